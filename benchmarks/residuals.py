"""Residual bytes per block: what the benchmark block's forward entry writes for
the backward pass, before and after jaxaot's residual pruning
(``jaxaot/_component/_rewrites.py``), with the JAX version that traced it.

Residuals that are elementwise arithmetic of other residuals are recomputed by
the linear entry instead of being written by the forward one. JAX versions
differ in how they express derivatives (from 0.11.2 tanh's derivative is a
``one_minus_square`` primitive), so the figure is worth comparing across them.

Run: ``python benchmarks/residuals.py [--batch 8 --seq 128 --width 256]``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp

import jaxaot
from jaxaot._component import _rewrites
from jaxaot.cli import _model


def _bytes(avals: Any) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in avals)


def measure(batch: int, seq: int, width: int) -> dict[str, Any]:
    seen: list[tuple[Any, Any, int]] = []
    original = _rewrites.prune_residuals

    def spy(known: Any, unknown: Any, n_out: int) -> tuple[Any, Any]:
        pruned = original(known, unknown, n_out)
        seen.append((known, pruned[0], n_out))
        return pruned

    # Wherever jaxaot imported it from _rewrites.
    patched = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("jaxaot") and getattr(m, "prune_residuals", None) is original
    ]
    for m in patched:
        m.prune_residuals = spy  # type: ignore[attr-defined]
    try:
        params = _model.init_block(jax.random.key(0), width)
        x = jax.random.normal(jax.random.key(1), (batch, seq, width), jnp.float32)
        comp = jaxaot.component(_model.block)
        with jaxaot.using_cache(jaxaot.MemoryCache()):
            jax.grad(lambda p, x: jnp.sum(comp(p, x)), argnums=(0, 1))(params, x)
    finally:
        for m in patched:
            m.prune_residuals = original  # type: ignore[attr-defined]
    known, pruned, n_out = seen[0]
    return {
        "jax": jax.__version__,
        "residuals before pruning": len(known.out_avals) - n_out,
        "residuals written": len(pruned.out_avals) - n_out,
        "MB before pruning": _bytes(known.out_avals[n_out:]) / 1e6,
        "MB written": _bytes(pruned.out_avals[n_out:]) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    row = measure(args.batch, args.seq, args.width)
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print(
        "| "
        + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values())
        + " |"
    )


if __name__ == "__main__":
    main()
