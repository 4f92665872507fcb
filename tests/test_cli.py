"""The ``jaxaot`` command line: ``jaxaot cache ...``, errors, help, widths, ``--version``."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jaxaot
from jaxaot import cli
from jaxaot._store import _entry
from jaxaot.cli import _output
from jaxaot.cli import cache as cli_cache


@jaxaot.component
def affine(x, w):
    return x @ w + 1.0


@jaxaot.component
def many(*xs):
    return sum(jnp.sum(x) for x in xs)


@jaxaot.component
def tree_fn(params, x):
    return {"y": jnp.tanh(params["w"] @ x) + params["b"][0], "n": jnp.sum(x)}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory with plain, vmap-derived and pytree-argument entries (made once)."""
    root = tmp_path_factory.mktemp("cli") / "template"
    with jaxaot.using_cache(jaxaot.DirectoryCache(root)):
        x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
        affine(x, w)
        jax.vmap(affine, in_axes=(0, None))(jnp.ones((5, 2, 3)), w)
        tree_fn({"w": jnp.ones((2, 3)), "b": (jnp.ones(2),)}, jnp.ones(3))
    jaxaot.wait_for_writes()  # executables are written in the background: finish before copying
    return root


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory with one entry of a component with 60 arguments (made once)."""
    root = tmp_path_factory.mktemp("cli") / "wide"
    with jaxaot.using_cache(jaxaot.DirectoryCache(root)):
        many(*[jnp.ones((i + 1, 7)) for i in range(60)])
    jaxaot.wait_for_writes()
    return root


@pytest.fixture
def cache_dir(template: Path, tmp_path: Path) -> Path:
    """A private copy of the template cache."""
    root = tmp_path / "c"
    shutil.copytree(template, root)
    return root


def headers(root: Path) -> dict[str, dict[str, Any]]:
    cache = jaxaot.DirectoryCache(root)
    return {k: _entry.verify(cache.path_for(k).read_bytes())[0] for k in cache.keys()}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("jaxaot: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], err


def set_mtimes(root: Path, times: dict[str, float]) -> None:
    cache = jaxaot.DirectoryCache(root)
    for key, t in times.items():
        os.utime(cache.path_for(key), (t, t))


def corrupt(root: Path, key: str) -> None:
    path = jaxaot.DirectoryCache(root).path_for(key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# -- ls --------------------------------------------------------------------------


def test_template_has_the_expected_entries(cache_dir: Path) -> None:
    hs = headers(cache_dir)
    names = {h["name"] for h in hs.values()}
    assert names == {"affine", "tree_fn"}
    transforms = [dict(h["key"])["transform"] for h in hs.values()]
    assert any(t and t[0][0] == "vmap" for t in transforms)


def test_ls_table(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "cache", "ls", "--wide", "--dir", str(cache_dir))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["NAME", "TRANSFORM", "KIND", "SIGNATURE"]
    assert not any(ch in out for ch in "│┃━─\x1b")  # plain text when piped
    hs = headers(cache_dir)
    assert len(lines) == 1 + len(hs)
    cache = jaxaot.DirectoryCache(cache_dir)
    for key, h in hs.items():
        (row,) = [line for line in lines if key[:12] in line]
        assert row.startswith(h["name"])
        assert h["signature"] in row  # --wide: whole
        assert _output.human_bytes(cache.path_for(key).stat().st_size) in row
        transform = dict(h["key"])["transform"]
        assert f"  {cli_cache.short_transform(transform)}  " in row
        kind = "executable" if "executable" in dict(h["sections"]) else "stablehlo"
        assert f"  {kind}  " in row
    vmap_rows = [line for line in lines if "  vmap(0,-)  " in line]
    assert vmap_rows and all("float32[5,2,3]" in r for r in vmap_rows)
    assert any("'b'" not in line and "float32[2,3]" in line for line in lines)


def test_ls_piped_lines_are_bounded(wide_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A component with 60 arguments: its signature is cut when piped, whole with --wide."""
    root = wide_dir
    h = next(iter(headers(root).values()))
    assert len(h["signature"]) > 500
    code, out, _ = run(capsys, "cache", "ls", "--dir", str(root))
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 170, out
    assert "…" in out and h["signature"] not in out
    code, out, _ = run(capsys, "cache", "ls", "--wide", "--dir", str(root))
    assert code == 0 and h["signature"] in out
    rows = run_json(capsys, "cache", "ls", "--dir", str(root))
    assert {r["signature"] for r in rows} == {h["signature"]}


@pytest.mark.parametrize("width", [80, 100, 120, 150])
def test_ls_fits_the_terminal(
    wide_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    width: int,
) -> None:
    """On a terminal every column shown has its header and cells whole (names and
    signatures cut with an ellipsis), the lines fit, and the columns left out to fit
    are named; from the widest terminal down, the flops and the platforms go first,
    the digest (what ``cache info`` takes) late."""
    root = wide_dir
    monkeypatch.setattr(_output, "is_terminal", lambda stream: True)
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, _ = run(capsys, "cache", "ls", "--dir", str(root))
    assert code == 0 and "many" in out
    assert width < 120 or "float32[1,7]" in out
    body = [line for line in out.splitlines() if "│" in line]
    assert len(body) == len(headers(root)), out  # one row per entry: no wrapping
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert max(len(line) for line in plain.splitlines()) <= width, plain
    header = next(line for line in plain.splitlines() if "NAME" in line)
    shown = [cell.strip() for cell in header.strip("┃ ").split("┃")]
    every = ["NAME", "TRANSFORM", "KIND", "SIGNATURE", "PLATFORMS", "SIZE", "HITS"]
    every += ["LAST USED", "FLOPS", "DIGEST"]
    assert shown == [h for h in every if h in shown], shown  # whole headers, in order
    assert {"NAME", "SIGNATURE", "SIZE", "LAST USED"} <= set(shown), shown
    give_way = ["FLOPS", "PLATFORMS", "HITS", "KIND", "TRANSFORM", "DIGEST", "LAST USED"]
    hidden = [h for h in give_way if h not in shown]
    assert hidden == give_way[: len(hidden)], hidden  # the least telling columns go first
    caption = " ".join(plain.split())
    if hidden:
        said = f"not shown to fit the terminal: {', '.join(hidden)} (--wide shows all)"
        assert said in caption, caption
    for line in body:  # the size column's cells are whole (a unit, never an ellipsis)
        cells = [c.strip() for c in re.sub(r"\x1b\[[0-9;]*m", "", line).strip("│ ").split("│")]
        size = cells[shown.index("SIZE")]
        assert re.fullmatch(r"[0-9.]+ (B|KiB|MiB|GiB)", size), (size, line)
    if width <= 100:
        assert hidden, plain


def test_clip_keeps_both_ends_of_a_signature() -> None:
    sig = "(" + ", ".join(f"float32[{i},7]" for i in range(60)) + ")"
    cut = _output.clip(sig, 48, middle=True)
    assert len(cut) <= 48 and cut.startswith("(float32[0,7], ") and cut.endswith(", float32[59,7])")
    assert ", …, " in cut
    assert _output.clip(sig, 20) == sig[:19] + "…"
    assert _output.clip("(int32[])", 48, middle=True) == "(int32[])"
    assert _output.clip("abcdefghijklmnop", 10, middle=True) == "abcdefghi…"


def test_distinct_entries_have_distinct_labels() -> None:
    forward = [["linearize", [True, False], "forward"]]
    linear = [["linearize", [True, False], "linear"]]
    back = [*linear, ["transpose", [False, True]]]
    labels = [cli_cache.short_transform(t) for t in (forward, linear, back, [], None)]
    assert labels == [
        "linearize:forward",
        "linearize:linear",
        "linearize:linear+transpose",
        "-",
        "-",
    ]
    assert cli_cache.short_transform([["vmap", [0, None], 5]]) == "vmap(0,-)"
    assert cli_cache.short_transform([["vmap", [None, 1], 5]]) == "vmap(-,1)"


def test_ls_labels_every_entry_of_a_gradient_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "grad"
    with jaxaot.using_cache(jaxaot.DirectoryCache(root)):
        x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
        jax.grad(lambda w: affine(x, w).sum())(w)
    rows = run_json(capsys, "cache", "ls", "--dir", str(root))
    labels = [(r["name"], r["transform"], r["kind"], r["signature"]) for r in rows]
    assert len(labels) == len(set(labels)) >= 3, labels


def test_ls_json_fields(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(capsys, "cache", "ls", "--dir", str(cache_dir))
    hs = headers(cache_dir)
    cache = jaxaot.DirectoryCache(cache_dir)
    assert {r["digest"] for r in rows} == set(hs)
    for r in rows:
        h = hs[r["digest"]]
        assert len(r["digest"]) == 64
        assert r["ok"] is True and r["error"] is None
        assert r["name"] == h["name"]
        assert r["signature"] == h["signature"]
        assert r["platforms"] == h["platforms"]
        assert r["size"] == cache.path_for(r["digest"]).stat().st_size
        assert r["hits"] == 0
        assert r["last_used"] == pytest.approx(cache.access_time(r["digest"]))
        assert r["created"] == h["created"]
        assert r["sections"] == {name: size for name, size in h["sections"]}
        assert r["executable"] == ("executable" in r["sections"])
        flops = h["extra"].get("cost_analysis", {}).get("flops")
        assert r["flops"] == flops
        t = dict(h["key"])["transform"]
        assert r["transform"] == cli_cache.short_transform(t)
        assert r["kind"] == ("executable" if r["executable"] else "stablehlo")
    assert any(r["transform"] == "vmap(0,-)" for r in rows)


def test_jaxaot_jit_programs_are_listed_and_exported_by_their_function(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``jaxaot.jit`` function's programs (glue, served whole) are named after
    it, so that ``cache export --component`` finds them by its name."""
    cache_dir = tmp_path / "cache"

    @jaxaot.jit
    def predict(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w).sum()

    with jaxaot.using_cache(jaxaot.DirectoryCache(cache_dir)):
        predict(jnp.ones((3, 4)), jnp.ones((4, 2)))
        jaxaot.wait_for_writes()
    rows = run_json(capsys, "cache", "ls", "--dir", str(cache_dir))
    assert [(r["name"], r["transform"]) for r in rows] == [("predict", "whole program")], rows
    out = tmp_path / "predict.jxb"
    assert (
        cli.main(["cache", "export", "--dir", str(cache_dir), "--component", "predict", str(out)])
        == 0
    )
    assert "exported 1 entry" in capsys.readouterr().out


def test_cache_takes_what_precompile_took(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cache SPEC`` (what ``jaxaot precompile --cache`` takes, the next command a
    user types after it) names a directory, or a URL when it has a scheme."""
    want = {r["digest"] for r in run_json(capsys, "cache", "ls", "--dir", str(cache_dir))}
    assert want
    got = {r["digest"] for r in run_json(capsys, "cache", "ls", "--cache", str(cache_dir))}
    assert got == want
    as_url = run_json(capsys, "cache", "ls", "--cache", f"file://{cache_dir}")
    assert {r["digest"] for r in as_url} == want
    code, _, err = run(capsys, "cache", "ls", "--cache", str(cache_dir / "nothing"))
    assert code == 1
    assert_one_line_error(err, f"no such directory: {cache_dir / 'nothing'}")


def test_ls_sorting(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = sorted(headers(cache_dir))
    now = time.time()
    set_mtimes(cache_dir, {k: now - 1000 * (i + 1) for i, k in enumerate(keys)})
    cache = jaxaot.DirectoryCache(cache_dir)
    cache.get(keys[-1])  # hits; a get also refreshes the access time
    cache.get(keys[-1])
    cache.get(keys[1])
    set_mtimes(cache_dir, {keys[-1]: now, keys[1]: now - 10})  # the oldest is now the newest

    d = ["--dir", str(cache_dir)]
    by_default = [r["digest"] for r in run_json(capsys, "cache", "ls", *d)]
    assert by_default == [keys[-1], keys[1], keys[0], *keys[2:-1]]

    by_name = [r["name"] for r in run_json(capsys, "cache", "ls", "--sort", "name", *d)]
    assert by_name == sorted(by_name, key=str.lower)

    sizes = [r["size"] for r in run_json(capsys, "cache", "ls", "--sort", "size", *d)]
    assert sizes == sorted(sizes, reverse=True)

    by_hits = run_json(capsys, "cache", "ls", "--sort", "hits", *d)
    assert [r["hits"] for r in by_hits[:2]] == [2, 1]
    assert [r["digest"] for r in by_hits[:2]] == [keys[-1], keys[1]]


def test_ls_reads_without_counting_hits(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = jaxaot.DirectoryCache(cache_dir)
    old = time.time() - 5000
    set_mtimes(cache_dir, dict.fromkeys(cache.keys(), old))
    for _ in range(2):
        run(capsys, "cache", "ls", "--dir", str(cache_dir))
        run(capsys, "cache", "verify", "--dir", str(cache_dir))
    for key in cache.keys():
        assert cache.hit_count(key) == 0
        assert cache.access_time(key) == pytest.approx(old)


def test_ls_lists_bad_entries(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = sorted(headers(cache_dir))[0]
    corrupt(cache_dir, key)
    code, out, _ = run(capsys, "cache", "ls", "--dir", str(cache_dir))
    assert code == 0
    (row,) = [line for line in out.splitlines() if key[:12] in line]
    assert row.startswith("<bad entry>") and "checksum mismatch" in row
    rows = run_json(capsys, "cache", "ls", "--dir", str(cache_dir))
    (bad,) = [r for r in rows if not r["ok"]]
    assert bad["digest"] == key and bad["name"] == "<bad entry>" and "checksum" in bad["error"]


def test_ls_rich_table_on_a_terminal(
    cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_output, "is_terminal", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(capsys, "cache", "ls", "--dir", str(cache_dir))
    assert code == 0
    assert "affine" in out and "tree_fn" in out and "float32[5,2,3]" in out
    assert any(ch in out for ch in "│┃━─")


def test_ls_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jaxaot.DirectoryCache(tmp_path / "empty")
    code, out, _ = run(capsys, "cache", "ls", "--dir", str(tmp_path / "empty"))
    assert code == 0 and "no entries" in out
    assert run_json(capsys, "cache", "ls", "--dir", str(tmp_path / "empty")) == []


# -- info ------------------------------------------------------------------------


def test_info_by_prefix(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hs = headers(cache_dir)
    key, h = next((k, h) for k, h in hs.items() if h["name"] == "tree_fn")
    code, out, err = run(capsys, "cache", "info", key[:8].upper(), "--dir", str(cache_dir))
    assert code == 0, err
    assert key in out and "tree_fn" in out
    for name in dict(h["key"]):
        assert any(line.strip().startswith(name) for line in out.splitlines()), name
    for section, size in h["sections"]:
        assert section in out and f"({size} bytes)" in out
    assert "jax_default_matmul_precision" in out  # config key parts, one per line
    assert "params['w']" in out and "float32[2,3]" in out  # argument names with avals
    assert "result['y']" in out  # result paths
    assert "host callbacks" in out and "created" in out and "jaxlib" in out
    for line in ("versions:", "key parts:", "sections:", "arguments (3):", "results (2):"):
        assert line in out.splitlines()


def test_info_json(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hs = headers(cache_dir)
    key = next(k for k, h in hs.items() if dict(h["key"])["transform"])
    data = run_json(capsys, "cache", "info", key[:10], "--dir", str(cache_dir))
    h = hs[key]
    assert data["digest"] == key
    assert data["key_parts"] == dict(h["key"])
    assert data["transform"] == "vmap(0,-)"
    assert data["arg_names"] == h["arg_names"] and data["result_paths"] == h["result_paths"]
    assert data["in_avals"] == h["in_avals"] and data["out_avals"] == h["out_avals"]
    assert data["versions"] == {"jax": h["jax"], "jaxlib": h["jaxlib"]}
    assert data["extra"] == h["extra"] and data["host_callbacks"] is False
    assert data["path"] == str(jaxaot.DirectoryCache(cache_dir).path_for(key))


def test_info_shows_the_cost_figures_people_read(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An executable entry's cost analysis: flops, transcendentals, bytes accessed and
    optimal seconds; the per-operand figures only under --json."""
    hs = headers(cache_dir)
    # (In key order: the directory's listing order differs between file systems.)
    key, h = next((k, h) for k, h in sorted(hs.items()) if h["extra"].get("cost_analysis"))
    cost = h["extra"]["cost_analysis"]
    code, out, _ = run(capsys, "cache", "info", key[:12], "--dir", str(cache_dir))
    assert code == 0
    lines = out.splitlines()
    start = lines.index("cost analysis (XLA's estimate):")
    block = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        block.append(line.strip())
    shown = [line.split("  ")[0] for line in block]
    expected = [n for n in ("flops", "transcendentals", "bytes accessed") if n in cost]
    assert shown[: len(expected)] == expected
    assert block[0].split() == ["flops", _output.human_count(cost["flops"])]
    assert "executable_in_tree" not in out  # an internal detail: --json only
    raw = [k for k in cost if k not in ("flops", "transcendentals", "bytes accessed")]
    assert raw and not any(k in out for k in raw)  # no raw 'bytes accessed0{}' keys
    # One screen: the executable's placement parts (inputs, mesh, process) included.
    assert len(lines) < 66, out
    data = run_json(capsys, "cache", "info", key[:12], "--dir", str(cache_dir))
    assert data["extra"]["cost_analysis"] == cost


def test_info_cuts_long_values(wide_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = wide_dir
    key = next(iter(headers(root)))
    code, out, _ = run(capsys, "cache", "info", key[:8], "--dir", str(root))
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 160, out
    assert "arguments (60):" in out and "more" in out and "--json" in out
    data = run_json(capsys, "cache", "info", key[:8], "--dir", str(root))
    assert len(data["in_avals"]) == 60


def test_info_ambiguous_unknown_and_invalid_keys(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = sorted(headers(cache_dir))[0]
    twin = key[:4] + ("0" if key[4] != "0" else "1") * 60
    (cache_dir / key[:2] / twin).write_bytes(b"not an entry")
    d = ["--dir", str(cache_dir)]

    code, _, err = run(capsys, "cache", "info", key[:4], *d)
    assert code == 1
    assert_one_line_error(err, "ambiguous", key[:4], "give more digits")

    # A longer prefix and the full key pick one entry again.
    assert run(capsys, "cache", "info", key[:6], *d)[0] == 0
    assert run(capsys, "cache", "info", key, *d)[0] == 0

    # The planted file is an entry too: info reports it as damaged.
    code, out, _ = run(capsys, "cache", "info", twin, *d)
    assert code == 1 and "entry too short" in out

    keys = jaxaot.DirectoryCache(cache_dir).keys()
    unknown = next(
        p for p in (f"{i:04x}" for i in range(1 << 16)) if not any(k.startswith(p) for k in keys)
    )
    code, _, err = run(capsys, "cache", "info", unknown, *d)
    assert code == 1  # not a usage error: no such entry
    assert_one_line_error(err, "no entry matches")

    for bad in ("abc", "zzzz1234"):
        code, _, err = run(capsys, "cache", "info", bad, *d)
        assert code == 2  # a usage error, with a pointer to the command's help
        assert_one_line_error(err, "invalid key", "'jaxaot cache info --help'")


# -- stats -----------------------------------------------------------------------


def test_stats_numbers_match(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = jaxaot.DirectoryCache(cache_dir)
    expected = cache.stats()
    total = sum(cache.path_for(k).stat().st_size for k in cache.keys())
    assert expected["bytes"] == total
    cache.get(cache.keys()[0])

    data = run_json(capsys, "cache", "stats", "--dir", str(cache_dir))
    assert data["entries"] == expected["entries"] == len(cache.keys())
    assert data["bytes"] == total
    assert data["max_bytes"] == expected["max_bytes"]
    assert data["path"] == str(cache_dir.resolve())
    assert data["recorded_hits"] == 1

    code, out, _ = run(capsys, "cache", "stats", "--dir", str(cache_dir))
    assert code == 0
    fields = {line[:14].strip(): line[14:].strip() for line in out.splitlines()}
    assert fields["entries"] == str(expected["entries"])
    assert f"({total} bytes)" in fields["total"]
    assert f"({expected['max_bytes']} bytes" in fields["cap"]
    assert fields["path"] == str(cache_dir.resolve())
    assert fields["recorded hits"] == "1"


def test_stats_cap_from_env(
    cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAXAOT_CACHE_MAX_BYTES", "123456")
    assert run_json(capsys, "cache", "stats", "--dir", str(cache_dir))["max_bytes"] == 123456


def test_stats_leaves_out_this_process_counters(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counters = set(jaxaot.DirectoryCache(cache_dir).stats()) - {"path", "backend", "entries"}
    counters -= {"bytes", "other_bytes", "max_bytes", "temp_files"}
    assert {"hits", "misses"} <= counters  # what the backend counts in this process
    data = run_json(capsys, "cache", "stats", "--dir", str(cache_dir))
    assert not counters & set(data), data
    assert data["temp_files"] == 0  # what the store itself reports stays
    code, out, _ = run(capsys, "cache", "stats", "--dir", str(cache_dir))
    assert code == 0 and "backend stats" not in out
    names = [line[:14].strip() for line in out.splitlines()]
    assert "hits" not in names and "misses" not in names and "temp files" in names


# -- verify ----------------------------------------------------------------------


def test_verify_clean_corrupt_and_fix(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ["--dir", str(cache_dir)]
    n = len(headers(cache_dir))
    code, out, _ = run(capsys, "cache", "verify", *d)
    assert code == 0 and f"{n} ok, 0 bad" in out

    key = sorted(headers(cache_dir))[1]
    corrupt(cache_dir, key)
    code, out, _ = run(capsys, "cache", "verify", *d)
    assert code == 1
    assert key[:12] in out and "checksum mismatch" in out and f"{n - 1} ok, 1 bad" in out
    assert jaxaot.DirectoryCache(cache_dir).path_for(key).exists()

    code, out, _ = run(capsys, "cache", "verify", "--json", *d)
    report = json.loads(out)
    assert code == 1
    assert report["ok"] == n - 1 and report["bad"][0]["digest"] == key

    code, out, _ = run(capsys, "cache", "verify", "--fix", *d)
    assert code == 0
    assert "quarantined" in out and "1 removed" in out
    assert not jaxaot.DirectoryCache(cache_dir).path_for(key).exists()
    assert any(p.name.startswith(key) for p in (cache_dir / "quarantine").iterdir())

    code, out, _ = run(capsys, "cache", "verify", *d)
    assert code == 0 and f"{n - 1} ok, 0 bad" in out


def test_verify_detects_an_entry_under_the_wrong_key(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = sorted(headers(cache_dir))[:2]
    cache = jaxaot.DirectoryCache(cache_dir)
    cache.path_for(a).write_bytes(cache.path_for(b).read_bytes())
    code, out, _ = run(capsys, "cache", "verify", "--dir", str(cache_dir))
    assert code == 1 and a[:12] in out and "wrong key" in out


def test_verify_skips_other_format_versions(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = sorted(headers(cache_dir))[0]
    path = jaxaot.DirectoryCache(cache_dir).path_for(key)
    data = bytearray(path.read_bytes())
    data[8:10] = (_entry.ENTRY_FORMAT_VERSION + 1).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    code, out, _ = run(capsys, "cache", "verify", "--fix", "--dir", str(cache_dir))
    assert code == 0 and "1 of another entry format" in out
    assert path.exists()
    rows = run_json(capsys, "cache", "ls", "--dir", str(cache_dir))
    assert "format version" in next(r["error"] for r in rows if r["digest"] == key)


def test_verify_with_hmac_reports_unsigned_entries(
    cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    n = len(headers(cache_dir))
    monkeypatch.setenv(_entry.HMAC_ENV, "sekrit")
    code, out, _ = run(capsys, "cache", "verify", "--dir", str(cache_dir))
    assert code == 1
    assert "signatures" in out and f"0 ok, {n} bad" in out
    assert out.count("signature mismatch") == n


def _sign_all(root: Path, monkeypatch: pytest.MonkeyPatch, secret: str) -> None:
    """Re-writes every entry of ``root`` signed with ``secret``."""
    cache = jaxaot.DirectoryCache(root)
    for key in cache.keys():
        path = cache.path_for(key)
        entry = _entry.decode(path.read_bytes())
        with monkeypatch.context() as m:
            m.setenv(_entry.HMAC_ENV, secret)
            path.write_bytes(_entry.encode(entry))


@pytest.mark.parametrize("key", [None, "another key"], ids=["no-key", "another-key"])
def test_verify_fix_leaves_entries_signed_with_another_key(
    key: str | None,
    cache_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process without the cache's key (or with another) cannot check its entries:
    ``verify --fix`` reports them and leaves them, unless ``--force``."""
    n = len(headers(cache_dir))
    _sign_all(cache_dir, monkeypatch, "the cache's key")
    before = {p: p.read_bytes() for p in cache_dir.rglob("*") if p.is_file()}
    if key is None:
        monkeypatch.delenv(_entry.HMAC_ENV, raising=False)
    else:
        monkeypatch.setenv(_entry.HMAC_ENV, key)
    code, out, _ = run(capsys, "cache", "verify", "--fix", "--dir", str(cache_dir))
    assert code == 1 and f"0 ok, {n} bad, 0 removed" in out, out
    assert out.count("left alone (--force)") == n
    assert {p: p.read_bytes() for p in cache_dir.rglob("*") if p.is_file()} == before
    code, out, _ = run(capsys, "cache", "verify", "--fix", "--json", "--dir", str(cache_dir))
    report = json.loads(out)
    assert code == 1 and [b["removable"] for b in report["bad"]] == [False] * n
    # The key's holder still has a sound cache.
    monkeypatch.setenv(_entry.HMAC_ENV, "the cache's key")
    code, out, _ = run(capsys, "cache", "verify", "--dir", str(cache_dir))
    assert code == 0 and f"{n} ok, 0 bad" in out
    # --force removes them for a process that means it.
    if key is not None:
        monkeypatch.setenv(_entry.HMAC_ENV, key)
    else:
        monkeypatch.delenv(_entry.HMAC_ENV)
    code, out, _ = run(capsys, "cache", "verify", "--fix", "--force", "--dir", str(cache_dir))
    assert f"{n} removed" in out and code == 0, out
    assert jaxaot.DirectoryCache(cache_dir).keys() == []


def test_verify_force_needs_fix(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "cache", "verify", "--force", "--dir", str(cache_dir))
    assert code != 0
    assert_one_line_error(err, "--force")


def test_import_exits_non_zero_when_the_cache_did_not_store_everything(
    cache_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bundle = tmp_path / "b.jaxaot"
    code, _, _ = run(capsys, "cache", "export", str(bundle), "--dir", str(cache_dir))
    assert code == 0
    small = tmp_path / "small"
    monkeypatch.setenv("JAXAOT_CACHE_MAX_BYTES", "1K")  # smaller than any entry
    code, out, _ = run(capsys, "cache", "import", str(bundle), "--dir", str(small))
    assert code == 1, out
    assert "are not in" in out
    code, out, _ = run(capsys, "cache", "import", str(bundle), "--json", "--dir", str(small))
    report = json.loads(out)
    assert code == 1 and report["complete"] is False and report["not_stored"]
    monkeypatch.delenv("JAXAOT_CACHE_MAX_BYTES")
    code, out, _ = run(capsys, "cache", "import", str(bundle), "--dir", str(tmp_path / "big"))
    assert code == 0 and "are not in" not in out


def test_cli_errors_never_show_a_redis_password(capsys: pytest.CaptureFixture[str]) -> None:
    url = "redis://:hunter2-secret@127.0.0.1:1/0"
    code, out, err = run(capsys, "cache", "ls", "--url", url)
    assert code != 0
    assert "hunter2-secret" not in out + err


# -- prune -----------------------------------------------------------------------


def test_prune_by_size(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = jaxaot.DirectoryCache(cache_dir)
    keys = sorted(cache.keys())
    now = time.time()
    set_mtimes(cache_dir, {k: now - 100 * (i + 1) for i, k in enumerate(keys)})  # keys[0] newest
    sizes = {k: cache.path_for(k).stat().st_size for k in keys}
    limit = sizes[keys[0]] + sizes[keys[1]]

    code, out, _ = run(
        capsys, "cache", "prune", "--max-bytes", str(limit), "--dry-run", "--dir", str(cache_dir)
    )
    assert code == 0 and f"would remove {len(keys) - 2} entries" in out
    assert sorted(cache.keys()) == keys

    code, out, _ = run(
        capsys, "cache", "prune", "--max-bytes", str(limit), "-v", "--dir", str(cache_dir)
    )
    assert code == 0
    removed = sum(sizes[k] for k in keys[2:])
    assert f"removed {len(keys) - 2} entries ({_output.human_bytes(removed)})" in out
    assert sorted(cache.keys()) == keys[:2]
    assert all(k[:12] in out for k in keys[2:])

    code, out, _ = run(capsys, "cache", "prune", "--max-bytes", "1M", "--dir", str(cache_dir))
    assert code == 0 and "removed 0 entries" in out and sorted(cache.keys()) == keys[:2]
    run(capsys, "cache", "prune", "--max-bytes", "0", "--dir", str(cache_dir))
    assert cache.keys() == []


def test_prune_by_age(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = jaxaot.DirectoryCache(cache_dir)
    keys = sorted(cache.keys())
    old = keys[:2]
    set_mtimes(cache_dir, dict.fromkeys(old, time.time() - 10 * 86400))
    set_mtimes(cache_dir, dict.fromkeys(keys[2:], time.time() - 3 * 86400))
    code, out, _ = run(capsys, "cache", "prune", "--older-than", "7d", "--dir", str(cache_dir))
    assert code == 0 and "removed 2 entries" in out
    assert sorted(cache.keys()) == keys[2:]
    code, out, _ = run(capsys, "cache", "prune", "--older-than", "2d", "--dir", str(cache_dir))
    assert code == 0 and cache.keys() == []


def test_prune_removes_the_notes_of_what_it_removed(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A warm start's notes (one index per signature) go with their entries once
    they are old, as the entries they name are pruned."""
    cache = jaxaot.DirectoryCache(cache_dir)
    for i, k in enumerate(sorted(cache.keys())):
        cache.note(f"{i:02x}" * 16, k, b"noted")
    indexes = list(cache_dir.glob("*/*.index"))
    assert indexes
    long_ago = time.time() - 10 * 86400
    for path in indexes:
        os.utime(path, (long_ago, long_ago))
    code, _, _ = run(capsys, "cache", "prune", "--max-bytes", "0", "--dir", str(cache_dir))
    assert code == 0 and cache.keys() == []
    assert list(cache_dir.glob("*/*.index")) == []


def test_prune_older_than_a_bare_number_removes_nothing(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = sorted(jaxaot.DirectoryCache(cache_dir).keys())
    set_mtimes(cache_dir, dict.fromkeys(keys, time.time() - 30))  # made seconds ago
    code, _, err = run(capsys, "cache", "prune", "--older-than", "2", "--dir", str(cache_dir))
    assert code == 2
    assert_one_line_error(err, "invalid duration '2'", "give a unit", "2d")
    assert sorted(jaxaot.DirectoryCache(cache_dir).keys()) == keys
    code, out, _ = run(capsys, "cache", "prune", "--older-than", "2d", "--dir", str(cache_dir))
    assert code == 0 and "removed 0 entries" in out
    assert sorted(jaxaot.DirectoryCache(cache_dir).keys()) == keys


def _on_a_terminal(argv: list[str], answer: str, env: dict[str, str]) -> tuple[int, str]:
    """Runs ``python -m jaxaot ARGV`` with a real pseudo-terminal as stdin, answers
    ``answer`` to whatever it asks, and returns its exit status and output."""
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxaot", *argv],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        os.write(master, (answer + "\n").encode())  # kept by the terminal until read
        out, _ = proc.communicate(timeout=120)
    finally:
        os.close(slave)
        os.close(master)
    return proc.returncode, out


@pytest.mark.skipif(os.name != "posix", reason="pseudo-terminals")
def test_prune_asks_on_a_real_terminal(cache_dir: Path, subprocess_env: dict[str, str]) -> None:
    keys = sorted(jaxaot.DirectoryCache(cache_dir).keys())
    set_mtimes(cache_dir, dict.fromkeys(keys[:2], time.time() - 10 * 86400))
    argv = ["cache", "prune", "--older-than", "7d", "--dir", str(cache_dir)]
    code, out = _on_a_terminal(argv, "n", subprocess_env)
    assert code == 1, out
    assert (
        "Remove 2 entries (" in out and f"of {len(keys)} from {cache_dir.resolve()}? [y/N]" in out
    )
    assert "nothing removed" in out
    assert sorted(jaxaot.DirectoryCache(cache_dir).keys()) == keys
    code, out = _on_a_terminal(argv, "y", subprocess_env)
    assert code == 0 and "removed 2 entries" in out, out
    assert sorted(jaxaot.DirectoryCache(cache_dir).keys()) == keys[2:]


@pytest.mark.skipif(os.name != "posix", reason="pseudo-terminals")
def test_prune_yes_and_scripts_do_not_ask(cache_dir: Path, subprocess_env: dict[str, str]) -> None:
    keys = sorted(jaxaot.DirectoryCache(cache_dir).keys())
    set_mtimes(cache_dir, dict.fromkeys(keys[:1], time.time() - 10 * 86400))
    set_mtimes(cache_dir, dict.fromkeys(keys[1:2], time.time() - 5 * 86400))
    code, out = _on_a_terminal(
        ["cache", "prune", "--older-than", "7d", "--yes", "--dir", str(cache_dir)],
        "n",
        subprocess_env,
    )
    assert code == 0 and "removed 1 entry" in out and "[y/N]" not in out, out
    # stdin not a terminal (a pipe that never answers): no prompt, no hang
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot", "cache", "prune", "--older-than", "4d"]
        + ["--dir", str(cache_dir)],
        stdin=subprocess.PIPE,
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert proc.returncode == 0 and "removed 1 entry" in proc.stdout, proc.stdout + proc.stderr
    assert "[y/N]" not in proc.stdout
    assert sorted(jaxaot.DirectoryCache(cache_dir).keys()) == keys[2:]


@pytest.mark.parametrize("where", ["a shard", "the root"])
def test_commands_on_a_cache_this_user_cannot_list_fail_and_say_so(
    cache_dir: Path, subprocess_env: dict[str, str], where: str
) -> None:
    """A cache directory (or a shard of it) of another user (uid 65534, mode
    0700), read by root without its power to override permissions: listing,
    checking, clearing and pruning would pass over its entries and report
    success; each command fails with one line that names the directory, and the
    entries are all still there."""
    import _helpers

    _helpers.need_root()
    keys = sorted(jaxaot.DirectoryCache(cache_dir).keys())
    locked = cache_dir / keys[0][:2] if where == "a shard" else cache_dir
    for path in [locked, *locked.rglob("*")]:
        os.chown(path, _helpers.OTHER_UID, _helpers.OTHER_UID)
    locked.chmod(0o700)
    unprivileged = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    for command in (["ls"], ["stats"], ["verify", "--fix"], ["clear", "--yes"]):
        proc = subprocess.run(
            [*unprivileged, sys.executable, "-m", "jaxaot", "cache", *command]
            + ["--dir", str(cache_dir)],
            capture_output=True,
            text=True,
            env=subprocess_env,
            timeout=120,
        )
        assert proc.returncode == 1, (command, proc.stdout, proc.stderr)
        # (A root of another user's is refused before it is listed: it is not trusted.)
        assert_one_line_error(proc.stderr, "cannot list" if where == "a shard" else "65534")
        assert str(locked) in proc.stderr, proc.stderr
    for path in [locked, *locked.rglob("*")]:
        os.chown(path, 0, 0)
    assert sorted(jaxaot.DirectoryCache(cache_dir).keys()) == keys


def test_prune_needs_a_limit(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "cache", "prune", "--dir", str(cache_dir))
    assert code == 2
    assert_one_line_error(err, "--max-bytes")
    for bad in (["--max-bytes", "12Q"], ["--older-than", "3 fortnights"]):
        code, _, err = run(capsys, "cache", "prune", *bad, "--dir", str(cache_dir))
        assert code == 2
        assert_one_line_error(err, "invalid")


def test_parse_sizes_and_durations() -> None:
    assert _output.parse_size("1234") == 1234
    assert _output.parse_size("500M") == 500 * 2**20
    assert (
        _output.parse_size("2G")
        == _output.parse_size("2GiB")
        == _output.parse_size("2 gb")
        == 2 << 30
    )
    assert _output.parse_size("1.5k") == 1536
    assert _output.parse_duration("30s") == 30
    assert _output.parse_duration("15m") == 900
    assert _output.parse_duration("12h") == 12 * 3600
    assert _output.parse_duration("7d") == 7 * 86400
    assert _output.parse_duration("2w") == 14 * 86400
    with pytest.raises(argparse.ArgumentTypeError, match="give a unit"):
        _output.parse_duration("90")  # seconds to `sleep`, days to `find -mtime`: refused
    assert _output.human_bytes(880) == "880 B"
    assert _output.human_bytes(1536) == "1.5 KiB"
    assert _output.human_bytes(3 << 30) == "3.0 GiB"
    now = 1_000_000.0
    assert _output.human_time(now - 30, now) == "30s ago"
    assert _output.human_time(now - 7200, now) == "2h ago"
    assert _output.human_time(now - 3 * 86400, now) == "3d ago"


# -- clear -----------------------------------------------------------------------


def test_clear_with_yes(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n = len(headers(cache_dir))
    code, out, _ = run(capsys, "cache", "clear", "--yes", "--dir", str(cache_dir))
    assert code == 0 and f"removed {n} entries" in out
    assert jaxaot.DirectoryCache(cache_dir).keys() == []
    code, out, _ = run(capsys, "cache", "clear", "--dir", str(cache_dir))
    assert code == 0 and "no entries" in out


def test_clear_of_a_cache_in_use_counts_only_what_it_removed(
    cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry a running process writes while clear runs is not one it failed
    to remove: clear succeeds and says the new entry arrived meanwhile."""
    from _helpers import make_blob

    n = len(headers(cache_dir))
    original = jaxaot.DirectoryCache.clear

    def clear_while_written(self: jaxaot.DirectoryCache) -> None:
        original(self)
        self.put(*make_blob("written-meanwhile"))  # (a training process's new entry)

    monkeypatch.setattr(jaxaot.DirectoryCache, "clear", clear_while_written)
    code, out, _ = run(capsys, "cache", "clear", "--yes", "--dir", str(cache_dir))
    assert code == 0 and f"removed {n} entries" in out, out
    assert "1 entry written meanwhile by a running process" in out, out
    assert len(jaxaot.DirectoryCache(cache_dir).keys()) == 1


def test_clear_refuses_without_a_terminal(
    cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    n = len(headers(cache_dir))
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, _, err = run(capsys, "cache", "clear", "--dir", str(cache_dir))
    assert code == 1
    assert_one_line_error(err, "--yes", "not a terminal")
    assert len(jaxaot.DirectoryCache(cache_dir).keys()) == n


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("answer", ["n", "y"])
def test_clear_asks_on_a_terminal(
    answer: str,
    cache_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = len(headers(cache_dir))
    monkeypatch.setattr(sys, "stdin", _FakeTTY(answer + "\n"))
    code, out, _ = run(capsys, "cache", "clear", "--dir", str(cache_dir))
    assert f"Remove {n} entries (" in out and f"from {cache_dir.resolve()}? [y/N]" in out
    left = jaxaot.DirectoryCache(cache_dir).keys()
    if answer == "y":
        assert code == 0 and left == []
    else:
        assert code == 1 and len(left) == n and "nothing removed" in out


@pytest.mark.skipif(os.name != "posix", reason="pseudo-terminals")
def test_clear_asks_on_a_real_terminal(cache_dir: Path, subprocess_env: dict[str, str]) -> None:
    n = len(headers(cache_dir))
    code, out = _on_a_terminal(["cache", "clear", "--dir", str(cache_dir)], "n", subprocess_env)
    assert code == 1 and f"Remove {n} entries (" in out and "nothing removed" in out, out
    assert len(jaxaot.DirectoryCache(cache_dir).keys()) == n


# -- locations and errors --------------------------------------------------------


def test_missing_dir_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for sub in ("ls", "stats", "verify", "clear"):
        code, out, err = run(capsys, "cache", sub, "--dir", str(tmp_path / "nope"))
        assert code == 1 and out == ""
        assert_one_line_error(err, "no such directory", str(tmp_path / "nope"))
    assert not (tmp_path / "nope").exists()  # nothing was created
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "cache", "ls", "--dir", str(tmp_path / "file"))
    assert code == 1
    assert_one_line_error(err, "not a directory")


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_world_writable_dir_is_refused(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.chmod(cache_dir, 0o777)
    code, out, err = run(capsys, "cache", "ls", "--dir", str(cache_dir))
    assert code == 1 and out == ""
    assert_one_line_error(err, "world-writable", "chmod 700")


def test_default_cache_from_env(
    cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(cache_dir))
    monkeypatch.delenv("JAXAOT_CACHE", raising=False)
    rows = run_json(capsys, "cache", "ls")
    assert {r["digest"] for r in rows} == set(headers(cache_dir))
    assert run_json(capsys, "cache", "stats")["path"] == str(cache_dir.resolve())

    for choice in ("off", "memory"):
        monkeypatch.setenv("JAXAOT_CACHE", choice)
        code, _, err = run(capsys, "cache", "ls")
        assert code == 1
        assert_one_line_error(err, f"JAXAOT_CACHE={choice}", "no persistent cache")
    # --dir works whatever JAXAOT_CACHE says.
    assert run(capsys, "cache", "stats", "--dir", str(cache_dir))[0] == 0

    monkeypatch.delenv("JAXAOT_CACHE")
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(cache_dir.parent / "never-made"))
    code, _, err = run(capsys, "cache", "ls")
    assert code == 1
    assert_one_line_error(err, "no such directory", "never-made")


def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["cache"], ["nope"], ["cache", "ls", "--sort", "bogus"], ["cache", "info"]):
        code, out, err = run(capsys, *argv)
        assert code == 2, argv
        assert_one_line_error(err)


@pytest.mark.parametrize(
    "argv, prog",
    [
        (["cache", "ls", "--bogus"], "jaxaot cache ls"),
        (["cache", "info", "abcd", "extra"], "jaxaot cache info"),
        (["cache", "ls", "--sort", "bogus"], "jaxaot cache ls"),
        (["demo", "--bogus"], "jaxaot demo"),
        (["cache"], "jaxaot cache"),
        (["--bogus"], "jaxaot"),
    ],
)
def test_errors_point_to_the_subcommand_help(
    argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert_one_line_error(err, f"'{prog} --help'")


@pytest.mark.parametrize("steps", ["0", "-3", "two"])
def test_demo_refuses_a_bad_step_count(steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "demo", "--steps", steps)
    assert code == 2 and out == ""
    assert_one_line_error(err, "--steps", steps)


def test_missing_store_directory_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}/nonexistent"
    for sub in ("ls", "stats", "verify"):
        code, out, err = run(capsys, "cache", sub, "--url", url)
        assert code == 1 and out == ""
        assert_one_line_error(err, "no such directory", str(tmp_path / "nonexistent"))
    assert not (tmp_path / "nonexistent").exists()


def test_unknown_cache_choice_names_urls(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAXAOT_CACHE", "bogus")
    code, _, err = run(capsys, "cache", "ls")
    assert code == 1
    assert_one_line_error(err, "'bogus'", "redis://", "file://")


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("JAXAOT_CACHE_HMAC_KEY", " ", "is set but empty"),
        ("JAXAOT_CACHE_MAX_BYTES", "lots", "JAXAOT_CACHE_MAX_BYTES"),
    ],
)
@pytest.mark.parametrize("command", [("cache", "ls"), ("cache", "stats"), ("cache", "verify")])
def test_a_setting_jaxaot_cannot_use_is_a_one_line_error(
    cache_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
    words: str,
    command: tuple[str, ...],
) -> None:
    """A JAXAOT_* variable set to what jaxaot cannot use (a signing key that did
    not reach the process) is said in one line, exit status 1: no traceback."""
    monkeypatch.setenv(variable, value)
    code, out, err = run(capsys, *command, "--dir", str(cache_dir))
    assert code == 1 and out == ""
    assert_one_line_error(err, words)


def test_export_of_an_unknown_component_writes_nothing(
    cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "out.jxb"
    code, out, err = run(
        capsys, "cache", "export", str(bundle), "--component", "nosuch", "--dir", str(cache_dir)
    )
    assert code == 1 and out == ""
    assert_one_line_error(err, "nosuch", "nothing written", "affine")
    assert not bundle.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    code, out, _ = run(
        capsys, "cache", "export", str(bundle), "--component", "affine", "--dir", str(cache_dir)
    )
    assert code == 0 and bundle.exists() and "components: affine" in out


def test_export_with_no_good_entry_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty cache, or one whose every entry fails verification, exports no
    empty bundle and says why (status 1)."""
    source, bundle = tmp_path / "source", tmp_path / "out.jxb"
    jaxaot.DirectoryCache(source).put("ab" * 16, b"not an entry")
    code, out, err = run(capsys, "cache", "export", str(bundle), "--dir", str(source))
    assert code == 1 and out == "" and not bundle.exists()
    assert_one_line_error(err, "all 1 entry failed verification", "nothing written")
    (tmp_path / "empty").mkdir()
    code, out, err = run(capsys, "cache", "export", str(bundle), "--dir", str(tmp_path / "empty"))
    assert code == 1 and not bundle.exists()
    assert_one_line_error(err, "it holds no entries", "nothing written")


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "cache" in out and "demo" in out and "bench" in out
    assert "'jaxaot COMMAND --help'" in out
    code, out, _ = run(capsys, "cache", "--help")
    assert code == 0
    for sub in ("ls", "info", "stats", "verify", "prune", "clear", "export", "import"):
        assert sub in out
    code, out, _ = run(capsys, "cache", "verify", "--help")
    assert code == 0 and "--fix" in out and "Exit status" in out
    code, out, _ = run(capsys, "demo", "--help")
    assert code == 0 and "--dir PATH, --cache-dir PATH" in out


def test_version_does_not_import_jax(subprocess_env: dict[str, str]) -> None:
    code = (
        "import sys; from jaxaot.cli import main; rc = main(['--version']); "
        "heavy = [m for m in ('jax', 'numpy', 'rich') if m in sys.modules]; "
        "print('heavy:', ','.join(heavy)); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first.startswith("jaxaot ") and first.split()[1][0].isdigit()
    assert second.strip() == "heavy:"


def test_protocol_only_backend(fresh_cache: jaxaot.MemoryCache) -> None:
    """A backend without files is read through get(); its extras are used when present."""
    with jaxaot.using_cache(fresh_cache):
        affine(jnp.ones((4, 3)), jnp.ones((3, 2)))
    key = fresh_cache.keys()[0]
    fresh_cache.put("ab" * 16, b"garbage")
    view = cli_cache.CacheView(fresh_cache, "memory")
    records = {r.key: r for r in cli_cache.load_records(view)}
    assert records[key].name == "affine" and records[key].error is None
    assert records["ab" * 16].name == "<bad entry>"
    assert records[key].last_used is None and records[key].hits is not None
    assert view.remove_bad("ab" * 16) == "deleted" and not view.exists("ab" * 16)


# -- real processes --------------------------------------------------------------


def test_python_m_jaxaot(cache_dir: Path, subprocess_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot", "cache", "ls", "--dir", str(cache_dir)],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "affine" in proc.stdout and "tree_fn" in proc.stdout and "vmap" in proc.stdout
    assert not any(ch in proc.stdout for ch in "│┃━─\x1b")

    missing = str(cache_dir.parent / "missing")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot", "cache", "verify", "--dir", missing],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert_one_line_error(proc.stderr, "no such directory")


def test_console_script(cache_dir: Path, subprocess_env: dict[str, str]) -> None:
    script = shutil.which("jaxaot")
    if script is None:
        pytest.skip("the jaxaot console script is not installed (pip install -e .)")
    proc = subprocess.run(
        [script, "cache", "stats", "--json", "--dir", str(cache_dir)],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["entries"] == len(headers(cache_dir))


def test_clear_and_prune_fail_when_entries_cannot_be_removed(
    cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a directory it cannot write in (root ignores permission bits, so the
    removals are made to fail), clear and prune say what could not be removed and
    exit 1; they said "removed 5 entries" with exit 0, and a cron prune failed
    silently."""
    n = len(headers(cache_dir))
    monkeypatch.setattr(jaxaot.DirectoryCache, "clear", lambda self: None)
    monkeypatch.setattr(jaxaot.DirectoryCache, "delete", lambda self, key: False)
    code, out, _ = run(capsys, "cache", "clear", "--yes", "--dir", str(cache_dir))
    assert code == 1 and f"{n} entries could not be removed" in out, out
    code, out, _ = run(capsys, "cache", "prune", "--max-bytes", "0", "--dir", str(cache_dir))
    assert code == 1 and f"{n} entries could not be removed" in out, out
    assert len(jaxaot.DirectoryCache(cache_dir).keys()) == n
