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

__all__ = ["Region", "contains_components", "inline_calls", "nested_components", "split"]

logger = logging.getLogger("jaxaot")


def contains_components(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (closed or not) holds a component call, nested jaxprs included."""
    return any(eqn.primitive is component_p for j in walk_jaxprs(jaxpr) for eqn in j.eqns)


# How the primitives that hold components the split cannot reach are spelled in
# what ``explain`` says (``fori_loop`` stages out as a scan or a while loop).
_NESTING_NAMES = {"scan": "scan/fori_loop", "while": "while_loop/fori_loop"}


def nested_components(jaxpr: Any) -> str:
    """The primitives (``scan/fori_loop``, ``cond``...) of ``jaxpr``'s own equations
    that hold component calls, which therefore stay inside their glue; ``""``
    if none do."""
    names = dict.fromkeys(
        _NESTING_NAMES.get(eqn.primitive.name, eqn.primitive.name)
        for eqn in jaxpr.eqns
        if eqn.primitive is not component_p
        and any(contains_components(j) for j in jaxprs_in_params(eqn.params))
    )
    return ", ".join(names)


def under_loops(nested: str) -> str:
    """Why a program whose layers run under ``nested`` (``scan/fori_loop``...) is
    kept whole, as ``explain`` says it."""
    return (
        f"kept whole: its layers run under {nested} (as with nn.scan, hk.layer_stack, "
        "a scan over stacked layers or a loop of inner steps), compiled with their "
        "glue: a loop's body is compiled once already, and a split cannot reach inside it"
    )


def loops_in_glue(nested: str) -> str:
    """What ``explain`` says of a split program's layers that run under ``nested``
    (``scan/fori_loop``...): they stay in the glue that loops over them."""
    return (
        f"in glue, under {nested}: layers a loop runs (an RNN's cell, nn.scan, "
        "hk.layer_stack) are compiled with the loop, whose body is compiled once already"
    )


def scan_why() -> str:
    """Why a program whose layers are stacked under a scan has nothing to split."""
    return "nothing to split: " + under_loops("lax.scan or fori_loop").removeprefix("kept whole: ")


def scanned_layers(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (closed or not) holds a scan of two or more steps, nested
    jaxprs included: layers stacked under it are one body, compiled once."""
    return any(
        eqn.primitive.name == "scan" and eqn.params.get("length", 0) >= 2
        for j in walk_jaxprs(jaxpr)
        for eqn in j.eqns
    )


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


def _aval_key(v: Any) -> tuple[Any, Any]:
    return tuple(v.aval.shape), v.aval.dtype


def _donations(
    invars: Sequence[Any],
    outvars: Sequence[Any],
    donatable: set[Any],
    here: int,
    last_use: dict[Any, int],
    needed_after: set[Any],
) -> tuple[int, ...]:
    """The positions among ``invars`` a region donates: values whose buffers may be
    reused (``donatable``) that it reads last (once: a buffer passed twice cannot
    be donated), each matched, in order, to an output of its shape and dtype that
    no earlier one was matched to, as XLA pairs donated inputs with outputs (a
    donated input with no output to reuse it is deleted after the call instead)."""
    free = [_aval_key(v) for v in outvars]
    donate = []
    for j, v in enumerate(invars):
        if (
            isinstance(v, Literal)
            or v not in donatable
            or last_use.get(v) != here
            or v in needed_after
            or sum(u is v for u in invars) != 1
        ):
            continue
        key = _aval_key(v)
        if key in free:
            free.remove(key)
            donate.append(j)
    return tuple(donate)


def split(jaxpr: Any, donated: set[Any]) -> tuple[list[Region], set[Any]]:
    """Cuts ``jaxpr`` into regions, in program order; and the donated inputs that
    no region consumed (deleted after the call).

    A donated input's buffer is donated to the region that reads it last, and
    lives on in the output XLA reuses it for; that output is donated in turn to
    the region that reads it last, and so on: the buffer reaches the region that
    produces the program's matching output, which reuses it, as in one XLA
    program (a donated step's new parameters are written over its old ones)."""
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
    # Values whose buffers a region may donate: the donated inputs, then the
    # outputs that may hold a donated buffer (of the shape and dtype of one).
    donatable = set(donated)
    for i, (kind, eqns) in enumerate(groups):
        if kind == "component":
            invars, outvars = list(eqns[0].invars), list(eqns[0].outvars)
        else:
            defined: set[Any] = set()
            invars = []
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
        donate = _donations(invars, outvars, donatable, i, last_use, needed_after[i])
        given = {_aval_key(invars[j]) for j in donate}
        donatable.update(v for v in outvars if not isinstance(v, DropVar) and _aval_key(v) in given)
        consumed.update(invars[j] for j in donate)
        regions.append(Region(kind, eqns, invars, outvars, donate))
    return regions, donated - consumed
