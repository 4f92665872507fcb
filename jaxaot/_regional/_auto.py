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

import jax

from .._component._blocks import Block, block_call, block_name, vjp_call
from .._component._rules import bind, component_p
from .._jax import (
    CALL_PRIMITIVES,
    CUSTOM_VJP_PRIMITIVES,
    BoundCall,
    bind_plainly,
    call_body,
    call_jaxpr,
    current_trace,
    differentiating,
    evaluate,
    intercepting,
    is_inline,
    is_plain_jit,
    not_intercepting,
    uses_primitive,
    walk_jaxprs,
    within,
)
from .._keys._closure import ClosureError
from .._stats import set_during

__all__ = [
    "MIN_EQUATIONS",
    "BlockFinder",
    "StaleTrace",
    "finding",
    "module_ended",
    "note",
    "program_entered",
]

logger = logging.getLogger("jaxaot")

#: A call body without a matrix product or convolution is a block only from this
#: many equations (nested ones included) on.
MIN_EQUATIONS = 16
_HEAVY = frozenset(["dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"])
#: The name linen's lifted transforms (``nn.remat``, ``nn.jit``) give the function they transform.
_LINEN_LIFTED = "core_fn"

_FINDER: contextvars.ContextVar[BlockFinder | None] = contextvars.ContextVar(
    "jaxaot_block_finder", default=None
)


#: The linen module each lifted body was traced for, by the body's jaxpr (kept
#: alive here, so that its id is not reused): an outer jit looked through binds
#: them again after the model ended, and ``nn.jit`` gives a body it traced for
#: one program back to the next, without running the module's call again.
_LIFTED: dict[int, tuple[Any, str]] = {}
_LIFTED_MAX = 1024


#: Why a call is not a block, by kind (``explain`` gives these).
HELPER = "JAX's own helpers (jax.numpy, lax, jax.nn, jax.random): never blocks"
HOLDS_COMPONENTS = "holds components (inlined: its components are regions)"
CUSTOM_VJP = "a custom_vjp rule under vmap (kept in its glue)"
LOOKED_THROUGH = "looked through (it wraps repeated layers)"
CLOSES_OVER = "holds a value of the program's own trace (kept in its glue)"
CUSTOM_VJP_FAILED = (
    "a custom_vjp rule under grad that could not be differentiated alone (kept in its glue)"
)


#: Why the custom_vjp rules of a call could not be differentiated alone, by the
#: call (see :func:`_rules_of`). A failed attempt can leave JAX's traces of the
#: rules unusable (diffrax's checkpointed loops: a rule's store is never filled,
#: and every later trace, ``jax.jit``'s too, fails), so JAX's caches are cleared
#: (its in-memory executables go with them) and the program is traced again
#: without trying them (``_tracing.trace``).
_UNDIFFERENTIABLE: dict[tuple[Any, ...], str] = {}
_UNDIFFERENTIABLE_MAX = 1024


def _rules_of(call: BoundCall, name: str) -> tuple[Any, ...]:
    """A call holding custom_vjp rules, as the next trace binds it again: its
    name, the function's source and its operand types."""
    closed = call_jaxpr(call)
    info = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
    types = tuple(str(getattr(a, "aval", type(a).__name__)) for a in call.args)
    return (name, getattr(info, "func_src_info", None), types)


class StaleTrace(Exception):
    """A rule failed to differentiate alone: the program is traced afresh."""


def _why_not(call: BoundCall) -> str | None:
    """Why ``call`` is not worth a block, or ``None`` where it is."""
    if is_inline(call):
        return HELPER
    count, heavy = 0, False
    for jaxpr in walk_jaxprs(call_jaxpr(call)):
        for eqn in jaxpr.eqns:
            if eqn.primitive is component_p:
                return HOLDS_COMPONENTS
            heavy = heavy or eqn.primitive.name in _HEAVY
            count += 1
    if heavy or count >= MIN_EQUATIONS:
        return None
    return f"small: {count} equations, no matrix product or convolution"


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
        if _why_not(BoundCall(kind, eqn.params, ())) is not None:
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
        # Why the calls of the program's own trace that are not blocks are not,
        # by the call's name (as ``explain`` tells it).
        self.notes: dict[str, str] = {}
        # The linen module whose call ended last (a lifted transform's block is
        # named after it, not after linen's ``core_fn``).
        self.last_module: str | None = None
        # Whether a linen module method's latest call called repeated layers
        # (``_scoped.Calls.wraps_layers``), where its calls are counted.
        self.wraps_layers: Callable[[str], bool] | None = None
        # The calls kept in their glue under vmap for their custom_vjp rules: their
        # backward passes, bound by grad's transpose, are kept there too.
        self.under_vmap: set[str] = set()

    def note(self, call: BoundCall | str, why: str) -> None:
        """Records why ``call`` (or the call named so) is not a block. JAX's own
        helpers are not recorded: they are never blocks, and whether JAX binds
        them or inlines them from its trace caches differs from trace to trace."""
        if why == HELPER:
            return
        name = call if isinstance(call, str) else self._name(call) or block_name(call)
        if name not in self.notes:
            self.notes[name] = why
            logger.debug("jaxaot.jit: %s is not a block (%s)", name, why)

    def entered(self) -> None:
        """The program's function starts running: its trace is the root."""
        if self.root is None:
            self.root = current_trace()

    def hook(self, call: BoundCall) -> Sequence[Any] | None:
        if self.last_module and block_name(call) == f"{call.kind}({_LINEN_LIFTED})":
            body = call_jaxpr(call)
            if len(_LIFTED) >= _LIFTED_MAX:
                _LIFTED.clear()
            _LIFTED.setdefault(id(body), (body, self.last_module))
        if self.root is None or not within(current_trace(), self.root):
            return None  # inside another inner function's own trace
        if is_plain_jit(call) and (_repeats_inside(call) or self._lifts_layers(call)):
            # An outer jit around the model (gemma's and linen's ``nn.jit``, a
            # ``jax.jit`` of the loss): looked through, as if it were not there,
            # so that the layers it repeats are found as blocks (or, a few small
            # ones, stay in the program compiled whole: as a block called once,
            # it would be made, then inlined again).
            self.note(call, LOOKED_THROUGH)
            closed = call_jaxpr(call)
            return evaluate(closed.jaxpr, closed.consts, call.args)
        if (self._name(call) or block_name(call)) in self.under_vmap:
            self.note(call, CUSTOM_VJP)  # (a backward pass: a block called once at best)
            return None
        why = _why_not(call)
        rules = why is None and uses_primitive(call_jaxpr(call), CUSTOM_VJP_PRIMITIVES)
        held = _rules_of(call, self._name(call) or block_name(call)) if rules else ()
        if held in _UNDIFFERENTIABLE:  # nor a block where the program binds it itself
            self.note(call, f"{CUSTOM_VJP_FAILED} ({_UNDIFFERENTIABLE[held]})")
            return None
        if rules and current_trace() is not self.root:
            # A custom_vjp rule traced by the program (diffrax's adjoints,
            # optimistix, lineax) cannot be differentiated again outside the
            # trace that made it: under grad, the call is differentiated whole,
            # its forward and backward passes two blocks; under other
            # transformations (vmap), kept in its glue.
            if not differentiating(current_trace()):
                self.note(call, CUSTOM_VJP)
                if not uses_primitive(call_jaxpr(call), ("while",)):
                    return None  # (under a grad around the vmap, its batched form may be)
                # A solve (diffrax, optimistix: rules around a while loop): bound here,
                # unseen, as are its batched form (under a grad around the vmap) and
                # its backward pass. Their batched rules cannot be differentiated
                # outside this trace, and trying costs a trace of the whole program.
                self.under_vmap.add(self._name(call) or block_name(call))
                return bind_plainly(call)
            try:
                with not_intercepting():
                    return vjp_call(call, self._name(call))
            except Exception as e:  # its rules cannot be differentiated alone: kept in glue
                if len(_UNDIFFERENTIABLE) >= _UNDIFFERENTIABLE_MAX:
                    _UNDIFFERENTIABLE.clear()
                _UNDIFFERENTIABLE[held] = f"{type(e).__name__}: {e}"
                jax.clear_caches()
                raise StaleTrace(held[0]) from e
        if why is not None:
            self.note(call, why)
            return None
        try:
            with not_intercepting():  # jaxaot's own tracing below binds calls too
                block, operands, outputs = block_call(call, self._name(call))
        except ClosureError:  # a value of the program's trace inside it: not a block
            self.note(call, CLOSES_OVER)
            return None
        with not_intercepting():
            return outputs(bind(block, operands))

    def _lifts_layers(self, call: BoundCall) -> bool:
        """Whether ``call`` lifts a linen module (``nn.jit`` of the class, or of its
        ``__call__`` as gemma's ``Transformer``) whose call, just traced (the
        last to end), called repeated layers."""
        if self.wraps_layers is None:
            return False
        known = _LIFTED.get(id(call_jaxpr(call)))
        if known is not None:
            return self.wraps_layers(known[1])
        last = self.last_module
        if last is None or block_name(call) != f"{call.kind}(__call__)":
            return False
        return self.wraps_layers(last)

    def _name(self, call: BoundCall) -> str | None:
        # A linen-lifted call (``nn.remat``, ``nn.jit``) is named after the module
        # whose call ended just before it was first bound: the module it lifts.
        known = _LIFTED.get(id(call_jaxpr(call)))
        return None if known is None else f"{call.kind}({known[1]})"

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
    with set_during(_FINDER, finder), intercepting(finder.hook):
        yield


def note(name: str, why: str) -> None:
    """Tells the block finder of this trace (if any) why ``name`` is not a block."""
    finder = _FINDER.get()
    if finder is not None:
        finder.note(name, why)


def module_ended(name: str) -> None:
    """Tells the block finder of this trace (if any) that a call of the linen
    module method ``name`` ended."""
    finder = _FINDER.get()
    if finder is not None:
        finder.last_module = name


def program_entered() -> None:
    """Called as a program's function starts running under ``jaxaot.jit``'s trace."""
    finder = _FINDER.get()
    if finder is not None:
        finder.entered()
