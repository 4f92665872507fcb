"""``jaxaot demo``: train a small transformer language model whose block and train
step are components, and show what a warm cache does to the start-up time.

Run it twice: the second run loads the compiled train step from the cache
instead of tracing and compiling it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class DemoResult:
    """What a demo run measured."""

    time_to_first_step: float
    steady_step: float
    first_loss: float
    last_loss: float
    steps: int
    cache: str
    stats: dict[str, int] = field(default_factory=dict)
    step_info: dict[str, int] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument(
        "--cache-dir", default=None, help="cache directory (default: the default cache)"
    )
    parser.add_argument(
        "--cold", action="store_true", help="ignore the cache (no reads, no writes)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


VOCAB = 64


def batches(batch: int, seq: int, seed: int = 0) -> Any:
    """Endless batches of arithmetic sequences modulo VOCAB: easy to learn, no download."""
    rng = np.random.default_rng(seed)
    t = np.arange(seq + 1)
    while True:
        start = rng.integers(0, VOCAB, size=(batch, 1))
        stride = rng.integers(1, 8, size=(batch, 1))
        yield ((start + stride * t) % VOCAB).astype(np.int32)


def run(args: argparse.Namespace) -> DemoResult:
    t_start = time.perf_counter()
    import jax
    import optax

    import jaxaot

    from . import _model

    cache: Any
    if args.cold:
        jaxaot.set_cache(None)
        where = "none (--cold)"
    elif args.cache_dir:
        cache = jaxaot.DirectoryCache(args.cache_dir)
        jaxaot.set_cache(cache)
        where = str(cache.stats()["path"])
    else:
        cache = jaxaot.get_cache()
        where = (
            str(cache.stats().get("path", type(cache).__name__)) if cache is not None else "none"
        )

    before = jaxaot.stats()
    block = jaxaot.component(_model.block)
    optimizer = optax.adam(3e-3)

    def loss_fn(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        return _model.lm_loss(params, tokens, block)

    @jaxaot.component(donate_argnums=(0, 1))
    def train_step(params: dict[str, Any], opt_state: Any, tokens: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = _model.init_lm(jax.random.key(0), args.layers, args.width, VOCAB, args.seq)
    opt_state = optimizer.init(params)
    data = batches(args.batch, args.seq)

    losses: list[float] = []
    step_times: list[float] = []
    pending: jaxaot.HostCopy[Any] | None = None
    progress = None
    if not args.quiet:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("[bold]training[/]"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]}"),
            TimeRemainingColumn(),
            transient=True,
        )
        progress.start()
        task = progress.add_task("train", total=args.steps, loss="…")
    time_to_first = 0.0
    try:
        for i in range(args.steps):
            t0 = time.perf_counter()
            params, opt_state, loss = train_step(params, opt_state, next(data))
            if pending is not None:  # last step's loss, copied while this step ran
                losses.append(float(pending.result()))
            pending = jaxaot.to_host_async(loss)
            if i == 0:
                loss.block_until_ready()
                time_to_first = time.perf_counter() - t_start
            else:
                step_times.append(time.perf_counter() - t0)
            if progress is not None and losses:
                progress.update(task, advance=1, loss=f"{losses[-1]:.3f}")
        if pending is not None:
            losses.append(float(pending.result()))
    finally:
        if progress is not None:
            progress.stop()
    steady = statistics.median(step_times[len(step_times) // 2 :]) if step_times else 0.0
    return DemoResult(
        time_to_first_step=time_to_first,
        steady_step=steady,
        first_loss=losses[0],
        last_loss=losses[-1],
        steps=args.steps,
        cache=where,
        stats={k: v - before.get(k, 0) for k, v in jaxaot.stats().items()},
        step_info=train_step.cache_info()._asdict(),
    )


def summary_rows(result: DemoResult) -> list[tuple[str, str]]:
    # A warm start loads what it needs: no lowering, no compile (default keys trace
    # the body once to find their key).
    warm = result.step_info.get("compiles", 1) == 0 and result.step_info.get("lowerings", 1) == 0
    return [
        (
            "time to first step",
            f"{result.time_to_first_step:.2f} s (import, init, trace/compile or load, run)",
        ),
        ("steady step time", f"{result.steady_step * 1e3:.1f} ms"),
        ("loss", f"{result.first_loss:.3f} → {result.last_loss:.3f} over {result.steps} steps"),
        (
            "cache",
            f"{result.stats.get('hits', 0)} hits, {result.stats.get('misses', 0)} misses, "
            f"{result.stats.get('traces', 0)} traces, {result.stats.get('lowerings', 0)} lowerings, "
            f"{result.stats.get('compiles', 0)} compiles",
        ),
        (
            "train step",
            "warm start: loaded from the cache" if warm else "cold start: traced and compiled",
        ),
        ("cache location", result.cache),
    ]
