"""Leases on a local (or mounted) filesystem: a lock file beside each entry.

``<shard>/<key>.lease`` is locked with ``flock`` by the process making the
entry. The operating system drops the lock the moment its holder dies
(killed, out of memory), so a dead holder's lease is free at once and needs no
expiry, and no renewal: a process holding only file leases runs no heartbeat
thread. The file holds the lease's record (``_lease``): who holds it, and,
once it is released, ``done`` for :data:`~._lease.DONE_SECONDS`, so that
waiters stop waiting at once even if the entry could not be written.

A lease file is opened through the shard's descriptor with ``O_NOFOLLOW |
O_NONBLOCK`` (never through a symlink, never a FIFO), must be a regular file,
and is held to the same trust rules as entries (the caller's ``trusted``). Lease
files older than an hour are removed by the directory cache's clean-up
(``_dirlayout.scan``) unless they are locked (:func:`is_held`). A lock taken
on a file that was removed meanwhile is dropped and taken again on the new one.

On network filesystems the locks are as reliable as the filesystem's own
(``flock`` over NFS uses its byte-range locks). Nothing here imports JAX.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable

from . import _lease
from ._lease import LEASE_SUFFIX, Record
from ._protocol import Held
from ._safefs import NotRegularFileError, stat_nofollow

try:
    import fcntl
except ImportError:  # no flock (Windows): no leases, entries are made as before
    fcntl = None  # type: ignore[assignment]

__all__ = ["LEASE_SUFFIX", "FileLease", "available", "is_held", "take"]

logger = logging.getLogger("jaxaot")

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_MAX = 4096

#: Checks a lease file's ``fstat`` (raises to refuse it).
Trusted = Callable[[os.stat_result, str], None]


def is_held(shard_fd: int, name: str) -> bool:
    """Whether the lease file ``name`` is locked by a live process (never raises:
    a file that cannot be opened or locked counts as held, and is left alone)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, dir_fd=shard_fd)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # drops the lock, if it was taken here
    return False


def available() -> bool:
    """Whether this platform has ``flock``."""
    return fcntl is not None


class FileLease:
    """A held lease: the locked file's descriptor and the record written into it.
    It never expires while its holder lives, so it needs no renewal."""

    expires = False

    def __init__(self, fd: int, key: str, record: Record, where: str) -> None:
        self.key = key
        self.holder = record.holder
        self._fd: int | None = fd
        self._record = record
        self._where = where
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FileLease({self._where!r}, {self.holder!r})"

    def renew(self) -> bool:
        """Touches the file (so that clean-up leaves it alone); the lock itself
        lasts as long as this process."""
        with self._lock:
            if self._fd is None:
                return False
            try:
                os.utime(self._fd)
            except OSError:
                pass  # a read-only or vanished file: the lock still holds
            return True

    def release(self) -> None:
        """Writes ``done`` into the file, then unlocks and closes it."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            _write(fd, self._record.done(expiring=False))
        except OSError as e:
            logger.debug("jaxaot: could not mark lease %s done: %s", self._where, e)
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            os.close(fd)


def _write(fd: int, record: Record) -> None:
    data = record.text().encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read(fd: int) -> Record | None:
    try:
        return _lease.parse(os.pread(fd, _READ_MAX, 0))
    except OSError:
        return None


def _open(shard_fd: int, name: str, mode: int) -> tuple[int, os.stat_result]:
    """Opens (creating it with ``mode`` if missing) the regular file ``name`` in the shard.

    Raises:
      NotRegularFileError: a symlink, FIFO, directory... at that name, or a hard
        link to another file (another member of a group's store could point it
        at a file of this user's, which the lease would write).
      OSError: any other failure.
    """
    flags = os.O_RDWR | os.O_CREAT | _O_CLOEXEC | _O_NOFOLLOW | _O_NONBLOCK
    created = True
    try:
        try:
            fd = os.open(name, flags | os.O_EXCL, mode, dir_fd=shard_fd)
        except FileExistsError:
            created = False
            fd = os.open(name, flags, mode, dir_fd=shard_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EEXIST):
            raise NotRegularFileError(e.errno, "not a regular file", name) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        raise NotRegularFileError(errno.EINVAL, "not a regular file of its own", name)
    if created and stat.S_IMODE(st.st_mode) != mode:
        with contextlib.suppress(OSError):
            os.fchmod(fd, mode)  # the umask narrowed it (a group's store needs it writable)
            st = os.fstat(fd)
    return fd, st


def take(
    shard_fd: int, key: str, trusted: Trusted, where: str, *, mode: int = 0o600
) -> FileLease | Held:
    """The lease on ``key``, whose lock file is in the directory ``shard_fd``: a
    :class:`FileLease` if this process now holds it, else who does (a
    :class:`Held`; ``done`` while a released lease's mark is fresh).

    Raises:
      NotRegularFileError: the lease's name is not a regular file.
      OSError: the file cannot be opened, locked or written (no lease).
      Exception: whatever ``trusted`` raises for a file it refuses.
    """
    if fcntl is None:
        raise OSError(errno.ENOSYS, "no flock on this platform")
    name = key + LEASE_SUFFIX
    for _ in range(8):
        fd, st = _open(shard_fd, name, mode)
        try:
            trusted(st, f"lease file {where}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read(fd)
                return Held(record.holder if record is not None else "?", done=False)
            # Locked; but a clean-up may have removed the file between our open and
            # our lock: then the lock guards nothing, and we try the new file.
            try:
                now = stat_nofollow(name, shard_fd)
            except FileNotFoundError:
                continue
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue
            record = _read(fd)
            fresh = time.time() - os.fstat(fd).st_mtime < _lease.DONE_SECONDS
            if record is not None and record.state == _lease.DONE and fresh:
                return Held(record.holder, done=True)
            mine = _lease.new_record()
            _write(fd, mine)
            lease = FileLease(fd, key, mine, where)
            fd = -1  # the lease owns it now
            if record is not None and record.state == _lease.MAKING:
                logger.debug(
                    "jaxaot: lease %s: its holder %s died before it was done", where, record.holder
                )
            return lease
        finally:
            if fd >= 0:
                os.close(fd)  # also drops a lock taken on it
    raise OSError(errno.EAGAIN, "the lease file kept being replaced", name)
