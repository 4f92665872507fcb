"""Making an entry: trace, check effects, lower (where the entry may leave this
process), and record names and types."""

from __future__ import annotations

from typing import Any

import jax

from .. import _stats
from .._jax import (
    has_host_callbacks,
    is_ordered_effect,
    lower_linkable,
    module_to_bytecode,
    uses_primitive,
)
from .._keys._key import ComponentKey
from .._store._entry import LOCAL, Entry
from .._store._readwrite import CALLBACKS_ONLY, LINEAR_ONLY, WITH_CALLER
from ._cost import work_facts
from ._plain import devices_of, devices_to_json, needs_context, needs_plain_jax
from ._types import traced_under

__all__ = ["build_entry"]


def _local_reason(
    callbacks: bool, axis: bool, linear: bool, checks: bool, plain: str | None
) -> str:
    """Why an entry stays in this process (said when it is not written)."""
    if checks:
        return (
            "its program holds checkify.check calls, which checkify lowers where "
            "the component is called"
        )
    if linear:
        return "it is a custom_vjp rule's linear part, which only its transpose uses"
    if axis:
        return (
            "its program uses a mesh or vmap axis bound outside it (it is called inside "
            "a shard_map or pmap, or takes a collective over an enclosing axis), so it "
            "is lowered with its caller"
        )
    if plain is not None:
        return f"its program {plain}"
    return "the entry holds host callbacks (process-local Python objects)"


def build_entry(
    key: ComponentKey,
    traced: Any,
    name: str,
    counters: _stats.Counters,
    *,
    owner: str,
    lower: bool = True,
) -> Entry:
    """The entry for ``key`` from ``traced`` (a ``jax.stages.Traced``), named ``name``;
    lowered for the key's platform unless ``lower`` is false or the entry must stay
    in this process. ``owner`` names the component in errors; ``counters`` count
    the lowering.

    Raises:
      ValueError: the program has ordered side effects.
    """
    closed = traced.jaxpr
    for eff in closed.effects:
        if is_ordered_effect(eff):
            raise ValueError(
                f"jaxaot.component {owner!r}: ordered side effects ({eff}) are not "
                "supported in components; use unordered callbacks (the default for "
                "jax.debug.print and io_callback) or call it outside the component"
            )
    callbacks = has_host_callbacks(closed)
    stablehlo = None
    # A program served as plain JAX: its entry is not lowered, and stays in this process.
    devices = devices_of(closed)
    plain = needs_plain_jax(devices)
    axis, linear = needs_context(closed)
    # checkify.check lowers only once checkify has made it a value: such a body
    # is checked inline where it is called (``_rules``), never lowered alone.
    checks = uses_primitive(closed, ("check",))
    if uses_primitive(closed, ("custom_partitioning",)):
        # Said once: silence would read as the user's partitioning kept.
        _stats.warn_once(
            f"custom-partitioning:{owner}",
            f"jaxaot: component {owner!r} calls a custom_partitioning function: a "
            "component is lowered apart from its caller's shardings, so its partition "
            "rule is not used and its plain function runs on each device (under "
            "jax.jit the rule partitions it); call it outside the component",
        )
    context = axis or linear or checks
    local = callbacks or context or plain is not None
    # Only a linear part: every process derives it again, and writes its transposes.
    linear_only = linear and not callbacks and plain is None
    if not local and lower:
        platform = key.parts["platforms"][0]
        with traced_under((*closed.in_avals, *closed.out_avals)):
            lowered = lower_linkable(traced, platform)
        counters.add("lowerings")
        stablehlo = module_to_bytecode(lowered.compiler_ir("stablehlo"))
    debug = closed.jaxpr.debug_info
    arg_names = tuple("" if n is None else str(n) for n in (debug.arg_names or ()))
    if len(arg_names) != len(closed.in_avals):
        arg_names = ("",) * len(closed.in_avals)
    result_paths = tuple(str(p) for p in (debug.result_paths or ()))
    if len(result_paths) != len(closed.out_avals):
        result_paths = tuple(f"result[{i}]" for i in range(len(closed.out_avals)))
    return Entry(
        key=key,
        name=name,
        in_avals=tuple(closed.in_avals),
        out_avals=tuple(closed.out_avals),
        out_tree=jax.tree_util.tree_structure(traced.out_info),
        arg_names=arg_names,
        result_paths=result_paths,
        stablehlo=stablehlo,
        # Entries that cannot be lowered on their own (collectives over an
        # outer vmap axis, custom_vjp linear parts) stay in this process, like
        # those with host callbacks; they are only ever transformed.
        host_callbacks=local,
        jaxpr=closed,
        effects=frozenset(closed.effects),
        extra={
            # In this process only for its host callbacks: its executable can be
            # cached where JAX can bind them again in another process.
            **({CALLBACKS_ONLY: True} if callbacks and not context and plain is None else {}),
            **({"plain": plain} if plain else {}),
            **({LOCAL: _local_reason(callbacks, axis, linear, checks, plain)} if local else {}),
            **({LINEAR_ONLY: True} if linear_only else {}),
            **({WITH_CALLER: True} if context and not callbacks and plain is None else {}),
            **({"devices": devices_to_json(devices)} if devices else {}),
            **work_facts(closed),
        },
    )
