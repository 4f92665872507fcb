"""Leases in a Redis database, for :class:`~._redis.RedisCache`.

A lease is the string ``<prefix>lease:<key>`` holding its record (``_lease``),
taken with ``SET ... NX PX <ttl>``: one process gets it, and it expires by
itself ``ttl`` after it was taken or last renewed, so a holder that dies loses
it within ``ttl``. The holder renews it from a heartbeat and releases it with
Lua scripts that act only if the value is still its own (its random token), so
a holder whose lease expired and was taken over never extends or ends the new
holder's lease. Released, the lease says ``done`` for
:data:`~._lease.DONE_SECONDS`. Lease names are not cache keys: ``keys``,
``clear`` and ``stats`` never see them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from . import _lease
from ._lease import Record
from ._protocol import Held

__all__ = ["LEASE_PREFIX", "RedisLease", "Run", "take"]

logger = logging.getLogger("jaxaot")

T = TypeVar("T")

#: After the cache's prefix: ``jaxaot:lease:<key>``.
LEASE_PREFIX = "lease:"

#: ``run(what, fn)``: ``(True, fn(client))`` within the call's deadline, or
#: ``(False, None)`` after a fault (counted and warned by the cache).
Run = Callable[[str, Callable[[Any], Any]], tuple[bool, Any]]

# KEYS[1] = the lease; ARGV[1] = the holder's value; ARGV[2] = milliseconds.
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
# KEYS[1] = the lease; ARGV[1] = the holder's value; ARGV[2] = its "done" value;
# ARGV[3] = how long "done" lasts (milliseconds).
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('set', KEYS[1], ARGV[2], 'px', ARGV[3])
  return 1
end
return 0
"""


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))


class RedisLease:
    """A lease this process holds in Redis."""

    def __init__(self, run: Run, name: str, key: str, record: Record, ttl: float) -> None:
        self.key = key
        self.holder = record.holder
        self._run = run
        self._name = name
        self._value = record.text()
        self._done = record.done(expiring=False).text()
        self._ttl = ttl
        self._released = False

    def __repr__(self) -> str:
        return f"RedisLease({self._name!r}, {self.holder!r})"

    def renew(self) -> bool:
        """Extends the lease by its ``ttl`` if it is still ours; whether it is."""
        if self._released:
            return False
        ok, answer = self._run(
            f"renewing the lease on {self.key[:16]}",
            lambda c: c.eval(_RENEW, 1, self._name, self._value, _ms(self._ttl)),
        )
        return bool(ok and answer == 1)

    def release(self) -> None:
        """Marks the lease done (if it is still ours); it expires by itself after that."""
        if self._released:
            return
        self._released = True
        ok, answer = self._run(
            f"releasing the lease on {self.key[:16]}",
            lambda c: c.eval(
                _RELEASE, 1, self._name, self._value, self._done, _ms(_lease.DONE_SECONDS)
            ),
        )
        if ok and answer != 1:
            logger.debug("jaxaot: lease %s had expired before it was released", self._name)


def take(run: Run, name: str, key: str, ttl: float) -> RedisLease | Held | None:
    """The lease ``name`` (on cache key ``key``): ours, another's, or ``None`` when
    the server cannot be asked."""
    record = _lease.new_record()  # no expiry in the record: Redis expires it (PX)
    value = record.text()
    for _ in range(3):
        ok, taken = run(
            f"taking the lease on {key[:16]}",
            lambda c: c.set(name, value, nx=True, px=_ms(ttl)),
        )
        if not ok:
            return None
        if taken:
            return RedisLease(run, name, key, record, ttl)
        ok, current = run(f"reading the lease on {key[:16]}", lambda c: c.get(name))
        if not ok:
            return None
        if current is None:
            continue  # it expired or was released meanwhile: try again
        held = _lease.parse(current if isinstance(current, bytes) else None)
        if held is None:
            return Held("?")
        return Held(held.holder, done=held.state == _lease.DONE)
    return None
