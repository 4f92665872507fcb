"""What every backend's lease records: who holds it, a token only the holder
knows, whether the holder is still making the entry or done, and (where the
store cannot tell a dead holder by itself) when the lease expires.

A record is one line of JSON, small enough for a Redis value, a lock file's
contents or a tiny object. Backends write it when they grant a lease, and
rewrite it as ``done`` when it is released. Nothing here imports JAX.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from typing import NamedTuple

__all__ = [
    "DONE",
    "DONE_SECONDS",
    "LEASE_SUFFIX",
    "MAKING",
    "Record",
    "holder_name",
    "new_record",
    "parse",
]

MAKING = "making"
DONE = "done"
#: How long a released lease keeps saying "done" (seconds): long enough for every
#: waiter's next poll to see it, short enough that a later fleet leases afresh.
DONE_SECONDS = 60.0
#: The name of a key's lease beside its entry (local stores), or of its lease object.
LEASE_SUFFIX = ".lease"

_HOST: str | None = None


def holder_name() -> str:
    """This process as the others' logs name it: ``"host pid N"``."""
    global _HOST
    if _HOST is None:
        try:
            _HOST = socket.gethostname() or "?"
        except OSError:
            _HOST = "?"
    return f"{_HOST} pid {os.getpid()}"


class Record(NamedTuple):
    """One lease's state: ``state`` is :data:`MAKING` or :data:`DONE`; ``expires``
    is a ``time.time()`` reading (0: the store tells a dead holder itself)."""

    state: str
    holder: str
    token: str
    expires: float = 0.0

    def text(self) -> str:
        return json.dumps(
            {
                "state": self.state,
                "holder": self.holder,
                "token": self.token,
                "expires": self.expires,
            }
        )

    def done(self, seconds: float = DONE_SECONDS, *, expiring: bool = True) -> Record:
        """This lease released: done, expiring ``seconds`` from now (if ``expiring``)."""
        return self._replace(state=DONE, expires=time.time() + seconds if expiring else 0.0)

    def renewed(self, ttl: float) -> Record:
        return self._replace(expires=time.time() + ttl)

    def live(self) -> bool:
        """Whether an expiring record has not expired yet (clocks of the hosts that
        share a store are assumed to agree within a few seconds)."""
        return self.expires <= 0 or time.time() < self.expires


def new_record(ttl: float | None = None) -> Record:
    """A fresh lease for this process (expiring ``ttl`` seconds from now, if given)."""
    expires = 0.0 if ttl is None else time.time() + ttl
    return Record(MAKING, holder_name(), secrets.token_hex(16), expires)


def parse(data: bytes | str | None) -> Record | None:
    """The record in ``data``, or ``None`` if there is none or it is not one."""
    if not data:
        return None
    try:
        raw = json.loads(data)
        record = Record(
            str(raw["state"]), str(raw["holder"]), str(raw["token"]), float(raw["expires"])
        )
    except (ValueError, TypeError, KeyError):
        return None
    return record if record.state in (MAKING, DONE) else None
