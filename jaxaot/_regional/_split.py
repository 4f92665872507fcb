"""Cutting a traced program into regions: single component calls, and the runs of
other equations between them (*glue*).

Calls of ``jax.jit`` functions and ``jax.checkpoint`` regions that contain
components are inlined first (:func:`inline_calls`), so their components split
as well. A component under ``lax.scan``, ``cond`` or ``while`` stays inside its
glue (one DEBUG line).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .._component._rules import component_p
from .._jax import (
    CALL_PRIMITIVES,
    DropVar,
    Literal,
    call_body,
    evaluate,
    jaxprs_in_params,
    walk_jaxprs,
)

__all__ = ["Region", "contains_components", "inline_calls", "split"]

logger = logging.getLogger("jaxaot")


def contains_components(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (closed or not) holds a component call, nested jaxprs included."""
    return any(eqn.primitive is component_p for j in walk_jaxprs(jaxpr) for eqn in j.eqns)


def inline_calls(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    unsplit: Callable[[Any], bool] | None = None,
) -> list[Any]:
    """Evaluates ``jaxpr`` (under a trace: restages it), inlining the calls (jit,
    checkpoint) that contain components, and the component calls ``unsplit``
    says stay in their glue (blocks called once): their computations' own
    equations in their place."""

    def visit(eqn: Any, invals: list[Any], read: Any) -> list[Any] | None:
        name = eqn.primitive.name
        if eqn.primitive is component_p:
            if unsplit is not None and unsplit(eqn):
                return list(eqn.params["call"].fn()(*invals))
            return None
        inner = call_body(eqn) if name in CALL_PRIMITIVES else None
        if inner is not None and contains_components(inner[0]):
            return inline_calls(inner[0], inner[1], invals, unsplit)
        if name not in CALL_PRIMITIVES and any(
            contains_components(j) for j in jaxprs_in_params(eqn.params)
        ):
            logger.debug(
                "jaxaot.jit: components under %s are compiled inline with their glue", name
            )
        return None

    return evaluate(jaxpr, consts, args, visit)


class Region(NamedTuple):
    """One step of a split program: a component call, or a run of glue equations.

    ``invars``/``outvars``: the variables it reads from and hands to the rest of
    the program; ``donate``: positions among ``invars`` that it may donate (a
    donated input it reads last)."""

    kind: str  # "component" or "glue"
    eqns: list[Any]
    invars: list[Any]
    outvars: list[Any]
    donate: tuple[int, ...]


def split(jaxpr: Any, donated: set[Any]) -> tuple[list[Region], set[Any]]:
    """Cuts ``jaxpr`` into regions, in program order; and the donated inputs that
    no glue region consumed (deleted after the call)."""
    groups: list[tuple[str, list[Any]]] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is component_p:
            groups.append(("component", [eqn]))
        elif groups and groups[-1][0] == "glue":
            groups[-1][1].append(eqn)
        else:
            groups.append(("glue", [eqn]))
    # Liveness: which variables each region must hand on.
    needed_after: list[set[Any]] = [set() for _ in groups]
    live = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    last_use: dict[Any, int] = {}
    for i in range(len(groups) - 1, -1, -1):
        needed_after[i] = set(live)
        for eqn in groups[i][1]:
            for v in eqn.invars:
                if not isinstance(v, Literal):
                    live.add(v)
                    last_use.setdefault(v, i)
    regions: list[Region] = []
    consumed: set[Any] = set()
    for i, (kind, eqns) in enumerate(groups):
        if kind == "component":
            regions.append(Region(kind, eqns, list(eqns[0].invars), list(eqns[0].outvars), ()))
            continue
        defined: set[Any] = set()
        invars: list[Any] = []
        for eqn in eqns:
            for v in eqn.invars:
                if not isinstance(v, Literal) and v not in defined and v not in invars:
                    invars.append(v)
            defined.update(v for v in eqn.outvars if not isinstance(v, DropVar))
        outvars = [
            v
            for eqn in eqns
            for v in eqn.outvars
            if not isinstance(v, DropVar) and v in needed_after[i]
        ]
        donate = tuple(
            j
            for j, v in enumerate(invars)
            if v in donated and last_use.get(v) == i and v not in needed_after[i]
        )
        consumed.update(invars[j] for j in donate)
        regions.append(Region(kind, eqns, invars, outvars, donate))
    return regions, donated - consumed
