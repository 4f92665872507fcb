"""Models and helpers shared by the tests of ``jaxaot.jit`` (``test_regional``,
``test_plan``, ``test_whole``)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaot
from jaxaot.cli import _model

WIDTH, SEQ, BATCH = 16, 8, 2


block = jaxaot.component(_model.block, static_argnames=("heads", "causal"))


def loss(blocks: list[dict[str, jax.Array]], x: jax.Array, block_fn: Any) -> jax.Array:
    for p in blocks:
        x = block_fn(p, x)
    return jnp.mean(x**2)


def train_step_factory(block_fn: Any) -> tuple[Any, Any]:
    optimizer = optax.adam(1e-2)

    def step(blocks: Any, opt_state: Any, x: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(blocks, x, block_fn)
        updates, opt_state = optimizer.update(grads, opt_state, blocks)
        return optax.apply_updates(blocks, updates), opt_state, value

    return step, optimizer


def setup(layers: int) -> tuple[Any, jax.Array]:
    blocks = _model.init_blocks(jax.random.key(0), layers, WIDTH)
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, WIDTH))
    return blocks, x


def close(a: Any, b: Any, tol: float = 5e-5) -> None:
    jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(u, v, rtol=tol, atol=tol), a, b)


def settle(fn: Any, make_args: Any, limit: float = 300.0) -> Any:
    """Calls ``fn`` (with fresh arguments each time) until it has chosen between its
    split and whole-program forms; returns its plan."""
    import time

    deadline = time.monotonic() + limit
    jax.block_until_ready(fn(*make_args()))
    (plan,) = fn._plans.values()
    while plan.pending():
        assert time.monotonic() < deadline, "the steady state was never chosen"
        if plan.whole is not None:
            concurrent.futures.wait([plan.whole])
        jax.block_until_ready(fn(*make_args()))
    return plan
