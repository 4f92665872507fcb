"""Making the plan of a split program for one signature: trace it, inline the calls
that hold components, cut it into regions, number the values' slots, and start
loading or compiling each region's executable.

Executables that autodiff will surely need start compiling while the program
is still being traced (unsharded programs: their input shardings are known
before the trace). A sharded program compiles each region for the shardings
its inputs have, which are known only once the regions before it are compiled
(:func:`chained`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax

from .._component._blocks import Block
from .._component._rules import PREFETCH, component_p
from .._jax import ClosedJaxpr, DropVar, Jaxpr, Literal, has_host_callbacks, join_effects
from . import _choice, _whole
from ._auto import BlockFinder, finding
from ._named import named_blocks
from ._placement import (
    UNSET,
    MeshContext,
    flat_targets,
    in_flight_limit,
    output_shardings,
    region_placement,
    region_sharding,
)
from ._plan import WHOLE as WHOLE_FORM
from ._plan import Plan, Step
from ._pool import submit_background, submit_jobs
from ._programs import GLUE, WHOLE, region_executable
from ._split import Region, contains_components, inline_calls, split

__all__ = ["MAX_WHOLE_CALLS", "PlanSpec", "build_plan"]

logger = logging.getLogger("jaxaot")

# A whole program that still binds more component calls than this once its
# repeated layers are loops is not made: unrolled, it would compile for as long
# as jax.jit does (what the split program is there to avoid).
MAX_WHOLE_CALLS = 16


@dataclass(frozen=True)
class PlanSpec:
    """What a ``jaxaot.jit`` function asks of its plans."""

    name: str
    jitted: Any  # the function under jax.jit (with its static and donated arguments)
    whole_program: bool
    out_shardings: Any = UNSET
    auto_regions: bool = True  # find the blocks an unmodified program repeats
    blocks: tuple[Any, ...] = ()  # functions and classes the user names as blocks
    program: Any = None  # the user's function (where named functions are found)


class _Maker(NamedTuple):
    """How to get one region's executable, for the input shardings given (``None``:
    none needed); regions with one ``job_key`` share one executable."""

    make: Callable[[tuple[Any, ...] | None], Any]
    job_key: Any
    label: str


class _Slots:
    """Where each value of the program lives in a plan's list of slots: the inputs,
    then the constants and literals (``fixed``), then what regions compute."""

    def __init__(self, jaxpr: Any, consts: Sequence[Any], regions: Sequence[Region]) -> None:
        self.of: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars)}
        self.fixed: list[Any] = []
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            self.of[v] = len(self.of)
            self.fixed.append(c)
        self._literals: dict[int, int] = {}
        self._n_inputs = len(jaxpr.invars)
        for region in regions:
            for v in region.invars:
                if isinstance(v, Literal):
                    self(v)
        for v in jaxpr.outvars:
            if isinstance(v, Literal):
                self(v)
        # Literals were added after the constants; region outputs come after them.
        self.next = self._n_inputs + len(self.fixed)
        for region in regions:
            for v in region.outvars:
                if not isinstance(v, DropVar) and v not in self.of:
                    self.of[v] = self.next
                    self.next += 1

    def __call__(self, v: Any) -> int:
        if isinstance(v, Literal):
            if id(v) not in self._literals:
                self._literals[id(v)] = self._n_inputs + len(self.fixed)
                self.fixed.append(v.val)
            return self._literals[id(v)]
        return self.of[v]

    def outs(self, region: Region) -> tuple[int, ...]:
        """The slots of a region's outputs (dropped outputs go to the spare slot)."""
        return tuple(self(v) if not isinstance(v, DropVar) else self.next for v in region.outvars)


def _trace(
    spec: PlanSpec, args: tuple[Any, ...], kwargs: dict[str, Any], sharded: bool
) -> tuple[Any, dict[Any, concurrent.futures.Future[Any]], BlockFinder | None]:
    """The traced program, the region executables autodiff started compiling
    during the trace (by entry key), and what found its blocks."""
    early: dict[Any, concurrent.futures.Future[Any]] = {}
    seen: collections.Counter[Any] = collections.Counter()

    def prefetch(call: Any) -> None:
        if isinstance(call.component, Block):  # a block called once stays in its glue
            seen[call.key] += 1
            if seen[call.key] < 2:
                return
        if call.key not in early:
            early.update(submit_jobs({call.key: functools.partial(region_executable, call)}))

    finder = BlockFinder() if spec.auto_regions or spec.blocks else None
    token = None if sharded else PREFETCH.set(prefetch)
    try:
        with finding(finder), named_blocks(spec.blocks, spec.program):
            traced = spec.jitted.trace(*args, **kwargs)
    finally:
        if token is not None:
            PREFETCH.reset(token)
    return traced, early, finder


def _glue_for(
    glue: Any, donate: tuple[int, ...], text: str, shardings: tuple[Any, ...] | None
) -> Any:
    return GLUE.get(glue, donate, shardings, text)


def _entry_for(call: Any, shardings: tuple[Any, ...] | None) -> Any:
    return region_executable(call, shardings)


def _maker(region: Region, debug_info: Any) -> _Maker:
    if region.kind == "component":
        call = region.eqns[0].params["call"]
        return _Maker(functools.partial(_entry_for, call), call.key, call.name)
    glue = ClosedJaxpr(
        Jaxpr(
            constvars=(),
            invars=region.invars,
            outvars=region.outvars,
            eqns=region.eqns,
            effects=join_effects(*(e.effects for e in region.eqns)),
            debug_info=debug_info,
        ),
        (),
    )
    text = str(glue)
    return _Maker(
        functools.partial(_glue_for, glue, region.donate, text),
        (text, tuple(glue.in_avals), region.donate),
        "glue",
    )


def chained(
    makers: Sequence[_Maker],
    step_ins: Sequence[tuple[int, ...]],
    step_outs: Sequence[tuple[int, ...]],
    known: dict[int, Any],
) -> list[concurrent.futures.Future[Any]]:
    """One job per step of a sharded program, started in program order: each
    compiles (or finds: steps with the same entry or glue and the same input
    shardings share one executable) its executable for the shardings of its
    inputs, which are the program's inputs' (``known``, by slot) or the output
    shardings of the executables of the steps before it (whose jobs it waits for:
    they were started before it, so none waits for a job that has not started)."""
    producer: dict[int, tuple[int, int]] = {}
    futures: list[concurrent.futures.Future[Any]] = []

    def sharding(slot: int) -> Any:
        if slot in known:
            return known[slot]
        k, j = producer[slot]
        return region_sharding(output_shardings(futures[k].result())[j])

    def job(k: int) -> Any:
        shardings = tuple(sharding(i) for i in step_ins[k])
        return makers[k].make(shardings)

    for k, outs in enumerate(step_outs):
        futures.append(submit_jobs({k: functools.partial(job, k)})[k])
        for j, slot in enumerate(outs):
            producer[slot] = (k, j)
    return futures


def _unsharded_jobs(
    makers: Sequence[_Maker], early: dict[Any, concurrent.futures.Future[Any]]
) -> list[concurrent.futures.Future[Any]]:
    """One job per distinct entry or glue program, all started now (or already
    started during the trace); the future of each step."""
    jobs: dict[Any, Callable[[], Any]] = {}
    for maker in makers:
        jobs.setdefault(maker.job_key, functools.partial(maker.make, None))
    futures = {k: f for k, f in early.items() if k in jobs}
    for k, f in early.items():
        if k not in jobs:  # autodiff ran under another transformation (vmap of grad)
            f.cancel()
    futures.update(submit_jobs({k: job for k, job in jobs.items() if k not in futures}))
    return [futures[maker.job_key] for maker in makers]


def build_plan(
    spec: PlanSpec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    donated: list[int],
    leaves: list[Any],
) -> Plan | None:
    """The plan for this call's signature, or ``None`` where the program calls no
    component (``jax.jit`` serves it). Raises where it cannot be split."""
    placements = [region_placement(x) for x in leaves]
    sharded = any(p is not None for p in placements) or not MeshContext().empty
    traced, early, finder = _trace(spec, args, kwargs, sharded)
    closed = traced.jaxpr
    if not contains_components(closed.jaxpr):
        logger.debug("jaxaot.jit %s: no component calls; using jax.jit", spec.name)
        return None
    counts = BlockFinder.counts(closed.jaxpr)
    unsplit = BlockFinder.once(counts) if counts else None
    in_avals = closed.in_avals
    if len(in_avals) != len(placements):
        raise ValueError(f"{len(in_avals)} traced inputs for {len(placements)} leaves")
    flat = jax.make_jaxpr(lambda *xs: inline_calls(closed.jaxpr, closed.consts, xs, unsplit))(
        *[
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=p)
            for a, p in zip(in_avals, placements, strict=True)
        ]
    )
    jaxpr = flat.jaxpr
    if not contains_components(jaxpr):
        logger.debug("jaxaot.jit %s: no repeated blocks; using jax.jit", spec.name)
        return None
    regions, leftover = split(jaxpr, {jaxpr.invars[i] for i in donated})
    # A component that names devices places its outputs there: the regions after
    # it are compiled for the shardings they receive, as in a sharded program.
    sharded = sharded or any(
        region.kind == "component" and region.eqns[0].params["call"].devices for region in regions
    )
    slots = _Slots(jaxpr, flat.consts, regions)
    makers = [_maker(region, jaxpr.debug_info) for region in regions]
    step_ins = [tuple(slots(v) for v in region.invars) for region in regions]
    step_outs = [slots.outs(region) for region in regions]
    if sharded:
        for f in early.values():
            f.cancel()
        known = dict(enumerate(placements))
        for i, value in enumerate(slots.fixed):
            known[len(placements) + i] = region_placement(value)
        step_futures = chained(makers, step_ins, step_outs, known)
    else:
        step_futures = _unsharded_jobs(makers, early)
    steps = [
        Step(region.kind, future, ins, outs, maker.label, bool(region.donate))
        for region, future, ins, outs, maker in zip(
            regions, step_futures, step_ins, step_outs, makers, strict=True
        )
    ]
    summary = _summary(regions, counts)
    logger.debug("jaxaot.jit %s:%s\n%s", spec.name, " (sharded)" if sharded else "", summary)
    start_whole = recalled = remember = None
    # Sharded programs have no whole-program form: the choice between the two
    # forms is by local timing, which differs from process to process (their
    # collectives would diverge), and its executable is compiled unsharded.
    if spec.whole_program and not jaxpr.effects and not sharded:
        # The whole program's digest (its text and entry keys), made once when first needed.
        digest = functools.lru_cache(maxsize=1)(functools.partial(_whole.digest, jaxpr))
        start_whole = functools.partial(_start_whole, spec.name, jaxpr, tuple(donated), digest)
        recalled, remember = _recorded_choice(jaxpr, tuple(donated), digest)
    out_shardings = None
    if spec.out_shardings is not UNSET:
        outs = jax.tree_util.tree_unflatten(traced.out_tree, list(jaxpr.outvars))
        out_shardings = list(flat_targets(spec.out_shardings, outs, "out_shardings"))
    return Plan(
        name=spec.name,
        n_inputs=len(jaxpr.invars),
        fixed=slots.fixed,
        n_consts=len(flat.consts),
        n_slots=slots.next + 1,
        steps=steps,
        out_slots=[slots(v) for v in jaxpr.outvars],
        out_tree=traced.out_tree,
        delete_after=[i for i, v in enumerate(jaxpr.invars) if v in leftover],
        donated=donated,
        start_whole=start_whole,
        out_shardings=out_shardings,
        in_flight=in_flight_limit() if sharded else None,
        summary=summary,
        recalled=recalled,
        remember=remember,
    )


def _recorded_choice(
    jaxpr: Any, donated: tuple[int, ...], digest: Callable[[], str]
) -> tuple[concurrent.futures.Future[str | None], Callable[[str, dict[str, float]], None]]:
    """The form an earlier process settled on for this program, being read from
    the cache on the loading threads (not behind the background thread's
    compiles: the plan's second call waits for it; where it is the whole
    program, that starts loading then, if the cache has it, so that the plan's
    job finds it made), and how to record the form this process settles
    on (on the background thread); see ``_choice``."""
    avals = tuple(v.aval for v in [*jaxpr.invars, *jaxpr.constvars])

    def remember(form: str, measured: dict[str, float]) -> None:
        submit_background(lambda: _choice.remember(digest(), avals, donated, form, measured))

    def recall() -> str | None:
        form = _choice.recall(digest(), avals, donated)
        if form == WHOLE_FORM:
            submit_jobs({"load": lambda: WHOLE.cached(digest(), avals, donated)})
        return form

    return submit_jobs({"recall": recall})["recall"], remember


def _summary(regions: Sequence[Region], counts: collections.Counter[Any]) -> str:
    """What the program was split into: per component and block, how many calls
    of each of its entries (``forward``, ``transpose``...) run as regions; how
    many glue programs; which blocks stayed in their glue (called once)."""
    calls: dict[str, collections.Counter[str]] = {}
    for region in regions:
        if region.kind != "component":
            continue
        call = region.eqns[0].params["call"]
        kind = "block" if isinstance(call.component, Block) else "component"
        transform = call.key.parts.get("transform") or ()
        entry = "/".join(str(t[0]) if t and t[0] != "linearize" else str(t[2]) for t in transform)
        calls.setdefault(f"{kind} {call.component.name}", collections.Counter())[
            entry or "call"
        ] += 1
    lines = [
        f"  {name}: " + ", ".join(f"{n} {entry}" for entry, n in sorted(entries.items()))
        for name, entries in sorted(calls.items())
    ]
    lines.append(f"  glue: {sum(r.kind == 'glue' for r in regions)} programs")
    inlined = sorted({call.component.name for call, n in counts.items() if n < 2})
    if inlined:
        lines.append("  in glue (called once): " + ", ".join(inlined))
    return "\n".join(lines)


def _start_whole(
    name: str, jaxpr: Any, donated: tuple[int, ...], digest: Callable[[], str]
) -> tuple[concurrent.futures.Future[Any], int, bool] | None:
    """Starts loading or compiling the whole-program form of ``jaxpr`` (its
    inputs, then its constants) on the background threads; the job, how many
    component calls the whole program binds, and whether it calls back into
    Python. None when it would bind more than ``MAX_WHOLE_CALLS``."""
    fn, calls = _whole.program(jaxpr)
    if calls > MAX_WHOLE_CALLS:
        logger.debug(
            "jaxaot.jit %s: no whole program (%d component calls after loops, over %d)",
            name,
            calls,
            MAX_WHOLE_CALLS,
        )
        return None
    calls_back = any(
        eqn.params["call"].entry.host_callbacks
        for eqn in jaxpr.eqns
        if eqn.primitive is component_p
    )
    avals = tuple(v.aval for v in [*jaxpr.invars, *jaxpr.constvars])
    out_avals = tuple(v.aval for v in jaxpr.outvars)
    logger.debug(
        "jaxaot.jit %s: whole program with %d component calls in the background", name, calls
    )
    calls_back = calls_back or has_host_callbacks(ClosedJaxpr(jaxpr, [None] * len(jaxpr.constvars)))

    def job() -> Any:
        return WHOLE.program(digest(), avals, out_avals, donated, fn, lambda: calls_back)

    return submit_background(job), calls, calls_back
