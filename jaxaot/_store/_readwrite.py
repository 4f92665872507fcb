"""Reading and writing entries in a byte cache: a fault, a damaged entry or one
this process cannot use is a miss (one warning per cause), never an error."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .. import _stats
from .._caches import Cache, Quarantining
from .._keys._key import ComponentKey
from . import _entry
from ._entry import Entry, EntryError
from ._trees import NotPersistable

__all__ = ["decoder", "discard", "read", "write"]

logger = logging.getLogger("jaxaot")


def read(cache: Cache, key: ComponentKey) -> Entry | None:
    try:
        blob = cache.get(key.digest)
    except Exception as e:
        _stats.bump("cache_errors")
        _stats.warn_once(
            f"get:{type(cache).__name__}:{type(e).__name__}",
            f"jaxaot: reading from {cache!r} failed ({type(e).__name__}: {e}); computing locally",
        )
        return None
    if blob is None:
        return None
    try:
        return _entry.decode(blob, expected=key)
    except EntryError as e:
        if not e.removable:
            # Sound for the processes that wrote it (another HMAC key, another entry
            # format): a miss here, left alone, one warning per cause.
            _stats.bump("unusable_entries")
            _stats.warn_once(
                f"entry-unusable:{e.cause}",
                f"jaxaot: cache entries in {cache!r} cannot be used by this process ({e}); "
                "computing locally and leaving them in place",
            )
            return None
        _stats.bump("corrupt_entries")
        logger.warning(
            "jaxaot: dropped a bad cache entry %s from %r (%s); recomputing",
            key.digest[:16],
            cache,
            e,
        )
        discard(cache, key.digest)
        return None


def decoder(key: ComponentKey) -> Callable[[bytes], Entry | None]:
    def decode(blob: bytes) -> Entry | None:
        try:
            return _entry.decode(blob, expected=key)
        except EntryError as e:
            logger.warning("jaxaot: entry %s from another process is bad (%s)", key.digest[:16], e)
            return None

    return decode


def discard(cache: Cache, digest: str) -> None:
    try:
        if isinstance(cache, Quarantining):
            cache.quarantine(digest)
        else:
            cache.delete(digest)
    except Exception:  # removing a bad entry is best effort
        logger.debug("jaxaot: could not remove bad entry %s", digest[:16], exc_info=True)


def write(cache: Cache, entry: Entry) -> None:
    try:
        blob = _entry.encode(entry)
    except NotPersistable as e:
        logger.debug("jaxaot: not caching %s (%s): %s", entry.name, entry.key.digest[:16], e)
        return
    try:
        cache.put(entry.key.digest, blob)
    except Exception as e:
        _stats.bump("cache_errors")
        _stats.warn_once(
            f"put:{type(cache).__name__}:{type(e).__name__}",
            f"jaxaot: writing to {cache!r} failed ({type(e).__name__}: {e}); continuing without it",
        )
