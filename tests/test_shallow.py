"""A few small layers are not blocks (``jaxaot._regional._shallow``): a program of
fewer than five small Equinox or Flax NNX layers is compiled whole from one
trace, bit for bit ``jax.jit``'s; more layers, or big ones, are blocks. (The
linen and Haiku cases are in ``test_scoped.py``, with their counting trace.)"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaot

WIDTH = 16
_RUNS: list[str] = []  # one item per layer call traced


class Block(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, key: jax.Array) -> None:
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=key)
        self.norm = eqx.nn.LayerNorm(WIDTH)

    def __call__(self, x: jax.Array) -> jax.Array:
        _RUNS.append("eqx")
        return x + jnp.tanh(jax.vmap(self.linear)(jax.vmap(self.norm)(x)))


class Model(eqx.Module):
    blocks: list[Block]

    def __init__(self, layers: int) -> None:
        self.blocks = [Block(k) for k in jax.random.split(jax.random.key(0), layers)]

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


def _equinox_step(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """An Equinox train step with optax Adam: the optimizer state holds two more
    copies of the model's structure (and so of its blocks)."""
    model = Model(layers)
    tx = optax.adam(1e-2)
    opt = tx.init(eqx.filter(model, eqx.is_array))
    x = jnp.linspace(-1.0, 1.0, 4 * WIDTH).reshape(4, WIDTH)

    def step(model: Model, opt: Any, x: jax.Array) -> Any:
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        updates, opt = tx.update(grads, opt, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt, loss

    return step, (model, opt, x)


def _bits(got: Any, want: Any) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _run_and_explain(regional: Any, step: Any, args: tuple[Any, ...]) -> str:
    """Runs ``regional``, checks its values against ``eqx.filter_jit``'s, and
    returns what ``explain`` says of the call."""
    got = regional(*args)
    want = eqx.filter_jit(step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    return str(regional.explain(*args))


@pytest.mark.parametrize("layers", [2, 4])
def test_a_few_small_equinox_layers_are_compiled_whole_from_one_trace(layers: int) -> None:
    step, args = _equinox_step(layers)
    regional = jaxaot.jit(step)
    _RUNS.clear()
    got = regional(*args)
    assert len(_RUNS) == layers  # one trace, its layers not blocks
    _bits(got, eqx.filter_jit(step)(*args))
    explained = regional.explain(*args)
    says = f"one program, cached whole (a few small layers, Block x{layers}, each called fewer"
    assert says in explained, explained


def test_layers_stacked_under_a_scan_say_so() -> None:
    """Equinox layers stacked with ``filter_vmap`` and run by ``lax.scan``: one body
    compiled once, so nothing splits; ``explain`` says it is the scan (not that
    each layer is called once), with jax.jit's values."""

    @eqx.filter_vmap
    def make(key: jax.Array) -> eqx.nn.Linear:
        return eqx.nn.Linear(WIDTH, WIDTH, key=key)

    stacked = make(jax.random.split(jax.random.key(0), 6))
    params, static = eqx.partition(stacked, eqx.is_array)
    x = jnp.ones((4, WIDTH))

    def loss(params: Any, x: jax.Array) -> jax.Array:
        def layer(h: jax.Array, p: Any) -> tuple[jax.Array, None]:
            return h + jnp.tanh(jax.vmap(eqx.combine(p, static))(h)), None

        return jnp.mean(jax.lax.scan(layer, x, params)[0] ** 2)

    step = jax.value_and_grad(loss)
    before = jaxaot.jit(step).explain(params, x)  # (explained before any call, too)
    regional = jaxaot.jit(step)
    _bits(regional(params, x), jax.jit(step)(params, x))
    for explained in (before, regional.explain(params, x)):
        assert (
            "its layers run under lax.scan or fori_loop (as with nn.scan, hk.layer_stack"
            in explained
        )
        assert "called once" not in explained and "repeats no block" not in explained


def test_five_equinox_layers_are_blocks_from_one_trace() -> None:
    """Five instances in every copy of the model: a loop, found before the trace
    (no counting trace first)."""
    step, args = _equinox_step(5)
    regional = jaxaot.jit(step)
    _RUNS.clear()
    got = regional(*args)
    assert len(_RUNS) <= 5  # one trace (a block's body is traced once per signature)
    want = eqx.filter_jit(step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert "block jit(Block.__call__): 5 forward" in regional.explain(*args)


def test_a_few_big_equinox_layers_are_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Big calls (every call, with the threshold at 1): traced again with them as
    blocks, which run split."""
    from jaxaot._regional import _whole

    monkeypatch.setattr(_whole, "WHOLE_BELOW", 1.0)
    step, args = _equinox_step(3)
    regional = jaxaot.jit(step)
    explained = _run_and_explain(regional, step, args)
    assert "block jit(Block.__call__): 3 forward" in explained, explained
    assert "runs split" in explained, explained


class NBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        _RUNS.append("nnx")
        return x + jnp.tanh(self.linear(x))


class NModel(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([NBlock(rngs) for _ in range(layers)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_few_small_nnx_layers_merged_in_the_step_are_compiled_whole() -> None:
    """NNX's functional form: the GraphDef counts the layers."""
    graphdef, state = nnx.split(NModel(3, nnx.Rngs(0)))
    x = jnp.linspace(-1.0, 1.0, 4 * WIDTH).reshape(4, WIDTH)

    def loss(state: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    step = jax.value_and_grad(loss)
    regional = jaxaot.jit(step)
    _RUNS.clear()
    got = regional(state, x)
    assert len(_RUNS) == 3
    _bits(got, jax.jit(step)(state, x))
    explained = regional.explain(state, x)
    assert "cached whole (a few small layers, NBlock x3, each called fewer than 5" in explained, (
        explained
    )


def test_whole_program_off_keeps_a_few_small_layers_as_blocks() -> None:
    step, args = _equinox_step(3)
    regional = jaxaot.jit(step, whole_program=False)
    assert "block jit(Block.__call__): 3 forward" in _run_and_explain(regional, step, args)


def test_a_step_that_raises_leaves_the_layer_class_as_it_was() -> None:
    """The counting trace swaps the class's ``__call__``; a step that raises in it
    puts it back (and raises what ``jax.jit`` raises)."""
    model = Model(3)
    before = Block.__dict__["__call__"]

    def step(model: Model, x: jax.Array) -> jax.Array:
        return model(x) @ jnp.ones((WIDTH + 1, 2))  # shapes that do not fit

    x = jnp.ones((4, WIDTH))
    with pytest.raises(TypeError) as jitted:
        eqx.filter_jit(step)(model, x)
    with pytest.raises(TypeError) as regional:
        jaxaot.jit(step)(model, x)
    assert str(regional.value) == str(jitted.value)
    assert Block.__dict__["__call__"] is before
    _RUNS.clear()
    model(x)  # an eager call runs the class's own __call__, counted nowhere else
    assert _RUNS == ["eqx"] * 3


def test_a_few_small_layers_named_in_blocks_are_blocks() -> None:
    step, args = _equinox_step(3)
    regional = jaxaot.jit(step, blocks=(Block,))
    explained = _run_and_explain(regional, step, args)
    assert "block jit(Block.__call__): 3 forward" in explained, explained
    assert "runs as one program, its layers unrolled" in explained, explained


def test_a_train_state_holding_the_model_and_its_optimizer_state_counts_each() -> None:
    """One argument holding the model and the optimizer's copies of it: the layers
    are counted per model, not per argument (three copies of three layers are
    still a few layers)."""
    step, (model, opt, x) = _equinox_step(3)

    def state_step(state: tuple[Any, Any], x: jax.Array) -> Any:
        model, opt, loss = step(*state, x)
        return (model, opt), loss

    regional = jaxaot.jit(state_step)
    _RUNS.clear()
    got = regional((model, opt), x)
    assert len(_RUNS) == 3  # one trace
    _bits(got, eqx.filter_jit(state_step)((model, opt), x))
    assert "a few small layers, Block x3" in regional.explain((model, opt), x)
