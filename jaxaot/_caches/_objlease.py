"""Leases in an object store (or any fsspec filesystem without local locks), for
:class:`~._fsspec.FsspecCache`.

A lease is a small object, ``<root>/.leases/<key>.lease``, holding its record
(``_lease``) with an expiry: a holder renews it from a heartbeat (rewrites it
with a later expiry), so a holder that dies loses it ``ttl`` after its last
renewal. It is created with a conditional write where the store has one
(fsspec's ``pipe_file(..., mode="create")``: ``If-None-Match`` on S3, a
generation precondition on GCS), then read back: the process whose token is
there holds it. On a store whose "create" is only a check then a write, two
processes racing in the same instant may both believe they hold it; the cost
is one entry made twice, never a wrong one. Expiry compares the holder's clock
with the reader's: hosts sharing a store should agree within a few seconds.
Released, the lease says ``done`` for :data:`~._lease.DONE_SECONDS`.
"""

from __future__ import annotations

import functools
import logging
import posixpath
from collections.abc import Callable
from typing import Any

from . import _lease
from ._lease import LEASE_SUFFIX, Record
from ._protocol import Held

__all__ = ["LEASES_DIR", "ObjectLease", "Run", "lease_path", "take"]

logger = logging.getLogger("jaxaot")

#: Below the store's root; not a shard, so listings of entries never see it.
LEASES_DIR = ".leases"

#: ``run(what, fn)``: ``(True, fn())`` within the store's deadline, or
#: ``(False, None)`` after a fault (counted and warned by the cache).
Run = Callable[[str, Callable[[], Any]], tuple[bool, Any]]


def lease_path(root: str, key: str) -> str:
    return f"{root}/{LEASES_DIR}/{key}{LEASE_SUFFIX}"


def _read(fs: Any, path: str) -> bytes | None:
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        return None


def _create(fs: Any, path: str, data: bytes) -> bool:
    """Writes ``data`` at ``path`` unless something is there; whether it did."""
    try:
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
    except Exception:  # stores without directories
        pass
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    except TypeError:  # an fsspec without conditional writes
        if fs.exists(path):
            return False
        fs.pipe_file(path, data)
    return True


def _remove_if(fs: Any, path: str, seen: bytes) -> None:
    """Removes the lease at ``path`` if it still holds ``seen`` (an expired lease)."""
    if _read(fs, path) == seen:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass


class ObjectLease:
    """A lease this process holds in an object store."""

    def __init__(self, run: Run, fs: Any, path: str, key: str, record: Record, ttl: float) -> None:
        self.key = key
        self.holder = record.holder
        self._run = run
        self._fs = fs
        self._path = path
        self._record = record
        self._ttl = ttl
        self._released = False

    def __repr__(self) -> str:
        return f"ObjectLease({self._path!r}, {self.holder!r})"

    def _ours(self) -> bool:
        ok, data = self._run(
            f"reading the lease on {self.key[:16]}", lambda: _read(self._fs, self._path)
        )
        current = _lease.parse(data) if ok else None
        return current is not None and current.token == self._record.token

    def renew(self) -> bool:
        """Rewrites the lease with a later expiry if it is still ours; whether it is."""
        if self._released or not self._ours():
            return False
        renewed = self._record.renewed(self._ttl)
        ok, _ = self._run(
            f"renewing the lease on {self.key[:16]}",
            lambda: self._fs.pipe_file(self._path, renewed.text().encode()),
        )
        if ok:
            self._record = renewed
        return bool(ok)

    def release(self) -> None:
        """Rewrites the lease as done (if it is still ours)."""
        if self._released:
            return
        self._released = True
        if not self._ours():
            logger.debug("jaxaot: lease %s had expired before it was released", self._path)
            return
        done = self._record.done().text().encode()
        self._run(
            f"releasing the lease on {self.key[:16]}",
            lambda: self._fs.pipe_file(self._path, done),
        )


def take(run: Run, fs: Any, path: str, key: str, ttl: float) -> ObjectLease | Held | None:
    """The lease at ``path`` (on cache key ``key``): ours, another's, or ``None``
    when the store cannot be asked."""
    for _ in range(3):
        ok, data = run(f"reading the lease on {key[:16]}", lambda: _read(fs, path))
        if not ok:
            return None
        current = _lease.parse(data)
        if current is not None and current.live():
            return Held(current.holder, done=current.state == _lease.DONE)
        if data is not None:  # expired (its holder died), or not a lease at all
            if current is not None and current.state == _lease.MAKING:
                logger.debug(
                    "jaxaot: lease %s: its holder %s stopped renewing", path, current.holder
                )
            ok, _ = run(
                f"removing an old lease on {key[:16]}",
                functools.partial(_remove_if, fs, path, data),
            )
            if not ok:
                return None
        mine = _lease.new_record(ttl)
        ok, created = run(
            f"taking the lease on {key[:16]}",
            functools.partial(_create, fs, path, mine.text().encode()),
        )
        if not ok:
            return None
        if not created:
            continue  # another process created it first: look at it again
        ok, back = run(f"reading the lease on {key[:16]}", lambda: _read(fs, path))
        if not ok:
            return None
        got = _lease.parse(back)
        if got is not None and got.token == mine.token:
            return ObjectLease(run, fs, path, key, mine, ttl)
        return Held(got.holder if got is not None else "?", done=False)
    return None
