"""``jaxaot.jit``: regional compilation of programs made of components.

``jax.jit`` inlines every component call, so XLA compiles the whole unrolled
program, and compile time grows faster than the program. ``jaxaot.jit`` traces
the program the same way, then splits its jaxpr at the component calls:

* every component call runs that component's own executable, compiled once
  per entry (the primal entry and the derived entries that ``grad`` needs),
  and kept in the cache like any other executable entry;
* the equations between component calls form *glue* programs; glue programs
  that are the same (same equations, same types) are compiled once and
  cached too.

Calls of ``jax.jit`` functions and ``jax.checkpoint`` regions that contain
components are inlined first, so their components split as well. A component
under ``lax.scan``, ``cond`` or ``while`` stays inside its glue (compiled the
ordinary way), with one DEBUG line; when nothing can be split, or splitting
fails, the program runs under plain ``jax.jit``. Either way the result is
the one ``jax.jit`` would give.

In the steady state, the split program competes with its whole-program form
(one executable, repeated layers as a loop), compiled in the background once
the program has run; the faster one runs (``_plan``, ``_whole``).

Sharded programs (an input placed on a mesh or on a device other than the
default one, or a mesh in context: ``jax.set_mesh``) compile each region for
the shardings its inputs have: the program's inputs' (after ``in_shardings``),
then the output shardings of the executables before it, in program order
(``_chained``). Regions with the same entry or glue and the same input
shardings share one executable, so the layers of a data-parallel or FSDP model
compile once, whatever the depth. Executables are keyed by those shardings (in
this process by the sharding objects and the mesh in context; in the cache by
their text, ``_sharding.region_sharding_parts``), so one compiled for some
shardings is never used for others. Compile jobs run in the mesh context of
the caller. Sharded programs have no whole-program form (see below).

Outputs without ``out_shardings`` have the sharding the executable computing
them gives them (XLA's propagation within that region). For data-parallel and
2-D (data x model) steps that is jax.jit's; where jax.jit propagates a
sharding back from a later use (FSDP gradients returned next to parameters
updated from them: jax.jit shards them like the parameters, the split returns
them as the backward executables make them, replicated), pass
``out_shardings`` and the outputs are moved there.

Multi-process jobs: every process takes the same split-or-fallback decision
as long as what decides it is the same in all of them: the trace and split
(the program and its global shardings), and whether each executable compiles
(the same module and shardings). The one choice made from local measurements,
whole program or split, is never made for sharded programs. A process whose
cache or compiler fails where the others' do not would fall back alone; that
case is not guarded against.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import hashlib
import logging
import operator
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from . import _component, _distributed, _entry, _plan, _sharding, _stats, _whole
from ._config import get_cache
from ._jaxcompat import (
    CALL_PRIMITIVES,
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    Literal,
    Tracer,
    call_body,
    component_calls_in,
    cpp_dispatcher,
    fastpath_miss,
    jaxpr_as_fun,
    join_effects,
    trace_context,
    trace_state_clean,
)
from ._key import ComponentKey, aval_str
from ._optimize import evaluate
from ._plan import Plan, PlanFailed, Step
from ._rules import PREFETCH, component_p

logger = logging.getLogger("jaxaot")

_INLINE = CALL_PRIMITIVES


def _contains_components(jaxpr: Any) -> bool:
    return component_calls_in(jaxpr) > 0


def _inner_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    return call_body(eqn)


def _eval_inlined(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluates ``jaxpr``, inlining calls (jit, checkpoint) that contain components."""

    def visit(eqn: Any, invals: list[Any], read: Any) -> list[Any] | None:
        name = eqn.primitive.name
        inner = _inner_jaxpr(eqn) if name in _INLINE else None
        if inner is not None and _contains_components(inner[0]):
            return _eval_inlined(inner[0], inner[1], invals)
        if name not in _INLINE and _contains_components_in_params(eqn):
            logger.debug(
                "jaxaot.jit: components under %s are compiled inline with their glue", name
            )
        return None

    return evaluate(jaxpr, consts, args, visit)


def _contains_components_in_params(eqn: Any) -> bool:
    from ._jaxcompat import jaxprs_in_params

    return any(_contains_components(j) for j in jaxprs_in_params(eqn.params))


def _program_key(
    kind: str,
    digest: str,
    avals: Sequence[Any],
    donate: tuple[int, ...],
    shardings: tuple[Any, ...] | None = None,
) -> ComponentKey:
    parts = _component._base_parts(_component.default_platform())
    executable = _component._executable_parts(donate)
    if shardings is not None:  # compiled for these input shardings, under this mesh
        texts, mesh = _sharding.region_sharding_parts(shardings, [len(a.shape) for a in avals])
        executable = (*executable, ("input_shardings", texts), ("context_mesh", mesh))
    parts.update(
        component=f"{kind}:{digest}",
        in_tree="",
        static=(),
        args=tuple(aval_str(a.shape, a.dtype, a.weak_type) for a in avals),
        transform=((kind, donate),),
        executable=executable,
    )
    return ComponentKey(parts)


def _glue_key(text: str, avals: Sequence[Any], donate: tuple[int, ...]) -> ComponentKey:
    return _program_key("glue", hashlib.sha256(text.encode()).hexdigest(), avals, donate)


class _ProgramCache:
    """Compiled programs of this process (glue programs, whole programs), by
    content; shared by all jaxaot.jit functions and kept in the cache."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._locks = _stats.KeyedLocks()
        self._exes: dict[tuple[Any, ...], Any] = {}
        # Executables loaded from a cache, by id: the cache and key they came from.
        self._loaded: dict[int, tuple[Any, ComponentKey]] = {}
        self.counters = _stats.Counters(parent=_stats.PROCESS)

    def payload(self, exe: Any) -> bytes | None:
        """The serialized executable ``exe`` was loaded from (read from its cache
        again), or ``None`` if it was compiled here. A loaded executable cannot be
        serialized again on XLA:CPU (its kernels are not kept)."""
        source = self._loaded.get(id(exe))
        if source is None:
            return None
        from ._store import read

        entry = read(*source)
        return None if entry is None else entry.executable

    def get(
        self,
        closed: Any,
        donate: tuple[int, ...],
        shardings: tuple[Any, ...] | None = None,
        text: str | None = None,
    ) -> Any:
        """The executable of a glue program (a closed jaxpr, whose text is ``text``)
        for inputs with ``shardings`` (see ``program``)."""
        return self.program(
            hashlib.sha256((str(closed) if text is None else text).encode()).hexdigest(),
            tuple(closed.in_avals),
            tuple(closed.out_avals),
            donate,
            jaxpr_as_fun(closed),
            lambda: _has_callbacks(closed),
            shardings,
        )

    def program(
        self,
        digest: str,
        avals: tuple[Any, ...],
        out_avals: tuple[Any, ...],
        donate: tuple[int, ...],
        fn: Callable[..., Any],
        callbacks: Callable[[], bool],
        shardings: tuple[Any, ...] | None = None,
    ) -> Any:
        """The executable of ``fn`` (flat arrays to a flat list) at ``avals``, whose
        content ``digest`` names: from this process, else the cache, else compiled
        (and stored unless it calls back into Python). ``shardings``: the sharding
        each input is compiled for (``None``: none needed); all ``None`` outside a
        mesh, or no ``shardings``, is the unsharded executable."""
        memo_key: tuple[Any, ...] = (digest, avals, donate)
        if shardings is not None:
            context = _sharding.MeshContext()
            if context.empty and all(s is None for s in shardings):
                shardings = None
            else:
                memo_key = (*memo_key, shardings, context.key())
        exe = self._exes.get(memo_key)
        if exe is not None:
            self.counters.add("hits")
            return exe
        with self._locks(memo_key):
            exe = self._exes.get(memo_key)
            if exe is not None:
                self.counters.add("hits")
                return exe
            key = _program_key(self.kind, digest, avals, donate, shardings)
            cache = get_cache()
            loaded = _component._load_executable(cache, key) if cache is not None else None
            if loaded is not None:
                exe = loaded[0]
                self._loaded[id(exe)] = (cache, key)
                self.counters.add("hits")
            else:
                self.counters.add("misses")
                sds = [
                    jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=s)
                    for a, s in zip(avals, shardings or (None,) * len(avals), strict=True)
                ]
                exe = (
                    jax.jit(fn, keep_unused=True, donate_argnums=donate)
                    .trace(*sds)
                    .lower()
                    .compile()
                )
                self.counters.add("compiles")
                if cache is not None and not callbacks():
                    record = _entry.Entry(
                        key=key,
                        name=self.kind,
                        in_avals=avals,
                        out_avals=out_avals,
                        out_tree=jax.tree_util.tree_structure([0] * len(out_avals)),
                        arg_names=("",) * len(avals),
                        result_paths=tuple(f"result[{i}]" for i in range(len(out_avals))),
                    )
                    _component._store_executable(cache, key, record, exe, None)
            self._exes[memo_key] = exe
            return exe


def _has_callbacks(closed: Any) -> bool:
    from ._jaxcompat import has_host_callbacks

    return has_host_callbacks(closed)


GLUE = _ProgramCache("glue")
# Whole-program forms of split programs (see ``_whole``).
WHOLE = _ProgramCache("whole program")


def _split(
    jaxpr: Any, donated: set[Any]
) -> tuple[list[tuple[str, list[Any], list[Any], list[Any], tuple[int, ...]]], set[Any]]:
    """Cuts ``jaxpr`` into runs of glue equations and single component calls.

    Returns (kind, eqns, invars, outvars, donate positions) per step, and the
    donated inputs no glue step consumed."""
    groups: list[tuple[str, list[Any]]] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is component_p:
            groups.append(("component", [eqn]))
        elif groups and groups[-1][0] == "glue":
            groups[-1][1].append(eqn)
        else:
            groups.append(("glue", [eqn]))
    # Liveness: which variables each step must hand on.
    needed_after: list[set[Any]] = [set() for _ in groups]
    live = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    last_use: dict[Any, int] = {}
    for i in range(len(groups) - 1, -1, -1):
        needed_after[i] = set(live)
        for eqn in groups[i][1]:
            for v in eqn.invars:
                if not isinstance(v, Literal):
                    live.add(v)
                    last_use.setdefault(v, i)
    steps: list[tuple[str, list[Any], list[Any], list[Any], tuple[int, ...]]] = []
    consumed: set[Any] = set()
    for i, (kind, eqns) in enumerate(groups):
        defined: set[Any] = set()
        invars: list[Any] = []
        for eqn in eqns:
            for v in eqn.invars:
                if not isinstance(v, Literal) and v not in defined and v not in invars:
                    invars.append(v)
            defined.update(v for v in eqn.outvars if not isinstance(v, DropVar))
        if kind == "component":
            outvars = list(eqns[0].outvars)
            steps.append((kind, eqns, list(eqns[0].invars), outvars, ()))
            continue
        outvars = [
            v
            for eqn in eqns
            for v in eqn.outvars
            if not isinstance(v, DropVar) and v in needed_after[i]
        ]
        donate = tuple(
            j
            for j, v in enumerate(invars)
            if v in donated and last_use.get(v) == i and v not in needed_after[i]
        )
        consumed.update(invars[j] for j in donate)
        steps.append((kind, eqns, invars, outvars, donate))
    return steps, donated - consumed


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _submit_jobs(
    jobs: dict[Any, Callable[[], Any]],
) -> dict[Any, concurrent.futures.Future[Any]]:
    """Starts the jobs (loading or compiling executables), in order, on a pool of
    threads: XLA compiles without holding the GIL, so a block's forward and
    backward executables compile at the same time, and while earlier steps run.
    Each job sees the caller's context (the cache set by ``using_cache``) and
    mesh (``jax.set_mesh``: JAX keeps it per thread)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = max(2, os.cpu_count() or 1)
            _POOL = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxaot-jit")
        pool = _POOL
    mesh = _sharding.MeshContext()
    if not mesh.empty:
        jobs = {k: functools.partial(_with_mesh, mesh, job) for k, job in jobs.items()}
    return {k: pool.submit(contextvars.copy_context().run, job) for k, job in jobs.items()}


def _with_mesh(mesh: _sharding.MeshContext, job: Callable[[], Any]) -> Any:
    with mesh.entered():
        return job()


_AVAL = operator.attrgetter("aval")
_SHARDING = operator.attrgetter("sharding")


def _avals(leaves: Sequence[Any], arrays: bool) -> tuple[Any, ...]:
    """``jax.typeof`` of each leaf; for plain arrays (``arrays``: every leaf is
    one), without its per-leaf cost."""
    if arrays and jax.sharding.NamedSharding not in set(map(type, map(_SHARDING, leaves))):
        return tuple(map(_AVAL, leaves))  # what jax.typeof gives for these
    return tuple(jax.typeof(x) for x in leaves)


_ARRAY_TYPES = {type(jax.numpy.zeros(()))}


_UNSET: Any = object()


def _check_shardings(what: str, value: Any) -> None:
    """``in_shardings``/``out_shardings``: shardings, partition specs or ``None``
    (unconstrained) in a pytree prefix of the arguments or results."""
    leaves = jax.tree_util.tree_leaves(value, is_leaf=_is_target)
    for leaf in leaves:
        if not _is_target(leaf):
            raise TypeError(
                f"jaxaot.jit: {what} must hold jax.sharding.Sharding, PartitionSpec or "
                f"None leaves, got {type(leaf).__name__}: {leaf!r}"
            )


def _is_target(x: Any) -> bool:
    return x is None or isinstance(x, jax.sharding.Sharding | jax.sharding.PartitionSpec)


def _target(x: Any, what: str) -> Any:
    if isinstance(x, jax.sharding.PartitionSpec):
        mesh = jax.sharding.get_mesh()
        if mesh.empty:
            raise ValueError(f"jaxaot.jit: a PartitionSpec in {what} needs a mesh (jax.set_mesh)")
        return jax.sharding.NamedSharding(mesh, x)
    return x


def _flat_targets(prefix: Any, tree: Any, what: str) -> tuple[Any, ...]:
    """For each leaf of ``tree`` (positional arguments, or results), the sharding a
    pytree prefix of it gives (``None``: unconstrained). A single sharding (or
    spec, or ``None``) counts for every leaf, as in ``jax.jit``."""
    if _is_target(prefix):
        return (_target(prefix, what),) * len(jax.tree_util.tree_leaves(tree))
    if isinstance(tree, tuple) and isinstance(prefix, list):
        prefix = tuple(prefix)
    leaves, prefix_def = jax.tree_util.tree_flatten(prefix, is_leaf=_is_target)
    out: list[Any] = []
    subtrees = prefix_def.flatten_up_to(tree)  # type: ignore[attr-defined]
    for target, subtree in zip(leaves, subtrees, strict=True):
        out += [_target(target, what)] * len(jax.tree_util.tree_leaves(subtree))
    return tuple(out)


def _reshard(out: list[Any], targets: Sequence[Any]) -> list[Any]:
    """``out`` with each array moved to its target sharding where it is elsewhere."""
    return [
        x
        if t is None or not isinstance(x, jax.Array) or x.sharding.is_equivalent_to(t, x.ndim)
        else jax.device_put(x, t)
        for x, t in zip(out, targets, strict=True)
    ]


def _entry_for(call: Any, shardings: tuple[Any, ...] | None) -> Any:
    if shardings is None:
        return call.component._call_executable(call)
    return call.component._call_executable(call, shardings)


def _glue_for(
    glue: Any, donate: tuple[int, ...], text: str, shardings: tuple[Any, ...] | None
) -> Any:
    return GLUE.get(glue, donate, shardings, text)


def _output_shardings(exe: Any) -> list[Any]:
    return list(jax.tree_util.tree_leaves(exe.output_shardings))


def _chained(
    makers: Sequence[tuple[Callable[[tuple[Any, ...] | None], Any], Any, str]],
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
        return _sharding.region_sharding(_output_shardings(futures[k].result())[j])

    def job(k: int) -> Any:
        shardings = tuple(sharding(i) for i in step_ins[k])
        return makers[k][0](shardings)

    for k, outs in enumerate(step_outs):
        futures.append(_submit_jobs({k: functools.partial(job, k)})[k])
        for j, slot in enumerate(outs):
            producer[slot] = (k, j)
    return futures


class RegionalFunction:
    """A function compiled region by region; see :func:`jit`."""

    def __init__(
        self,
        fun: Callable[..., Any],
        *,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (),
        whole_program: bool = True,
        in_shardings: Any = _UNSET,
        out_shardings: Any = _UNSET,
    ) -> None:
        self.__wrapped__ = fun
        self._static_argnums = (
            (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        )
        self._static_argnames = (
            (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        )
        self._donate_argnums = (
            (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        )
        self._whole_program = bool(whole_program)
        placement: dict[str, Any] = {}
        if in_shardings is not _UNSET:
            _check_shardings("in_shardings", in_shardings)
            placement["in_shardings"] = in_shardings
        if out_shardings is not _UNSET:
            _check_shardings("out_shardings", out_shardings)
            placement["out_shardings"] = out_shardings
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        self._in_targets: dict[Any, tuple[Any, ...]] = {}
        self._jitted = jax.jit(
            fun,
            static_argnums=self._static_argnums,
            static_argnames=self._static_argnames,
            donate_argnums=self._donate_argnums,
            **placement,
        )
        self._plans: dict[Any, Plan | None] = {}
        # Calls of plain arguments whose plan runs its whole-program form go
        # through JAX's C++ dispatcher straight to that executable (see
        # ``_dispatch_miss``); not with static arguments, donation or placements.
        self._simple = (
            not self._static_argnums
            and not self._static_argnames
            and not self._donate_argnums
            and in_shardings is _UNSET
            and out_shardings is _UNSET
        )
        self._dispatch: Callable[..., Any] | None = None
        # The last call's signature, in parts, and its plan (see ``_lookup``).
        self._last: tuple[Any, ...] | None = None
        self._lock = threading.Lock()
        self.__name__ = getattr(fun, "__name__", "function")
        self.__doc__ = getattr(fun, "__doc__", None)
        self._reset_dispatch()

    def __repr__(self) -> str:
        return f"<jaxaot.jit {self.__name__}>"

    def _dynamic(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Any], Any, tuple[Any, ...], list[int]]:
        if not self._static_argnums and not self._static_argnames and not self._donate_argnums:
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
            return leaves, treedef, (), []
        n = len(args)
        static_pos = {i % n for i in self._static_argnums if -n <= i < n} if n else set()
        donate_pos = {i % n for i in self._donate_argnums if -n <= i < n} if n else set()
        dyn_args: list[Any] = []
        statics: list[tuple[Any, Any]] = []
        donated_flags: list[bool] = []
        for i, a in enumerate(args):
            if i in static_pos:
                statics.append((i, a))
            else:
                dyn_args.append(a)
                donated_flags.append(i in donate_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        statics += [(k, v) for k, v in sorted(kwargs.items()) if k in self._static_argnames]
        leaves, treedef = jax.tree_util.tree_flatten((tuple(dyn_args), dyn_kwargs))
        donated_leaves: list[int] = []
        offset = 0
        for a, donated in zip(dyn_args, donated_flags, strict=True):
            count = len(jax.tree_util.tree_leaves(a))
            if donated:
                donated_leaves.extend(range(offset, offset + count))
            offset += count
        return leaves, treedef, tuple(statics), donated_leaves

    def _placed(self, leaves: list[Any], treedef: Any) -> list[Any] | None:
        """The leaves placed as ``in_shardings`` says (as ``jax.jit`` places them:
        host values and uncommitted arrays are put there); ``None`` where a
        committed array is elsewhere (``jax.jit`` says what happens then)."""
        targets = self._in_targets.get(treedef)
        if targets is None:
            dyn_args, _ = jax.tree_util.tree_unflatten(treedef, leaves)
            targets = _flat_targets(self._in_shardings, dyn_args, "in_shardings")
            targets += (None,) * (len(leaves) - len(targets))  # keyword arguments
            self._in_targets[treedef] = targets
        placed = list(leaves)
        for i, (leaf, target) in enumerate(zip(leaves, targets, strict=True)):
            if target is None:
                continue
            if isinstance(leaf, jax.Array) and leaf.committed:
                if not leaf.sharding.is_equivalent_to(target, leaf.ndim):
                    return None
            else:
                placed[i] = jax.device_put(leaf, target)
        return placed

    def _reset_dispatch(self) -> None:
        """A fresh C++ dispatcher: it knows no executable."""
        self._dispatch = (
            cpp_dispatcher(self.__name__, self._dispatch_miss) if self._simple else None
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dispatch = self._dispatch
        if dispatch is not None and trace_state_clean():
            # Hot path: a signature seen before whose plan runs the whole program
            # runs in C++; every other call comes back to ``_dispatch_miss``.
            return dispatch(*args, **kwargs)
        return self._call_slow(args, kwargs, *self._dynamic(args, kwargs))

    def _dispatch_miss(self, *args: Any, **kwargs: Any) -> tuple[Any, Any, bool]:
        """A call the C++ dispatcher has no fast path for. It gets one (the
        whole-program executable, taking the call's argument tree) when this
        call's plan, found as the Python path finds it, runs the whole program:
        the dispatcher's signature (tree, types with weak types, shardings,
        committedness, configuration) then stands for this plan's. Otherwise the
        call runs the Python path, and the next one with its signature comes back
        here. A plan that leaves the whole program resets the dispatcher."""
        parts = self._dynamic(args, kwargs)
        leaves, treedef, statics, donated = parts
        if (
            trace_state_clean()
            and set(map(type, leaves)) <= _ARRAY_TYPES
            and _sharding.MeshContext().empty
        ):
            plan = self._lookup(args, kwargs, leaves, treedef, statics, donated, True)
            if plan is not None and plan.mode is _plan.WHOLE and not plan.donated:
                exe = plan.structured(treedef, _submit_background, WHOLE.payload)
                if exe is not None:
                    plan.on_leave_whole = self._reset_dispatch
                    return fastpath_miss(exe, args, kwargs)  # type: ignore[no-any-return]
        # No fast path for this signature yet: the dispatcher forgets it (True),
        # so that a later call can give it one.
        return self._call_slow(args, kwargs, *parts), None, True

    def _call_slow(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        treedef: Any,
        statics: tuple[Any, ...],
        donated: list[int],
    ) -> Any:
        arrays = set(map(type, leaves)) <= _ARRAY_TYPES  # so no tracer among them
        if not trace_state_clean() or (not arrays and any(isinstance(x, Tracer) for x in leaves)):
            return self._jitted(*args, **kwargs)  # inside another trace: an ordinary jax.jit
        if self._in_shardings is not _UNSET:
            try:
                placed = self._placed(leaves, treedef)
            except (TypeError, ValueError):  # jax.jit says what is wrong with them
                placed = None
            if placed is None:
                return self._jitted(*args, **kwargs)
            leaves = placed
            arrays = set(map(type, leaves)) <= _ARRAY_TYPES
        plan = self._lookup(args, kwargs, leaves, treedef, statics, donated, arrays)
        if plan is None:
            return self._jitted(*args, **kwargs)
        try:
            out = plan(leaves)  # type: ignore[operator]
        except PlanFailed as e:  # nothing donated yet: jax.jit gives the result
            self._give_up(self._signature(leaves, treedef, statics, arrays), e)
            return self._jitted(*args, **kwargs)
        if plan.out_shardings is not None:  # type: ignore[union-attr]
            out = _reshard(out, plan.out_shardings)  # type: ignore[union-attr]
        return jax.tree_util.tree_unflatten(plan.out_tree, out)  # type: ignore[union-attr]

    def _lookup(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        treedef: Any,
        statics: tuple[Any, ...],
        donated: list[int],
        arrays: bool,
    ) -> Plan | None:
        """The plan for these leaves (made on the first call of its signature).

        A step loop calls with the same signature every time: for plain arrays,
        the last call's signature is compared part by part (each part's elements
        are mostly the very objects of the last call, which compare at once),
        before the full signature is built and hashed."""
        if arrays:
            shardings: tuple[Any, ...] = tuple(map(_SHARDING, leaves))
            types = tuple(map(_AVAL, leaves))
            mesh = (jax.sharding.get_abstract_mesh(), jax.sharding.get_mesh())
            context = trace_context()
            last = self._last
            if (
                last is not None
                and last[0] == treedef
                and last[1] == types
                and last[2] == shardings
                and last[3] == mesh
                and last[4] == statics
                and last[5] == context
            ):
                return last[6]  # type: ignore[no-any-return]
        sig = self._signature(leaves, treedef, statics, arrays)
        plan = self._plans.get(sig, False)
        if plan is False:
            with self._lock:
                plan = self._plans.get(sig, False)
                if plan is False:
                    plan = self._plan(args, kwargs, donated, leaves)
                    plan = self._agreed(plan)
                    self._plans[sig] = plan
        if arrays:
            self._last = (treedef, types, shardings, mesh, statics, context, plan)
        return plan  # type: ignore[return-value]

    @staticmethod
    def _signature(leaves: Sequence[Any], treedef: Any, statics: Any, arrays: bool) -> Any:
        """What tells plans apart: the types, shardings, the mesh in context and
        the configuration ``jax.jit`` traces again for (x64, matmul precision,
        dtype promotion, ...); for plain arrays, a function of each leaf's
        ``aval`` and ``sharding``."""
        if arrays:
            shardings: tuple[Any, ...] = tuple(map(_SHARDING, leaves))
        else:
            shardings = tuple(getattr(x, "sharding", None) for x in leaves)
        mesh = (jax.sharding.get_abstract_mesh(), jax.sharding.get_mesh())
        return (treedef, _avals(leaves, arrays), statics, shardings, mesh, trace_context())

    def _agreed(self, plan: Plan | None) -> Plan | None:
        """In a multi-process job, the plan if every process could split the program
        and make every executable, else ``None`` in every process (so that all run
        ``jax.jit`` and their collectives match). The first call then waits for
        all executables before it runs. Elsewhere, ``plan``."""
        if jax.process_count() <= 1:
            return plan
        ok = plan is not None
        if plan is not None:
            try:
                plan.wait()
            except PlanFailed as e:
                logger.debug("jaxaot.jit %s: not split here (%s)", self.__name__, e)
                ok = False
        decision = f"jit:{self.__name__}:{_distributed.next_decision()}"
        if not _distributed.agree(decision, ok):
            logger.debug("jaxaot.jit %s: not split in every process; using jax.jit", self.__name__)
            return None
        return plan

    def _give_up(self, sig: Any, error: Exception) -> None:
        logger.debug("jaxaot.jit %s: not split (%s); using jax.jit", self.__name__, error)
        with self._lock:
            self._plans[sig] = None
            self._last = None
            self._reset_dispatch()

    def precompile(self, *args: Any, **kwargs: Any) -> None:
        """Traces, splits and loads or compiles every executable for this signature,
        without running anything; returns when all are ready."""
        leaves, treedef, statics, donated = self._dynamic(args, kwargs)
        if self._in_shardings is not _UNSET:
            placed = self._placed(leaves, treedef)
            if placed is None:
                return
            leaves = placed
        sig = self._signature(leaves, treedef, statics, set(map(type, leaves)) <= _ARRAY_TYPES)
        with self._lock:
            if sig not in self._plans:
                self._plans[sig] = self._agreed(self._plan(args, kwargs, donated, leaves))
            plan = self._plans[sig]
        if plan is not None:
            try:
                plan.wait()
            except PlanFailed as e:
                self._give_up(sig, e)

    def _plan(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], donated: list[int], leaves: list[Any]
    ) -> Plan | None:
        try:
            return self._build_plan(args, kwargs, donated, leaves)
        except Exception as e:  # never a wrong result: fall back to jax.jit
            logger.debug(
                "jaxaot.jit %s: not split (%s: %s); using jax.jit",
                self.__name__,
                type(e).__name__,
                e,
            )
            return None

    def _build_plan(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], donated: list[int], leaves: list[Any]
    ) -> Plan | None:
        # Where each input is: a sharded program (some input placed on a mesh or
        # another device, or a mesh in context) compiles each region for the
        # shardings its inputs have, which are known only once the regions before
        # it are compiled.
        placements = [_sharding.region_placement(x) for x in leaves]
        sharded = any(p is not None for p in placements) or not _sharding.MeshContext().empty
        # Executables that autodiff will surely need start compiling during the trace
        # (unsharded programs: their input shardings are known before the trace).
        early: dict[Any, concurrent.futures.Future[Any]] = {}

        def prefetch(call: Any) -> None:
            if call.key not in early:
                job = functools.partial(call.component._call_executable, call)
                early.update(_submit_jobs({call.key: job}))

        token = None if sharded else PREFETCH.set(prefetch)
        try:
            traced = self._jitted.trace(*args, **kwargs)
        finally:
            if token is not None:
                PREFETCH.reset(token)
        closed = traced.jaxpr
        if not _contains_components(closed.jaxpr):
            logger.debug("jaxaot.jit %s: no component calls; using jax.jit", self.__name__)
            return None
        in_avals = closed.in_avals
        if len(in_avals) != len(placements):
            raise ValueError(f"{len(in_avals)} traced inputs for {len(placements)} leaves")
        flat = jax.make_jaxpr(lambda *xs: _eval_inlined(closed.jaxpr, closed.consts, xs))(
            *[
                jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=p)
                for a, p in zip(in_avals, placements, strict=True)
            ]
        )
        jaxpr = flat.jaxpr
        donated_vars = {jaxpr.invars[i] for i in donated}
        split, leftover = _split(jaxpr, donated_vars)
        # Slots: the inputs, then the constants and literals, then what steps compute.
        slots: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars)}
        fixed: list[Any] = []
        for v, c in zip(jaxpr.constvars, flat.consts, strict=True):
            slots[v] = len(slots)
            fixed.append(c)
        literals: dict[int, int] = {}

        def slot(v: Any) -> int:
            if isinstance(v, Literal):
                if id(v) not in literals:
                    literals[id(v)] = len(jaxpr.invars) + len(fixed)
                    fixed.append(v.val)
                return literals[id(v)]
            return slots[v]

        for _, _, invars, _, _ in split:
            for v in invars:
                if isinstance(v, Literal):
                    slot(v)
        for v in jaxpr.outvars:
            if isinstance(v, Literal):
                slot(v)
        n_fixed = len(jaxpr.invars) + len(fixed)
        # Literals were added after the constants; renumber step outputs past them.
        next_slot = n_fixed
        for _, _, _, outvars, _ in split:
            for v in outvars:
                if not isinstance(v, DropVar) and v not in slots:
                    slots[v] = next_slot
                    next_slot += 1
        # What each step runs: a component's entry, or a glue program.
        makers: list[tuple[Callable[[tuple[Any, ...] | None], Any], Any, str]] = []
        for kind, eqns, invars, outvars, donate in split:
            if kind == "component":
                call = eqns[0].params["call"]
                makers.append((functools.partial(_entry_for, call), call.key, call.name))
            else:
                glue = ClosedJaxpr(
                    Jaxpr(
                        constvars=(),
                        invars=invars,
                        outvars=outvars,
                        eqns=eqns,
                        effects=join_effects(*(e.effects for e in eqns)),
                        debug_info=jaxpr.debug_info,
                    ),
                    (),
                )
                text = str(glue)
                makers.append(
                    (
                        functools.partial(_glue_for, glue, donate, text),
                        (text, tuple(glue.in_avals), donate),
                        "glue",
                    )
                )
        step_ins = [tuple(slot(v) for v in invars) for _, _, invars, _, _ in split]
        step_outs = [
            tuple(slot(v) if not isinstance(v, DropVar) else next_slot for v in outvars)
            for _, _, _, outvars, _ in split
        ]
        if sharded:
            for f in early.values():
                f.cancel()
            known = dict(enumerate(placements))
            for i, value in enumerate(fixed):
                known[len(placements) + i] = _sharding.region_placement(value)
            step_futures = _chained(makers, step_ins, step_outs, known)
        else:
            # One job per distinct entry or glue program, all started now.
            jobs: dict[Any, Callable[[], Any]] = {}
            for make, job_key, _ in makers:
                jobs.setdefault(job_key, functools.partial(make, None))
            futures = {k: f for k, f in early.items() if k in jobs}
            for k, f in early.items():
                if k not in jobs:  # autodiff ran under another transformation (vmap of grad)
                    f.cancel()
            futures.update(_submit_jobs({k: job for k, job in jobs.items() if k not in futures}))
            step_futures = [futures[job_key] for _, job_key, _ in makers]
        steps = [
            Step(split[k][0], step_futures[k], step_ins[k], step_outs[k], label, bool(split[k][4]))
            for k, (_, _, label) in enumerate(makers)
        ]
        delete_after = [i for i, v in enumerate(jaxpr.invars) if v in leftover]
        n_comp = sum(s.kind == "component" for s in steps)
        logger.debug(
            "jaxaot.jit %s: %d component calls, %d glue programs%s",
            self.__name__,
            n_comp,
            len(steps) - n_comp,
            " (sharded)" if sharded else "",
        )
        start_whole = None
        # Sharded programs have no whole-program form: the choice between the two
        # forms is by local timing, which differs from process to process (their
        # collectives would diverge), and its executable is compiled unsharded.
        if self._whole_program and not jaxpr.effects and not sharded:
            start_whole = functools.partial(self._start_whole, jaxpr, tuple(donated))
        out_shardings = None
        if self._out_shardings is not _UNSET:
            outs = jax.tree_util.tree_unflatten(traced.out_tree, list(jaxpr.outvars))
            out_shardings = list(_flat_targets(self._out_shardings, outs, "out_shardings"))
        return Plan(
            name=self.__name__,
            n_inputs=len(jaxpr.invars),
            fixed=fixed,
            n_consts=len(flat.consts),
            n_slots=next_slot + 1,
            steps=steps,
            out_slots=[slot(v) for v in jaxpr.outvars],
            out_tree=traced.out_tree,
            delete_after=delete_after,
            donated=donated,
            start_whole=start_whole,
            out_shardings=out_shardings,
            in_flight=_in_flight_limit() if sharded else None,
        )

    def _start_whole(
        self, jaxpr: Any, donated: tuple[int, ...]
    ) -> tuple[concurrent.futures.Future[Any], int, bool] | None:
        """Starts loading or compiling the whole-program form of ``jaxpr`` (its
        inputs, then its constants) on the background threads; the job, how many
        component calls the whole program binds, and whether it calls back into
        Python. None when it would bind more than ``MAX_WHOLE_CALLS``."""
        fn, calls = _whole.program(jaxpr)
        if calls > MAX_WHOLE_CALLS:
            logger.debug(
                "jaxaot.jit %s: no whole program (%d component calls after loops, over %d)",
                self.__name__,
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
            "jaxaot.jit %s: whole program with %d component calls in the background",
            self.__name__,
            calls,
        )
        calls_back = calls_back or _has_callbacks(ClosedJaxpr(jaxpr, [None] * len(jaxpr.constvars)))
        job = functools.partial(
            WHOLE.program,
            _whole.digest(jaxpr),
            avals,
            out_avals,
            donated,
            fn,
            lambda: calls_back,
        )
        return _submit_background(job), calls, calls_back


_BACKGROUND: list[concurrent.futures.Future[Any]] = []


def _submit_background(job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """Runs ``job`` on the background threads; ``wait_for_background`` waits for it."""
    future = _submit_jobs({"background": job})["background"]
    with _POOL_LOCK:
        _BACKGROUND[:] = [f for f in _BACKGROUND if not f.done()] + [future]
    return future


# A whole program that still binds more component calls than this once its
# repeated layers are loops is not made: unrolled, it would compile for as long
# as jax.jit does (what the split program is there to avoid).
MAX_WHOLE_CALLS = 16


def _in_flight_limit() -> int | None:
    """How many multi-device executables a sharded split program may have queued
    before it waits for the oldest: XLA:CPU runs every simulated device's part of
    each queued collective on one shared thread pool, and with many executables in
    flight a collective can miss its rendezvous (XLA then ends the process). Other
    backends queue without limit. ``JAXAOT_IN_FLIGHT`` overrides (0: no limit)."""
    text = os.environ.get("JAXAOT_IN_FLIGHT", "").strip()
    if text:
        try:
            limit = int(text)
        except ValueError:
            raise ValueError(f"JAXAOT_IN_FLIGHT must be an integer, got {text!r}") from None
        return limit or None
    if jax.default_backend() == "cpu" and jax.local_device_count() > 1:
        return 8
    return None


def wait_for_background() -> None:
    """Blocks until every whole-program executable being made in the background
    is made (or failed)."""
    with _POOL_LOCK:
        pending = list(_BACKGROUND)
    concurrent.futures.wait(pending)


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    whole_program: bool = True,
    in_shardings: Any = _UNSET,
    out_shardings: Any = _UNSET,
) -> Any:
    """Like ``jax.jit``, for programs that call components: each component is
    compiled once per signature (and per derived transformation) instead of
    once per call site, and the glue between component calls is compiled once
    per distinct glue program. Executables live in the cache, so a warm
    process neither traces component bodies nor compiles them.

    With ``whole_program`` (the default), once the split program has run, a
    whole-program form of it (one executable, in which repeated layers are a
    loop over one compiled layer) is compiled in the background, kept in the
    cache, and used from then on if it runs faster: small steps then cost what
    one executable costs, not one executable per layer.

    ``in_shardings`` and ``out_shardings`` are those of ``jax.jit`` (shardings,
    or partition specs under ``jax.set_mesh``, in a pytree prefix of the
    positional arguments or of the results; ``None``: unconstrained). Inputs
    are placed as ``jax.jit`` places them (a committed array elsewhere goes to
    ``jax.jit``, which says what is wrong); results are moved where
    ``out_shardings`` says. Sharded programs are split too; see the module
    docstring for the shardings each region is compiled for and for what an
    output's sharding is without ``out_shardings``.

    Example::

        @jaxaot.jit
        def train_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # loss_fn calls components
            ...
    """

    def wrap(f: Callable[..., Any]) -> RegionalFunction:
        return RegionalFunction(
            f,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            whole_program=whole_program,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
        )

    return wrap if fun is None else wrap(fun)
