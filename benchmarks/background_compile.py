"""What the whole-program compile costs the split steps running beside it, with
the compile in the process and in the helper process (``JAXAOT_COMPILE_HELPER``).

Each trial is a fresh process per mode: ``jaxaot.jit`` of the benchmark train
step (no cache), two calls (the second starts the whole program), then split
steps back to back until the whole program is ready (their median: "beside"),
then split steps alone (their median: "alone").

Run: ``python benchmarks/background_compile.py`` (``--trials 3 --width 32
--layers 32``; prints a Markdown table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _trial(width: int, layers: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    import jaxaot
    from jaxaot.cli import _model

    jaxaot.set_cache(None)
    block = jaxaot.component(_model.block)

    def loss(blocks: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        for p in blocks:
            x = block(p, x)
        return jnp.mean(x**2)

    blocks = _model.init_blocks(jax.random.key(0), layers, width)
    x = jax.random.normal(jax.random.key(1), (2, 16, width))
    step = jaxaot.jit(jax.value_and_grad(loss))
    jax.block_until_ready(step(blocks, x))
    jax.block_until_ready(step(blocks, x))  # the program has run: the whole program starts
    (plan,) = step._plans.values()
    leaves = jax.tree_util.tree_leaves((blocks, x))
    start = time.perf_counter()
    beside = []
    while plan.whole is not None and not plan.whole.done():
        t = time.perf_counter()
        jax.block_until_ready(plan.run(leaves))
        beside.append(time.perf_counter() - t)
    compile_s = time.perf_counter() - start
    alone = []
    for _ in range(max(30, len(beside) // 4)):
        t = time.perf_counter()
        jax.block_until_ready(plan.run(leaves))
        alone.append(time.perf_counter() - t)
    return {
        "beside_ms": statistics.median(beside) * 1e3 if beside else float("nan"),
        "alone_ms": statistics.median(alone) * 1e3,
        "compile_s": compile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_trial(args.width, args.layers)))
        return
    command = [sys.executable, __file__, "--child", "--width", str(args.width)]
    command += ["--layers", str(args.layers)]
    print(
        "| trial | whole program compiled | split step beside it (ms) | alone (ms) | ratio | compile (s) |"
    )
    print("|---|---|---|---|---|---|")
    for trial in range(1, args.trials + 1):
        for helper, where in (("0", "in the process"), ("1", "in the helper")):
            env = dict(
                os.environ, JAXAOT_COMPILE_HELPER=helper, JAXAOT_WHOLE_PROGRAM_BELOW_MS="inf"
            )
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            ratio = r["beside_ms"] / r["alone_ms"]
            print(
                f"| {trial} | {where} | {r['beside_ms']:.2f} | {r['alone_ms']:.2f} | "
                f"{ratio:.2f} | {r['compile_s']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
