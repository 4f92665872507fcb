"""The files of a directory cache, and the maintenance that works on them:
listing entries, evicting the least recently used ones, removing orphaned temp
files, counting hits, moving bad entries to quarantine.

Layout::

  <root>/.lock                  writers' lock (``filelock``; released when its holder dies)
  <root>/<key[:2]>/<key>        one file per entry, mode 0600
  <root>/<key[:2]>/<key>.hits   one byte appended per hit (O_APPEND: safe across processes)
  <root>/<key[:2]>/<key>.lease  the lease on making the entry (``_filelease``; flock)
  <root>/<key[:2]>/.tmp-<pid>-<hex>   a write in flight (or left by a killed writer)
  <root>/<tag[:2]>/<tag>.index  notes about recent entries of one component and kind
                                (``DirectoryCache.note``): ``<key> <base64 note>`` lines
  <root>/quarantine/<key>.<ns>  entries moved aside by ``DirectoryCache.quarantine``

Everything here works through descriptors of real directories (see ``_safefs``)
and acts only on regular files: nothing is followed out of the root.
"""

from __future__ import annotations

import base64
import binascii
import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import NamedTuple

from . import _filelease, _safefs
from ._lease import LEASE_SUFFIX
from ._protocol import INDEX_ITEMS, check_key
from ._safefs import open_dir, opened_dir, stat_nofollow
from ._trust import Refused, untrusted_writer

__all__ = [
    "FUTURE_SLACK",
    "check_lock_file",
    "QUARANTINE_MAX_FILES",
    "TEMP_MAX_AGE",
    "Scan",
    "ScannedEntry",
    "clear_quarantine",
    "evict",
    "add_note",
    "forget_hits",
    "read_notes",
    "move_to_quarantine",
    "record_hit",
    "scan",
    "temp_name",
    "unlisted",
]

logger = logging.getLogger("jaxaot")

#: Temp files whose mtime is further than this (seconds) from now are orphans
#: of a killed writer and are removed during eviction.
TEMP_MAX_AGE = 3600.0
#: Quarantined entries kept at most; past this a bad entry is deleted instead.
QUARANTINE_MAX_FILES = 16
#: Entries dated further than this (seconds) in the future come from a skewed
#: clock; eviction takes them first rather than keeping them for ever.
FUTURE_SLACK = 86400.0

TEMP_PREFIX = ".tmp-"
HITS_SUFFIX = ".hits"
INDEX_SUFFIX = ".index"
QUARANTINE_DIR = "quarantine"
_HEX = frozenset("0123456789abcdef")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class ScannedEntry(NamedTuple):
    mtime: float
    size: int
    shard: str
    name: str


class Scan(NamedTuple):
    entries: list[ScannedEntry]
    temp_files: int
    temp_bytes: int
    #: Bytes of the files kept beside entries that do not go with one (notes,
    #: leases): they count against ``max_bytes`` too.
    other_bytes: int = 0


def temp_name() -> str:
    """A unique name for a write in flight, in the entry's shard directory."""
    import secrets

    return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def _is_key_name(name: str, shard: str) -> bool:
    return 16 <= len(name) <= 128 and name.startswith(shard) and _HEX.issuperset(name)


def _is_shard_name(name: str) -> bool:
    return len(name) == 2 and _HEX.issuperset(name)


# -- hits ------------------------------------------------------------------------------


def record_hit(shard_fd: int, key: str) -> None:
    """Appends one byte to ``key``'s hit file (best effort: a read-only cache still
    serves hits)."""
    try:
        fd = os.open(
            key + HITS_SUFFIX,
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_CLOEXEC | _O_NOFOLLOW | _O_NONBLOCK,
            0o600,
            dir_fd=shard_fd,
        )
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.write(fd, b".")
    except OSError:
        pass
    finally:
        os.close(fd)


def forget_hits(shard_fd: int, key: str) -> None:
    try:
        os.unlink(key + HITS_SUFFIX, dir_fd=shard_fd)
    except OSError:
        pass


# -- notes (an index per tag) ----------------------------------------------------------


def read_notes(
    shard_fd: int, tag: str, trusted: Callable[[os.stat_result], None]
) -> list[tuple[str, bytes]]:
    """The notes under ``tag``, oldest first (lines that do not parse are skipped:
    an append cut short). ``trusted`` raises for a file it refuses.

    Raises:
      OSError: the file cannot be read (``FileNotFoundError`` when absent), or is
        not a regular file.
    """
    fd, st = _safefs.open_regular(tag + INDEX_SUFFIX, shard_fd)
    try:
        trusted(st)
        data = _safefs.read_all(fd, st.st_size)
    finally:
        os.close(fd)
    notes = []
    for line in data.split(b"\n"):
        key, _, text = line.partition(b" ")
        try:
            notes.append((check_key(key.decode("ascii")), base64.b64decode(text, validate=True)))
        except (ValueError, binascii.Error):
            continue
    return notes


def add_note(
    shard_fd: int, tag: str, key: str, item: bytes, trusted: Callable[[os.stat_result], None]
) -> None:
    """Notes ``item`` about ``key`` under ``tag`` unless ``key`` is noted already:
    appended (one ``write`` with ``O_APPEND``, so concurrent notes do not mix), and
    the file rewritten with the most recent :data:`INDEX_ITEMS` once it holds
    twice as many (a note appended meanwhile may be lost: notes are hints).

    Raises:
      OSError: it cannot be read or written (or is not a regular file).
    """
    try:
        notes = read_notes(shard_fd, tag, trusted)
    except FileNotFoundError:
        notes = []
    if any(k == key for k, _ in notes):
        return
    line = key.encode("ascii") + b" " + base64.b64encode(item) + b"\n"
    name = tag + INDEX_SUFFIX
    if len(notes) >= 2 * INDEX_ITEMS:
        kept = b"".join(
            k.encode("ascii") + b" " + base64.b64encode(v) + b"\n"
            for k, v in notes[-(INDEX_ITEMS - 1) :]
        )
        _safefs.write_new_and_replace(temp_name(), name, kept + line, 0o600, dir_fd=shard_fd)
        return
    fd = os.open(
        name,
        os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_CLOEXEC | _O_NOFOLLOW | _O_NONBLOCK,
        0o600,
        dir_fd=shard_fd,
    )
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _safefs.NotRegularFileError(errno.EINVAL, "not a regular file", name)
        trusted(st)
        os.write(fd, line)
    finally:
        os.close(fd)


# -- listing and eviction --------------------------------------------------------------


def scan(root_fd: int, root: str, *, clean: bool, everything: bool = False) -> Scan:
    """Lists entries (and counts temp files); tolerates files vanishing meanwhile.
    Only real shard directories and regular files count; nothing is followed.

    With ``clean``, temp files and lease files older than :data:`TEMP_MAX_AGE`
    are removed (a lease file only once no process holds its lock), and so are
    notes untouched for as long whose entries are all gone (evicted or pruned:
    one index per signature would otherwise outlive its entries for ever). With
    ``everything`` too (a clear), notes, hit counts and lease files go whatever
    their age (a lease file still only once no process holds its lock).
    """
    entries: list[ScannedEntry] = []
    old_indexes: list[tuple[str, str, int]] = []  # (shard, file name, size)
    temps = 0
    temp_bytes = 0
    other_bytes = 0
    now = time.time()
    try:
        with os.scandir(root_fd) as it:
            shards = [
                d.name for d in it if _is_shard_name(d.name) and d.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return Scan(entries, 0, 0)
    for shard in shards:
        try:
            sfd = open_dir(shard, root_fd)
        except OSError:
            continue
        try:
            with os.scandir(sfd) as it:
                files = list(it)
            for f in files:
                name = f.name
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if name.endswith((LEASE_SUFFIX, INDEX_SUFFIX, HITS_SUFFIX)):
                    lease = name.endswith(LEASE_SUFFIX)
                    old = abs(now - st.st_mtime) > TEMP_MAX_AGE
                    if clean and old and not everything and name.endswith(INDEX_SUFFIX):
                        old_indexes.append((shard, name, st.st_size))
                    if clean and (everything or (lease and old)):
                        try:
                            if not (lease and _filelease.is_held(sfd, name)):
                                _safefs.unlink(name, sfd)
                                continue
                        except OSError:
                            pass
                    if not name.endswith(HITS_SUFFIX):  # (a hit count goes with its entry)
                        other_bytes += st.st_size
                    continue
                if name.startswith(TEMP_PREFIX):
                    if clean and abs(now - st.st_mtime) > TEMP_MAX_AGE:
                        try:
                            os.unlink(name, dir_fd=sfd)
                            logger.debug(
                                "jaxaot directory cache %s: removed orphan %s/%s",
                                root,
                                shard,
                                name,
                            )
                            continue
                        except OSError:
                            pass
                    temps += 1
                    temp_bytes += st.st_size
                elif _is_key_name(name, shard):
                    entries.append(ScannedEntry(st.st_mtime, st.st_size, shard, name))
        except OSError:
            continue
        finally:
            os.close(sfd)
    if old_indexes:
        other_bytes -= _drop_stale_notes(root_fd, old_indexes, {e.name for e in entries})
    return Scan(entries, temps, temp_bytes, other_bytes)


def unlisted(root_fd: int, root: str) -> list[str]:
    """The directories of the cache (the root, its shards) this process is not
    permitted to list: a scan passes over the entries in them."""
    try:
        with os.scandir(root_fd) as it:
            shards = [
                d.name for d in it if _is_shard_name(d.name) and d.is_dir(follow_symlinks=False)
            ]
    except PermissionError:
        return [root]
    except OSError:
        return []
    denied = []
    for shard in shards:
        try:
            with opened_dir(shard, root_fd) as sfd, os.scandir(sfd):
                pass
        except PermissionError:
            denied.append(os.path.join(root, shard))
        except OSError:  # (gone meanwhile, or no real directory: not an entry's place)
            continue
    return denied


def _drop_stale_notes(root_fd: int, indexes: list[tuple[str, str, int]], keys: set[str]) -> int:
    """Removes the index files among ``indexes`` none of whose notes names one of
    ``keys`` (the entries stored); the bytes removed."""
    freed = 0
    for shard, name, size in indexes:
        try:
            with opened_dir(shard, root_fd) as sfd:
                notes = read_notes(sfd, name[: -len(INDEX_SUFFIX)], lambda st: None)
                if not any(key in keys for key, _ in notes) and _safefs.unlink(name, sfd):
                    freed += size
        except OSError:
            continue
    return freed


def unlink_entry(root_fd: int, root: str, e: ScannedEntry) -> bool:
    """Removes a scanned entry (through a freshly opened shard descriptor, so a
    shard swapped for a symlink meanwhile is not followed)."""
    try:
        with opened_dir(e.shard, root_fd) as sfd:
            forget_hits(sfd, e.name)
            return _safefs.unlink(e.name, sfd)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            logger.debug("jaxaot directory cache %s: cannot delete %s: %s", root, e.name, exc)
        return False


def evict(root_fd: int, root: str, incoming: int, max_bytes: int) -> tuple[bool, int]:
    """Evicts least recently used entries until ``incoming`` more bytes fit under
    ``max_bytes``; whether the value now fits, and how many entries were evicted.

    Called with the writers' lock held. Entries dated more than
    :data:`FUTURE_SLACK` ahead (a skewed clock) go first.
    """
    listed = scan(root_fd, root, clean=True)
    total = sum(e.size for e in listed.entries) + listed.other_bytes
    if total + incoming <= max_bytes:
        return True, 0
    if listed.other_bytes + incoming > max_bytes:
        return False, 0  # evicting every entry would not make room: evict none
    horizon = time.time() + FUTURE_SLACK
    victims = sorted(
        listed.entries,
        key=lambda e: (e.mtime <= horizon, e.mtime if e.mtime <= horizon else 0.0),
    )
    evicted = 0
    for e in victims:
        if total + incoming <= max_bytes:
            break
        if unlink_entry(root_fd, root, e):
            evicted += 1
        # deleted by someone else meanwhile: the space is free all the same
        total -= e.size
    if evicted:
        logger.debug("jaxaot directory cache %s: evicted %d entries", root, evicted)
    return total + incoming <= max_bytes, evicted


# -- quarantine ------------------------------------------------------------------------


def move_to_quarantine(root_fd: int, shard_fd: int, root: str, key: str) -> bool:
    """Renames the entry into the quarantine directory; returns whether it did (not
    when the quarantine is full, untrusted or cannot be made)."""
    try:
        qfd = open_dir(QUARANTINE_DIR, root_fd, create=True)
    except OSError as e:
        logger.debug("jaxaot directory cache %s: no quarantine directory: %s", root, e)
        return False
    try:
        if untrusted_writer(os.fstat(qfd)) is not None or (
            len(os.listdir(qfd)) >= QUARANTINE_MAX_FILES
        ):
            return False
        target = f"{key}.{time.time_ns()}"
        os.rename(key, target, src_dir_fd=shard_fd, dst_dir_fd=qfd)
        forget_hits(shard_fd, key)
        logger.debug(
            "jaxaot directory cache %s: quarantined %s to %s",
            root,
            key,
            os.path.join(root, QUARANTINE_DIR, target),
        )
        return True
    finally:
        os.close(qfd)


def clear_quarantine(root_fd: int) -> None:
    """Removes the regular files in the quarantine directory.

    Raises:
      OSError: the quarantine directory is a symlink or not a directory
        (``ELOOP``/``ENOTDIR``), or cannot be opened.
    """
    with opened_dir(QUARANTINE_DIR, root_fd) as qfd:
        for name in os.listdir(qfd):
            try:
                if stat.S_ISREG(stat_nofollow(name, qfd).st_mode):
                    os.unlink(name, dir_fd=qfd)
            except OSError:
                pass


# -- the writers' lock -------------------------------------------------------------------


def check_lock_file(root_fd: int, name: str, path: str) -> None:
    """Makes sure the writers' lock ``name`` (at ``path``) is a regular file (created
    here, never through a link) before ``filelock`` opens it by name.

    Raises:
      Refused: it is a symlink, FIFO, directory... (nothing is written then).
      OSError: it cannot be opened or created.
    """
    try:
        fd = os.open(
            name,
            os.O_RDWR | os.O_CREAT | _O_CLOEXEC | _O_NOFOLLOW | _O_NONBLOCK,
            0o600,
            dir_fd=root_fd,
        )
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise Refused(
                "lock not a regular file",
                f"the writers' lock {path} is not a regular file; not writing",
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(
                "lock not a regular file",
                f"the writers' lock {path} is not a regular file; not writing",
            )
        if stat.S_IMODE(st.st_mode) != 0o600 and st.st_uid == os.getuid():
            os.fchmod(fd, 0o600)  # the umask may have narrowed it
    finally:
        os.close(fd)
