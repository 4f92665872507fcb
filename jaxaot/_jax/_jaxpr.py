"""Jaxprs: their types, walking them, their call bodies, effects and callbacks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._versions import SUPPORTED_JAX
from . import _internals
from ._internals import JAX_VERSION, Zero
from ._internals import array as _array
from ._internals import core as _core
from ._internals import dispatch as _dispatch
from ._internals import effects as _effects
from ._internals import partial_eval as _partial_eval
from ._internals import prng as _prng

io_callback_p = _internals.callback.io_callback_p
pure_callback_p = _internals.callback.pure_callback_p
debug_callback_p = _internals.debugging.debug_callback_p

__all__ = [
    "CALL_PRIMITIVES",
    "ELEMENTWISE_ARITHMETIC",
    "JAX_VERSION",
    "SUPPORTED_JAX",
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "Literal",
    "Primitive",
    "ShapedArray",
    "ArrayImpl",
    "PRNGKeyArray",
    "Tracer",
    "Zero",
    "apply_primitive",
    "call_body",
    "component_callback_jaxpr",
    "has_host_callbacks",
    "is_ordered_effect",
    "jaxpr_as_fun",
    "named",
    "jaxprs_in_params",
    "join_effects",
    "named_axis_effect",
    "trace_state_clean",
    "under_staging",
    "uses_primitive",
    "walk_jaxprs",
]

Primitive = _core.Primitive
ShapedArray = _core.ShapedArray
Tracer = _core.Tracer
#: The type of a concrete ``jax.Array`` (named without computing one: an array
#: made at import time would be an XLA compile in every process).
ArrayImpl = _array.ArrayImpl
#: The type of a concrete typed PRNG key array (``jax.random.key``).
PRNGKeyArray = _prng.PRNGKeyArray
# 0.10: ClosedJaxpr(jaxpr, consts) wraps a Jaxpr; 0.11+: a Jaxpr carries its
# consts and Jaxpr(jaxpr, consts) builds the closed one (0.12 drops the name).
ClosedJaxpr: Any = getattr(_core, "ClosedJaxpr", _core.Jaxpr)
Jaxpr = _core.Jaxpr
Literal = _core.Literal
DropVar = _core.DropVar
join_effects = _core.join_effects
jaxprs_in_params = _core.jaxprs_in_params
jaxpr_as_fun = _core.jaxpr_as_fun
trace_state_clean = _core.trace_state_clean
apply_primitive = _dispatch.apply_primitive


def under_staging() -> bool:
    """Whether a trace that stages a program (``jax.jit``, ``jax.make_jaxpr``, a
    ``scan`` body) is under the current one: then the program a call makes is
    part of that staged program. Under eager transformations alone
    (``jax.grad``, ``jax.vmap`` of a function called outside any jit), JAX
    compiles what each call binds by itself."""
    trace = _core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, _partial_eval.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` named ``name`` (the user's function): a program jaxaot compiles from a
    jaxpr is then ``jit(step)`` in compile logs, the profiler and HLO module names,
    as under ``jax.jit`` (not ``jit(jaxpr_as_fun)``)."""

    def program(*args: Any) -> Any:
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


def walk_jaxprs(closed: Any) -> Iterator[Any]:
    """``closed``'s jaxpr (closed or not) and every jaxpr nested in it, at any depth."""
    stack = [closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed]
    while stack:
        jaxpr = stack.pop()
        yield jaxpr
        stack.extend(_core.subjaxprs(jaxpr))


def uses_primitive(closed: Any, names: Sequence[str]) -> bool:
    """Whether ``closed`` (or a jaxpr nested in it) has an equation of one of ``names``."""
    wanted = set(names)
    return any(eqn.primitive.name in wanted for j in walk_jaxprs(closed) for eqn in j.eqns)


_CALLBACK_PRIMITIVES = frozenset([pure_callback_p, io_callback_p, debug_callback_p])
_CALLBACK_NAMES = frozenset(["debug_print", "debug_callback", "pure_callback", "io_callback"])


def _is_callback(primitive: Any) -> bool:
    name = getattr(primitive, "name", "")
    return primitive in _CALLBACK_PRIMITIVES or name in _CALLBACK_NAMES or name.endswith("callback")


def component_callback_jaxpr(eqn: Any) -> Any | None:
    """The jaxpr of the entry a ``jaxaot_component`` equation calls, where that entry
    is kept in its process for its host callbacks (and so is lowered inline, its
    callbacks with it); ``None`` for any other equation."""
    if eqn.primitive.name != "jaxaot_component":
        return None
    entry = getattr(eqn.params.get("call"), "entry", None)
    if not getattr(entry, "host_callbacks", False):
        return None
    return getattr(entry, "jaxpr", None)


def has_host_callbacks(closed_jaxpr: Any) -> bool:
    """Whether the jaxpr (or any jaxpr nested in it, or in a component it calls)
    calls back into Python."""
    stack = [closed_jaxpr]
    while stack:
        for j in walk_jaxprs(stack.pop()):
            for eqn in j.eqns:
                if _is_callback(eqn.primitive):
                    return True
                inner = component_callback_jaxpr(eqn)
                if inner is not None:
                    stack.append(inner)
    return False


def is_ordered_effect(effect: Any) -> bool:
    return _effects.ordered_effects.contains(effect)


def named_axis_effect(effects: Any) -> bool:
    """Whether ``effects`` hold a named-axis effect (a collective over an axis bound
    outside the jaxpr: ``psum`` over an outer ``vmap`` axis)."""
    return any(type(e).__name__ == "NamedAxisEffect" for e in effects)


#: The primitive of a ``jax.custom_vjp`` function's call (``custom_vjp_call_jaxpr``
#: in older JAX).
CUSTOM_VJP_PRIMITIVES = ("custom_vjp_call", "custom_vjp_call_jaxpr")

# Primitives that call a jaxpr (their body): inlined by jaxaot.jit and by the
# jaxpr rewrites. 0.11.1 replaced closed_call/core_call by eval_jaxpr.
CALL_PRIMITIVES = frozenset(
    ["jit", "pjit", "closed_call", "core_call", "eval_jaxpr", "checkpoint", "remat2"]
)


def call_body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of the body of a call-like equation (``CALL_PRIMITIVES``),
    or None for any other equation."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    inner = eqn.params.get("jaxpr")
    if inner is None:
        inner = eqn.params.get("call_jaxpr")
    if isinstance(inner, ClosedJaxpr):
        return inner.jaxpr, inner.consts
    if isinstance(inner, Jaxpr) and not inner.constvars:
        return inner, ()
    return None


# Elementwise arithmetic and shape-only operations: cheap to recompute, and
# fused by XLA into whatever consumes them. Transcendentals (exp, tanh, ...)
# are not listed: recomputing them costs more than reading them back.
# ``one_minus_square`` (0.11.2+: 1 - x**2, in tanh's derivative) is arithmetic.
ELEMENTWISE_ARITHMETIC = frozenset(
    [
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "integer_pow",
        "square",
        "one_minus_square",
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
