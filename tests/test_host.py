"""to_host_async: early device-to-host copies of pytrees."""

from __future__ import annotations

from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxaot

Metrics = namedtuple("Metrics", ["loss", "extra"])


def test_nested_pytree_matches_device_get() -> None:
    tree = {
        "loss": jnp.float32(1.5),
        "per_layer": [jnp.arange(3), (jnp.ones((2, 2), jnp.bfloat16), None)],
        "named": Metrics(jnp.zeros(()), {"count": 7}),
    }
    handle = jaxaot.to_host_async(tree)
    result = handle.result()
    expected = jax.device_get(tree)
    assert jax.tree_util.tree_structure(result) == jax.tree_util.tree_structure(expected)
    for got, want in zip(
        jax.tree_util.tree_leaves(result), jax.tree_util.tree_leaves(expected), strict=True
    ):
        assert type(got) is type(want) or isinstance(got, np.ndarray)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype
    assert handle.result() is result  # computed once


def test_does_not_block_and_reports_readiness() -> None:
    @jax.jit
    def slow(x: jax.Array) -> jax.Array:
        for _ in range(30):
            x = jnp.tanh(x @ x.T @ x)
        return x

    out = slow(jnp.ones((256, 256)))
    handle = jaxaot.to_host_async({"out": out})  # returns while the computation may still run
    assert isinstance(handle.done(), bool)
    np.testing.assert_allclose(handle.result()["out"], np.asarray(out))
    assert handle.done()


def test_leaves_that_are_not_arrays_pass_through() -> None:
    assert jaxaot.to_host_async({"a": 1, "b": "text"}).result() == {"a": 1, "b": "text"}
