"""Reading and writing entries in a byte cache: a fault, a damaged entry or one
this process cannot use is a miss (one warning per cause), never an error."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import _stats
from .._caches import Cache, Quarantining
from .._caches._faults import lost_write, store_fault_cause
from .._jax import CallbacksNotRebindable, serialize_with_callbacks
from .._keys._key import ComponentKey
from . import _entry
from ._entry import LOCAL, Entry, EntryError
from ._trees import NotPersistable

__all__ = [
    "CALLBACKS_ONLY",
    "LINEAR_ONLY",
    "callbacks_executable",
    "counted_loaded",
    "decoder",
    "dropped",
    "read_blob",
    "write",
]

#: ``Entry.extra`` flag of an entry kept in this process for its host callbacks
#: alone: its top-level executables are cached where JAX can bind the callbacks
#: again in another process (``callbacks_executable``).
CALLBACKS_ONLY = "host_callbacks_only"
#: ``Entry.extra`` flag of a custom_vjp rule's linear part: it stays in the process
#: that derives it (cheaply, from the entry it linearizes), and its transposes,
#: which programs call, are written.
LINEAR_ONLY = "custom_vjp_linear"
#: ``Entry.extra`` flag of an entry lowered only inside the program that calls it
#: (a collective over an enclosing axis, checkify checks): a block of a
#: ``jaxaot.jit`` program is then cached as part of that program.
WITH_CALLER = "with_caller"

logger = logging.getLogger("jaxaot")


#: The digests of the entries this process wrote: read back (by a second wrapper
#: of one function, after ``clear_cache``), they count as no entry ``loaded``.
_WRITTEN_HERE: set[str] = set()
#: The digests under which this process read an entry it cannot use, left in
#: place (another HMAC key's, another entry format's): caches keep an existing
#: entry, so this process's own is not stored there.
_KEPT_UNUSABLE: set[str] = set()


def read_blob(
    cache: Cache, key: ComponentKey, count: bool = True
) -> tuple[Entry | None, bytes | None]:
    """The entry under ``key`` (``None``: missing, unreadable or bad, dropped) and
    the bytes it was read from (``None`` where there were none); ``count``: counted
    as ``loaded`` (else the caller counts it, once it could use it)."""
    try:
        blob = cache.get(key.digest)
    except Exception as e:
        _stats.bump("cache_errors")
        _stats.warn_once(
            store_fault_cause(cache, e),
            f"jaxaot: reading from {cache!r} failed ({type(e).__name__}: {e}); computing locally",
        )
        return None, None
    if blob is None:
        return None, None
    try:
        entry = _entry.decode(blob, expected=key)
    except EntryError as e:
        if not e.removable:
            # Sound for the processes that wrote it (another HMAC key, another entry
            # format): a miss here, left alone, one warning per cause.
            _stats.bump("unusable_entries")
            if len(_KEPT_UNUSABLE) < 100_000:
                _KEPT_UNUSABLE.add(key.digest)
            _stats.warn_once(
                f"entry-unusable:{e.cause}",
                f"jaxaot: cache entries in {cache!r} cannot be used by this process ({e}); "
                "computing locally and leaving them in place",
            )
            return None, blob
        _stats.bump("corrupt_entries")
        dropped(cache, key.digest, f"a bad cache entry ({e})", "recomputing", blob, e.cause)
        return None, blob
    if count:
        counted_loaded(key.digest)
    return entry, blob


def counted_loaded(digest: str) -> None:
    """Counts the entry ``digest`` as ``loaded`` from a cache, unless this process
    wrote it (one it reads back is no warm start)."""
    if digest not in _WRITTEN_HERE:
        _stats.bump("loaded")


def decoder(key: ComponentKey) -> Callable[[bytes], Entry | None]:
    def decode(blob: bytes) -> Entry | None:
        try:
            entry = _entry.decode(blob, expected=key)
        except EntryError as e:
            logger.warning("jaxaot: entry %s from another process is bad (%s)", key.digest[:16], e)
            return None
        counted_loaded(key.digest)  # (made by process 0 of the job, not here)
        return entry

    return decode


def dropped(cache: Cache, digest: str, what: str, instead: str, blob: bytes, cause: str) -> None:
    """Removes the bad entry ``digest`` (read as ``blob``) and says so: one warning
    per ``cause`` and cache for the entries removed, and one per cache where they
    stay (a read-only cache: every process that reads it meets them again); later
    ones at DEBUG. ``what`` says what is wrong with it, ``instead`` what this
    process does."""
    where = f"{digest[:16]} in {cache!r}"
    if _discard(cache, digest, blob):
        _stats.warn_once(
            f"bad-entry-dropped:{cause}:{cache!r}",
            f"jaxaot: dropped {what} {where}; {instead} (other entries dropped for this "
            "cause are logged at DEBUG)",
        )
        return
    _stats.warn_once(
        f"bad-entry-stays:{cache!r}",
        f"jaxaot: {what} {where} could not be removed (is the cache read-only?); {instead}, "
        "and every process that reads it will",
    )


def _discard(cache: Cache, digest: str, blob: bytes) -> bool:
    """Whether the bad entry ``digest`` (``blob``) is gone: removed, or replaced
    meanwhile by another process's entry. (Read again to tell: quarantines return
    nothing, and a bad entry is rare.)"""
    try:
        if isinstance(cache, Quarantining):
            try:
                cache.quarantine(digest, check=_entry.check_stored)
            except TypeError:  # a cache of the user's, its quarantine without ``check``
                cache.quarantine(digest)
        else:
            cache.delete(digest)
        still = cache.get(digest)
    except Exception:  # removing a bad entry is best effort
        logger.debug("jaxaot: could not remove bad entry %s", digest[:16], exc_info=True)
        return False
    return still is None or still != blob


def write(cache: Cache, entry: Entry, kind: str = "component") -> None:
    """Writes ``entry`` to ``cache``; one that cannot be written is said once, as of
    a ``kind`` (``component``, ``block``), and kept in this process."""
    if entry.host_callbacks and entry.extra.get(CALLBACKS_ONLY):
        # Its lowered form would hold this process's callbacks; its executables
        # are cached with them rebound (``callbacks_executable``).
        logger.debug("jaxaot: %s stays in this process (host callbacks)", entry.name)
        return
    if entry.extra.get(LINEAR_ONLY) or (kind == "block" and entry.extra.get(WITH_CALLER)):
        # Nothing is lost: the program calling it is written, and holds it.
        logger.debug("jaxaot: %s stays in this process (%s)", entry.name, entry.extra.get(LOCAL))
        return
    try:
        blob = _entry.encode(entry)
    except NotPersistable as e:
        # Silence would read as "jaxaot does not help": say once per component
        # and cause what keeps it from a warm start.
        _stats.warn_once(
            f"not-persistable:{entry.name}:{e}",
            f"jaxaot: {kind} {entry.name!r} is not written to the cache ({e}); "
            "its entries stay in this process, so a new process traces, lowers and "
            "compiles it again",
        )
        return
    try:
        cache.put(entry.key.digest, blob)
        _WRITTEN_HERE.add(entry.key.digest)
        if entry.key.digest in _KEPT_UNUSABLE:
            _KEPT_UNUSABLE.discard(entry.key.digest)
            # (A signing key rotated: jaxaot precompile then fails, rather than
            # reporting entries made that no process with its key can read.)
            lost_write()
            _stats.warn_once(
                f"unusable-kept:{cache!r}",
                f"jaxaot: {cache!r} keeps the entries this process cannot use (signed with "
                "another key, or of another format) under the keys of its own entries, "
                "which are therefore not stored; remove them (jaxaot cache clear) to store these",
            )
    except Exception as e:
        _stats.bump("cache_errors")
        lost_write()
        _stats.warn_once(
            store_fault_cause(cache, e),
            f"jaxaot: writing to {cache!r} failed ({type(e).__name__}: {e}); continuing without it",
        )


def callbacks_executable(root: Entry, exe: Any, component: str) -> bytes | None:
    """The serialized top-level executable ``exe`` of ``root``, an entry kept in this
    process for its host callbacks, in a form another process loads with its own
    callbacks bound; or ``None`` where that cannot be (then the executable stays in
    this process, with one WARNING per component and cause)."""
    if not root.extra.get(CALLBACKS_ONLY):
        return None  # in this process for another reason (a context, plain JAX)
    program = root.key.parts.get("program")
    if program is None:
        _stats.warn_once(
            f"callbacks-explicit-key:{component}",
            f"jaxaot: component {component!r} has an explicit key and calls back into "
            "Python (jax.debug.print, pure_callback, io_callback, Equinox checks); its "
            "executable is not cached: an explicit key does not trace the body, so "
            "another process would have no callbacks to bind to it. Use a default key "
            "to cache it.",
        )
        return None
    try:
        return serialize_with_callbacks(exe, component, str(program))
    except CallbacksNotRebindable as e:
        _stats.warn_once(
            f"callbacks:{component}:{e}",
            f"jaxaot: component {component!r} calls back into Python and its executable "
            f"is not cached ({e}); each process compiles it",
        )
        return None
