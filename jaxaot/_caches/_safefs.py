"""File operations inside a cache root that never follow a symlink, never open a
FIFO, device or socket, and never act outside the root.

Every path below the root is reached through directory descriptors opened with
``O_NOFOLLOW | O_DIRECTORY``, so a symlinked shard or quarantine directory is
refused rather than followed; files are ``lstat``-ed and must be regular before
they are opened, are opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO swapped in
meanwhile cannot block the open) and are ``fstat``-ed again after opening.
Writes create a new temp file (``O_CREAT | O_EXCL | O_NOFOLLOW``) and rename it
within its directory descriptor.

This module does not import JAX.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

__all__ = [
    "NotRegularFileError",
    "makedirs_private",
    "fsync_dir",
    "open_dir",
    "open_regular",
    "opened_dir",
    "read_all",
    "read_regular",
    "stat_nofollow",
    "unlink",
    "write_new_and_replace",
]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC


class NotRegularFileError(OSError):
    """A name in the cache is a symlink, FIFO, device, socket or directory, not a file."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(name: str, mode: int) -> NotRegularFileError:
    return NotRegularFileError(errno.EINVAL, f"{_kind(mode)}, not a regular file", name)


def open_dir(name: str, dir_fd: int | None = None, *, create: bool = False) -> int:
    """A descriptor of the directory ``name`` (relative to ``dir_fd``), never through a
    symlink. With ``create``, a missing one is made with mode 0700 (whatever the umask).

    Raises:
      OSError: missing (and not ``create``), a symlink (``ELOOP``), not a directory
        (``ENOTDIR``), or any other failure.
    """
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
    made = True
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        made = False
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    if made:
        try:
            os.fchmod(fd, 0o700)  # the umask may have narrowed it; never widened
        except OSError:
            pass
    return fd


@contextlib.contextmanager
def opened_dir(name: str, dir_fd: int | None = None, *, create: bool = False) -> Iterator[int]:
    """:func:`open_dir` as a context manager that closes the descriptor."""
    fd = open_dir(name, dir_fd, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def stat_nofollow(name: str, dir_fd: int) -> os.stat_result:
    """``lstat`` of ``name`` in ``dir_fd``."""
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def open_regular(name: str, dir_fd: int, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """Opens the regular file ``name`` in ``dir_fd``; returns the descriptor and its ``fstat``.

    Raises:
      NotRegularFileError: ``name`` is a symlink, FIFO, device, socket or directory
        (it is not opened, or closed again at once if it was swapped in meanwhile).
      OSError: any other failure (``FileNotFoundError`` when missing).
    """
    before = stat_nofollow(name, dir_fd)
    if not stat.S_ISREG(before.st_mode):
        raise _not_regular(name, before.st_mode)
    try:
        fd = os.open(name, flags | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            raise _not_regular(
                name, stat.S_IFLNK if e.errno == errno.ELOOP else stat.S_IFIFO
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(name, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_all(fd: int, size_hint: int) -> bytes:
    """Reads ``fd`` to its end."""
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = os.read(fd, max(size_hint - got, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_regular(name: str, dir_fd: int) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file ``name`` in ``dir_fd`` and its ``fstat`` (see
    :func:`open_regular` for what is refused)."""
    fd, st = open_regular(name, dir_fd)
    try:
        return read_all(fd, st.st_size), st
    finally:
        os.close(fd)


def write_new_and_replace(
    tmp: str, name: str, value: bytes, mode: int, dir_fd: int | None = None
) -> None:
    """Writes ``value`` to the new file ``tmp`` (mode ``mode``, whatever the umask),
    fsyncs it and renames it onto ``name``, both in ``dir_fd``; on any failure ``tmp``
    is removed. ``tmp`` is created with ``O_EXCL | O_NOFOLLOW``: never through a link."""
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW,
        mode,
        dir_fd=dir_fd,
    )
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
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def fsync_dir(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass


def unlink(name: str, dir_fd: int) -> bool:
    """Removes ``name`` from ``dir_fd`` (a symlink itself, never its target); returns
    whether it was there."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _mkdir_private(path: str) -> None:
    """Creates ``path`` with mode 0700 (whatever the umask); an existing one is kept."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)


def makedirs_private(path: str) -> None:
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
