"""A cache in a local directory, shared safely by many processes.

The files it keeps (one per entry, sharded by the key's first two hex digits)
are described in ``_dirlayout``.

Guarantees:

* Writes are atomic: a uniquely named temp file in the entry's directory is
  written, flushed, fsynced and renamed over the final name, so a reader sees a
  complete value or nothing, even if the writer is killed.
* Readers take no lock. A successful ``get`` sets the entry's mtime to now;
  the mtime is the least-recently-used clock.
* Writers serialize on ``<root>/.lock``. Under the lock a writer evicts the
  least recently used entries until its value fits, then writes, so entries
  never total more than ``max_bytes`` (plus the one temp file in flight).
* I/O faults (read-only or full disk, a vanished directory, a directory this
  user cannot open) never raise from ``get``/``put``/``delete``/``keys``/
  ``clear``/``stats``: a read is a miss, a write is skipped, one warning per cause.
* Trust (see ``_trust``): without ``$JAXAOT_CACHE_HMAC_KEY``, the root must
  belong to this user and not be group- or world-writable, else
  :class:`UnsafeCacheDirError` is raised at construction: an entry becomes code
  in this process. The root is checked again on every call, and each shard
  directory and entry file before it is read: one that another user could have
  written is refused (a miss, one warning per cause) and left alone. With a key
  set, entries are signed and these ownership checks are not needed.
* Leases (``lease``, see ``_filelease``): a lock file beside the entry, locked
  with ``flock`` by the process making it; the operating system frees it the
  instant its holder dies. Lease files obey the same rules as entries (real
  files, trusted, never through a symlink); old ones are cleaned up with the
  temp files.
* Nothing inside the root is followed or opened unless it is a real directory
  or a regular file (see ``_safefs``): a symlinked shard or quarantine
  directory, a symlink, FIFO or device at an entry's name is never read,
  written or deleted through. ``clear``, eviction and quarantine act only on
  regular files inside the root.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock

from . import _dirlayout, _filelease, _safefs
from ._dirlayout import QUARANTINE_MAX_FILES, TEMP_MAX_AGE
from ._faults import WarnOnce, errno_cause, lost_write, no_access_text, write_fault_text
from ._protocol import (
    INDEX_ITEM_BYTES,
    INDEX_ITEMS,
    EntryCheck,
    Held,
    Lease,
    check_key,
    is_removable,
)
from ._safefs import NotRegularFileError, makedirs_private, open_dir, stat_nofollow
from ._trust import (
    Refused,
    UnsafeCacheDirError,
    UntrustedEntryError,
    check_safe_root,
    check_trusted,
    signing,
    untrusted_writer,
)

__all__ = [
    "DEFAULT_DIRECTORY_BYTES",
    "DEFAULT_LOCK_TIMEOUT",
    "QUARANTINE_MAX_FILES",
    "TEMP_MAX_AGE",
    "DirectoryCache",
    "UnsafeCacheDirError",
    "UntrustedEntryError",
]

logger = logging.getLogger("jaxaot")

#: Default cap on the total size of the entries in a directory cache (10 GiB).
DEFAULT_DIRECTORY_BYTES = 10 * 2**30
#: Seconds a writer waits for ``<root>/.lock`` before skipping its put.
DEFAULT_LOCK_TIMEOUT = 10.0
#: Seconds after a put found the writers' lock busy for a whole wait during which
#: puts skip at once rather than wait again: a stopped or hung writer would
#: otherwise cost every entry the whole wait (a write skipped is only recomputed).
LOCK_BUSY_BACKOFF = 60.0

_LOCK_NAME = ".lock"


_Refused = Refused


def _not_a_real_dir(e: OSError) -> bool:
    """``open_dir`` failed because the name is a symlink or not a directory."""
    return e.errno in (errno.ELOOP, errno.ENOTDIR)


class DirectoryCache(WarnOnce):
    """A byte cache in a local directory, safe to share between processes.

    Args:
      path: the cache root. Created (mode 0700) if missing; an existing one
        must belong to this user and not be group- or world-writable (unless
        ``$JAXAOT_CACHE_HMAC_KEY`` is set: then entries are signed).
      max_bytes: the most bytes of entries kept on disk. Least recently used
        entries are evicted to make room; a value larger than this is not
        stored (one warning).
      lock_timeout: seconds a writer waits for the writers' lock before
        skipping its put with a warning.
      fallback_ok: if true, a root that cannot be created or is not a
        directory (an ``OSError`` other than :class:`UnsafeCacheDirError`)
        does not raise: the cache logs one warning, starts empty, and each
        ``put`` tries again (and is skipped while that fails).

    Raises:
      UnsafeCacheDirError: the root is owned by another user or writable by
        others, and entries are not signed.
      OSError: the root could not be created, or is not a directory, and
        ``fallback_ok`` is false.
      ValueError: a bad argument, or ``$JAXAOT_CACHE_HMAC_KEY`` set but empty.

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
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"DirectoryCache: path must be a str or a path, got {path!r:.80}")
        head, sep, _ = os.fspath(path).partition("://")
        if sep and head.isalnum():
            raise ValueError(
                f"DirectoryCache: {os.fspath(path)!r:.80} is a URL, not a directory: "
                "RedisCache(url) or FsspecCache(url) opens a store, as JAXAOT_CACHE=url does"
            )
        signing()  # an empty $JAXAOT_CACHE_HMAC_KEY is a configuration error: raise now
        root = os.path.realpath(os.path.expanduser(os.fspath(path)))
        self._root = root
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.lock_timeout = float(lock_timeout)
        self._lock_path = os.path.join(root, _LOCK_NAME)
        self._filelock = filelock.FileLock(self._lock_path, timeout=self.lock_timeout, mode=0o600)
        self._lock_busy_until = 0.0
        self._state_lock = threading.Lock()
        self._counters = {
            "hits": 0,
            "misses": 0,
            "puts": 0,
            "evictions": 0,
            "put_errors": 0,
            "lock_timeouts": 0,
            "refused": 0,
            "read_errors": 0,
        }
        try:
            makedirs_private(root)
            check_safe_root(root)
        except UnsafeCacheDirError:
            raise  # never a fallback: the caller decides what to use instead
        except OSError as e:
            if not fallback_ok:
                raise
            self._warn_once(
                errno_cause(e), f"cannot use the cache directory ({errno_cause(e)}: {e})"
            )

    def __repr__(self) -> str:
        return f"DirectoryCache({self._root!r}, max_bytes={self.max_bytes})"

    def path_for(self, key: str) -> Path:
        """The file that holds (or would hold) the entry for ``key`` (``ValueError``
        for a key that is not a valid cache key)."""
        check_key(key)
        path = os.path.join(self._root, key[:2], key)
        # Keys are hex, so this cannot fail; it guards against a future key format.
        if os.path.dirname(os.path.dirname(os.path.normpath(path))) != self._root:
            raise ValueError(f"jaxaot cache key {key!r:.80} escapes the cache root {self._root}")
        return Path(path)

    def _log_prefix(self) -> str:
        return f"directory cache {self._root}"

    # -- trusted descriptors -----------------------------------------------------

    def _trusted(self, st: os.stat_result, what: str) -> None:
        check_trusted(st, what)

    @contextlib.contextmanager
    def _root_dir(self, *, create: bool = False) -> Iterator[int]:
        """A descriptor of the root, checked again on every use (it may have been opened
        to others since)."""
        if create:
            makedirs_private(self._root)
        try:
            fd = open_dir(self._root)
        except OSError as e:
            if _not_a_real_dir(e):
                raise _Refused(
                    "root not a directory",
                    f"the cache root {self._root} is no longer a real directory; not using it",
                ) from None
            if isinstance(e, PermissionError):
                raise _Refused("no access", no_access_text("the cache", self._root, e)) from None
            raise
        try:
            self._trusted(os.fstat(fd), f"root directory {self._root}")
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _shard_dir(self, root_fd: int, shard: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of the shard directory: a real directory only this user writes."""
        try:
            fd = open_dir(shard, root_fd, create=create)
        except OSError as e:
            if _not_a_real_dir(e):
                raise _Refused(
                    "shard not a directory",
                    f"{os.path.join(self._root, shard)} is a symlink or not a directory; "
                    "not following it",
                ) from None
            if isinstance(e, PermissionError):
                where = os.path.join(self._root, shard)
                raise _Refused("no access", no_access_text(where, where, e)) from None
            raise
        try:
            self._trusted(os.fstat(fd), f"shard directory {os.path.join(self._root, shard)}")
            yield fd
        finally:
            os.close(fd)

    def _refused(self, key: str, r: _Refused) -> None:
        self._count("refused")
        self._warn_once(r.cause, f"{r} (entry {key[:16]}: a miss)")

    def _open_entry(self, shard_fd: int, key: str) -> tuple[int, os.stat_result]:
        """Opens the entry file of ``key``: a regular file this user alone could write.

        Raises:
          _Refused: it is not a regular file, or not trusted.
          OSError: it cannot be opened (``FileNotFoundError`` when absent).
        """
        try:
            fd, st = _safefs.open_regular(key, shard_fd)
        except NotRegularFileError as e:
            raise _Refused(
                "entry not a regular file",
                f"{os.path.join(self._root, key[:2], key)} is {e.strerror}; not opening it",
            ) from None
        try:
            self._trusted(st, f"entry file {os.path.join(self._root, key[:2], key)}")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    # -- protocol ------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """Returns the bytes stored under ``key``, or ``None`` (also on any I/O error,
        and for an entry that another user could have written)."""
        check_key(key)
        try:
            with self._root_dir() as rfd, self._shard_dir(rfd, key[:2]) as sfd:
                fd, st = self._open_entry(sfd, key)
                try:
                    data = _safefs.read_all(fd, st.st_size)
                    try:
                        # On the descriptor: works even if an evictor unlinked the file meanwhile.
                        os.utime(fd)
                    except OSError as e:
                        logger.debug(
                            "jaxaot directory cache %s: cannot touch %s: %s", self._root, key, e
                        )
                finally:
                    os.close(fd)
                _dirlayout.record_hit(sfd, key)
        except _Refused as r:
            self._refused(key, r)
            self._count("misses")
            return None
        except OSError as e:
            if not isinstance(e, FileNotFoundError | NotADirectoryError):
                self._unreadable(key, e)
            self._count("misses")
            return None
        self._count("hits")
        return data

    def _unreadable(self, key: str, e: OSError) -> None:
        """An entry that is there but cannot be read: said once per cause; an entry
        file that fails alone (EIO, no permission) is moved to the quarantine, so
        that the next put writes a good one (a put keeps the name it finds)."""
        self._count("read_errors")
        cause = errno_cause(e)
        bad_file = e.errno in (errno.EIO, errno.EACCES, errno.EPERM)
        then = "moved to the quarantine; it is made again here" if bad_file else "made here"
        self._warn_once(
            f"read {cause}",
            f"cannot read entry {key[:16]} ({cause}: {e.strerror or e}); {then}",
        )
        if bad_file:
            self.quarantine(key, force=True)

    def peek(self, key: str) -> bytes | None:
        """The stored bytes of ``key`` without using it (no hit counted, no access time
        refreshed), for inspection; ``None`` if there is no entry.

        Raises:
          UntrustedEntryError: the entry, its directory or the root could have been
            written by another user (and entries are not signed), or the name is a
            symlink, FIFO, device or directory: it is not read.
          OSError: it cannot be read.
        """
        check_key(key)
        try:
            with self._root_dir() as rfd, self._shard_dir(rfd, key[:2]) as sfd:
                fd, st = self._open_entry(sfd, key)
                try:
                    return _safefs.read_all(fd, st.st_size)
                finally:
                    os.close(fd)
        except _Refused as r:
            raise UntrustedEntryError(errno.EPERM, str(r), key) from None
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _stat_in_shard(self, key: str, name: str) -> os.stat_result | None:
        """``lstat`` of ``name`` in ``key``'s shard (never through a symlink), or ``None``."""
        check_key(key)
        try:
            with self._root_dir() as rfd, self._shard_dir(rfd, key[:2]) as sfd:
                return stat_nofollow(name, sfd)
        except (_Refused, OSError):
            return None

    def hit_count(self, key: str) -> int:
        """How many times ``get`` served ``key`` (from any process) since it was written."""
        st = self._stat_in_shard(key, key + _dirlayout.HITS_SUFFIX)
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else 0

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        """Stores ``value`` under ``key`` unless an entry is already there.

        An existing entry is kept (its access time refreshed); a symlink, FIFO or
        other non-file at its name, or a file another user could have written, is
        replaced. A value larger than ``max_bytes`` is not stored (one warning).
        I/O errors and a busy lock skip the put, with one warning per cause.
        """
        check_key(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"DirectoryCache.put: value must be bytes, got {type(value).__name__}")
        if not isinstance(value, bytes):
            value = bytes(value)
        if len(value) > self.max_bytes:
            self._count("put_errors")
            lost_write()
            self._warn_once(
                "larger than max_bytes",
                f"put of {key} skipped: {len(value)} bytes is more than the whole cache may hold "
                f"(max_bytes {self.max_bytes}; $JAXAOT_CACHE_MAX_BYTES for the default cache)",
            )
            return
        shard = key[:2]
        try:
            with self._root_dir(create=True) as rfd:
                if self._touch(rfd, key):
                    return
                _dirlayout.check_lock_file(rfd, _LOCK_NAME, self._lock_path)
                # While the lock has just been found busy for a whole wait (a
                # stopped or hung writer holds it), a put does not wait again.
                busy = time.monotonic() < self._lock_busy_until
                with self._filelock.acquire(timeout=0 if busy else None):
                    self._lock_busy_until = 0.0
                    with self._shard_dir(rfd, shard, create=True) as sfd:
                        if self._touch_in(sfd, key):
                            return
                    fits, evicted = _dirlayout.evict(rfd, self._root, len(value), self.max_bytes)
                    if evicted:
                        self._count("evictions", evicted)
                    if not fits:
                        lost_write()
                        self._warn_once(
                            "no room",
                            f"put of {key[:16]} skipped: {len(value)} bytes do not fit beside "
                            "the notes and leases the cache holds (max_bytes "
                            f"{self.max_bytes}; $JAXAOT_CACHE_MAX_BYTES for the default cache)",
                        )
                        return
                    with self._shard_dir(rfd, shard, create=True) as sfd:
                        self._write(sfd, key, value)
        except filelock.Timeout:
            self._count("lock_timeouts")
            lost_write()
            if time.monotonic() >= self._lock_busy_until:
                self._lock_busy_until = time.monotonic() + LOCK_BUSY_BACKOFF
            self._warn_once(
                "lock timeout",
                f"put of {key} skipped: the writers' lock {self._lock_path} was busy "
                f"for {self.lock_timeout:g}s; while it stays busy, writes are skipped "
                "without waiting",
            )
            return
        except _Refused as r:
            self._count("put_errors")
            lost_write()
            self._warn_once(r.cause, f"{r} (put of {key[:16]} skipped)")
            return
        except OSError as e:
            self._count("put_errors")
            lost_write()
            cause = errno_cause(e)
            self._warn_once(cause, write_fault_text(cause, e, f"put of {key}"))
            return
        self._count("puts")

    def delete(self, key: str) -> bool:
        """Removes the entry under ``key``; returns whether one was removed."""
        check_key(key)
        try:
            with self._root_dir() as rfd, self._shard_dir(rfd, key[:2]) as sfd:
                _dirlayout.forget_hits(sfd, key)
                st = stat_nofollow(key, sfd)
                if stat.S_ISDIR(st.st_mode):
                    return False
                return _safefs.unlink(key, sfd)
        except _Refused as r:
            self._warn_once(r.cause, f"{r} (delete of {key[:16]} skipped)")
            return False
        except OSError as e:
            if not isinstance(e, FileNotFoundError | NotADirectoryError):
                logger.debug("jaxaot directory cache %s: cannot delete %s: %s", self._root, key, e)
            return False

    def keys(self) -> list[str]:
        """The keys of the stored entries (temp, lock and foreign files are ignored)."""
        return sorted(e.name for e in self._scan_root(clean=False).entries)

    def unlisted(self) -> list[str]:
        """The directories of the cache this process cannot list (the root, or
        shard directories, by their permissions): the entries in them are not in
        ``keys()``, and cannot be read, checked or removed from here."""
        try:
            with self._root_dir() as rfd:
                return _dirlayout.unlisted(rfd, self._root)
        except _Refused:
            return [self._root]
        except FileNotFoundError:
            return []
        except OSError:
            return [self._root]

    def clear(self) -> None:
        """Removes every entry, every quarantined entry and the files kept beside
        them (notes; leases no process holds) (regular files inside the root only:
        a symlinked shard or quarantine directory is not followed)."""
        try:
            with self._root_dir() as rfd:
                listed = _dirlayout.scan(rfd, self._root, clean=True, everything=True)
                for e in listed.entries:
                    _dirlayout.unlink_entry(rfd, self._root, e)
                try:
                    _dirlayout.clear_quarantine(rfd)
                except OSError as e:
                    if _not_a_real_dir(e):
                        self._warn_once(
                            "quarantine not a directory",
                            f"{os.path.join(self._root, _dirlayout.QUARANTINE_DIR)} is a "
                            "symlink or not a directory; not clearing through it",
                        )
        except _Refused as r:
            self._warn_once(r.cause, f"{r} (clear skipped)")
        except OSError as e:
            logger.debug("jaxaot directory cache %s: cannot clear: %s", self._root, e)

    def tidy(self) -> None:
        """Removes what no entry needs any more: temp and lease files left by dead
        writers, and notes whose entries are all gone (see ``_dirlayout.scan``)."""
        self._scan_root(clean=True)

    def stats(self) -> dict[str, Any]:
        """Entries, bytes, temp files on disk and this instance's counters."""
        scan = self._scan_root(clean=False)
        with self._state_lock:
            counters = dict(self._counters)
        return {
            "backend": "directory",
            "path": self._root,
            "entries": len(scan.entries),
            "bytes": sum(e.size for e in scan.entries),
            "other_bytes": scan.other_bytes,
            "max_bytes": self.max_bytes,
            "temp_files": scan.temp_files,
            **counters,
        }

    # -- extras --------------------------------------------------------------

    def lease(self, key: str, ttl: float) -> Lease | Held | None:
        """The lease on ``key`` (see ``_protocol.Leasing``): a lock file beside the
        entry, free the moment its holder dies (so ``ttl`` is not needed); ``None``
        (one warning per cause) where none can be taken (a read-only or full disk,
        an untrusted lease file or one that is not a regular file)."""
        check_key(key)
        where = os.path.join(self._root, key[:2], key + _filelease.LEASE_SUFFIX)
        try:
            with self._root_dir(create=True) as rfd:
                with self._shard_dir(rfd, key[:2], create=True) as sfd:
                    got = _filelease.take(sfd, key, self._trusted, where)
        except _Refused as r:
            # The same cause as a put's (a refused shard, say): one warning for both.
            self._warn_once(r.cause, f"{r} (no lease on {key[:16]}: made here)")
            return None
        except NotRegularFileError:
            self._warn_once(
                "lease not a regular file", f"cannot lock {where} (not a regular file); made here"
            )
            return None
        except OSError as e:
            cause = errno_cause(e)
            self._warn_once(cause, write_fault_text(cause, e, f"lease {where}"))
            return None
        return got

    def note(self, tag: str, key: str, item: bytes) -> None:
        """Notes ``item`` about ``key`` under ``tag`` (see ``_protocol.Indexing``), in
        ``<root>/<tag[:2]>/<tag>.index``; best effort (a fault skips it)."""
        check_key(tag)
        check_key(key)
        if len(item) > INDEX_ITEM_BYTES:
            return
        where = os.path.join(self._root, tag[:2], tag + _dirlayout.INDEX_SUFFIX)
        try:
            with self._root_dir(create=True) as rfd:
                with self._shard_dir(rfd, tag[:2], create=True) as sfd:
                    _dirlayout.add_note(
                        sfd, tag, key, bytes(item), lambda st: self._trusted(st, where)
                    )
        except (_Refused, OSError) as e:
            logger.debug("jaxaot directory cache %s: no note in %s: %s", self._root, where, e)

    def notes(self, tag: str) -> list[tuple[str, bytes]]:
        """The notes under ``tag`` of stored entries, most recent first (see
        ``_protocol.Indexing``): no entry is read, none counts a hit or is touched."""
        check_key(tag)
        where = os.path.join(self._root, tag[:2], tag + _dirlayout.INDEX_SUFFIX)
        try:
            with self._root_dir() as rfd, self._shard_dir(rfd, tag[:2]) as sfd:
                noted = _dirlayout.read_notes(sfd, tag, lambda st: self._trusted(st, where))
        except (_Refused, OSError) as e:
            if not isinstance(e, FileNotFoundError | NotADirectoryError):
                logger.debug("jaxaot directory cache %s: cannot read %s: %s", self._root, where, e)
            return []
        out: list[tuple[str, bytes]] = []
        seen: set[str] = set()
        for key, item in reversed(noted):
            if key in seen:
                continue
            seen.add(key)
            st = self._stat_in_shard(key, key)
            if st is not None and stat.S_ISREG(st.st_mode):
                out.append((key, item))
                if len(out) >= INDEX_ITEMS:
                    break
        return out

    def access_time(self, key: str) -> float | None:
        """When ``key`` was last read or written (its mtime), or ``None`` if absent."""
        st = self._stat_in_shard(key, key)
        return st.st_mtime if st is not None and stat.S_ISREG(st.st_mode) else None

    def quarantine(self, key: str, *, force: bool = False, check: EntryCheck | None = None) -> None:
        """Moves a bad entry out of the way (or deletes it); never raises for I/O errors.

        The entry goes to ``<root>/quarantine/<key>.<ns>`` for inspection; once
        that directory holds :data:`QUARANTINE_MAX_FILES` files (or if it is not a
        real directory), bad entries are deleted instead.

        An entry that is sound but cannot be checked here (signed with another
        key, unsigned while this process has a key, signed while it has none, or
        of another format version) is left alone unless ``force``: it is good
        for the processes that wrote it.
        """
        check_key(key)
        try:
            with self._root_dir() as rfd, self._shard_dir(rfd, key[:2]) as sfd:
                if not force and not self._removable(sfd, key, check):
                    logger.debug(
                        "jaxaot directory cache %s: left %s alone (sound, but not checkable by "
                        "this process)",
                        self._root,
                        key,
                    )
                    return
                if _dirlayout.move_to_quarantine(rfd, sfd, self._root, key):
                    return
        except FileNotFoundError:
            return
        except _Refused as r:
            self._warn_once(r.cause, f"{r} (quarantine of {key[:16]} skipped)")
            return
        except OSError as e:
            logger.debug("jaxaot directory cache %s: cannot quarantine %s: %s", self._root, key, e)
        if self.delete(key):
            logger.debug("jaxaot directory cache %s: deleted bad entry %s", self._root, key)

    # -- internals -------------------------------------------------------------

    def _removable(self, shard_fd: int, key: str, check: EntryCheck | None) -> bool:
        """Whether the stored bytes of ``key`` may be quarantined: anything but a sound
        entry that this process cannot check (see :meth:`quarantine`)."""
        try:
            data, _ = _safefs.read_regular(key, shard_fd)
        except NotRegularFileError:
            return True  # not an entry at all
        return is_removable(key, data, check)

    def _touch(self, root_fd: int, key: str) -> bool:
        """Refreshes an existing entry's access time; returns whether it exists."""
        try:
            with self._shard_dir(root_fd, key[:2]) as sfd:
                return self._touch_in(sfd, key)
        except (FileNotFoundError, _Refused):
            return False

    def _touch_in(self, shard_fd: int, key: str) -> bool:
        """:meth:`_touch` within the shard: only a trusted regular file counts."""
        try:
            st = stat_nofollow(key, shard_fd)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False  # a symlink, FIFO...: replaced by the write
        if untrusted_writer(st) is not None and not signing():
            return False  # planted by someone else: replaced by the write
        try:
            os.utime(key, dir_fd=shard_fd, follow_symlinks=False)
        except OSError:
            pass  # present but not touchable (a read-only disk): it still exists
        return True

    def _scan_root(self, *, clean: bool) -> _dirlayout.Scan:
        try:
            with self._root_dir() as rfd:
                return _dirlayout.scan(rfd, self._root, clean=clean)
        except _Refused as r:
            self._warn_once(r.cause, str(r))
        except OSError:
            pass
        return _dirlayout.Scan([], 0, 0)

    def _write(self, shard_fd: int, key: str, value: bytes) -> None:
        """Writes ``value`` as the entry ``key`` atomically (temp file, fsync, rename),
        within the shard's descriptor."""
        _safefs.write_new_and_replace(_dirlayout.temp_name(), key, value, 0o600, dir_fd=shard_fd)
        _safefs.fsync_dir(shard_fd)
