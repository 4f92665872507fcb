"""A short tour of jaxaot: a component called directly, inside jax.jit, under
vmap and grad, and served from the cache by a second function with the same key.

Run: ``python examples/quickstart.py``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxaot


@jaxaot.component
def block(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One residual MLP block."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return x + h @ params["w2"]


def init(key: jax.Array, width: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (width, 4 * width)) / width**0.5,
        "b1": jnp.zeros(4 * width),
        "w2": jax.random.normal(k2, (4 * width, width)) / (4 * width) ** 0.5,
    }


def main() -> None:
    width, depth = 32, 6
    keys = jax.random.split(jax.random.key(0), depth)
    layers = [init(k, width) for k in keys]
    x = jnp.ones((8, width))

    @jax.jit
    def loss(layers: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        for p in layers:
            x = block(p, x)
        return jnp.mean(x**2)

    value, grads = jax.value_and_grad(loss)(layers, x)
    # Under jax.jit, as in a program: run eagerly, JAX would compile the batched
    # call op by op in every process (docs/limitations.md).
    per_example = jax.jit(jax.vmap(block, in_axes=(None, 0)))(layers[0], x[:, None, :])
    print(f"loss {float(value):.4f}, grad norm {float(jnp.linalg.norm(grads[0]['w1'])):.4f}")
    print(f"vmapped block output {per_example.shape}")
    print(f"block: {block.cache_info()}")
    print("the lowered program calls one cached function for all layers:")
    text = loss.lower(layers, x).as_text()
    print(
        f"  {text.count('func.func private @jaxaot_block')} function, {text.count('call @jaxaot_block')} calls"
    )

    # An explicit key is a promise that the computation is the same wherever the
    # key is used (here two functions; usually two programs, say training and
    # serving). The second is served the first's entry and never traced.
    @jaxaot.component(key="shared-block")
    def first(x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 2

    @jaxaot.component(key="shared-block")
    def second(x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 2

    same = bool(jnp.allclose(first(x), second(x)))
    print(f"same key, same result: {same}; second traced {second.cache_info().traces} times")
    print(jaxaot.report())


if __name__ == "__main__":
    main()
