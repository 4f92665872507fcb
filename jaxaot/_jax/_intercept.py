"""Seeing the calls a traced program makes (inner ``jax.jit`` functions and
``jax.checkpoint`` regions) as they are bound, before autodiff transforms them.

JAX differentiates a ``checkpoint`` region by inlining its forward pass into
the caller: once the program is traced, the forward blocks have no boundary
left. So ``jaxaot.jit`` looks at each call when it is bound, in the program's
own trace (or a JVP, linearize or vmap trace over it), and may bind something
else in its place (a component call). :func:`intercepting` installs a hook for
the block; :func:`bind_plainly` binds a call as JAX would.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ._internals import UNSPECIFIED
from ._internals import ad as _ad
from ._internals import ad_checkpoint as _ad_checkpoint
from ._internals import core as _core
from ._internals import partial_eval as _pe
from ._internals import pjit as _pjit
from ._jaxpr import ClosedJaxpr, call_body, named

__all__ = [
    "BoundCall",
    "bind_plainly",
    "call_jaxpr",
    "current_trace",
    "differentiating",
    "forwarded",
    "hoisted",
    "hoisted_draws",
    "intercepting",
    "is_inline",
    "is_plain_jit",
    "jaxpr_program",
    "pruned",
    "not_intercepting",
    "used_inputs",
    "within",
]


class BoundCall(NamedTuple):
    """A call being bound: its kind (``"jit"`` or ``"checkpoint"``), the
    primitive's parameters, and its operands."""

    kind: str
    params: dict[str, Any]
    args: tuple[Any, ...]


#: Called with each call bound while it is set; returns the call's outputs, or
#: ``None`` to let JAX bind it.
_HOOK: contextvars.ContextVar[Callable[[BoundCall], Sequence[Any] | None] | None] = (
    contextvars.ContextVar("jaxaot_call_hook", default=None)
)
_ORIGINAL: dict[str, Callable[..., Any]] = {}
_INSTALLED = threading.Lock()
_PRIMITIVES = {"jit": _pjit.jit_p, "checkpoint": _ad_checkpoint.remat_p}


def _hooked(kind: str) -> Callable[..., Any]:
    original = _ORIGINAL[kind]

    def bind(*args: Any, **params: Any) -> Any:
        hook = _HOOK.get()
        if hook is not None:
            outs = hook(BoundCall(kind, params, args))
            if outs is not None:
                return outs
        return original(*args, **params)

    return bind


def _install() -> None:
    """Puts the hooks in place, once per process (idle unless a hook is set)."""
    with _INSTALLED:
        if _ORIGINAL:
            return
        for kind, primitive in _PRIMITIVES.items():
            _ORIGINAL[kind] = primitive.bind
        for kind, primitive in _PRIMITIVES.items():
            primitive.bind = _hooked(kind)  # type: ignore[method-assign]


@contextlib.contextmanager
def intercepting(hook: Callable[[BoundCall], Sequence[Any] | None]) -> Iterator[None]:
    """Calls ``hook`` with every inner ``jit`` and ``checkpoint`` call bound in this
    context (thread) during the block."""
    _install()
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def bind_plainly(call: BoundCall) -> list[Any]:
    """Binds ``call`` as JAX would, hooks aside."""
    _install()
    with not_intercepting():
        return list(_ORIGINAL[call.kind](*call.args, **call.params))


def jaxpr_program(closed: Any, name: str) -> Callable[..., Any]:
    """A function named ``name`` that runs ``closed`` as one nested ``jit`` call:
    traced, it binds one equation holding ``closed`` instead of binding each of
    its equations again (which costs about as much as the program's first trace),
    and lowers to the same computation, which XLA inlines."""
    n, m = len(closed.in_avals), len(closed.out_avals)

    def program(*args: Any) -> Any:
        # The parameters a jit call takes differ between JAX versions: those of
        # a trivial one traced here (under the caller's mesh), for ``closed``.
        template = jax.make_jaxpr(jax.jit(lambda *xs: xs))(*args).jaxpr.eqns[0].params
        params = dict(
            template,
            jaxpr=closed,
            in_shardings=(UNSPECIFIED,) * n,
            out_shardings=(UNSPECIFIED,) * m,
            in_layouts=(None,) * n,
            out_layouts=(None,) * m,
            donated_invars=(False,) * n,
            name=name,
            keep_unused=True,
        )
        return bind_plainly(BoundCall("jit", params, args))

    return named(program, name)


def hoisted(call: BoundCall) -> BoundCall:
    """``call`` with the constants of an inner ``jit``'s closed jaxpr passed as
    its first operands instead (calls that differ only in constants' values are
    then one program)."""
    if call.kind != "jit" or not call.params["jaxpr"].consts:
        return call
    closed = call.params["jaxpr"]
    return _with_inputs(call, _pe.convert_constvars_jaxpr(closed.jaxpr), closed.consts)


def _with_inputs(call: BoundCall, jaxpr: Any, first: Sequence[Any]) -> BoundCall:
    """``call`` of the open ``jaxpr``, which takes ``first`` before its operands."""
    params = dict(call.params)
    n = len(first)
    if call.kind == "jit":
        params["jaxpr"] = ClosedJaxpr(jaxpr, ())
        params["in_shardings"] = (*(UNSPECIFIED,) * n, *params["in_shardings"])
        params["in_layouts"] = (*(None,) * n, *params["in_layouts"])
        params["donated_invars"] = (*(False,) * n, *params["donated_invars"])
    else:
        params["jaxpr"] = jaxpr
    return BoundCall(call.kind, params, (*first, *call.args))


def hoisted_draws(call: BoundCall) -> BoundCall:
    """``call`` with the numbers its body folds into random keys
    (``random_fold_in`` of a literal) passed as its first operands instead.
    Flax linen folds a layer's place in the model into each of its draws' keys
    so (``make_rng`` under ``nn.remat``): every layer's program would differ by
    that number, and no layer would be shared. It computes the same."""
    closed = call.params["jaxpr"]
    if getattr(closed, "consts", ()):
        return call
    jaxpr = getattr(closed, "jaxpr", closed)
    values: list[Any] = []
    inputs: list[Any] = []
    eqns = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "random_fold_in" and isinstance(eqn.invars[1], _core.Literal):
            literal = eqn.invars[1]
            values.append(np.asarray(literal.val, dtype=getattr(literal.aval, "dtype", None)))
            inputs.append(_core.Var(literal.aval))
            eqn = eqn.replace(invars=[eqn.invars[0], inputs[-1]])
        eqns.append(eqn)
    if not values:
        return call
    changes: dict[str, Any] = {"invars": [*inputs, *jaxpr.invars], "eqns": eqns}
    info = getattr(jaxpr, "debug_info", None)
    if info is not None and getattr(info, "arg_names", None) is not None:
        changes["debug_info"] = info._replace(arg_names=(*("draw",) * len(values), *info.arg_names))
    return _with_inputs(call, jaxpr.replace(**changes), values)


def forwarded(call: BoundCall) -> tuple[BoundCall, tuple[int | None, ...]]:
    """``call`` without the outputs that are its traced inputs returned unchanged,
    and, per output of ``call``, the operand it is (``None``: one the new call
    computes).

    A layer handed a whole state that it passes on, changing its own part
    (Equinox's ``eqx.nn.State`` through each batch norm), returns every other
    layer's part unchanged: each layer's program would differ by which parts
    those are, and none would be shared. Passed on as JAX passes on a call's
    forwarded inputs: only traced values (a NumPy array or a Python number is
    made a JAX value by the call), and only where the call sets no sharding or
    layout for that output. A call that would compute nothing is kept whole."""
    closed = call.params["jaxpr"]
    jaxpr = getattr(closed, "jaxpr", closed)
    n = len(jaxpr.outvars)
    if getattr(closed, "consts", ()):
        return call, (None,) * n
    source = tuple(
        i if i is not None and isinstance(call.args[i], _core.Tracer) else None
        for i in _passed_on(jaxpr, call.params)
    )
    if all(i is None for i in source) or all(i is not None for i in source):
        return call, (None,) * n
    keep = [i is None for i in source]
    changes: dict[str, Any] = {
        "outvars": [v for v, k in zip(jaxpr.outvars, keep, strict=True) if k]
    }
    info = getattr(jaxpr, "debug_info", None)
    paths = getattr(info, "result_paths", None)
    if info is not None and isinstance(paths, tuple) and len(paths) == n:
        changes["debug_info"] = info._replace(
            result_paths=tuple(p for p, k in zip(paths, keep, strict=True) if k)
        )
    new = jaxpr.replace(**changes)
    params = dict(call.params)
    params["jaxpr"] = ClosedJaxpr(new, ()) if call.kind == "jit" else new
    for name in ("out_shardings", "out_layouts"):
        if name in params:
            params[name] = tuple(p for p, k in zip(params[name], keep, strict=True) if k)
    return BoundCall(call.kind, params, call.args), source


def _passed_on(jaxpr: Any, params: dict[str, Any], depth: int = 0) -> list[int | None]:
    """Per output of a call of ``jaxpr`` (with ``params``), the input it returns
    unchanged, or ``None``: directly, or through the inner calls that return it
    unchanged (a wrapper's ``jit`` around ``eqx.filter_jit``'s)."""
    n = len(jaxpr.outvars)
    shardings = params.get("out_shardings", (UNSPECIFIED,) * n)
    layouts = params.get("out_layouts", (None,) * n)
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    made = {o: (e, k) for e in jaxpr.eqns for k, o in enumerate(e.outvars)}
    inner: dict[int, list[int | None]] = {}

    def source(v: Any) -> int | None:
        while not isinstance(v, _core.Literal):
            if v in position:
                return position[v]
            eqn, k = made.get(v, (None, 0))
            body = call_body(eqn) if eqn is not None and depth < 4 else None
            if body is None or body[1]:
                return None
            if id(eqn) not in inner:
                inner[id(eqn)] = _passed_on(body[0], eqn.params, depth + 1)
            j = inner[id(eqn)][k]
            if j is None:
                return None
            v = eqn.invars[j]
        return None

    return [
        source(v) if s is UNSPECIFIED and layout is None else None
        for v, s, layout in zip(jaxpr.outvars, shardings, layouts, strict=True)
    ]


def pruned(call: BoundCall) -> tuple[BoundCall, tuple[bool, ...]]:
    """``call`` without the inputs its body never uses, and which inputs it keeps.

    A layer that receives more than it reads (``hk.remat`` passes the whole Haiku
    state into each layer's checkpoint) then has the inputs and the body of every
    other such layer. The call computes the same: only unused inputs go."""
    closed = call.params["jaxpr"]
    if getattr(closed, "consts", ()):
        return call, (True,) * len(call.args)
    new, keep = used_inputs(closed)
    if all(keep):
        return call, keep
    params = dict(call.params)
    # An inner jit's body is closed (its constants were hoisted into inputs); a
    # checkpoint's is open.
    params["jaxpr"] = ClosedJaxpr(new, ()) if call.kind == "jit" else new
    for name in ("in_shardings", "in_layouts", "donated_invars"):
        if name in params:
            params[name] = tuple(p for p, k in zip(params[name], keep, strict=True) if k)
    args = tuple(a for a, k in zip(call.args, keep, strict=True) if k)
    return BoundCall(call.kind, params, args), keep


def used_inputs(closed: Any) -> tuple[Any, tuple[bool, ...]]:
    """The jaxpr of ``closed`` (closed or open) without the equations its outputs
    do not need, and which of its inputs it still reads. A jaxpr JAX cannot prune
    reads them all."""
    jaxpr = getattr(closed, "jaxpr", closed)
    try:
        new, used = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=False)
    except Exception:  # a body JAX cannot prune: kept whole
        return jaxpr, (True,) * len(jaxpr.invars)
    return new, tuple(bool(u) for u in used)


def call_jaxpr(call: BoundCall) -> Any:
    """The body of ``call`` (a jaxpr, closed or not)."""
    return call.params["jaxpr"]


#: ``jax.Inline`` values (JAX 0.12 and later) of a call JAX inlines itself:
#: ``jax.numpy``'s own functions (``jax_early``) and ``jit(..., inline=True)``
#: (``jax_late``). ``auto`` (``inline=False``, the default) and the ``xla_*`` values
#: keep the call in the program.
_INLINED_BY_JAX = frozenset(["jax_early", "jax_late"])


# Where JAX's own code lives: an inner jit whose function is defined below it is
# one of JAX's helpers (``jnp.var``, ``jax.random.normal``'s ``_normal``,
# ``jax.nn`` functions), whatever its ``inline`` flag says.
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


def is_jax_helper(call: BoundCall) -> bool:
    """Whether ``call``'s function is defined in JAX's own code (``jax.numpy``,
    ``jax.nn``, ``lax``, ``jax.random``...), found by where its source lives."""
    closed = call.params.get("jaxpr")
    debug = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
    where = getattr(debug, "func_src_info", None)
    if not isinstance(where, str) or " at " not in where:
        return False
    path = where.rsplit(" at ", 1)[1].rsplit(":", 1)[0]
    return os.path.abspath(path).startswith(_JAX_DIR)


def is_plain_jit(call: BoundCall) -> bool:
    """Whether ``call`` is an inner ``jit`` that asks for nothing its body does not
    say: no input or output shardings, no donated inputs, no layouts, no compiler
    options. Inlining it
    then computes and places exactly what binding it would."""
    if call.kind != "jit":
        return False
    params = call.params
    shardings = (*params.get("in_shardings", ()), *params.get("out_shardings", ()))
    layouts = (*params.get("in_layouts", ()), *params.get("out_layouts", ()))
    return (
        all(s is UNSPECIFIED for s in shardings)
        and all(layout is None for layout in layouts)
        and not any(params.get("donated_invars", ()))
        and not params.get("compiler_options_kvs")
    )


def is_inline(call: BoundCall) -> bool:
    """Whether ``call`` is an inner ``jit`` JAX inlines anyway (``jax.numpy``'s own,
    or one made with ``inline=True``), or one of JAX's own helpers."""
    if call.kind == "jit" and is_jax_helper(call):
        return True
    inline = call.params.get("inline", False)
    if isinstance(inline, bool):  # JAX before 0.12
        return inline
    return str(getattr(inline, "value", inline)) in _INLINED_BY_JAX


def current_trace() -> Any:
    """The trace values are bound into now."""
    return _core.trace_ctx.trace


def differentiating(trace: Any) -> bool:
    """Whether ``trace`` is a JVP or linearize trace (``grad`` and its kin are
    tracing through it), not a ``vmap`` or a jaxpr being made."""
    return isinstance(trace, (_ad.JVPTrace, _ad.LinearizeTrace))


def within(trace: Any, root: Any) -> bool:
    """Whether ``trace`` is ``root`` or a transformation over it (JVP, linearize,
    vmap...): not the separate trace of an inner function, nor one jaxaot made."""
    seen = 0
    while trace is not None and seen < 64:
        if trace is root:
            return True
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return False  # a trace of its own (an inner function's, or a jaxpr being made)
        trace = getattr(trace, "parent_trace", None)
        seen += 1
    return False


@contextlib.contextmanager
def not_intercepting() -> Iterator[None]:
    """No hook during the block (jaxaot's own work while it handles a call)."""
    token = _HOOK.set(None)
    try:
        yield
    finally:
        _HOOK.reset(token)
