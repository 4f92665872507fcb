"""A few small layers are not blocks.

``jaxaot.jit`` finds the layers of a plain loop by their classes: Equinox and
Flax NNX modules by counting their instances (``_named.repeated_modules``),
linen and Haiku modules by counting their calls in a first trace
(``_scoped.counting``). Made blocks, fewer than ``_whole.MIN_LOOP`` calls of a
class whose calls do little work run as one program with the layers unrolled
(``_whole.form``): the program as ``jax.jit`` compiles it. Such a program is
compiled whole from its first trace instead, as ``jax.jit`` compiles it,
without a second trace with its layers as blocks, nor their entries, which cost
a shallow program's cold start about a third of ``jax.jit``'s time.

A program whose layers are counted before its first trace (by instances, which
an optimizer's copies of the model multiply) is traced first with their calls
counted, not as blocks, where every class has fewer instances than a loop takes
in the value that holds the fewest; it is traced again with them as blocks
where the calls turn out many or big.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .._component._cost import work
from . import _whole

__all__ = ["Seen", "counting_calls", "few_and_small", "outer_calls"]

#: A call seen: its class, and the classes of the calls around it.
Seen = tuple[type, frozenset[type]]


def outer_calls(calls: Iterable[Seen], classes: Sequence[type]) -> collections.Counter[type]:
    """How often each of ``classes`` was called outside the others' calls (a
    framework's layers inside a user's layer are parts of its calls)."""
    wanted = set(classes)
    return collections.Counter(
        cls for cls, around in calls if cls in wanted and not around & wanted
    )


def few_and_small(closed: Any, counts: collections.Counter[type]) -> str | None:
    """Why the layers counted in ``counts`` (calls per class, in the traced program
    ``closed``) are not made blocks, or ``None`` where they are: each class called
    fewer than ``_whole.MIN_LOOP`` times, and the program's work per call below
    ``_whole.WHOLE_BELOW`` (its layers' work and more: where the glue is big, the
    layers are made blocks, and ``_whole.form`` decides from their own work)."""
    if closed.jaxpr.effects or not counts:
        return None  # a program with effects runs split (``_planner._whole_form``)
    if max(counts.values()) >= _whole.MIN_LOOP:
        return None
    total = work(closed)
    if total is None or total / sum(counts.values()) >= _whole.WHOLE_BELOW:
        return None
    layers = ", ".join(f"{cls.__qualname__} x{k}" for cls, k in counts.items() if k > 1)
    if not layers:
        return "nothing to split: every layer it found is called once"
    return (
        f"its repeated layers ({layers}) are fewer than {_whole.MIN_LOOP} in a row and "
        "small: as blocks, they would run unrolled in one program"
    )


@contextlib.contextmanager
def counting_calls(classes: Sequence[type], seen: list[Seen]) -> Iterator[None]:
    """During the block, each call of ``classes`` is recorded in ``seen``, and
    otherwise runs as it would."""
    around: list[type] = []
    undo: list[Callable[[], None]] = []

    def counted(cls: type, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append((cls, frozenset(around)))
            around.append(cls)
            try:
                return original(self, *args, **kwargs)
            finally:
                around.pop()

        return call

    try:
        for cls in classes:
            previous = cls.__dict__.get("__call__")
            setattr(cls, "__call__", counted(cls, cls.__call__))  # type: ignore[operator]  # noqa: B010
            undo.append(functools.partial(_restore, cls, previous))
        yield
    finally:
        for step in reversed(undo):
            step()


def _restore(cls: type, previous: Any) -> None:
    if previous is None:
        delattr(cls, "__call__")
    else:
        setattr(cls, "__call__", previous)  # noqa: B010
