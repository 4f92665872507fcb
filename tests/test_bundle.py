"""Bundles: export a populated cache into one file, import it in a fresh process
that then runs with zero traces; damaged bundles and bad entries are refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import _helpers
import numpy as np
import pytest
from _helpers import make_blob

import jaxaot
from jaxaot import cli as _cli
from jaxaot._store import _bundle, _entry
from jaxaot._store._bundle import BundleError, export_bundle, import_bundle

COMPONENTS = textwrap.dedent(
    """
    import os
    import jax, jax.numpy as jnp, jaxaot

    def _guard():
        if os.environ.get("JAXAOT_TEST_RAISE") == "1":
            raise RuntimeError("body traced in the warm process")

    @jaxaot.component(key="bundle-block")
    def block(x, w):
        _guard()
        return jnp.tanh(x @ w)

    @jaxaot.component(key="bundle-loss")
    def loss(params, x):
        _guard()
        return jnp.mean(block(x, params["w"]) ** 2) + jnp.sum(params["b"])

    def run():
        x = jnp.arange(12.0).reshape(3, 4) / 10
        w = jnp.ones((4, 2)) / 3
        params = {"w": w, "b": jnp.ones(2)}
        top = block(x, w)
        grads = jax.grad(loss)(params, x)
        value = jax.jit(loss)(params, x)
        return {
            "top": top.tolist(), "grad_w": grads["w"].tolist(), "loss": float(value),
            "traces": block.cache_info().traces + loss.cache_info().traces,
        }
    """
)

POPULATE = "import json, comps; print(json.dumps(comps.run()))"

WARM = textwrap.dedent(
    """
    import json, sys
    from jaxaot import cli as _cli
    status = _cli.main(["cache", "import", sys.argv[1]])
    import comps
    result = comps.run()
    result["import_status"] = status
    print(json.dumps(result))
    """
)


def _env(tmp: Path, cache_dir: Path, *, raising: bool) -> dict[str, str]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["JAXAOT_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), repo, env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAXAOT_TEST_RAISE"] = "1" if raising else "0"
    env.pop("JAXAOT_CACHE", None)
    env.pop("JAXAOT_CACHE_HMAC_KEY", None)
    return env


def _python(code: str, *args: str, env: dict[str, str]) -> tuple[str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A cache directory filled by a real process running the components (made once)."""
    tmp = tmp_path_factory.mktemp("bundle")
    (tmp / "comps.py").write_text(COMPONENTS)
    cache_dir = tmp / "source"
    out, _ = _python(POPULATE, env=_env(tmp, cache_dir, raising=False))
    result = json.loads(out.strip().splitlines()[-1])
    assert result["traces"] > 0
    return {"tmp": tmp, "dir": cache_dir, "result": result}


@pytest.fixture
def source(populated: dict[str, Any], tmp_path: Path) -> jaxaot.DirectoryCache:
    """A private copy of the populated cache."""
    root = tmp_path / "source"
    shutil.copytree(populated["dir"], root)
    return jaxaot.DirectoryCache(root)


def names_in(cache: Any) -> dict[str, str]:
    return {k: _entry.verify(cache.get(k))[0]["name"] for k in cache.keys()}


# -- the whole trip ----------------------------------------------------------------


def test_fresh_process_imports_and_traces_nothing(
    populated: dict[str, Any], source: jaxaot.DirectoryCache, tmp_path: Path
) -> None:
    bundle = tmp_path / "warm.jaxaot"
    report = export_bundle(bundle, cache=source)
    assert report["entries"] == len(source.keys()) and report["bad"] == []
    assert report["names"] == ["block", "loss"] and report["path"] == str(bundle)
    assert report["bytes"] == sum(len(source.get(k) or b"") for k in source.keys())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left

    target = tmp_path / "fresh-cache"  # does not exist yet: the CLI import creates it
    out, err = _python(WARM, str(bundle), env=_env(populated["tmp"], target, raising=True))
    warm = json.loads(out.strip().splitlines()[-1])
    assert warm["import_status"] == 0
    assert warm["traces"] == 0
    expected = populated["result"]
    for name in ("top", "grad_w", "loss"):
        np.testing.assert_allclose(warm[name], expected[name], rtol=1e-6)
    assert f"{report['entries']} added, 0 skipped (already present), 0 refused" in out


def test_import_api_adds_skips_and_replaces_damaged(
    source: jaxaot.DirectoryCache, tmp_path: Path
) -> None:
    bundle = tmp_path / "b.jaxaot"
    export_bundle(bundle, cache=source)
    target = jaxaot.DirectoryCache(tmp_path / "target")
    first = import_bundle(bundle, cache=target)
    assert sorted(first["added"]) == source.keys() and first["refused"] == []
    assert target.keys() == source.keys()
    assert all(target.get(k) == source.get(k) for k in source.keys())
    # Already present: skipped; a damaged copy in the target is replaced.
    damaged = source.keys()[0]
    path = target.path_for(damaged)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    second = import_bundle(bundle, cache=target)
    assert second["added"] == [damaged] and len(second["skipped"]) == len(source.keys()) - 1
    assert target.get(damaged) == source.get(damaged)


def test_default_cache_is_used(source: jaxaot.DirectoryCache, tmp_path: Path) -> None:
    bundle = tmp_path / "b.jaxaot"
    with jaxaot.using_cache(source):
        export_bundle(bundle)
    mem = jaxaot.MemoryCache()
    with jaxaot.using_cache(mem):
        assert len(import_bundle(bundle)["added"]) == len(source.keys())
    with jaxaot.using_cache(None), pytest.raises(ValueError, match="caching is off"):
        export_bundle(bundle)


def test_component_selection(source: jaxaot.DirectoryCache, tmp_path: Path) -> None:
    bundle = tmp_path / "block.jaxaot"
    report = export_bundle(bundle, cache=source, components=["block", "nope"])
    assert report["names"] == ["block"] and report["unmatched"] == ["nope"]
    mem = jaxaot.MemoryCache()
    import_bundle(bundle, cache=mem)
    all_names = names_in(source)
    assert set(names_in(mem).values()) == {"block"}
    assert sorted(mem.keys()) == sorted(k for k, n in all_names.items() if n == "block")
    assert 0 < len(mem.keys()) < len(all_names)


def test_bad_entries_in_the_source_are_not_exported(
    source: jaxaot.DirectoryCache, tmp_path: Path
) -> None:
    bad = source.keys()[0]
    path = source.path_for(bad)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    report = export_bundle(tmp_path / "b.jaxaot", cache=source)
    assert report["bad"] == [bad] and bad not in report["keys"]
    assert report["entries"] == len(source.keys()) - 1


# -- refusals --------------------------------------------------------------------


def test_tampered_bundle_is_refused_whole(source: jaxaot.DirectoryCache, tmp_path: Path) -> None:
    bundle = tmp_path / "b.jaxaot"
    export_bundle(bundle, cache=source)
    data = bytearray(bundle.read_bytes())
    for where in (len(data) // 2, 20, len(data) - 1):
        tampered = bytearray(data)
        tampered[where] ^= 1
        bundle.write_bytes(bytes(tampered))
        target = jaxaot.MemoryCache()
        with pytest.raises(BundleError, match="checksum"):
            import_bundle(bundle, cache=target)
        assert target.keys() == []
    for broken, match in (
        (bytes(data[:-100]), "checksum"),
        (b"", "not a jaxaot bundle"),
        (b"PK\x03\x04" + bytes(data[4:]), "magic"),
    ):
        bundle.write_bytes(broken)
        with pytest.raises(BundleError, match=match):
            import_bundle(bundle, cache=jaxaot.MemoryCache())
    # Another format version (with a correct checksum) is refused too.
    body = bytearray(data[:-32])
    body[8:10] = (99).to_bytes(2, "little")
    bundle.write_bytes(bytes(body) + hashlib.sha256(body).digest())
    with pytest.raises(BundleError, match="version 99"):
        import_bundle(bundle, cache=jaxaot.MemoryCache())


def test_bad_entry_inside_a_sound_bundle_is_refused_and_reported(tmp_path: Path) -> None:
    good_key, good = make_blob(tag=1)
    flipped_key, flipped = make_blob(tag=2)
    flipped = flipped[:100] + bytes([flipped[100] ^ 1]) + flipped[101:]
    misfiled_key = make_blob(tag=3)[0]
    _, misfiled = make_blob(tag=4)  # sound, but for another key
    bundle = tmp_path / "mixed.jaxaot"
    _bundle._write_bundle(
        bundle,
        [
            (good_key, good),
            (flipped_key, flipped),
            (misfiled_key, misfiled),
            ("NOT-A-KEY", good),
        ],
    )
    target = jaxaot.MemoryCache()
    report = import_bundle(bundle, cache=target)
    assert report["added"] == [good_key] and target.keys() == [good_key]
    refused = {r["digest"]: r["error"] for r in report["refused"]}
    assert "checksum mismatch" in refused[flipped_key]
    assert "wrong key" in refused[misfiled_key]
    assert "invalid cache key" in refused["NOT-A-KEY"]


def test_signatures_are_checked_on_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "team-secret")
    key, signed = make_blob(tag=1)
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "intruder")
    key2, foreign = make_blob(tag=2)
    bundle = tmp_path / "signed.jaxaot"
    _bundle._write_bundle(bundle, [(key, signed), (key2, foreign)])
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "team-secret")
    report = import_bundle(bundle, cache=jaxaot.MemoryCache())
    assert report["added"] == [key]
    assert [r["digest"] for r in report["refused"]] == [key2]
    assert "signature mismatch" in report["refused"][0]["error"]


def test_failed_export_leaves_the_old_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "b.jaxaot"
    cache = jaxaot.MemoryCache()
    for tag in range(3):
        cache.put(*make_blob(tag=tag))
    export_bundle(bundle, cache=cache)
    before = bundle.read_bytes()

    class Failing(jaxaot.MemoryCache):
        def get(self, key: str) -> bytes | None:
            raise OSError(5, "Input/output error")

    failing = Failing()
    failing.put(*make_blob(tag=9))
    with pytest.raises(OSError):
        export_bundle(bundle, cache=failing)
    assert bundle.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.jaxaot"]


# -- the command line ----------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = _cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_export_and_import(
    source: jaxaot.DirectoryCache, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = ["--dir", str(source.root)]
    bundle = tmp_path / "all.jaxaot"
    n = len(source.keys())
    code, out, err = run(capsys, "cache", "export", str(bundle), *src)
    assert code == 0 and err == ""
    assert out.startswith(f"exported {n} entries") and "components: block, loss" in out

    code, out, _ = run(
        capsys,
        "cache",
        "export",
        str(tmp_path / "b.jaxaot"),
        "--component",
        "block",
        *src,
        "--json",
    )
    assert code == 0 and json.loads(out)["names"] == ["block"]
    code, out, err = run(
        capsys, "cache", "export", str(tmp_path / "x.jaxaot"), "--component", "nope", *src
    )
    assert code == 1 and "no entries for component(s): nope" in err
    assert not (tmp_path / "x.jaxaot").exists()

    target = tmp_path / "new" / "cache"
    code, out, _ = run(capsys, "cache", "import", str(bundle), "--dir", str(target))
    assert code == 0 and f"{n} added, 0 skipped (already present), 0 refused" in out
    assert jaxaot.DirectoryCache(target).keys() == source.keys()
    code, out, _ = run(capsys, "cache", "import", str(bundle), "--dir", str(target), "--json")
    report = json.loads(out)
    assert code == 0 and report["added"] == [] and len(report["skipped"]) == n

    # A bad entry inside a sound bundle: refused, reported, exit status 1.
    key, blob = make_blob(tag=5)
    bad = blob[:-1] + bytes([blob[-1] ^ 1])
    mixed = tmp_path / "mixed.jaxaot"
    _bundle._write_bundle(mixed, [(key, bad), make_blob(tag=6)])
    code, out, _ = run(capsys, "cache", "import", str(mixed), "--dir", str(target))
    assert code == 1 and "1 added, 0 skipped (already present), 1 refused" in out
    assert key[:12] in out and "checksum mismatch" in out

    # A damaged bundle: one-line error, exit status 1, nothing imported.
    data = bytearray(bundle.read_bytes())
    data[len(data) // 3] ^= 1
    bundle.write_bytes(bytes(data))
    empty = tmp_path / "empty"
    code, out, err = run(capsys, "cache", "import", str(bundle), "--dir", str(empty))
    assert code == 1 and out == ""
    assert (
        err.startswith("jaxaot: error: refused the bundle") and len(err.strip().splitlines()) == 1
    )
    assert jaxaot.DirectoryCache(empty).keys() == []
    code, _, err = run(capsys, "cache", "import", str(tmp_path / "missing.jaxaot"))
    assert code == 1 and "no such bundle file" in err


def test_cli_export_to_and_import_from_a_url(
    source: jaxaot.DirectoryCache, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}/store"
    bundle = tmp_path / "b.jaxaot"
    export_bundle(bundle, cache=source)
    code, out, _ = run(capsys, "cache", "import", str(bundle), "--url", url)
    assert code == 0 and f"{len(source.keys())} added" in out
    code, out, _ = run(capsys, "cache", "export", str(tmp_path / "again.jaxaot"), "--url", url)
    assert code == 0 and out.startswith(f"exported {len(source.keys())} entries")


# -- what was really stored; hostile entries -----------------------------------------------


def test_import_reports_what_the_cache_did_not_store(tmp_path: Path) -> None:
    source = jaxaot.MemoryCache()
    blobs = dict(make_blob(tag=t, payload=bytes(1000)) for t in range(4))
    for key, blob in blobs.items():
        source.put(key, blob)
    bundle = tmp_path / "b.jaxaot"
    export_bundle(bundle, cache=source)
    one = max(len(b) for b in blobs.values())
    target = jaxaot.DirectoryCache(tmp_path / "t", max_bytes=one + 10)  # room for one entry
    report = import_bundle(bundle, cache=target)
    assert report["added"] == target.keys() and len(report["added"]) == 1
    assert sorted(report["added"] + report["not_stored"]) == sorted(blobs)
    assert report["complete"] is False and report["refused"] == []
    tiny = jaxaot.DirectoryCache(tmp_path / "tiny", max_bytes=10)  # smaller than any entry
    report = import_bundle(bundle, cache=tiny)
    assert report["added"] == [] and sorted(report["not_stored"]) == sorted(blobs)
    full = import_bundle(bundle, cache=jaxaot.DirectoryCache(tmp_path / "roomy"))
    assert full["complete"] is True and full["not_stored"] == []


def test_a_damaged_copy_the_cache_cannot_replace_is_not_called_added(tmp_path: Path) -> None:
    """A cache that keeps its damaged copies (read-only: its deletes and writes
    fail, and say so) holds the keys after an import, but not the entries: they
    are reported not stored, and the import incomplete."""

    class Frozen(jaxaot.MemoryCache):
        frozen = False

        def put(self, key: str, value: bytes) -> None:
            if not self.frozen:
                super().put(key, value)

        def delete(self, key: str) -> None:
            if not self.frozen:
                super().delete(key)

    source = jaxaot.MemoryCache()
    blobs = dict(make_blob(tag=t) for t in range(3))
    for key, blob in blobs.items():
        source.put(key, blob)
    bundle = tmp_path / "b.jaxaot"
    export_bundle(bundle, cache=source)
    target = Frozen()
    for key, blob in blobs.items():
        target.put(key, blob[:-1] + bytes([blob[-1] ^ 1]))  # a flipped byte
    target.frozen = True
    report = import_bundle(bundle, cache=target)
    assert report["added"] == [] and sorted(report["not_stored"]) == sorted(blobs), report
    assert report["complete"] is False


def test_hostile_entry_in_a_bundle_is_refused_cleanly(tmp_path: Path) -> None:
    key, blob = make_blob()
    deep = _helpers.forge_entry(b"[" * 100_000 + b"]" * 100_000)
    bundle = tmp_path / "b.jaxaot"
    _bundle._write_bundle(bundle, [(key, blob), ("cd" * 32, deep)])
    target = jaxaot.MemoryCache()
    report = import_bundle(bundle, cache=target)  # no RecursionError
    assert report["added"] == [key] and target.keys() == [key]
    assert [r["digest"] for r in report["refused"]] == ["cd" * 32]
    assert "nested" in report["refused"][0]["error"]
