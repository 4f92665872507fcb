"""Jaxpr rewrites for the entries jaxaot derives itself: products without
transposes in backward entries, fewer residuals, and no residual that is the
forward entry's own input.

A transposed (backward) entry is compiled on its own, so XLA cannot undo
layout choices that JAX's transpose rules make. The one that matters: JAX
transposes ``dot_general`` into another ``dot_general`` followed by a
``transpose`` that swaps its two groups of free dimensions (for a weight
gradient, ``(g^T x)^T`` rather than ``x^T g``). XLA:CPU fuses that transpose
with the elementwise producers of ``g`` into a strided loop, and the dot then
misses its fast kernel (``python benchmarks/backward.py`` measures a
transformer block's backward pass against JAX's own). Swapping the operands
gives the same product with no transpose, so :func:`fuse_dot_transposes` does
that wherever the transposed product has no other use.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._jax import ELEMENTWISE_ARITHMETIC, Literal, bind_equation, call_body, evaluate, jaxpr_as_fun
from ._types import sds

__all__ = ["forwarded_inputs", "fuse_dot_transposes", "prune_residuals", "residual_layout"]

logger = logging.getLogger("jaxaot")


def _swapped_dot_params(dot: Any, permutation: Sequence[int]) -> dict[str, Any] | None:
    """The params of ``dot_general(b, a)`` when ``transpose(dot_general(a, b), permutation)``
    equals it, else None."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dot.params["dimension_numbers"]
    lhs, rhs = dot.invars
    n_batch = len(lhs_batch)
    n_lhs_free = lhs.aval.ndim - len(lhs_contract) - n_batch
    n_rhs_free = rhs.aval.ndim - len(rhs_contract) - n_batch
    swapped = (
        *range(n_batch),
        *range(n_batch + n_lhs_free, n_batch + n_lhs_free + n_rhs_free),
        *range(n_batch, n_batch + n_lhs_free),
    )
    if tuple(permutation) != swapped or dot.params.get("out_sharding") is not None:
        return None
    params = dict(dot.params)
    params["dimension_numbers"] = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    precision = params.get("precision")
    if isinstance(precision, tuple) and len(precision) == 2:
        params["precision"] = (precision[1], precision[0])
    return params


def _uses(jaxpr: Any) -> dict[Any, int]:
    uses: dict[Any, int] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, Literal):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            uses[v] = uses.get(v, 0) + 1
    return uses


def _fusing(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], counter: list[int]
) -> list[Any]:
    # transpose equation -> (its dot_general equation, the swapped dot's params)
    fused: dict[int, tuple[Any, dict[str, Any]]] = {}
    uses = _uses(jaxpr)
    dots = {
        eqn.outvars[0]: eqn
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "dot_general" and uses.get(eqn.outvars[0]) == 1
    }
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "transpose" and eqn.invars[0] in dots:
            dot = dots[eqn.invars[0]]
            params = _swapped_dot_params(dot, eqn.params["permutation"])
            if params is not None:
                fused[id(eqn)] = (dot, params)
    skipped = {id(dot) for dot, _ in fused.values()}
    counter[0] += len(fused)

    def visit(eqn: Any, invals: list[Any], read: Callable[[Any], Any]) -> list[Any] | None:
        if id(eqn) in skipped:
            return [None]  # computed by the transpose that used it
        if id(eqn) in fused:
            dot, params = fused[id(eqn)]
            lhs, rhs = (read(v) for v in dot.invars)
            with dot.ctx.manager:
                return [jax.lax.dot_general_p.bind(rhs, lhs, **params)]
        body = call_body(eqn)
        if body is not None:
            return _fusing(body[0], body[1], invals, counter)
        return None

    return evaluate(jaxpr, consts, args, visit)


def fuse_dot_transposes(fun: Callable[..., Any], avals: Sequence[Any]) -> Callable[..., Any]:
    """``fun`` (flat arrays to a flat sequence of arrays) traced at ``avals``, with
    every ``transpose(dot_general(a, b))`` that only swaps the product's free
    dimensions computed as ``dot_general(b, a)``; calls of ``jit`` functions are
    inlined (XLA inlines them anyway). Same values, from the same products."""
    structs = [sds(a) for a in avals]
    closed = jax.make_jaxpr(fun)(*structs)
    counter = [0]
    out = jax.make_jaxpr(lambda *xs: _fusing(closed.jaxpr, closed.consts, xs, counter))(*structs)
    logger.debug("jaxaot: %d dot transposes fused", counter[0])
    return jaxpr_as_fun(out)  # type: ignore[no-any-return]


# Elementwise arithmetic and shape-only operations: cheap to recompute (see
# ``_jax.ELEMENTWISE_ARITHMETIC``).
_ARITHMETIC = ELEMENTWISE_ARITHMETIC


def _nbytes(v: Any) -> int:
    return int(v.aval.size) * v.aval.dtype.itemsize


def forwarded_inputs(known: Any, n_out: int) -> list[list[int]]:
    """``[r, q]`` for each residual output ``r`` of the forward jaxpr ``known``
    (whose first ``n_out`` outputs are the primal outputs) that is its own input
    ``q``, unchanged: a weight the backward pass multiplies by, say. A forward
    entry does not return those (it would return a copy): whoever binds it has
    the input at hand (``_rules._linearize``)."""
    jaxpr = known.jaxpr
    position = {v: q for q, v in enumerate(jaxpr.invars)}
    return [
        [r, position[v]]
        for r, v in enumerate(jaxpr.outvars)
        if r >= n_out and not isinstance(v, Literal) and v in position
    ]


def residual_layout(known: Any, n_out: int) -> str:
    """A digest of the residuals the forward jaxpr ``known`` returns after its
    ``n_out`` primal outputs: for each, in order, the primitive that makes it (or
    the input it is) and its type. A forward entry made in one process and a
    linear entry derived in another fit together only where theirs agree."""
    jaxpr = known.jaxpr
    producer = {v: eqn.primitive.name for eqn in jaxpr.eqns for v in eqn.outvars}
    position = {v: f"in{q}" for q, v in enumerate(jaxpr.invars)}
    text = ";".join(
        f"{'literal' if isinstance(v, Literal) else producer.get(v) or position.get(v, 'const')}"
        f":{v.aval.str_short()}"
        for v in jaxpr.outvars[n_out:]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prune_residuals(known: Any, unknown: Any, n_out: int) -> tuple[Any, Any]:
    """Writes fewer residuals: those that are elementwise arithmetic of other
    residuals are recomputed at the start of the linear part, and residuals that
    are all elementwise arithmetic of one value the forward part computes (or
    takes as input) are replaced by that value, when it is smaller than they are
    together.

    ``known`` maps primals to ``n_out`` primal outputs then the residuals;
    ``unknown`` maps the residuals then the tangents to output tangents. In the
    benchmark block, the MLP's residuals ``1 + tanh(u)``, ``1 - tanh(u)**2``
    and their products are all recomputed from ``tanh(u)``, however the
    installed JAX expresses tanh's derivative. The forward entry then writes
    fewer bytes and the backward entry reads fewer, never more."""
    jaxpr = known.jaxpr
    residuals = list(jaxpr.outvars[n_out:])
    real = list(dict.fromkeys(r for r in residuals if not isinstance(r, Literal)))
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}

    def arithmetic(v: Any) -> Any:
        eqn = producer.get(v)
        if eqn is None or eqn.primitive.name not in _ARITHMETIC or eqn.effects:
            return None
        return eqn

    def sources(v: Any, avail: set[Any], seen: set[Any]) -> dict[Any, None]:
        """The values outside ``avail`` that ``v`` is elementwise arithmetic of, in
        the order its equations read them (a dict: the same order in every process,
        where a set of variables would iterate by address)."""
        if isinstance(v, Literal) or v in avail or v in seen:
            return {}
        seen.add(v)
        eqn = arithmetic(v)
        if eqn is None:
            return {v: None}
        out: dict[Any, None] = {}
        for u in eqn.invars:
            out.update(sources(u, avail, seen))
        return out

    kept = set(real)
    changed = True
    while changed:
        changed = False
        # Residuals computable from the other residuals alone.
        for r in reversed(real):
            if r in kept and arithmetic(r) is not None and not sources(r, kept - {r}, set()):
                kept.discard(r)
                changed = True
        # Residuals that are arithmetic of one other value: keep that value instead.
        groups: dict[Any, list[Any]] = {}
        for r in real:
            if r in kept and arithmetic(r) is not None:
                found = sources(r, kept - {r}, set())
                if len(found) == 1:
                    groups.setdefault(next(iter(found)), []).append(r)
        for source, group in groups.items():
            if _nbytes(source) < sum(_nbytes(r) for r in group):
                kept.difference_update(group)
                kept.add(source)
                changed = True
    if kept == set(real):
        return known, unknown
    # Kept residuals in their order, each new source where its first residual was;
    # any other in the order the program defines it. The order is the forward
    # entry's results and the linear entry's inputs, made in different processes
    # (a forward entry loaded, its linear entry derived again): it must follow
    # from the program alone, never from addresses (the iteration of a set).
    order: list[Any] = []
    for r in real:
        if r in kept:
            order.append(r)
        else:
            order.extend(s for s in sources(r, set(), set()) if s in kept)
    defined = [
        *jaxpr.constvars,
        *jaxpr.invars,
        *(v for eqn in jaxpr.eqns for v in eqn.outvars),
    ]
    order.extend(v for v in defined if v in kept)
    kept_list = list(dict.fromkeys(order))
    if len(kept_list) != len(kept):  # (a value from nowhere: leave them all as they are)
        return known, unknown
    needed: set[Any] = set()

    def mark(v: Any) -> None:
        if isinstance(v, Literal) or v in kept or v in needed:
            return
        needed.add(v)
        for u in producer[v].invars:
            mark(u)

    for r in residuals:
        mark(r)
    recompute = [eqn for eqn in jaxpr.eqns if any(v in needed for v in eqn.outvars)]
    forward_outvars = [*jaxpr.outvars[:n_out], *kept_list]

    def forward(*primals: Any) -> list[Any]:
        return evaluate(jaxpr, known.consts, primals, outvars=forward_outvars)

    linear = jaxpr_as_fun(unknown)

    def linear_from_kept(*args: Any) -> list[Any]:
        env = dict(zip(kept_list, args[: len(kept_list)], strict=True))
        for eqn in recompute:
            invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            env.update(zip(eqn.outvars, bind_equation(eqn, invals), strict=True))
        values = [r.val if isinstance(r, Literal) else env[r] for r in residuals]
        return linear(*values, *args[len(kept_list) :])  # type: ignore[no-any-return]

    def structs(avals: Sequence[Any]) -> list[Any]:
        return [sds(a) for a in avals]

    tangent_avals = unknown.in_avals[len(residuals) :]
    new_known = jax.make_jaxpr(forward)(*structs(known.in_avals))
    new_unknown = jax.make_jaxpr(linear_from_kept)(
        *structs([r.aval for r in kept_list]), *structs(tangent_avals)
    )
    logger.debug(
        "jaxaot: %d residuals written instead of %d (%d bytes instead of %d)",
        len(kept_list),
        len(real),
        sum(map(_nbytes, kept_list)),
        sum(map(_nbytes, real)),
    )
    return new_known, new_unknown
