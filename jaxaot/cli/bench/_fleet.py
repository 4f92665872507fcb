"""``jaxaot bench fleet``: N cold processes started together on one new cache,
against one cold process alone, in one run (issue #27).

For each cache (a directory; Redis too, on a private ``redis-server`` on
loopback that the run starts, when the binary and the ``redis`` package are
there) and each depth, four groups run (the first three on caches of their own):

* ``lone``: one cold process;
* ``fleet``: N cold processes;
* ``fleet, leases off``: the same N with ``JAXAOT_LEASE_WAIT=0``: every process
  makes what it misses, as before leases (for comparison);
* ``fleet, warm cache``: N processes on the cache ``fleet`` filled: they make
  nothing, so their time is the floor that N processes sharing the machine's
  CPUs set (each still traces, loads and runs its first step).

Each member is a worker process (``_worker``'s ``fleet_member``): it imports,
builds the model and its ``jaxaot.jit`` step over component layers, says
``ready`` and waits at the start barrier; the parent starts them all at once, so
that they all miss together. A group's row: entries made (lowerings and
compiles, summed over its members, background work included), the slowest
member's time from the barrier to its first result, and what the members
waited for. Writes ``fleet.md`` and ``fleet.json`` to ``config.out``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO

from ._config import ArgumentError, BenchConfig, Job, write
from ._report import header, model_sentence
from ._runner import _WORKER_CODE, Log, Row, median_row, worker_env

__all__ = ["GROUPS", "fleet_markdown", "run_fleet", "run_members"]

#: Group -> (label, leases on). ``fleet_warm`` runs on the cache ``fleet`` filled:
#: it makes nothing, so its time is the floor that N processes sharing the
#: machine's CPUs (each tracing, loading and running its first step) set.
GROUPS = {
    "lone": ("one process alone", True),
    "fleet": ("fleet", True),
    "fleet_off": ("fleet, leases off", False),
    "fleet_warm": ("fleet, warm cache (the floor)", True),
}
#: Targets of issue #27: fleet / lone.
MADE_TARGET, FIRST_TARGET = 1.25, 1.5
_GUARD_S = 1800.0  # a member that has not finished by then has hung


def run_members(job: Job, n: int, env: dict[str, str]) -> list[Row]:
    """Runs ``n`` fleet members of ``job`` started together (``env`` added to each
    one's environment); returns each one's row."""
    base = {**worker_env(None), **env}
    # Members started together share the machine's GPU: without this, the first
    # would reserve most of its memory and leave the others none.
    base.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    procs: list[subprocess.Popen[str]] = []
    logs: list[IO[str]] = []
    try:
        for _ in range(n):
            logs.append(tempfile.TemporaryFile("w+"))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _WORKER_CODE, job.to_json()],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=logs[-1],
                    text=True,
                    env=base,
                )
            )
        for proc, err in zip(procs, logs, strict=True):
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"fleet member failed before the start:\n{_tail(proc, err)}")
        for proc in procs:  # the start barrier: all of them at once
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        rows = []
        for proc, err in zip(procs, logs, strict=True):
            out, _ = proc.communicate(timeout=_GUARD_S)
            if proc.returncode != 0:
                raise RuntimeError(f"fleet member failed:\n{_tail(proc, err)}")
            rows.append(json.loads(out.strip().splitlines()[-1]))
        return rows
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for err in logs:
            err.close()


def _tail(proc: subprocess.Popen[str], log: IO[str]) -> str:
    proc.wait()
    log.seek(0)
    return log.read()[-3000:]


def group_row(backend: str, group: str, layers: int, members: list[Row]) -> Row:
    """One group's row from its members' rows."""
    stats = [m["stats"] for m in members]

    def total(name: str) -> float:
        return float(sum(s.get(name, 0) for s in stats))

    return {
        "backend": backend,
        "group": group,
        "label": GROUPS[group][0],
        "layers": layers,
        "processes": len(members),
        "made": int(total("lowerings") + total("compiles")),
        "made_here": int(total("made_here")),
        "first_result": max(m["first_result"] for m in members),
        "first_result_fastest": min(m["first_result"] for m in members),
        "loaded_after_wait": int(total("loaded_after_wait")),
        "wait_seconds": total("wait_seconds"),
        "lease_takeovers": int(total("lease_takeovers")),
        "lease_wait_timeouts": int(total("lease_wait_timeouts")),
    }


def _ratios(row: Row, lone: Row) -> None:
    """A group's ratios to the lone process of the same trial (taken within a trial,
    minutes apart at most, so that a shared machine's load drifts less between them)."""
    row["made_ratio"] = row["made"] / max(lone["made"], 1)
    row["first_ratio"] = row["first_result"] / lone["first_result"]


@contextlib.contextmanager
def _directory(work: Path) -> Iterator[Callable[[], dict[str, str]]]:
    yield lambda: {"dir": str(work / f"cache-{uuid.uuid4().hex[:8]}")}


@contextlib.contextmanager
def _redis(work: Path) -> Iterator[Callable[[], dict[str, str]]]:
    """A private redis-server on loopback for the run; each call, a new prefix."""
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    binary = shutil.which("redis-server")
    assert binary is not None
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [*cmd, "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 15
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the benchmark's redis-server did not start") from None
                time.sleep(0.05)
        url = f"redis://127.0.0.1:{port}/0"
        yield lambda: {"redis": url, "prefix": f"bench-{uuid.uuid4().hex[:8]}:"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def backends(log: Log) -> list[str]:
    """The caches this machine can run: the directory, and Redis where possible."""
    found = ["directory"]
    try:
        import redis  # noqa: F401
    except ImportError:
        log("the redis package is missing: no Redis rows (pip install 'jaxaot[redis]')")
        return found
    if shutil.which("redis-server") is None:
        log("redis-server is not installed: no Redis rows")
        return found
    return [*found, "redis"]


def run_fleet(config: BenchConfig, log: Log) -> str:
    """Runs the fleet suite; writes ``fleet.md`` and ``fleet.json``; returns the Markdown."""
    if config.processes < 2:
        raise ArgumentError(f"--processes must be at least 2, got {config.processes}")
    layers = config.layers or (4,)
    shape = config.shape("regional")
    runs: dict[tuple[str, int, str], list[Row]] = {}
    for trial in range(config.trials):
        for backend in backends(log):
            for depth in layers:
                with tempfile.TemporaryDirectory(prefix="jaxaot-fleet-") as tmp:
                    opened = _redis if backend == "redis" else _directory
                    with opened(Path(tmp)) as new_cache:
                        filled: dict[str, str] | None = None
                        for group, (label, leases) in GROUPS.items():
                            n = 1 if group == "lone" else config.processes
                            tag = (
                                f"trial {trial + 1}/{config.trials}, " if config.trials > 1 else ""
                            )
                            log(f"{tag}{backend}, L={depth}: {label} ({n} process{'es' * (n > 1)})")
                            job = Job("fleet_member", depth, tmp, config.repeats, shape)
                            cache = filled if group == "fleet_warm" else new_cache()
                            filled = cache if group == "fleet" else filled
                            job = replace(job, cache=cache)
                            env = {} if leases else {"JAXAOT_LEASE_WAIT": "0"}
                            members = run_members(job, n, env)
                            row = group_row(backend, group, depth, members)
                            lone = runs[(backend, depth, "lone")][-1] if n > 1 else row
                            _ratios(row, lone)
                            runs.setdefault((backend, depth, group), []).append(row)
    rows = [median_row(trial_rows) for trial_rows in runs.values()]
    text = fleet_markdown(rows, config)
    write(config, "fleet", rows, text)
    return text


def fleet_markdown(rows: list[Row], config: BenchConfig) -> str:
    """The fleet suite's report: a row per cache, depth and group, and the ratios
    to the lone process against the issue's targets."""
    shape = config.shape("regional")
    lines = [
        f"{header('Fleet benchmark')}. {config.processes} cold processes started together "
        "on one new cache, against one cold process alone; the step runs under `jaxaot.jit` "
        f"over component layers. {model_sentence(shape)}. "
        "Made: lowerings and compiles in all the processes of a group (background work "
        "included); first result: from the start barrier to the step's first result, "
        "slowest member (fastest in brackets); waited: seconds all members spent waiting "
        "for entries other members made.",
        "",
        "| cache | L | group | processes | made | made / lone | first result (s) | / lone "
        "| loaded after waiting | waited (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["backend"], r["layers"], r["group"]): r for r in rows}
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['layers']} | {r['label']} | {r['processes']} | {r['made']} "
            f"| {r['made_ratio']:.2f} | **{r['first_result']:.2f}** "
            f"({r['first_result_fastest']:.2f}) | {r['first_ratio']:.2f} "
            f"| {r['loaded_after_wait']} | {r['wait_seconds']:.2f} |"
        )
    trials = f", the median of {config.trials} trials' ratios" if config.trials > 1 else ""
    lines += [
        "",
        f"Targets (fleet / lone): made ≤ {MADE_TARGET}, first result ≤ {FIRST_TARGET}. Each "
        f"ratio is to the lone process of the same trial{trials}.",
        "",
    ]
    for (backend, depth, group), r in by.items():
        if group == "lone":
            continue
        made, first = r["made_ratio"], r["first_ratio"]
        if group == "fleet_warm":
            verdict = "nothing to make: what sharing the CPUs costs"
        elif GROUPS[group][1]:
            met = made <= MADE_TARGET and first <= FIRST_TARGET
            verdict = "targets met" if met else "targets missed"
        else:
            verdict = "every process makes what it misses, as before leases"
        lines.append(
            f"- {backend}, L={depth}, {r['label']}: made {made:.2f}x, first result "
            f"{first:.2f}x the lone process's ({verdict})"
        )
    lines.append(f"\nCommand: `{_command(config)}`.")
    return "\n".join(lines) + "\n"


def _command(config: BenchConfig) -> str:
    words = ["jaxaot bench fleet", f"--processes {config.processes}"]
    if config.layers:
        words.append("--layers " + " ".join(str(n) for n in config.layers))
    for flag, value in (
        ("--width", config.width),
        ("--batch", config.batch),
        ("--seq", config.seq),
    ):
        if value is not None:
            words.append(f"{flag} {value}")
    if config.trials > 1:
        words.append(f"--trials {config.trials}")
    return " ".join(words)
