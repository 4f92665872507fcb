"""MemoryCache: the byte protocol, LRU by bytes, hit counts, threads."""

from __future__ import annotations

import logging
import threading

import pytest

import jaxaot
from jaxaot._caches import Cache


def k(i: int) -> str:
    return f"{i:064x}"


def test_protocol_round_trip() -> None:
    cache = jaxaot.MemoryCache(max_bytes=1000)
    assert isinstance(cache, Cache)
    assert cache.get(k(1)) is None
    cache.put(k(1), b"abc")
    assert cache.get(k(1)) == b"abc"
    assert cache.keys() == [k(1)]
    assert cache.delete(k(1)) is True and cache.delete(k(1)) is False
    cache.put(k(2), b"x")
    cache.clear()
    assert cache.keys() == [] and cache.stats()["bytes"] == 0


def test_lru_by_bytes() -> None:
    cache = jaxaot.MemoryCache(max_bytes=30)
    for i in range(3):
        cache.put(k(i), bytes(10))
    assert cache.get(k(0)) is not None  # 0 becomes most recently used
    cache.put(k(3), bytes(10))
    assert cache.get(k(1)) is None
    assert {k(0), k(2), k(3)} == set(cache.keys())
    stats = cache.stats()
    assert stats["bytes"] == 30 and stats["evictions"] == 1 and stats["entries"] == 3


def test_oversized_values_are_not_stored() -> None:
    cache = jaxaot.MemoryCache(max_bytes=5)
    cache.put(k(1), bytes(6))
    assert cache.keys() == []


def test_hit_counts() -> None:
    cache = jaxaot.MemoryCache()
    cache.put(k(1), b"v")
    for _ in range(3):
        cache.get(k(1))
    cache.get(k(2))
    assert cache.hit_count(k(1)) == 3
    assert cache.stats()["hits"] == 3 and cache.stats()["misses"] == 1


@pytest.mark.parametrize(
    "bad", ["../etc/passwd", "ABC" * 10, "a" * 300, "k\x00" * 10, "é" * 20, 12]
)
def test_bad_keys_are_refused(bad: object) -> None:
    cache = jaxaot.MemoryCache()
    with pytest.raises(ValueError):
        cache.put(bad, b"v")  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        jaxaot.MemoryCache(max_bytes=-1)
    with pytest.raises(TypeError, match="bytes"):
        jaxaot.MemoryCache().put(k(1), "text")  # type: ignore[arg-type]


def test_threads_keep_the_byte_count_exact() -> None:
    cache = jaxaot.MemoryCache(max_bytes=2000)
    barrier = threading.Barrier(8)

    def worker(t: int) -> None:
        barrier.wait()
        for i in range(300):
            key = k((t * 7 + i) % 40)
            cache.put(key, bytes((i % 9) * 10 + 1))
            cache.get(key)
            if i % 13 == 0:
                cache.delete(key)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = cache.stats()
    assert stats["bytes"] == sum(len(cache.get(key) or b"") for key in cache.keys())
    assert stats["bytes"] <= 2000


def test_value_larger_than_the_cap_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    cache = jaxaot.MemoryCache(max_bytes=10)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    for i in range(4):
        cache.put(f"{i:02x}" * 16, bytes(11))
    assert cache.keys() == []
    warnings = [r for r in caplog.records if r.name == "jaxaot" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "max_bytes 10" in warnings[0].getMessage()
