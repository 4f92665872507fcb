"""Regional compilation of unmodified models: the blocks ``jaxaot.jit`` finds itself.

Large-model code already marks its repeated blocks, not for jaxaot: each layer
an inner ``jax.jit`` function, or a ``jax.checkpoint`` region (Flax
``nnx.remat``/``nn.remat``, Equinox ``filter_checkpoint``). While ``jaxaot.jit``
traces a program, :class:`BlockFinder` sees each such call as it is bound (in
the program's own trace, or a JVP, linearize or vmap trace over it; not inside
another inner function's trace), before autodiff inlines a checkpoint's
forward pass, and binds a block component (``_component._blocks``) in its
place. Autodiff then derives the block's forward, linear and transposed
entries as it does for an annotated component.

What is a block: a call that is not one of JAX's own inlined helpers, whose
body holds a matrix product or convolution or at least ``MIN_EQUATIONS``
equations, and no component call (a call holding components is inlined, and
its components are regions). After the trace, a block whose entry the program calls only once
is inlined back into its glue (:meth:`BlockFinder.once`): only repeated blocks
become regions.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._component._blocks import Block, block_call, block_name
from .._component._rules import bind, component_p
from .._jax import (
    CALL_PRIMITIVES,
    BoundCall,
    call_body,
    call_jaxpr,
    current_trace,
    evaluate,
    intercepting,
    is_inline,
    is_plain_jit,
    not_intercepting,
    uses_primitive,
    walk_jaxprs,
    within,
)

__all__ = ["MIN_EQUATIONS", "BlockFinder", "finding", "program_entered"]

logger = logging.getLogger("jaxaot")

#: A call body without a matrix product or convolution is a block only from this
#: many equations (nested ones included) on.
MIN_EQUATIONS = 16
_HEAVY = frozenset(["dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"])
_CUSTOM_VJP = ("custom_vjp_call", "custom_vjp_call_jaxpr")

_FINDER: contextvars.ContextVar[BlockFinder | None] = contextvars.ContextVar(
    "jaxaot_block_finder", default=None
)


def _worth_a_block(call: BoundCall) -> bool:
    if is_inline(call):
        return False
    count, heavy = 0, False
    for jaxpr in walk_jaxprs(call_jaxpr(call)):
        for eqn in jaxpr.eqns:
            if eqn.primitive is component_p:
                return False  # its components are regions already: it is inlined
            heavy = heavy or eqn.primitive.name in _HEAVY
            count += 1
    return heavy or count >= MIN_EQUATIONS


def _repeats_inside(call: BoundCall) -> bool:
    """Whether ``call``'s body calls one inner function (jit or checkpoint, the
    same body on the same types) two or more times, at its top level: then it
    wraps the repeated layers rather than being one of them."""
    seen: set[tuple[str, str]] = set()
    for eqn in call_jaxpr(call).jaxpr.eqns:
        body = call_body(eqn)
        if body is None:
            continue
        kind = "jit" if eqn.primitive.name in ("jit", "pjit") else "checkpoint"
        if not _worth_a_block(BoundCall(kind, eqn.params, ())):
            continue  # JAX's helpers and small functions are not layers
        text = (eqn.primitive.name, str(body[0]))
        if text in seen:
            return True
        seen.add(text)
    return False


class BlockFinder:
    """The blocks of one trace of a program: turns calls into block calls, and
    counts how often each entry is called."""

    def __init__(self) -> None:
        self.root: Any = None  # the program's own trace, once it runs

    def entered(self) -> None:
        """The program's function starts running: its trace is the root."""
        if self.root is None:
            self.root = current_trace()

    def hook(self, call: BoundCall) -> Sequence[Any] | None:
        if self.root is None or not within(current_trace(), self.root):
            return None  # inside another inner function's own trace
        if is_plain_jit(call) and _repeats_inside(call):
            # An outer jit around the model (gemma's and linen's ``nn.jit``, a
            # ``jax.jit`` of the loss): looked through, as if it were not there,
            # so that the layers it repeats are found as blocks.
            closed = call_jaxpr(call)
            return evaluate(closed.jaxpr, closed.consts, call.args)
        if not _worth_a_block(call):
            return None
        if current_trace() is not self.root and uses_primitive(call_jaxpr(call), _CUSTOM_VJP):
            # Under a transformation (grad), a custom_vjp rule traced by the
            # program (diffrax's adjoints, optimistix, lineax) cannot be
            # transposed again outside the trace that made it: kept in its glue.
            logger.debug(
                "jaxaot.jit: %s is not a block (a custom_vjp rule under a transformation)",
                block_name(call),
            )
            return None
        with not_intercepting():  # jaxaot's own tracing below binds calls too
            block, operands = block_call(call)
            return bind(block, operands)

    @staticmethod
    def counts(jaxpr: Any) -> collections.Counter[Any]:
        """How often each block entry is called at ``jaxpr``'s top level (calls
        inlined into it included), by its call (equal calls have equal keys)."""
        found: collections.Counter[Any] = collections.Counter()
        stack = [jaxpr]
        while stack:
            j = stack.pop()
            for eqn in j.eqns:
                if eqn.primitive is component_p and isinstance(eqn.params["call"].component, Block):
                    found[eqn.params["call"]] += 1
                elif eqn.primitive.name in CALL_PRIMITIVES:
                    body = call_body(eqn)
                    if body is not None:
                        stack.append(body[0])
        return found

    @staticmethod
    def once(counts: collections.Counter[Any]) -> Callable[[Any], bool]:
        """Whether a component equation is a block called only once (to inline)."""

        def test(eqn: Any) -> bool:
            call = eqn.params["call"]
            return isinstance(call.component, Block) and counts[call] < 2

        return test


@contextlib.contextmanager
def finding(finder: BlockFinder | None) -> Iterator[None]:
    """Finds blocks with ``finder`` during the block (``None``: finds none)."""
    if finder is None:
        yield
        return
    token = _FINDER.set(finder)
    try:
        with intercepting(finder.hook):
            yield
    finally:
        _FINDER.reset(token)


def program_entered() -> None:
    """Called as a program's function starts running under ``jaxaot.jit``'s trace."""
    finder = _FINDER.get()
    if finder is not None:
        finder.entered()
