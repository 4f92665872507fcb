"""How much work a computation does, and whether its linearization recomputes it.

A linearized component (``jax.grad`` of a program calling it) is a forward
entry and a backward one. By default the forward entry returns the residuals
the backward one reads (20 to 40 arrays for a transformer block). On XLA:CPU
every array an executable returns and every kernel it runs costs microseconds,
whatever its size: for a small layer the forward entry then costs five times
the layer's own inference pass, and a training step of many such layers costs
well over a ``lax.scan`` of them. Such a layer is cheaper to compute again:
its forward entry returns its outputs alone (the same program as its inference
pass), and its backward entry computes the forward pass again from the layer's
inputs, as ``jax.checkpoint`` would.

``work`` estimates a computation's cost from its jaxpr (two per multiply-add
of its products and convolutions, one per element every other operation
writes, loop bodies times their trip count); it is kept in the entry
(``extra["work"]``), so a process that loads the entry from a cache decides as
the one that made it, and the keys of its derived entries agree.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator
from typing import Any

from .._env import number
from .._jax import ClosedJaxpr, jaxprs_in_params, uses_primitive
from .._store._entry import Entry

__all__ = [
    "RECOMPUTE_BELOW",
    "entry_work",
    "keeping_residuals",
    "recompute_below",
    "recomputes",
    "work",
    "work_facts",
]

# A linearized entry whose ``work`` is below this, on CPU, recomputes its forward
# pass in the backward entry: below it, the outputs and kernels a forward entry
# that writes residuals adds cost more than the forward pass computed again;
# above it, recomputing costs more. Measured by ``python benchmarks/recompute.py``
# (jaxaot.jit's split train step, each form, at shapes on either side of it).
# ``JAXAOT_RECOMPUTE_BELOW`` overrides it (0: never).
RECOMPUTE_BELOW = 8e6

# Primitives whose trip count jaxpr types do not give: their work is unknown.
_UNBOUNDED = frozenset(["while"])


#: Set while ``jaxaot.jit`` traces a program that may run as one program: its
#: small components keep their residuals (see :func:`keeping_residuals`).
_KEEP_RESIDUALS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxaot_keep_residuals", default=False
)


@contextlib.contextmanager
def keeping_residuals(keep: bool = True) -> Iterator[None]:
    """During the block, no linearization recomputes its forward pass: in one
    program (``jaxaot.jit``'s whole-program form) residuals are arrays inside
    it, which cost no executable's output, and recomputing would only compile
    and run the forward pass twice. (Whether an entry recomputes is part of its
    derived entries' keys.)"""
    token = _KEEP_RESIDUALS.set(keep)
    try:
        yield
    finally:
        _KEEP_RESIDUALS.reset(token)


def recompute_below() -> float:
    """:data:`RECOMPUTE_BELOW`, or ``$JAXAOT_RECOMPUTE_BELOW``."""
    return number("JAXAOT_RECOMPUTE_BELOW", RECOMPUTE_BELOW, "a number (of work; 0: never)")


def recomputes(entry: Entry) -> bool:
    """Whether ``entry``'s linearization recomputes its forward pass (see above):
    for an entry of known work below :func:`recompute_below`, with no side
    effects (a callback would run twice) and no checkpoint region. Decided from
    the entry alone, the same on every platform."""
    if entry.host_callbacks or entry.effects:
        return False
    if entry.extra.get("checkpoints") or _KEEP_RESIDUALS.get():
        return False
    cost = entry_work(entry)
    return cost is not None and cost < recompute_below()


def entry_work(entry: Entry) -> float | None:
    """The work ``entry`` was made with (see :func:`work_facts`), or ``None``."""
    cost = entry.extra.get("work")
    return float(cost) if isinstance(cost, (int, float)) else None


# A computation with a checkpoint region in it has its residuals chosen by the
# region's policy (``jax.checkpoint``'s, Equinox's ``filter_checkpoint``): it is
# never made to recompute more.
_CHECKPOINTS = ("checkpoint", "remat2")


def work_facts(closed: Any) -> dict[str, float | bool]:
    """What an entry of ``closed`` keeps of its cost: its ``work`` where known, and
    whether it holds a checkpoint region (then it never recomputes more). Kept in
    the entry, so that a process that loads it decides as the one that made it."""
    facts: dict[str, float | bool] = {}
    if uses_primitive(closed, _CHECKPOINTS):
        facts["checkpoints"] = True
    cost = work(closed)
    if cost is not None:
        facts["work"] = cost
    return facts


def work(closed: Any) -> float | None:
    """An estimate of what ``closed`` (a jaxpr, closed or not) computes; None if a
    loop's trip count is unknown."""
    jaxpr = closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _UNBOUNDED:
            return None
        inner = list(jaxprs_in_params(eqn.params))
        if inner:
            costs = [work(j) for j in inner]
            if any(c is None for c in costs):
                return None
            known = [float(c) for c in costs if c is not None]
            # A conditional runs one branch; a scan its body ``length`` times.
            body = max(known) if name == "cond" else sum(known)
            total += body * float(eqn.params.get("length", 1)) if name == "scan" else body
        elif name == "dot_general":
            total += _dot(eqn)
        elif name == "conv_general_dilated":
            total += _conv(eqn)
        else:
            total += _elements(v.aval for v in eqn.outvars)
    return total


def _elements(avals: Iterable[Any]) -> float:
    return float(sum(math.prod(getattr(a, "shape", ())) for a in avals))


def _dot(eqn: Any) -> float:
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    depth = math.prod(lhs[d] for d in contract)
    return 2.0 * _elements(v.aval for v in eqn.outvars) * depth


def _conv(eqn: Any) -> float:
    # Each output element is a product over the kernel's in-features and window:
    # the kernel's size over its out-features.
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * _elements(v.aval for v in eqn.outvars) * math.prod(rhs) / max(1, out_features)
