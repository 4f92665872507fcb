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
from typing import Any

import jax

from .. import _stats
from .._jax import BoundCall, bind_plainly, default_platform, hoisted, pruned, trace_context
from .._keys._key import ComponentKey
from .._keys._program import program_parts
from .._keys._text import tree_text
from .._store._entry import Entry
from .._store._lookup import Store
from ._call import Call
from ._entries import build_entry
from ._parts import base_parts, types_text
from ._plain import devices_of
from ._types import aval_of, sds

__all__ = ["Block", "block_call", "block_name", "forget_blocks"]


class Block:
    """The entries of one kind of block, by name (a :class:`~._call.EntryMaker`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._counters = _stats.Counters(parent=_stats.PROCESS)
        self.store = Store(name, self._counters)

    def __repr__(self) -> str:
        return f"<jaxaot block {self.name}>"

    def make_entry(self, key: ComponentKey, trace: Any, name: str, lower: bool = True) -> Entry:
        return build_entry(key, trace(), name, self._counters, owner=self.name, lower=lower)

    def cache_info(self) -> _stats.CacheInfo:
        """Counts for this block's entries in this process."""
        return self._counters.info()


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
_MADE: dict[tuple[Any, ...], tuple[Any, Call]] = {}
_MADE_MAX = 1024


def forget_blocks() -> None:
    """Forgets every block of this process (their entries stay in the cache)."""
    with _LOCK:
        _BLOCKS.clear()
        _MADE.clear()


def _memo_key(call: BoundCall, avals: tuple[Any, ...]) -> tuple[Any, ...] | None:
    others = tuple(sorted((k, repr(v)) for k, v in call.params.items() if k != "jaxpr"))
    try:
        key = (call.kind, id(call.params["jaxpr"]), others, avals, trace_context())
        hash(key)
    except TypeError:  # an unhashable type or context: not memoized
        return None
    return key


def block_call(call: BoundCall, name: str | None = None) -> tuple[Call, tuple[Any, ...]]:
    """The component call standing for ``call`` (named ``name``, else after its
    function), and the operands to bind it with (an inner ``jit``'s constants
    first; inputs the body never uses left out)."""
    # Keyed by what it uses: inputs its body never reads are dropped, so layers
    # handed more than they read (``hk.remat``'s whole state) key alike.
    call, _ = pruned(hoisted(call))
    avals = tuple(aval_of(a) for a in call.args)
    memo = _memo_key(call, avals)
    made = _MADE.get(memo) if memo is not None else None
    if made is not None and made[0] is call.params["jaxpr"]:
        return made[1], call.args
    made_call = _made(call, avals, name or block_name(call))
    if memo is not None:
        with _LOCK:
            if len(_MADE) >= _MADE_MAX:
                _MADE.clear()
            _MADE[memo] = (call.params["jaxpr"], made_call)
    return made_call, call.args


def _made(call: BoundCall, avals: tuple[Any, ...], name: str) -> Call:

    def trace() -> Any:
        def body(*args: Any) -> list[Any]:
            return bind_plainly(BoundCall(call.kind, call.params, args))

        return jax.jit(body, keep_unused=True).trace(*[sds(a) for a in avals])

    traced = trace()
    parts = base_parts(default_platform())
    parts["component"] = f"block:{call.kind}"
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
    entry = block.store.entry(key, lambda: block.make_entry(key, lambda: traced, name))
    if entry.jaxpr is None:  # loaded from a cache: this process has the same program
        entry.jaxpr = traced.jaxpr
    return Call(block, key, entry, trace, devices_of(traced.jaxpr))
