"""An entry's executable on flat arrays: a region of a ``jaxaot.jit`` split
program, or a transformed component call run eagerly (``jax.grad(component)(x)``
outside ``jax.jit``, which JAX would otherwise compile afresh in every process).

One executable per entry, input placement and donated inputs, in this process
(the component's ``region_executables``) and in the cache, under the entry's
executable key (``flat``: it takes the entry's inputs as a flat list, unlike the
top-level executable of the same entry, which takes the call's pytrees).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._caches import Cache
from .._jax import Tracer, active_target, on_target
from .._keys._key import ComponentKey
from .._keys._sharding import is_single_device
from .._store._executables import (
    cost_dict,
    executable_key,
    load_executable,
    store_executable,
)
from .._store._lookup import Codec, get_or_make
from .._store._readwrite import callbacks_executable
from ._types import sds

__all__ = ["flat_executable", "lowered", "runs_flat"]


def flat_executable(
    call: Any,
    run: Callable[..., Any],
    memo: Any,
    shardings: tuple[Any, ...] | None = None,
    placement: tuple[tuple[str, Any], ...] = (),
    donate: tuple[int, ...] = (),
) -> Any:
    """The executable of ``run`` (the call of ``call``'s entry on flat arrays),
    compiled for the input ``shardings`` (``None``: unsharded; ``placement``:
    their key parts) with the inputs at ``donate`` donated: from this process
    (under ``memo``), else loaded from the cache, else compiled and stored.
    Counted in the component's counters."""
    store = call.component.store
    entry = call.entry

    def load(cache: Cache, exe_key: ComponentKey) -> Any:
        loaded = load_executable(cache, exe_key)
        return None if loaded is None else loaded[0]

    def make() -> Any:
        store.counters.add("compiles")
        structs = [sds(a) for a in entry.in_avals]
        what = f"jaxaot.component {call.component.name!r}"
        return lowered(run, structs, donate, shardings, what).compile()

    def save(cache: Cache, exe_key: ComponentKey, exe: Any) -> None:
        payload = None
        if entry.host_callbacks:
            # Stored only where its callbacks can be bound again in a
            # process that traced the same program (``_jax._callbacks``).
            payload = callbacks_executable(entry, exe, call.component.name)
            if payload is None:
                return
        store_executable(cache, exe_key, entry, exe, cost_dict(exe), serialized=payload)

    # One lock per entry, so that jaxaot.jit compiles different entries of one
    # component (its forward and its backward) at the same time.
    return get_or_make(
        store.region_executables,
        memo,
        store.region_locks(memo),
        lambda: executable_key(call.key, donate, placement, flat=True),
        Codec(
            f"{call.component.name} region executable", load, save, memo_hits=False, executable=True
        ),
        make,
        store.counters,
    )


def lowered(
    fn: Callable[..., Any],
    structs: list[Any],
    donate: tuple[int, ...],
    shardings: tuple[Any, ...] | None,
    what: str,
) -> Any:
    """``fn`` lowered for ``structs`` with the inputs at ``donate`` donated, each
    input placed as ``shardings`` says (where it says), under a compile target
    for its devices (unplaced inputs on its first)."""
    if shardings is not None:
        structs = [
            s
            if sharding is None
            else jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type, sharding=sharding)
            for s, sharding in zip(structs, shardings, strict=True)
        ]
    structs = on_target(structs, what)
    return jax.jit(fn, keep_unused=True, donate_argnums=donate).trace(*structs).lower()


def runs_flat(call: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``call`` run eagerly on ``args`` can run its unsharded flat
    executable: every argument a concrete array on the default device alone, no
    mesh set, no compile target, and an entry without effects (tokens are JAX's
    to thread)."""
    if call.entry.effects or active_target() is not None:
        return False
    if not jax.sharding.get_abstract_mesh().empty or getattr(
        jax.config, "jax_default_device", None
    ):
        return False
    default = jax.devices()[0]
    for x in args:
        if not isinstance(x, jax.Array) or isinstance(x, Tracer):
            return False
        if not is_single_device(x.sharding):
            return False
        if x.sharding.device_set != {default}:
            return False
    return True
