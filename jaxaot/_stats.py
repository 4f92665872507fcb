"""Counters per component and for the whole process."""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

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
    """Thread-safe counters by name (whole numbers, or seconds); every increment
    also counts in ``parent`` (a component's in the process's, :data:`PROCESS`)."""

    def __init__(self, parent: Counters | None = None) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._parent = parent

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n
        if self._parent is not None:
            self._parent.add(name, n)

    def values(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def info(self) -> CacheInfo:
        values = self.values()
        return CacheInfo(**{name: int(values[name]) for name in COUNTERS})

    def reset(self) -> None:
        with self._lock:
            self._values = dict.fromkeys(COUNTERS, 0)


#: The process's counters: every component's, and what only the process counts.
PROCESS = Counters()
_PROCESS_ONLY = (
    "cache_errors",
    "cache_write_errors",
    "corrupt_entries",
    "unusable_entries",
    "components",
    # One maker per entry across processes (``_store._once``):
    "made_here",  # entries (lowered, derived, executables) this process made
    "made_in_process",  # of which, entries no process writes (kept in each process)
    "loaded_after_wait",  # entries another process made while this one waited
    "wait_seconds",  # time spent waiting for other processes' entries
    "lease_takeovers",  # entries whose maker died: made here instead
    "lease_wait_timeouts",  # waits past $JAXAOT_LEASE_WAIT: made here instead
    "loaded",  # entries (lowered, derived, executables) read from a cache, not written here
    "prefetched",  # of which, executables loaded while their program was traced (``_prefetch``)
    "compile_seconds",  # XLA's time compiling what this process made
)


def bump(name: str, n: float = 1) -> None:
    """Counts ``n`` more ``name`` for the whole process."""
    PROCESS.add(name, n)


def stats() -> dict[str, float]:
    """Process-wide counts: hits, misses, traces (of component bodies: every
    process traces a ``jaxaot.jit`` program, as ``jax.jit`` does, and that is not
    counted), lowerings, compiles, faults
    (``cache_write_errors``: values a cache did not store, the write failed or
    was skipped),
    entries ``loaded`` from a cache (of which executables ``prefetched``: loaded
    on a background thread while their program was traced), ``compile_seconds``
    (XLA's time compiling what jaxaot made here), and the fleet's (entries ``made_here``,
    ``loaded_after_wait`` for another process, ``wait_seconds``,
    ``lease_takeovers``, ``lease_wait_timeouts``). All are whole numbers but
    ``wait_seconds`` and ``compile_seconds``."""
    values = {**dict.fromkeys((*COUNTERS, *_PROCESS_ONLY), 0), **PROCESS.values()}
    out: dict[str, float] = {}
    for name, value in values.items():
        seconds = name.endswith("_seconds")
        out[name] = round(float(value), 3) if seconds else int(value)
    return out


def report() -> str:
    """One line saying what this process did: entries loaded from the cache,
    entries made here, XLA compiles and the seconds spent compiling them, e.g.
    ``jaxaot: warm start: loaded 4 entries from the cache, made 0 here (0 compiles,
    0.00 s compiling)``.

    ``warm start`` when everything came from the cache (nothing lowered or
    compiled), ``cold start`` when nothing did, ``partly warm`` in between.
    With ``JAXAOT_VERBOSE=1`` the line is logged (INFO, to stderr) at exit."""
    s = stats()
    loaded, compiles = int(s["loaded"]), int(s["compiles"])
    # Entries every process derives afresh (never written) are no sign of a cold cache.
    made = max(int(s["made_here"]) - int(s["made_in_process"]), 0)
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
    eager = 0  # eager component calls JAX runs op by op (see ``eager``)


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


@contextlib.contextmanager
def set_during(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """``var`` set to ``value`` in this context while the block runs."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


class eager:
    """Marks this thread as running what JAX compiles outside jaxaot's cache (a
    component call op by op, ``vmap`` or ``grad`` of it outside ``jax.jit``; a
    ``jaxaot.jit`` program run under plain ``jax.jit``): each such compile counts
    in ``compiles`` and ``compile_seconds``, so that :func:`report` does not call
    the process warm."""

    def __enter__(self) -> None:
        _making.eager += 1

    def __exit__(self, *exc: object) -> None:
        _making.eager -= 1


def _on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    # JAX records one such event per XLA compile, in the compiling thread.
    if event != "/jax/core/compile/backend_compile_duration":
        return
    if _making.depth:
        bump("compile_seconds", duration_secs)
    elif _making.eager:
        bump("compiles")
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
        atexit.register(_report_at_exit)


def _report_at_exit() -> None:
    # Opted in: the line is seen, through the program's own logging where it set
    # some up (once), else through a handler of ours.
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    logger.info("%s", report())


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(cause: str, message: str, seen: set[str] | None = None) -> None:
    """Logs ``message`` as a WARNING the first time ``cause`` is seen, then at DEBUG:
    the one warn-once of jaxaot. ``seen``: the causes already warned of (the
    process's by default; a cache backend passes its own)."""
    with _warned_lock:
        scope = _warned if seen is None else seen
        first = cause not in scope
        scope.add(cause)
    logger.log(logging.WARNING if first else logging.DEBUG, message)


def reset_warnings() -> None:
    with _warned_lock:
        _warned.clear()
