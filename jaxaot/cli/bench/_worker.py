"""The timing worker: one contender of one benchmark, in a fresh process.

The parent starts ``python -c "...; from jaxaot.cli.bench._worker import main;
main(seconds_to_import)" JOB`` with a :class:`~._config.Job` as JSON (the
contender, the depth, the work folder shared by one trial's processes, the
model's shape and step, and for the sharded suite the mesh). The worker builds
the model, places it, times the contender and prints one JSON line: the row.

Contenders that prepare something for another (JAX's persistent cache, a
``jax.export`` artifact, a serialized executable, a jaxaot cache) leave it in
the work folder.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _edits
from ._config import Job, ModelShape
from ._measure import (
    PHASES,
    block,
    early_steps,
    load_all_executables,
    measure_stages,
    settle,
    steady,
    steady_after_warmup,
    timed,
)
from ._mesh import Placement, placement

__all__ = ["main", "worker"]


@dataclass
class _Run:
    """What a contender works with: its job, the placed model and its block, and
    the row it fills in."""

    job: Job
    blocks: Any
    x: Any
    block: Callable[..., Any]
    placement: Placement
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def work(self) -> Path:
        return Path(self.job.work)

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.blocks, self.x)

    def make_step(self, block_fn: Callable[..., Any]) -> Callable[..., Any]:
        """The benchmark's step over the layers, each layer ``block_fn``."""
        import jax
        import jax.numpy as jnp

        def loss(blocks: Any, x: Any) -> Any:
            for p in blocks:
                x = block_fn(p, x)
            return jnp.mean(x**2)

        def step(blocks: Any, x: Any) -> Any:
            return jax.value_and_grad(loss)(blocks, x)

        return loss if self.job.shape.inference else step


def _model(layers: int, shape: ModelShape) -> tuple[Any, Any]:
    """The parameters of ``layers`` blocks and an input batch (on the default device)."""
    import jax
    import jax.numpy as jnp

    from .. import _model as model_lib

    blocks = model_lib.init_blocks(jax.random.key(0), layers, shape.width)
    x = jax.random.normal(jax.random.key(1), (shape.batch, shape.seq, shape.width), jnp.float32)
    return block((blocks, x))


# -- the contenders ------------------------------------------------------------------


def _jit(run: _Run) -> None:
    """``jax.jit`` of the step (with JAX's persistent cache for the ``pcc`` contenders)."""
    import jax

    measure_stages(jax.jit(run.make_step(run.block)), run.args, run.result, run.job.repeats)


def _jit_components(run: _Run) -> None:
    """``jax.jit`` of the step calling a component block (inlined, no cache)."""
    import jax

    import jaxaot

    jaxaot.set_cache(None)
    step = run.make_step(jaxaot.component(run.block))
    measure_stages(jax.jit(step), run.args, run.result, run.job.repeats)


def _scan(run: _Run, remat: bool = False) -> None:
    """``jax.jit`` of the same step with the layers stacked, under ``lax.scan``
    (each layer a ``jax.checkpoint`` region where ``remat``)."""
    import jax

    stacked = jax.tree_util.tree_map(lambda *xs: jax.numpy.stack(xs), *run.blocks)
    stacked = block(run.placement.place(stacked, "stacked"))
    block_fn = jax.checkpoint(run.block) if remat else run.block

    def scan_loss(stacked: Any, x: Any) -> Any:
        def body(h: Any, p: Any) -> Any:
            return block_fn(p, h), None

        h, _ = jax.lax.scan(body, x, stacked)
        return jax.numpy.mean(h**2)

    step = scan_loss if run.job.shape.inference else jax.value_and_grad(scan_loss)
    measure_stages(jax.jit(step), (stacked, run.x), run.result, run.job.repeats)


def _noinline(run: _Run) -> None:
    """``jax.jit`` of the step whose layers are Equinox ``noinline`` calls."""
    import jax
    from equinox.internal import noinline

    step = run.make_step(noinline(run.block))
    measure_stages(jax.jit(step), run.args, run.result, run.job.repeats)


def _regional(run: _Run) -> None:
    """``jaxaot.jit`` of the step calling component blocks, cold or warm."""
    import jaxaot

    _regional_step(run, run.make_step(jaxaot.component(run.block)), "jaxaot-regional")


def _remat_regional(run: _Run) -> None:
    """``jaxaot.jit`` of the step whose layers are ``jax.checkpoint`` regions, with no
    jaxaot annotation (found as blocks), cold or warm."""
    import jax

    _regional_step(run, run.make_step(jax.checkpoint(run.block)), "jaxaot-remat")


def _regional_step(run: _Run, fn: Callable[..., Any], cache: str) -> None:
    """``jaxaot.jit`` of ``fn`` with the cache in ``cache`` (under the work folder).

    The first call traces and splits the program (timed as "trace"), then runs it
    while its executables compile or load on background threads (all of that is
    "first run": the phases overlap)."""
    import jaxaot

    result = run.result
    jaxaot.set_cache(jaxaot.DirectoryCache(run.work / cache))
    step = jaxaot.jit(fn)
    make_plan = step._plan

    def timed_plan(*a: Any) -> Any:
        plan, result["trace"] = timed(lambda: make_plan(*a))
        return plan

    step._plan = timed_plan  # type: ignore[method-assign]
    _, first_call = timed(lambda: block(step(*run.args)))
    result["first_run"] = first_call - result["trace"]
    if run.job.mesh is None:  # the regional suite's figure (the sharded suite's steps are long)
        early_steps(step, run.args, result, first_call)
    settle(step, run.args, result)
    result["steady"] = steady_after_warmup(lambda: step(*run.args), run.job.repeats)
    result["stats"] = jaxaot.stats()


def _remat(run: _Run) -> None:
    """``jax.jit`` of the step whose layers are ``jax.checkpoint`` regions."""
    import jax

    measure_stages(
        jax.jit(run.make_step(jax.checkpoint(run.block))), run.args, run.result, run.job.repeats
    )


def _remat_limit(run: _Run) -> None:
    """The floor of a warm start of the remat'd step: reading and loading every
    executable the cold ``jaxaot.jit`` run wrote ("compile / load"), then the first
    run of the loaded executables ("first run"), with the trace and split done
    beforehand and not counted."""
    import jax

    import jaxaot

    cache = jaxaot.DirectoryCache(run.work / "jaxaot-remat")
    run.result["loaded"], run.result["compile"] = timed(lambda: len(load_all_executables(cache)))
    jaxaot.set_cache(cache)
    step = jaxaot.jit(run.make_step(jax.checkpoint(run.block)))
    # Trace, split and load everything first (not part of the floor), then time the
    # first run of the loaded executables: what any warm start must pay after loading.
    step.precompile(*run.args)
    _, run.result["first_run"] = timed(lambda: block(step(*run.args)))
    settle(step, run.args, {})
    run.result["steady"] = steady_after_warmup(lambda: step(*run.args), run.job.repeats)


def _shared_cache(spec: dict[str, str] | None) -> Any:
    """The fleet suite's shared cache, as the job names it."""
    import jaxaot

    if spec is None:
        raise ValueError("a fleet member needs the job's cache")
    if "redis" in spec:
        return jaxaot.RedisCache(spec["redis"], prefix=spec["prefix"])
    return jaxaot.DirectoryCache(spec["dir"])


def _fleet_member(run: _Run) -> None:
    """One cold process of ``bench fleet``: ``jaxaot.jit`` of the step over component
    layers on the shared cache the job names. It prints ``ready`` and waits for a
    line on stdin (the start barrier, so that the fleet misses all at once), then
    times its first result; its counts are what it did from the barrier on, its
    background cache writes included."""
    import jaxaot

    jaxaot.set_cache(_shared_cache(run.job.cache))
    step = jaxaot.jit(run.make_step(jaxaot.component(run.block)))
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    before = jaxaot.stats()
    _, run.result["first_run"] = timed(lambda: block(step(*run.args)))
    jaxaot.wait_for_writes()
    run.result["stats"] = {k: v - before.get(k, 0) for k, v in jaxaot.stats().items()}


def _export_prepare(run: _Run) -> None:
    import jax
    from jax import export

    exported = export.export(jax.jit(run.make_step(run.block)))(*run.args)
    (run.work / "step.export").write_bytes(exported.serialize())


def _export_warm(run: _Run) -> None:
    """A ``jax.export`` artifact read, deserialized and compiled in a fresh process
    (reading and deserializing count as tracing)."""
    import jax
    from jax import export

    blob, t_read = timed((run.work / "step.export").read_bytes)
    exported, t_deser = timed(lambda: export.deserialize(bytearray(blob)))
    measure_stages(jax.jit(exported.call), run.args, run.result, run.job.repeats)
    run.result["trace"] += t_read + t_deser


def _jaxaot_component(run: _Run) -> None:
    """The whole step as one jaxaot component, cold or warm (one ``precompile``)."""
    import jaxaot

    jaxaot.set_cache(jaxaot.DirectoryCache(run.work / "jaxaot-cache"))
    step = jaxaot.component(run.make_step(jaxaot.component(run.block)), key="bench-step")
    _, run.result["compile"] = timed(lambda: step.precompile(*run.args))
    _, run.result["first_run"] = timed(lambda: block(step(*run.args)))
    run.result["steady"] = steady(lambda: step(*run.args), run.job.repeats)
    run.result["cache_info"] = step.cache_info()._asdict()


def _limit_prepare(run: _Run) -> None:
    """Compiles and serializes the program jaxaot's step executable is (``jax.jit``
    of the step calling component blocks), so that the limit loads exactly that."""
    import jax
    from jax.experimental import serialize_executable as se

    import jaxaot

    jaxaot.set_cache(None)
    program = run.make_step(jaxaot.component(run.block))
    compiled = jax.jit(program).trace(*run.args).lower().compile()
    payload, _, _ = se.serialize(compiled)
    (run.work / "step.executable").write_bytes(payload)


def _limit(run: _Run) -> None:
    """The physical limit of a warm start: read the serialized executable,
    ``deserialize_and_load`` it, and run it."""
    import jax
    from jax.experimental import serialize_executable as se

    in_tree = jax.tree_util.tree_structure((run.args, {}))
    out = 0.0 if run.job.shape.inference else (0.0, run.blocks)
    out_tree = jax.tree_util.tree_structure(out)

    def load() -> Any:
        blob = (run.work / "step.executable").read_bytes()
        return se.deserialize_and_load(blob, in_tree, out_tree)

    compiled, run.result["compile"] = timed(load)
    _, run.result["first_run"] = timed(lambda: block(compiled(*run.args)))
    run.result["steady"] = steady(lambda: compiled(*run.args), run.job.repeats)


_CONTENDERS: dict[str, Callable[[_Run], None]] = {
    "jit_cold": _jit,
    "pcc_cold": _jit,
    "pcc_warm": _jit,
    "jit_components_cold": _jit_components,
    "scan_cold": _scan,
    "noinline_cold": _noinline,
    "regional_cold": _regional,
    "regional_warm": _regional,
    "remat_jit_cold": _remat,
    "remat_scan_cold": lambda run: _scan(run, remat=True),
    "remat_regional_cold": _remat_regional,
    "remat_regional_warm": _remat_regional,
    "remat_limit": _remat_limit,
    "export_prepare": _export_prepare,
    "export_warm": _export_warm,
    "jaxaot_cold": _jaxaot_component,
    "jaxaot_warm": _jaxaot_component,
    "limit_prepare": _limit_prepare,
    "limit": _limit,
    "fleet_member": _fleet_member,
}


def worker(job: Job, t_import: float) -> dict[str, Any]:
    """Times ``job``'s contender in this process; returns its row (each of
    :data:`PHASES`, ``first_result`` their sum, ``steady`` and what the contender
    adds)."""
    import jax

    from .. import _model as model_lib

    edit = job.contender.removeprefix("edit:") if job.contender.startswith("edit:") else None
    contender = _CONTENDERS.get(job.contender)
    if contender is None and edit is None:
        raise ValueError(f"unknown contender {job.contender!r}")
    result: dict[str, Any] = {"contender": job.contender, "layers": job.layers}
    result.update({"import": t_import} | dict.fromkeys(PHASES))
    if job.contender.startswith("pcc") or edit in _edits.PCC:
        jax.config.update("jax_compilation_cache_dir", str(Path(job.work) / "jax-pcc"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if edit is not None:  # a step of the edits suite (its model made on the host)
        result.update(_edits.run_edit(edit, job))
    else:
        assert contender is not None
        place = placement(job.mesh) if job.mesh is not None else Placement()
        with place.context():
            blocks, x = _model(job.layers, job.shape)
            blocks, x = block((place.place(blocks, "blocks"), place.place(x, "batch")))
            contender(_Run(job, blocks, x, place.block or model_lib.block, place, result))
    result["first_result"] = sum(result[p] or 0.0 for p in PHASES)
    return result


def main(t_import: float) -> None:
    """Entry point of a worker process: ``argv[1]`` is the :class:`Job` as JSON."""
    row = worker(Job.from_json(sys.argv[1]), t_import)
    sys.stdout.write(json.dumps(row) + "\n")
