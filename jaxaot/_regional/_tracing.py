"""Tracing a ``jaxaot.jit`` program for its plan: with the blocks the user named,
the module classes that name themselves (``_named``), the linen and Haiku
layers a first trace counts (``_scoped``), and not with a few small layers
(``_shallow``)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax

from .. import _stats
from .._component._blocks import Block
from .._component._cost import keeping_residuals
from .._component._rules import PREFETCH
from .._jax import jax_explanations_off
from . import _whole
from ._auto import BlockFinder, StaleTrace, finding, program_entered
from ._named import from_a_framework, named_blocks, repeated_modules
from ._placement import UNSET
from ._scoped import Calls, counting, is_scoped, scoped_blocks
from ._shallow import Seen, counting_calls, few_and_small, layer_calls

__all__ = ["PlanSpec", "Prefetch", "Traced", "check_options", "entering", "trace"]

logger = logging.getLogger("jaxaot")


@dataclass(frozen=True)
class PlanSpec:
    """What a ``jaxaot.jit`` function asks of its plans."""

    name: str
    # A fresh jax.jit of the function (with its static and donated arguments), with
    # a trace cache of its own: one for each trace of a program.
    retracer: Callable[[], Any]
    whole_program: bool
    out_shardings: Any = UNSET
    auto_regions: bool = True  # find the blocks an unmodified program repeats
    blocks: tuple[Any, ...] = ()  # functions and classes the user names as blocks
    program: Any = None  # the user's function (where named functions are found)
    # What was said of this function's programs (each once, at INFO: see ``say``).
    said: set[str] = field(default_factory=set, compare=False, hash=False)

    def say(self, what: str) -> None:
        """Logs ``jaxaot.jit NAME: what`` at INFO, once per function."""
        if what not in self.said:
            self.said.add(what)
            logger.info("jaxaot.jit %s: %s", self.name, what)


#: Traces of one plan made again for custom_vjp rules that failed to
#: differentiate alone (one each); the trace after them may fail for good.
_STALE_RETRIES = 4


class Traced(NamedTuple):
    traced: Any  # the program, traced
    early: dict[Any, concurrent.futures.Future[Any]]  # executables autodiff started
    finder: BlockFinder | None  # what found its blocks
    kept_whole: str | None  # why layers it found repeating are not blocks


class Prefetch:
    """Starts compiling, while the program is traced, the region executables
    autodiff binds (by entry key, in ``early``); ``start`` makes one."""

    def __init__(self, whole_program: bool, start: Callable[[Any], dict[Any, Any]]) -> None:
        self.whole_program = whole_program
        self.start = start
        self.early: dict[Any, concurrent.futures.Future[Any]] = {}
        self.seen: collections.Counter[Any] = collections.Counter()

    def __call__(self, call: Any) -> None:
        if self.whole_program and _whole.small(call):
            return  # a program of small calls runs as one program: none is needed
        if isinstance(call.component, Block):  # a block called once stays in its glue
            self.seen[call.key] += 1
            if self.seen[call.key] < 2:
                return
        if call.key not in self.early:
            self.early.update(self.start(call))


def trace(
    spec: PlanSpec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    prefetch: Prefetch | None,
    sharded: bool,
) -> Traced:
    """The traced program, the region executables autodiff started compiling
    during the trace (by entry key; only with a ``prefetch``), what found its
    blocks, and why the linen or Haiku layers it repeats stay in it."""
    seen = prefetch.seen if prefetch is not None else collections.Counter()

    named = spec.blocks
    deferred: tuple[type, ...] = ()  # found, counted in the first trace (``_shallow``)
    counted: tuple[type, ...] = ()
    if spec.auto_regions:  # module classes of a plain loop of layers name themselves
        found = repeated_modules(args, kwargs, spec.program, named)
        new = tuple(cls for cls in found.classes if cls not in named)
        counted = tuple(cls for cls in new if cls not in found.parts)
        # The user's layers, where there are any: a framework's layers found
        # beside them (``nnx.Linear`` counted in a GraphDef, which does not say
        # what encloses what) are their parts.
        counted = tuple(cls for cls in counted if not from_a_framework(cls)) or counted
        if (
            counted
            and spec.whole_program
            and not sharded
            and all(found.fewest[cls] < _whole.MIN_LOOP for cls in counted)
        ):
            deferred = new
        else:
            named = (*named, *new)
    seen_calls: list[Seen] = []

    def fresh(
        named: tuple[Any, ...], counted: tuple[type, ...] = ()
    ) -> tuple[Any, BlockFinder | None, Calls | None]:
        # A jit of its own for each trace: JAX would give an earlier trace of this
        # signature (``explain``'s, or another plan's) from its cache, without
        # running the program, and so without counting its module calls or
        # finding its blocks. A trace whose rule failed to differentiate alone is
        # made again without it (each such rule once: they are finitely many).
        for _ in range(_STALE_RETRIES):
            try:
                return run(spec.retracer(), named, counted)
            except StaleTrace as stale:
                logger.debug("jaxaot.jit %s: traced again without trying %s", spec.name, stale)
                seen.clear()
        return run(spec.retracer(), named, counted)

    def run(
        jitted: Any, named: tuple[Any, ...], counted: tuple[type, ...]
    ) -> tuple[Any, BlockFinder | None, Calls | None]:
        finder = BlockFinder() if spec.auto_regions or named else None
        plain = tuple(b for b in named if not (isinstance(b, type) and is_scoped(b)))
        scoped = tuple(b for b in named if isinstance(b, type) and is_scoped(b))
        with contextlib.ExitStack() as stack:
            # Small components of a program that may run as one program keep
            # their residuals (recomputing pays off only in a split program).
            stack.enter_context(keeping_residuals(spec.whole_program))
            calls = stack.enter_context(counting()) if spec.auto_regions else None
            if finder is not None and calls is not None:
                finder.wraps_layers = calls.wraps_layers
            stack.enter_context(finding(finder))
            # Classes found, not named, are parts of the blocks they sit in: the
            # framework's layers (an eqx.nn.Linear in a user's Block), and any
            # inside a class the user named.
            parts = [
                b
                for b in plain
                if isinstance(b, type)
                and b not in spec.blocks
                and (bool(spec.blocks) or from_a_framework(b))
            ]
            stack.enter_context(named_blocks(plain, spec.program, parts))
            stack.enter_context(scoped_blocks(scoped))
            seen_calls.clear()
            stack.enter_context(counting_calls(counted, seen_calls))
            stack.enter_context(jax_explanations_off())
            traced = jitted.trace(*args, **kwargs)
        _refuse_leaked_tracers(spec, traced, args, kwargs)
        return traced, finder, calls

    kept_whole = None
    # (Without a prefetch, one set around this trace stays in effect.)
    with (
        _stats.set_during(PREFETCH, prefetch) if prefetch is not None else contextlib.nullcontext()
    ):
        traced, finder, calls = fresh(named, counted if deferred else ())
        if deferred:
            kept_whole = few_and_small(traced.jaxpr, layer_calls(seen_calls, counted))
            if kept_whole is None:  # many calls, or big ones: they are blocks
                seen.clear()
                named = (*named, *deferred)
                traced, finder, calls = fresh(named)
        more = () if calls is None else tuple(c for c in calls.repeated() if c not in named)
        if more and calls is not None and kept_whole is None and spec.whole_program and not sharded:
            linen = layer_calls(((cls, around) for cls, _, around in calls.calls), more)
            kept_whole = few_and_small(traced.jaxpr, linen)
        if more and kept_whole is None and not _repeats_blocks(traced.jaxpr):
            # Linen or Haiku layers repeat, and no boundary marked them: traced
            # again with them as blocks (by a jit of its own: JAX would return
            # the first trace from its cache).
            logger.debug(
                "jaxaot.jit %s: module classes that repeat: %s",
                spec.name,
                ", ".join(c.__qualname__ for c in more),
            )
            # (Its calls are counted afresh: a block called once in each trace is
            # still called once, and starts no executable.)
            seen.clear()
            traced, finder, _ = fresh((*named, *more))
    return Traced(traced, prefetch.early if prefetch is not None else {}, finder, kept_whole)


def check_options(
    name: str,
    whole_program: Any,
    auto_regions: Any,
    keep_unused: bool,
    compiler_options: dict[str, Any] | None,
) -> None:
    """Refuses, when a function is decorated, the options its plans cannot honour.

    Raises:
      TypeError: ``whole_program`` or ``auto_regions`` is not a bool.
      ValueError: ``keep_unused=True`` (the cached programs prune unused inputs)
        or ``compiler_options`` (keys hold XLA's flags, not one function's options).
    """
    for option, value in (("whole_program", whole_program), ("auto_regions", auto_regions)):
        if not isinstance(value, bool):
            raise TypeError(f"jaxaot.jit {name!r}: {option} must be a bool, got {value!r:.60}")
    if keep_unused:
        raise ValueError(
            f"jaxaot.jit {name!r}: keep_unused=True is not supported (its programs "
            "are compiled, and cached, with unused inputs pruned); use jax.jit for a "
            "program that must keep them"
        )
    if compiler_options:
        raise ValueError(
            f"jaxaot.jit {name!r}: compiler_options are not supported (its "
            "executables are cached under keys that hold XLA's flags, not options "
            "of one function); set them in XLA_FLAGS, or use jax.jit for this function"
        )


def entering(name: str, fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` as the traces that plan it run it: the trace that finds blocks
    starts where it is entered, and what it changes in place in its arguments
    without returning it is said (:func:`_say_lost_updates`)."""

    @functools.wraps(fun)
    def entered(*args: Any, **kwargs: Any) -> Any:
        program_entered()
        before = jax.tree_util.tree_leaves((args, kwargs))
        out = fun(*args, **kwargs)
        _say_lost_updates(name, before, (args, kwargs), out)
        return out

    return entered


def _say_lost_updates(name: str, before: list[Any], arguments: Any, out: Any) -> None:
    """Warns, once per function, where a traced program changed its arguments in
    place without returning the new values: ``jax.jit`` and ``jaxaot.jit`` hand a
    function copies of its arguments' containers, so such updates never reach
    the caller (a Flax NNX step whose ``optimizer.update(model, grads)`` runs in
    place trains nothing). A leaf replaced in an argument and not among the
    results is such an update."""
    now = jax.tree_util.tree_flatten_with_path(arguments)[0]
    if len(now) == len(before) and all(a is b for a, (_, b) in zip(before, now, strict=True)):
        return
    returned = {id(leaf) for leaf in jax.tree_util.tree_leaves(out)}
    ids = {id(leaf) for leaf in before}
    lost = [
        ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])  # type: ignore[attr-defined]
        for path, leaf in now
        if id(leaf) not in ids and id(leaf) not in returned
    ]
    if lost:
        more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
        _stats.warn_once(
            f"lost-updates:{name}",
            f"jaxaot.jit {name!r}: the function changes its arguments in place "
            f"({', '.join(lost[:3])}{more}) without returning them; as under jax.jit, "
            "those changes never reach the caller. Return the new values (Flax NNX: "
            "nnx.split the model and optimizer and return their new state, or use "
            "nnx.jit)",
        )


def _refuse_leaked_tracers(
    spec: PlanSpec, traced: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Raises ``jax.jit``'s error where the program closes over a tracer of a
    trace that has ended (a leaked tracer): ``trace`` takes it as one more input
    of the program, which its call, with the arguments alone, would not fit."""
    if len(traced.jaxpr.in_avals) == len(jax.tree_util.tree_leaves(traced.args_info)):
        return
    spec.retracer()(*args, **kwargs)  # raises UnexpectedTracerError, naming where it leaked
    raise TypeError(
        f"jaxaot.jit {spec.name!r}: the function closes over a traced value of a "
        "transformation that has ended (a leaked tracer); pass it as an argument"
    )


def _repeats_blocks(closed: Any) -> bool:
    return any(n >= 2 for n in BlockFinder.counts(closed.jaxpr).values())
