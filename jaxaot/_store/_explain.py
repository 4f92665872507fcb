"""Why a key missed: the closest recent key of the same component and kind, and
what changed, in words.

Every miss is noted (whether or not misses are explained): its key's parts and
explanation data (:attr:`ComponentKey.about`) go under a *tag* derived from the
component's name and the kind of entry, in the active cache where the backend
keeps notes (:class:`~jaxaot._caches.Indexing`), and in this process while it
explains misses. With
``JAXAOT_EXPLAIN_MISSES=1`` a miss is explained from those notes alone (and the
keys the store holds): no entry is read, so explaining counts no hit, refreshes
no access time, and costs the same in a cache of any size. A backend that keeps
no notes offers no candidates.

One miss is explained once: a top-level call that misses its executable, and
then its root entry while compiling it, logs the executable's miss only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from .._caches import Cache, Indexing
from .._caches._protocol import INDEX_ITEM_BYTES, INDEX_ITEMS
from .._keys._key import ComponentKey
from ._active import explain_misses

__all__ = ["candidates", "miss", "note", "tag"]

logger = logging.getLogger("jaxaot")

_NOTE_VERSION = 1
#: Tags remembered in this process (each with at most INDEX_ITEMS keys).
_LOCAL_TAGS = 256

_local: OrderedDict[str, OrderedDict[str, ComponentKey]] = OrderedDict()
_local_lock = threading.Lock()
_thread = threading.local()


def kind(key: ComponentKey) -> tuple[Any, ...]:
    """What a key is an entry of: its transformations by name, and whether it is
    an executable's (only keys of one kind are compared)."""
    transform = key.parts.get("transform") or ()
    kinds = tuple(t[0] if isinstance(t, tuple) and t else t for t in transform)
    return (kinds, "executable" in key.parts)


def tag(name: str, key: ComponentKey) -> str:
    """The tag under which the keys of component ``name`` of ``key``'s kind are noted."""
    text = json.dumps(["jaxaot notes", _NOTE_VERSION, name, kind(key)], default=str)
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()


def _item(key: ComponentKey) -> bytes | None:
    """A note of ``key``: its parts and, where it fits, its explanation data."""
    for about in (key.about, {}):
        data = {"v": _NOTE_VERSION, "key": key.to_json(), "about": about}
        try:
            item = json.dumps(data, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
        except (TypeError, ValueError):
            continue
        if len(item) <= INDEX_ITEM_BYTES:
            return item.encode("ascii")
    return None


def _from_item(digest: str, item: bytes) -> ComponentKey | None:
    try:
        data = json.loads(item)
        about = data.get("about") or {}
        key = ComponentKey.from_json(data["key"], about if isinstance(about, dict) else None)
    except Exception:  # a note from another version, or cut short: explains nothing
        return None
    return key if key.digest == digest else None


def note(name: str, key: ComponentKey, cache: Cache | None, local: bool = True) -> None:
    """Notes a missed key in ``cache`` (where it keeps notes) and, with ``local``, in
    this process."""
    t = tag(name, key)
    if local:
        _note_here(t, key)
    if not isinstance(cache, Indexing):
        return
    item = _item(key)
    if item is None:
        return
    try:
        cache.note(t, key.digest, item)
    except Exception:  # notes are hints: a fault loses one
        logger.debug("jaxaot: could not note %s in %r", key.digest[:16], cache, exc_info=True)


def _note_here(t: str, key: ComponentKey) -> None:
    with _local_lock:
        keys = _local.get(t)
        if keys is None:
            keys = _local[t] = OrderedDict()
            while len(_local) > _LOCAL_TAGS:
                _local.popitem(last=False)
        _local.move_to_end(t)
        keys[key.digest] = key
        keys.move_to_end(key.digest)
        while len(keys) > INDEX_ITEMS:
            keys.popitem(last=False)


def candidates(
    name: str, key: ComponentKey, cache: Cache | None, held: Iterable[ComponentKey] = ()
) -> list[ComponentKey]:
    """Keys of component ``name`` of ``key``'s kind to compare ``key`` with, most
    recent first: ``held`` (the store's own), those noted in this process, and
    those noted in ``cache`` whose entries it still holds. Reads no entry."""
    t = tag(name, key)
    want = kind(key)
    found: dict[str, ComponentKey] = {}
    for k in reversed(list(held)):
        if kind(k) == want:
            found.setdefault(k.digest, k)
    with _local_lock:
        local = list(reversed((_local.get(t) or {}).values()))
    for k in local:
        found.setdefault(k.digest, k)
    if isinstance(cache, Indexing):
        try:
            noted = cache.notes(t)
        except Exception:  # a cache whose notes cannot be read offers none
            logger.debug("jaxaot: could not read notes from %r", cache, exc_info=True)
            noted = []
        for digest, item in noted:
            if digest not in found:
                k = _from_item(digest, item)
                if k is not None and kind(k) == want:
                    found[digest] = k
    found.pop(key.digest, None)
    return list(found.values())


def _root_digest(key: ComponentKey) -> str:
    if "executable" not in key.parts:
        return key.digest
    return ComponentKey([(k, v) for k, v in key.parts.items() if k != "executable"]).digest


def _same_miss(name: str, key: ComponentKey) -> bool:
    """Whether this miss is the root entry's of an executable whose miss was just
    explained on this thread (one miss: the executable compiles it)."""
    pending: dict[str, str] = getattr(_thread, "pending", None) or {}
    _thread.pending = pending
    if "executable" in key.parts:
        pending[name] = _root_digest(key)
        return False
    return pending.pop(name, None) == key.digest


def miss(
    name: str,
    key: ComponentKey,
    cache: Cache | None,
    held: Iterable[ComponentKey] = (),
    label: str | None = None,
) -> None:
    """A miss of component ``name``'s ``key``: noted; with ``JAXAOT_EXPLAIN_MISSES=1``
    explained at WARNING (once per miss), else logged at DEBUG. ``label`` names
    what missed in the message (default: ``component 'name'``)."""
    what = f"component {name!r}" if label is None else label
    if not explain_misses():
        # Noted for other processes (and later runs) that explain their misses;
        # this process keeps no notes of its own while it explains none.
        logger.debug("jaxaot: %s miss %s", name, key.digest[:16])
        note(name, key, cache, local=False)
        return
    if _same_miss(name, key):
        logger.debug("jaxaot: %s miss %s (its executable's miss)", name, key.digest[:16])
        note(name, key, cache)
        return
    known = candidates(name, key, cache, held)
    with _local_lock:  # the keys this process missed (and so made) itself
        mine = set(_local.get(tag(name, key)) or ())
    note(name, key, cache)
    # The closest (fewest differences; min keeps the first of equals: the most
    # recent), of the entries this process did not make where there are any: a
    # process missing every bucket of a deployment for one cause is told that
    # cause each time, not how a bucket it made just now differs.
    found = min(
        ((k, key.explain(k)) for k in known),
        key=lambda kl: (kl[0].digest in mine, len(kl[1])),
        default=None,
    )
    if found is None:
        logger.warning(
            "jaxaot: %s missed the cache (key %s); no other entry of its component "
            "and kind is held in this process or noted in the cache",
            what,
            key.digest[:16],
        )
        return
    closest, lines = found
    logger.warning(
        "jaxaot: %s missed the cache (key %s); the closest entry held (%s) differs in: %s",
        what,
        key.digest[:16],
        closest.digest[:16],
        "; ".join(lines) or "nothing the key names (an entry that could not be used)",
    )
