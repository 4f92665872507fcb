"""The trust policy shared by every backend: when bytes from a store may become
code in this process.

* With ``$JAXAOT_CACHE_HMAC_KEY`` set, every entry is signed and a reader accepts
  only entries signed with that key, so the store itself need not be trusted:
  anyone may be able to write to it.
* Without a key, an entry is only checksummed, so the store must be writable by
  this user alone. Local stores (a cache directory, a ``file://`` path) check
  that on the root, on each shard directory and on each entry file before it is
  read: owned by this user (or root) and not group- or world-writable. Remote
  stores (Redis, object stores) cannot be checked; the first one made in a
  process without a key logs one loud warning.
* An empty or blank key is a configuration error (a secret that did not reach
  the job), never a silent "signing off".

This module does not import JAX.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading

from .._env import SettingError

__all__ = [
    "HMAC_ENV",
    "UnsafeCacheDirError",
    "UntrustedEntryError",
    "check_safe_root",
    "hmac_secret",
    "signing",
    "unsigned_said_by_parent",
    "untrusted_writer",
    "warn_unsigned_remote",
]

logger = logging.getLogger("jaxaot")

HMAC_ENV = "JAXAOT_CACHE_HMAC_KEY"

_remote_warned: set[str] = set()
_remote_lock = threading.Lock()


def hmac_secret() -> bytes | None:
    """The signing key from ``$JAXAOT_CACHE_HMAC_KEY``, or ``None`` when it is unset.

    Raises:
      SettingError: the variable is set but empty or only whitespace.
    """
    raw = os.environ.get(HMAC_ENV)
    if raw is None:
        return None
    if not raw.strip():
        raise SettingError(
            f"${HMAC_ENV} is set but empty: the signing secret did not reach this process. "
            f"Set it to the secret shared by every process of the cache, or unset it to use "
            "plain checksums (then only caches that this user alone can write are read)"
        )
    return raw.encode("utf-8")


def signing() -> bool:
    """Whether entries are signed (``$JAXAOT_CACHE_HMAC_KEY`` is set). Raises like
    :func:`hmac_secret` for an empty key."""
    return hmac_secret() is not None


def untrusted_writer(st: os.stat_result) -> str | None:
    """Why someone other than this user could have written the file or directory
    whose ``lstat``/``fstat`` is ``st``, or ``None`` if only this user (or root) could."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:  # no POSIX ownership (Windows): nothing to check
        return None
    uid = getuid()
    if st.st_uid not in (uid, 0):
        return f"owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def unsigned_said_by_parent() -> None:
    """This process's parent (``jaxaot precompile``'s) said what
    :func:`warn_unsigned_remote` says, of the same stores: not said again here."""
    global _said_by_parent
    _said_by_parent = True


_said_by_parent = False


def warn_unsigned_remote(kind: str, url: str) -> None:
    """Once per process and store: a loud warning that entries of a remote store are
    not signed, so whoever can write to the store can run code here."""
    if signing() or _said_by_parent:
        return
    with _remote_lock:
        first = url not in _remote_warned
        _remote_warned.add(url)
    if first:
        logger.warning(
            "jaxaot %s cache %s: $%s is not set, so entries are only checksummed: anyone "
            "who can write to this store can run code in this process through a planted "
            "entry. Set the same secret in $%s in every process that shares the store.",
            kind,
            url,
            HMAC_ENV,
            HMAC_ENV,
        )


class Refused(Exception):
    """A directory or file in a cache root that this process does not use; ``cause``
    names the kind, for one warning per cause (internal to the backends)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def check_trusted(st: os.stat_result, what: str) -> None:
    """Raises :class:`Refused` if another user could have written ``what`` (a
    directory or entry whose ``stat`` is ``st``) and entries are not signed."""
    why = untrusted_writer(st)
    if why is not None and not signing():
        raise Refused(
            f"untrusted {what.split()[0]}",
            f"{what} is {why}, and entries are not signed ($JAXAOT_CACHE_HMAC_KEY); "
            "not using it (another user could have planted code there)",
        )


class UnsafeCacheDirError(PermissionError):
    """The cache directory could be written by someone else, so it is not used."""


class UntrustedEntryError(PermissionError):
    """An entry file (or its directory) could have been written by another user, and
    entries are not signed, so it is not read."""


def check_safe_root(root: str) -> None:
    """Raises :class:`UnsafeCacheDirError` unless ``root`` is ours and private enough
    (or entries are signed)."""
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "jaxaot cache path is not a directory", root)
    why = untrusted_writer(st)
    if why is None or signing():
        return
    if "owned by" in why:
        raise UnsafeCacheDirError(
            f"jaxaot cache directory {root} is {why}; refusing to load code another user "
            "could write (or set $JAXAOT_CACHE_HMAC_KEY so that entries are signed)"
        )
    # A sticky directory (/tmp) is shared on purpose: never advise changing it.
    fix = (
        "choose a directory of your own (a subdirectory of it, say)"
        if st.st_mode & stat.S_ISVTX
        else f"run `chmod 700 {root}` or choose another path"
    )
    raise UnsafeCacheDirError(
        f"jaxaot cache directory {root} is {why}; {fix} "
        "(or set $JAXAOT_CACHE_HMAC_KEY so that entries are signed)"
    )
