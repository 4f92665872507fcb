"""Blocks: components made from the calls a program makes, not from a decorator.

An inner ``jax.jit`` function or a ``jax.checkpoint`` region called again and
again (the layers of a model) is a component in all but name: ``jaxaot.jit``
turns each such call into a call of a :class:`Block`, whose root entry is the
call itself (one equation of the call's primitive, with its body and
parameters: a checkpoint's policy included, so the backward pass recomputes
what the policy says). Its key is a component's default key: the canonical
program, so two calls with the same body (up to their inputs and, for an inner
``jit``, its constants' values, which are passed as inputs) share every entry,
derived entries and executables included, across processes too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _stats
from .._jax import (
    BoundCall,
    Tracer,
    bind_plainly,
    call_jaxpr,
    default_platform,
    forwarded,
    hoisted,
    hoisted_draws,
    pruned,
    trace_context,
)
from .._keys._key import ComponentKey
from .._keys._program import program_parts
from .._keys._text import tree_text
from .._store._entry import Entry
from .._store._lookup import Store
from ._call import Call
from ._entries import build_entry
from ._parts import base_parts, types_text
from ._plain import devices_of
from ._rules import bind
from ._types import aval_of, is_differentiable, sds, type_of

__all__ = ["Block", "block_call", "block_name", "forget_blocks", "vjp_call"]


class Block:
    """The entries of one kind of block, by name (a :class:`~._call.EntryMaker`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._counters = _stats.Counters(parent=_stats.PROCESS)
        self.store = Store(name, self._counters, kind="block")

    def __repr__(self) -> str:
        return f"<jaxaot block {self.name}>"

    def make_entry(self, key: ComponentKey, trace: Any, name: str, lower: bool = True) -> Entry:
        entry = build_entry(key, trace(), name, self._counters, owner=self.name, lower=lower)
        return _placeless(entry)

    def cache_info(self) -> _stats.CacheInfo:
        """Counts for this block's entries in this process."""
        return self._counters.info()


def _placeless(entry: Entry) -> Entry:
    """``entry`` with its results typed as its inputs are (``type_of``): a block's
    body is a jaxpr of the user's trace, whose results a mesh with Auto axes
    types (that trace's), which its key, as every type's, leaves out. Its calls
    on another mesh, or none, would take that mesh for theirs (a later jit under
    an Explicit mesh refused them)."""
    outs = tuple(type_of(a) for a in entry.out_avals)
    if outs != entry.out_avals:
        entry.out_avals = outs
    return entry


_BLOCKS: dict[str, Block] = {}
_LOCK = threading.Lock()


def _block(name: str) -> Block:
    with _LOCK:
        block = _BLOCKS.get(name)
        if block is None:
            block = _BLOCKS[name] = Block(name)
        return block


def block_name(call: BoundCall) -> str:
    """``jit(layer)`` or ``checkpoint(layer)``: the kind and the function's name."""
    if call.kind == "jit":
        fn = str(call.params.get("name") or "function")
    else:
        debug = getattr(call.params["jaxpr"], "debug_info", None)
        fn = str(getattr(debug, "func_name", None) or "function")
    return f"{call.kind}({fn})"


#: Block calls already made in this process, by the call's body (the very jaxpr
#: object, kept alive here so that its id is not reused), its other parameters,
#: its input types and the trace context: JAX traces a function once per types,
#: so every layer of a model binds the same body, and its key is worked out once.
_MADE: dict[Any, tuple[Any, Any]] = {}
_MADE_MAX = 1024


def forget_blocks() -> None:
    """Forgets every block of this process (their entries stay in the cache)."""
    with _LOCK:
        _BLOCKS.clear()
        _MADE.clear()
        _VJP_MADE.clear()
        _LEAN.clear()
        _BY_CONTENT.clear()


def _memo_key(call: BoundCall, avals: tuple[Any, ...]) -> tuple[Any, ...] | None:
    others = tuple(sorted((k, repr(v)) for k, v in call.params.items() if k != "jaxpr"))
    try:
        key = (call.kind, id(call.params["jaxpr"]), others, avals, trace_context())
        hash(key)
    except TypeError:  # an unhashable type or context: not memoized
        return None
    return key


def block_call(
    call: BoundCall, name: str | None = None
) -> tuple[Call, tuple[Any, ...], Callable[[Sequence[Any]], list[Any]]]:
    """The component call standing for ``call`` (named ``name``, else after its
    function), the operands to bind it with (an inner ``jit``'s constants
    first; inputs the body never uses left out), and what gives ``call``'s
    outputs from that call's."""
    traced = tuple(isinstance(a, Tracer) for a in call.args)
    avals = tuple(aval_of(a) for a in call.args)
    # Made once per body (every layer of a model binds the same one): the block,
    # the operands its transformations put first, which outputs are operands
    # passed on, and which operands it reads.
    made, first, source, keep = _memoized(
        _MADE, call, (avals, traced), lambda: _transformed(call, name)
    )
    given = (*first, *call.args)
    operands = tuple(a for a, k in zip(given, keep, strict=True) if k)

    def outputs(computed: Sequence[Any]) -> list[Any]:
        it = iter(computed)
        return [next(it) if i is None else given[i] for i in source]

    return made, operands, outputs


def _transformed(call: BoundCall, name: str | None) -> tuple[Call, tuple[Any, ...], Any, Any]:
    # Keyed by what it computes: outputs that are inputs passed on unchanged are
    # taken from the inputs, and inputs its body then never reads are dropped,
    # so layers handed more than they read or change (``hk.remat``'s whole
    # state, Equinox's ``eqx.nn.State``) key alike; the numbers folded into its
    # random keys are inputs, so linen layers drawing under ``nn.remat`` key alike.
    full = hoisted_draws(hoisted(call))
    first = full.args[: len(full.args) - len(call.args)]
    lean, source = forwarded(full)
    lean, keep = pruned(lean)
    avals = tuple(aval_of(a) for a in lean.args)
    return _made(lean, avals, name or block_name(call)), first, source, keep


def _memoized(
    table: dict[Any, tuple[Any, Any]], call: BoundCall, avals: Any, make: Callable[[], Any]
) -> Any:
    """What ``make()`` gives for ``call``, made once per body, parameters, input
    types and trace context (kept in ``table``, bounded)."""
    memo = _memo_key(call, avals)
    known = table.get(memo) if memo is not None else None
    if known is not None and known[0] is call.params["jaxpr"]:
        return known[1]
    made = make()
    if memo is not None:
        with _LOCK:
            if len(table) >= _MADE_MAX:
                table.clear()
            table[memo] = (call.params["jaxpr"], made)
    return made


#: Differentiated calls already made, by their body's program (see ``_by_content``).
_BY_CONTENT: dict[Any, Any] = {}


def _by_content(call: BoundCall, avals: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """What ``make()`` gives for ``call``, made once per program its body computes:
    a function traced again for each call binds another body of the same program
    (a diffrax solve whose terms are made in the call), and differentiating it
    with ``jax.vjp`` costs several times what naming its program does. A body
    that cannot be named so (a value of an outer trace in it) is made."""
    try:
        parts = program_parts(call_jaxpr(call), "block")
    except Exception:
        return make()
    others = tuple(sorted((k, repr(v)) for k, v in call.params.items() if k != "jaxpr"))
    content = (call.kind, str(parts["program"]), repr(parts["consts"]), repr(parts["rules"]))
    key = (*content, others, avals, trace_context())
    known = _BY_CONTENT.get(key)
    if known is None:
        known = make()
        with _LOCK:
            if len(_BY_CONTENT) >= _MADE_MAX:
                _BY_CONTENT.clear()
            _BY_CONTENT[key] = known
    return known


def _made(call: BoundCall, avals: tuple[Any, ...], name: str) -> Call:
    def body(*args: Any) -> list[Any]:
        return bind_plainly(BoundCall(call.kind, call.params, args))

    return _made_of(body, avals, name, call.kind)


def _made_of(body: Callable[..., list[Any]], avals: tuple[Any, ...], name: str, kind: str) -> Call:
    """The block call of ``body`` (flat arrays to a flat list) at ``avals``."""

    def trace() -> Any:
        return jax.jit(body, keep_unused=True).trace(*[sds(a) for a in avals])

    traced = trace()
    parts = base_parts(default_platform())
    parts["component"] = f"block:{kind}"
    parts.update(program_parts(traced.jaxpr, name))
    parts.update(
        out_tree=tree_text(jax.tree_util.tree_structure(traced.out_info)),
        in_tree="",
        static=(),
        args=types_text(avals),
        transform=(),
    )
    key = ComponentKey(parts)
    block = _block(name)
    entry = _placeless(block.store.entry(key, lambda: block.make_entry(key, lambda: traced, name)))
    if entry.jaxpr is None:  # loaded from a cache: this process has the same program
        entry.jaxpr = traced.jaxpr
    return Call(block, key, entry, trace, devices_of(traced.jaxpr))


class _VjpBlocks(NamedTuple):
    """A call's forward and backward passes as two block calls (see :func:`vjp_call`)."""

    forward: Call  # the inputs to the outputs, then the residuals
    backward: Call  # the residuals and the outputs' cotangents to the inputs' cotangents
    n_out: int
    wrt: tuple[bool, ...]  # the inputs differentiated (inexact ones)
    out_wrt: tuple[bool, ...]  # the outputs that carry a cotangent


def _vjp_blocks(call: BoundCall, avals: tuple[Any, ...], name: str) -> _VjpBlocks:
    kind, params = call.kind, call.params
    wrt = tuple(is_differentiable(a.dtype) for a in avals)
    body = call_jaxpr(call)  # closed (jit) or open (checkpoint)
    out_avals = [v.aval for v in getattr(body, "jaxpr", body).outvars]
    out_wrt = tuple(is_differentiable(a.dtype) for a in out_avals)
    # The residuals' structure: the vjp function's, as the forward trace made it.
    made: dict[str, Any] = {}

    def forward(*args: Any) -> list[Any]:
        def differentiated(*inexact: Any) -> list[Any]:
            it = iter(inexact)
            full = [next(it) if d else a for a, d in zip(args, wrt, strict=True)]
            return bind_plainly(BoundCall(kind, params, tuple(full)))

        outs, vjp = jax.vjp(differentiated, *[a for a, d in zip(args, wrt, strict=True) if d])
        residuals, made["tree"] = jax.tree_util.tree_flatten(vjp)
        return [*outs, *residuals]

    fwd = _made_of(forward, avals, f"{name} forward", kind)
    tree = made["tree"]
    n_res = tree.num_leaves
    res_avals = tuple(v.aval for v in fwd.entry.jaxpr.jaxpr.outvars[len(out_avals) :])

    def backward(*flat: Any) -> list[Any]:
        vjp = jax.tree_util.tree_unflatten(tree, flat[:n_res])
        it = iter(flat[n_res:])
        cts = [
            next(it) if d else np.zeros(a.shape, jax.dtypes.float0)
            for a, d in zip(out_avals, out_wrt, strict=True)
        ]
        return list(vjp(cts))

    ct_avals = tuple(a for a, d in zip(out_avals, out_wrt, strict=True) if d)
    bwd = _made_of(backward, (*res_avals, *ct_avals), f"{name} backward", kind)
    return _VjpBlocks(fwd, bwd, len(out_avals), wrt, out_wrt)


_VJP_MADE: dict[Any, tuple[Any, Any]] = {}
#: Calls without the inputs their bodies never read, by body (see ``_lean``).
_LEAN: dict[Any, tuple[Any, Any]] = {}


def _lean(call: BoundCall) -> BoundCall:
    """``pruned(hoisted(call))``, its body made once per body: every layer binding
    one body then binds one lean body too, and finds its blocks made (by
    identity) rather than naming the lean body's program again, which for a
    body of many custom rules (a diffrax solve) costs more than the rest of a
    warm start."""

    def make() -> tuple[Any, tuple[Any, ...], tuple[bool, ...]]:
        full = hoisted(call)
        lean, keep = pruned(full)
        return lean.params, tuple(full.args[: len(full.args) - len(call.args)]), keep

    avals = tuple(aval_of(a) for a in call.args)
    params, first, keep = _memoized(_LEAN, call, avals, make)
    args = tuple(a for a, k in zip((*first, *call.args), keep, strict=True) if k)
    return BoundCall(call.kind, params, args)


def vjp_call(call: BoundCall, name: str | None = None) -> list[Any]:
    """Binds ``call`` under ``grad`` as a custom VJP whose forward and backward
    passes are two blocks, and returns its outputs.

    A call holding ``custom_vjp`` rules (diffrax's adjoints, optimistix, lineax)
    cannot be differentiated from its jaxpr outside the trace that made the
    rules. So the whole call is differentiated here, once per body and types,
    with ``jax.vjp``: the forward block returns the outputs and the residuals
    (the leaves of the vjp function), the backward block takes them back with
    the cotangents. Each is keyed by its own traced program, as any block is;
    inputs its body never reads are left out first, as ``block_call`` leaves
    them out (a Haiku layer is handed the whole state; it gets no cotangent)."""
    call = _lean(call)
    avals = tuple(aval_of(a) for a in call.args)
    blocks: _VjpBlocks = _memoized(
        _VJP_MADE,
        call,
        avals,
        lambda: _by_content(
            call, avals, lambda: _vjp_blocks(call, avals, name or block_name(call))
        ),
    )
    kind, params = call.kind, call.params

    @jax.custom_vjp
    def run(*args: Any) -> list[Any]:
        return bind_plainly(BoundCall(kind, params, args))

    def run_fwd(*args: Any) -> tuple[list[Any], list[Any]]:
        outs = bind(blocks.forward, args)
        return outs[: blocks.n_out], outs[blocks.n_out :]

    def run_bwd(residuals: list[Any], cts: list[Any]) -> tuple[Any, ...]:
        given = [c for c, d in zip(cts, blocks.out_wrt, strict=True) if d]
        got = iter(bind(blocks.backward, (*residuals, *given)))
        return tuple(next(got) if d else None for d in blocks.wrt)

    run.defvjp(run_fwd, run_bwd)
    return list(run(*call.args))
