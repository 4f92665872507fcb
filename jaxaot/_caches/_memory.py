"""An in-process, bounded, thread-safe cache.

It lends no leases (``_protocol.Leasing``): no other process can see it, and
within one process the store's own locks already make each entry once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ._faults import WarnOnce
from ._protocol import INDEX_ITEM_BYTES, INDEX_ITEMS, check_key

DEFAULT_MEMORY_BYTES = 1 << 30
#: The most index tags kept (``note``), least recently noted dropped first.
_INDEX_TAGS = 1024


class MemoryCache(WarnOnce):
    """A byte cache held in this process, least recently used evicted first.

    Args:
      max_bytes: the most bytes of values kept at once. A value larger than
        this is not stored (one warning per cache).

    Example::

      cache = jaxaot.MemoryCache(max_bytes=256 << 20)
      jaxaot.set_cache(cache)
    """

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(
                f"MemoryCache: max_bytes must be a non-negative int, got {max_bytes!r}"
            )
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._hits: dict[str, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._counters = {"hits": 0, "misses": 0, "puts": 0, "evictions": 0}
        self._state_lock = threading.Lock()
        self._index: OrderedDict[str, OrderedDict[str, bytes]] = OrderedDict()

    def __repr__(self) -> str:
        return f"MemoryCache(max_bytes={self.max_bytes})"

    def _log_prefix(self) -> str:
        return "memory cache"

    def get(self, key: str) -> bytes | None:
        check_key(key)
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self._counters["misses"] += 1
                return None
            self._data.move_to_end(key)
            self._hits[key] += 1
            self._counters["hits"] += 1
            return value

    def put(self, key: str, value: bytes) -> None:
        check_key(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"MemoryCache.put: value must be bytes, got {type(value).__name__}")
        value = bytes(value)
        if len(value) > self.max_bytes:
            self._warn_once(
                "larger than max_bytes",
                f"put of {key[:16]} skipped: {len(value)} bytes is more than the whole cache "
                f"may hold (max_bytes {self.max_bytes})",
            )
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._data[key] = value
            self._hits.setdefault(key, 0)
            self._bytes += len(value)
            self._counters["puts"] += 1
            while self._bytes > self.max_bytes:
                evicted, blob = self._data.popitem(last=False)
                self._hits.pop(evicted, None)
                self._bytes -= len(blob)
                self._counters["evictions"] += 1

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            value = self._data.pop(key, None)
            if value is None:
                return False
            self._hits.pop(key, None)
            self._bytes -= len(value)
            return True

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._hits.clear()
            self._index.clear()
            self._bytes = 0

    def note(self, tag: str, key: str, item: bytes) -> None:
        """Notes ``item`` about ``key`` under ``tag`` (see ``_protocol.Indexing``)."""
        check_key(tag)
        check_key(key)
        if len(item) > INDEX_ITEM_BYTES:
            return
        with self._lock:
            noted = self._index.get(tag)
            if noted is None:
                noted = self._index[tag] = OrderedDict()
                while len(self._index) > _INDEX_TAGS:
                    self._index.popitem(last=False)
            self._index.move_to_end(tag)
            if key in noted:
                return
            noted[key] = bytes(item)
            while len(noted) > INDEX_ITEMS:
                noted.popitem(last=False)

    def notes(self, tag: str) -> list[tuple[str, bytes]]:
        """The notes under ``tag`` of stored entries, most recent first; no use of any."""
        check_key(tag)
        with self._lock:
            noted = self._index.get(tag)
            if noted is None:
                return []
            return [(k, v) for k, v in reversed(noted.items()) if k in self._data]

    def hit_count(self, key: str) -> int:
        """How many times ``get`` returned the value stored under ``key``."""
        with self._lock:
            return self._hits.get(check_key(key), 0)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "backend": "memory",
                "entries": len(self._data),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                **self._counters,
            }
