"""An Equinox training loop whose train step is one component: the step takes the
model and the optimizer state and returns the updated ones, as with
``eqx.filter_jit``. Run it twice: the second process loads the compiled step
from the cache, and its last line says so (``warm start``, 0 compiles).

Run: ``python examples/equinox_train.py [--steps 50] [--cache-dir DIR]``
"""

from __future__ import annotations

import argparse
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxaot

optimizer = optax.adam(1e-2)


class MLP(eqx.Module):
    layers: list[eqx.nn.Linear]

    def __init__(self, sizes: list[int], key: jax.Array) -> None:
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [
            eqx.nn.Linear(m, n, key=k) for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
        ]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    pred = jax.vmap(model)(x)
    return jnp.mean((pred - y) ** 2)


@jaxaot.component
def train_step(model: MLP, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    if args.cache_dir:
        jaxaot.set_cache(jaxaot.DirectoryCache(args.cache_dir))
    model = MLP([8, 32, 32, 1], jax.random.key(0))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.key(1), (64, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    losses = []
    for _ in range(args.steps):
        model, opt_state, loss = train_step(model, opt_state, x, y)
        losses.append(float(loss))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"train_step: {train_step.cache_info()}")
    print(jaxaot.report())


if __name__ == "__main__":
    main()
