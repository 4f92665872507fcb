"""The lookup chain of one component's entries and top-level executables.

Data flows one way: the component asks its :class:`Store` for an entry or an
executable under a key; the store looks in its in-process tables, then in the
active byte cache (``jaxaot.set_cache``/``using_cache``), then, in a
multi-process job, waits for the process that makes it (``_job``); if another
process sharing the cache is making it, waits for it to land (``_once``); and
only then makes it with the function it was given, holding the cache's lease
on it. What it made it writes to the cache, big executables in the background
(the lease is released once they are written). The store knows nothing of tracing
or of transformations, and the cache backends know nothing of entries.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from .. import _stats
from .._caches import Cache
from .._keys._key import ComponentKey
from . import _entry, _explain, _job
from ._active import get_cache
from ._entry import Entry
from ._executables import (
    BACKGROUND_AFTER_SECONDS,
    cost_dict,
    load_executable_entry,
    store_executable,
    store_in_background,
)
from ._once import Outcome, make_once
from ._readwrite import decoder, read, write

__all__ = ["Store"]

logger = logging.getLogger("jaxaot")


class Store:
    """One component's entries and executables.

    ``entry`` and ``executable`` serve from this process's tables, else from
    the active cache, else make (and write) what they are asked for; each key is
    made once, also when threads ask at once. ``check`` is called with every
    entry read from a cache (before it is used).
    """

    def __init__(
        self,
        name: str,
        counters: _stats.Counters,
        check: Callable[[Entry], None] | None = None,
    ) -> None:
        self.name = name
        self.counters = counters
        self.check = check
        self.lock = threading.RLock()
        self.entries: dict[ComponentKey, Entry] = {}
        self.executables: dict[Hashable, Any] = {}
        self.costs: dict[Hashable, dict[str, float] | None] = {}
        # Executables callers compile for one entry (``jaxaot.jit``'s regions), by
        # whatever they key them on, with one lock per such key.
        self.region_executables: dict[Any, Any] = {}
        self.region_locks = _stats.KeyedLocks()

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.executables.clear()
            self.costs.clear()
            self.region_executables.clear()

    # -- entries ----------------------------------------------------------------

    def entry(self, key: ComponentKey, build: Callable[[], Entry]) -> Entry:
        """The entry for ``key``: from this process, the cache, another process of
        the job, or ``build()`` (then written to the cache)."""
        entry = self.entries.get(key)
        if entry is not None:
            self.counters.add("hits")
            return entry
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.counters.add("hits")
                return entry
            cache = get_cache()
            entry = read(cache, key) if cache is not None else None
            if entry is not None:
                self.counters.add("hits")
                logger.debug("jaxaot: %s hit %s", self.name, key.digest[:16])
                if self.check is not None:
                    self.check(entry)
                hit = entry
                _job.publish_hit(key.digest, lambda: _entry.encode(hit))
            else:
                entry = self._make_entry(key, cache, build)
            self.entries[key] = entry
            return entry

    def _make_entry(
        self, key: ComponentKey, cache: Cache | None, build: Callable[[], Entry]
    ) -> Entry:
        """A missed entry: made here, by another process of the fleet (``_once``), or
        by process 0 of the job (``_job``)."""
        self.explain_miss(key, cache)
        made: list[Outcome[Entry]] = []

        def load() -> Entry | None:
            assert cache is not None
            entry = read(cache, key)
            if entry is not None and self.check is not None:
                self.check(entry)
            return entry

        def make() -> Entry:
            store = None if cache is None else functools.partial(_written, cache)
            outcome = make_once(cache, key.digest, f"{self.name} entry", load, build, store)
            made.append(outcome)
            return outcome.value

        entry = _job.share(key.digest, make, _entry.encode, decoder(key))
        if made and not made[0].made:  # made by another process: a hit, after all
            self.counters.add("hits")
        else:
            self.counters.add("misses")
            if not made and cache is not None:  # received from process 0 of the job
                write(cache, entry)
        return entry

    def explain_miss(self, key: ComponentKey, cache: Cache | None) -> None:
        """Notes a miss of ``key``; with ``JAXAOT_EXPLAIN_MISSES=1`` logs (WARNING, once
        per miss) what changed against the closest key of this component of the same
        kind, held here or noted in the cache, without reading any entry (``_explain``)."""
        _explain.miss(self.name, key, cache, list(self.entries))

    # -- executables -------------------------------------------------------------

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
        exe = self.executables.get(sig)
        if exe is not None:
            return exe
        with self.lock:
            exe = self.executables.get(sig)
            if exe is not None:
                return exe
            exe_key = key()
            cache = get_cache()
            loaded = load_executable_entry(cache, exe_key, in_tree) if cache is not None else None
            if loaded is not None:
                exe, record = loaded
                costs = record.extra.get("cost_analysis")
                costs = dict(costs) if isinstance(costs, dict) else None
                self.counters.add("hits")
                if self.check is not None:
                    self.check(record)
            else:
                exe, costs = self._make_executable(exe_key, cache, compile, extra, in_tree)
            self.costs[sig] = costs
            self.executables[sig] = exe
            return exe

    def _make_executable(
        self,
        exe_key: ComponentKey,
        cache: Cache | None,
        compile: Callable[[], tuple[Any, Entry | None]],
        extra: Callable[[], dict[str, Any]] | None,
        in_tree: Any,
    ) -> tuple[Any, dict[str, float] | None]:
        """A missed top-level executable and its costs: compiled here (and stored,
        big ones in the background), or loaded once another process made it."""
        self.explain_miss(exe_key, cache)

        def load() -> tuple[Any, Entry | None] | None:
            assert cache is not None
            return load_executable_entry(cache, exe_key, in_tree)

        made: dict[str, Any] = {}

        def make() -> tuple[Any, Entry | None]:
            start = time.perf_counter()
            exe, root = compile()
            made["seconds"] = time.perf_counter() - start
            made["costs"] = cost_dict(exe)
            self.counters.add("compiles")
            return exe, root

        def store(value: tuple[Any, Entry | None]) -> concurrent.futures.Future[None] | None:
            exe, root = value
            # Executables are compiled by each process of a multi-process job
            # (they are bound to that process's devices); lowered entries are shared.
            if cache is None or root is None:
                return None
            more = extra() if extra is not None else {}
            if root.host_callbacks:
                # Kept in this process; its executable is cached where another
                # process can bind its own callbacks to it (a default key traces them).
                from ._readwrite import callbacks_executable

                payload = callbacks_executable(root, exe, self.name)
                if payload is not None:
                    store_executable(cache, exe_key, root, exe, made["costs"], more, payload)
                return None
            if made["seconds"] >= BACKGROUND_AFTER_SECONDS:
                # A big executable: serialize and write it while the first step
                # runs, off the path to the first result.
                return store_in_background(cache, exe_key, root, exe, made["costs"], more)
            store_executable(cache, exe_key, root, exe, made["costs"], more)
            return None

        outcome = make_once(cache, exe_key.digest, f"{self.name} executable", load, make, store)
        exe, record = outcome.value
        if outcome.made:
            self.counters.add("misses")
            return exe, made["costs"]
        self.counters.add("hits")
        assert record is not None
        if self.check is not None:
            self.check(record)
        costs = record.extra.get("cost_analysis")
        return exe, dict(costs) if isinstance(costs, dict) else None


def _written(cache: Cache, entry: Entry) -> None:
    write(cache, entry)
