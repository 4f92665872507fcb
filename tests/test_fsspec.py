"""FsspecCache on fsspec's real ``memory://`` and ``file://`` filesystems: the byte
protocol, layout, atomic writes, the size cap, tampered entries and faults."""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest
from _helpers import make_blob

import jaxaot
from jaxaot import cli as _cli
from jaxaot._caches._fsspec import FsspecCache
from jaxaot._caches._tiered import TieredCache

SIZES = [1, 1000, 1 << 20, 5 << 20]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "jaxaot" and r.levelno >= logging.WARNING
    ]


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://jaxaot-test-{uuid.uuid4().hex}"
    return f"file://{tmp_path}/store"


def test_round_trip_keys_delete_clear(url: str) -> None:
    cache = FsspecCache(url)
    assert cache.keys() == [] and cache.get("ab" * 16) is None
    stored = {}
    for i, size in enumerate(SIZES):
        key = f"{i:02x}" * 16
        value = os.urandom(size)
        cache.put(key, value)
        stored[key] = value
    for key, value in stored.items():
        assert cache.get(key) == value
    assert cache.keys() == sorted(stored)
    stats = cache.stats()
    assert stats["backend"] == "fsspec" and stats["entries"] == len(SIZES)
    assert stats["bytes"] == sum(SIZES) and stats["puts"] == len(SIZES)
    # Layout: <root>/<key[:2]>/<key>.
    key = sorted(stored)[1]
    assert cache.fs.cat_file(f"{cache._root}/{key[:2]}/{key}") == stored[key]
    # put keeps an existing entry.
    cache.put(key, b"other")
    assert cache.get(key) == stored[key]
    assert cache.delete(key) is True and cache.delete(key) is False
    assert cache.get(key) is None
    # Foreign objects are neither listed nor cleared.
    cache.fs.pipe_file(f"{cache._root}/README", b"hello")
    cache.fs.makedirs(f"{cache._root}/zz", exist_ok=True)
    cache.fs.pipe_file(f"{cache._root}/zz/{'ab' * 16}", b"misfiled")
    assert key not in cache.keys() and len(cache.keys()) == len(SIZES) - 1
    cache.clear()
    assert cache.keys() == []
    assert cache.fs.cat_file(f"{cache._root}/README") == b"hello"
    with pytest.raises(ValueError):
        cache.get("../etc/passwd")
    assert isinstance(cache, jaxaot.Cache)


def test_file_writes_leave_no_partial_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = FsspecCache(f"file://{tmp_path}/store")
    key, blob = make_blob()

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    cache.put(key, blob)
    cache.put(key, blob)
    monkeypatch.undo()
    assert cache.get(key) is None
    shard = tmp_path / "store" / key[:2]
    assert list(shard.iterdir()) == []  # the temp file is gone too
    assert len(warnings_of(caplog)) == 1 and "ENOSPC" in warnings_of(caplog)[0]
    cache.put(key, blob)
    assert [p.name for p in shard.iterdir()] == [key]


def test_max_bytes_evicts_oldest(url: str) -> None:
    cache = FsspecCache(url, max_bytes=2500)
    keys = [f"{i:02x}" * 16 for i in range(4)]
    for key in keys:
        cache.put(key, b"x" * 1000)
    left = cache.keys()
    assert len(left) == 2 and keys[-1] in left
    assert cache.stats()["bytes"] <= 2500 and cache.stats()["evictions"] == 2
    cache.put("ff" * 16, b"y" * 3000)  # larger than the cap: not stored
    assert cache.get("ff" * 16) is None


def test_tampered_entry_is_refused_and_not_promoted(url: str) -> None:
    remote = FsspecCache(url)
    key, blob = make_blob()
    data = bytearray(blob)
    data[len(data) // 2] ^= 0x01
    remote.put(key, bytes(data))
    local = jaxaot.MemoryCache()
    tiered = TieredCache(local, remote)
    assert tiered.get(key) is None
    assert local.keys() == [] and remote.keys() == []
    remote.put(key, blob)
    assert tiered.get(key) == blob and local.get(key) == blob


@pytest.mark.parametrize("method", ["cat_file", "find", "pipe_file", "rm_file", "exists"])
def test_faults_are_misses_with_one_warning(
    url: str, method: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = FsspecCache(url)
    key, blob = make_blob()
    other, other_blob = make_blob(tag=1)
    cache.put(key, blob)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(cache.fs, method, boom)
    if method == "pipe_file" and url.startswith("file://"):
        monkeypatch.setattr(os, "open", boom)  # the local write path does not use pipe_file
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    for _ in range(3):
        got = cache.get(key)
        assert got in (None, blob)
        cache.put(other, other_blob)
        cache.keys()
        cache.delete(other)
        cache.stats()
        cache.clear()
    warnings = warnings_of(caplog)
    assert len(warnings) == 1, warnings
    assert "EIO" in warnings[0]
    monkeypatch.undo()
    cache.put(other, other_blob)
    assert cache.get(other) == other_blob


def test_connection_errors_back_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = FsspecCache(f"memory://jaxaot-test-{uuid.uuid4().hex}", backoff=60)
    key, blob = make_blob()
    cache.put(key, blob)
    calls = []

    def refused(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(cache.fs, "cat_file", refused)
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    assert [cache.get(key) for _ in range(5)] == [None] * 5
    assert len(calls) == 1  # later calls did not wait on the store
    assert cache.stats()["skipped_offline"] >= 4
    assert len(warnings_of(caplog)) == 1
    cache._down_until = 0.0  # the back-off is over
    monkeypatch.undo()
    assert cache.get(key) == blob


def test_components_share_a_store(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/shared"

    @jaxaot.component(key="fsspec-e2e")
    def f(x):
        return jnp.cos(x) + 1

    x = jnp.arange(3.0)
    with jaxaot.using_cache(TieredCache(jaxaot.MemoryCache(), FsspecCache(url))):
        expected = f(x)

    @jaxaot.component(key="fsspec-e2e")
    def g(x):
        raise AssertionError("traced although the store holds the entry")

    with jaxaot.using_cache(TieredCache(jaxaot.MemoryCache(), FsspecCache(url))):
        assert jnp.allclose(g(x), expected)
    assert g.cache_info().traces == 0


def test_cli_on_a_store_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/cli-store"
    cache = FsspecCache(url)
    key, blob = make_blob(name="listed")
    cache.put(key, blob)
    assert _cli.main(["cache", "ls", "--url", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["digest"], r["name"], r["ok"], r["last_used"]) for r in rows] == [
        (key, "listed", True, None)
    ]
    assert _cli.main(["cache", "ls", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "listed" in out and key[:12] in out
    assert _cli.main(["cache", "stats", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 1
    assert _cli.main(["cache", "ls", "--url", url, "--dir", str(tmp_path)]) == 2
    assert "not allowed with" in capsys.readouterr().err


def test_missing_fsspec_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(ImportError, match=r"jaxaot\[fsspec\]"):
        FsspecCache("memory://x")
