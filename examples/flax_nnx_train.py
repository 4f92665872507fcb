"""A Flax NNX training loop whose train step is one component. NNX objects are
mutable Python objects, so the step works on their state: ``nnx.split`` gives
the model's and the optimizer's graph definition (a pytree with no arrays,
fixed for the run) and their state (arrays); the component takes both,
rebuilds the objects inside with ``nnx.merge``, and returns the updated state,
which the loop passes to the next step. Run it twice:
the second process loads the compiled step from the cache, and its last line
says so (``warm start``, 0 compiles).

Run: ``python examples/flax_nnx_train.py [--steps 50] [--cache-dir DIR]``
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxaot


class MLP(nnx.Module):
    def __init__(self, sizes: list[int], rngs: nnx.Rngs) -> None:
        self.layers = nnx.List(
            [nnx.Linear(m, n, rngs=rngs) for m, n in zip(sizes[:-1], sizes[1:], strict=True)]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = nnx.gelu(layer(x))
        return self.layers[-1](x)


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


# ``graphdef`` is an argument like the state: a pytree with no leaves, so only its
# structure (the model's layout and settings) is part of the key.
@jaxaot.component
def train_step(graphdef: Any, state: Any, x: jax.Array, y: jax.Array) -> Any:
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    _, state = nnx.split((model, optimizer))
    return state, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    if args.cache_dir:
        jaxaot.set_cache(jaxaot.DirectoryCache(args.cache_dir))
    model = MLP([8, 32, 32, 1], nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    x = jax.random.normal(jax.random.key(1), (64, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    losses = []
    for _ in range(args.steps):
        state, loss = train_step(graphdef, state, x, y)
        losses.append(float(loss))
    nnx.update((model, optimizer), state)  # the trained values back into the objects
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"train_step: {train_step.cache_info()}")
    print(jaxaot.report())


if __name__ == "__main__":
    main()
