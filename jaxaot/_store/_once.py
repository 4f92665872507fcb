"""One maker per entry across a fleet: of the processes that miss an entry in a
shared cache at the same time, one makes it and the others load it.

:func:`make_once` is the one place where a miss turns into work, used by every
site that makes something a cache can hold: lowered and derived entries and
top-level executables (``_lookup.Store``), and ``jaxaot.jit``'s glue,
whole-program and region executables (``_regional._programs``). On a miss it
asks the cache for the entry's lease (``_caches.Leasing``):

* **taken**: it makes the entry, writes it, and releases the lease once it is
  written (a background write releases it when done); a heartbeat thread renews
  a lease that expires (Redis, object stores) meanwhile; a lock file needs none.
  (An entry written between the miss and the lease is not missed: its maker's
  lease still says ``done``, see below.)
* **held by another process**: it waits, polling the cache with a short
  back-off (2 ms growing to 25 ms; a poll costs a failed ``open`` or a round
  trip), and loads the entry as soon as it lands. Each poll also asks for
  the lease again, so when the holder dies (its lock file is unlocked at
  once, a Redis or object-store lease expires after its ``ttl``) one waiter
  takes over and makes it. A holder that is done but left
  no entry (it could not be written: host callbacks, a full disk) lets the
  waiters make it at once, each for itself;
* **none to be had** (the cache lends no leases, or the store is down): it makes
  the entry itself, as without leases.

A wait is bounded: after ``JAXAOT_LEASE_WAIT`` seconds (default 300) the
process makes the entry itself, with one warning. A holder that ran past the
wait is then not waited for in that cache for as long again (or until it is seen
done with an entry): a stalled process (stopped, swapping) holds the leases of
an entry and of the entries it is made from, and waiting for each in turn would
cost the waiter one full wait per level. ``JAXAOT_LEASE_WAIT=0``
turns leases off (every process makes what it misses, as before leases).
``JAXAOT_LEASE_TTL`` (default 30 s) is how long a lease outlives its holder's
last renewal where the store cannot tell a dead holder at once.

**No deadlock.** A process may hold one lease while it waits for another:
making an outer component's entry needs its inner components' entries, and an
executable needs its lowered entry. What a process waits for is always
something the entry it holds is made *from*: keys name their content (an
entry's key contains its inner components' keys, an executable's key its
entry's), so these needs form a DAG, and a cycle of processes each waiting for
a lease the next one holds would be a cycle in it. Processes may take leases in
any order. Should a cycle arise anyway (say through in-process locks), the
bounded wait breaks it.

Inside a ``jax.distributed`` job, lowered entries are still made by process 0
and handed to the others (``_job``): only process 0 asks for the lease.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

from .. import _stats
from .._caches import Cache, Held, Lease, Leasing
from .._caches._faults import store_fault_cause
from .._env import number
from . import _progress

__all__ = [
    "LEASE_TTL_ENV",
    "LEASE_WAIT_ENV",
    "Outcome",
    "drop",
    "keep",
    "lease_ttl",
    "lease_wait",
    "make_once",
]

logger = logging.getLogger("jaxaot")

T = TypeVar("T")

LEASE_WAIT_ENV = "JAXAOT_LEASE_WAIT"
LEASE_TTL_ENV = "JAXAOT_LEASE_TTL"
DEFAULT_WAIT = 300.0
DEFAULT_TTL = 30.0
FIRST_POLL = 0.002
MAX_POLL = 0.025


def _seconds(name: str, default: float) -> float:
    return number(name, default, "a non-negative number of seconds", minimum=0.0)


def lease_wait() -> float:
    """Seconds a process waits for another to make an entry (``$JAXAOT_LEASE_WAIT``;
    0 turns leases off)."""
    return _seconds(LEASE_WAIT_ENV, DEFAULT_WAIT)


def lease_ttl() -> float:
    """Seconds a lease outlives its holder's last renewal (``$JAXAOT_LEASE_TTL``)."""
    return max(_seconds(LEASE_TTL_ENV, DEFAULT_TTL), 0.1)


class Outcome(NamedTuple, Generic[T]):
    """What :func:`make_once` got: ``value``, ``made`` here (else loaded from the
    cache), and whether it ``waited`` for another process first."""

    value: T
    made: bool
    waited: bool = False


#: Writes a made value to the cache: ``None`` when written (or not writable),
#: or a future that completes when a background write is done.
Write = Callable[[T], "concurrent.futures.Future[Any] | None"]


def make_once(
    cache: Cache | Leasing | None,
    digest: str,
    what: str,
    load: Callable[[], T | None],
    make: Callable[[], T],
    store: Write[T] | None = None,
    wait_limit: tuple[float, str] | None = None,
) -> Outcome[T]:
    """The value of the cache entry ``digest`` that this process missed: made here
    (``make()``, then ``store(value)``) or, if another process of the fleet is
    making it, loaded from ``cache`` (``load()``, ``None`` while it is not there)
    once it lands. ``what`` names the entry's kind in logs. ``wait_limit``: how
    long to wait for another process, and the variable that sets it (default
    ``$JAXAOT_LEASE_WAIT``'s). Raises what ``make``
    raises, and ``ValueError`` for a malformed ``$JAXAOT_LEASE_WAIT`` or
    ``$JAXAOT_LEASE_TTL``; faults of the cache or its leases are never raised."""
    wait_env = LEASE_WAIT_ENV if wait_limit is None else wait_limit[1]
    if not isinstance(cache, Leasing):
        wait = 0.0
    else:
        wait = lease_wait() if wait_limit is None else wait_limit[0]
    if wait <= 0:
        return Outcome(_make(_watched(make, what), store, None, 0.0), made=True)
    assert isinstance(cache, Leasing)
    ttl = lease_ttl()
    started: float | None = None
    holder = "?"
    poll = FIRST_POLL
    while True:
        got = _lease(cache, digest, ttl)
        if not isinstance(got, Held):
            break  # ours, or none to be had
        stalled = _stalled(cache)
        if got.done:
            stalled.pop(got.holder, None)  # it works again
        elif time.monotonic() - stalled.get(got.holder, -math.inf) < wait:
            logger.debug(
                "jaxaot: %s outlasted a wait just before; making %s %s here",
                got.holder,
                what,
                digest[:16],
            )
            got = None
            break
        if got.done:  # the holder finished: its entry is there, or it could not be written
            value = load()
            if value is not None:
                return _loaded(value, started, digest, what, got.holder)
            logger.debug(
                "jaxaot: %s is done with %s %s but left no entry; making it here",
                got.holder,
                what,
                digest[:16],
            )
            break
        now = time.monotonic()
        if started is None:
            started, holder = now, got.holder
            logger.debug("jaxaot: waiting for %s to make %s %s", holder, what, digest[:16])
        elif now - started >= wait:
            _stats.bump("lease_wait_timeouts")
            _stalled(cache)[got.holder] = time.monotonic()
            _stats.warn_once(
                "lease-wait",
                f"jaxaot: waited {wait:g} s (${wait_env}) for {got.holder} to make "
                f"{what} {digest[:16]}; making it here",
            )
            break
        time.sleep(min(poll, max(wait - (now - started), 0.0)))
        poll = min(poll * 1.5, MAX_POLL)
        value = load()
        if value is not None:
            return _loaded(value, started, digest, what, holder)
    lease = got if got is not None and not isinstance(got, Held) else None
    if lease is not None and started is not None:
        # Another holder stopped: it may have written the entry before it died.
        value = load()
        if value is not None:
            _finish(lease)
            return _loaded(value, started, digest, what, holder)
        _stats.bump("lease_takeovers")
        waited = time.monotonic() - started
        text = (
            f"jaxaot: took over {what} {digest[:16]} from {holder}, whose lease ended before "
            f"the entry was written; waited {waited:.1f} s for it"
        )
        if waited >= 1.0:  # a wait the user feels: said once (a lock file frees at once)
            _stats.warn_once(
                "lease-takeover",
                text + " (a lease ends with its holder's process: at once in a cache "
                "directory, $JAXAOT_LEASE_TTL later on Redis and object stores, or when the "
                "store evicts it: a Redis at its maxmemory)",
            )
        else:
            logger.debug(text)
    if started is not None:
        _stats.bump("wait_seconds", time.monotonic() - started)
    value = _make(_watched(make, what), store, lease, ttl)
    if lease is not None:
        logger.debug("jaxaot: made %s %s holding its lease (%s)", what, digest[:16], lease.holder)
    return Outcome(value, made=True, waited=started is not None)


#: Per cache, the holders that outlasted a whole wait, and when (see the module's
#: docstring).
_STALLED: weakref.WeakKeyDictionary[object, dict[str, float]] = weakref.WeakKeyDictionary()
_STALLED_LOCK = threading.Lock()


def _stalled(cache: object) -> dict[str, float]:
    with _STALLED_LOCK:
        try:
            return _STALLED.setdefault(cache, {})
        except TypeError:  # a cache that cannot be weakly referenced: nothing remembered
            return {}


def _lease(cache: Leasing, digest: str, ttl: float) -> Lease | Held | None:
    try:
        return cache.lease(digest, ttl)
    except Exception as e:  # a backend that raises: no lease, as if it lent none
        _stats.warn_once(
            store_fault_cause(cache, e),
            f"jaxaot: taking a lease in {cache!r} failed ({type(e).__name__}: {e}); "
            "making entries here",
        )
        return None


def _loaded(value: T, started: float | None, digest: str, what: str, holder: str) -> Outcome[T]:
    if started is None:
        return Outcome(value, made=False)
    seconds = time.monotonic() - started
    _stats.bump("wait_seconds", seconds)
    _stats.bump("loaded_after_wait")
    logger.debug(
        "jaxaot: loaded %s %s after waiting %.2f s for %s", what, digest[:16], seconds, holder
    )
    return Outcome(value, made=False, waited=True)


def _watched(make: Callable[[], T], what: str) -> Callable[[], T]:
    """``make``, its XLA compile seconds counted (``jaxaot.report()``) and, when
    opted in, shown while it runs long (``_progress``)."""

    def run() -> T:
        with _stats.making(), _progress.showing(what):
            return make()

    return run


def _make(make: Callable[[], T], store: Write[T] | None, lease: Lease | None, ttl: float) -> T:
    """``make()`` and ``store`` it, holding ``lease`` (renewed every ``ttl / 3``
    seconds) until it is written."""
    if lease is not None:
        keep(lease, ttl)
    try:
        value = make()
        _stats.bump("made_here")
        pending = store(value) if store is not None else None
    except BaseException:
        _finish(lease)
        raise
    if pending is None:
        _finish(lease)
    else:
        pending.add_done_callback(lambda _: _finish(lease))
    return value


def keep(lease: Lease, ttl: float) -> None:
    """Renews ``lease`` every ``ttl / 3`` seconds from the heartbeat thread until it
    is dropped, if it expires (a lock file does not: it costs no thread)."""
    if getattr(lease, "expires", True):
        _HEARTBEAT.add(lease, ttl / 3)


def drop(lease: Lease) -> None:
    """Stops renewing ``lease`` (it stays held until released, or it expires)."""
    _HEARTBEAT.discard(lease)


def _finish(lease: Lease | None) -> None:
    if lease is None:
        return
    drop(lease)
    try:
        lease.release()
    except Exception as e:  # it expires by itself
        logger.debug("jaxaot: releasing %r failed: %s", lease, e)


class _Heartbeat:
    """Renews the leases this process holds, every third of their ttl, from one
    daemon thread (started with the first lease)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # id -> (lease, seconds between renewals, when next)
        self._held: dict[int, tuple[Lease, float, float]] = {}
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease, every: float) -> None:
        with self._cond:
            self._held[id(lease)] = (lease, every, time.monotonic() + every)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxaot-leases", daemon=True)
                self._thread.start()
            self._cond.notify()

    def discard(self, lease: Lease) -> None:
        with self._cond:
            self._held.pop(id(lease), None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [(lease, every) for lease, every, at in self._held.values() if at <= now]
                if not due:
                    nearest = min((at for _, _, at in self._held.values()), default=now + 60)
                    self._cond.wait(nearest - now)
                    continue
                for lease, every in due:
                    self._held[id(lease)] = (lease, every, now + every)
            for lease, _ in due:
                try:
                    kept = lease.renew()
                except Exception:
                    kept = False
                if not kept:
                    logger.debug("jaxaot: lost %r while making its entry", lease)
                    self.discard(lease)

    def forget(self) -> None:
        """In a forked child: the parent's leases and thread are not this process's."""
        self._cond = threading.Condition()
        self._held = {}
        self._thread = None


# Every miss's work passes through here: count its compile seconds (jaxaot.report()).
_stats.watch_compiles()

_HEARTBEAT = _Heartbeat()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HEARTBEAT.forget)
