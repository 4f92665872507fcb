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
from typing import Any, NamedTuple

import jax

from .._component._blocks import Block
from .._component._rules import component_p
from .._jax import (
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    Literal,
    callback_equations,
    has_host_callbacks,
    join_effects,
    named,
)
from .._keys._callbacks import callback_witness, register_callbacks
from .._keys._program import arg_names, program_digest
from . import _whole
from ._auto import BlockFinder
from ._placement import (
    UNSET,
    MeshContext,
    devices_disagree,
    flat_targets,
    in_flight_limit,
    output_shardings,
    region_placement,
    region_sharding,
)
from ._plan import Plan, Step
from ._pool import submit_jobs
from ._programs import GLUE, WHOLE, region_executable
from ._split import (
    Region,
    contains_components,
    inline_calls,
    loops_in_glue,
    nested_components,
    scan_why,
    scanned_layers,
    split,
    under_loops,
)
from ._tracing import PlanSpec, Prefetch, trace

__all__ = ["PlanSpec", "build_plan", "describe"]

logger = logging.getLogger("jaxaot")


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


def _prefetch(spec: PlanSpec) -> Prefetch:
    return Prefetch(
        spec.whole_program,
        lambda call: submit_jobs({call.key: functools.partial(region_executable, call)}),
    )


def _unlike(counts: collections.Counter[Any]) -> str:
    """What tells apart the calls of a block that runs several times, each as a
    program of its own (so none repeats): their names and how many."""
    programs: dict[tuple[str, str], int] = collections.Counter()
    for call in counts:  # counted per transformation (forward, backward, ...): the most
        programs[(call.name, repr(call.key.parts.get("transform")))] += 1
    most: dict[str, int] = {}
    for (name, _), n in programs.items():
        most[name] = max(most.get(name, 0), n)
    named = [f"{name} runs {n} times" for name, n in sorted(most.items()) if n >= 2]
    if not named:
        return ""
    return (
        f"; {', '.join(named)}, each call a different program: a value made for each "
        "layer is built into it (a number or an array of its own, a Python value per layer)"
    )


def _closed(invars: Any, outvars: Any, eqns: Any, effects: Any, debug_info: Any) -> Any:
    """A closed jaxpr of ``eqns`` without constants."""
    jaxpr = Jaxpr(
        constvars=(),
        invars=invars,
        outvars=outvars,
        eqns=eqns,
        effects=effects,
        debug_info=debug_info,
    )
    return ClosedJaxpr(jaxpr, ())


def _maker(region: Region, debug_info: Any, name: str) -> _Maker:
    """How region ``region`` of jaxaot.jit function ``name`` gets its executable."""
    if region.kind == "component":
        call = region.eqns[0].params["call"]
        # A call donating inputs runs an executable of its own (the same entry,
        # compiled with those inputs donated).
        job_key = (call.key, region.donate) if region.donate else call.key
        make = functools.partial(region_executable, call, donate=region.donate)
        return _Maker(make, job_key, call.name)
    effects = join_effects(*(e.effects for e in region.eqns))
    glue = _closed(region.invars, region.outvars, region.eqns, effects, debug_info)
    what = f"jaxaot.jit {name}'s glue program"
    content = program_digest(glue, what)
    return _Maker(
        lambda shardings: GLUE.get(glue, region.donate, shardings, content, what, name),
        (content, tuple(glue.in_avals), region.donate),
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


class _Cut(NamedTuple):
    """A traced program cut into regions (see :func:`_cut`)."""

    traced: Any
    jaxpr: Any  # the program with the calls holding components inlined
    consts: list[Any]
    regions: list[Region]
    leftover: set[Any]  # donated inputs no region consumes (deleted after the call)
    donated_vars: set[Any]
    counts: collections.Counter[Any]  # calls of each block's entry
    nested: str  # what holds components the split cannot reach ("" if nothing)
    why: str | None  # why the program is served whole, where it is
    placements: list[Any]
    sharded: bool
    early: dict[Any, concurrent.futures.Future[Any]]
    notes: dict[str, str]  # why the calls that are not blocks are not, by name


def _cut(
    spec: PlanSpec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    donated: list[int],
    leaves: list[Any],
    prefetch: bool = True,
) -> _Cut | None:
    """Traces the program and cuts it into regions (``prefetch``: starting the
    executables autodiff binds while it traces; else compiling nothing); ``None``
    where there is nothing to compile, or the call is one ``jax.jit`` refuses."""
    if devices_disagree(leaves):
        return None  # (jax.jit names the arguments on other devices)
    placements = [region_placement(x) for x in leaves]
    sharded = any(p is not None for p in placements) or not MeshContext().empty
    traced, early, finder, kept_whole = trace(
        spec, args, kwargs, _prefetch(spec) if prefetch and not sharded else None, sharded
    )
    closed = traced.jaxpr
    counts: collections.Counter[Any] = collections.Counter()
    if not contains_components(closed.jaxpr):
        # Nothing to split: the program is served whole, as one region (cached
        # like any glue program), never compiled afresh in a warm process.
        jaxpr, consts = closed.jaxpr, list(closed.consts)
        if kept_whole is not None:
            why = kept_whole
        elif scanned_layers(closed):
            why = scan_why()
        elif finder is not None and finder.notes:  # (each said under "not blocks")
            why = "nothing to split: it calls no component, and its layers cannot be blocks"
        elif finder is not None and spec.blocks:
            names = ", ".join(getattr(b, "__qualname__", repr(b)) for b in spec.blocks)
            why = (
                f"nothing to split: blocks={names} is called fewer than twice where the "
                "program reaches it (a global of its module or of the program's, or "
                "through the program's closures and partials)"
            )
        elif finder is not None:
            why = (
                "nothing to split: it calls no component and repeats no block; a layer "
                "called in a loop splits as a block under @jaxaot.component, jax.checkpoint "
                "or jaxaot.jit(blocks=...)"
            )
        else:
            why = "nothing to split: it calls no component (auto_regions=False, no blocks=)"
    else:
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
        jaxpr, consts = flat.jaxpr, list(flat.consts)
        why = None
        if not contains_components(jaxpr):
            unlike = _unlike(counts)  # (why none repeats says more than how few)
            why = kept_whole if kept_whole and not unlike else None
            why = why or "nothing to split: every block it found is called once" + unlike
    donated_vars = {jaxpr.invars[i] for i in donated}
    regions, leftover = split(jaxpr, donated_vars)
    if not regions:
        logger.debug("jaxaot.jit %s: nothing to compile; using jax.jit", spec.name)
        return None
    nested = nested_components(jaxpr)
    if why is None and not any(region.kind == "component" for region in regions):
        why = under_loops(nested)
    if why is not None:
        for f in early.values():
            f.cancel()
        early = {}
    return _Cut(
        traced,
        jaxpr,
        consts,
        regions,
        leftover,
        donated_vars,
        counts,
        nested,
        why,
        placements,
        sharded,
        early,
        {} if finder is None else dict(finder.notes),
    )


def describe(
    spec: PlanSpec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    donated: list[int],
    leaves: list[Any],
) -> tuple[str, str | None] | None:
    """What the plan of this call would run (the summary its plan would have), and
    why it would be served whole (or ``None``), found by tracing and cutting the
    program only: no executable is compiled or loaded. ``None`` where
    ``jax.jit`` would serve it."""
    cut = _cut(spec, args, kwargs, donated, leaves, prefetch=False)
    if cut is None:
        return None
    return _described(cut, _whole_form(spec, cut, donated)), cut.why


def _sharded(cut: _Cut) -> bool:
    """Whether the program's regions are compiled for the shardings they receive:
    a sharded program, or one calling a component that names devices (it places
    its outputs there)."""
    return cut.sharded or any(
        region.kind == "component" and region.eqns[0].params["call"].devices
        for region in cut.regions
    )


def _described(cut: _Cut, form: tuple[bool, str | None]) -> str:
    """What the program runs (its regions, and its form), then why its calls that
    are not blocks are not (for a program served whole, only the latter: its
    reason is ``cut.why``)."""
    # A call that is a block at some sites and not at others (a solve whose rule
    # stays in its glue under grad) is said to be so.
    blocks = {r.eqns[0].params["call"].component.name for r in cut.regions if r.kind == "component"}
    lines = [
        f"    {name}{' (some of its calls)' if name in blocks else ''}: {why}"
        for name, why in sorted(cut.notes.items())
    ]
    not_blocks = ["  not blocks:", *lines] if lines else []
    if cut.why is not None:
        return "\n".join(not_blocks)
    whole, why = form
    if why is None:
        said = []
    elif whole:
        donated = [i for i, v in enumerate(cut.jaxpr.invars) if v in cut.donated_vars]
        if _whole.looped(cut.jaxpr, donated):
            said = [f"  runs as one program, its repeated layers as loops ({why})"]
        else:
            said = [
                f"  runs as one program, its layers unrolled ({why}; fewer than "
                f"{_whole.MIN_LOOP} in a row)"
            ]
    else:
        said = [f"  runs split, each component compiled once ({why})"]
    return "\n".join([_summary(cut.regions, cut.counts, cut.nested), *said, *not_blocks])


def build_plan(
    spec: PlanSpec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    donated: list[int],
    leaves: list[Any],
) -> Plan | None:
    """The plan for this call's signature, or ``None`` where the program has nothing
    to compile (``jax.jit`` serves it). Raises where it cannot be split."""
    cut = _cut(spec, args, kwargs, donated, leaves)
    if cut is None:
        return None
    traced, jaxpr, consts, regions, leftover, donated_vars = cut[:6]
    why, placements, sharded, early = cut.why, cut.placements, cut.sharded, cut.early
    if why is not None:
        spec.say(f"served whole, as one cached program ({why})")
    if why is not None and not sharded:
        return _one_program(
            spec, cut, tuple(donated), _served(cut, tuple(donated), spec.name), (False, None)
        )
    sharded = _sharded(cut)
    form = _whole_form(spec, cut, tuple(donated))
    if form[0] or sharded:  # (exclusive: the early executables are not needed)
        for f in early.values():
            f.cancel()
    if form[0]:
        return _one_program(
            spec,
            cut,
            tuple(donated),
            _whole_job(jaxpr, tuple(donated), spec.name, _input_names(cut)),
            form,
        )
    slots = _Slots(jaxpr, consts, regions)
    makers = [_maker(region, jaxpr.debug_info, spec.name) for region in regions]
    step_ins = [tuple(slots(v) for v in region.invars) for region in regions]
    step_outs = [slots.outs(region) for region in regions]
    if sharded:
        known = dict(enumerate(placements))
        for i, value in enumerate(slots.fixed):
            known[len(placements) + i] = region_placement(value)
        step_futures = chained(makers, step_ins, step_outs, known)
    else:
        step_futures = _unsharded_jobs(makers, early)
    steps = [
        # (Only a step donating an input waits for every executable: one donating
        # an intermediate leaves the inputs intact for jax.jit.)
        Step(
            region.kind,
            future,
            ins,
            outs,
            maker.label,
            any(region.invars[j] in donated_vars for j in region.donate),
        )
        for region, future, ins, outs, maker in zip(
            regions, step_futures, step_ins, step_outs, makers, strict=True
        )
    ]
    summary = _described(cut, form)
    logger.debug("jaxaot.jit %s:%s\n%s", spec.name, " (sharded)" if sharded else "", summary)
    return Plan(
        name=spec.name,
        n_inputs=len(jaxpr.invars),
        fixed=slots.fixed,
        n_consts=len(consts),
        n_slots=slots.next + 1,
        steps=steps,
        out_slots=[slots(v) for v in jaxpr.outvars],
        out_tree=traced.out_tree,
        delete_after=[i for i, v in enumerate(jaxpr.invars) if v in leftover],
        donated=donated,
        out_shardings=_out_shardings(spec, cut),
        in_flight=in_flight_limit() if sharded else None,
        summary=summary,
        served_whole=why,
    )


def _whole_form(spec: PlanSpec, cut: _Cut, donated: Sequence[int]) -> tuple[bool, str | None]:
    """Whether the split program ``cut`` runs as one program, its repeated layers
    as loops (see ``_whole.form``), and why (``None``: no such form is made)."""
    if not spec.whole_program:
        return False, None  # whole_program=False
    if _sharded(cut):
        # Its regions are compiled for the shardings each receives; one program
        # of them would be compiled unsharded.
        return False, None
    if cut.jaxpr.effects or cut.why is not None:
        return False, None
    return _whole.form(cut.jaxpr, donated)


def _served(cut: _Cut, donated: tuple[int, ...], name: str) -> tuple[Any, bool]:
    """The job of a program served whole (one executable of the whole program, its
    inputs then its constants, cached as a whole program, as ``jaxaot cache ls``
    lists it), and whether it calls back into Python."""
    jaxpr = cut.jaxpr
    invars = [*jaxpr.invars, *jaxpr.constvars]
    program = _closed(invars, jaxpr.outvars, jaxpr.eqns, jaxpr.effects, jaxpr.debug_info)
    what = f"jaxaot.jit {name}'s program (served whole)"
    content = program_digest(program, what)
    names = _input_names(cut)
    job = submit_jobs(
        {"whole": lambda: WHOLE.get(program, donated, None, content, what, name, names)}
    )["whole"]
    return job, has_host_callbacks(program)


def _input_names(cut: _Cut) -> list[str] | None:
    """The paths of the inputs of the program ``cut`` as its trace named them
    (``params['w']``), then its constants (``constant #0``), as a miss's
    explanation names them; ``None`` where its trace did not name them."""
    names = arg_names(cut.traced.jaxpr)
    if names is None or len(names) != len(cut.jaxpr.invars):
        return None
    return names + [f"constant #{i}" for i in range(len(cut.jaxpr.constvars))]


def _whole_job(
    jaxpr: Any, donated: tuple[int, ...], name: str, names: list[str] | None
) -> tuple[Any, bool]:
    """The job of the whole-program form of ``jaxpr`` (its inputs, then its
    constants: repeated layers as loops, ``names`` their paths), and whether it
    calls back into Python."""
    fn, _ = _whole.program(jaxpr, donated)
    calls_back = any(
        eqn.params["call"].entry.host_callbacks
        for eqn in jaxpr.eqns
        if eqn.primitive is component_p
    ) or has_host_callbacks(ClosedJaxpr(jaxpr, [None] * len(jaxpr.constvars)))
    avals = tuple(v.aval for v in [*jaxpr.invars, *jaxpr.constvars])
    out_avals = tuple(v.aval for v in jaxpr.outvars)

    # Its callbacks, those of the components it calls inline included, named for
    # rebinding in another process (under the digest its key names).
    eqns = callback_equations(jaxpr)
    digest = _whole.digest(jaxpr)
    register_callbacks(WHOLE.kind, digest, eqns)

    def job() -> Any:
        return WHOLE.program(
            digest,
            avals,
            out_avals,
            donated,
            named(fn, name),
            lambda: calls_back,
            what=f"jaxaot.jit {name}'s whole program",
            names=names,
            witness=callback_witness(eqns) if eqns else None,
        )

    return submit_jobs({"whole": job})["whole"], calls_back


def _out_shardings(spec: PlanSpec, cut: _Cut) -> list[Any] | None:
    """Per flat output, the sharding ``out_shardings`` asks for (``None``: unset)."""
    if spec.out_shardings is UNSET:
        return None
    outs = jax.tree_util.tree_unflatten(cut.traced.out_tree, list(cut.jaxpr.outvars))
    return list(flat_targets(spec.out_shardings, outs, "out_shardings"))


def _one_program(
    spec: PlanSpec,
    cut: _Cut,
    donated: tuple[int, ...],
    made: tuple[Any, bool],
    form: tuple[bool, str | None],
) -> Plan:
    """The plan of an unsharded program run as one executable (``made``: its job,
    and whether it calls back into Python; ``form``: as ``_whole_form`` gave it),
    from its first call; its calls go through JAX's C++ dispatcher."""
    job, calls_back = made
    summary = _described(cut, form)
    logger.debug("jaxaot.jit %s:\n%s", spec.name, summary)
    return Plan(
        name=spec.name,
        n_inputs=len(cut.jaxpr.invars),
        fixed=cut.consts,
        n_consts=len(cut.consts),
        out_tree=cut.traced.out_tree,
        donated=list(donated),
        out_shardings=_out_shardings(spec, cut),
        summary=summary,
        served_whole=cut.why,
        program=(job, calls_back),
    )


def _summary(regions: Sequence[Region], counts: collections.Counter[Any], nested: str) -> str:
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
        f"  {name}: "
        + ", ".join(
            f"{n} {entry}s" if entry.endswith("call") and n != 1 else f"{n} {entry}"
            for entry, n in sorted(entries.items())
        )
        for name, entries in sorted(calls.items())
    ]
    glue = sum(r.kind == "glue" for r in regions)
    lines.append(f"  glue: {glue} {'program' if glue == 1 else 'programs'}")
    inlined = sorted({call.component.name for call, n in counts.items() if n < 2})
    if inlined:
        lines.append("  in glue (called once): " + ", ".join(inlined))
    if nested:
        lines.append(f"  {loops_in_glue(nested)}")
    return "\n".join(lines)
