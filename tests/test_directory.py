"""Tests for jaxaot._caches._directory.DirectoryCache.

The stress tests (marked ``slow``) run with reduced counts by default; set
``JAXAOT_STRESS=full`` for the full counts of /work/shared/RELIABILITY.md.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import logging
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _helpers  # noqa: E402
import pytest

from jaxaot._caches import Cache, _directory
from jaxaot._caches._directory import (
    DEFAULT_DIRECTORY_BYTES,
    TEMP_MAX_AGE,
    DirectoryCache,
    UnsafeCacheDirError,
)
from jaxaot._store._entry import check_stored

_WORKER_PATH = Path(__file__).with_name("_directory_worker.py")
_spec = importlib.util.spec_from_file_location("_directory_worker", _WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

FULL = os.environ.get("JAXAOT_STRESS") == "full"
YEAR = 365 * 86400.0


def k(i: int, shard: str | None = None) -> str:
    """A valid 32-hex-char key; ``shard`` forces its first two characters."""
    h = hashlib.sha256(str(i).encode()).hexdigest()[:32]
    return h if shard is None else shard + h[2:]


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def temp_files(root: Path) -> list[Path]:
    return [p for p in all_files(root) if p.name.startswith(".tmp-")]


def set_mtime(cache: DirectoryCache, key: str, t: float) -> None:
    os.utime(cache.path_for(key), (t, t))


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "jaxaot" and r.levelno >= logging.WARNING]


# -- basics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [None, 3])
def test_a_path_that_is_not_one_is_a_type_error_naming_the_class(path: object) -> None:
    with pytest.raises(TypeError, match="DirectoryCache: path must be a str or a path"):
        DirectoryCache(path)  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "gs://bucket/path", "file:///tmp/c"])
def test_a_url_is_refused_naming_the_stores_that_open_it(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DirectoryCache("redis://...")`` would make a directory named ``redis:`` and
    share nothing: it says which class opens the store."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="is a URL, not a directory: RedisCache"):
        DirectoryCache(url)
    assert list(tmp_path.iterdir()) == []


def test_default_max_bytes_is_10_gib(tmp_path: Path) -> None:
    assert DEFAULT_DIRECTORY_BYTES == 10 * 2**30
    cache = DirectoryCache(tmp_path / "c")
    assert cache.max_bytes == DEFAULT_DIRECTORY_BYTES
    assert isinstance(cache, Cache)


@pytest.mark.parametrize(
    "value",
    [b"", b"\x00", bytes(range(256)) * 3, random.Random(0).randbytes(1 << 20)],
    ids=["empty", "nul", "768B", "1MiB"],
)
def test_round_trip_identical_bytes(tmp_path: Path, value: bytes) -> None:
    cache = DirectoryCache(tmp_path / "c")
    key = k(1)
    assert cache.get(key) is None
    cache.put(key, value)
    got = cache.get(key)
    assert got == value and type(got) is bytes
    # A second instance (another process, in effect) sees the same bytes.
    assert DirectoryCache(tmp_path / "c").get(key) == value


def test_put_accepts_bytearray_and_memoryview_rejects_str(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c")
    cache.put(k(1), bytearray(b"abc"))
    cache.put(k(2), memoryview(b"xyz"))
    assert cache.get(k(1)) == b"abc" and cache.get(k(2)) == b"xyz"
    with pytest.raises(TypeError):
        cache.put(k(3), "text")  # type: ignore[arg-type]


def test_layout_is_root_shard_key(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c")
    key = k(7)
    cache.put(key, b"v")
    assert cache.path_for(key) == (tmp_path / "c").resolve() / key[:2] / key
    assert (tmp_path / "c" / key[:2] / key).read_bytes() == b"v"


def test_keys_delete_clear_stats(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c", max_bytes=1000)
    for i in range(5):
        cache.put(k(i), bytes(10 * (i + 1)))
    assert cache.keys() == sorted(k(i) for i in range(5))
    st = cache.stats()
    assert st["backend"] == "directory"
    assert st["path"] == str((tmp_path / "c").resolve())
    assert (st["entries"], st["bytes"], st["max_bytes"], st["temp_files"]) == (5, 150, 1000, 0)
    assert st["puts"] == 5
    assert json.loads(json.dumps(st)) == st

    assert cache.delete(k(0)) is True
    assert cache.delete(k(0)) is False
    assert cache.get(k(0)) is None
    assert k(0) not in cache.keys()
    assert cache.stats()["entries"] == 4

    cache.clear()
    assert cache.keys() == []
    assert cache.stats()["entries"] == 0 and cache.stats()["bytes"] == 0
    assert cache.get(k(1)) is None
    cache.put(k(1), b"again")  # still usable after clear
    assert cache.get(k(1)) == b"again"


def test_files_beside_entries_count_against_the_cap_and_go_with_clear(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Notes and leases are the cache's files too: their bytes count against
    ``max_bytes``; a clear leaves none of them, nor hit counts, except a lease that a
    live process still holds."""
    root = tmp_path / "c"
    cache = DirectoryCache(root, max_bytes=1000)
    cache.put(k(0), bytes(300))
    assert cache.get(k(0)) == bytes(300)  # a hit file
    cache.note("ab" * 16, k(0), bytes(450))  # a note file of about 630 bytes
    done = cache.lease(k(1), 30.0)
    assert done is not None and not isinstance(done, _directory.Held)
    done.release()
    held = cache.lease(k(2), 30.0)
    assert held is not None and not isinstance(held, _directory.Held)
    other = cache.stats()["other_bytes"]
    assert 630 < other < 850, cache.stats()
    cache.put(k(3), bytes(150))  # 300 + 150 + the notes > 1000: the oldest entry goes
    assert cache.keys() == [k(3)]
    # A value that fits only without the notes evicts nothing, and says so once.
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        cache.put(k(4), bytes(900))
        cache.put(k(5), bytes(950))
    assert cache.keys() == [k(3)]
    said = [r.getMessage() for r in caplog.records if "do not fit beside" in r.getMessage()]
    assert len(said) == 1, caplog.text
    cache.clear()
    left = [p.name for p in all_files(root) if p.name != ".lock"]
    assert left == [k(2) + ".lease"], left
    assert cache.stats()["other_bytes"] == (root / k(2)[:2] / (k(2) + ".lease")).stat().st_size
    assert cache.notes("ab" * 16) == []
    held.release()


def test_notes_whose_entries_are_all_gone_go_once_old(tmp_path: Path) -> None:
    """An index of notes (one per signature) whose entries were all evicted or
    deleted is removed by a tidy or an eviction once it has not been written for
    an hour; one still naming a stored entry stays, and so does a recent one (its
    entry may still be on its way)."""
    root = tmp_path / "c"
    cache = DirectoryCache(root, max_bytes=10_000)
    for i in range(4):
        cache.put(k(i), bytes(100))
    gone, kept, recent = "ab" * 16, "cd" * 16, "ef" * 16
    cache.note(gone, k(0), b"x")
    cache.note(gone, k(1), b"y")
    cache.note(kept, k(1), b"x")
    cache.note(kept, k(2), b"y")
    cache.note(recent, k(3), b"x")
    assert cache.delete(k(0)) and cache.delete(k(1)) and cache.delete(k(3))

    def index(tag: str) -> Path:
        return root / tag[:2] / (tag + ".index")

    hours_ago = time.time() - 2 * 3600
    for tag in (gone, kept):
        os.utime(index(tag), (hours_ago, hours_ago))
    before = cache.stats()["other_bytes"]
    cache.tidy()
    assert not index(gone).exists()
    assert index(kept).exists() and cache.notes(kept) == [(k(2), b"y")]
    assert index(recent).exists()
    assert cache.stats()["other_bytes"] < before
    # A write's scan for eviction removes them too.
    os.utime(index(recent), (hours_ago, hours_ago))
    cache.put(k(5), bytes(100))
    assert not index(recent).exists() and index(kept).exists()


def test_put_keeps_existing_entry_and_refreshes_access_time(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c")
    key = k(1)
    cache.put(key, b"first")
    path = cache.path_for(key)
    inode = path.stat().st_ino
    set_mtime(cache, key, time.time() - 1000)
    cache.put(key, b"second")
    assert cache.get(key) == b"first"
    assert path.stat().st_ino == inode  # not rewritten
    at = cache.access_time(key)
    assert at is not None and at > time.time() - 60  # refreshed


def test_get_refreshes_access_time(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c")
    key = k(1)
    assert cache.access_time(key) is None
    cache.put(key, b"v")
    set_mtime(cache, key, 1_000_000.0)
    assert cache.access_time(key) == 1_000_000.0
    assert cache.get(key) == b"v"
    at = cache.access_time(key)
    assert at is not None and abs(at - time.time()) < 60


def test_value_larger_than_max_bytes_is_not_stored(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c", max_bytes=100)
    cache.put(k(1), bytes(60))
    cache.put(k(2), bytes(101))
    assert cache.get(k(2)) is None
    assert cache.get(k(1)) == bytes(60)  # nothing evicted for a value that cannot fit
    cache.put(k(3), bytes(100))
    assert cache.keys() == [k(3)]


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        DirectoryCache(tmp_path / "c", max_bytes=-1)
    with pytest.raises(ValueError, match="lock_timeout"):
        DirectoryCache(tmp_path / "c", lock_timeout=-1)


# -- eviction ----------------------------------------------------------------------------------


def test_lru_eviction_order_respects_get(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c", max_bytes=300)
    now = time.time()
    for i, age in ((0, 30), (1, 20), (2, 10)):
        cache.put(k(i), bytes(100))
        set_mtime(cache, k(i), now - age)
    assert cache.get(k(0)) == bytes(100)  # k0 becomes the most recently used
    cache.put(k(3), bytes(100))  # evicts k1, now the least recently used
    assert sorted(cache.keys()) == sorted([k(0), k(2), k(3)])
    set_mtime(cache, k(3), now - 5)
    cache.put(k(4), bytes(150))  # needs 150 bytes: evicts k2 (10s) then k3 (5s)
    assert sorted(cache.keys()) == sorted([k(0), k(4)])
    assert cache.stats()["evictions"] == 3
    assert cache.stats()["bytes"] <= 300


def test_eviction_with_skewed_clocks_keeps_newest(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c", max_bytes=400)
    now = time.time()
    mtimes = {
        "past": now - YEAR,
        "far_future": now + YEAR,  # clock was a year ahead: must not pin the entry for a year
        "near_future": now + 3600,  # clock stepped back an hour: still counts as recent
        "recent": now - 1,
    }
    keys = {name: k(i) for i, name in enumerate(mtimes)}
    for name, t in mtimes.items():
        cache.put(keys[name], bytes(100))
        set_mtime(cache, keys[name], t)
    cache.put(k(10), bytes(100))
    assert keys["far_future"] not in cache.keys()
    cache.put(k(11), bytes(100))
    assert keys["past"] not in cache.keys()
    assert sorted(cache.keys()) == sorted([keys["near_future"], keys["recent"], k(10), k(11)])
    # A put that needs all the room but one entry: the most recently used one survives
    # (an hour in the future is within the slack, so it counts as the newest).
    cache.put(k(12), bytes(300))
    assert sorted(cache.keys()) == sorted([keys["near_future"], k(12)])
    assert cache.get(k(12)) == bytes(300)
    assert cache.stats()["bytes"] <= 400


def test_eviction_tolerates_files_vanishing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = DirectoryCache(tmp_path / "c", max_bytes=300)
    for i in range(3):
        cache.put(k(i), bytes(100))
    real_unlink = os.unlink

    def racing_unlink(path: Any, *a: Any, **kw: Any) -> None:
        real_unlink(path, *a, **kw)  # someone else deleted it first ...
        real_unlink(path, *a, **kw)  # ... so ours raises FileNotFoundError

    monkeypatch.setattr(os, "unlink", racing_unlink)
    cache.put(k(3), bytes(100))
    monkeypatch.undo()
    assert cache.get(k(3)) == bytes(100)
    assert cache.stats()["bytes"] <= 300


# -- permissions and trust ----------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_modes_are_0700_and_0600_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        root = tmp_path / "a" / "b" / "cache"
        cache = DirectoryCache(root)
        key = k(1)
        cache.put(key, b"v")
        cache.put(k(2), b"w")
        cache.quarantine(k(2), check=check_stored)
    finally:
        os.umask(old)

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    for d in (tmp_path / "a", tmp_path / "a" / "b", root, root / key[:2], root / "quarantine"):
        assert mode(d) == 0o700, d
    assert mode(cache.path_for(key)) == 0o600
    assert mode(root / ".lock") == 0o600
    (qfile,) = (root / "quarantine").iterdir()
    assert mode(qfile) == 0o600
    assert cache.get(key) == b"v"


@pytest.mark.parametrize("bad_mode", [0o777, 0o770, 0o702])
def test_refuses_group_or_world_writable_dir(tmp_path: Path, bad_mode: int) -> None:
    root = tmp_path / "c"
    root.mkdir()
    root.chmod(bad_mode)
    with pytest.raises(UnsafeCacheDirError, match="writable") as info:
        DirectoryCache(root)
    assert isinstance(info.value, PermissionError)
    assert str(root) in str(info.value)
    assert "\n" not in str(info.value)
    assert f"chmod 700 {root}" in str(info.value)
    assert list(root.iterdir()) == []  # nothing written into it


def test_a_shared_sticky_dir_is_refused_without_advice_to_change_it(tmp_path: Path) -> None:
    """A directory such as /tmp (world-writable and sticky) is shared on purpose:
    the error names a directory of the user's own, never ``chmod`` on it."""
    root = tmp_path / "tmp"
    root.mkdir()
    root.chmod(0o1777)
    with pytest.raises(UnsafeCacheDirError, match="writable") as info:
        DirectoryCache(root)
    assert "chmod" not in str(info.value) and "a directory of your own" in str(info.value)


def test_refuses_symlink_to_world_writable_dir(tmp_path: Path) -> None:
    target = tmp_path / "shared"
    target.mkdir()
    target.chmod(0o777)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeCacheDirError, match="writable"):
        DirectoryCache(tmp_path / "link")


def test_refuses_dir_owned_by_another_uid(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a directory to uid 65534")
    root = tmp_path / "c"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, -1)
    with pytest.raises(UnsafeCacheDirError, match="owned by uid 65534") as info:
        DirectoryCache(root)
    assert str(root) in str(info.value)
    # fallback_ok is for directories that cannot be created, never for unsafe ones.
    with pytest.raises(UnsafeCacheDirError):
        DirectoryCache(root, fallback_ok=True)


def test_existing_private_dir_is_accepted(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir(mode=0o755)
    root.chmod(0o755)  # readable by others is allowed; entries are 0600 anyway
    DirectoryCache(root).put(k(1), b"v")
    assert DirectoryCache(root).get(k(1)) == b"v"


def test_root_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(OSError):
        DirectoryCache(blocker / "c")
    cache = DirectoryCache(blocker / "c", fallback_ok=True)
    assert cache.get(k(1)) is None
    cache.put(k(1), b"v")  # skipped, no exception
    assert cache.keys() == [] and cache.stats()["entries"] == 0
    with pytest.raises(NotADirectoryError):
        DirectoryCache(blocker)
    assert DirectoryCache(blocker, fallback_ok=True).get(k(1)) is None


BAD_KEYS: list[Any] = [
    "../" + "a" * 20,
    "../../../../etc/passwd",
    "a" * 16 + "/x",
    "ab/" + "c" * 20,
    "ab\\" + "c" * 20,
    "a" * 16 + "\x00",
    "\x00" * 20,
    "a" * 300,
    "é" * 20,
    "ａ" * 20,  # fullwidth a
    "A" * 32,
    "a" * 15,
    "",
    "..",
    None,
    b"a" * 32,
]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=[f"key{i}" for i in range(len(BAD_KEYS))])
def test_invalid_keys_are_rejected_and_write_nothing(tmp_path: Path, bad: Any) -> None:
    root = tmp_path / "inner" / "c"
    cache = DirectoryCache(root)
    before = all_files(tmp_path)
    calls: list[Callable[[], object]] = [
        lambda: cache.get(bad),
        lambda: cache.put(bad, b"x" * 10),
        lambda: cache.delete(bad),
        lambda: cache.path_for(bad),
        lambda: cache.access_time(bad),
        lambda: cache.quarantine(bad, check=check_stored),
    ]
    for call in calls:
        with pytest.raises(ValueError):
            call()
    assert all_files(tmp_path) == before
    assert cache.keys() == []


# -- faults -------------------------------------------------------------------------------------


def _fault(
    monkeypatch: pytest.MonkeyPatch, name: str, err: int, when: Callable[..., bool]
) -> list[int]:
    """Makes ``os.<name>`` raise OSError(err) when ``when(*args)``; returns a hit counter."""
    real = getattr(os, name)
    hits = [0]

    def fake(*args: Any, **kwargs: Any) -> Any:
        if when(*args):
            hits[0] += 1
            raise OSError(err, os.strerror(err), str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, fake)
    return hits


def _writes_under(root: Path) -> Callable[..., bool]:
    """Matches os.open calls that would create or write a file under ``root``."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def when(path: Any, flags: int = 0, *rest: Any) -> bool:
        return str(path).startswith(str(root)) and bool(flags & write_flags)

    return when


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES])
def test_read_only_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, err: int
) -> None:
    cache = DirectoryCache(tmp_path / "c")
    cache.put(k(1), b"old")
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    # chmod 0500 does not stop root, so the file system's refusal is injected instead.
    hits = _fault(monkeypatch, "open", err, _writes_under(cache.root))
    for i in range(2, 7):
        cache.put(k(i), b"new" * 100)
    assert hits[0] >= 5
    assert cache.get(k(1)) == b"old"  # hits still work
    assert all(cache.get(k(i)) is None for i in range(2, 7))  # puts skipped
    cache.put(k(1), b"other")  # an existing key is not rewritten (and raises nothing)
    assert cache.get(k(1)) == b"old"
    warns = warnings_of(caplog)
    assert len(warns) == 1, [r.getMessage() for r in warns]
    assert errno.errorcode[err] in warns[0].getMessage()
    assert str(cache.root) in warns[0].getMessage()
    assert temp_files(cache.root) == []
    assert not any(r.levelno == logging.INFO for r in caplog.records)
    monkeypatch.undo()
    cache.put(k(2), b"new")  # writable again: puts resume
    assert cache.get(k(2)) == b"new"


@pytest.mark.parametrize("where", ["fsync", "replace", "temp-open"])
def test_disk_full_injected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    cache = DirectoryCache(tmp_path / "c")
    cache.put(k(1), b"old")
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    if where == "fsync":
        hits = _fault(monkeypatch, "fsync", errno.ENOSPC, lambda fd: True)
    elif where == "replace":
        hits = _fault(monkeypatch, "replace", errno.ENOSPC, lambda src, dst: ".tmp-" in str(src))
    else:
        hits = _fault(monkeypatch, "open", errno.ENOSPC, lambda path, *a: ".tmp-" in str(path))
    for i in range(2, 6):
        cache.put(k(i), bytes(4096))
    assert hits[0] == 4
    assert temp_files(cache.root) == []  # no partial or temp file remains
    assert cache.keys() == [k(1)]
    assert cache.get(k(1)) == b"old"
    warns = warnings_of(caplog)
    assert len(warns) == 1 and "ENOSPC" in warns[0].getMessage()
    assert "disk is full" in warns[0].getMessage()  # what it means for every later write
    assert cache.stats()["put_errors"] == 4
    # A different cause gets its own single warning.
    monkeypatch.undo()
    _fault(monkeypatch, "replace", errno.EROFS, lambda src, dst: True)
    cache.put(k(9), b"x")
    cache.put(k(10), b"x")
    warns = warnings_of(caplog)
    assert len(warns) == 2 and "EROFS" in warns[1].getMessage()


def test_one_warning_per_cache_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    a = DirectoryCache(tmp_path / "a")
    b = DirectoryCache(tmp_path / "b")
    _fault(monkeypatch, "fsync", errno.ENOSPC, lambda fd: True)
    for _ in range(3):
        a.put(k(1), b"x")
        b.put(k(1), b"x")
    assert len(warnings_of(caplog)) == 2


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the injected ENOSPC tests cover disk full")
    if proc.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); "
            "the injected ENOSPC tests cover disk full"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=20)


def test_disk_full_real_tmpfs(small_tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = DirectoryCache(small_tmpfs / "c", max_bytes=100 << 20)
    old = random.Random(1).randbytes(600 << 10)
    cache.put(k(1), old)
    assert cache.get(k(1)) == old
    for i in range(2, 5):
        cache.put(k(i), random.Random(i).randbytes(600 << 10))  # does not fit in 1 MiB
    assert cache.get(k(2)) is None
    assert cache.get(k(1)) == old
    assert temp_files(cache.root) == []
    warns = warnings_of(caplog)
    assert len(warns) == 1 and "ENOSPC" in warns[0].getMessage()


def test_directory_removed_mid_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "c"
    cache = DirectoryCache(root)
    cache.put(k(1), b"v1")
    shutil.rmtree(root)
    assert cache.get(k(1)) is None
    assert cache.keys() == []
    assert cache.stats()["entries"] == 0
    assert cache.access_time(k(1)) is None
    assert cache.delete(k(1)) is False
    cache.clear()
    cache.quarantine(k(1), check=check_stored)
    cache.put(k(2), b"v2")  # recreates the directory
    assert cache.get(k(2)) == b"v2"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    # Only a shard removed.
    shutil.rmtree(root / k(2)[:2])
    assert cache.get(k(2)) is None
    cache.put(k(2), b"v2b")
    assert cache.get(k(2)) == b"v2b"
    assert warnings_of(caplog) == []


def test_orphan_temp_files_cleaned_fresh_kept(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c", max_bytes=10_000)
    key = k(1)
    cache.put(key, b"v")
    shard = cache.path_for(key).parent
    now = time.time()
    old = shard / ".tmp-999999-deadbeefdeadbeef"
    future = shard / ".tmp-999998-0123456789abcdef"
    fresh = shard / ".tmp-999997-fedcba9876543210"
    other_shard = cache.root / "ff"
    other_shard.mkdir(mode=0o700)
    old2 = other_shard / ".tmp-1-00"
    for p, t in (
        (old, now - TEMP_MAX_AGE - 60),
        (future, now + TEMP_MAX_AGE + 3600),  # skewed clock
        (fresh, now - 5),
        (old2, now - 10 * TEMP_MAX_AGE),
    ):
        p.write_bytes(b"partial")
        os.utime(p, (t, t))
    # Junk that is neither an entry nor a temp file: ignored, never counted or deleted.
    (cache.root / "README").write_text("hi")
    (shard / ("A" * 32)).write_bytes(b"x")
    (shard / "notakey").write_bytes(b"x")
    assert cache.stats()["temp_files"] == 4
    assert cache.keys() == [key]

    cache.put(k(2), b"w")  # a put scans the directory and removes old orphans
    assert not old.exists() and not future.exists() and not old2.exists()
    assert fresh.exists()
    assert cache.stats()["temp_files"] == 1
    assert sorted(cache.keys()) == sorted([key, k(2)])
    assert cache.stats()["entries"] == 2
    assert (cache.root / "README").exists() and (shard / "notakey").exists()
    cache.clear()
    assert cache.keys() == []
    assert fresh.exists()  # a fresh temp file may be a write in flight: clear leaves it


def test_quarantine_moves_entry_and_stays_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DirectoryCache(tmp_path / "c")
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    cache.put(k(1), b"bad")
    cache.quarantine(k(1), check=check_stored)
    assert cache.get(k(1)) is None
    qdir = cache.root / "quarantine"
    (moved,) = qdir.iterdir()
    assert moved.name.startswith(k(1) + ".") and moved.read_bytes() == b"bad"
    assert k(1) not in cache.keys()
    cache.put(k(1), b"good")  # a re-put after quarantine hits again
    assert cache.get(k(1)) == b"good"
    for i in range(100, 130):
        cache.put(k(i), b"bad")
        cache.quarantine(k(i), check=check_stored)
        assert cache.get(k(i)) is None
    assert len(list(qdir.iterdir())) == _directory.QUARANTINE_MAX_FILES
    cache.quarantine(k(999), check=check_stored)  # absent: nothing happens
    assert warnings_of(caplog) == []
    assert any("quarantined" in r.getMessage() for r in caplog.records)
    cache.clear()
    assert list(qdir.iterdir()) == []


def test_threads_share_one_instance(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c", max_bytes=256 << 10)
    keys = [k(i) for i in range(12)]
    errors: list[BaseException] = []
    bad = [0]

    def run(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                key = rng.choice(keys)
                if rng.random() < 0.5:
                    cache.put(key, worker.make_value(rng, rng.randint(64, 64 << 10)))
                else:
                    got = cache.get(key)
                    if got is not None and not worker.is_valid(got):
                        bad[0] += 1
        except BaseException as e:  # collected and reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and bad[0] == 0
    assert cache.stats()["bytes"] <= 256 << 10
    assert temp_files(cache.root) == []


def test_module_does_not_import_jax() -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import _directory_worker as w; "
        "w.load_directory_module(); print('jax' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(_WORKER_PATH.parent)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "False"


# -- processes ----------------------------------------------------------------------------------


def _spawn(mode: str, args: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(_WORKER_PATH), mode, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _expect_line(proc: subprocess.Popen[str], want: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != want:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"worker said {line!r}, wanted {want!r}; stderr:\n{err}")


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)


def test_lock_holder_killed_does_not_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "c"
    cache = DirectoryCache(root, lock_timeout=1.5)
    holder = _spawn("holdlock", {"root": str(root)})
    try:
        _expect_line(holder, "locked")
        t0 = time.monotonic()
        cache.put(k(1), b"v")  # lock busy: skipped with a warning, after the timeout
        assert 1.4 < time.monotonic() - t0 < 6
        assert cache.get(k(1)) is None
        (warn,) = warnings_of(caplog)
        assert "lock" in warn.getMessage()
        assert cache.stats()["lock_timeouts"] == 1
        # Still busy: the next write is skipped without waiting again (each waited
        # the whole timeout, behind a stopped writer), and said no more.
        t0 = time.monotonic()
        cache.put(k(2), b"v")
        assert time.monotonic() - t0 < 1.0
        assert cache.get(k(2)) is None and cache.stats()["lock_timeouts"] == 2
        assert len(warnings_of(caplog)) == 1
    finally:
        _kill(holder)
    assert holder.returncode == -signal.SIGKILL
    cache.put(k(3), b"v")  # free again: written (in the same cache, at once)
    assert cache.get(k(3)) == b"v"
    t0 = time.monotonic()
    DirectoryCache(root, lock_timeout=5).put(k(1), b"v")
    assert time.monotonic() - t0 < 2
    assert cache.get(k(1)) == b"v"


def _tree_bytes(shard: Path) -> int:
    """Bytes of every file in one shard directory (one listing: a consistent snapshot)."""
    total = 0
    try:
        with os.scandir(shard) as it:
            for e in list(it):
                try:
                    total += e.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
    except OSError:
        pass
    return total


@pytest.mark.slow
def test_stress_concurrent_processes(tmp_path: Path) -> None:
    if FULL:
        n_proc, ops, max_size, max_bytes = 8, 200, 8 << 20, 32 << 20
    else:
        n_proc, ops, max_size, max_bytes = 4, 40, 1 << 20, 4 << 20
    root = tmp_path / "c"
    DirectoryCache(root, max_bytes)
    # 30 shared keys in one shard, so one directory listing sees every entry and temp file at once.
    keys = [k(i, shard="5a") for i in range(30)]
    shard = root / "5a"
    procs = [
        _spawn(
            "stress",
            {
                "root": str(root),
                "max_bytes": max_bytes,
                "ops": ops,
                "min_size": 1024,
                "max_size": max_size,
                "keys": keys,
                "seed": seed,
            },
        )
        for seed in range(n_proc)
    ]
    peak = [0]
    samples = [0]
    done = threading.Event()

    def monitor() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_bytes(shard))
            samples[0] += 1
            time.sleep(0.002)

    results: list[dict[str, Any]] = []
    try:
        for p in procs:
            _expect_line(p, "ready")
        mon = threading.Thread(target=monitor, daemon=True)
        mon.start()
        for p in procs:  # the barrier: every worker is waiting on stdin
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        done.set()
        for p in procs:
            if p.poll() is None:
                _kill(p)
    errors = [e for r in results for e in r["errors"]]
    assert errors == [], errors[0]
    assert sum(r["counts"]["bad"] for r in results) == 0
    assert sum(r["counts"]["hit"] for r in results) > 0
    assert sum(r["counts"]["put"] for r in results) > 0
    # Workers overlapped: distinct PIDs, and a moment when every one was running.
    assert len({r["pid"] for r in results}) == n_proc
    assert max(r["start"] for r in results) < min(r["end"] for r in results)
    assert temp_files(root) == []
    assert samples[0] > 10
    assert peak[0] <= max_bytes + max_size, (peak[0], max_bytes)
    cache = DirectoryCache(root, max_bytes)
    assert cache.stats()["bytes"] <= max_bytes
    for key in cache.keys():
        value = cache.get(key)
        assert value is not None and worker.is_valid(value)


@pytest.mark.slow
def test_stress_sigkill_during_write(tmp_path: Path) -> None:
    trials = 50 if FULL else 10
    size = (8 << 20) if FULL else (2 << 20)
    root = tmp_path / "c"
    cache = DirectoryCache(root, max_bytes=64 << 20, lock_timeout=10)
    rng = random.Random(0)
    outcomes = {"old": 0, "new": 0, "miss": 0}
    for trial in range(trials):
        key = k(trial)
        old = worker.make_value(random.Random(-1 - trial), size, tag=0)
        cache.put(key, old)
        assert cache.get(key) == old
        proc = _spawn(
            "writer",
            {"root": str(root), "max_bytes": 64 << 20, "key": key, "size": size, "seed": trial},
        )
        try:
            _expect_line(proc, "ready")
            time.sleep(rng.uniform(0.0, 0.15))
        finally:
            _kill(proc)
        assert proc.returncode == -signal.SIGKILL
        got = cache.get(key)
        if got is None:
            outcomes["miss"] += 1
        elif got == old:
            outcomes["old"] += 1
        else:
            assert len(got) == size and worker.is_valid(got), "partial or corrupt value"
            assert got[32:40] != (0).to_bytes(8, "big")
            outcomes["new"] += 1
        # The killed writer's lock is gone: the next put proceeds at once.
        t0 = time.monotonic()
        cache.put(k(1000 + trial), b"after")
        assert time.monotonic() - t0 < 5
        assert cache.get(k(1000 + trial)) == b"after"
        cache.delete(key)
    assert sum(outcomes.values()) == trials
    # Temp files of dead writers are tolerated; once old enough, a put removes them.
    leftovers = temp_files(root)
    for p in leftovers:
        t = time.time() - TEMP_MAX_AGE - 60
        os.utime(p, (t, t))
    cache.put(k(5000), b"cleanup")
    assert temp_files(root) == []
    assert cache.get(k(5000)) == b"cleanup"


@pytest.mark.slow
def test_stress_reader_races_evictor(tmp_path: Path) -> None:
    iterations = 10_000 if FULL else 1_000
    root = tmp_path / "c"
    size = 64 << 10
    max_bytes = 4 * size  # 16 keys, room for 4: nearly every put evicts
    keys = [k(i) for i in range(16)]
    stop = tmp_path / "stop"
    proc = _spawn(
        "evictor",
        {
            "root": str(root),
            "max_bytes": max_bytes,
            "keys": keys,
            "size": size,
            "seed": 1,
            "stop": str(stop),
        },
    )
    cache = DirectoryCache(root, max_bytes)
    hits = misses = 0
    try:
        _expect_line(proc, "ready")
        time.sleep(0.05)
        rng = random.Random(2)
        for _ in range(iterations):
            got = cache.get(rng.choice(keys))
            if got is None:
                misses += 1
            else:
                assert len(got) == size and worker.is_valid(got), "partial value"
                hits += 1
        stop.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            _kill(proc)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["errors"] == []
    assert hits > 0 and misses > 0
    assert result["evictions"] > 0 and result["puts"] > 0
    assert cache.stats()["bytes"] <= max_bytes
    assert temp_files(root) == []


# -- trust: another user, symlinks, FIFOs ------------------------------------------------


@pytest.fixture
def shared_base() -> Iterator[Path]:
    with _helpers.traversable_dir() as path:
        yield path


def test_entry_planted_by_another_uid_after_the_root_opened_up(
    shared_base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _helpers.need_root()
    root = shared_base / "c"
    cache = DirectoryCache(root)  # private when made
    cache.put(k(1), b"mine")
    root.chmod(0o777)  # later made writable by all (a careless chmod, a shared mount)
    key, planted = _helpers.make_blob("planted")
    _helpers.as_other_user(f"mkdir {root}/{key[:2]} && cat > {root}/{key[:2]}/{key}", planted)
    assert (root / key[:2] / key).stat().st_uid == _helpers.OTHER_UID
    caplog.set_level(logging.WARNING, logger="jaxaot")
    assert cache.get(key) is None  # never read: the root is no longer private
    assert cache.get(k(1)) is None
    cache.put(k(2), b"x")  # nor written
    assert not (root / k(2)[:2]).exists()
    assert len(warnings_of(caplog)) == 1 and "writable" in warnings_of(caplog)[0].getMessage()
    root.chmod(0o700)  # private again: our entries are served, the planted one is not
    assert cache.get(k(1)) == b"mine"
    assert cache.get(key) is None
    assert (root / key[:2] / key).exists()  # refused, left alone
    assert any(f"uid {_helpers.OTHER_UID}" in r.getMessage() for r in warnings_of(caplog))
    with pytest.raises(_directory.UntrustedEntryError):
        cache.peek(key)


def test_entry_file_of_another_uid_or_writable_by_others_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DirectoryCache(tmp_path / "c")
    for i in (1, 2, 3):
        cache.put(k(i), b"v%d" % i)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    cache.path_for(k(1)).chmod(0o666)
    assert cache.get(k(1)) is None
    assert cache.get(k(3)) == b"v3"
    if os.geteuid() == 0:
        os.chown(cache.path_for(k(3)), _helpers.OTHER_UID, -1)
        assert cache.get(k(3)) is None
    assert all("not signed" in r.getMessage() for r in warnings_of(caplog))


def test_signed_entries_lift_the_ownership_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "team-secret")
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    cache = DirectoryCache(root)  # accepted: every entry read is signature-checked
    cache.put(k(1), b"v")
    cache.path_for(k(1)).chmod(0o666)
    assert cache.get(k(1)) == b"v"
    monkeypatch.delenv("JAXAOT_CACHE_HMAC_KEY")
    assert cache.get(k(1)) is None  # without the key the same files are refused
    with pytest.raises(UnsafeCacheDirError):
        DirectoryCache(root)


def test_planted_pickle_never_runs(shared_base: Path) -> None:
    """An executable entry with a pickle that would create a sentinel, planted by
    another user once the root became writable by all: the sentinel never appears."""
    _helpers.need_root()
    import jax.numpy as jnp

    import jaxaot
    from jaxaot._store import _entry

    root = shared_base / "victim"
    cache = DirectoryCache(root)

    def body(x):
        return x * 2 + 1

    x = jnp.arange(3.0)
    with jaxaot.using_cache(cache):
        expected = jaxaot.component(body, key="planted-pickle")(x)
        jaxaot.wait_for_writes()
    exe_keys = []
    for key in cache.keys():
        blob = cache.path_for(key).read_bytes()
        if "executable" in _entry.verify(blob)[1]:
            exe_keys.append((key, blob))
    (exe_key, exe_blob), *_ = exe_keys
    sentinel = shared_base / "sentinel"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.mkdir, (str(sentinel),))

    forged = _entry.decode(exe_blob)
    forged.executable = __import__("pickle").dumps(Evil())
    planted = _entry.encode(forged)  # a sound checksum: only ownership can tell
    shutil.rmtree(root / exe_key[:2])
    root.chmod(0o777)
    _helpers.as_other_user(
        f"mkdir {root}/{exe_key[:2]} && cat > {root}/{exe_key[:2]}/{exe_key}", planted
    )
    with jaxaot.using_cache(cache):
        got = jaxaot.component(body, key="planted-pickle")(x)
    assert not sentinel.exists()
    assert jnp.allclose(got, expected)


def test_symlinked_shard_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    key = k(1, shard="ab")
    victim = outside / key
    victim.write_bytes(b"someone else's file")
    other = outside / k(2, shard="ab")
    other.write_bytes(b"another")
    cache = DirectoryCache(tmp_path / "c", max_bytes=1 << 20)
    (cache.root / "ab").symlink_to(outside)
    assert cache.get(key) is None  # not read through the link
    cache.put(k(3, shard="ab"), b"new")  # not written through it
    assert sorted(p.name for p in outside.iterdir()) == sorted([key, other.name])
    assert key not in cache.keys()
    assert cache.delete(key) is False
    cache.clear()
    for i in range(10, 20):  # eviction pressure
        cache.put(k(i), bytes(300 << 10))
    assert victim.read_bytes() == b"someone else's file" and other.read_bytes() == b"another"
    assert (cache.root / "ab").is_symlink()


def test_symlinked_quarantine_is_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    keep = elsewhere / "precious.txt"
    keep.write_bytes(b"keep me")
    cache = DirectoryCache(tmp_path / "c")
    (cache.root / "quarantine").symlink_to(elsewhere)
    cache.put(k(1), b"bad")
    cache.quarantine(k(1), check=check_stored)
    assert cache.get(k(1)) is None  # removed all the same (deleted, not moved)
    assert [p.name for p in elsewhere.iterdir()] == ["precious.txt"]
    cache.clear()
    assert keep.read_bytes() == b"keep me"


def _in_thread(fun: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Runs ``fun`` in a thread; fails (instead of hanging the suite) if it blocks."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fun())
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fun} blocked for {timeout}s"
    if errors:
        raise errors[0]
    return result[0]


@pytest.mark.parametrize("where", ["entry", "hits"])
def test_fifo_in_the_cache_never_blocks(tmp_path: Path, where: str) -> None:
    cache = DirectoryCache(tmp_path / "c")
    key = k(1)
    shard = cache.root / key[:2]
    shard.mkdir(mode=0o700)
    fifo = shard / (key if where == "entry" else key + ".hits")
    if where == "hits":
        cache.put(key, b"value")
    os.mkfifo(fifo, 0o600)
    try:
        got = _in_thread(lambda: cache.get(key))
        assert got == (None if where == "entry" else b"value")
        if where == "entry":
            assert _in_thread(lambda: cache.keys()) == []
            with pytest.raises(_directory.UntrustedEntryError):
                _in_thread(lambda: cache.peek(key))
            _in_thread(lambda: cache.put(key, b"value"))  # replaces the FIFO
            assert stat.S_ISREG(os.lstat(fifo).st_mode)
            assert cache.get(key) == b"value"
    finally:
        try:  # unblock a thread stuck in open() on the old code
            fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


def test_entry_signed_with_another_key_is_left_alone_by_quarantine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = DirectoryCache(tmp_path / "c")
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "writers-key")
    key, signed = _helpers.make_blob("signed")
    cache.put(key, signed)
    for reader in ("other-key", None):
        if reader is None:
            monkeypatch.delenv("JAXAOT_CACHE_HMAC_KEY")
        else:
            monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", reader)
        cache.quarantine(key, check=check_stored)
        assert cache.peek(key) == signed  # sound for its writers: kept
    damaged = bytearray(signed)
    damaged[40] ^= 1
    key2 = _helpers.make_blob("signed2")[0]
    cache.put(key2, bytes(damaged))
    cache.quarantine(key2, check=check_stored)  # damaged: quarantined, whatever the key
    assert cache.peek(key2) is None
    cache.quarantine(key, force=True)  # verify --fix --force
    assert cache.peek(key) is None
    assert len(list((cache.root / "quarantine").iterdir())) == 2


def test_value_larger_than_the_cap_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DirectoryCache(tmp_path / "c", max_bytes=100)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    for i in range(5):
        cache.put(k(i), bytes(200))
    assert cache.keys() == []
    warns = warnings_of(caplog)
    assert len(warns) == 1 and "max_bytes 100" in warns[0].getMessage()


_SIGNED_READER = """
import sys, jax.numpy as jnp, jaxaot
cache = jaxaot.DirectoryCache(sys.argv[1])
with jaxaot.using_cache(cache):
    y = jaxaot.component(lambda x: jnp.sin(x) + 2, key="signed-cache")(jnp.arange(5.0))
    jaxaot.wait_for_writes()
print(repr(y.tolist()))
"""


def test_a_process_without_the_key_leaves_a_signed_cache_intact(tmp_path: Path) -> None:
    root = tmp_path / "signed"
    env = {k: v for k, v in os.environ.items() if k != "JAXAOT_CACHE_HMAC_KEY"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])

    def run(key: str | None) -> str:
        proc_env = dict(env)
        if key is not None:
            proc_env["JAXAOT_CACHE_HMAC_KEY"] = key
        proc = subprocess.run(
            [sys.executable, "-c", _SIGNED_READER, str(root)],
            env=proc_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def entries() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and len(p.name) == 64}

    expected = run("team-secret")
    before = entries()
    assert len(before) == 2  # the entry and its executable, signed
    for reader in (None, "another-secret"):
        assert run(reader) == expected  # computed locally: a miss for this process
        assert entries() == before  # nothing quarantined, deleted or rewritten
        assert not (root / "quarantine").exists() or not list((root / "quarantine").iterdir())


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
def test_an_entry_that_cannot_be_read_is_said_once_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """An entry file that is there but fails to read (a bad sector, a file this
    user may not read) is a miss said once per cause, and is moved aside, so the
    next put writes a good one: before, it was a silent miss in every process,
    and puts kept the unreadable name."""
    cache = DirectoryCache(tmp_path / "c")
    cache.put(k(1), b"old")
    cache.put(k(2), b"other")
    read_all = _directory._safefs.read_all

    def failing(fd: int, size: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(k(1)):
            raise OSError(code, os.strerror(code))
        return read_all(fd, size)

    caplog.set_level(logging.WARNING, logger="jaxaot")
    monkeypatch.setattr(_directory._safefs, "read_all", failing)
    assert cache.get(k(1)) is None and cache.get(k(1)) is None
    assert cache.get(k(2)) == b"other"
    said = [r.getMessage() for r in warnings_of(caplog)]
    assert len(said) == 1 and errno.errorcode[code] in said[0] and k(1)[:16] in said[0], said
    assert cache.stats()["read_errors"] == 1  # then moved aside: a plain miss
    cache.put(k(1), b"new")
    monkeypatch.undo()
    assert cache.get(k(1)) == b"new"


_NO_ACCESS_RUN = """
import json, logging, sys
import jax.numpy as jnp, jaxaot
logging.basicConfig(level=logging.WARNING, format="WARNING-LINE %(message)s")
f = jaxaot.component(lambda x: jnp.sin(x) * 2)
got = [f(jnp.ones(n)).tolist() for n in (2, 3, 2)]
jaxaot.wait_for_writes()
print(json.dumps({"got": got, **jaxaot.stats()}))
"""


def test_a_cache_directory_this_user_cannot_open_is_said_once_with_its_owner_and_a_fix(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A cache directory the process cannot open (as after a run as root made the
    user's ``~/.cache/jaxaot`` private to root): one warning that names its owner
    and mode and says what to do. Before, two warnings claimed that its entries
    were "still read" and that an entry was "moved to the quarantine", neither of
    which a process that cannot open the directory does. The process here is
    root without the capability to override permissions, on a directory of mode
    0: the kernel refuses it as it refuses another user."""
    _helpers.need_root()
    root = tmp_path / "cache"
    DirectoryCache(root).put(k(1), b"v")
    root.chmod(0)
    procs = [
        subprocess.run(
            ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, *args],
            capture_output=True,
            text=True,
            env={**subprocess_env, "JAXAOT_CACHE_DIR": str(root)},
            timeout=300,
        )
        for args in (["-c", _NO_ACCESS_RUN], ["-m", "jaxaot", "cache", "ls"])
    ]
    root.chmod(0o700)
    proc, listing = procs
    # (The command does not pass over what it cannot see: it fails, and says why.)
    assert listing.returncode == 1 and "cannot open it (EACCES)" in listing.stderr, listing
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    import jax
    import jax.numpy as jnp

    want = [jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(n)).tolist() for n in (2, 3, 2)]
    assert out["got"] == want, out
    said = [line for line in proc.stderr.splitlines() if line.startswith("WARNING-LINE")]
    assert len(said) == 1, said
    assert "belongs to root (uid 0), mode 0, and this user" in said[0], said
    assert "cannot open it (EACCES)" in said[0] and "chown" in said[0], said
    assert "quarantine" not in said[0] and "still read" not in said[0], said
    assert DirectoryCache(root).keys() == [k(1)]  # nothing written, moved or removed


def test_the_no_access_warning_needs_no_user_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where there is no ``pwd`` module (not POSIX), the warning names uids: the
    caches import and work without it."""
    from jaxaot._caches._faults import no_access_text

    monkeypatch.setitem(sys.modules, "pwd", None)
    said = no_access_text("the cache", str(tmp_path), PermissionError(errno.EACCES, "denied"))
    assert f"belongs to uid {os.stat(tmp_path).st_uid}, mode " in said, said
    assert "cannot open it (EACCES)" in said
