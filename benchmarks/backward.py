"""One transformer block's forward and backward executables, each compiled on its
own (as ``jaxaot.jit`` runs them): jaxaot's forward and transposed entries
against JAX's own split (``jax.vjp`` under one ``jax.jit``, its backward under
another), in one run.

JAX's transpose of a matmul's weight gradient is ``transpose(dot_general(g, x))``;
compiled alone, XLA:CPU fuses that transpose with the elementwise producers of
``g`` and the dot misses its fast kernel. jaxaot's transposed entries compute
``dot_general(x, g)`` instead (``jaxaot/_component/_rewrites.py``).

Run: ``python benchmarks/backward.py`` (prints a Markdown table, milliseconds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxaot
from jaxaot.cli import _model


def _ms(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def measure(batch: int, seq: int, width: int, repeats: int) -> dict[str, float]:
    params = _model.init_block(jax.random.key(0), width)
    x = jax.random.normal(jax.random.key(1), (batch, seq, width), jnp.float32)

    # JAX's own split: the forward with its residuals, then the backward alone.
    forward = jax.jit(lambda p, x: jax.vjp(_model.block, p, x))
    y, pullback = forward(params, x)
    backward = jax.jit(lambda pullback, g: pullback(g))
    ct = jnp.ones_like(y)

    # jaxaot: the executables jaxaot.jit runs for one layer of a grad.
    comp = jaxaot.component(_model.block)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        grad = jaxaot.jit(jax.grad(lambda p, x: jnp.sum(comp(p, x) * ct), argnums=(0, 1)))
        grad.precompile(params, x)
    (plan,) = grad._plans.values()
    assert plan is not None
    components = [s for s in plan.steps if s.kind == "component"]
    fwd_step, bwd_step = components[0], components[-1]
    leaves = jax.tree_util.tree_leaves(((params, x), {}))
    env = plan._env(leaves)
    inputs: dict[int, list[Any]] = {}
    for i, step in enumerate(plan.steps):
        inputs[i] = [env[slot] for slot in step.ins]
        env_out = step.executable()(*inputs[i])
        for slot, value in zip(step.outs, env_out, strict=True):
            env[slot] = value
    fwd_ins = inputs[plan.steps.index(fwd_step)]
    bwd_ins = inputs[plan.steps.index(bwd_step)]
    return {
        "jax forward (with residuals)": _ms(lambda: forward(params, x), repeats),
        "jax backward": _ms(lambda: backward(pullback, ct), repeats),
        "jaxaot forward entry": _ms(lambda: fwd_step.executable()(*fwd_ins), repeats),
        "jaxaot transposed entry": _ms(lambda: bwd_step.executable()(*bwd_ins), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="8,128,256", help="batch,seq,width")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    batch, seq, width = (int(v) for v in args.shape.split(","))
    times = measure(batch, seq, width, args.repeats)
    print(f"One block, batch {batch}, sequence {seq}, width {width}; milliseconds (median).\n")
    print("| executable | ms |")
    print("|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.1f} |")
    ratio = times["jaxaot transposed entry"] / times["jax backward"]
    print(f"\nbackward, jaxaot / jax: {ratio:.2f}")


if __name__ == "__main__":
    main()
