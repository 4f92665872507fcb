"""One compile per job: in a multi-process JAX job (``jax.distributed``), each
entry is made by one process and handed to the others through the
distributed runtime's key-value store.

Process 0 makes every lowered entry (a component's output types and
StableHLO, for each signature and derived transformation) that its caches do
not hold, and publishes the entry's bytes under the
entry's digest; an entry it finds in its own cache it publishes too. The
other processes, on a miss in their caches, wait for those bytes
(``blocking_key_value_get_bytes``), verify and decode them instead of
tracing or compiling. In an SPMD job every process asks for the same entries,
so each signature is traced and lowered once per job. Top-level executables
are compiled by each process for its own devices (an XLA executable is bound
to the devices it was compiled for) and kept in each process's cache. If process 0
fails to make an entry, publishes nothing usable, or takes longer than
``JAXAOT_DISTRIBUTED_TIMEOUT`` seconds (default 600), the waiting process
makes the entry itself: a job never hangs on a dead process and never uses
unverified bytes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from .._env import number
from .._jax import distributed_client

__all__ = ["agree", "next_decision", "publish_hit", "share", "timeout_seconds"]

logger = logging.getLogger("jaxaot")

T = TypeVar("T")
_PREFIX = "jaxaot"


def timeout_seconds() -> float:
    return number("JAXAOT_DISTRIBUTED_TIMEOUT", 600.0, "a number of seconds")


def share(
    digest: str,
    make: Callable[[], T],
    to_bytes: Callable[[T], bytes | None],
    from_bytes: Callable[[bytes], T | None],
) -> T:
    """``make()`` in one process of the job; the others get ``from_bytes`` of its bytes.

    Outside a multi-process job this is just ``make()``."""
    client = distributed_client()
    if client is None:
        return make()
    blob_key = f"{_PREFIX}/entry/{digest}"
    if _is_leader():
        try:
            value = make()
        except BaseException:
            _publish(client, blob_key, b"")
            raise
        try:
            blob = to_bytes(value)
        except Exception as e:
            logger.debug("jaxaot: entry %s not shared: %s", digest[:16], e)
            blob = None
        _publish(client, blob_key, blob or b"")
        return value
    try:
        blob = client.blocking_key_value_get_bytes(blob_key, int(timeout_seconds() * 1000))
    except Exception as e:
        logger.warning(
            "jaxaot: waited too long for process 0 to make entry %s (%s); making it here",
            digest[:16],
            type(e).__name__,
        )
        return make()
    if blob:
        received = from_bytes(bytes(blob))
        if received is not None:
            logger.debug("jaxaot: entry %s received from process 0", digest[:16])
            return received
    return make()


def _is_leader() -> bool:
    import jax

    return jax.process_index() == 0


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
    _publish(client, f"{_PREFIX}/entry/{digest}", blob or b"")


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
    """Whether every process of the job says ``ok`` to decision ``name``: each
    publishes its own answer and reads the others'. A process that does not
    answer within ``JAXAOT_DISTRIBUTED_TIMEOUT`` counts as a no. Outside a
    multi-process job this is ``ok``."""
    client = distributed_client()
    if client is None:
        return ok
    import jax

    base = f"{_PREFIX}/agree/{name}"
    _publish(client, f"{base}/{jax.process_index()}", b"1" if ok else b"0")
    timeout_ms = int(timeout_seconds() * 1000)
    answers = []
    for pid in range(jax.process_count()):
        try:
            answers.append(bytes(client.blocking_key_value_get_bytes(f"{base}/{pid}", timeout_ms)))
        except Exception as e:
            logger.warning(
                "jaxaot: process %d did not answer decision %s (%s); deciding no",
                pid,
                name,
                type(e).__name__,
            )
            return False
    return all(a == b"1" for a in answers)
