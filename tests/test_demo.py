"""``jaxaot demo``: a handful of steps, cold then warm; what it reports, and its errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxaot._store import _active
from jaxaot.cli import demo as cli_demo
from jaxaot.cli import main

TINY = ["--layers", "1", "--width", "32", "--seq", "16", "--batch", "4"]


def fields(out: str) -> dict[str, str]:
    """``name  value`` rows of the summary (the first of each name)."""
    rows: dict[str, str] = {}
    for line in out.splitlines()[1:]:
        name, _, value = line.strip().partition("  ")
        rows.setdefault(name, value.strip())
    return rows


def counts(text: str) -> dict[str, int]:
    """``{"hits": 3, "misses": 0, ...}`` from ``3 hits, 0 misses, ...``."""
    found = {}
    for part in text.split("(")[0].split(","):
        number, _, name = part.strip().partition(" ")
        found[name] = int(number)
    return found


def test_demo_cold_then_warm(subprocess_env: dict[str, str]) -> None:
    """The README's quick start: a run, then a warm one, each a fresh process."""
    env = dict(subprocess_env)
    cold = {k: v[0] for k, v in _demo(env, "--steps", "4").items()}
    assert cold["train step"] == "cold start: traced and compiled"
    assert cold["cache location"] == env["JAXAOT_CACHE_DIR"]
    first = counts(cold["persistent cache"])
    # A fresh directory: every look-up that reached it missed, and each entry was written.
    assert first["hits"] == 0 and first["misses"] > 0 and first["written"] == first["misses"]
    assert counts(cold["this process"])["compiles"] >= 1
    fleet = re.match(r"(\d+) entries made here, 0 made by other processes", cold["fleet"])
    assert fleet and int(fleet[1]) >= 1, cold["fleet"]
    ttfs = cold["time to first step"]
    assert re.match(r"\d+\.\d\d s since the process start: \d+\.\d\d s Python", ttfs), ttfs

    warm = {k: v[0] for k, v in _demo(env, "--steps", "4").items()}
    assert warm["train step"] == "warm start: loaded from the cache"
    # Default keys trace the body to find their key; nothing is lowered or compiled.
    here = counts(warm["this process"])
    assert here["lowerings"] == 0 and here["compiles"] == 0, here
    assert warm["fleet"].startswith("0 entries made here, 0 made by other processes")
    second = counts(warm["persistent cache"])
    assert second["hits"] > 0 and second["misses"] == 0 and second["written"] == 0
    assert "→" in warm["loss"] and warm["loss"] == cold["loss"]
    assert warm["steady step time"].endswith("(wall time per finished step, second half)")
    assert os.path.isdir(env["JAXAOT_CACHE_DIR"])


def test_demo_cold_flag_uses_no_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--cold after a warm run: no hits of any kind are reported, and nothing is
    read; with one step, it has no steady time to report."""
    assert main(["demo", "--steps", "3", *TINY, "--cache-dir", str(tmp_path / "c"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["demo", "--steps", "1", *TINY, "--cold", "--quiet"]) == 0
    out = fields(capsys.readouterr().out)
    assert out["cache location"] == "none (--cold)"
    assert out["persistent cache"].startswith("none")
    assert "hits" not in out["persistent cache"]
    assert out["train step"] == "cold start: traced and compiled"
    assert out["steady step time"] == "- (needs --steps 2 or more)"
    assert out["loss"].endswith("over 1 steps")


def test_demo_without_the_redis_package_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setenv("JAXAOT_CACHE", "redis://127.0.0.1:1/0")
    monkeypatch.setattr(_active, "_default", _active._UNSET)
    code = main(["demo", "--steps", "2", *TINY, "--quiet"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxaot: error: JAXAOT_CACHE=redis://"), err
    assert "jaxaot[redis]" in lines[0]


def test_demo_without_optax_names_the_demo_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """optax is the demo extra: without it, one line naming it, before anything runs."""
    monkeypatch.setitem(sys.modules, "optax", None)
    code = main(["demo", "--steps", "2", *TINY, "--dir", str(tmp_path / "c"), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxaot: error: jaxaot demo needs optax"), err
    assert 'pip install ".[demo]"' in lines[0]
    assert not (tmp_path / "c").exists()


def test_describe_names_the_tiers(tmp_path: Path) -> None:
    import jaxaot

    local = jaxaot.DirectoryCache(tmp_path / "local")
    tiered = jaxaot.TieredCache(jaxaot.MemoryCache(), local)
    assert cli_demo.describe(tiered) == f"tiers: memory (this process only) → {tmp_path}/local"
    assert cli_demo.describe(cli_demo.Counted(local)) == str(tmp_path / "local")
    assert cli_demo.describe(None) == "none"


def test_process_start_is_before_now() -> None:
    import time

    start = cli_demo.process_start()
    if sys.platform.startswith("linux"):
        assert start is not None
    if start is not None:
        assert start < time.perf_counter()


def test_a_process_start_far_from_the_import_is_not_the_clocks_origin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``/proc`` start time far before ``jaxaot.cli``'s import (clocks a sandbox
    keeps apart), or after it, is no process start: the demo's clock (and the edits
    suite's) then starts at the import."""
    import jaxaot.cli

    start = cli_demo.process_start()
    if not sys.platform.startswith("linux"):
        pytest.skip("the process start is read from /proc (Linux)")
    assert start is not None
    assert 0.0 <= jaxaot.cli.IMPORTED_AT - start <= cli_demo.STARTUP_MOST_S
    monkeypatch.setattr(jaxaot.cli, "IMPORTED_AT", start + cli_demo.STARTUP_MOST_S + 20.0)
    assert cli_demo.process_start() is None
    monkeypatch.setattr(jaxaot.cli, "IMPORTED_AT", start - 1.0)
    assert cli_demo.process_start() is None


def _demo(env: dict[str, str], *args: str) -> dict[str, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot", "demo", *TINY, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines()[1:]:
        name, _, value = line.strip().partition("  ")
        rows.setdefault(name, []).append(value.strip())
    return rows


def test_demo_over_a_shared_store_reports_each_tier(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The README's "Sharing a cache" flow: a fresh local tier each time, so the second
    run's hits come from the shared store."""
    pytest.importorskip("fsspec")
    store = f"file://{tmp_path}/shared"
    env = dict(subprocess_env, JAXAOT_CACHE=store, JAXAOT_CACHE_DIR=str(tmp_path / "local1"))
    first = _demo(env, "--steps", "2")
    assert first["cache location"] == [f"tiers: {tmp_path}/local1 → {store}"]
    assert counts(first["persistent cache"][0])["hits"] == 0
    assert len(first["tier"]) == 2
    for row in first["tier"]:
        assert counts(row.rpartition(": ")[2]) == {
            "hits": 0,
            "written": counts(row.rpartition(": ")[2])["written"],
        }
        assert counts(row.rpartition(": ")[2])["written"] > 0
    env["JAXAOT_CACHE_DIR"] = str(tmp_path / "local2")
    second = _demo(env, "--steps", "2")
    assert second["train step"] == ["warm start: loaded from the cache"]
    local, shared = second["tier"]
    assert local.startswith(f"{tmp_path}/local2: 0 hits")
    assert shared.startswith(f"{store}: ") and not shared.startswith(f"{store}: 0 hits")
    # Each verified hit of the store was copied into the fresh local tier (as
    # docs/sharing.md shows): as many written there as the store served.
    served = counts(shared.rpartition(": ")[2])["hits"]
    assert counts(local.rpartition(": ")[2])["written"] == served, second["tier"]


def test_a_damaged_entry_is_not_counted_as_a_hit() -> None:
    """The demo's counts: a sound entry read back is a hit; a damaged one (which
    jaxaot drops and makes again) and a missing one are misses."""
    from _helpers import make_blob

    import jaxaot

    counted = cli_demo.Counted(jaxaot.MemoryCache())
    key, blob = make_blob("sound")
    bad_key, bad = make_blob("damaged")
    counted.put(key, blob)
    counted.put(bad_key, bad[:-8] + bytes(8))
    counted.get(key)
    counted.get(bad_key)
    counted.get("00" * 32)
    assert (counted.hits, counted.misses, counted.puts) == (1, 2, 2)
