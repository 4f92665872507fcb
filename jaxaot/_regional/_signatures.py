"""A call signature that ``jaxaot.jit`` traces and plans for the first time: its
types (``signature_types``), its executables loaded while it is traced
(``loading_ahead``), and what is new in it,
said when misses are explained (``JAXAOT_EXPLAIN_MISSES=1``, or JAX's own
``jax_explain_cache_misses``), as ``jax.jit`` explains its cache misses."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax

from .._component._arguments import Arguments
from .._component._types import type_of
from .._jax import active_target, trace_context
from .._keys._sharding import is_single_device
from .._store._active import get_cache
from .._store._executables import platform_text
from .._store._prefetch import ahead
from ._placement import canonical_sharding, host_sharding

__all__ = ["loading_ahead", "plan_signature", "say_new_signature", "signature_types"]

logger = logging.getLogger("jaxaot")

AVAL = operator.attrgetter("aval")
SHARDING = operator.attrgetter("sharding")


def signature_types(leaves: Sequence[Any], arrays: bool) -> tuple[Any, ...]:
    """The type of each leaf (``type_of`` of ``jax.typeof``; for plain arrays,
    ``arrays``: every leaf is one, without ``jax.typeof``'s per-leaf cost).

    Keyed by value: JAX interns its types and, from jax 0.12 on, compares them by
    identity, and equal types made by two routes (an eager result's, an
    executable's) are two objects; a step's outputs fed back as its inputs must
    find the plan of those inputs."""
    if arrays and jax.sharding.NamedSharding not in set(map(type, map(SHARDING, leaves))):
        avals: Any = map(AVAL, leaves)  # what jax.typeof gives for these
    else:
        avals = map(jax.typeof, leaves)
    return tuple(map(type_of, avals))


def say_new_signature(
    name: str,
    arguments: Arguments,
    last: tuple[Any, ...] | None,
    args: tuple[Any, ...],
    leaves: list[Any],
    treedef: Any,
    statics: tuple[Any, ...],
    arrays: bool,
) -> None:
    """Says what is new in a call of the ``jaxaot.jit`` function ``name`` (its
    ``arguments``) against its ``last`` call with plain arrays (its tree, types,
    shardings, mesh, statics...): static values, and argument types and
    shardings, by the user's names."""
    changes: list[str] = []
    if last is not None and arrays:
        old = dict(last[4])
        names = arguments.names(args)
        for where, value in statics:
            if where in old and old[where] != value:
                arg = names[where] if isinstance(where, int) and where < len(names) else where
                changes.append(f"static argument {arg!r}: {old[where]!r} → {value!r}")
        passed = _passing(last[0], set(old), treedef, {where for where, _ in statics})
        if passed is not None:
            changes.append(passed)
        elif last[0] != treedef:
            changes.append("the arguments' tree structure")
        else:
            changes += _leaf_change(arguments, last, leaves, treedef)
        if not changes:
            changes.append("the mesh or JAX's configuration")
    logger.warning(
        "jaxaot.jit %s: traced and planned again for a new signature (%s)",
        name,
        "; ".join(changes[:3]) or "the first call with these arguments",
    )


def _leaf_change(
    arguments: Arguments, last: tuple[Any, ...], leaves: list[Any], treedef: Any
) -> list[str]:
    """The first argument whose type or sharding changed, as ``path: was → now``."""
    dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    for i, (was, now, sharded, leaf) in enumerate(
        zip(last[1], map(AVAL, leaves), last[2], leaves, strict=True)
    ):
        placed = getattr(leaf, "sharding", None)
        if was == now and sharded == placed:
            continue
        a, b = was.str_short(), now.str_short()
        w, n = getattr(was, "weak_type", False), getattr(now, "weak_type", False)
        if a == b and w != n:  # (a Python scalar's type)
            a, b = (f"{t} weakly typed" if weak else t for t, weak in ((a, w), (b, n)))
        elif a == b:  # the same type on other devices (its mesh, its placement)
            a, b = f"{a} {_placed(sharded)}", f"{b} {_placed(placed)}"
        return [f"{arguments.leaf_path(dyn_args, dyn_kwargs, i)}: {a} → {b}"]
    return []


def _passing(was: Any, was_static: set[Any], now: Any, now_static: set[Any]) -> str | None:
    """What changed in how the arguments are passed (by position or by keyword),
    where that did: ``y: by keyword → by position``."""
    keywords = []
    for tree, static in ((was, was_static), (now, now_static)):
        try:
            _, kwargs = jax.tree_util.tree_unflatten(tree, [None] * tree.num_leaves)
        except (TypeError, ValueError):  # not an (args, kwargs) tree
            return None
        keywords.append(set(kwargs) | {w for w in static if isinstance(w, str)})
    if keywords[0] == keywords[1]:
        return None
    moved = [f"{name}: by keyword → by position" for name in sorted(keywords[0] - keywords[1])] + [
        f"{name}: by position → by keyword" for name in sorted(keywords[1] - keywords[0])
    ]
    return "; ".join(moved)


def _placed(sharding: Any) -> str:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return f"sharded {sharding.spec} over the mesh {dict(sharding.mesh.shape)}"
    if is_single_device(sharding):
        return f"on {next(iter(sharding.device_set))}"
    return f"placed {sharding}"


def loading_ahead(
    function: Callable[..., Any], leaves: Sequence[Any], treedef: Any, statics: tuple[Any, ...]
) -> AbstractContextManager[None]:
    """Around the first plan of a signature of ``function`` (its dynamic
    ``leaves``, its ``treedef`` and its ``statics``): the executables the last
    process that planned it used load on a background thread while it is traced
    (``_store._prefetch``), and those it uses are noted for the next."""
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", type(function).__qualname__)

    def text() -> str:
        mesh = jax.sharding.get_abstract_mesh()
        types = []
        for leaf in leaves:
            sharding = getattr(leaf, "sharding", None)
            placed = isinstance(sharding, jax.sharding.NamedSharding)
            types.append(f"{jax.typeof(leaf)}{sharding if placed else ''}")
        return "\n".join((str(treedef), repr(statics), str(mesh), " ".join(types)))

    return ahead(get_cache(), f"jaxaot.jit {module}.{name}", text, platform_text)


def plan_signature(leaves: Sequence[Any], treedef: Any, statics: Any, arrays: bool) -> Any:
    """What tells plans apart: the types, shardings, the mesh in context and
    the configuration ``jax.jit`` traces again for (x64, matmul precision,
    dtype promotion, ...); for plain arrays, a function of each leaf's
    ``aval`` and ``sharding``."""
    if arrays:
        shardings: tuple[Any, ...] = tuple(map(SHARDING, leaves))
    else:
        # A host value (a NumPy array, a Python scalar) has no sharding: it is
        # placed as an array made on the default device is, and shares its plans.
        host = host_sharding()
        shardings = tuple(getattr(x, "sharding", host) for x in leaves)
    # Equal shardings spelled differently (a step's outputs fed back) are one plan.
    shardings = tuple(map(canonical_sharding, shardings))
    mesh = (jax.sharding.get_abstract_mesh(), jax.sharding.get_mesh())
    # The compile target: another platform's plans (in-process only).
    target = active_target()
    types = signature_types(leaves, arrays)
    return (treedef, types, statics, shardings, mesh, trace_context(), target)
