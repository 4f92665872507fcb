"""Caches layered fastest first: a local directory in front of a shared store.

``TieredCache(DirectoryCache(...), RedisCache(...))`` reads the directory
first and the remote store only on a local miss. Every hit is *verified*
(checksum, signature with ``$JAXAOT_CACHE_HMAC_KEY``, header, and the entry's
own key digest against the key it was stored under) before it is returned or
copied into the faster tiers, so a damaged or planted entry is never promoted
nor returned: a damaged one is removed from the tier that returned it, and
only from that tier (``quarantine`` where the tier has it, else ``delete``); a
sound entry that this process cannot check (signed with another key...) is
left alone; either way the look-up goes on to the next tier, and a sound copy
found there is returned and copied into the faster tiers.

Leases (``lease``) are taken in the slowest tier that lends them: the shared
store, where the other processes look. A process waiting for an entry reads
every tier, so it finds the entry wherever it lands first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from ._faults import WarnOnce, lost_write
from ._protocol import (
    INDEX_ITEMS,
    BadEntry,
    Cache,
    EntryCheck,
    Held,
    Indexing,
    Lease,
    Leasing,
    Quarantining,
    check_key,
)

__all__ = ["TieredCache"]

logger = logging.getLogger("jaxaot")

_SERVED_MAX = 4096


class TieredCache(WarnOnce):
    """Several caches read fastest first, written all at once.

    Args:
      *caches: the tiers, fastest (most local) first.
      check: what verifies a hit (raises ``BadEntry``). The store gives it the
        entry format's own verification (checksum, signature, header, and that
        the entry's key digest names the key it is stored under) when the cache
        becomes its cache (``jaxaot.set_cache``, ``using_cache``, ``JAXAOT_CACHE``)
        and has none.
      write_back: a verified hit is copied into the slower tiers as well (see
        :meth:`filling`).

    * ``get`` tries each tier in order and verifies each hit: a sound entry is copied into every faster tier
      and returned; a damaged one counts as that tier's miss, is removed from
      that tier only, and the next tier is tried; a sound entry this process
      cannot check (another key, unsigned...) is left alone, with one warning
      per cause, and the next tier is tried.
    * ``quarantine(key)`` (called by a reader that could not use what ``get``
      returned) acts on the tier that returned it and the faster tiers it was
      copied into, never on slower tiers.
    * ``put`` writes to every tier. A tier that raises does not stop the
      others (one warning per cause).
    * ``delete`` removes from every tier, ``keys`` is the union, ``clear``
      clears every tier, ``stats`` reports each tier.

    Example::

      jaxaot.set_cache(TieredCache(DirectoryCache("~/.cache/jaxaot"),
                                   RedisCache("redis://cache:6379/0")))
    """

    def __init__(
        self, *caches: Cache, check: EntryCheck | None = None, write_back: bool = False
    ) -> None:
        if not caches:
            raise ValueError("TieredCache needs at least one cache")
        for i, c in enumerate(caches):
            if not isinstance(c, Cache):
                raise TypeError(
                    f"TieredCache: tier {i} is not a jaxaot cache "
                    f"(get/put/delete/keys/clear/stats): {type(c).__name__}"
                )
        self.tiers: tuple[Cache, ...] = tuple(caches)
        self.check = check
        self.write_back = write_back
        self._state_lock = threading.Lock()
        self._counters = {
            "hits": 0,
            "misses": 0,
            "promotions": 0,
            "refused": 0,
            "tier_errors": 0,
        }
        self._tier_hits = [0] * len(caches)
        #: key -> the tier its last ``get`` was served from (for ``quarantine``).
        self._served: OrderedDict[str, int] = OrderedDict()

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

    def _remove_bad(
        self, i: int, key: str, *, force: bool = False, check: EntryCheck | None = None
    ) -> None:
        tier = self.tiers[i]
        try:
            if not isinstance(tier, Quarantining):
                tier.delete(key)
            else:
                try:
                    tier.quarantine(key, force=force, check=check or self.check)
                except TypeError:  # a tier whose quarantine takes no ``force`` or ``check``
                    tier.quarantine(key)  # type: ignore[call-arg]
        except Exception as e:  # removal is best effort
            self._tier_failed(i, "removing a bad entry", e)

    def _sound(self, i: int, key: str, blob: bytes, check: EntryCheck) -> bool:
        """Whether tier ``i``'s ``blob`` passes the check; a damaged one is removed from
        that tier, one this process cannot check is left alone (one warning per cause)."""
        try:
            check(key, blob)
        except BadEntry as e:
            self._count("refused")
            tier = self.tiers[i]
            if e.removable:
                self._warn_once(
                    f"refused:{i}:{e.cause}",
                    f"refused entry {key[:16]} from tier {i} ({tier!r}): {e}; "
                    "removed from that tier, trying the next",
                )
                self._remove_bad(i, key)
            else:
                self._warn_once(
                    f"unusable:{e.cause}",
                    f"entry {key[:16]} from tier {i} ({tier!r}) cannot be used by this "
                    f"process ({e}); a miss here, left alone",
                )
            return False
        return True

    def filling(self) -> TieredCache:
        """These tiers, read as they are, but a hit in a faster tier is also
        written to every slower one: what ``jaxaot precompile`` fills, so that
        an entry it finds in the local tier reaches the shared store that the
        deployment's machines read, rather than being "already present"."""
        return TieredCache(*self.tiers, check=self.check, write_back=True)

    def _promote(self, i: int, key: str, blob: bytes) -> None:
        """Copies a verified hit from tier ``i`` into every faster tier (and every
        slower one, writing back)."""
        for j in (j for j in range(len(self.tiers)) if j < i or (self.write_back and j > i)):
            try:
                self.tiers[j].put(key, blob)
            except Exception as e:
                self._tier_failed(j, "put", e)
            else:
                self._count("promotions")

    def _remember(self, key: str, tier: int) -> None:
        with self._state_lock:
            self._served[key] = tier
            self._served.move_to_end(key)
            while len(self._served) > _SERVED_MAX:
                self._served.popitem(last=False)

    # -- protocol ------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The first sound copy of ``key`` from the fastest tier that has one, or ``None``.

        Without an entry check, the first copy found is returned unverified and
        not copied into the faster tiers."""
        check_key(key)
        check = self.check
        for i, tier in enumerate(self.tiers):
            try:
                blob = tier.get(key)
            except Exception as e:
                self._tier_failed(i, "get", e)
                continue
            if blob is None:
                continue
            blob = bytes(blob)
            if check is None:
                pass  # nothing to verify with: returned as found, never promoted
            elif self._sound(i, key, blob, check):
                self._promote(i, key, blob)
            else:
                continue
            self._remember(key, i)
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
                lost_write()

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

    def lease(self, key: str, ttl: float) -> Lease | Held | None:
        """The lease on ``key`` in the slowest tier that lends one (the shared one);
        while it lends none (a server down, backing off), the next faster tier's:
        the processes that share a directory still make each entry once. ``None``
        if no tier lends one."""
        check_key(key)
        for i in reversed(range(len(self.tiers))):
            tier = self.tiers[i]
            if isinstance(tier, Leasing):
                try:
                    got = tier.lease(key, ttl)
                except Exception as e:
                    self._tier_failed(i, "lease", e)
                    continue
                if got is not None:
                    return got
        return None

    def note(self, tag: str, key: str, item: bytes) -> None:
        """Notes ``item`` about ``key`` under ``tag`` in every tier that keeps notes."""
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, Indexing):
                try:
                    tier.note(tag, key, item)
                except Exception as e:
                    self._tier_failed(i, "note", e)

    def notes(self, tag: str) -> list[tuple[str, bytes]]:
        """The notes under ``tag`` from the tiers that keep them, fastest tier first,
        each key once (no entry is read). Writing back (``filling``), the notes a
        tier lacks are written to it, so that the shared tiers hold what the
        local one noted."""
        found: dict[str, bytes] = {}
        held: dict[int, set[str]] = {}
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, Indexing):
                try:
                    noted = tier.notes(tag)
                except Exception as e:
                    self._tier_failed(i, "notes", e)
                    continue
                held[i] = {key for key, _ in noted}
                for key, item in noted:
                    found.setdefault(key, item)
        out = list(found.items())[:INDEX_ITEMS]
        if self.write_back:
            for i, keys in held.items():
                for key, item in reversed(out):  # (the oldest first: the newest ends first)
                    if key not in keys:
                        try:
                            self.tiers[i].note(tag, key, item)  # type: ignore[attr-defined]
                        except Exception as e:
                            self._tier_failed(i, "note", e)
        return out

    def quarantine(self, key: str, *, force: bool = False, check: EntryCheck | None = None) -> None:
        """Removes a bad entry: from the tier that last served ``key`` and the faster
        tiers it was copied into; from every tier if it was not served here. Each
        tier's own ``quarantine`` is used where it has one (and decides, unless
        ``force``, to leave alone a sound entry this process cannot check)."""
        check_key(key)
        with self._state_lock:
            source = self._served.pop(key, None)
        last = len(self.tiers) - 1 if source is None else source
        for i in range(last + 1):
            self._remove_bad(i, key, force=force, check=check)
