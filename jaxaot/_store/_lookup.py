"""The one lookup chain of everything jaxaot caches: :func:`get_or_make`.

Data flows one way: a caller asks for a value (a lowered or derived entry, a
top-level executable, a glue or whole-program executable, a region
executable) under a key. The chain looks in the caller's in-process table,
then in the active byte cache (``jaxaot.set_cache``/``using_cache``); on a miss,
in a multi-process job, it waits for the process that makes it (``_job``); if
another process sharing the cache is making it, it waits for it to land
(``_once``); and only then makes it with the function it was given, holding
the cache's lease on it, and writes it. What differs between kinds of values
is only how one is read, written and shared: its :class:`Codec`.
:class:`Store` holds one component's tables and chains. The chain knows nothing
of tracing or of transformations, and the cache backends know nothing of
entries.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Hashable, MutableMapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .. import _stats
from .._caches import Cache
from .._keys._key import ComponentKey
from . import _entry, _explain, _job, _prefetch
from ._active import get_cache
from ._entry import Entry
from ._executables import (
    BACKGROUND_AFTER_SECONDS,
    cost_dict,
    load_executable,
    platform_text,
    store_executable,
)
from ._once import make_once
from ._readwrite import callbacks_executable, decoder, read_blob, write
from ._writer import in_background

__all__ = ["Codec", "Store", "get_or_make"]

logger = logging.getLogger("jaxaot")

T = TypeVar("T")

#: Writes a made value to the cache: ``None`` when written (or not writable), or a
#: future that completes when a background write is done (its lease is held until then).
Save = Callable[[Cache, ComponentKey, T], "concurrent.futures.Future[Any] | None"]


@dataclass(frozen=True)
class Codec(Generic[T]):
    """How one kind of cached value is read from and written to a byte cache.

    ``what`` names the kind in logs; ``load`` reads a value (``None``: not there,
    or unusable); ``save`` writes a made one; ``to_bytes``/``from_bytes``, where
    given, hand a made value to the other processes of a multi-process job
    (lowered entries: executables are bound to their process's devices).
    ``memo_hits``: whether a value found in the in-process table counts as a hit
    (entries and programs, looked up once per trace; not the executables that
    calls run, looked up once per call). ``kept_here``: whether a made value
    stays in this process (never written: every process makes it), which is no
    miss a cache could fix: neither counted nor explained. ``executable``: values
    are executables, noted under the signature being looked up for the next
    process to load ahead (``_prefetch``)."""

    what: str
    load: Callable[[Cache, ComponentKey], T | None]
    save: Save[T] | None = None
    to_bytes: Callable[[T], bytes | None] | None = None
    from_bytes: Callable[[ComponentKey], Callable[[bytes], T | None]] | None = None
    memo_hits: bool = True
    kept_here: Callable[[T], bool] | None = None
    executable: bool = False


def get_or_make(
    memo: MutableMapping[Any, T],
    memo_key: Hashable,
    lock: AbstractContextManager[Any],
    key: Callable[[], ComponentKey],
    codec: Codec[T],
    make: Callable[[], T],
    counters: _stats.Counters,
    explain: Callable[[ComponentKey, Cache | None], None] | None = None,
) -> T:
    """The value for ``memo_key``: from ``memo`` (this process), else read from the
    active cache under ``key()`` with ``codec``, else made by ``make()`` (here,
    once per fleet through the cache's leases, or by process 0 of a job) and
    written; remembered in ``memo`` either way. ``lock`` serializes the lookups
    of one key in this process. ``counters`` get a hit for a value found (here
    too when ``codec.memo_hits``, or made by another process) and a miss for one
    made here; ``explain`` is told of each miss."""
    value = memo.get(memo_key)
    if value is None:
        with lock:  # (looked at again: another thread may have made it meanwhile)
            value = memo.get(memo_key)
            if value is None:
                k = key()
                cache = get_cache()
                found = codec.load(cache, k) if cache is not None else None
                if found is None:
                    value = _miss(k, cache, codec, make, counters, explain)
                else:
                    value = found
                    counters.add("hits")
                    logger.debug("jaxaot: %s hit %s", codec.what, k.digest[:16])
                    if codec.to_bytes is not None:
                        to_bytes = codec.to_bytes
                        _job.publish_hit(k.digest, lambda: to_bytes(found))
                memo[memo_key] = value
                if codec.executable:
                    _prefetch.noted(k)
                return value
    if codec.executable:
        _prefetch.noted(key)
    if codec.memo_hits:
        counters.add("hits")
    return value


def _miss(
    key: ComponentKey,
    cache: Cache | None,
    codec: Codec[T],
    make: Callable[[], T],
    counters: _stats.Counters,
    explain: Callable[[ComponentKey, Cache | None], None] | None,
) -> T:
    """A missed value: made here, by another process of the fleet (``_once``), or
    by process 0 of the job (``_job``). Explained at once, or, for a kind of
    value that may stay in this process, once made, unless it does."""
    kept_here = codec.kept_here
    if explain is not None and kept_here is None:
        explain(key, cache)
    save = codec.save

    def load() -> T | None:
        assert cache is not None
        return codec.load(cache, key)

    def store(value: T) -> concurrent.futures.Future[Any] | None:
        return None if cache is None or save is None else save(cache, key, value)

    job = _job.leases(cache) if codec.to_bytes and codec.from_bytes else None
    if job is None:
        outcome = make_once(cache, key.digest, codec.what, load, make, store)
    else:
        # A multi-process job: process 0 makes it and hands its bytes to the others.
        assert codec.to_bytes is not None and codec.from_bytes is not None
        to_bytes, decode = codec.to_bytes, codec.from_bytes(key)

        def received() -> T | None:
            if job.leader:
                return None if cache is None else codec.load(cache, key)
            blob = job.published(key.digest)
            return decode(blob) if blob else None

        def publish(value: T) -> None:
            try:
                blob = to_bytes(value)
            except Exception as e:
                logger.debug("jaxaot: entry %s not shared: %s", key.digest[:16], e)
                blob = None
            job.publish(key.digest, blob)

        def stored(value: T) -> concurrent.futures.Future[Any] | None:
            pending = store(value)
            if job.leader:
                publish(value)
            return pending

        limit = (_job.timeout_seconds(), _job.TIMEOUT_ENV)
        outcome = make_once(job, key.digest, codec.what, received, make, stored, limit)
        if not outcome.made:
            if job.leader:
                publish(outcome.value)  # another job's process made it
            else:
                store(outcome.value)  # received from process 0: kept in this process's cache
    if outcome.made and kept_here is not None:
        if kept_here(outcome.value):
            _stats.bump("made_in_process")  # as every process does
            return outcome.value
        if explain is not None:
            explain(key, cache)
    # Made by another process: a hit, after all.
    counters.add("misses" if outcome.made else "hits")
    return outcome.value


class Store:
    """One component's entries and executables, each looked up by :func:`get_or_make`.

    ``check`` is called with every entry read from a cache (before it is used).
    ``kind``: what its messages call it (``component``, or ``block`` for a block
    ``jaxaot.jit`` found).
    """

    def __init__(
        self,
        name: str,
        counters: _stats.Counters,
        check: Callable[[Entry], None] | None = None,
        kind: str = "component",
    ) -> None:
        self.name = name
        self.counters = counters
        self.check = check
        self.lock = threading.RLock()
        self.entries: dict[ComponentKey, Entry] = {}
        # Top-level executables (and their cost analyses) by call signature.
        self.executables: dict[Hashable, tuple[Any, dict[str, float] | None]] = {}
        # Executables callers compile for one entry (``jaxaot.jit``'s regions), by
        # whatever they key them on, with one lock per such key.
        self.region_executables: dict[Any, Any] = {}
        self.region_locks = _stats.KeyedLocks()
        self._entry_codec: Codec[Entry] = Codec(
            f"{name} entry",
            self._read_entry,
            lambda cache, _, entry: write(cache, entry, kind),
            _entry.encode,
            decoder,
            kept_here=lambda entry: entry.host_callbacks,
        )

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.executables.clear()
            self.region_executables.clear()

    def _checked(self, entry: Entry | None) -> Entry | None:
        if entry is not None and self.check is not None:
            self.check(entry)
        return entry

    def _read_entry(self, cache: Cache, key: ComponentKey) -> Entry | None:
        return self._checked(read_blob(cache, key)[0])

    def explain_miss(self, key: ComponentKey, cache: Cache | None) -> None:
        """Notes a miss of ``key``; with ``JAXAOT_EXPLAIN_MISSES=1`` logs (WARNING, once
        per miss) what changed against the closest key of this component of the same
        kind, held here or noted in the cache, without reading any entry (``_explain``)."""
        _explain.miss(self.name, key, cache, list(self.entries))

    # -- entries ----------------------------------------------------------------

    def entry(self, key: ComponentKey, build: Callable[[], Entry]) -> Entry:
        """The entry for ``key``: from this process, the cache, another process of
        the job, or ``build()`` (then written to the cache)."""
        return get_or_make(
            self.entries,
            key,
            self.lock,
            lambda: key,
            self._entry_codec,
            build,
            self.counters,
            self.explain_miss,
        )

    # -- executables -------------------------------------------------------------

    def known_executable(self, sig: Hashable) -> Any:
        """The top-level executable this process holds for ``sig``, or ``None``."""
        held = self.executables.get(sig)
        return None if held is None else held[0]

    def costs(self, sig: Hashable) -> dict[str, float] | None:
        """The cost analysis of the top-level executable for ``sig`` (held here)."""
        held = self.executables.get(sig)
        return None if held is None else held[1]

    def executable(
        self,
        sig: Hashable,
        key: Callable[[], ComponentKey],
        compile: Callable[[], tuple[Any, Entry | None]],
        extra: Callable[[], dict[str, Any]] | None = None,
        in_tree: Any = None,
    ) -> Any:
        """The top-level executable for ``sig``: from this process, else loaded from
        the cache under ``key()`` (no trace, lowering or compile), else
        ``compile()`` (which returns it and the root entry it runs) and stored,
        in the background where compiling took a while."""
        held = self.executables.get(sig)
        if held is not None:
            return held[0]
        made: dict[str, Any] = {}

        def load(cache: Cache, exe_key: ComponentKey) -> tuple[Any, dict[str, float] | None] | None:
            loaded = load_executable(cache, exe_key, in_tree)
            if loaded is None:
                return None
            exe, entry = loaded
            self._checked(entry)
            costs = entry.extra.get("cost_analysis")
            return exe, dict(costs) if isinstance(costs, dict) else None

        def make() -> tuple[Any, dict[str, float] | None]:
            start = time.perf_counter()
            exe, root = compile()
            made["seconds"] = time.perf_counter() - start
            made["root"] = root
            self.counters.add("compiles")
            return exe, cost_dict(exe)

        def save(
            cache: Cache, exe_key: ComponentKey, value: tuple[Any, dict[str, float] | None]
        ) -> concurrent.futures.Future[None] | None:
            # Executables are compiled by each process of a multi-process job
            # (they are bound to that process's devices); lowered entries are shared.
            exe, costs = value
            root: Entry | None = made.get("root")
            if root is None:
                return None
            more = extra() if extra is not None else {}
            if root.host_callbacks:
                # Kept in this process; its executable is cached where another
                # process can bind its own callbacks to it (a default key traces them).
                payload = callbacks_executable(root, exe, self.name)
                if payload is not None:
                    store_executable(cache, exe_key, root, exe, costs, more, payload)
                return None
            if made["seconds"] >= BACKGROUND_AFTER_SECONDS:
                # A big executable: serialize and write it while the first step
                # runs, off the path to the first result.
                return in_background(
                    exe_key.digest,
                    lambda: store_executable(cache, exe_key, root, exe, costs, more),
                )
            store_executable(cache, exe_key, root, exe, costs, more)
            return None

        codec: Codec[tuple[Any, dict[str, float] | None]] = Codec(
            f"{self.name} executable", load, save, memo_hits=False, executable=True
        )
        # A new signature here: its executable loads while its key is traced.
        name = f"component {self.name}"
        with _prefetch.ahead(get_cache(), name, lambda: repr(sig), platform_text):
            return get_or_make(
                self.executables, sig, self.lock, key, codec, make, self.counters, self.explain_miss
            )[0]
