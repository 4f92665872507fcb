"""A few small layers are not blocks.

``jaxaot.jit`` finds the layers of a plain loop by their classes: Equinox and
Flax NNX modules by counting their instances (``_named.repeated_modules``),
linen and Haiku modules by counting their calls in a first trace
(``_scoped.counting``). Made blocks, fewer than ``_whole.MIN_LOOP`` calls of a
class whose calls do little work run as one program with the layers unrolled
(``_whole.form``): the program as ``jax.jit`` compiles it. Such a program is
compiled whole from its first trace instead, as ``jax.jit`` compiles it,
without a second trace with its layers as blocks, nor their entries: a shallow
program's cold start then costs about what ``jax.jit``'s does (measured against
it with 4-layer linen and Equinox train steps).

A program whose layers are counted before its first trace (by instances, which
an optimizer's copies of the model multiply) is traced first with their calls
counted, not as blocks, where every class has fewer instances than a loop takes
in the model that holds the fewest; it is traced again with them as blocks
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
from ._named import swapped_calls
from ._split import scan_why, scanned_layers, under_loops

__all__ = ["Seen", "counting_calls", "few_and_small", "layer_calls"]

#: How far above ``_whole.WHOLE_BELOW`` a few layers' share of the program's
#: work (its work over the calls of the least-called class) may be while they
#: stay in the program. A layer's share counts its forward and backward passes
#: and a part of the glue, about one and a half times the largest of its split
#: entries, which ``_whole.form`` compares with ``_whole.WHOLE_BELOW``; a share up
#: to twice that keeps a shallow program as ``jax.jit`` compiles it. Measured by
#: ``python benchmarks/real_models.py --layers 4`` (Haiku, linen and gemma
#: transformers of width 64, their layers' shares just above ``WHOLE_BELOW``),
#: against ``jax.jit``.
FEW_ABOVE = 2.0

#: A call seen: its class, and the classes of the calls around it.
Seen = tuple[type, frozenset[type]]


def layer_calls(calls: Iterable[Seen], classes: Sequence[type]) -> collections.Counter[type]:
    """The layers among ``classes`` and how often each was called: classes called
    two or more times outside the calls of the others (a model class around the
    layers is called once; a framework's layers, or a user's, inside a layer are
    parts of its calls)."""
    calls = list(calls)
    total = collections.Counter(cls for cls, _ in calls if cls in set(classes))
    repeated = {cls for cls, n in total.items() if n >= 2}
    outer = collections.Counter(
        cls for cls, around in calls if cls in repeated and not around & repeated
    )
    # (A class called once outside the others, a head after layers that hold
    # others of its kind, is glue.)
    return collections.Counter({cls: n for cls, n in outer.items() if n >= 2})


def few_and_small(closed: Any, counts: collections.Counter[type]) -> str | None:
    """Why the layers counted in ``counts`` (:func:`layer_calls`, in the traced
    program ``closed``) are not made blocks, or ``None`` where they are: each
    class called fewer than ``_whole.MIN_LOOP`` times, no more than
    ``_whole.MAX_WHOLE_CALLS`` calls in all, and the program's work over the
    calls of the least-called class (more than any one of its calls does) below
    ``_whole.WHOLE_BELOW`` times :data:`FEW_ABOVE`."""
    if closed.jaxpr.effects:
        return None  # a program with effects runs split (``_planner._whole_form``)
    if not counts:
        if scanned_layers(closed):
            return scan_why()
        return "nothing to split: every layer it found is called once"
    if max(counts.values()) >= _whole.MIN_LOOP or sum(counts.values()) > _whole.MAX_WHOLE_CALLS:
        return None
    total = work(closed)
    if total is None or total / min(counts.values()) >= FEW_ABOVE * _whole.WHOLE_BELOW:
        return None
    if scanned_layers(closed):  # (the layers counted are those of its one body)
        return under_loops("lax.scan")
    layers = ", ".join(f"{cls.__qualname__} x{k}" for cls, k in counts.items())
    return (
        f"a few small layers, {layers}, each called fewer than {_whole.MIN_LOOP} times: "
        "as blocks, they would run unrolled in one program"
    )


@contextlib.contextmanager
def counting_calls(classes: Sequence[type], seen: list[Seen]) -> Iterator[None]:
    """During the block, each call of ``classes`` is recorded in ``seen``, and
    otherwise runs as it would (the classes' ``__call__`` is swapped while the
    block runs, one such block at a time)."""
    around: list[type] = []

    def counted(cls: type) -> Callable[..., Any]:
        original = cls.__call__  # type: ignore[operator]

        @functools.wraps(original)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append((cls, frozenset(around)))
            around.append(cls)
            try:
                return original(self, *args, **kwargs)
            finally:
                around.pop()

        return call

    with swapped_calls(classes, counted):
        yield
