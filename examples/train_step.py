"""A whole train step as one component: forward, value_and_grad, an optax update,
and donated parameters and optimizer state. Run it twice: the second process
loads the compiled step from the cache (no trace, no lowering, no compile).

Run: ``python examples/train_step.py [--steps 50] [--cache-dir DIR]``
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxaot


def init(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / m**0.5, "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


@jaxaot.component
def layer(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ p["w"] + p["b"])


def loss_fn(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    for p in params[:-1]:
        x = layer(p, x)
    pred = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((pred - y) ** 2)


optimizer = optax.adamw(1e-2)


@jaxaot.component(donate_argnums=(0, 1))
def train_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    if args.cache_dir:
        jaxaot.set_cache(jaxaot.DirectoryCache(args.cache_dir))
    params = init(jax.random.key(0), [16, 64, 64, 1])
    opt_state = optimizer.init(params)
    x = jax.random.normal(jax.random.key(1), (128, 16))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    start = time.perf_counter()
    pending = None
    losses = []
    for i in range(args.steps):
        params, opt_state, metrics = train_step(params, opt_state, x, y)
        if pending is not None:
            losses.append(float(pending.result()["loss"]))
        pending = jaxaot.to_host_async(metrics)  # copied while the next step runs
        if i == 0:
            metrics["loss"].block_until_ready()
            first = time.perf_counter() - start
    assert pending is not None
    losses.append(float(pending.result()["loss"]))
    info = train_step.cache_info()
    print(f"first step {first:.2f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"train_step: {info}")
    cost = train_step.cost_analysis(params, opt_state, x, y) or {}
    # XLA's estimate has dozens of per-operand figures; these are the ones people read.
    shown = {k: cost[k] for k in ("flops", "transcendentals", "bytes accessed") if k in cost}
    print("cost analysis: " + ", ".join(f"{k} {v:.3g}" for k, v in shown.items()))


if __name__ == "__main__":
    main()
