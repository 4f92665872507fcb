"""Loading a signature's executables while its program is traced.

A new process must trace a program before it knows its keys, and only then
can it load the program's executables: on a warm start the two costs add up.
But which executables a function's signature used is known from the last
process that ran it. Under a *tag* naming the function, the signature (the
call's tree, types and shardings, its static arguments) and the platform, the
cache keeps notes of the executables the signature looked up
(``_caches.Indexing``: hints beside the entries, never entries). The first
call of that signature in a new process reads the notes and loads those
executables on a background thread while its own thread traces. An
executable loaded ahead is used only where the key the trace computed is the
very key it was stored under, checked as every read checks it: a program whose
code changed computes other keys, and the executables loaded ahead for it go
unused (and are dropped). Nothing is ever taken on the tag's word.

``ahead`` wraps the first lookup of a signature; every executable
looked up inside it (``_lookup.get_or_make``, on any thread the lookup hands
work to) is noted under its tag; ``take`` is where a read of an executable
entry (``_executables.load_executable``) looks first.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import hashlib
import logging
import re
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import _stats
from .._caches import Cache, Indexing
from .._caches._protocol import INDEX_ITEMS
from .._jax import active_target, binds_callbacks, deserialize_executable
from .._keys._key import ComponentKey
from . import _entry
from ._entry import Entry
from ._readwrite import counted_loaded
from ._trees import tree_from_json
from ._writer import in_background

__all__ = ["ahead", "noted", "take"]

logger = logging.getLogger("jaxaot")

#: The most executables loaded ahead and not yet taken that this process keeps
#: (the oldest are dropped): those of programs whose code changed are never
#: taken. As many as one signature has notes of.
KEEP = INDEX_ITEMS

Loaded = tuple[Entry, Any]


#: This process's notes say it noted them (with their order): a later process
#: loads the latest process's executables first, in the order that one used them.
_RUN = secrets.token_hex(4)


class _Signature:
    """The notes of one signature's first lookup: what it found noted, and where
    to note what it uses that was not."""

    def __init__(self, cache: Indexing, tag: str, known: set[str]) -> None:
        self.cache = cache
        self.tag = tag
        self.known = known
        self.lock = threading.Lock()
        self.count = 0

    def note(self, digest: str) -> None:
        with self.lock:
            if digest in self.known:
                return
            self.known.add(digest)
            self.count += 1
            item = f"{_RUN}:{self.count}".encode()
        # Written by the writer thread, after the entry it names (a note costs
        # this thread, which hands the executable to the call waiting for it, a
        # few system calls, each waiting for the interpreter while that write runs).
        in_background(f"note:{self.tag}:{digest}", lambda: self._write(digest, item))

    def _write(self, digest: str, item: bytes) -> None:
        try:
            self.cache.note(self.tag, digest, item)
        except Exception:  # notes are hints: a fault loses one
            logger.debug("jaxaot: could not note %s under %s", digest[:16], self.tag[:16])


def _in_order(noted: list[tuple[str, bytes]]) -> list[str]:
    """Noted digests (most recent first) in the order to load them: the latest
    process's first, in the order it used them, then each earlier one's (what
    it still uses that an earlier process noted, and what it no longer uses)."""
    runs: dict[str, list[tuple[int, str]]] = {}
    for digest, item in noted:
        run, _, count = item.decode("ascii", "replace").partition(":")
        runs.setdefault(run, []).append((int(count) if count.isdigit() else 0, digest))
    return [digest for used in runs.values() for _, digest in sorted(used)]


_current: contextvars.ContextVar[_Signature | None] = contextvars.ContextVar(
    "jaxaot_prefetch", default=None
)
_lock = threading.Lock()
_ready: collections.OrderedDict[str, tuple[Cache, concurrent.futures.Future[Loaded | None]]] = (
    collections.OrderedDict()
)
_loader: concurrent.futures.ThreadPoolExecutor | None = None
# The executables this process looked up (a signature sharing one loads none again).
_looked_up: set[str] = set()


#: An object's address in its repr (``<... object at 0x7f...>``): another in each process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def tag(name: str, text: str, platform: str) -> str:
    """The tag of function ``name``'s signature ``text`` (objects' addresses left
    out) on ``platform`` (the devices, or compile target, executables are made for)."""
    signature = _ADDRESS.sub("", text)
    body = "\n".join(("jaxaot prefetch", name, platform, signature))
    return hashlib.sha256(body.encode()).hexdigest()


@contextlib.contextmanager
def ahead(
    cache: Cache | None, name: str, text: Callable[[], str], platform: Callable[[], str]
) -> Iterator[None]:
    """Around the first lookup of a signature of function ``name`` (``text()``
    names the signature, ``platform()`` the devices its executables are made
    for): starts loading the executables noted for it in ``cache`` (in the
    order they were first used), and notes the ones it uses that were not
    noted. A cache that keeps no notes, or a signature that cannot be named,
    does neither."""
    if not isinstance(cache, Indexing) or active_target() is not None:
        yield  # (a compile target's executables are for other devices: never loaded here)
        return
    try:
        t = tag(name, text(), platform())
        found = _in_order(cache.notes(t))
        for digest in found:
            _start(cache, digest)
    except Exception as e:  # a hint lost (or no thread to load on): as without it
        logger.debug("jaxaot: nothing loaded ahead for %s (%s: %s)", name, type(e).__name__, e)
        yield
        return
    with _stats.set_during(_current, _Signature(cache, t, set(found))):
        yield


def noted(key: ComponentKey | Callable[[], ComponentKey]) -> None:
    """Notes the executable ``key`` (or ``key()``) names under the signature being
    looked up (if any: ``key`` is not called otherwise)."""
    signature = _current.get()
    if signature is not None:
        signature.note((key if isinstance(key, ComponentKey) else key()).digest)


def _start(cache: Cache, digest: str) -> None:
    global _loader
    with _lock:
        if digest in _ready or digest in _looked_up:
            return  # (loading, or loaded here already)
        if _loader is None:
            # One thread: the executables load in the order they are needed.
            _loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxaot-prefetch")
            stop_at_exit = getattr(threading, "_register_atexit", None)
            if stop_at_exit is not None:  # (before the pool's own exit, which runs the queue)
                stop_at_exit(_stop)
        _ready[digest] = (cache, _loader.submit(_load, cache, digest))
        while len(_ready) > KEEP:
            _ready.popitem(last=False)[1][1].cancel()


def _stop() -> None:
    """At exit: loads not started yet are dropped (a process ends without them)."""
    with _lock:
        for _, loading in _ready.values():
            loading.cancel()


def _load(cache: Cache, digest: str) -> Loaded | None:
    """The entry stored under ``digest`` and its executable, or ``None`` (anything
    wrong with it is left to the lookup, which reads it again and says so)."""
    try:
        blob = cache.get(digest)
        if blob is None:
            return None
        entry = _entry.decode(blob)
        stored = entry.extra.get("executable_in_tree")
        if entry.executable is None or stored is None or binds_callbacks(entry.executable):
            return None  # (its callbacks are bound from this process's trace of it)
        return entry, deserialize_executable(
            entry.executable, tree_from_json(stored), entry.out_tree
        )
    except Exception as e:
        logger.debug("jaxaot: %s not loaded ahead (%s: %s)", digest[:16], type(e).__name__, e)
        return None


def take(cache: Cache, key: ComponentKey) -> Loaded | None:
    """The entry and executable loaded ahead under ``key`` from ``cache`` (waiting
    for it if it is loading), if it is stored under this very key; else ``None``."""
    with _lock:
        held = _ready.pop(key.digest, None)
        _looked_up.add(key.digest)
    if held is None or held[0] is not cache:
        return None
    # (Waited for even before it starts: the loader takes the GIL this thread
    # gives up here, and it loads first what the latest process used first.)
    try:
        loaded = held[1].result()
    except concurrent.futures.CancelledError:
        return None
    if loaded is None or loaded[0].key != key:
        return None
    _stats.bump("prefetched")
    counted_loaded(key.digest)
    return loaded
