"""Counters per component and for the whole process."""

from __future__ import annotations

import atexit
import logging
import os
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
    "loaded": 0,  # entries (lowered, derived, executables) read from a cache
    "compile_seconds": 0.0,  # XLA's time compiling what this process made
}


def bump(name: str, n: float = 1) -> None:
    with _extra_lock:
        _extra[name] = _extra.get(name, 0) + n


def stats() -> dict[str, float]:
    """Process-wide counts: hits, misses, traces, lowerings, compiles, faults,
    entries ``loaded`` from a cache and ``compile_seconds`` (XLA's time compiling
    what jaxaot made here), and the fleet's (entries ``made_here``,
    ``loaded_after_wait`` for another process, ``wait_seconds``,
    ``lease_takeovers``, ``lease_wait_timeouts``). All are whole numbers but
    ``wait_seconds`` and ``compile_seconds``."""
    with _extra_lock:
        extra = dict(_extra)
    extra["wait_seconds"] = round(extra["wait_seconds"], 3)
    extra["compile_seconds"] = round(extra["compile_seconds"], 3)
    return {**PROCESS.info()._asdict(), **extra}


def report() -> str:
    """One line saying what this process did: entries loaded from the cache,
    entries made here, XLA compiles and the seconds spent compiling them, e.g.
    ``jaxaot: warm start: loaded 4 entries from the cache, made 0 here (0 compiles,
    0.00 s compiling)``.

    ``warm start`` when everything came from the cache (nothing lowered or
    compiled), ``cold start`` when nothing did, ``partly warm`` in between.
    With ``JAXAOT_VERBOSE=1`` the line is logged (INFO, to stderr) at exit."""
    s = stats()
    loaded, made, compiles = int(s["loaded"]), int(s["made_here"]), int(s["compiles"])
    if loaded + made == 0:
        state = "nothing loaded or made"
    elif made == 0 and s["lowerings"] == 0 and compiles == 0:
        state = "warm start"
    elif loaded == 0:
        state = "cold start"
    else:
        state = "partly warm"
    return (
        f"jaxaot: {state}: loaded {_entries(loaded)} from the cache, made {made} here "
        f"({compiles} compile{'' if compiles == 1 else 's'}, "
        f"{s['compile_seconds']:.2f} s compiling)"
    )


def _entries(n: int) -> str:
    return "1 entry" if n == 1 else f"{n} entries"


VERBOSE_ENV = "JAXAOT_VERBOSE"


class _Making(threading.local):
    depth = 0  # makes in progress in this thread (nested: an executable's entries)


_making = _Making()
_watching = False
_watch_lock = threading.Lock()


class making:
    """Marks this thread as making something for jaxaot (``_store._once``): XLA
    compiles that finish meanwhile count in ``compile_seconds``."""

    def __enter__(self) -> None:
        _making.depth += 1

    def __exit__(self, *exc: object) -> None:
        _making.depth -= 1


def _on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    # JAX records one such event per XLA compile, in the compiling thread.
    if event == "/jax/core/compile/backend_compile_duration" and _making.depth:
        bump("compile_seconds", duration_secs)


def watch_compiles() -> None:
    """Starts counting compile seconds (JAX's own compile event; imports
    ``jax.monitoring``, so call it from a layer that uses JAX), and with
    ``JAXAOT_VERBOSE=1`` logs :func:`report` at exit. Idempotent."""
    global _watching
    with _watch_lock:
        if _watching:
            return
        _watching = True
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_event)
    if os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        if not logger.handlers:
            # Opted in: the line must be seen without the program configuring logging.
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        atexit.register(lambda: logger.info("%s", report()))


_warned: set[str] = set()
_warned_lock = threading.Lock()


def first_time(cause: str, seen: set[str] | None = None) -> bool:
    """Whether ``cause`` is new to ``seen`` (the process's causes by default; a
    cache passes its own), marking it seen: the one test behind every
    one-warning-per-cause in jaxaot (``warn_once`` here, ``_caches._faults.WarnOnce``)."""
    with _warned_lock:
        scope = _warned if seen is None else seen
        first = cause not in scope
        scope.add(cause)
    return first


def warn_once(cause: str, message: str) -> None:
    """Logs ``message`` as a WARNING the first time ``cause`` is seen in this
    process, then at DEBUG."""
    logger.log(logging.WARNING if first_time(cause) else logging.DEBUG, message)


def reset_warnings() -> None:
    with _warned_lock:
        _warned.clear()
