"""Small layers under ``grad``: a forward entry that writes residuals against one
that returns the layer's output alone and lets the backward entry recompute the
rest (``jaxaot._component._cost``), and against ``lax.scan``.

For each shape, one fresh process builds ``jaxaot.jit``'s split program of the
benchmark train step (no cache, no whole-program form) twice, once per form
(``JAXAOT_RECOMPUTE_BELOW`` set to 0, then to infinity), and scan's
``jax.jit(value_and_grad)`` over stacked layers; then it times the three in
interleaved rounds of back-to-back calls. Medians of the rounds' medians.

Run: ``python benchmarks/recompute.py`` (``--layers 16 --rounds 6``; prints a
Markdown table). The shapes span the default threshold (8 million, the work
column).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SHAPES = [(32, 2, 16), (64, 2, 16), (64, 4, 32), (128, 2, 32), (64, 8, 64)]


def _trial(width: int, batch: int, seq: int, layers: int, rounds: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import jaxaot
    from jaxaot._component import _cost
    from jaxaot.cli import _model

    jaxaot.set_cache(None)
    blocks = _model.init_blocks(jax.random.key(0), layers, width)
    x = jax.random.normal(jax.random.key(1), (batch, seq, width))
    leaves = jax.tree_util.tree_leaves((blocks, x))
    work = _cost.work(jax.make_jaxpr(_model.block)(blocks[0], x))

    def split_step(threshold: str) -> Any:
        os.environ["JAXAOT_RECOMPUTE_BELOW"] = threshold
        block = jaxaot.component(_model.block)

        def loss(blocks: Any, x: jax.Array) -> jax.Array:
            for p in blocks:
                x = block(p, x)
            return jnp.mean(x**2)

        step = jaxaot.jit(jax.value_and_grad(loss), whole_program=False)
        jax.block_until_ready(step(blocks, x))
        (plan,) = step._plans.values()
        plan.wait()
        return lambda: plan.run(leaves)

    def scan_loss(stacked: Any, x: jax.Array) -> jax.Array:
        x = jax.lax.scan(lambda x, p: (_model.block(p, x), None), x, stacked)[0]
        return jnp.mean(x**2)

    stacked = jax.tree.map(lambda *a: jnp.stack(a), *blocks)
    scan = jax.jit(jax.value_and_grad(scan_loss))
    forms = {
        "residuals": split_step("0"),  # no block recomputes
        "recompute": split_step("inf"),  # every block does
        "scan": lambda: scan(stacked, x),
    }
    rows: dict[str, list[float]] = {k: [] for k in forms}
    for fn in forms.values():
        jax.block_until_ready(fn())
    for _ in range(rounds):
        for name, fn in forms.items():
            times = []
            for _ in range(15):
                start = time.perf_counter()
                jax.block_until_ready(fn())
                times.append(time.perf_counter() - start)
            rows[name].append(statistics.median(times) * 1e3)
    return {"work": work, **{k: statistics.median(v) for k, v in rows.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        width, batch, seq = (int(v) for v in args.trial.split(","))
        print(json.dumps(_trial(width, batch, seq, args.layers, args.rounds)))
        return
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, L={args.layers}, ms a step\n")
    print("| width, batch, seq | work | residuals | recompute | scan | recompute / residuals |")
    print("|---|---|---|---|---|---|")
    for width, batch, seq in SHAPES:
        out = subprocess.run(
            [sys.executable, __file__, "--layers", str(args.layers), "--rounds", str(args.rounds)]
            + ["--trial", f"{width},{batch},{seq}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"| {width}, {batch}, {seq} | {r['work'] / 1e6:.1f} M | {r['residuals']:.2f} | "
            f"{r['recompute']:.2f} | {r['scan']:.2f} | {r['recompute'] / r['residuals']:.2f} |"
        )


if __name__ == "__main__":
    main()
