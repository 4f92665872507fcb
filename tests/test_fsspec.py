"""FsspecCache on fsspec's real ``memory://`` and ``file://`` filesystems: the byte
protocol, layout, atomic writes, the size cap, tampered entries and faults."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import _helpers
import jax.numpy as jnp
import pytest
from _helpers import make_blob

import jaxaot
from jaxaot import cli as _cli
from jaxaot._caches._fsspec import FsspecCache
from jaxaot._caches._tiered import TieredCache
from jaxaot._store._entry import check_stored

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

    def broken_replace(src: Any, dst: Any, **kwargs: Any) -> None:
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
    tiered = TieredCache(local, remote, check=check_stored)
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

    if url.startswith("file://"):
        # Local paths go through os directly (descriptor-relative, no symlink followed).
        local = {"cat_file": "read", "find": "scandir", "pipe_file": "open"}
        local |= {"rm_file": "unlink", "exists": "stat"}
        monkeypatch.setattr(os, local[method], boom)
    else:
        monkeypatch.setattr(cache.fs, method, boom)
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


def test_a_store_down_when_the_cache_is_made_degrades_and_connects_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A driver that connects as it is made (ftp) with its server down: the cache
    is made, says so once, and its calls are misses and skipped writes, as for a
    store that goes down later; a component computes. With the server up, it
    connects on the next use."""
    import socket

    pytest.importorskip("fsspec.implementations.ftp")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caplog.set_level(logging.WARNING, logger="jaxaot")
    cache = FsspecCache(f"ftp://127.0.0.1:{port}/jaxaot", backoff=60)
    key, blob = make_blob()
    assert cache.get(key) is None
    cache.put(key, blob)
    assert cache.lease(key, 10.0) is None
    down = [w for w in warnings_of(caplog) if "cannot be reached" in w]
    assert len(down) == 1 and "ECONNREFUSED" in down[0], warnings_of(caplog)
    assert not any("lease" in w for w in warnings_of(caplog))

    @jaxaot.component
    def double(x: Any) -> Any:
        return x * 2

    with jaxaot.using_cache(cache):
        assert double(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert len(warnings_of(caplog)) == 2  # the unsigned store's, and the outage
    cache._down_until = 0.0  # the back-off is over: the next use connects again
    cache._address = "memory://jaxaot-test-" + uuid.uuid4().hex  # (the server is back)
    cache.put(key, blob)
    assert cache.get(key) == blob


def test_a_remote_call_that_hangs_is_cut_off_at_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A driver call that does not return (a stalled object store) makes ``get`` a
    miss and ``put`` a skipped write after ``timeout``, whatever the driver's own
    timeouts; later calls back off instead of waiting again."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    release = threading.Event()
    entered: list[str] = []

    class StalledStore(MemoryFileSystem):  # type: ignore[misc]
        protocol = "jaxaotstalled"
        stall = False

        def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
            if StalledStore.stall:
                entered.append("cat_file")
                release.wait(60)
            return super().cat_file(path, *args, **kwargs)

        def exists(self, path: str, **kwargs: Any) -> bool:
            if StalledStore.stall:
                entered.append("exists")
                release.wait(60)
            return bool(super().exists(path, **kwargs))

    fsspec.register_implementation("jaxaotstalled", StalledStore, clobber=True)
    try:
        cache = FsspecCache(f"jaxaotstalled://t-{uuid.uuid4().hex}", timeout=0.2, backoff=60)
        key, blob = make_blob()
        other, other_blob = make_blob(tag=1)
        cache.put(key, blob)
        assert cache.get(key) == blob
        StalledStore.stall = True
        caplog.set_level(logging.DEBUG, logger="jaxaot")
        assert cache.get(key) is None
        assert entered == ["cat_file"] and not release.is_set()  # it did not wait it out
        cache.put(other, other_blob)  # backing off: the store is not asked again
        assert cache.get(other) is None and entered == ["cat_file"]
        warnings = [w for w in warnings_of(caplog) if "HMAC" not in w]  # not the unsigned one
        assert len(warnings) == 1 and "within 0.2 s" in warnings[0], warnings
        assert cache.stats()["skipped_offline"] >= 2
        release.set()
        StalledStore.stall = False
        cache._down_until = 0.0  # the back-off is over
        assert cache.get(key) == blob
        cache.put(other, other_blob)
        assert cache.get(other) == other_blob
    finally:
        release.set()
        StalledStore.stall = False


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


# -- trust on local paths -----------------------------------------------------------------


def test_file_url_over_a_directory_another_user_owns_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The README's ``file:///tmp/shared-jaxaot`` made by another user, writable by
    all, no HMAC key: an entry planted there is never read."""
    _helpers.need_root()
    with _helpers.traversable_dir() as base:
        base.chmod(0o1777)  # like /tmp
        shared = base / "shared-jaxaot"
        key, planted = make_blob("planted")
        _helpers.as_other_user(
            f"mkdir -m 777 {shared} && mkdir -m 777 {shared}/{key[:2]} && "
            f"cat > {shared}/{key[:2]}/{key} && chmod 666 {shared}/{key[:2]}/{key}",
            planted,
        )
        cache = FsspecCache(f"file://{shared}")
        caplog.set_level(logging.WARNING, logger="jaxaot")
        assert cache.get(key) is None
        other, blob = make_blob("mine")
        cache.put(other, blob)  # nothing written into a store another user controls
        assert not (shared / other[:2]).exists()
        warns = warnings_of(caplog)
        assert len(warns) == 1 and f"uid {_helpers.OTHER_UID}" in warns[0]
        assert cache.stats()["refused"] == 1


def test_a_signed_store_in_a_group_directory_is_written_by_every_member(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A team's signed store in a setgid directory its group writes (mode 2770):
    the shards and lease files one member makes are the group's to write, so
    another member (a real second uid in that group) writes entries into them
    and locks their leases. They were made 0755 and 0644, and the other member's
    writes and leases failed ("the cache cannot be written")."""
    _helpers.need_root()
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "team-secret")
    with _helpers.traversable_dir() as base:
        team = base / "team"
        team.mkdir()
        os.chown(team, -1, _helpers.OTHER_UID)  # the group both members are in
        team.chmod(0o2770)
        cache = FsspecCache(f"file://{team}")
        key, blob = make_blob("ours")
        cache.put(key, blob)
        lease = cache.lease(key, 10.0)
        assert lease is not None and hasattr(lease, "release")
        lease.release()
        shard = team / key[:2]
        assert stat.S_IMODE(shard.stat().st_mode) & 0o070 == 0o070
        _helpers.as_other_user(
            f"cd {shard} && echo theirs > .probe && mv .probe probe && "
            f"exec 3<>{key}.lease && flock -n 3"
        )
        assert (shard / "probe").read_text() == "theirs\n"
        assert cache.get(key) == blob


def test_file_url_entry_written_by_another_user_is_refused(tmp_path: Path) -> None:
    _helpers.need_root()
    cache = FsspecCache(f"file://{tmp_path}/store")
    key, blob = make_blob()
    cache.put(key, blob)
    assert cache.get(key) == blob
    os.chown(tmp_path / "store" / key[:2] / key, _helpers.OTHER_UID, -1)
    assert cache.get(key) is None
    cache.put(key, blob)  # the foreign file is replaced by ours
    assert cache.get(key) == blob


def test_file_url_symlinks_and_fifos_are_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    key = "ab" + "0" * 30
    (outside / key).write_bytes(b"elsewhere")
    store = tmp_path / "store"
    cache = FsspecCache(f"file://{store}", max_bytes=1 << 20)
    cache.put("cd" + "1" * 30, b"v")
    (store / "ab").symlink_to(outside)
    assert cache.get(key) is None and key not in cache.keys()
    cache.put("ab" + "2" * 30, b"new")
    cache.clear()
    assert sorted(p.name for p in outside.iterdir()) == [key]
    fifo_key = "ef" + "3" * 30
    (store / "ef").mkdir()
    os.mkfifo(store / "ef" / fifo_key)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(cache.get(fifo_key)), daemon=True)
    t.start()
    t.join(20)
    try:
        assert not t.is_alive() and result == [None]
    finally:
        fd = os.open(store / "ef" / fifo_key, os.O_RDWR | os.O_NONBLOCK)
        os.close(fd)


def test_file_url_without_a_path_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for url in ("file://", "file://relative", "local://", "file:///"):
        with pytest.raises(ValueError, match="absolute"):
            FsspecCache(url)
    assert list(tmp_path.iterdir()) == []


def test_unsigned_remote_store_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from jaxaot._caches import _trust

    monkeypatch.setattr(_trust, "_remote_warned", set())
    caplog.set_level(logging.WARNING, logger="jaxaot")
    fs = pytest.importorskip("fsspec")
    from fsspec.implementations.memory import MemoryFileSystem

    class FakeRemote(MemoryFileSystem):  # an object store stand-in (not "memory")
        protocol = ("jaxaot-fake-remote",)

    fs.register_implementation("jaxaot-fake-remote", FakeRemote, clobber=True)
    for _ in range(3):
        FsspecCache("jaxaot-fake-remote://bucket/cache")
    FsspecCache(f"memory://jaxaot-test-{uuid.uuid4().hex}")  # in-process: no warning
    loud = [m for m in warnings_of(caplog) if "only checksummed" in m]
    assert len(loud) == 1 and "JAXAOT_CACHE_HMAC_KEY" in loud[0]


def test_credentials_in_a_store_url_never_show(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"memory://user:hunter2@jaxaot-test-{uuid.uuid4().hex}/c?token=hunter3"
    cache = FsspecCache(url)
    key, blob = make_blob()

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise OSError(5, f"cannot reach {url}")

    monkeypatch.setattr(cache.fs, "cat_file", boom)
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    cache.get(key)
    shown = [repr(cache), cache.url, json.dumps(cache.stats())]
    shown += [r.getMessage() for r in caplog.records]
    assert any("cannot reach" in text for text in shown)
    assert all("hunter2" not in text and "hunter3" not in text for text in shown), shown
