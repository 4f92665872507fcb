"""Running contenders: each in a fresh worker process, each preparation before
the first contender that needs it, trials interleaved, and the median of a
contender's trials as its row."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ._config import Job, MeshLayout, Table
from ._mesh import DEVICE_FLAG

__all__ = ["Log", "Row", "WorkerRunner", "median_row", "run_contenders", "run_worker"]

#: Where progress lines go.
Log = Callable[[str], None]

#: One contender's timings (a worker's JSON line, plus what the suite adds).
Row = dict[str, Any]

#: Runs one job in a fresh process and returns its row.
WorkerRunner = Callable[[Job], Row]

#: The code a worker process runs: it times its imports, then :func:`._worker.main`.
_WORKER_CODE = (
    "import time; t0 = time.perf_counter(); import jax, jaxaot; "
    "from jaxaot.cli.bench._worker import main; main(time.perf_counter() - t0)"
)


def worker_env(mesh: MeshLayout | None) -> dict[str, str]:
    """A worker's environment: this one, on this machine's accelerator where it
    has one (a GPU, a TPU) and on the CPU otherwise, unless ``JAX_PLATFORMS``
    says; for a mesh, simulated CPU devices, their count in ``XLA_FLAGS`` (set
    before the worker imports JAX; any other flags kept, any other device count
    replaced). Naming the platform spares a CPU machine JAX's attempt at every
    installed plugin (libtpu) in every worker."""
    from ..._jax import local_accelerator

    env = dict(os.environ)
    if mesh is not None:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.setdefault("JAX_PLATFORMS", local_accelerator() or "cpu")
    if mesh is not None:
        flags = re.sub(rf"{DEVICE_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
        flags.append(f"{DEVICE_FLAG}={mesh.devices}")
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_worker(job: Job) -> Row:
    """Runs ``job`` in a fresh process and returns the JSON line it prints."""
    import json

    cmd = [sys.executable, "-c", _WORKER_CODE, job.to_json()]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(job.mesh))
    if proc.returncode != 0:
        raise RuntimeError(
            f"benchmark worker {job.contender} (L={job.layers}) failed:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_contenders(
    table: Table,
    job: Job,
    layers: Sequence[int],
    log: Log,
    skip: Callable[[str, int], bool] = lambda name, depth: False,
    trials: int = 1,
) -> list[Row]:
    """Runs each contender of ``table`` at each depth, as ``job`` says (its shape
    and mesh; its contender, depth and work folder are set here), each with
    :func:`run_worker` (looked up when called). With ``trials`` over 1 the whole
    sequence of contenders runs that many times at each depth, interleaved (each
    trial in its own work folder, so cold is cold again), and each row is the
    :func:`median_row` of a contender's trials."""
    rows: list[Row] = []
    for depth in layers:
        runs: dict[str, list[Row]] = {}
        for trial in range(trials):
            tag = f"L={depth}" + (f", trial {trial + 1}/{trials}" if trials > 1 else "")
            with tempfile.TemporaryDirectory(prefix="jaxaot-bench-") as tmp:
                at = replace(job, layers=depth, work=tmp)
                for name, row in _trial(table, at, tag, log, skip, first=trial == 0):
                    runs.setdefault(name, []).append(row)
        rows += [median_row(trial_rows) for trial_rows in runs.values()]
    return rows


def _trial(
    table: Table,
    job: Job,
    tag: str,
    log: Log,
    skip: Callable[[str, int], bool],
    first: bool,
) -> list[tuple[str, Row]]:
    """One trial at one depth: every contender of ``table`` not skipped, each
    preparation once, before the first contender that needs it."""
    prepared: set[str] = set()
    rows = []
    for name, (label, prep) in table.items():
        if skip(name, job.layers):
            if first:
                log(f"L={job.layers}: {name} skipped")
            continue
        if prep is not None and prep not in prepared:
            log(f"{tag}: preparing {prep}")
            run_worker(job.at(prep))
            prepared.add(prep)
        log(f"{tag}: {name}")
        row = run_worker(job.at(name))
        row["label"] = label
        rows.append((name, row))
        prepared.add(name)
    return rows


def median_row(trial_rows: Sequence[Row]) -> Row:
    """One contender's row from its trials: the median of each number that differs
    between trials (a field missing from some trials, or None in any, is taken from
    the first trial), everything else from the first trial; with more than one trial, ``trials``
    keeps each trial's first result and steady step, and its chosen form (``mode``)."""
    first = trial_rows[0]
    if len(trial_rows) == 1:
        return dict(first)
    row: Row = {}
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
