"""``jaxaot bench``: warm-start benchmark against JAX's own caches.

Every contender runs in its own fresh Python process (``python -m
jaxaot._bench worker ...``), so that nothing warm in one process helps
another; prepared artifacts (JAX's persistent cache, a ``jax.export``
artifact, a serialized executable, a jaxaot cache) live in a work folder
shared by the processes of one run. Each worker prints one JSON line of
timings; the parent writes a Markdown table and a PNG plot.

Model: ``L`` pre-norm transformer blocks (4 heads, GELU MLP 4x), batch 8,
sequence 128, width 256 (``--width``, ``--batch``, ``--seq`` change them); the
step is ``value_and_grad`` of the mean square of the output with respect to
every block's parameters, or with ``--inference`` that mean square alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The benchmark model's batch, sequence and width; JAXAOT_BENCH_SHAPE="b,s,w"
# shrinks it (the test suite runs the whole benchmark on a tiny model), and so
# do ``--batch``, ``--seq`` and ``--width`` (passed on to the workers this way).
BATCH, SEQ, WIDTH = (int(v) for v in os.environ.get("JAXAOT_BENCH_SHAPE", "8,128,256").split(","))
# "train" (value_and_grad) or "inference" (the forward pass alone).
MODE = os.environ.get("JAXAOT_BENCH_MODE", "train")
# How long a jaxaot.jit contender may keep choosing its steady state before its
# steady step is measured anyway (seconds).
SETTLE_SECONDS = 600.0
PHASES = ("trace", "lower", "compile", "first_run")

# name -> (label, preparation contender or None)
REGIONAL: dict[str, tuple[str, str | None]] = {
    "jit_cold": ("jax.jit, cold", None),
    "scan_cold": ("scan over stacked layers, cold", None),
    "jit_components_cold": ("jax.jit calling components, cold", None),
    "noinline_cold": ("Equinox noinline layers, cold", None),
    "regional_cold": ("jaxaot.jit, cold", None),
    "pcc_warm": ("jax.jit + JAX persistent cache, warm", "pcc_cold"),
    "regional_warm": ("jaxaot.jit, warm", "regional_cold"),
}

CONTENDERS: dict[str, tuple[str, str | None]] = {
    "jit_cold": ("jax.jit, cold", None),
    "jit_components_cold": ("jax.jit calling components, cold", None),
    "pcc_cold": ("jax.jit + JAX persistent cache, cold", None),
    "pcc_warm": ("jax.jit + JAX persistent cache, warm", "pcc_cold"),
    "export_warm": ("jax.export artifact, fresh process", "export_prepare"),
    "jaxaot_cold": ("jaxaot component, cold", None),
    "jaxaot_warm": ("jaxaot component, warm", "jaxaot_cold"),
    "limit": ("physical limit: read + deserialize_and_load", "limit_prepare"),
}


# ----------------------------------------------------------------------------
# Worker side: one contender, in a fresh process.


def _model(layers: int) -> tuple[Any, Any, Callable[..., Any]]:
    import jax
    import jax.numpy as jnp

    from .cli import _model

    blocks = _model.init_blocks(jax.random.key(0), layers, WIDTH)
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, WIDTH), jnp.float32)

    def make_step(block_fn: Callable[..., Any]) -> Callable[..., Any]:
        def loss(blocks: Any, x: Any) -> Any:
            for p in blocks:
                x = block_fn(p, x)
            return jnp.mean(x**2)

        def step(blocks: Any, x: Any) -> Any:
            return jax.value_and_grad(loss)(blocks, x)

        return loss if MODE == "inference" else step

    jax.block_until_ready((blocks, x))
    return blocks, x, make_step


def _block(out: Any) -> Any:
    import jax

    return jax.block_until_ready(out)


# A steady-step round runs back-to-back calls for at least this long (seconds), so
# that a step of a millisecond is not timed by one call on a shared machine.
ROUND_SECONDS = 0.2


def _steady(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds a call: the median over ``repeats`` rounds of back-to-back calls,
    each call waited for before the next, a round lasting ``ROUND_SECONDS`` or
    one call."""
    t0 = time.perf_counter()
    _block(fn())
    calls = max(1, int(ROUND_SECONDS / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            _block(fn())
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _settle(step: Any, args: tuple[Any, ...], result: dict[str, Any]) -> None:
    """Runs a ``jaxaot.jit`` step until it has chosen its steady state (split or
    whole program), and records the choice and each form's steady step. (The
    forms are then set from here, so a close choice is not timed again later.)"""
    from ._regional import _plan

    start = time.perf_counter()
    (plan,) = step._plans.values()
    while plan is not None and plan.pending() and time.perf_counter() - start < SETTLE_SECONDS:
        _block(step(*args))
    result["settle"] = time.perf_counter() - start
    if plan is None:
        return
    result["steps"] = len(plan.steps)
    result["mode"] = plan.mode
    result["whole_calls"] = plan.whole_calls
    chosen = plan.mode
    for mode in (_plan.SPLIT, _plan.WHOLE):
        if mode == _plan.WHOLE and (plan.whole is None or plan.whole.exception() is not None):
            continue
        plan.mode = mode
        result[f"steady_{mode}"] = _steady_after_warmup(lambda: step(*args), 5)
    plan.mode = chosen


def _steady_after_warmup(fn: Callable[[], Any], repeats: int) -> float:
    """:func:`_steady` of a ``jaxaot.jit`` step once its background work is done,
    as in a long run: cache writes, a whole-program compile, and the C++ fast path
    the first call in this state starts loading."""
    _block(fn())
    _quiesce()
    return _steady(fn, repeats)


def _quiesce() -> None:
    """Waits for jaxaot's background work (cache writes, whole-program
    executables, C++ fast paths being loaded)."""
    import jaxaot

    from . import _regional

    _regional.wait_for_background()
    jaxaot.wait_for_writes()


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _measure_stages(
    jitted: Any, args: tuple[Any, ...], result: dict[str, Any], repeats: int
) -> None:
    """Times ``jitted``'s trace, lower, compile and first run, then its steady step."""
    traced, result["trace"] = _timed(lambda: jitted.trace(*args))
    lowered, result["lower"] = _timed(traced.lower)
    compiled, result["compile"] = _timed(lowered.compile)
    _, result["first_run"] = _timed(lambda: _block(compiled(*args)))
    result["steady"] = _steady(lambda: compiled(*args), repeats)


#: Places one of the benchmark's inputs on devices: ``place(tree, kind)`` with
#: kind ``"blocks"`` (the per-layer parameter dicts), ``"stacked"`` (the same
#: parameters stacked for scan) or ``"batch"`` (the input activations).
Placement = Callable[[Any, str], Any]


def _unplaced(tree: Any, kind: str) -> Any:
    return tree


def worker(
    contender: str,
    layers: int,
    work: Path,
    repeats: int,
    t_import: float,
    place: Placement = _unplaced,
) -> dict[str, Any]:
    import jax

    import jaxaot

    result: dict[str, Any] = {"contender": contender, "layers": layers, "import": t_import}
    for phase in PHASES:
        result[phase] = None
    if contender.startswith("pcc"):
        jax.config.update("jax_compilation_cache_dir", str(work / "jax-pcc"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    blocks, x, make_step = _model(layers)
    blocks, x = _block((place(blocks, "blocks"), place(x, "batch")))
    from .cli import _model as model_lib

    if contender in ("jit_cold", "pcc_cold", "pcc_warm", "jit_components_cold"):
        if contender == "jit_components_cold":
            jaxaot.set_cache(None)
            step = make_step(jaxaot.component(model_lib.block))
        else:
            step = make_step(model_lib.block)
        jitted = jax.jit(step)
        _measure_stages(jitted, (blocks, x), result, repeats)
    elif contender == "scan_cold":
        stacked = jax.tree_util.tree_map(lambda *xs: jax.numpy.stack(xs), *blocks)
        stacked = _block(place(stacked, "stacked"))

        def scan_loss(stacked: Any, x: Any) -> Any:
            def body(h: Any, p: Any) -> Any:
                return model_lib.block(p, h), None

            h, _ = jax.lax.scan(body, x, stacked)
            return jax.numpy.mean(h**2)

        jitted = jax.jit(scan_loss if MODE == "inference" else jax.value_and_grad(scan_loss))
        _measure_stages(jitted, (stacked, x), result, repeats)
    elif contender == "noinline_cold":
        from equinox.internal import noinline

        step = make_step(noinline(model_lib.block))
        jitted = jax.jit(step)
        _measure_stages(jitted, (blocks, x), result, repeats)
    elif contender in ("regional_cold", "regional_warm"):
        jaxaot.set_cache(jaxaot.DirectoryCache(work / "jaxaot-regional"))
        step = jaxaot.jit(make_step(jaxaot.component(model_lib.block)))
        # The first call traces and splits the program (timed as "trace"), then
        # runs it while its executables compile or load on background threads
        # (all of that is "first run": the phases overlap).
        make_plan = step._plan

        def timed_plan(*a: Any) -> Any:
            plan, result["trace"] = _timed(lambda: make_plan(*a))
            return plan

        step._plan = timed_plan  # type: ignore[method-assign]
        _, first_call = _timed(lambda: _block(step(blocks, x)))
        result["first_run"] = first_call - result["trace"]
        _settle(step, (blocks, x), result)
        result["steady"] = _steady_after_warmup(lambda: step(blocks, x), repeats)
        result["stats"] = jaxaot.stats()
    elif contender == "export_prepare":
        from jax import export

        exported = export.export(jax.jit(make_step(model_lib.block)))(blocks, x)
        (work / "step.export").write_bytes(exported.serialize())
    elif contender == "export_warm":
        from jax import export

        blob, t_read = _timed((work / "step.export").read_bytes)
        exported, t_deser = _timed(lambda: export.deserialize(bytearray(blob)))
        _measure_stages(jax.jit(exported.call), (blocks, x), result, repeats)
        result["trace"] += t_read + t_deser  # reading and deserializing count as tracing
    elif contender in ("jaxaot_cold", "jaxaot_warm"):
        jaxaot.set_cache(jaxaot.DirectoryCache(work / "jaxaot-cache"))
        step = jaxaot.component(make_step(jaxaot.component(model_lib.block)), key="bench-step")
        compiled, result["compile"] = _timed(lambda: step.precompile(blocks, x))
        _, result["first_run"] = _timed(lambda: _block(step(blocks, x)))
        result["steady"] = _steady(lambda: step(blocks, x), repeats)
        result["cache_info"] = step.cache_info()._asdict()
    elif contender == "limit_prepare":
        from jax.experimental import serialize_executable as se

        # The same program jaxaot's step executable is (jit of the step calling
        # component blocks), so the limit is loading exactly what jaxaot loads.
        jaxaot.set_cache(None)
        program = make_step(jaxaot.component(model_lib.block))
        compiled = jax.jit(program).trace(blocks, x).lower().compile()
        payload, _, _ = se.serialize(compiled)
        (work / "step.executable").write_bytes(payload)
    elif contender == "limit":
        from jax.experimental import serialize_executable as se

        in_tree = jax.tree_util.tree_structure(((blocks, x), {}))
        out_tree = jax.tree_util.tree_structure((0.0, blocks))

        def load() -> Any:
            return se.deserialize_and_load(
                (work / "step.executable").read_bytes(), in_tree, out_tree
            )

        compiled, result["compile"] = _timed(load)
        _, result["first_run"] = _timed(lambda: _block(compiled(blocks, x)))
        result["steady"] = _steady(lambda: compiled(blocks, x), repeats)
    else:
        raise ValueError(f"unknown contender {contender!r}")
    result["first_result"] = sum(result[p] or 0.0 for p in PHASES)
    return result


# ----------------------------------------------------------------------------
# Parent side.


#: Where progress lines go.
Log = Callable[[str], None]

#: Runs one contender in a fresh process: ``(contender, layers, work, repeats) -> row``.
WorkerRunner = Callable[[str, int, Path, int], dict[str, Any]]


def _run_worker(
    contender: str,
    layers: int,
    work: Path,
    repeats: int,
    module: str = "jaxaot._bench",
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Runs ``module.worker_main`` in a fresh process (``extra_env`` is set before
    it imports JAX) and returns the JSON line it prints."""
    code = (
        "import time; t0 = time.perf_counter(); import jax, jaxaot; "
        f"from {module} import worker_main; worker_main(time.perf_counter() - t0)"
    )
    cmd = [sys.executable, "-c", code, contender, str(layers), str(work), str(repeats)]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(_OVERRIDES)
    env.update(extra_env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"benchmark worker {contender} (L={layers}) failed:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_contenders(
    table: dict[str, tuple[str, str | None]],
    layers: Sequence[int],
    repeats: int,
    log: Callable[[str], None],
    skip: Callable[[str, int], bool] = lambda name, depth: False,
    run_worker: WorkerRunner | None = None,
    trials: int = 1,
) -> list[dict[str, Any]]:
    """Runs each contender of ``table`` at each depth (``run_worker``, default
    :func:`_run_worker`, looked up when called). With ``trials`` over 1 the whole
    sequence of contenders runs that many times at each depth, interleaved (each
    trial in its own work folder, so cold is cold again), and each row is the
    :func:`median_row` of a contender's trials."""
    import tempfile

    run = run_worker if run_worker is not None else _run_worker

    rows: list[dict[str, Any]] = []
    for depth in layers:
        runs: dict[str, list[dict[str, Any]]] = {}
        for trial in range(trials):
            tag = f"L={depth}" + (f", trial {trial + 1}/{trials}" if trials > 1 else "")
            with tempfile.TemporaryDirectory(prefix="jaxaot-bench-") as tmp:
                work = Path(tmp)
                prepared: set[str] = set()
                for name, (_, prep) in table.items():
                    if skip(name, depth):
                        if trial == 0:
                            log(f"L={depth}: {name} skipped")
                        continue
                    if prep is not None and prep not in prepared:
                        log(f"{tag}: preparing {prep}")
                        run(prep, depth, work, repeats)
                        prepared.add(prep)
                    log(f"{tag}: {name}")
                    row = run(name, depth, work, repeats)
                    row["label"] = table[name][0]
                    runs.setdefault(name, []).append(row)
                    prepared.add(name)
        rows += [median_row(trial_rows) for trial_rows in runs.values()]
    return rows


def median_row(trial_rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One contender's row from its trials: the median of each number that differs
    between trials (a field missing from some trials, or None in any, is taken from
    the first trial), everything else from the first trial; with more than one trial, ``trials``
    keeps each trial's first result and steady step, and its chosen form (``mode``)."""
    first = trial_rows[0]
    if len(trial_rows) == 1:
        return dict(first)
    row: dict[str, Any] = {}
    for field, value in first.items():
        values = [r.get(field) for r in trial_rows]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numbers and any(v != value for v in values):
            row[field] = statistics.median(values)  # type: ignore[type-var]
        else:  # the same in every trial (the depth, a step count), or not a number
            row[field] = value
    row["trials"] = [
        {"first_result": r.get("first_result"), "steady": r.get("steady")}
        | ({"mode": r["mode"]} if "mode" in r else {})
        for r in trial_rows
    ]
    return row


def _fmt(t: float | None) -> str:
    return "–" if t is None else f"{t:.2f}"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def markdown(rows: list[dict[str, Any]]) -> str:
    import jax

    lines = [
        f"Warm-start benchmark, {datetime.date.today().isoformat()}, jax {jax.__version__}, "
        f"backend {jax.default_backend()}, {machine()}. Times in seconds; "
        "time to first result = trace + lower + compile/load + first run "
        "(import and parameter initialisation excluded).",
        "",
        "| L | contender | import | trace | lower | compile / load | first run | first result | steady step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        label = r["label"]
        lines.append(
            f"| {r['layers']} | {label} | {_fmt(r['import'])} | {_fmt(r['trace'])} | {_fmt(r['lower'])} | "
            f"{_fmt(r['compile'])} | {_fmt(r['first_run'])} | **{_fmt(r['first_result'])}** | {_fmt(r['steady'])} |"
        )
    lines += ["", "Ratios (same run):", ""]
    by = {(r["layers"], r["contender"]): r for r in rows}
    for depth in sorted({r["layers"] for r in rows}):

        def get(name: str, field: str = "first_result", depth: int = depth) -> float:
            return float(by[(depth, name)][field])

        lines.append(
            f"- L={depth}: jaxaot warm / physical limit = {get('jaxaot_warm') / get('limit'):.2f}; "
            f"jaxaot warm / jit+JAX cache warm = {get('jaxaot_warm') / get('pcc_warm'):.2f}; "
            f"jaxaot cold / jit cold = {get('jaxaot_cold') / get('jit_cold'):.2f}; "
            f"steady step, jit with components / plain jit = "
            f"{get('jit_components_cold', 'steady') / get('jit_cold', 'steady'):.3f}"
        )
    lines.append(
        "\njaxaot cold's compile/load column includes its trace and lowering (one call: "
        "`Component.precompile`); export's trace column includes reading and deserializing the artifact."
    )
    return "\n".join(lines) + "\n"


#: What each contender's "compile" phase is: a real compile, one call that
#: traces, lowers and compiles (``Component.precompile`` on a cold cache), or a
#: load of a stored executable.
STAGE_OF_COMPILE = {
    "jaxaot_cold": "trace+lower+compile",
    "jaxaot_warm": "load",
    "pcc_warm": "load",
    "limit": "load",
}
STAGE_COLORS = {
    "trace": "#4c72b0",
    "lower": "#55a868",
    "compile": "#c44e52",
    "trace+lower+compile": "#dd8452",
    "load": "#937860",
    "first run": "#8172b2",
}


def figure_note(date: str | None = None) -> str:
    """The date, JAX version, backend and machine a figure's numbers come from."""
    import jax

    day = date or datetime.date.today().isoformat()
    return f"{day}, jax {jax.__version__}, backend {jax.default_backend()}, {machine()}"


def plot(rows: list[dict[str, Any]], path: Path, note: str | None = None) -> None:
    """Stacked bars of each contender's stages, one panel per depth, one seconds scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r["layers"] for r in rows})
    names = [n for n in CONTENDERS if any(r["contender"] == n for r in rows)]
    fig, axes = plt.subplots(
        1, len(depths), figsize=(6 * len(depths), 5.2), squeeze=False, sharex=True
    )
    labelled: set[str] = set()
    for ax, depth in zip(axes[0], depths, strict=True):
        sub = {r["contender"]: r for r in rows if r["layers"] == depth}
        for y, name in enumerate(names):
            left = 0.0
            for phase in PHASES:
                value = float((sub.get(name) or {}).get(phase) or 0.0)
                if value <= 0:
                    continue
                stage = STAGE_OF_COMPILE.get(name, "compile") if phase == "compile" else phase
                stage = stage.replace("_", " ")
                ax.barh(
                    y,
                    value,
                    left=left,
                    color=STAGE_COLORS[stage],
                    label=None if stage in labelled else stage,
                )
                labelled.add(stage)
                left += value
        ax.set_yticks(range(len(names)), [CONTENDERS[n][0] for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds to first result (same scale in every panel)")
        ax.set_title(f"train step, {depth} layers")
        ax.grid(True, axis="x", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    order = [s for s in STAGE_COLORS if s in labels]
    fig.legend(
        [handles[labels.index(s)] for s in order],
        order,
        loc="lower right",
        fontsize=8,
        ncol=len(order),
    )
    fig.suptitle(f"Warm start: time to first result by stage ({note or figure_note()})", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "suite",
        nargs="?",
        default="warm-start",
        choices=("warm-start", "regional", "sharded", "all"),
        help="which benchmark (default warm-start; all = warm-start and regional)",
    )
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="depths to run")
    parser.add_argument("--full", action="store_true", help="warm-start: also L=8 and L=48")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="regional: stop at L=16; sharded: L=2 and 4 on a tiny model (for tests)",
    )
    parser.add_argument(
        "--max-jit-layers",
        type=int,
        default=48,
        help="regional, sharded: run the whole-program jax.jit contenders only up to this "
        "depth (default 48)",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=8,
        help="sharded: simulated CPU devices, the mesh's one axis (default 8)",
    )
    parser.add_argument(
        "--contenders",
        nargs="+",
        default=None,
        metavar="NAME",
        help="sharded: run only these contenders (default: all of them)",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=None,
        choices=("data-parallel", "fsdp"),
        help="sharded: the layouts to run (default both)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="steady-state repeats (default 3)")
    parser.add_argument(
        "--trials",
        type=int,
        default=1,
        help="regional: run the contenders this many times, interleaved, each in a fresh "
        "process, and report each one's median (default 1)",
    )
    parser.add_argument(
        "--width", type=int, default=None, help=f"regional: model width (default {WIDTH})"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help=f"regional: batch size (default {BATCH})"
    )
    parser.add_argument(
        "--seq", type=int, default=None, help=f"regional: sequence length (default {SEQ})"
    )
    parser.add_argument(
        "--inference",
        action="store_true",
        help="regional: time the forward pass alone, not the train step",
    )
    parser.add_argument("--out", default="bench-out", help="output folder (default ./bench-out)")


def _ms(t: float | None) -> str:
    return "–" if t is None else f"{t * 1e3:.3g}"


def stage_table(rows: list[dict[str, Any]], lead: Sequence[tuple[str, str]] = ()) -> list[str]:
    """The Markdown table of each row's stages, first result and steady step (ms),
    after the ``lead`` columns (header, row field) and the depth."""
    head = [h for h, _ in lead] + ["L", "contender", "trace", "lower", "compile / load"]
    head += ["first run", "first result", "steady step (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r[field]) for _, field in lead] + [str(r["layers"]), r["label"]]
        cells += [_fmt(r[p]) for p in ("trace", "lower", "compile", "first_run")]
        cells += [f"**{_fmt(r['first_result'])}**", _ms(r["steady"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


Row = dict[str, Any]


def ratio(a: Row | None, b: Row | None, field: str = "first_result") -> str:
    """``a[field] / b[field]`` to two decimals, or a dash when either row is missing."""
    if a is None or b is None:
        return "–"
    return f"{float(a[field]) / float(b[field]):.2f}"


def best_steady(*rows: Row | None) -> Row | None:
    """The row (of those present) with the fastest steady step."""
    present = [r for r in rows if r is not None]
    return min(present, key=lambda r: float(r["steady"]), default=None)


def steady_state_line(regional: Row | None) -> list[str]:
    """What a ``jaxaot.jit`` contender chose as its steady state, as one list item."""
    if not regional or not regional.get("mode"):
        return []
    modes = [t.get("mode") for t in regional.get("trials", ())]
    chosen = (
        f"the {regional['mode']} program"
        if len(set(modes)) <= 1
        else f"per trial, the {', '.join(str(m) for m in modes)} program"
    )
    return [
        f"  - jaxaot.jit's steady state: {chosen} "
        f"(split program: {regional.get('steps')} executables, "
        f"{_ms(regional.get('steady_split'))} ms a step; whole program: "
        f"{regional.get('whole_calls')} component calls, "
        f"{_ms(regional.get('steady_whole'))} ms a step; chosen after {regional['settle']:.1f} s)"
    ]


def regional_markdown(rows: list[dict[str, Any]]) -> str:
    import jax

    step = "forward pass (inference)" if MODE == "inference" else "train step (value_and_grad)"
    lines = [
        f"Regional-compilation benchmark, {datetime.date.today().isoformat()}, jax {jax.__version__}, "
        f"backend {jax.default_backend()}, {machine()}. Model width {WIDTH}, batch {BATCH}, "
        f"sequence {SEQ}; {step} of L blocks. Seconds, except the steady step (ms). "
        "jaxaot.jit's trace column is its first call's trace and split; the rest of "
        "that call (compiling or loading executables on background threads while the steps "
        "whose executables are ready already run) is its first run. Its steady step is "
        "measured once it has chosen between its split program and its whole-program form"
        " and its background work (cache writes, executables being loaded) is done."
        + trials_sentence(rows),
        "",
        *stage_table(rows),
    ]
    by = {(r["layers"], r["contender"]): r for r in rows}
    lines += ["", "Ratios (same run):", ""]
    for depth in sorted({r["layers"] for r in rows}):

        def row(name: str, depth: int = depth) -> Row | None:
            return by.get((depth, name))

        regional = row("regional_cold")
        best = best_steady(row("jit_cold"), row("scan_cold"))
        steady = ratio(regional, best, "steady") if best else "nan"
        lines.append(
            f"- L={depth}: first result, jaxaot.jit / scan = {ratio(regional, row('scan_cold'))}, "
            f"/ noinline = {ratio(regional, row('noinline_cold'))}, / jax.jit = {ratio(regional, row('jit_cold'))}; "
            f"warm jaxaot.jit / warm jit+JAX cache = {ratio(row('regional_warm'), row('pcc_warm'))}; "
            f"steady step / best of jit and scan = {steady}, "
            f"/ jax.jit = {ratio(regional, row('jit_cold'), 'steady')}"
        )
        if regional and "trials" in regional:
            lines.append(
                "  - per trial, jaxaot.jit / scan: first result "
                f"{trial_ratios(regional, row('scan_cold'), 'first_result')}; steady step "
                f"{trial_ratios(regional, row('scan_cold'), 'steady')}"
            )
        lines += steady_state_line(regional)
    return "\n".join(lines) + "\n"


def trials_sentence(rows: Sequence[Row]) -> str:
    """Says how many trials each figure is the median of ('' for one trial)."""
    n = max((len(r.get("trials", ())) for r in rows), default=0)
    if n < 2:
        return ""
    return (
        f" Each figure is the median of {n} trials: the contenders ran in turn, each in a "
        "fresh process, then again."
    )


def trial_ratios(a: Row | None, b: Row | None, field: str) -> str:
    """``a[field] / b[field]`` trial by trial, to two decimals ('–' without trials)."""
    if not a or not b or "trials" not in a or "trials" not in b:
        return "–"
    pairs = zip(a["trials"], b["trials"], strict=False)
    return ", ".join(f"{float(x[field]) / float(y[field]):.2f}" for x, y in pairs)


def depth_axes(
    ax: Any, rows: list[dict[str, Any]], table: dict[str, tuple[str, str | None]], title: str
) -> None:
    """One line per contender of ``table``: time to first result against depth
    (log-log), ticked at the depths run."""
    from matplotlib.ticker import NullLocator

    for name, (label, _) in table.items():
        pts = sorted((r["layers"], r["first_result"]) for r in rows if r["contender"] == name)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    depths = sorted({r["layers"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel("seconds to first result (log)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig: Any, path: Path, note: str | None) -> None:
    """Writes ``fig`` with the date and machine of its numbers in a corner."""
    import matplotlib.pyplot as plt

    fig.text(0.01, 0.01, note or figure_note(), fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def regional_plot(rows: list[dict[str, Any]], path: Path, note: str | None = None) -> None:
    """Time to first result against depth, one line per contender, ticks at the depths run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    depth_axes(ax, rows, REGIONAL, "Train step: time to first result against depth")
    save_figure(fig, path, note)


def run(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = []
    if args.suite in ("warm-start", "all"):
        layers = args.layers or ([4, 8, 16, 48] if args.full else [4, 16])
        rows = run_contenders(CONTENDERS, layers, args.repeats, log)
        (out / "warm_start.json").write_text(json.dumps(rows, indent=1))
        text = markdown(rows)
        (out / "warm_start.md").write_text(text)
        plot(rows, out / "warm_start.png")
        texts.append(text)
    if args.suite in ("regional", "all"):
        saved = (BATCH, SEQ, WIDTH, MODE, dict(_OVERRIDES))
        _configure(args)
        try:
            texts.append(_run_regional(args, out, log))
        finally:
            _restore(saved)
    if args.suite == "sharded":
        from . import _bench_sharded

        saved = (BATCH, SEQ, WIDTH, MODE, dict(_OVERRIDES))
        _configure(args, _bench_sharded.QUICK_SHAPE if args.quick else None)
        try:
            texts.append(_bench_sharded.run_sharded(args, out, log))
        finally:
            _restore(saved)
    return "\n".join(texts)


def _run_regional(args: argparse.Namespace, out: Path, log: Callable[[str], None]) -> str:
    layers = args.layers or ([4, 8, 16] if args.quick else [4, 8, 16, 32, 48])
    try:
        import equinox  # noqa: F401

        have_equinox = True
    except ImportError:
        have_equinox = False
        log("equinox is not installed: skipping the noinline contender (pip install equinox)")
    max_jit = args.max_jit_layers

    def skip(name: str, depth: int) -> bool:
        if name == "noinline_cold" and not have_equinox:
            return True
        return name in ("jit_cold", "jit_components_cold", "pcc_warm") and depth > max_jit

    rows = run_contenders(REGIONAL, layers, args.repeats, log, skip, trials=args.trials)
    (out / "regional.json").write_text(json.dumps(rows, indent=1))
    text = regional_markdown(rows)
    (out / "regional.md").write_text(text)
    regional_plot(rows, out / "regional.png")
    return text


def _restore(saved: tuple[int, int, int, str, dict[str, str]]) -> None:
    global BATCH, SEQ, WIDTH, MODE
    BATCH, SEQ, WIDTH, MODE, overrides = saved
    _OVERRIDES.clear()
    _OVERRIDES.update(overrides)


# Settings for the workers of this run (``_configure``), as environment variables.
_OVERRIDES: dict[str, str] = {}


def _configure(args: argparse.Namespace, shape: str | None = None) -> None:
    """Applies ``--width``, ``--batch``, ``--seq`` and ``--inference`` (the regional
    and sharded suites' model and step) for this process and its workers; ``shape``
    ("b,s,w") replaces the default model's."""
    global BATCH, SEQ, WIDTH, MODE
    default = shape or os.environ.get("JAXAOT_BENCH_SHAPE", "8,128,256")
    b, s, w = (int(v) for v in default.split(","))
    BATCH = getattr(args, "batch", None) or b
    SEQ = getattr(args, "seq", None) or s
    WIDTH = getattr(args, "width", None) or w
    if getattr(args, "inference", False):
        MODE = "inference"
    _OVERRIDES.update(JAXAOT_BENCH_SHAPE=f"{BATCH},{SEQ},{WIDTH}", JAXAOT_BENCH_MODE=MODE)


def worker_main(t_import: float, place: Placement = _unplaced) -> None:
    """Entry point of a worker process: ``argv`` is contender, layers, work folder, repeats."""
    contender, depth, work_dir, reps = (
        sys.argv[1],
        int(sys.argv[2]),
        Path(sys.argv[3]),
        int(sys.argv[4]),
    )
    row = worker(contender, depth, work_dir, reps, t_import, place)
    sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)

    def log(message: str) -> None:
        sys.stderr.write(message + "\n")

    sys.stdout.write(run(p.parse_args(), log) + "\n")
