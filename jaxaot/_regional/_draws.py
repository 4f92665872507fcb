"""Random draws of a Flax linen layer run as a block.

A linen layer's draws (``self.make_rng("dropout")``) fold its place in the
model (its scope's path) and a counter into the stream's key. Applied unbound,
from a scope of its own, the layer would draw other numbers; with its place in
its program as a constant, every layer's program would differ and none would be
shared. So the key of each draw is made where the layer is called, by Flax's own
folding, and passed into the block as an input: every layer runs one program,
and draws exactly the numbers it draws inline (as under ``jax.jit``).

The layer is traced twice:

* :func:`drawn_call` first traces it to record the draws it makes: the stream,
  the scope path below the layer and the counter of each. A recorded draw is
  answered with a stand-in key. The stream keys the layer is given must then be
  unread: a key Flax made some other way (a lifted ``nn.jit`` inside the layer)
  reads them, and the layer stays inline.
* It then applies the layer as a block, answering each draw with its key, in
  the recorded order, and checking that each is the draw recorded. The draws
  count in the layer's own scope counters, as they would inline, so a later draw
  in the model is the one it would be.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax

from .._jax import not_intercepting, used_inputs
from .._stats import set_during
from ._named import array_body, jitted_call

__all__ = ["Refused", "drawn_call"]

#: The first element of the path of a block's stream keys: it marks the draws
#: :func:`drawn_call` answers. The same in every layer, so every layer traces
#: the same program.
_MARK = "jaxaot:block"

#: Answers the draws of the layer being traced (see :func:`_install`): given the
#: stream, the draw's path and counter, and the key the stream holds there.
_ANSWER: contextvars.ContextVar[Callable[[str, tuple[Any, ...], Any], Any] | None] = (
    contextvars.ContextVar("jaxaot_linen_draws", default=None)
)
_PATCH = threading.Lock()


class Refused(Exception):
    """The layer's draws cannot be made outside it: it stays inline (the reason
    is the message)."""


class _Diverged(Exception):
    """The second trace drew other numbers than the first."""


def _install() -> Any:
    """Flax's ``LazyRng`` once ``Scope.make_rng`` also tells :data:`_ANSWER` of
    each draw on a block's stream (``None`` for a Flax without them)."""
    scope_module = sys.modules.get("flax.core.scope")
    scope_class = getattr(scope_module, "Scope", None)
    lazy = getattr(scope_module, "LazyRng", None)
    with _PATCH:
        if scope_class is None or lazy is None:
            return None
        if getattr(scope_class, "_jaxaot_draws", False):
            return lazy
        original = scope_class.__dict__.get("make_rng")
        if not callable(original):
            return None

        @functools.wraps(original)
        def make_rng(self: Any, name: str = "params") -> Any:
            key = original(self, name)  # Flax's checks, its fallback and its counting
            answer = _ANSWER.get()
            if answer is None:
                return key
            stream = name if self.has_rng(name) else "params"
            lazy = self.rngs.get(stream)
            path = tuple(getattr(lazy, "suffix", ()))
            if path[:1] != (_MARK,):
                return key
            return answer(
                stream, (*path[1:], self.rng_counters[stream]), getattr(lazy, "rng", None)
            )

        scope_class.make_rng = make_rng
        scope_class._jaxaot_draws = True
        return lazy


def _applied(
    lazy: Any, unbound: Any, counters: dict[Any, Any], answer: Callable[..., Any]
) -> Callable[..., Any]:
    """The layer applied to its variables, with stream keys marked as a block's
    (``lazy``: Flax's ``LazyRng``), counting its draws in ``counters`` and
    answering them with ``answer``."""

    def body(variables: Any, roots: dict[str, Any], keys: Any, args: Any, kwargs: Any) -> Any:
        rngs = {name: lazy(root, (_MARK,)) for name, root in roots.items()}

        drawn = [0]

        def run(bound: Any) -> Any:
            bound.scope.rng_counters = counters
            setup = getattr(bound, "_try_setup", None)
            if setup is not None:
                # Flax ran the layer's setup in its scope before this call: its
                # draws there are made, and the clone's setup would draw again.
                setup()
                if drawn[0]:
                    raise Refused("it draws random numbers in setup")
            return bound(*args, **kwargs)

        def checked(stream: str, path: tuple[Any, ...], held: Any) -> Any:
            # A stream a lifted transform split inside the layer (nn.vmap or nn.scan
            # with split_rngs) holds another key there: its draws are not the ones
            # made outside.
            if held is not roots.get(stream):
                raise Refused("a random stream is split or carried inside it")
            drawn[0] += 1
            return answer(keys, stream, path)

        with set_during(_ANSWER, checked):
            return unbound.apply(variables, rngs=rngs, method=run)

    return body


def drawn_call(
    module: Any, args: Any, kwargs: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Any:
    """``module(*args, **kwargs)``, a linen layer in a scope with random streams,
    as a block (``wrap`` makes the block's body what it is for other layers).
    Raises :class:`Refused` where it cannot, before anything is bound."""
    lazy = _install()
    if lazy is None:
        raise Refused("this Flax's random streams cannot be moved into a block")
    if _holds_foreign(module):
        raise Refused("it holds a module of another scope, which draws there")
    scope = module.scope
    outer = dict(scope.rngs)
    roots = {name: stream.rng for name, stream in outer.items()}
    unbound, variables = module.unbind()

    recorded: list[tuple[str, tuple[Any, ...]]] = []

    def record(standins: dict[str, Any], stream: str, path: tuple[Any, ...]) -> Any:
        recorded.append((stream, path))
        return standins[stream]

    first = _applied(lazy, unbound, _copied(scope.rng_counters), record)
    fn, arrays = array_body(wrap(first), (variables, roots, dict(roots), args, kwargs), {})
    try:
        with not_intercepting():
            closed = jax.make_jaxpr(fn)(*arrays)
    except Refused:
        raise
    except Exception as error:  # the inline call gives the user the error, if any
        raise Refused(f"its trace with moved draws failed ({type(error).__name__})") from None
    start = len(array_body(first, (variables,), {})[1])  # the roots follow its arrays
    if any(used_inputs(closed)[1][start : start + len(roots)]):
        raise Refused("it makes random keys other than by make_rng")

    keys = [lazy.create(outer[stream], *path).as_jax_rng() for stream, path in recorded]
    done: list[tuple[str, tuple[Any, ...]]] = []

    def replay(keys: list[Any], stream: str, path: tuple[Any, ...]) -> Any:
        if len(done) == len(recorded) or recorded[len(done)] != (stream, path):
            raise _Diverged
        done.append((stream, path))
        return keys[len(done) - 1]

    counted = _copied(scope.rng_counters)
    second = _applied(lazy, unbound, counted, replay)

    def block(*arguments: Any) -> Any:
        out = second(*arguments)
        if len(done) != len(recorded):
            raise _Diverged
        return out

    try:
        out = jitted_call(wrap(block))(variables, roots, keys, args, kwargs)
    except _Diverged:  # nothing was bound, nor counted
        raise Refused("its draws differ from one trace to the next") from None
    _assign(scope.rng_counters, counted)
    return out


def _holds_foreign(module: Any) -> bool:
    """Whether a field of ``module`` holds a linen module bound in a scope outside
    its own (a ``Dropout`` its parent made and handed it): that module draws at
    its own place, which the layer's unbound apply would move."""
    linen_module = getattr(sys.modules.get("flax.linen"), "Module", None)
    if linen_module is None:
        return False
    own = tuple(module.scope.path)
    for field in dataclasses.fields(module):
        if field.name in ("parent", "name"):
            continue
        value = getattr(module, field.name, None)
        for leaf in jax.tree_util.tree_leaves(value, is_leaf=lambda x: isinstance(x, linen_module)):
            scope = getattr(leaf, "scope", None) if isinstance(leaf, linen_module) else None
            if scope is not None and tuple(scope.path)[: len(own)] != own:
                return True
    return False


def _copied(counters: dict[Any, Any]) -> dict[Any, Any]:
    """A scope's draw counters (nested for its children), copied. The keys stay:
    Flax finds a child's counters by a sentinel object in its key."""
    return {k: _copied(v) if isinstance(v, dict) else v for k, v in counters.items()}


def _assign(counters: dict[Any, Any], counted: dict[Any, Any]) -> None:
    """``counters`` made equal to ``counted`` in place: the scopes of children
    already made hold their own dicts within it."""
    for k, v in counted.items():
        if isinstance(v, dict) and isinstance(counters.get(k), dict):
            _assign(counters[k], v)
        else:
            counters[k] = v
