"""The entries of an :class:`~._fsspec.FsspecCache` on a local or mounted path
(``file://``): reached through descriptors of real directories, never through a
symlink, read only from regular files that this user alone could have written
(unless entries are signed, see ``_trust``), written atomically (temp file,
fsync, rename), and leased with lock files (``_filelease``).

Nothing here imports JAX or fsspec.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Callable
from typing import Any

from . import _filelease, _safefs
from ._faults import errno_cause, write_fault_text
from ._protocol import Held, Lease
from ._safefs import NotRegularFileError, open_dir, stat_nofollow
from ._trust import Refused, check_trusted, signing, untrusted_writer

__all__ = ["KEY_RE", "SHARD_RE", "TEMP_PREFIX", "LocalRoot"]

KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")
SHARD_RE = re.compile(r"^[0-9a-f]{2}$")
TEMP_PREFIX = ".tmp-"

#: ``warn(cause, message)``: one warning per cause (the cache's).
WarnCause = Callable[[str, str], None]


def _group_bits(root: os.stat_result) -> int:
    """The permission bits a store's root gives its group, where the store is a
    group's: entries signed, the root group-writable (a setgid team directory).
    Its shards and lease files get them too, so that each member writes into the
    shards, and locks the leases, that another member made."""
    bits = stat.S_IMODE(root.st_mode) & (0o070 | stat.S_ISGID)
    return bits if signing() and bits & 0o020 else 0


class LocalRoot:
    """The cache's root directory ``root`` on this machine."""

    def __init__(self, root: str) -> None:
        self._root = root

    def trusted(self, st: os.stat_result, what: str) -> None:
        check_trusted(st, what)

    def directory(self, shard: str | None = None, *, create: bool = False) -> int:
        """A checked descriptor of the root, or of one shard directory below it."""
        try:
            try:
                rfd = open_dir(self._root)
            except FileNotFoundError:
                if not create:
                    raise
                os.makedirs(self._root, exist_ok=True)
                rfd = open_dir(self._root)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Refused("root not a directory", f"{self._root} is not a directory") from e
            raise
        try:
            root_st = os.fstat(rfd)
            self.trusted(root_st, f"root directory {self._root}")
            if shard is None:
                return rfd
            try:
                sfd = open_dir(shard, rfd, create=create)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused(
                        "shard not a directory",
                        f"{self._root}/{shard} is a symlink or not a directory; not following it",
                    ) from e
                raise
            try:
                if create:
                    try:
                        # Readable by the other users of a shared store.
                        os.fchmod(sfd, 0o755 | _group_bits(root_st))
                    except OSError:
                        pass  # (another user's shard)
                self.trusted(os.fstat(sfd), f"shard directory {self._root}/{shard}")
            except BaseException:
                os.close(sfd)
                raise
            return sfd
        finally:
            if shard is not None:
                os.close(rfd)

    def read(self, key: str) -> bytes:
        """The entry file's bytes.

        Raises:
          Refused: not a regular file, or not trusted.
          OSError: cannot be read (``FileNotFoundError`` when absent).
        """
        sfd = self.directory(key[:2])
        try:
            try:
                fd, st = _safefs.open_regular(key, sfd)
            except NotRegularFileError as e:
                raise Refused(
                    "entry not a regular file",
                    f"{self._root}/{key[:2]}/{key} is {e.strerror}; not opening it",
                ) from e
            try:
                self.trusted(st, f"entry file {self._root}/{key[:2]}/{key}")
                return _safefs.read_all(fd, st.st_size)
            finally:
                os.close(fd)
        finally:
            os.close(sfd)

    def exists(self, key: str) -> bool:
        """Whether a trusted regular entry file is there (anything else is replaced)."""
        try:
            sfd = self.directory(key[:2])
        except FileNotFoundError:
            return False
        try:
            st = stat_nofollow(key, sfd)
        except FileNotFoundError:
            return False
        finally:
            os.close(sfd)
        return stat.S_ISREG(st.st_mode) and (untrusted_writer(st) is None or signing())

    def write(self, key: str, value: bytes) -> None:
        """Temp file in the entry's directory, fsync, rename: atomic on POSIX filesystems."""
        sfd = self.directory(key[:2], create=True)
        try:
            tmp = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
            _safefs.write_new_and_replace(tmp, key, value, 0o644, dir_fd=sfd)
        finally:
            os.close(sfd)

    def unlink(self, key: str) -> bool:
        try:
            sfd = self.directory(key[:2])
        except FileNotFoundError:
            return False
        try:
            if stat.S_ISDIR(stat_nofollow(key, sfd).st_mode):
                return False
            return _safefs.unlink(key, sfd)
        finally:
            os.close(sfd)

    def entries(self) -> dict[str, dict[str, Any]]:
        """``{key: {"size", "mtime"}}`` of the regular entry files in real shard directories."""
        try:
            rfd = self.directory()
        except FileNotFoundError:
            return {}
        out: dict[str, dict[str, Any]] = {}
        try:
            with os.scandir(rfd) as it:
                shards = [
                    d.name for d in it if SHARD_RE.match(d.name) and d.is_dir(follow_symlinks=False)
                ]
            for shard in shards:
                try:
                    sfd = open_dir(shard, rfd)
                except OSError:
                    continue
                try:
                    with os.scandir(sfd) as it:
                        for f in it:
                            if not (KEY_RE.match(f.name) and f.name.startswith(shard)):
                                continue
                            try:
                                st = f.stat(follow_symlinks=False)
                            except OSError:
                                continue
                            if stat.S_ISREG(st.st_mode):
                                out[f.name] = {"size": st.st_size, "mtime": st.st_mtime}
                finally:
                    os.close(sfd)
        finally:
            os.close(rfd)
        return out

    def lease(self, key: str, warn: WarnCause) -> Lease | Held | None:
        """The lease on ``key``: a lock file beside the entry (``None``, one
        warning per cause through ``warn``, where it cannot be taken)."""
        where = f"{self._root}/{key[:2]}/{key}{_filelease.LEASE_SUFFIX}"
        if not _filelease.available():
            return None
        try:
            sfd = self.directory(key[:2], create=True)
            try:
                # A lease file is the group's to write where its shard is.
                group = stat.S_IMODE(os.fstat(sfd).st_mode) & 0o020
                return _filelease.take(sfd, key, self.trusted, where, mode=0o644 | group)
            finally:
                os.close(sfd)
        except Refused as r:
            warn(r.cause, f"{r} (no lease on {key[:16]}: made here)")
        except NotRegularFileError as e:
            warn(f"lease {errno_cause(e)}", f"cannot lock {where} (not a regular file); made here")
        except OSError as e:
            # The cause a put's fault has too (a read-only mount, say): one warning for both.
            cause = errno_cause(e)
            warn(cause, write_fault_text(cause, e, f"lease {where}"))
        return None
