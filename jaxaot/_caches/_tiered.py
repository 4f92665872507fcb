"""Caches layered fastest first: a local directory in front of a shared store.

``TieredCache(DirectoryCache(...), RedisCache(...))`` reads the directory
first and the remote store only on a local miss. A remote hit is *verified*
(checksum, or signature with ``$JAXAOT_CACHE_HMAC_KEY``, and the entry's own
key digest against the key it was stored under) before it is copied into the
faster tiers, so a damaged or planted remote entry is never promoted: it is
removed from its tier (``quarantine`` where the tier has it, else ``delete``)
and the look-up goes on to the next tier.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ._faults import WarnOnce
from ._protocol import Cache, check_key

__all__ = ["TieredCache", "verify_entry"]

logger = logging.getLogger("jaxaot")


def verify_entry(key: str, blob: bytes) -> dict[str, Any]:
    """Checks that ``blob`` is a sound entry for cache key ``key``; returns its header.

    Verifies the checksum (the HMAC signature when ``$JAXAOT_CACHE_HMAC_KEY``
    is set), the format, and that the digest recorded in the header, and the
    digest of the key parts recorded in the header, both name ``key``.

    Raises:
      jaxaot._entry.EntryError: the entry is damaged, unsigned, foreign, of
        another format version, or stored under another key.
    """
    from .._entry import EntryError, verify
    from .._key import ComponentKey

    header, _ = verify(blob)
    try:
        digest = ComponentKey.from_json(header["key"]).digest
    except (KeyError, TypeError, ValueError) as e:
        raise EntryError(f"malformed key parts: {e}") from e
    if header.get("digest") != digest or not key.startswith(digest):
        raise EntryError(f"stored under the wrong key (its key digest is {digest[:12]})")
    return header


class TieredCache(WarnOnce):
    """Several caches read fastest first, written all at once.

    Args:
      *caches: the tiers, fastest (most local) first.

    * ``get`` tries each tier in order. A hit in the first tier is returned as
      is (the reader verifies it anyway). A hit in a later tier is verified
      with :func:`verify_entry` first: a sound entry is copied into every
      faster tier and returned; a bad one counts as that tier's miss, is
      removed from it, and the next tier is tried.
    * ``put`` writes to every tier. A tier that raises does not stop the
      others (one warning per cause).
    * ``delete`` removes from every tier, ``keys`` is the union, ``clear``
      clears every tier, ``stats`` reports each tier.

    Example::

      jaxaot.set_cache(TieredCache(DirectoryCache("~/.cache/jaxaot"),
                                   RedisCache("redis://cache:6379/0")))
    """

    def __init__(self, *caches: Cache) -> None:
        if not caches:
            raise ValueError("TieredCache needs at least one cache")
        for i, c in enumerate(caches):
            if not isinstance(c, Cache):
                raise TypeError(
                    f"TieredCache: tier {i} is not a jaxaot cache "
                    f"(get/put/delete/keys/clear/stats): {type(c).__name__}"
                )
        self.tiers: tuple[Cache, ...] = tuple(caches)
        self._state_lock = threading.Lock()
        self._warned: set[str] = set()
        self._counters = {
            "hits": 0,
            "misses": 0,
            "promotions": 0,
            "refused": 0,
            "tier_errors": 0,
        }
        self._tier_hits = [0] * len(caches)

    def __repr__(self) -> str:
        return "TieredCache(" + ", ".join(repr(t) for t in self.tiers) + ")"

    # -- helpers -------------------------------------------------------------

    def _log_prefix(self) -> str:
        return "tiered cache"

    def _tier_failed(self, i: int, what: str, e: Exception) -> None:
        self._count("tier_errors")
        self._warn_once(
            f"{what}:{i}:{type(e).__name__}",
            f"{what} on tier {i} ({self.tiers[i]!r}) raised {type(e).__name__}: {e}; "
            "going on without it",
        )

    def _remove_bad(self, i: int, key: str) -> None:
        tier = self.tiers[i]
        quarantine = getattr(tier, "quarantine", None)
        try:
            if quarantine is not None:
                quarantine(key)
            else:
                tier.delete(key)
        except Exception as e:  # removal is best effort
            self._tier_failed(i, "removing a bad entry", e)

    # -- protocol ------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The first sound copy of ``key`` from the fastest tier that has one, or ``None``."""
        from .._entry import EntryError

        check_key(key)
        for i, tier in enumerate(self.tiers):
            try:
                blob = tier.get(key)
            except Exception as e:
                self._tier_failed(i, "get", e)
                continue
            if blob is None:
                continue
            blob = bytes(blob)
            if i > 0:
                try:
                    verify_entry(key, blob)
                except EntryError as e:
                    self._count("refused")
                    self._warn_once(
                        f"refused:{i}",
                        f"refused entry {key[:16]} from tier {i} ({tier!r}): {e}; "
                        "not promoted, removed from that tier",
                    )
                    self._remove_bad(i, key)
                    continue
                for j in range(i):
                    try:
                        self.tiers[j].put(key, blob)
                    except Exception as e:
                        self._tier_failed(j, "put", e)
                    else:
                        self._count("promotions")
            with self._state_lock:
                self._counters["hits"] += 1
                self._tier_hits[i] += 1
            return blob
        self._count("misses")
        return None

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        """Writes ``value`` to every tier; a tier that raises is skipped (one warning per cause)."""
        check_key(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"TieredCache.put: value must be bytes, got {type(value).__name__}")
        value = bytes(value)
        for i, tier in enumerate(self.tiers):
            try:
                tier.put(key, value)
            except Exception as e:
                self._tier_failed(i, "put", e)

    def delete(self, key: str) -> bool:
        """Removes ``key`` from every tier; returns whether any tier had it."""
        check_key(key)
        removed = False
        for i, tier in enumerate(self.tiers):
            try:
                removed = bool(tier.delete(key)) or removed
            except Exception as e:
                self._tier_failed(i, "delete", e)
        return removed

    def keys(self) -> list[str]:
        """The keys held by any tier."""
        found: set[str] = set()
        for i, tier in enumerate(self.tiers):
            try:
                found.update(tier.keys())
            except Exception as e:
                self._tier_failed(i, "keys", e)
        return sorted(found)

    def clear(self) -> None:
        """Clears every tier."""
        for i, tier in enumerate(self.tiers):
            try:
                tier.clear()
            except Exception as e:
                self._tier_failed(i, "clear", e)

    def stats(self) -> dict[str, Any]:
        """``entries``: distinct keys over all tiers; ``bytes``: the sum over the tiers;
        ``tiers``: each tier's own stats; plus this cache's counters."""
        tiers: list[dict[str, Any]] = []
        for i, tier in enumerate(self.tiers):
            try:
                tiers.append(dict(tier.stats()))
            except Exception as e:
                self._tier_failed(i, "stats", e)
                tiers.append({"backend": type(tier).__name__, "error": f"{type(e).__name__}: {e}"})
        sizes = [t.get("bytes") for t in tiers]
        with self._state_lock:
            counters = dict(self._counters)
            tier_hits = list(self._tier_hits)
        return {
            "backend": "tiered",
            "entries": len(self.keys()),
            "bytes": sum(s for s in sizes if isinstance(s, int)),
            **counters,
            "tier_hits": tier_hits,
            "tiers": tiers,
        }

    # -- extras --------------------------------------------------------------

    def quarantine(self, key: str) -> None:
        """Removes a bad entry from every tier (each tier's ``quarantine`` when it has one)."""
        check_key(key)
        for i in range(len(self.tiers)):
            self._remove_bad(i, key)
