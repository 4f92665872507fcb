"""Fault bookkeeping shared by the remote backends: counters, one warning per
cause (later ones at DEBUG), and a short back-off after an outage so that a
dead server is not asked again on every call."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time

from .._stats import bump, warn_once

logger = logging.getLogger("jaxaot")


#: Causes that stop every write to a cache, whichever of a lease, a put or a
#: clean-up meets them first: a read-only disk or mount, no write permission.
UNWRITABLE = frozenset({"EROFS", "EACCES", "EPERM"})


def errno_cause(exc: BaseException) -> str:
    """A fault's cause for one warning per cause: the errno's name (``ENOSPC``) for
    an ``OSError`` that has one, else the exception's type name. Leases, writes and
    reads of one cache use it alike, so one cause gives one warning."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    return type(exc).__name__


def no_access_text(what: str, path: str, exc: OSError) -> str:
    """The warning for a cache directory (``what``: "the cache", or its path) this
    user cannot open, such as one a run as root made: whose it is, and what to do."""
    return (
        f"{what} {owner_text(path, exc)}: nothing in it is read or written, and its "
        "entries are made in this process; make it this user's (chown -R) or set "
        "$JAXAOT_CACHE_DIR to a directory of this user's"
    )


def owner_text(path: str, exc: OSError) -> str:
    """Whose directory ``path`` is, and that this user cannot open it (``exc``):
    "belongs to root (uid 0), mode 700, and this user (...) cannot open it (EACCES)"."""
    try:
        st = os.stat(path)
        whose = f"belongs to {_user(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):o}, and "
    except OSError:
        whose = ""
    me = _user(os.geteuid()) if hasattr(os, "geteuid") else "?"
    return f"{whose}this user ({me}) cannot open it ({errno_cause(exc)})"


def _user(uid: int) -> str:
    try:
        import pwd  # (POSIX only)

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def write_fault_text(cause: str, exc: OSError, what: str) -> str:
    """The warning for a write (``what``: "put of KEY", "lease LEASE-FILE") that
    failed with ``cause``. An unwritable cache says what that means for every later
    write, since it is warned about once, by whichever write meets it first."""
    if cause in UNWRITABLE:
        return (
            f"the cache cannot be written ({cause}: {exc.strerror or exc}): its entries are "
            f"still read, but none are written or leased, and misses are made in this "
            f"process (first seen on {what})"
        )
    if cause in ("ENOSPC", "EDQUOT"):
        return (
            f"the cache's disk is full ({cause}: {exc.strerror or exc}): entries that do not "
            f"fit are not written (they are made in this process), until space is freed "
            f"(first seen on {what})"
        )
    return f"{what} skipped ({cause}: {exc})"


def store_fault_cause(cache: object, exc: BaseException) -> str:
    """The process-wide cause of a fault raised by a cache's method (get, put or
    lease alike): the cache and the fault, so one cause warns once."""
    return f"cache {cache!r}: {errno_cause(exc)}"


def lost_write() -> None:
    """Counts, for the whole process, one value a cache did not store: its write
    failed or was skipped (``jaxaot precompile`` fails where one of its entries
    may be missing from the cache it fills)."""
    bump("cache_write_errors")


class WarnOnce:
    """Mixin for every backend: counters, and one warning per cause for each
    store (``_stats.warn_once``, later ones at DEBUG): per path or URL, not per
    cache object, so the caches a program makes of one store warn once between
    them. Subclasses set ``_state_lock`` and ``_counters`` and name themselves in
    ``_log_prefix``."""

    _state_lock: threading.Lock
    _counters: dict[str, int]

    def _log_prefix(self) -> str:
        return "cache"

    def _count(self, name: str, n: int = 1) -> None:
        with self._state_lock:
            self._counters[name] += n

    def _warn_once(self, cause: str, message: str) -> None:
        prefix = self._log_prefix()
        warn_once(f"{prefix}: {cause}", f"jaxaot {prefix}: {message}")


class FaultTracking(WarnOnce):
    """Mixin for remote backends: ``WarnOnce`` plus a back-off after outages. Call
    ``_init_faults`` in ``__init__``; subclasses set ``url``, ``backoff``, ``_kind``
    ("redis", "fsspec") and ``_peer`` ("server", "store"), and override ``_cause``
    and ``_is_outage``."""

    url: str
    backoff: float
    _kind = "remote"
    _peer = "server"

    def _init_faults(self, counters: dict[str, int]) -> None:
        self._state_lock = threading.Lock()
        self._down_until = 0.0
        self._counters = counters

    def _cause(self, e: BaseException) -> str:
        return type(e).__name__

    def _is_outage(self, e: BaseException) -> bool:
        return isinstance(e, ConnectionError | TimeoutError)

    def _log_prefix(self) -> str:
        return f"{self._kind} cache {self.url}"

    def _available(self, what: str) -> bool:
        """False while backing off after an outage (the call then skips the remote)."""
        with self._state_lock:
            down = time.monotonic() < self._down_until
            if down:
                self._counters["skipped_offline"] += 1
        if down:
            logger.debug(
                "jaxaot %s cache %s: %s skipped (%s unreachable)",
                self._kind,
                self.url,
                what,
                self._peer,
            )
        return not down

    def _fault(self, what: str, e: BaseException) -> None:
        cause = self._cause(e)
        self._count("errors")
        outage = self._is_outage(e)
        if outage and self.backoff > 0:
            with self._state_lock:
                self._down_until = time.monotonic() + self.backoff
        # One warning for an outage, however its calls fail (a timeout while the
        # server stalls, then refused connections once it is gone).
        if outage:
            retry = f", tried again every {self.backoff:g} s" if self.backoff > 0 else ""
            self._warn_once(
                "outage",
                f"the {self._peer} cannot be reached ({cause}: {self._describe(e)}); "
                f"entries are made in this process and not shared while it is down{retry}",
            )
            return
        # Said once per cause, by whichever call meets it first: so it says what it
        # means for every later call that fails alike (a server refusing every
        # command fails every read and write, not only the first one named).
        self._warn_once(
            cause,
            f"{what} failed ({cause}: {self._describe(e)}); skipped, as is every later "
            "call that fails so: an entry that cannot be read is made in this process, "
            "and one that cannot be written is not shared",
        )

    def _describe(self, e: BaseException) -> str:
        """What went wrong, for a user (backends override with their own words)."""
        return self._redact_text(" ".join(str(e).split()))[:200] or type(e).__name__

    def _redact_text(self, text: str) -> str:
        """``text`` with any credential of this store taken out (backends override)."""
        return text
