"""Evaluating a jaxpr equation by equation, and binding one equation.

Under a trace, evaluating a jaxpr restages it: jaxaot's jaxpr rewrites and
``jaxaot.jit``'s inlining are interpreters over :func:`evaluate` whose
``visit`` replaces the equations they rewrite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._jaxpr import DropVar, Literal

__all__ = ["bind_equation", "evaluate"]


def bind_equation(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Binds ``eqn``'s primitive to ``invals`` in the equation's context (its name
    stack, its source info); its outputs as a list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        if isinstance(params, tuple):  # (subfuns, params), as older JAX returns
            subfuns, params = params
            out = eqn.primitive.bind(*subfuns, *invals, **params)
        else:
            out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    visit: Callable[[Any, list[Any], Callable[[Any], Any]], list[Any] | None] | None = None,
    outvars: Sequence[Any] | None = None,
) -> list[Any]:
    """Evaluates ``jaxpr`` equation by equation (under a trace, this restages it),
    binding each primitive unless ``visit(eqn, invals, read)`` returns the
    equation's outputs itself (``read`` gives any variable's value so far).
    Returns the values of ``outvars`` (default: the jaxpr's outputs)."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outvals = visit(eqn, invals, read) if visit is not None else None
        if outvals is None:
            outvals = bind_equation(eqn, invals)
        for v, x in zip(eqn.outvars, outvals, strict=True):
            if not isinstance(v, DropVar):
                env[v] = x
    return [read(v) for v in (jaxpr.outvars if outvars is None else outvars)]
