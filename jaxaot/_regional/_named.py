"""Blocks the user names: ``jaxaot.jit(step, blocks=(...))``.

Code without any boundary (a plain Python loop of layers) marks no block. The
functions and module classes named in ``blocks`` get one while ``jaxaot.jit``
traces the program: each of their calls becomes an inner ``jit`` call (its
arrays passed as arguments, everything else fixed by the call), which the
block finder (``_auto``) turns into a block like any other.

* A module class: its ``__call__`` for the trace. Flax linen modules go
  through ``nn.jit`` (their variables lifted as linen lifts them), Flax NNX
  modules through ``nnx.jit`` (state they update is written back), other
  classes (Equinox modules, any pytree) through a jit of the call with the
  module's arrays as arguments.
* A function: found where the program names it: a global of the function's
  own module or of the program's, or a free variable of the program.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from .._jax import Tracer

__all__ = ["check_blocks", "named_blocks"]


def check_blocks(blocks: Any) -> tuple[Any, ...]:
    """``blocks`` as a tuple of functions and classes.

    Raises:
      TypeError: an item is neither (naming it).
    """
    items = tuple(blocks) if isinstance(blocks, list | tuple) else (blocks,)
    for item in items:
        if not (isinstance(item, type) or isinstance(item, types.FunctionType)):
            raise TypeError(
                f"jaxaot.jit: blocks must be functions or module classes, got "
                f"{type(item).__name__}: {item!r:.60}"
            )
    return items


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | Tracer)


def _jitted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called through ``jax.jit``: its array leaves are the jit's arguments,
    every other leaf is fixed by the call (part of the program)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def body(*arrays: Any) -> Any:
            full = list(leaves)
            for i, a in zip(dynamic, arrays, strict=True):
                full[i] = a
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            return fn(*a, **k)

        # Named as the user knows it (``Layer.__call__``): the block is named after it.
        body.__name__ = body.__qualname__ = getattr(fn, "__qualname__", "block")
        return jax.jit(body)(*[leaves[i] for i in dynamic])

    return call


def _framework(cls: type) -> str:
    modules = {getattr(c, "__module__", "") for c in cls.__mro__}
    if any(m.startswith("flax.linen") for m in modules):
        return "linen"
    if any(m.startswith("flax.nnx") for m in modules):
        return "nnx"
    return "pytree"


def _class_call(cls: type) -> Callable[..., Any]:
    """The ``__call__`` ``cls`` has during the trace (see the module docstring)."""
    original = cls.__call__  # type: ignore[operator]
    kind = _framework(cls)
    if kind == "linen":
        import flax.linen as nn

        return nn.jit(cls).__call__  # type: ignore[no-any-return]
    if kind == "nnx":
        from flax import nnx

        jitted = nnx.jit(original)

        @functools.wraps(original)
        def nnx_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return jitted(self, *args, **kwargs)

        return nnx_call
    return _jitted(original)


@contextlib.contextmanager
def named_blocks(blocks: Sequence[Any], program: Callable[..., Any]) -> Iterator[None]:
    """During the block, calls of ``blocks`` (classes and functions) are inner jit
    calls, where ``program`` (the traced function) can reach them."""
    undo: list[Callable[[], None]] = []
    try:
        for block in blocks:
            if isinstance(block, type):
                previous = block.__dict__.get("__call__")
                setattr(block, "__call__", _class_call(block))  # noqa: B010
                undo.append(functools.partial(_restore_attr, block, "__call__", previous))
            else:
                undo.extend(_rebind(block, _jitted(block), program))
        yield
    finally:
        for step in reversed(undo):
            step()


def _restore_attr(obj: Any, name: str, previous: Any) -> None:
    if previous is None:
        delattr(obj, name)
    else:
        setattr(obj, name, previous)


def _rebind(fn: Any, wrapped: Any, program: Any) -> list[Callable[[], None]]:
    """Binds ``wrapped`` wherever ``program`` finds ``fn`` by name: the globals of
    ``fn``'s module and of ``program``'s, and ``program``'s free variables."""
    undo: list[Callable[[], None]] = []
    namespaces = [getattr(fn, "__globals__", None)]
    target = getattr(program, "__wrapped__", program)
    namespaces.append(getattr(target, "__globals__", None))
    seen: set[int] = set()
    for namespace in namespaces:
        if namespace is None or id(namespace) in seen:
            continue
        seen.add(id(namespace))
        for name, value in list(namespace.items()):
            if value is fn:
                namespace[name] = wrapped
                undo.append(functools.partial(namespace.__setitem__, name, fn))
    for cell in getattr(target, "__closure__", None) or ():
        try:
            if cell.cell_contents is fn:
                cell.cell_contents = wrapped
                undo.append(functools.partial(setattr, cell, "cell_contents", fn))
        except ValueError:  # an empty cell
            continue
    return undo
