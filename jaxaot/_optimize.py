"""Jaxpr rewrites for the entries jaxaot derives itself.

A transposed (backward) entry is compiled on its own, so XLA cannot undo
layout choices that JAX's transpose rules make. The one that matters: JAX
transposes ``dot_general`` into another ``dot_general`` followed by a
``transpose`` that swaps its two groups of free dimensions (for a weight
gradient, ``(g^T x)^T`` rather than ``x^T g``). XLA:CPU fuses that transpose
with the elementwise producers of ``g`` into a strided loop, and the dot then
misses its fast kernel; in the benchmark transformer block this was a third
of the backward pass. Swapping the operands gives the same product with no
transpose, so :func:`fuse_dot_transposes` does that wherever the transposed
product has no other use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ._jaxcompat import ClosedJaxpr, DropVar, Jaxpr, Literal, jaxpr_as_fun

logger = logging.getLogger("jaxaot")

# Calls whose bodies are inlined. A ``checkpoint`` in a backward entry holds the
# forward recomputation; with no forward pass in the same program there is
# nothing for XLA to share it with, so inlining it changes no schedule.
_CALLS = frozenset(["jit", "pjit", "closed_call", "core_call", "checkpoint", "remat2"])


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


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Binds ``eqn``'s primitive to ``invals`` in its context; its outputs as a list."""
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    visit: Callable[[Any, list[Any], Callable[[Any], Any]], list[Any] | None],
) -> list[Any]:
    """Evaluates ``jaxpr`` equation by equation (under a trace, this restages it),
    binding each primitive unless ``visit(eqn, invals, read)`` returns the
    equation's outputs itself (``read`` gives any variable's value so far)."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outvals = visit(eqn, invals, read)
        if outvals is None:
            outvals = _bind(eqn, invals)
        for v, x in zip(eqn.outvars, outvals, strict=True):
            if not isinstance(v, DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


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
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None
        if isinstance(inner, ClosedJaxpr):
            return _fusing(inner.jaxpr, inner.consts, invals, counter)
        if isinstance(inner, Jaxpr) and not inner.constvars:
            return _fusing(inner, (), invals, counter)
        return None

    return evaluate(jaxpr, consts, args, visit)


def fuse_dot_transposes(fun: Callable[..., Any], avals: Sequence[Any]) -> Callable[..., Any]:
    """``fun`` (flat arrays to a flat sequence of arrays) traced at ``avals``, with
    every ``transpose(dot_general(a, b))`` that only swaps the product's free
    dimensions computed as ``dot_general(b, a)``; calls of ``jit`` functions are
    inlined (XLA inlines them anyway). Same values, from the same products."""
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    closed = jax.make_jaxpr(fun)(*sds)
    counter = [0]
    out = jax.make_jaxpr(lambda *xs: _fusing(closed.jaxpr, closed.consts, xs, counter))(*sds)
    logger.debug("jaxaot: %d dot transposes fused", counter[0])
    return jaxpr_as_fun(out)  # type: ignore[no-any-return]


# Elementwise arithmetic and shape-only operations: cheap to recompute, and
# fused by XLA into whatever consumes them. Transcendentals (exp, tanh, ...)
# are not listed: recomputing them costs more than reading them back.
_ARITHMETIC = frozenset(
    [
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "integer_pow",
        "square",
        "max",
        "min",
        "select_n",
        "convert_element_type",
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "eq",
        "ne",
        "lt",
        "gt",
        "le",
        "ge",
        "and",
        "or",
        "not",
        "abs",
        "sign",
        "copy",
    ]
)


def prune_residuals(known: Any, unknown: Any, n_out: int) -> tuple[Any, Any]:
    """Drops the residuals of a linearization that are elementwise arithmetic of
    other residuals, and recomputes them at the start of the linear part.

    ``known`` maps primals to ``n_out`` primal outputs then the residuals;
    ``unknown`` maps the residuals then the tangents to output tangents. The
    forward entry then writes fewer bytes (in the benchmark block, four of the
    six MLP-sized residuals are arithmetic of the other two) and the backward
    entry reads fewer; no residual is ever added."""
    jaxpr = known.jaxpr
    residuals = list(jaxpr.outvars[n_out:])
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    kept = {r for r in residuals if not isinstance(r, Literal)}

    def derivable(v: Any, avail: set[Any], seen: set[Any]) -> bool:
        if isinstance(v, Literal) or v in avail:
            return True
        eqn = producer.get(v)
        if eqn is None or eqn.primitive.name not in _ARITHMETIC or v in seen or eqn.effects:
            return False
        seen.add(v)
        return all(derivable(u, avail, seen) for u in eqn.invars)

    for r in reversed(residuals):
        if not isinstance(r, Literal) and r in kept and derivable(r, kept - {r}, set()):
            kept.discard(r)
    if len(kept) == len({r for r in residuals if not isinstance(r, Literal)}):
        return known, unknown
    kept_list = list(
        dict.fromkeys(r for r in residuals if not isinstance(r, Literal) and r in kept)
    )
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
    full = jaxpr_as_fun(known)

    def forward(*primals: Any) -> list[Any]:
        outs = full(*primals)
        by_var = {
            v: o for v, o in zip(jaxpr.outvars, outs, strict=True) if not isinstance(v, Literal)
        }
        return [*outs[:n_out], *(by_var[r] for r in kept_list)]

    linear = jaxpr_as_fun(unknown)

    def linear_from_kept(*args: Any) -> list[Any]:
        env = dict(zip(kept_list, args[: len(kept_list)], strict=True))
        for eqn in recompute:
            invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            env.update(zip(eqn.outvars, _bind(eqn, invals), strict=True))
        values = [r.val if isinstance(r, Literal) else env[r] for r in residuals]
        return linear(*values, *args[len(kept_list) :])  # type: ignore[no-any-return]

    def sds(avals: Sequence[Any]) -> list[Any]:
        return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]

    tangent_avals = unknown.in_avals[len(residuals) :]
    new_known = jax.make_jaxpr(forward)(*sds(known.in_avals))
    new_unknown = jax.make_jaxpr(linear_from_kept)(
        *sds([r.aval for r in kept_list]), *sds(tangent_avals)
    )
    logger.debug(
        "jaxaot: %d of %d residuals recomputed", len(residuals) - len(kept_list), len(residuals)
    )
    return new_known, new_unknown
