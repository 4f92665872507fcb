"""Counters per component and for the whole process."""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import NamedTuple

logger = logging.getLogger("jaxaot")

COUNTERS = ("hits", "misses", "traces", "lowerings", "compiles")


class CacheInfo(NamedTuple):
    """What one component did in this process.

    ``hits``/``misses``: entry look-ups served from a cache or not; ``traces``:
    times the Python body ran under tracing; ``lowerings``: StableHLO modules
    produced; ``compiles``: XLA executables compiled.
    """

    hits: int = 0
    misses: int = 0
    traces: int = 0
    lowerings: int = 0
    compiles: int = 0


class KeyedLocks:
    """One lock per key, made on first use: work on different keys runs in parallel,
    work on one key once."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Hashable, threading.Lock] = {}

    def __call__(self, key: Hashable) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())


class Counters:
    """Thread-safe counters; every increment also counts process-wide."""

    def __init__(self, parent: Counters | None = None) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)
        self._parent = parent

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n
        if self._parent is not None:
            self._parent.add(name, n)

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(**self._values)

    def reset(self) -> None:
        with self._lock:
            self._values = dict.fromkeys(COUNTERS, 0)


PROCESS = Counters()
_extra_lock = threading.Lock()
_extra: dict[str, float] = {
    "cache_errors": 0,
    "corrupt_entries": 0,
    "unusable_entries": 0,
    "components": 0,
    # One maker per entry across processes (``_store._once``):
    "made_here": 0,  # entries (lowered, derived, executables) this process made
    "loaded_after_wait": 0,  # entries another process made while this one waited
    "wait_seconds": 0.0,  # time spent waiting for other processes' entries
    "lease_takeovers": 0,  # entries whose maker died: made here instead
    "lease_wait_timeouts": 0,  # waits past $JAXAOT_LEASE_WAIT: made here instead
}


def bump(name: str, n: float = 1) -> None:
    with _extra_lock:
        _extra[name] = _extra.get(name, 0) + n


def stats() -> dict[str, float]:
    """Process-wide counts: hits, misses, traces, lowerings, compiles, faults, and
    the fleet's (entries ``made_here``, ``loaded_after_wait`` for another process,
    ``wait_seconds``, ``lease_takeovers``, ``lease_wait_timeouts``). All are whole
    numbers but ``wait_seconds``."""
    with _extra_lock:
        extra = dict(_extra)
    extra["wait_seconds"] = round(extra["wait_seconds"], 3)
    return {**PROCESS.info()._asdict(), **extra}


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(cause: str, message: str) -> None:
    """Logs ``message`` as a WARNING the first time ``cause`` is seen, then at DEBUG."""
    with _warned_lock:
        first = cause not in _warned
        _warned.add(cause)
    logger.log(logging.WARNING if first else logging.DEBUG, message)


def reset_warnings() -> None:
    with _warned_lock:
        _warned.clear()
