"""``jaxaot bench precompile``: a deployment after ``jaxaot precompile`` (issue #37).

The model, manifests and timing worker are in :mod:`._serving`. Every measured
process is a fresh ``sys.executable`` with a cache folder of its own; in order:

* **decode loop** (prefill buckets and a decode step donating the per-layer KV
  caches): ``jaxaot precompile`` fills a cache; a fresh process answers every
  bucket once from it (and compiles nothing of jaxaot's), then times its steady
  decode step against ``jax.jit``'s (both donating; values compared); against
  ``jax.jit`` + JAX's persistent cache after a warm-up process, ``jax.jit``
  cold, the load limit (a process that reads and deserializes every
  executable of the filled cache, nothing else), and the load + trace limit
  (that, and tracing each bucket's plain program once with ``jax.make_jaxpr``:
  a process that has not seen a signature must trace it to know which
  executable it needs, so no contender that checks its entries can go below),
  and the load + trace + run limit (that, and the time the deployed process
  takes to answer every bucket again once all are loaded: the buckets' own
  work, which any first answer includes); and the load + first-run limit (the
  load limit's process runs each executable once on zeros: XLA:CPU readies an
  executable's code on its first run, which any first answer pays too); and the
  load + first-run + trace limit, every part a first answer needs, one after
  another (a deployed process that overlaps them, loading while it traces, goes
  below it);
* **serving** (the forward pass over batch x sequence buckets): the same
  contenders; the precompile's wall time with ``--workers 2`` against
  ``--workers 1`` (each on a new cache);
* **Redis** (where ``redis-server`` and the ``redis`` package are there): two
  ``jaxaot precompile`` processes (one worker each, one run) started together on
  one new Redis cache against one alone: entries made, from their last lines.

Writes ``precompile.md`` and ``precompile.json`` to ``config.out``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._config import BenchConfig, write
from ._fleet import _redis, backends
from ._report import header
from ._runner import Log, Row, worker_env

__all__ = ["TARGETS", "precompile_markdown", "run_precompile"]

#: Targets of issue #37: (numerator, denominator) -> the most their ratio may be.
TARGETS = {
    ("decoding/jaxaot", "decoding/pcc"): 0.8,
    ("decoding/steady_jaxaot", "decoding/steady_jit"): 1.1,
    ("serving/jaxaot", "serving/limit"): 1.1,
    ("precompile/workers2", "precompile/workers1"): 0.6,
    ("redis/pair", "redis/lone"): 1.05,
}
_MADE = re.compile(r"(\d+) entr(?:y|ies) made")
_WORKER = "from jaxaot.cli.bench._serving import main; main()"
#: How the table names a target's denominator.
_SHORT = {
    "pcc": "jax.jit + JAX cache warm",
    "steady_jit": "jax.jit's",
    "limit": "the load limit",
    "workers1": "--workers 1",
    "lone": "one process alone",
}
_GUARD_S = 1800.0  # a process that has not finished by then has hung
#: Steady decode steps per timing round (five rounds).
_STEPS = 400


def _env(work: Path) -> dict[str, str]:
    """A process's environment: the CPU backend, and a default jaxaot cache folder of
    its own (a Redis cache's local tier lives there: two processes sharing one would
    load from it what the other made, and none may touch the user's cache)."""
    local = Path(tempfile.mkdtemp(prefix="local-", dir=work))
    return {**worker_env(None), "JAXAOT_CACHE_DIR": str(local)}


def _worker(log: Log, model: str, contender: str, cache: Path, quick: bool) -> Row:
    log(f"{model}: {contender}")
    job = {"contender": contender, "model": model, "cache": str(cache), "quick": quick}
    job["steps"] = 10 if quick else _STEPS
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, json.dumps(job)],
        capture_output=True,
        text=True,
        env=_env(cache.parent),
        timeout=_GUARD_S,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker {model}/{contender} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _precompile_cmd(target: str, cache: str, workers: int, *more: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxaot",
        "precompile",
        f"jaxaot.cli.bench._serving:{target}",
        "--workers",
        str(workers),
        "--cache",
        cache,
        *more,
    ]


def _made(proc: subprocess.Popen[str], what: str) -> int:
    out, err = proc.communicate(timeout=_GUARD_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out[-2000:]}{err[-2000:]}")
    found = _MADE.findall(out.strip().splitlines()[-1])
    return int(found[0])


def _precompile(log: Log, target: str, cache: Path, workers: int) -> tuple[float, int]:
    """``jaxaot precompile`` of ``target`` into ``cache``: its wall time and entries made."""
    log(f"jaxaot precompile {target} --workers {workers}")
    start = time.perf_counter()
    proc = subprocess.Popen(
        _precompile_cmd(target, str(cache), workers),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(cache.parent),
    )
    made = _made(proc, f"jaxaot precompile {target}")
    return time.perf_counter() - start, made


def _deployment(log: Log, model: str, work: Path, quick: bool) -> dict[str, Any]:
    """One model's contenders: jaxaot after precompile, the load limit, jax.jit +
    JAX's persistent cache (warmed by a process first), jax.jit cold."""
    target = model + "_quick" * quick
    seconds, made = _precompile(log, target, work / f"{model}-jaxaot", 1)
    rows: dict[str, Any] = {"precompile": {"seconds": seconds, "made": made}}
    rows["jaxaot"] = _worker(log, model, "jaxaot", work / f"{model}-jaxaot", quick)
    rows["limit"] = _worker(log, model, "limit", work / f"{model}-jaxaot", quick)
    rows["pcc_warmup"] = _worker(log, model, "pcc", work / f"{model}-pcc", quick)
    rows["pcc"] = _worker(log, model, "pcc", work / f"{model}-pcc", quick)
    rows["jit"] = _worker(log, model, "jit", work / f"{model}-jit", quick)
    return rows


def _redis_rows(log: Log, work: Path, quick: bool) -> dict[str, int] | None:
    """Entries made by one ``jaxaot precompile`` alone and by two started together,
    each on a new Redis database of a private server."""
    if "redis" not in backends(log):
        return None
    target = "serving" + "_quick" * quick
    counts: dict[str, int] = {}
    with _redis(work) as new_cache:
        url = new_cache()["redis"].rsplit("/", 1)[0]
        for group, db, n in (("lone", 1, 1), ("pair", 2, 2)):
            log(f"redis: {n} jaxaot precompile process{'es' * (n > 1)} on one cache")
            cmd = _precompile_cmd(target, f"{url}/{db}", 1, "--run", f"bench-{group}")
            procs = [
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=_env(work),
                )
                for _ in range(n)
            ]
            counts[group] = sum(_made(p, "jaxaot precompile on Redis") for p in procs)
    return counts


def run_precompile(config: BenchConfig, log: Log) -> str:
    """Runs the precompile suite; writes ``precompile.md`` and ``.json``; returns the Markdown."""
    quick = config.quick
    with tempfile.TemporaryDirectory(prefix="jaxaot-bench-precompile-") as tmp:
        work = Path(tmp)
        data: dict[str, Any] = {"quick": quick}
        data["decoding"] = _deployment(log, "decoding", work, quick)
        data["serving"] = _deployment(log, "serving", work, quick)
        target = "serving" + "_quick" * quick
        seconds, made = _precompile(log, target, work / "serving-workers2", 2)
        data["precompile"] = {
            "workers1": data["serving"]["precompile"]["seconds"],
            "workers2": seconds,
            "made1": data["serving"]["precompile"]["made"],
            "made2": made,
        }
        data["redis"] = _redis_rows(log, work, quick)
    text = precompile_markdown(data)
    write(config, "precompile", data, text)
    return text


def _value(data: dict[str, Any], path: str) -> float:
    part, name = path.split("/")
    value = data[part][name]
    return float(value["seconds"] if isinstance(value, dict) else value)


def precompile_markdown(data: dict[str, Any]) -> str:
    """The suite's one table: each measurement, its ratio where the issue sets a
    target, and whether the target holds."""
    from ._serving import SIZES

    s = SIZES[bool(data["quick"])]
    serving_n = len(s.batch) * len(s.seq)
    lines = [
        f"{header('Precompile benchmark')}. A transformer of {s.layers} blocks, width "
        f"{s.width}: serving its forward pass over {serving_n} buckets (batch "
        f"{'/'.join(map(str, s.batch))} x sequence {'/'.join(map(str, s.seq))}), and a "
        f"decode loop (batch {s.decode_batch}, prefill buckets of "
        f"{'/'.join(map(str, s.prefill))} tokens, then decode steps donating per-layer KV "
        f"caches of {s.max_len}). Every process is fresh; first answers: from after import "
        "and parameter set-up until every bucket has answered once.",
        "",
        "| part | measurement | value | ratio | target | holds |",
        "|---|---|---|---|---|---|",
    ]
    labels = {
        "jaxaot": "jaxaot after `jaxaot precompile`: first answer of every bucket (s)",
        "limit": "load limit: read + deserialize every executable (s)",
        "trace": "load + trace limit: the load limit, and jax.make_jaxpr of each bucket (s)",
        "run": "load + trace + run limit: that, and every bucket answered again, warm (s)",
        "first": "load + first-run limit: the load limit, and each executable run once (s)",
        "all": "load + first-run + trace limit: all three, one after another (s)",
        "pcc": "jax.jit + JAX persistent cache, warm: first answers (s)",
        "jit": "jax.jit, cold: first answers (s)",
        "steady_jaxaot": "steady decode step, jaxaot.jit (ms)",
        "steady_jit": "steady decode step, jax.jit (ms)",
        "workers1": "`jaxaot precompile --workers 1` wall time (s)",
        "workers2": "`jaxaot precompile --workers 2` wall time (s)",
        "lone": "Redis: entries made by one precompile process",
        "pair": "Redis: entries made by two precompile processes together",
    }
    order = [
        (
            "decoding",
            (
                "jaxaot",
                "pcc",
                "jit",
                "limit",
                "first",
                "trace",
                "run",
                "all",
                "steady_jaxaot",
                "steady_jit",
            ),
        ),
        ("serving", ("jaxaot", "limit", "first", "trace", "run", "all", "pcc", "jit")),
        ("precompile", ("workers1", "workers2")),
        ("redis", ("lone", "pair")),
    ]
    flat = {part: dict(rows) if isinstance(rows, dict) else rows for part, rows in data.items()}
    decoding = data["decoding"]
    flat["decoding"].update({k: decoding["jaxaot"][k] for k in ("steady_jaxaot", "steady_jit")})
    for part in ("decoding", "serving"):
        limit = data[part]["limit"]
        flat[part]["trace"] = limit["seconds"] + limit.get("trace_seconds", 0.0)
        flat[part]["first"] = limit["seconds"] + limit.get("first_run_seconds", 0.0)
        flat[part]["run"] = flat[part]["trace"] + data[part]["jaxaot"].get("again_seconds", 0.0)
        flat[part]["all"] = flat[part]["first"] + limit.get("trace_seconds", 0.0)
    targets = {num: (den, most) for (num, den), most in TARGETS.items()}
    for part, names in order:
        if flat.get(part) is None:
            lines.append(f"| {part} | not run (no redis-server or redis package) | – | – | – | – |")
            continue
        for name in names:
            path = f"{part}/{name}"
            value = _value(flat, path)
            shown = (
                f"{value * 1000:.3f}"
                if name.startswith("steady")
                else (f"{int(value)}" if part == "redis" else f"{value:.2f}")
            )
            ratio = target = holds = "–"
            if path in targets:
                den, most = targets[path]
                r = value / _value(flat, den)
                ratio, target = f"{r:.2f}", f"≤ {most} x {_SHORT[den.split('/')[1]]}"
                holds = "yes" if r <= most else "**no**"
            elif part in ("decoding", "serving") and name in (
                "jit",
                "limit",
                "first",
                "trace",
                "run",
                "all",
                "pcc",
            ):
                ratio = f"jaxaot / this: {_value(flat, f'{part}/jaxaot') / value:.2f}"
            lines.append(f"| {part} | {labels[name]} | {shown} | {ratio} | {target} | {holds} |")
    for part in ("decoding", "serving"):
        row = data[part]["jaxaot"]
        lines.append(
            f"\n{part}: the deployed process answered {row['buckets']} buckets; JAX compiled "
            f"{row['backend_compiles']} programs meanwhile, jaxaot made "
            f"{row['jaxaot_made']['lowerings']} lowerings and {row['jaxaot_made']['compiles']} "
            f"compiles; the load limit loaded {data[part]['limit']['loaded']} executables."
        )
    lines.append(
        f"Decode values of jaxaot.jit equal to jax.jit's: {decoding['jaxaot']['decode_equal']}."
    )
    command = "jaxaot bench precompile" + " --quick" * bool(data["quick"])
    lines.append(f"\nCommand: `{command}`.")
    return "\n".join(lines) + "\n"
