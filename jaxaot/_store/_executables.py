"""Executable entries: what keys an executable (the devices and flags it was
compiled for), serializing it into an entry, loading it back, and writing big
ones in the background."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax

from .. import _stats
from .._caches import Cache
from .._jax import (
    CallbacksNotRebindable,
    active_target,
    compile_flags,
    deserialize_executable,
    host_cpu_text,
    platform_version_text,
    serialize_executable,
    target_devices,
    topology_text,
)
from .._keys._key import ComponentKey
from . import _prefetch
from ._entry import Entry, EntryError
from ._readwrite import counted_loaded, dropped, read_blob, write
from ._trees import NotPersistable, tree_from_json, tree_to_json
from ._writer import written

__all__ = [
    "BACKGROUND_AFTER_SECONDS",
    "cost_dict",
    "executable_key",
    "executable_parts",
    "load_executable",
    "platform_text",
    "store_executable",
    "target_process_keys",
]

logger = logging.getLogger("jaxaot")


def executable_parts(donate_argnums: tuple[int, ...]) -> tuple[tuple[str, Any], ...]:
    """Key parts that make a foreign or stale executable impossible to load: those
    of the devices it is compiled for, as a process on them names itself (this
    process's, or the active compile target's: its process 0), the topology
    where the devices have one (TPUs), donations and compiler flags."""
    if active_target() is None:
        devices = jax.devices()
        count, processes, index = jax.device_count(), jax.process_count(), jax.process_index()
    else:
        devices = target_devices()
        count, processes = len(devices), len({int(d.process_index) for d in devices})
        index = 0
    device = devices[0]
    client = device.client
    topology = topology_text(devices)
    return (
        ("backend", str(client.platform)),
        ("platform_version", platform_version_text(client)),
        ("device_kind", str(device.device_kind)),
        # XLA:CPU's code is this CPU's: another CPU's is not loaded (nor dropped).
        *((("host_cpu", host_cpu_text()),) if str(client.platform) == "cpu" else ()),
        ("device_count", count),
        ("process_count", processes),
        # An executable is bound to its process's devices: each process has its own.
        ("process_index", index),
        *((("topology", topology),) if topology is not None else ()),
        ("donate_argnums", tuple(donate_argnums)),
        # Less the dump and debug flags, which cannot change the code (as JAX's cache).
        *compile_flags(),
    )


def platform_text() -> str:
    """The devices (or the compile target) executables are made for here, and
    how (``executable_parts`` of an executable that donates nothing), as text."""
    return repr(executable_parts(()))


def executable_key(
    key: ComponentKey,
    donate_argnums: tuple[int, ...],
    placement: tuple[tuple[str, Any], ...] = (),
    flat: bool = False,
) -> ComponentKey:
    """The key of an executable of the program ``key`` names: the one place where
    executables are keyed. ``placement``: the shardings and mesh it is compiled
    for; ``flat``: it takes flat arrays (``jaxaot.jit``'s regions), not the call's
    pytrees (a component's top-level executable of the same entry)."""
    convention = (("calling_convention", "flat"),) if flat else ()
    return key.replace(executable=(*executable_parts(donate_argnums), *convention, *placement))


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


BACKGROUND_AFTER_SECONDS = 0.25


def load_executable(
    cache: Cache, key: ComponentKey, in_tree: Any = None
) -> tuple[Any, Entry] | None:
    """The executable stored under ``key`` and its entry, or ``None`` (a damaged or
    unloadable entry is dropped with a warning: a miss, never a crash). ``in_tree``
    is the calling convention's input tree, for entries that could not store it."""
    written(key.digest)
    ahead = _prefetch.take(cache, key)
    if ahead is not None:
        return ahead[1], ahead[0]
    entry, blob = read_blob(cache, key, count=False)
    if entry is None or blob is None:
        return None
    try:
        if entry.executable is None:
            raise EntryError("entry has no executable section")
        stored = entry.extra.get("executable_in_tree")
        if stored is not None:
            stored = tree_from_json(stored)
            if in_tree is not None and stored != in_tree:
                # (Sound bytes of another executable under this key: it would be
                # called with inputs it was not compiled for.)
                raise EntryError("its input tree is not the call's")
            in_tree = stored
        if in_tree is None:
            raise EntryError("entry has no input tree")
        exe = deserialize_executable(entry.executable, in_tree, entry.out_tree)
    except CallbacksNotRebindable as e:
        # A sound entry whose host callbacks this process cannot name (two programs
        # alike but for the objects their callbacks see): a miss here, kept for others.
        logger.debug("jaxaot: not loading %s here: %s", key.digest[:16], e)
        return None
    except Exception as e:  # damaged, foreign or unloadable: a miss, never a crash
        _stats.bump("corrupt_entries")
        what = f"a cached executable that could not be loaded ({type(e).__name__}: {e})"
        dropped(cache, key.digest, what, "compiling instead", blob, "unloadable")
        return None
    counted_loaded(key.digest)
    return exe, entry


def _in_tree_json(in_tree: Any) -> dict[str, Any]:
    # A tree whose node data is not JSON (an Equinox static field holding a
    # function) is not stored: the loading call gives its own, equal by the key.
    try:
        return {"executable_in_tree": tree_to_json(in_tree)}
    except NotPersistable:
        return {}


def target_process_keys(key: ComponentKey) -> list[ComponentKey]:
    """The keys of ``key``'s executable for the other processes of the active
    compile target (none without a target, or for a one-process target): the
    same executable, keyed by each process index, as each process of the
    target names itself."""
    target = active_target()
    parts = key.parts.get("executable")
    if target is None or not isinstance(parts, tuple):
        return []
    processes = sorted({int(d.process_index) for d in target_devices()})
    out = []
    for index in processes[1:]:
        changed = tuple(
            ("process_index", index) if isinstance(p, tuple) and p[:1] == ("process_index",) else p
            for p in parts
        )
        out.append(key.replace(executable=changed))
    return out


def not_serializable(name: str, error: Exception) -> None:
    """Says once per program ``name`` that its executable could not be serialized
    (``error``): silence would read as a warm start to come. (A component's host
    callback that only its lowering adds, as lineax's solves do, cannot be
    serialized; nor, at times, an XLA:CPU executable holding a sort's comparator.)"""
    why = f"{type(error).__name__}: {error}"
    if "LessThan" in str(error):
        why += "; XLA:CPU cannot serialize a sort whose comparator it compiled to a fast path"
    _stats.warn_once(
        f"not-serializable:{name}",
        f"jaxaot: the executable of {name!r} is not written to the cache ({why}); it stays "
        "in this process, so a new process compiles it again",
    )


def store_executable(
    cache: Cache,
    key: ComponentKey,
    root: Entry,
    exe: Any,
    costs: dict[str, float] | None,
    extra: dict[str, Any] | None = None,
    serialized: bytes | None = None,
) -> None:
    """Writes ``exe`` serialized (or ``serialized``, the bytes it was loaded from)
    under ``key``, with ``root``'s types; not if it cannot be serialized."""
    try:
        if serialized is None:
            payload, in_tree, out_tree = serialize_executable(exe)
        else:
            payload, in_tree, out_tree = serialized, exe.in_tree, exe.out_tree
        entry = Entry(
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
        not_serializable(root.name, e)
        return
    write(cache, entry)
    # A multi-process target: one entry per process (the same bytes).
    for other in target_process_keys(key):
        write(cache, dataclasses.replace(entry, key=other))
