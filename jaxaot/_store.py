"""Lookup and storage: one component's entries and executables, and the byte cache.

Data flows one way: the component (``_component``) asks its :class:`Store`
for an entry or an executable under a key; the store looks in its in-process
tables, then in the active byte cache (``jaxaot.set_cache``/``using_cache``),
then, in a multi-process job, waits for the process that makes it
(``_distributed``), and only then makes it with the function it was given.
What it made it writes to the cache, big executables in the background. The
store knows nothing of tracing or of transformations, and the cache backends
know nothing of entries.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax

from . import _distributed, _entry, _stats
from ._caches import Cache
from ._config import explain_misses, get_cache
from ._entry import Entry, EntryError, NotPersistable
from ._jaxcompat import deserialize_executable, serialize_executable
from ._key import ComponentKey

logger = logging.getLogger("jaxaot")

# At most this many entries are read to explain one miss.
_EXPLAIN_SCAN = 256


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
                _distributed.publish_hit(key.digest, lambda: _entry.encode(hit))
            else:
                self.counters.add("misses")
                self.explain_miss(key, cache)
                entry = _distributed.share(key.digest, build, _entry.encode, decoder(key))
                if cache is not None:
                    write(cache, entry)
            self.entries[key] = entry
            return entry

    def explain_miss(self, key: ComponentKey, cache: Cache | None) -> None:
        """With ``JAXAOT_EXPLAIN_MISSES=1``, logs (WARNING) the parts in which ``key``
        differs from the closest key of this component held in this process or in
        the cache (written by any process); of the same kind only (root against
        root, executable against executable, one derived entry against another of
        the same transformation)."""
        if not explain_misses():
            logger.debug("jaxaot: %s miss %s", self.name, key.digest[:16])
            return
        known = [k for k in list(self.entries) if _same_kind(k, key)]
        if cache is not None:
            known += [k for k in _cached_keys(cache, self.name) if _same_kind(k, key)]
        known = [k for k in dict.fromkeys(known) if k != key]
        if not known:
            logger.warning(
                "jaxaot: component %r missed the cache (key %s); no other entry of this "
                "component of the same kind is held in this process or the cache",
                self.name,
                key.digest[:16],
            )
            return
        closest = min(known, key=lambda k: len(key.explain(k)))
        logger.warning(
            "jaxaot: component %r missed the cache (key %s); the closest entry held "
            "(%s) differs in: %s",
            self.name,
            key.digest[:16],
            closest.digest[:16],
            "; ".join(key.explain(closest)),
        )

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
                self.counters.add("misses")
                self.explain_miss(exe_key, cache)
                start = time.perf_counter()
                exe, root = compile()
                seconds = time.perf_counter() - start
                self.counters.add("compiles")
                costs = cost_dict(exe)
                # Executables are compiled by each process of a multi-process job
                # (they are bound to that process's devices); lowered entries are shared.
                if cache is not None and root is not None and not root.host_callbacks:
                    more = extra() if extra is not None else {}
                    if seconds >= _BACKGROUND_AFTER_SECONDS:
                        # A big executable: serialize and write it while the first
                        # step runs, off the path to the first result.
                        store_in_background(cache, exe_key, root, exe, costs, more)
                    else:
                        store_executable(cache, exe_key, root, exe, costs, more)
            self.costs[sig] = costs
            self.executables[sig] = exe
            return exe

    def region_executable(
        self,
        key: ComponentKey,
        entry: Entry,
        compile: Callable[[], Any],
        shardings: tuple[Any, ...] | None = None,
    ) -> Any:
        """An executable running one entry on flat arrays (for ``jaxaot.jit``),
        compiled for the input ``shardings`` (``None`` for each input that needs
        none; all ``None``, or no ``shardings``, outside a mesh: the unsharded
        executable). One per entry and shardings, in this process and in the cache:
        one compiled for some shardings is never loaded for others."""
        from ._sharding import MeshContext, region_sharding_parts

        memo: Any = key
        sharded = False
        if shardings is not None:
            context = MeshContext()
            if not context.empty or any(s is not None for s in shardings):
                memo, sharded = (key, shardings, context.key()), True
        exe = self.region_executables.get(memo)
        if exe is not None:
            return exe
        # One lock per entry, so that jaxaot.jit compiles different entries of one
        # component (its forward and its backward) at the same time.
        with self.region_locks(memo):
            exe = self.region_executables.get(memo)
            if exe is not None:
                return exe
            # Not the top-level executable of the same entry: that one takes the
            # call's pytrees, this one flat arrays.
            parts = (*executable_parts(()), ("calling_convention", "flat"))
            if sharded:
                assert shardings is not None
                texts, mesh = region_sharding_parts(
                    shardings, [len(a.shape) for a in entry.in_avals]
                )
                parts = (*parts, ("input_shardings", texts), ("context_mesh", mesh))
            exe_key = key.replace(executable=parts)
            cache = get_cache()
            loaded = load_executable(cache, exe_key) if cache is not None else None
            if loaded is not None:
                exe = loaded[0]
                self.counters.add("hits")
            else:
                self.counters.add("misses")
                exe = compile()
                self.counters.add("compiles")
                if cache is not None and not entry.host_callbacks:
                    store_executable(cache, exe_key, entry, exe, cost_dict(exe))
            self.region_executables[memo] = exe
            return exe


def _kind(key: ComponentKey) -> tuple[Any, ...]:
    transform = key.parts.get("transform") or ()
    kinds = tuple(t[0] if isinstance(t, tuple) and t else t for t in transform)
    return (kinds, "executable" in key.parts)


def _same_kind(a: ComponentKey, b: ComponentKey) -> bool:
    return _kind(a) == _kind(b)


def _cached_keys(cache: Cache, name: str) -> list[ComponentKey]:
    """Keys of this component's entries in ``cache``, from their verified headers."""
    try:
        digests = list(cache.keys())
    except Exception:  # a cache that cannot list its keys
        return []
    out = []
    for digest in digests[:_EXPLAIN_SCAN]:
        try:
            blob = cache.get(digest)
            if blob is None:
                continue
            header, _ = _entry.verify(blob)
            if header.get("name") == name:
                out.append(ComponentKey.from_json(header["key"]))
        except Exception:  # a bad entry explains nothing
            continue
    return out


def read(cache: Cache, key: ComponentKey) -> Entry | None:
    try:
        blob = cache.get(key.digest)
    except Exception as e:
        _stats.bump("cache_errors")
        _stats.warn_once(
            f"get:{type(cache).__name__}:{type(e).__name__}",
            f"jaxaot: reading from {cache!r} failed ({type(e).__name__}: {e}); computing locally",
        )
        return None
    if blob is None:
        return None
    try:
        return _entry.decode(blob, expected=key)
    except EntryError as e:
        if not e.removable:
            # Sound for the processes that wrote it (another HMAC key, another entry
            # format): a miss here, left alone, one warning per cause.
            _stats.bump("unusable_entries")
            _stats.warn_once(
                f"entry-unusable:{e.cause}",
                f"jaxaot: cache entries in {cache!r} cannot be used by this process ({e}); "
                "computing locally and leaving them in place",
            )
            return None
        _stats.bump("corrupt_entries")
        logger.warning(
            "jaxaot: dropped a bad cache entry %s from %r (%s); recomputing",
            key.digest[:16],
            cache,
            e,
        )
        discard(cache, key.digest)
        return None


def executable_parts(donate_argnums: tuple[int, ...]) -> tuple[tuple[str, Any], ...]:
    """Key parts that make a foreign or stale executable impossible to load."""
    device = jax.devices()[0]
    client = device.client
    return (
        ("backend", str(client.platform)),
        ("platform_version", str(client.platform_version)),
        ("device_kind", str(device.device_kind)),
        ("device_count", jax.device_count()),
        ("process_count", jax.process_count()),
        # An executable is bound to its process's devices: each process has its own.
        ("process_index", jax.process_index()),
        ("donate_argnums", tuple(donate_argnums)),
        ("xla_flags", os.environ.get("XLA_FLAGS", "")),
        ("libtpu_init_args", os.environ.get("LIBTPU_INIT_ARGS", "")),
    )


def cost_dict(compiled: Any) -> dict[str, float] | None:
    try:
        costs = compiled.cost_analysis()
    except Exception:  # a backend without cost analysis
        return None
    if isinstance(costs, list | tuple):
        costs = costs[0] if costs else None
    if not costs:
        return None
    out: dict[str, float] = {}
    for name, value in dict(costs).items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


_BACKGROUND_AFTER_SECONDS = 0.25
_writer: concurrent.futures.ThreadPoolExecutor | None = None
_pending: dict[str, concurrent.futures.Future[None]] = {}
_pending_lock = threading.Lock()


def store_in_background(
    cache: Cache,
    key: ComponentKey,
    root: Entry,
    exe: Any,
    costs: dict[str, float] | None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Stores an executable entry from a worker thread. The interpreter waits for
    the worker at exit; ``wait_for_writes`` and reads of the same key wait too."""
    global _writer
    with _pending_lock:
        if _writer is None:
            _writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxaot-writer")
        future = _writer.submit(store_executable, cache, key, root, exe, costs, extra)
        _pending[key.digest] = future

    def done(_: Any) -> None:
        with _pending_lock:
            if _pending.get(key.digest) is future:
                del _pending[key.digest]

    future.add_done_callback(done)


def wait_for_writes() -> None:
    """Blocks until every entry being written in the background is written."""
    with _pending_lock:
        futures = list(_pending.values())
    for future in futures:
        future.result()


def load_executable(
    cache: Cache, key: ComponentKey, in_tree: Any = None
) -> tuple[Any, dict[str, float] | None] | None:
    """The executable stored under ``key`` and its cost analysis, or ``None``."""
    loaded = load_executable_entry(cache, key, in_tree)
    if loaded is None:
        return None
    exe, entry = loaded
    costs = entry.extra.get("cost_analysis")
    return exe, dict(costs) if isinstance(costs, dict) else None


def load_executable_entry(
    cache: Cache, key: ComponentKey, in_tree: Any = None
) -> tuple[Any, Entry] | None:
    """The executable stored under ``key`` and its entry, or ``None`` (a damaged or
    unloadable entry is dropped with a warning: a miss, never a crash). ``in_tree``
    is the calling convention's input tree, for entries that could not store it."""
    pending = _pending.get(key.digest)
    if pending is not None:
        pending.result()
    entry = read(cache, key)
    if entry is None:
        return None
    try:
        if entry.executable is None:
            raise EntryError("entry has no executable section")
        stored = entry.extra.get("executable_in_tree")
        if stored is not None:
            in_tree = _entry.tree_from_json(stored)
        if in_tree is None:
            raise EntryError("entry has no input tree")
        exe = deserialize_executable(entry.executable, in_tree, entry.out_tree)
    except Exception as e:  # damaged, foreign or unloadable: a miss, never a crash
        _stats.bump("corrupt_entries")
        logger.warning(
            "jaxaot: could not load the cached executable %s (%s: %s); compiling instead",
            key.digest[:16],
            type(e).__name__,
            e,
        )
        discard(cache, key.digest)
        return None
    return exe, entry


def _in_tree_json(in_tree: Any) -> dict[str, Any]:
    # A tree whose node data is not JSON (an Equinox static field holding a
    # function) is not stored: the loading call gives its own, equal by the key.
    try:
        return {"executable_in_tree": _entry.tree_to_json(in_tree)}
    except NotPersistable:
        return {}


def executable_entry(
    key: ComponentKey,
    root: Entry,
    exe: Any,
    costs: dict[str, float] | None,
    extra: dict[str, Any] | None = None,
) -> Entry | None:
    """An entry holding ``exe`` serialized, or ``None`` if it cannot be serialized."""
    try:
        payload, in_tree, out_tree = serialize_executable(exe)
        return Entry(
            key=key,
            name=root.name,
            in_avals=root.in_avals,
            out_avals=root.out_avals,
            out_tree=out_tree,
            arg_names=root.arg_names,
            result_paths=root.result_paths,
            executable=payload,
            extra={**(extra or {}), "cost_analysis": costs, **_in_tree_json(in_tree)},
        )
    except Exception as e:
        logger.debug("jaxaot: not caching the executable of %s: %s", root.name, e)
        return None


def store_executable(
    cache: Cache,
    key: ComponentKey,
    root: Entry,
    exe: Any,
    costs: dict[str, float] | None,
    extra: dict[str, Any] | None = None,
) -> None:
    entry = executable_entry(key, root, exe, costs, extra)
    if entry is not None:
        write(cache, entry)


def decoder(key: ComponentKey) -> Callable[[bytes], Entry | None]:
    def decode(blob: bytes) -> Entry | None:
        try:
            return _entry.decode(blob, expected=key)
        except EntryError as e:
            logger.warning("jaxaot: entry %s from another process is bad (%s)", key.digest[:16], e)
            return None

    return decode


def discard(cache: Cache, digest: str) -> None:
    quarantine = getattr(cache, "quarantine", None)
    try:
        if quarantine is not None:
            quarantine(digest)
        else:
            cache.delete(digest)
    except Exception:  # removing a bad entry is best effort
        logger.debug("jaxaot: could not remove bad entry %s", digest[:16], exc_info=True)


def write(cache: Cache, entry: Entry) -> None:
    try:
        blob = _entry.encode(entry)
    except NotPersistable as e:
        logger.debug("jaxaot: not caching %s (%s): %s", entry.name, entry.key.digest[:16], e)
        return
    try:
        cache.put(entry.key.digest, blob)
    except Exception as e:
        _stats.bump("cache_errors")
        _stats.warn_once(
            f"put:{type(cache).__name__}:{type(e).__name__}",
            f"jaxaot: writing to {cache!r} failed ({type(e).__name__}: {e}); continuing without it",
        )
