"""A cache in a local directory, shared safely by many processes.

Layout::

  <root>/.lock                  writers' lock (``filelock``; released when its holder dies)
  <root>/<key[:2]>/<key>        one file per entry, mode 0600
  <root>/<key[:2]>/<key>.hits   one byte appended per hit (O_APPEND: safe across processes)
  <root>/<key[:2]>/.tmp-<pid>-<hex>   a write in flight (or left by a killed writer)
  <root>/quarantine/<key>.<ns>  entries moved aside by :meth:`DirectoryCache.quarantine`

Guarantees:

* Writes are atomic: a uniquely named temp file in the entry's directory is
  written, flushed, fsynced and renamed over the final name, so a reader sees a
  complete value or nothing, even if the writer is killed.
* Readers take no lock. A successful ``get`` sets the entry's mtime to now;
  the mtime is the least-recently-used clock.
* Writers serialize on ``<root>/.lock``. Under the lock a writer evicts the
  least recently used entries until its value fits, then writes, so entries
  never total more than ``max_bytes`` (plus the one temp file in flight).
* I/O faults (read-only or full disk, a vanished directory, permissions)
  never raise from ``get``/``put``/``delete``/``keys``/``clear``/``stats``: a
  read is a miss, a write is skipped with one warning per cause.
* The root must belong to this user and not be group- or world-writable,
  else :class:`UnsafeCacheDirError` is raised at construction: an entry
  becomes code in this process.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import filelock

from ._faults import WarnOnce
from ._protocol import check_key

__all__ = [
    "DEFAULT_DIRECTORY_BYTES",
    "DEFAULT_LOCK_TIMEOUT",
    "QUARANTINE_MAX_FILES",
    "TEMP_MAX_AGE",
    "DirectoryCache",
    "UnsafeCacheDirError",
]

logger = logging.getLogger("jaxaot")

#: Default cap on the total size of the entries in a directory cache (10 GiB).
DEFAULT_DIRECTORY_BYTES = 10 * 2**30
#: Temp files whose mtime is further than this (seconds) from now are orphans
#: of a killed writer and are removed during eviction.
TEMP_MAX_AGE = 3600.0
#: Seconds a writer waits for ``<root>/.lock`` before skipping its put.
DEFAULT_LOCK_TIMEOUT = 10.0
#: Quarantined entries kept at most; past this a bad entry is deleted instead.
QUARANTINE_MAX_FILES = 16
#: Entries dated further than this (seconds) in the future come from a skewed
#: clock; eviction takes them first rather than keeping them for ever.
FUTURE_SLACK = 86400.0

_TEMP_PREFIX = ".tmp-"
_HITS_SUFFIX = ".hits"
_LOCK_NAME = ".lock"
_QUARANTINE_DIR = "quarantine"
_HEX = frozenset("0123456789abcdef")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class UnsafeCacheDirError(PermissionError):
    """The cache directory could be written by someone else, so it is not used."""


class _Entry(NamedTuple):
    mtime: float
    size: int
    path: str


class _Scan(NamedTuple):
    entries: list[_Entry]
    temp_files: int
    temp_bytes: int


def _is_key_name(name: str, shard: str) -> bool:
    return 16 <= len(name) <= 128 and name.startswith(shard) and _HEX.issuperset(name)


def _is_shard_name(name: str) -> bool:
    return len(name) == 2 and _HEX.issuperset(name)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    return type(exc).__name__


def _check_safe(root: str) -> None:
    """Raises :class:`UnsafeCacheDirError` unless ``root`` is ours and private enough."""
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "jaxaot cache path is not a directory", root)
    getuid = getattr(os, "getuid", None)
    if getuid is not None and st.st_uid != getuid():
        raise UnsafeCacheDirError(
            f"jaxaot cache directory {root} is owned by uid {st.st_uid}, not by this user "
            f"(uid {getuid()}); refusing to load code another user could write"
        )
    if os.name == "posix" and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheDirError(
            f"jaxaot cache directory {root} is group- or world-writable "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 700 {root}` or choose another path"
        )


def _mkdir_private(path: str) -> None:
    """Creates ``path`` with mode 0700 (whatever the umask); an existing one is kept."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)


def _makedirs_private(path: str) -> None:
    """Creates ``path`` and any missing parents, each new one with mode 0700."""
    missing: list[str] = []
    head = path
    while head and not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for d in reversed(missing):
        _mkdir_private(d)


def write_and_replace(tmp: str, path: str, value: bytes, mode: int) -> None:
    """Writes ``value`` to the new file ``tmp`` (mode ``mode``, whatever the umask),
    fsyncs it and renames it onto ``path``; on any failure ``tmp`` is removed."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, mode)
    try:
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, mode)  # the umask may have narrowed the mode further
            view = memoryview(value)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class DirectoryCache(WarnOnce):
    """A byte cache in a local directory, safe to share between processes.

    Args:
      path: the cache root. Created (mode 0700) if missing; an existing one
        must belong to this user and not be group- or world-writable.
      max_bytes: the most bytes of entries kept on disk. Least recently used
        entries are evicted to make room; a value larger than this is not
        stored.
      lock_timeout: seconds a writer waits for the writers' lock before
        skipping its put with a warning.
      fallback_ok: if true, a root that cannot be created or is not a
        directory (an ``OSError`` other than :class:`UnsafeCacheDirError`)
        does not raise: the cache logs one warning, starts empty, and each
        ``put`` tries again (and is skipped while that fails).

    Raises:
      UnsafeCacheDirError: the root is owned by another user or writable by
        others.
      OSError: the root could not be created, or is not a directory, and
        ``fallback_ok`` is false.

    Example::

      cache = DirectoryCache("~/.cache/jaxaot", max_bytes=2 << 30)
      cache.put(key, blob)
      assert cache.get(key) == blob
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int = DEFAULT_DIRECTORY_BYTES,
        *,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        fallback_ok: bool = False,
    ) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(
                f"DirectoryCache: max_bytes must be a non-negative int, got {max_bytes!r}"
            )
        if not isinstance(lock_timeout, int | float) or lock_timeout < 0:
            raise ValueError(
                f"DirectoryCache: lock_timeout must be a non-negative number, got {lock_timeout!r}"
            )
        root = os.path.realpath(os.path.expanduser(os.fspath(path)))
        self._root = root
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.lock_timeout = float(lock_timeout)
        self._lock_path = os.path.join(root, _LOCK_NAME)
        self._filelock = filelock.FileLock(self._lock_path, timeout=self.lock_timeout, mode=0o600)
        self._warned: set[str] = set()
        self._state_lock = threading.Lock()
        self._counters = {
            "hits": 0,
            "misses": 0,
            "puts": 0,
            "evictions": 0,
            "put_errors": 0,
            "lock_timeouts": 0,
        }
        try:
            _makedirs_private(root)
            _check_safe(root)
        except UnsafeCacheDirError:
            raise  # never a fallback: the caller decides what to use instead
        except OSError as e:
            if not fallback_ok:
                raise
            self._warn_once("create", f"cannot use the cache directory ({_cause(e)}: {e})")

    def __repr__(self) -> str:
        return f"DirectoryCache({self._root!r}, max_bytes={self.max_bytes})"

    # -- paths ---------------------------------------------------------------

    def path_for(self, key: str) -> Path:
        """The file that holds (or would hold) the entry for ``key``.

        Raises:
          ValueError: ``key`` is not a valid cache key.
        """
        check_key(key)
        path = os.path.join(self._root, key[:2], key)
        # Keys are hex, so this cannot fail; it guards against a future key format.
        if os.path.dirname(os.path.dirname(os.path.normpath(path))) != self._root:
            raise ValueError(f"jaxaot cache key {key!r:.80} escapes the cache root {self._root}")
        return Path(path)

    # -- logging -------------------------------------------------------------

    def _log_prefix(self) -> str:
        return f"directory cache {self._root}"

    # -- protocol ------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """Returns the bytes stored under ``key``, or ``None`` (also on any I/O error)."""
        path = self.path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
        except OSError as e:
            if not isinstance(e, FileNotFoundError | NotADirectoryError):
                logger.debug("jaxaot directory cache %s: cannot open %s: %s", self._root, key, e)
            self._count("misses")
            return None
        try:
            size = os.fstat(fd).st_size
            chunks: list[bytes] = []
            got = 0
            while True:
                chunk = os.read(fd, max(size - got, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            data = b"".join(chunks)
            try:
                # On the descriptor: works even if an evictor unlinked the file meanwhile.
                os.utime(fd if os.utime in os.supports_fd else path)
            except OSError as e:
                logger.debug("jaxaot directory cache %s: cannot touch %s: %s", self._root, key, e)
        except OSError as e:
            logger.debug("jaxaot directory cache %s: cannot read %s: %s", self._root, key, e)
            self._count("misses")
            return None
        finally:
            os.close(fd)
        self._count("hits")
        self._record_hit(os.fspath(path))
        return data

    def _record_hit(self, path: str) -> None:
        try:
            fd = os.open(
                path + _HITS_SUFFIX,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_CLOEXEC | _O_NOFOLLOW,
                0o600,
            )
        except OSError:
            return  # a read-only cache still serves hits; the count is best effort
        try:
            os.write(fd, b".")
        except OSError:
            pass
        finally:
            os.close(fd)

    def hit_count(self, key: str) -> int:
        """How many times ``get`` served ``key`` (from any process) since it was written."""
        try:
            return os.stat(os.fspath(self.path_for(key)) + _HITS_SUFFIX).st_size
        except OSError:
            return 0

    @staticmethod
    def _forget_hits(path: str) -> None:
        try:
            os.unlink(path + _HITS_SUFFIX)
        except OSError:
            pass

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        """Stores ``value`` under ``key`` unless an entry is already there.

        An existing entry is kept (its access time refreshed). A value larger
        than ``max_bytes`` is not stored. I/O errors and a busy lock skip the
        put, with one warning per cause.
        """
        path = self.path_for(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"DirectoryCache.put: value must be bytes, got {type(value).__name__}")
        if not isinstance(value, bytes):
            value = bytes(value)
        if len(value) > self.max_bytes:
            logger.debug(
                "jaxaot directory cache %s: %s not stored, %d bytes > max_bytes %d",
                self._root,
                key,
                len(value),
                self.max_bytes,
            )
            return
        spath = os.fspath(path)
        if self._touch(spath):
            return
        try:
            _makedirs_private(self._root)
            with self._filelock:
                if self._touch(spath):
                    return
                shard = os.path.dirname(spath)
                _mkdir_private(shard)
                if not self._make_room(len(value)):
                    return
                self._write(spath, value)
        except filelock.Timeout:
            self._count("lock_timeouts")
            self._warn_once(
                "lock timeout",
                f"put of {key} skipped: the writers' lock {self._lock_path} was busy "
                f"for {self.lock_timeout:g}s",
            )
            return
        except OSError as e:
            self._count("put_errors")
            self._warn_once(_cause(e), f"put of {key} skipped ({_cause(e)}: {e})")
            return
        self._count("puts")

    def delete(self, key: str) -> bool:
        """Removes the entry under ``key``; returns whether one was removed."""
        path = self.path_for(key)
        self._forget_hits(os.fspath(path))
        try:
            os.unlink(path)
        except OSError as e:
            if not isinstance(e, FileNotFoundError | NotADirectoryError):
                logger.debug("jaxaot directory cache %s: cannot delete %s: %s", self._root, key, e)
            return False
        return True

    def keys(self) -> list[str]:
        """The keys of the stored entries (temp, lock and foreign files are ignored)."""
        return sorted(os.path.basename(e.path) for e in self._scan(clean=False).entries)

    def clear(self) -> None:
        """Removes every entry and every quarantined entry."""
        for e in self._scan(clean=True).entries:
            self._forget_hits(e.path)
            try:
                os.unlink(e.path)
            except OSError as exc:
                if not isinstance(exc, FileNotFoundError):
                    logger.debug(
                        "jaxaot directory cache %s: cannot delete %s: %s", self._root, e.path, exc
                    )
        qdir = os.path.join(self._root, _QUARANTINE_DIR)
        for name in self._listdir(qdir):
            try:
                os.unlink(os.path.join(qdir, name))
            except OSError:
                pass

    def stats(self) -> dict[str, Any]:
        """Entries, bytes, temp files on disk and this instance's counters."""
        scan = self._scan(clean=False)
        with self._state_lock:
            counters = dict(self._counters)
        return {
            "backend": "directory",
            "path": self._root,
            "entries": len(scan.entries),
            "bytes": sum(e.size for e in scan.entries),
            "max_bytes": self.max_bytes,
            "temp_files": scan.temp_files,
            **counters,
        }

    # -- extras --------------------------------------------------------------

    def access_time(self, key: str) -> float | None:
        """When ``key`` was last read or written (its mtime), or ``None`` if absent."""
        try:
            return os.stat(self.path_for(key), follow_symlinks=False).st_mtime
        except OSError:
            return None

    def quarantine(self, key: str) -> None:
        """Moves a bad entry out of the way (or deletes it); never raises for I/O errors.

        The entry goes to ``<root>/quarantine/<key>.<ns>`` for inspection; once
        that directory holds :data:`QUARANTINE_MAX_FILES` files, bad entries are
        deleted instead.
        """
        path = os.fspath(self.path_for(key))
        qdir = os.path.join(self._root, _QUARANTINE_DIR)
        try:
            _mkdir_private(qdir)
            if len(self._listdir(qdir)) < QUARANTINE_MAX_FILES:
                target = os.path.join(qdir, f"{key}.{time.time_ns()}")
                os.replace(path, target)
                self._forget_hits(path)
                try:
                    os.chmod(target, 0o600)
                except OSError:
                    pass
                logger.debug(
                    "jaxaot directory cache %s: quarantined %s to %s", self._root, key, target
                )
                return
        except FileNotFoundError:
            return
        except OSError as e:
            logger.debug("jaxaot directory cache %s: cannot quarantine %s: %s", self._root, key, e)
        if self.delete(key):
            logger.debug("jaxaot directory cache %s: deleted bad entry %s", self._root, key)

    # -- internals -------------------------------------------------------------

    def _touch(self, path: str) -> bool:
        """Refreshes an existing entry's access time; returns whether it exists."""
        try:
            os.utime(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            # Present but not touchable (a read-only disk): it still exists.
            return os.path.lexists(path)
        return True

    @staticmethod
    def _listdir(path: str) -> list[str]:
        try:
            return os.listdir(path)
        except OSError:
            return []

    def _scan(self, *, clean: bool) -> _Scan:
        """Lists entries (and counts temp files); tolerates files vanishing meanwhile.

        With ``clean``, temp files older than :data:`TEMP_MAX_AGE` are removed.
        """
        entries: list[_Entry] = []
        temps = 0
        temp_bytes = 0
        now = time.time()
        try:
            shards = [d.name for d in os.scandir(self._root) if _is_shard_name(d.name)]
        except OSError:
            return _Scan(entries, 0, 0)
        for shard in shards:
            sdir = os.path.join(self._root, shard)
            try:
                it = list(os.scandir(sdir))
            except OSError:
                continue
            for f in it:
                name = f.name
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if name.startswith(_TEMP_PREFIX):
                    if clean and abs(now - st.st_mtime) > TEMP_MAX_AGE:
                        try:
                            os.unlink(f.path)
                            logger.debug(
                                "jaxaot directory cache %s: removed orphan %s", self._root, f.path
                            )
                            continue
                        except OSError:
                            pass
                    temps += 1
                    temp_bytes += st.st_size
                elif _is_key_name(name, shard):
                    entries.append(_Entry(st.st_mtime, st.st_size, f.path))
        return _Scan(entries, temps, temp_bytes)

    def _make_room(self, incoming: int) -> bool:
        """Evicts least recently used entries until ``incoming`` more bytes fit.

        Called with the writers' lock held. Entries dated more than
        :data:`FUTURE_SLACK` ahead (a skewed clock) go first. Returns whether
        the value now fits.
        """
        scan = self._scan(clean=True)
        total = sum(e.size for e in scan.entries)
        if total + incoming <= self.max_bytes:
            return True
        horizon = time.time() + FUTURE_SLACK
        victims = sorted(
            scan.entries, key=lambda e: (e.mtime <= horizon, e.mtime if e.mtime <= horizon else 0.0)
        )
        evicted = 0
        for e in victims:
            if total + incoming <= self.max_bytes:
                break
            self._forget_hits(e.path)
            try:
                os.unlink(e.path)
                evicted += 1
            except FileNotFoundError:
                pass  # deleted by someone else meanwhile: the space is free all the same
            total -= e.size
        if evicted:
            self._count("evictions", evicted)
            logger.debug("jaxaot directory cache %s: evicted %d entries", self._root, evicted)
        return total + incoming <= self.max_bytes

    def _write(self, path: str, value: bytes) -> None:
        """Writes ``value`` to ``path`` atomically (temp file, fsync, rename)."""
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f"{_TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        write_and_replace(tmp, path, value, 0o600)
        _fsync_dir(directory)
