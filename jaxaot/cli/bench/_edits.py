"""``jaxaot bench edits``: a research loop, as fresh processes on one cache each
(issue #36).

Each contender gets a cache of its own and runs the same sequence, each step in
a fresh process: cold; a restart (the same program); edit 1, the loss gains a
term; edit 2, four more layers; edit 3, the learning rate (a Python float baked
into the step) changes; each edited program once more (its restart). The edits
add up (edit 2 keeps edit 1's loss term). A step's figure is the time from the
process's start (``/proc``; imports included, as a researcher waits for them)
to its first train step's result, and, apart, from just before its first call.
The steps run in turn across the contenders (step 1 of each, then step 2, ...),
so that a slow moment of a shared machine does not fall on one contender.

The contenders: ``jaxaot.jit`` of a train step whose layers are components;
``jaxaot.jit`` of one whose layers are plain ``jax.checkpoint`` regions in a
Python loop (found as blocks); ``jax.jit`` of the unrolled step and ``jax.jit``
of a ``lax.scan`` over stacked layers, both with JAX's persistent compilation
cache. The worker side (one step of one contender) is :func:`run_edit`, called
by :mod:`._worker`. Writes ``edits.md`` and ``edits.json`` to ``config.out``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._config import ArgumentError, BenchConfig, Job, ModelShape, write
from ._measure import block, timed
from ._report import header, model_sentence, table_head
from ._runner import Log, Row

__all__ = ["CONTENDERS", "STEPS", "edits_markdown", "run_edit", "run_edits"]

#: Contender -> label. ``jit_pcc`` and ``scan_pcc`` run with JAX's persistent cache.
CONTENDERS = {
    "regional": "jaxaot.jit, component layers",
    "remat_regional": "jaxaot.jit, remat'd layers (no annotation)",
    "jit_pcc": "jax.jit + JAX persistent cache",
    "scan_pcc": "scan + JAX persistent cache",
}
#: Contenders that use JAX's persistent cache (set before the worker's first compile).
PCC = frozenset({"jit_pcc", "scan_pcc"})
#: The jaxaot contenders and their peers, the best of which each edit is held against.
OURS, PEERS = ("regional", "remat_regional"), ("jit_pcc", "scan_pcc")

#: The sequence: (name, the edits in the program, layers added).
STEPS = (
    ("cold", "", 0),
    ("restart", "", 0),
    ("edit 1: loss term", "loss", 0),
    ("restart 1", "loss", 0),
    ("edit 2: depth +4", "loss", 4),
    ("restart 2", "loss", 4),
    ("edit 3: learning rate", "loss,lr", 4),
    ("restart 3", "loss,lr", 4),
)
#: The learning rate before and after edit 3, and the weight of edit 1's L2 term.
LR, LR_EDITED, L2 = 1e-2, 3e-3, 1e-3
#: Targets of issue #36 for each edit of a jaxaot contender: its first result
#: against the better peer's same edit, and against its own restart.
PEER_TARGET, RESTART_TARGET = 0.5, 1.15


# -- the worker side: one step of one contender, in a fresh process ----------------------


def _train_step(edit: str, block_fn: Callable[..., Any], stacked: bool = False) -> Any:
    """``value_and_grad`` of the benchmark loss and an SGD update, with ``edit``'s
    changes: an L2 term in the loss (``loss``), another learning rate (``lr``)."""
    import jax
    import jax.numpy as jnp

    edits = set(edit.split(","))
    lr = LR_EDITED if "lr" in edits else LR

    def loss(blocks: Any, x: Any) -> Any:
        if stacked:
            x = jax.lax.scan(lambda h, p: (block_fn(p, h), None), x, blocks)[0]
        else:
            for p in blocks:
                x = block_fn(p, x)
        value = jnp.mean(x**2)
        if "loss" in edits:
            value = value + L2 * sum(jnp.sum(w**2) for w in jax.tree_util.tree_leaves(blocks))
        return value

    def step(blocks: Any, x: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(blocks, x)
        return value, jax.tree_util.tree_map(lambda p, g: p - lr * g, blocks, grads)

    return step


def _host_model(layers: int, shape: ModelShape, stacked: bool) -> tuple[Any, Any]:
    """The benchmark model's parameters (shaped as ``_model.init_blocks`` shapes
    them; stacked for scan) and an input batch, drawn by NumPy and placed at once.
    Making them compiles nothing, so that they cost every contender the same: made
    with ``jax.random``, JAX's persistent cache would serve those eager ops'
    compiles to its contenders alone."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    w = shape.width

    def normal(rows: int, cols: int) -> Any:
        return rng.standard_normal((rows, cols), np.float32) * np.float32(rows**-0.5)

    blocks = [
        {"ln1": np.ones(w, np.float32), "ln2": np.ones(w, np.float32)}
        | {"qkv": normal(w, 3 * w), "proj": normal(w, w)}
        | {"up": normal(w, 4 * w), "down": normal(4 * w, w)}
        for _ in range(layers)
    ]
    params: Any = blocks
    if stacked:
        params = {name: np.stack([b[name] for b in blocks]) for name in blocks[0]}
    x = rng.standard_normal((shape.batch, shape.seq, w), np.float32)
    return block(jax.device_put((params, x)))


def run_edit(contender: str, job: Job) -> dict[str, Any]:
    """Times the first train step of ``contender`` in this process (its cache in the
    job's work folder, the program ``job.edit`` says); returns ``first_run`` (from
    just before the first call), ``from_start`` (from the process's start, or None
    where ``/proc`` cannot tell), the first loss and, for ``jaxaot.jit``, what this
    process compiled and loaded."""
    import jax

    import jaxaot

    from .. import _model
    from ..demo import process_start

    start = process_start()
    if contender not in CONTENDERS:
        raise ValueError(f"unknown contender {contender!r}")
    ours = contender in OURS
    args = _host_model(job.layers, job.shape, stacked=contender == "scan_pcc")
    if ours:
        jaxaot.set_cache(jaxaot.DirectoryCache(Path(job.work) / "jaxaot"))
        wrap = jaxaot.component if contender == "regional" else jax.checkpoint
        step = jaxaot.jit(_train_step(job.edit, wrap(_model.block)))
    else:
        step = jax.jit(_train_step(job.edit, _model.block, stacked=contender == "scan_pcc"))
    out, first_run = timed(lambda: block(step(*args)))
    done = time.perf_counter()
    row: dict[str, Any] = {
        "first_run": first_run,
        "from_start": None if start is None else done - start,
        "loss": float(out[0]),
    }
    if ours:
        jaxaot.wait_for_writes()  # not timed: a long run finishes its writes while it trains
        stats = jaxaot.stats()
        row["made"] = {k: stats.get(k, 0) for k in ("lowerings", "compiles", "loaded")}
    return row


# -- the suite ---------------------------------------------------------------------------


def run_edits(config: BenchConfig, log: Log) -> str:
    """Runs the sequence for each contender at each depth; returns the report."""
    from . import _runner

    if config.inference:
        raise ArgumentError("the edits suite times a train step (no --inference)")
    names = list(config.contenders or CONTENDERS)
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        raise ArgumentError(f"unknown contenders {unknown}; choose from {sorted(CONTENDERS)}")
    shape = config.shape("edits")
    rows: list[Row] = []
    for depth in config.layers or (16,):
        with tempfile.TemporaryDirectory(prefix="jaxaot-edits-") as tmp:
            for step, edit, extra in STEPS:
                for name in names:
                    log(f"L={depth}: {name}, {step}")
                    work = Path(tmp) / name  # each contender's own caches
                    work.mkdir(exist_ok=True)
                    job = Job(f"edit:{name}", depth + extra, str(work), 1, shape, edit=edit)
                    row = _runner.run_worker(job)
                    row.update(contender=name, label=CONTENDERS[name], step=step, depth=depth)
                    rows.append(row)
    text = edits_markdown(rows, shape, config)
    write(config, "edits", rows, text)
    return text


def _seconds(row: Row) -> float:
    """A step's figure: from the process's start where known, else from its first call."""
    return float(row["from_start"] if row.get("from_start") is not None else row["first_run"])


def _ratios(
    at: dict[tuple[int, str, str], Row], depth: int, name: str, seconds: Callable[[Row], float]
) -> list[float | None]:
    """Each edit of ``name`` against its restart, then against the better peer at
    that edit (None where a figure is missing), by the figure ``seconds`` gives."""
    steps = [step for step, _, _ in STEPS]
    own, peer = [], []
    for i in range(2, len(steps), 2):
        edit, restart = at.get((depth, name, steps[i])), at.get((depth, name, steps[i + 1]))
        own.append(None if edit is None or restart is None else seconds(edit) / seconds(restart))
        peers = [at.get((depth, p, steps[i])) for p in PEERS]
        best = min((seconds(p) for p in peers if p is not None), default=None)
        peer.append(None if edit is None or best is None else seconds(edit) / best)
    return own + peer


def edits_markdown(rows: list[Row], shape: Any, config: BenchConfig) -> str:
    """The report: each contender's seconds at each step, then each edit's ratios."""
    steps = [name for name, _, _ in STEPS]
    edits = [name for name in steps if name.startswith("edit")]
    lines = [
        f"{header('Research-loop benchmark')}. {model_sentence(shape)} and an SGD update; "
        "each step a fresh process on the contender's own cache. Seconds from the process's "
        "start (imports included) to the first train step's result; in parentheses, from "
        "just before the first call.",
        "",
        *table_head(["L", "contender", *steps]),
    ]
    at: dict[tuple[int, str, str], Row] = {(r["depth"], r["contender"], r["step"]): r for r in rows}
    depths = sorted({r["depth"] for r in rows})
    names = list(dict.fromkeys(r["contender"] for r in rows))
    for depth in depths:
        for name in names:
            cells = []
            for step in steps:
                r = at.get((depth, name, step))
                cells.append("–" if r is None else f"{_seconds(r):.2f} ({r['first_run']:.2f})")
            lines.append(f"| {depth} | {CONTENDERS[name]} | " + " | ".join(cells) + " |")
    head = [f"{e.split(':')[0]} / its restart" for e in edits]
    head += [f"{e.split(':')[0]} / best peer" for e in edits]
    lines += [
        "",
        "Ratios (same run): each edit's first result against a restart of the edited "
        "program, and against the better of jax.jit and scan (each with JAX's persistent "
        "cache) at the same edit; from the process's start, and in parentheses from just "
        "before the first call.",
        "",
        *table_head(["L", "contender", *head]),
    ]
    verdicts, made = [], []
    for depth in depths:
        for name in names:
            ratios = _ratios(at, depth, name, _seconds)
            calls = _ratios(at, depth, name, lambda r: float(r["first_run"]))
            cells = [
                "–" if a is None else f"{a:.2f} ({b:.2f})"
                for a, b in zip(ratios, calls, strict=True)
            ]
            lines.append(f"| {depth} | {CONTENDERS[name]} | " + " | ".join(cells) + " |")
            known = [v for v in ratios if v is not None]
            if name in OURS and len(known) == len(ratios):
                n = len(edits)
                met = max(known[:n]) <= RESTART_TARGET and max(known[n:]) <= PEER_TARGET
                verdicts.append(f"{CONTENDERS[name]}, L={depth}: {'met' if met else 'missed'}")
            counts: list[Any] = [at.get((depth, name, step), {}).get("made") for step in steps]
            if name in OURS and all(counts):
                made.append(
                    f"- {CONTENDERS[name]}, L={depth}: compiled / loaded executables at each "
                    "step: " + ", ".join(f"{c['compiles']} / {c['loaded']}" for c in counts)
                )
    lines += [
        "",
        f"Targets, every edit of a jaxaot contender: ≤ {PEER_TARGET}× the best peer, "
        f"≤ {RESTART_TARGET}× its restart." + (f" {'; '.join(verdicts)}." if verdicts else ""),
        *([""] + made if made else []),
        "",
        "Command: `jaxaot bench edits --layers "
        + " ".join(str(d) for d in depths)
        + f" --width {shape.width} --batch {shape.batch} --seq {shape.seq}"
        + (f" --contenders {' '.join(config.contenders)}`" if config.contenders else "`"),
    ]
    return "\n".join(lines) + "\n"
