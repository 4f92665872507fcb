"""Small layers under ``grad``: a backward entry that reads the residuals its
forward entry wrote against one that recomputes the forward pass from the
layer's inputs (``JAXAOT_RECOMPUTE_BELOW``, see docs/components.md), and
against ``lax.scan``.

For each shape, one fresh process builds ``jaxaot.jit``'s split program of a
train step of small transformer blocks (no cache, ``whole_program=False``)
twice, once per form (``JAXAOT_RECOMPUTE_BELOW`` set to 0, then to infinity,
before the step's first call), and scan's ``jax.jit(value_and_grad)`` over
stacked layers; then it times the three in interleaved rounds of back-to-back
calls. Medians of the rounds' medians. The flops column is XLA's estimate for
one block's forward pass; the shapes span the default threshold.

Run: ``python benchmarks/recompute.py`` (``--layers 16 --rounds 6``; prints a
Markdown table).
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

    def init_block(key: jax.Array) -> dict[str, jax.Array]:
        k = jax.random.split(key, 3)
        return {
            "ln": jnp.ones(width),
            "qkv": jax.random.normal(k[0], (width, 3 * width)) * width**-0.5,
            "up": jax.random.normal(k[1], (width, 4 * width)) * width**-0.5,
            "down": jax.random.normal(k[2], (4 * width, width)) * (4 * width) ** -0.5,
        }

    def block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        """A small pre-norm block: one-head causal attention, then a GELU MLP."""
        h = x - x.mean(-1, keepdims=True)
        h = h * jax.lax.rsqrt((h**2).mean(-1, keepdims=True) + 1e-5) * p["ln"]
        q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
        logits = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), q @ k.swapaxes(1, 2), -1e30)
        x = x + jax.nn.softmax(logits / width**0.5) @ v
        return x + jax.nn.gelu(x @ p["up"]) @ p["down"]

    jaxaot.set_cache(None)
    blocks = [init_block(k) for k in jax.random.split(jax.random.key(0), layers)]
    x = jax.random.normal(jax.random.key(1), (batch, seq, width))
    cost = jax.jit(block).lower(blocks[0], x).compile().cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost or {}).get("flops", float("nan"))

    def loss(blocks: Any, x: jax.Array, layer: Any) -> jax.Array:
        for p in blocks:
            x = layer(p, x)
        return jnp.mean(x**2)

    def split_step(threshold: str) -> Any:
        os.environ["JAXAOT_RECOMPUTE_BELOW"] = threshold  # read when the step is first traced
        layer = jaxaot.component(block)
        step = jaxaot.jit(jax.value_and_grad(lambda b, x: loss(b, x, layer)), whole_program=False)
        jax.block_until_ready(step(blocks, x))
        jaxaot.wait_for_writes()
        return lambda: step(blocks, x)

    def scan_loss(stacked: Any, x: jax.Array) -> jax.Array:
        x = jax.lax.scan(lambda x, p: (block(p, x), None), x, stacked)[0]
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
    return {"flops": flops, **{k: statistics.median(v) for k, v in rows.items()}}


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
    print("| width, batch, seq | flops | residuals | recompute | scan | recompute / residuals |")
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
            f"| {width}, {batch}, {seq} | {r['flops'] / 1e6:.1f} M | {r['residuals']:.2f} | "
            f"{r['recompute']:.2f} | {r['scan']:.2f} | {r['recompute'] / r['residuals']:.2f} |"
        )


if __name__ == "__main__":
    main()
