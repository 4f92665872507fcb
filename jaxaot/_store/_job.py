"""One compile per job: in a multi-process JAX job (``jax.distributed``), each
entry is made by one process and handed to the others through the
distributed runtime's key-value store.

The job is one more lease backend (:class:`JobLeases`) for the one mechanism
that makes each entry once (``_once.make_once``): process 0 takes every lease
(holding its cache's own lease as well, where the cache is shared with other
jobs), makes the lowered entries (a component's output types and StableHLO,
for each signature and derived transformation) that its caches do not hold,
and publishes each entry's bytes under its digest; an entry it finds in its
own cache it publishes too (:func:`publish_hit`). To the other processes each
of those leases is held by process 0: on a miss in their own caches they wait
for its bytes, verify and decode them instead of tracing or compiling. In an
SPMD job every process asks for the same entries, so each signature is traced
and lowered once per job. Top-level executables are compiled by each process
for its own devices (an XLA executable is bound to the devices it was compiled
for) and kept in each process's cache. If process 0 fails to make an entry
(its lease is then released with nothing published), or takes longer than
``JAXAOT_DISTRIBUTED_TIMEOUT`` seconds (default 600), the waiting process makes
the entry itself: a job never hangs on a dead process and never uses
unverified bytes.

Process 0 says when it starts making an entry. An entry it has not started
within :data:`START_WAIT` seconds (or the timeout, if shorter) may be one it
never makes: a signature of another process only (process-local shapes, a
body that depends on ``jax.process_index()``, edited code), or one whose trace
failed in process 0. The waiting process then makes it itself, and, until
process 0 is seen making entries again, makes every entry process 0 has not
started without waiting: a job is never held up one full timeout per entry.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _stats
from .._caches import Cache, Held, Lease, Leasing
from .._env import number
from .._jax import distributed_client

__all__ = [
    "START_WAIT",
    "TIMEOUT_ENV",
    "JobLeases",
    "agree",
    "leases",
    "next_decision",
    "publish_hit",
]

logger = logging.getLogger("jaxaot")

_PREFIX = "jaxaot"
TIMEOUT_ENV = "JAXAOT_DISTRIBUTED_TIMEOUT"
_PROCESS_0 = "process 0 of the job"


def timeout_seconds() -> float:
    return number(TIMEOUT_ENV, 600.0, "a number of seconds")


#: Seconds a process waits for process 0 to start making an entry it has not
#: started (it may never make it); bounded by the timeout. Long enough for a
#: process 0 a little behind the others (in an SPMD job they reach each miss
#: at about the same time; what keeps them apart is work done by one process
#: alone); a wrong guess costs one entry made twice, a stall one wait per entry.
START_WAIT = 30.0


def _blob_key(digest: str) -> str:
    return f"{_PREFIX}/entry/{digest}"


def _started_key(digest: str) -> str:
    return f"{_PREFIX}/started/{digest}"


class _Unstarted:
    """When this process first waited for each entry process 0 had not started,
    and whether process 0 is behind: it let one such wait run out, and has not
    been seen starting or publishing an entry since."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}
        self.behind = False
        self.lock = threading.Lock()

    def seen(self, digest: str) -> None:
        with self.lock:
            self.since.pop(digest, None)
            self.behind = False

    def given_up(self, digest: str) -> bool:
        """Whether to stop waiting for process 0 to start ``digest``."""
        now = time.monotonic()
        with self.lock:
            if self.behind:
                return True
            first = self.since.setdefault(digest, now)
            if now - first < min(START_WAIT, timeout_seconds()):
                return False
            self.since.pop(digest, None)
            self.behind = True
        _stats.warn_once(
            "job-unstarted",
            f"jaxaot: process 0 of the job did not start making entry {digest[:16]} "
            f"within {min(START_WAIT, timeout_seconds()):g} s; this process makes it, and "
            "the entries process 0 has not started, itself until process 0 catches up "
            "(a signature only this process calls, a body that depends on the process, "
            "or a process 0 behind the others)",
        )
        return True


_UNSTARTED = _Unstarted()


class _LeaderLease:
    """Process 0's lease on an entry: its cache's own lease, if any, and the
    promise to publish the entry's bytes (nothing published by the time it is
    released tells the others to make the entry themselves)."""

    def __init__(self, leases: JobLeases, digest: str, inner: Lease | None) -> None:
        self.key = digest
        self.holder = _PROCESS_0 if inner is None else inner.holder
        self.expires = inner is not None and getattr(inner, "expires", True)
        self._leases = leases
        self._inner = inner

    def renew(self) -> bool:
        return True if self._inner is None else self._inner.renew()

    def release(self) -> None:
        self._leases.publish(self.key, None)  # (no-op if it was published)
        if self._inner is not None:
            self._inner.release()


class JobLeases:
    """The leases of a multi-process job, over its distributed client (see the
    module's docstring). ``cache``: this process's cache (process 0 also takes
    its lease); ``decode``: an entry from the bytes process 0 published."""

    def __init__(self, client: Any, leader: bool, cache: Cache | None) -> None:
        self.client = client
        self.leader = leader
        self.cache = cache
        self._published: set[str] = set()
        self._lock = threading.Lock()

    def lease(self, key: str, ttl: float) -> Lease | Held | None:
        if self.leader:
            inner: Lease | Held | None = None
            if isinstance(self.cache, Leasing):
                try:
                    inner = self.cache.lease(key, ttl)
                except Exception as e:  # made without the cache's lease, still published
                    logger.debug("jaxaot: lease on %s failed: %s", key[:16], e)
            # Started: the others wait for it (as long as the timeout allows).
            _publish(self.client, _started_key(key), b"1")
            if isinstance(inner, Held):
                return inner  # another job's process is making it: wait for the cache
            return _LeaderLease(self, key, inner)
        if self.published(key) is not None:
            _UNSTARTED.seen(key)
            return Held(_PROCESS_0, done=True)
        if self._started(key):
            _UNSTARTED.seen(key)
            return Held(_PROCESS_0, done=False)
        if _UNSTARTED.given_up(key):
            return None  # made here, as without a job
        return Held(_PROCESS_0, done=False)

    def _started(self, digest: str) -> bool:
        try:
            self.client.key_value_try_get_bytes(_started_key(digest))
        except Exception:  # not there (NOT_FOUND), or the service is gone
            return False
        return True

    def published(self, digest: str) -> bytes | None:
        """The bytes process 0 published for ``digest`` (empty: it made nothing), or
        ``None`` while it has published nothing."""
        try:
            return bytes(self.client.key_value_try_get_bytes(_blob_key(digest)))
        except Exception:  # not there yet (NOT_FOUND), or the service is gone
            return None

    def publish(self, digest: str, blob: bytes | None) -> None:
        """Hands ``blob`` (``None``: nothing usable) to the other processes, once."""
        with self._lock:
            if digest in self._published:
                return
            self._published.add(digest)
        _publish(self.client, _blob_key(digest), blob or b"")


def _is_leader() -> bool:
    import jax

    return jax.process_index() == 0


def leases(cache: Cache | None) -> JobLeases | None:
    """The job's leases over ``cache``, or ``None`` outside a multi-process job."""
    client = distributed_client()
    if client is None:
        return None
    return JobLeases(client, _is_leader(), cache)


_published: set[str] = set()


def publish_hit(digest: str, to_bytes: Callable[[], bytes | None]) -> None:
    """Process 0 found an entry in its own cache: hands it to the others too."""
    client = distributed_client()
    if client is None or not _is_leader() or digest in _published:
        return
    _published.add(digest)
    try:
        blob = to_bytes()
    except Exception as e:
        logger.debug("jaxaot: entry %s not shared: %s", digest[:16], e)
        blob = None
    _publish(client, _blob_key(digest), blob or b"")


def _publish(client: Any, key: str, blob: bytes) -> None:
    try:
        client.key_value_set_bytes(key, blob)
    except Exception as e:  # the others will time out and make it themselves
        logger.debug("jaxaot: could not publish %s: %s", key, e)


_decisions = itertools.count()


def next_decision() -> int:
    """A number for the next decision every process of an SPMD job takes in the
    same order (each process counts its own; they agree because they run the
    same program)."""
    return next(_decisions)


def agree(name: str, ok: bool) -> bool:
    """Whether every process of the job says ``ok`` to decision ``name``, the same
    answer in every process: each publishes its own; process 0 reads them (one
    that does not answer within ``JAXAOT_DISTRIBUTED_TIMEOUT`` counts as a no)
    and publishes the job's answer, which every other process takes, however late
    either arrives (a process that decided alone could run other collectives than
    the rest of the job). Outside a multi-process job this is ``ok``."""
    client = distributed_client()
    if client is None:
        return ok
    import jax

    base = f"{_PREFIX}/agree/{name}"
    me = jax.process_index()
    _publish(client, f"{base}/{me}", b"1" if ok else b"0")
    timeout_ms = int(timeout_seconds() * 1000)
    if me == 0:
        answer = ok
        for pid in range(1, jax.process_count()):
            try:
                said = bytes(client.blocking_key_value_get_bytes(f"{base}/{pid}", timeout_ms))
            except Exception as e:
                logger.warning(
                    "jaxaot: process %d did not answer decision %s (%s); deciding no for the job",
                    pid,
                    name,
                    type(e).__name__,
                )
                answer = False
                break
            answer = answer and said == b"1"
        _publish(client, f"{base}/job", b"1" if answer else b"0")
        return answer
    while True:
        try:
            return bytes(client.blocking_key_value_get_bytes(f"{base}/job", timeout_ms)) == b"1"
        except Exception as e:  # process 0 is late: its answer is the job's, whenever it comes
            _stats.warn_once(
                f"agree-waits:{name}",
                f"jaxaot: waiting for process 0 to decide {name} for the job "
                f"({type(e).__name__}); every process takes its answer",
            )
            time.sleep(1.0)
