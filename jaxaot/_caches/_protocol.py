"""The byte-level protocol shared by every jaxaot cache backend, the optional
maintenance features some backends add, and the entry check they are given.

A cache maps *keys* to *values*. Keys are lowercase hexadecimal strings (the
digest of a :class:`jaxaot.ComponentKey`, sometimes with a short hex suffix),
so they are safe to use as file names, object names or Redis keys. Values are
opaque ``bytes``: encoding, checksums and signatures live in the entry format
(``jaxaot._store``), never in a backend. A backend only stores and returns
bytes; extra behaviour (tiers, read-only wrappers, verification) is layered by
wrapping.

Shared backends may also lend *leases* (:class:`Leasing`): the first process
to miss an entry takes the lease on its key and makes the entry, the others
wait for it to land and load it, so that a fleet of cold processes makes each
entry once. What a lease guards is the store's business (``_store._once``);
a backend only grants, renews and releases them.

Where a backend must tell a sound entry from a damaged one (a tiered cache
copying a hit into a faster tier, a quarantine that must not destroy entries
signed with another key), it asks the :class:`EntryCheck` it was given (the
store gives its entry format's check to the caches it uses, and with each
quarantine): backends never read an entry's format themselves.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = [
    "BadEntry",
    "Cache",
    "EntryCheck",
    "Held",
    "HitCounting",
    "INDEX_ITEMS",
    "INDEX_ITEM_BYTES",
    "Indexing",
    "Lease",
    "Leasing",
    "LocalFiles",
    "Pingable",
    "Quarantining",
    "check_key",
    "is_removable",
]

_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")


def check_key(key: object) -> str:
    """Returns ``key`` if it is a valid cache key, else raises ``ValueError``."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"jaxaot cache keys are 16-128 lowercase hex characters, got {key!r:.80}")
    return key


@runtime_checkable
class Cache(Protocol):
    """What every cache backend implements.

    ``get`` returns the stored bytes or ``None``; ``put`` stores bytes (a
    backend may keep an existing value under the same key instead);
    ``delete`` returns whether something was removed; ``keys`` lists the stored
    keys; ``clear`` removes everything; ``stats`` returns a JSON-able dict with
    at least ``entries`` and ``bytes``.
    """

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def clear(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


# -- optional maintenance features (the command line uses these) ---------------------


@runtime_checkable
class Quarantining(Protocol):
    """Moves a bad entry aside (or deletes it); unless ``force``, leaves alone a
    sound entry that this process cannot check (signed with another key...), as
    ``check`` (an :class:`EntryCheck`) tells; without one, nothing is removed
    unless ``force``."""

    def quarantine(
        self, key: str, *, force: bool = False, check: EntryCheck | None = None
    ) -> None: ...


@runtime_checkable
class LocalFiles(Protocol):
    """Entries are local files: their path, a read that counts as no use, and when
    each was last used."""

    def path_for(self, key: str) -> Path: ...

    def peek(self, key: str) -> bytes | None: ...

    def access_time(self, key: str) -> float | None: ...


@runtime_checkable
class HitCounting(Protocol):
    """How many times each entry was read."""

    def hit_count(self, key: str) -> int: ...


#: The most notes an index keeps under one tag (the most recent ones).
INDEX_ITEMS = 32
#: Notes larger than this are not kept.
INDEX_ITEM_BYTES = 64 << 10


@runtime_checkable
class Indexing(Protocol):
    """Small notes about entries, kept under a *tag* beside the entries (never
    listed, counted, evicted or served as entries): the store keeps one tag per
    component and kind of entry, so that a miss can be explained from the entries
    of its own component without reading any other.

    ``note(tag, key, item)`` records ``item`` (at most :data:`INDEX_ITEM_BYTES`)
    about the entry ``key`` under ``tag`` (both valid cache keys), keeping the
    :data:`INDEX_ITEMS` most recent keys; a key already noted is left as it is.
    ``notes(tag)`` returns ``(key, item)`` pairs, most recent first, for the
    entries still stored. Neither is a use of any entry (no hit counted, no access
    time refreshed), and neither raises for faults (a skipped note, no notes)."""

    def note(self, tag: str, key: str, item: bytes) -> None: ...

    def notes(self, tag: str) -> list[tuple[str, bytes]]: ...


@runtime_checkable
class Pingable(Protocol):
    """A remote store that can be asked whether it answers (raises ``ConnectionError``)."""

    def ping(self) -> None: ...


# -- leases (one maker per entry across processes) ----------------------------------


class Lease(Protocol):
    """A lease this process holds on one key: while it holds it, other processes
    that miss the key wait for the entry instead of making it too.

    ``holder`` names this process (host and pid) for the others' DEBUG logs.
    ``renew`` extends a lease that expires (the store calls it from a heartbeat
    while the entry is being made) and returns whether the lease is still held;
    a lease whose ``expires`` is false (a lock the operating system holds for
    as long as its holder lives) is never renewed, so it costs no thread;
    ``release`` ends it (after the entry was written, or could not be), leaving a
    short-lived mark that says the holder is done, so that waiters stop waiting
    at once. Neither raises: a fault means the lease may be lost, never an error.
    """

    key: str
    holder: str

    # (``expires``: optional, true where absent.)

    def renew(self) -> bool: ...

    def release(self) -> None: ...


class Held(NamedTuple):
    """Another process's lease on a key: who holds it (``"host pid N"``, or ``"?"``
    when it cannot be told), and whether it is ``done`` (released: its entry is
    written, or could not be; a waiter then looks for the entry once and makes it
    itself if it is not there)."""

    holder: str
    done: bool = False


@runtime_checkable
class Leasing(Protocol):
    """A shared store that lends leases.

    ``lease(key, ttl)`` returns a :class:`Lease` if this process now holds the
    lease on ``key`` (it expires ``ttl`` seconds after it was taken or last
    renewed, or at once if the holder dies, where the store can tell); a
    :class:`Held` if another process holds it; ``None`` if no lease can be had
    (the store is down, refuses, or cannot lend one for this key): the caller
    then makes the entry itself, as without leases. Never raises for faults."""

    def lease(self, key: str, ttl: float) -> Lease | Held | None: ...


# -- the entry check -----------------------------------------------------------------


class BadEntry(ValueError):
    """Stored bytes that are not a sound entry for their key. ``cause`` names the
    kind of problem (for one warning per cause); ``removable`` says whether the
    entry is bad for every process (damage: it may be quarantined), or only
    unusable by this one (signed with another key, another format version)."""

    cause = "damaged"
    removable = True


class EntryCheck(Protocol):
    """Raises :class:`BadEntry` unless ``blob`` is a sound entry stored under ``key``."""

    def __call__(self, key: str, blob: bytes) -> Any: ...


def is_removable(key: str, blob: bytes, check: EntryCheck | None) -> bool:
    """Whether ``blob`` (stored under ``key``) may be quarantined or deleted as bad:
    anything but a sound entry this process cannot check. A sound entry is
    removable too (the caller found it unusable for another reason). Without any
    check, nothing is decided to be removable. Never raises."""
    if check is None:
        return False
    try:
        check(key, blob)
    except BadEntry as e:
        return e.removable
    except Exception:  # e.g. an empty $JAXAOT_CACHE_HMAC_KEY: decide nothing
        return False
    return True
