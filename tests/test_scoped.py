"""Linen and Haiku layers of a plain loop as blocks (``jaxaot._regional._scoped``):
found by a counting trace, split where it is sound, left inline (and said so)
where it is not; values always those of ``jax.jit``."""

from __future__ import annotations

import enum
import functools
import logging
from typing import Any

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot
from jaxaot._regional._scoped import Calls, counting, scoped_blocks

WIDTH = 16


def _same(got: Any, want: Any) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


class Dropped(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dropout(0.5, deterministic=False)(nn.Dense(WIDTH)(x))
        return x + jnp.tanh(h)


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(nn.BatchNorm(use_running_average=False)(nn.Dense(WIDTH)(x)))


class Pure(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(nn.Dense(WIDTH)(nn.LayerNorm()(x)))


def _linen(block: type[nn.Module], layers: int = 3, **apply: Any) -> tuple[Any, tuple[Any, ...]]:
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(layers):
                x = block()(x)
            return x

    model, x = Model(), jnp.ones((2, WIDTH))
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

    def loss(variables: Any, x: jax.Array) -> jax.Array:
        out = model.apply(variables, x, **apply)
        out = out[0] if isinstance(out, tuple) else out
        return (out**2).mean()

    return jax.value_and_grad(loss), (variables, x)


def test_linen_layers_with_mutable_state_stay_inline_and_say_why() -> None:
    # (Five layers: fewer small ones are not looked at as blocks at all, see below.)
    step, args = _linen(Normed, layers=5, mutable=["batch_stats"])
    regional = jaxaot.jit(step)
    _same(regional(*args), jax.jit(step)(*args))
    explained = regional.explain(*args)
    says = "Normed.__call__: left inline: its scope has mutable collections"
    assert "not blocks:" in explained and says in explained, explained
    # Named in blocks=, it is still refused; nothing then suggests blocks= again.
    named = jaxaot.jit(step, blocks=(Normed,)).explain(*args)
    assert says in named and "its layers cannot be blocks" in named, named
    assert "blocks=" not in named and "blocks=" not in explained, (named, explained)


class Drawing(nn.Module):
    """Draws in its own scope (twice) and in a child's."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + 0.1 * jax.random.normal(self.make_rng("dropout"), x.shape)
        x = nn.Dropout(0.5, deterministic=False)(nn.Dense(WIDTH)(x))
        return x + 0.1 * jax.random.normal(self.make_rng("dropout"), x.shape)


class Direct(nn.Module):
    """Makes its key from its scope's stream itself, not by ``make_rng``."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        key = self.scope.rngs["dropout"].as_jax_rng()
        return x + jax.random.normal(key, x.shape) * nn.Dense(WIDTH)(x)


@pytest.mark.parametrize(("key", "shared"), [(jax.random.key, False), (jax.random.PRNGKey, True)])
def test_linen_layers_drawing_random_numbers_are_blocks_with_jax_jit_draws(
    key: Any, shared: bool
) -> None:
    """Layers drawing from the scope's streams (dropout, their own ``make_rng``)
    are one block, called with keys made where each layer sits: the draws, loss
    and gradients are ``jax.jit``'s. A layer called again (``shared``) draws on
    from where its first call left off, as inline, and so does a fresh layer."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.Dropout(0.1, deterministic=False)(x)
            first = Drawing()
            for layer in (first, Drawing(), first, Drawing()) if shared else [Drawing()] * 0:
                x = layer(x)
            for _ in range(0 if shared else 4):
                x = Drawing()(x)
            return nn.Dense(1)(x)

    model, x = Model(), jnp.ones((2, WIDTH))
    variables = model.init({"params": key(0), "dropout": key(1)}, x)

    def loss(variables: Any, x: jax.Array, k: jax.Array) -> jax.Array:
        return (model.apply(variables, x, rngs={"dropout": k}) ** 2).mean()

    step, args = jax.value_and_grad(loss), (variables, x, key(5))
    regional = jaxaot.jit(step, whole_program=False)
    got, want = regional(*args), jax.jit(step)(*args)
    _same(got, want)
    explained = regional.explain(*args)
    assert "block jit(Drawing.__call__): 4 forward, 4 linear/transpose" in explained, explained
    assert "left inline" not in explained, explained
    # Other keys draw other numbers (the draws are inputs of the block, not constants).
    other = (variables, x, key(6))
    assert not np.allclose(regional(*other)[0], got[0])
    _same(regional(*other), jax.jit(step)(*other))


def test_a_linen_layer_whose_keys_flax_makes_otherwise_stays_inline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    step, args = _linen(Direct, rngs={"dropout": jax.random.key(2)})
    regional = jaxaot.jit(step, whole_program=False)
    with caplog.at_level(logging.DEBUG, logger="jaxaot"):  # what explain would list
        _same(regional(*args), jax.jit(step)(*args))
    says = "Direct.__call__ is not a block (left inline: it makes random keys other than by"
    assert says in caplog.text, caplog.text


def test_pure_linen_layers_of_a_plain_loop_are_blocks() -> None:
    step, args = _linen(Pure)
    regional = jaxaot.jit(step, whole_program=False)
    _same(regional(*args), jax.jit(step)(*args))
    assert "block jit(Pure.__call__): 3 forward, 3 linear/transpose" in regional.explain(*args)


_RUNS: list[int] = []


class Counted(nn.Module):
    """Counts how often its body runs (once per layer per trace)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        _RUNS.append(1)
        return x + jnp.tanh(nn.Dense(WIDTH)(nn.LayerNorm()(x)))


@pytest.mark.parametrize("layers", [2, 4])
def test_a_few_small_linen_layers_are_compiled_whole_from_one_trace(layers: int) -> None:
    """Fewer layers than a loop takes, each small: as blocks, the program would
    run as one program with them unrolled. It is that program from its first
    trace (no second trace with them as blocks), bit for bit ``jax.jit``'s, and
    ``explain`` says why."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(layers):
                x = Counted()(x)
            return nn.Dense(1)(x)

    model, x = Model(), jnp.ones((2, WIDTH))
    variables = model.init(jax.random.key(0), x)
    step = jax.value_and_grad(lambda v, x: (model.apply(v, x) ** 2).mean())
    regional = jaxaot.jit(step)
    _RUNS.clear()
    got = regional(variables, x)
    assert len(_RUNS) == layers  # one trace
    want = jax.jit(step)(variables, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    explained = regional.explain(variables, x)
    says = f"one program, cached whole (a few small layers, Counted x{layers}, each called fewer"
    assert says in explained, explained


_ACTS: list[Any] = []


class Acting(nn.Module):
    """Records the activation of each run of its body."""

    act: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        _ACTS.append(self.act)
        return x + self.act(nn.Dense(WIDTH)(nn.LayerNorm()(x)))


@pytest.mark.parametrize("whole_program", [False, True])
def test_linen_layers_of_one_configuration_are_traced_once_as_blocks(
    whole_program: bool,
) -> None:
    """Six layers of two configurations (activations alternating): the counting
    trace runs every layer, the trace that makes them blocks each configuration
    once (JAX gives every later layer of it that trace, as ``nn.jit`` does), and
    each layer still computes with its own activation: ``jax.jit``'s values."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for i in range(6):
                x = Acting(act=(jnp.tanh, jax.nn.relu)[i % 2])(x)
            return x

    model, x = Model(), jnp.linspace(-1.0, 1.0, 2 * WIDTH).reshape(2, WIDTH)
    variables = model.init(jax.random.key(0), x)
    step = jax.value_and_grad(lambda v, x: (model.apply(v, x) ** 2).mean())
    regional = jaxaot.jit(step, whole_program=whole_program)
    _ACTS.clear()
    got = regional(variables, x)
    assert len(_ACTS) == 6 + 2 and _ACTS[6:] == [jnp.tanh, jax.nn.relu], _ACTS
    _same(got, jax.jit(step)(variables, x))
    assert "Acting.__call__" in regional.explain(variables, x)


class Scaling(nn.Module):
    """Scales by a field whose type decides the result (a NumPy scalar promotes
    bfloat16 values; a Python number does not, and an int floors)."""

    s: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(WIDTH)(x)
        s = self.s.value if isinstance(self.s, enum.Enum) else self.s
        if isinstance(s, int):
            return h + (jnp.arange(WIDTH) * s) // 3
        return h * s


def _member(value: float) -> enum.Enum:
    """A member ``A`` of an enum made here: two calls, two enums of one name."""

    class Mode(enum.Enum):
        A = value

    return Mode.A


@pytest.mark.parametrize(
    "fields",
    [
        [0.5] * 3 + [np.float32(0.5)] * 3,
        [1] * 3 + [1.0] * 3,
        [0.0] * 3 + [-0.0] * 3,
        [_member(2.0)] * 3 + [_member(3.0)] * 3,
    ],
    ids=["number_and_numpy_scalar", "int_and_float", "zero_and_negative_zero", "two_enums"],
)
def test_linen_layers_whose_fields_are_equal_but_of_other_types_are_traced_apart(
    fields: list[Any],
) -> None:
    """Six layers whose fields compare equal (``0.5 == np.float32(0.5)``,
    ``1 == 1.0``, ``0.0 == -0.0``) but compute apart: they are keyed by their
    typed text, so each configuration is traced on its own, and the values and
    dtypes are ``jax.jit``'s (Flax's own fingerprint, as ``nn.jit`` keys its
    traces, made them share one trace)."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for field in fields:
                x = Scaling(field)(x)
            return x

    model = Model()
    x = jnp.linspace(-1.0, 1.0, 2 * WIDTH).reshape(2, WIDTH).astype(jnp.bfloat16)
    variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16), model.init(jax.random.key(0), x))

    def f(v: Any, x: jax.Array) -> Any:
        out = model.apply(v, x)
        return out, jnp.copysign(1.0, out)  # (and the signs, of zeros too)

    got, want = jaxaot.jit(f)(variables, x), jax.jit(f)(variables, x)
    assert got[0].dtype == want[0].dtype
    np.testing.assert_allclose(
        np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=2e-2, atol=2e-2
    )
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))


class _Few(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(3):
            x = Counted()(x)
        return nn.Dense(1)(x)


class _FewJitted(nn.Module):
    """gemma's form: ``nn.jit`` on the model's ``__call__``."""

    @functools.partial(nn.jit, static_argnames=("self",))
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(3):
            x = Counted()(x)
        return nn.Dense(1)(x)


@pytest.mark.parametrize("form", ["class", "method"])
def test_a_few_small_linen_layers_under_nn_jit_make_no_entry_of_their_model(form: str) -> None:
    """``nn.jit`` around a model of a few small layers (of its class, or of its
    ``__call__`` as gemma's): the jit, which wraps the repeated layers, is looked
    through rather than made a block called once (its forward and backward
    entries made, only to be inlined into the whole program again). One trace,
    one program compiled, nothing else made, ``jax.jit``'s bits."""
    # (Rows of their own: the two forms are one program, which a process makes once.)
    rows = 2 if form == "class" else 3
    model, x = (nn.jit(_Few)() if form == "class" else _FewJitted()), jnp.ones((rows, WIDTH))
    variables = model.init(jax.random.key(0), x)
    step = jax.value_and_grad(lambda v, x: (model.apply(v, x) ** 2).mean())
    regional = jaxaot.jit(step)
    _RUNS.clear()
    before = jaxaot.stats()
    got = regional(variables, x)
    after = jaxaot.stats()
    assert len(_RUNS) == 3  # one trace
    made = {k: after[k] - before[k] for k in ("misses", "lowerings", "compiles")}
    assert made == {"misses": 1, "lowerings": 0, "compiles": 1}, made
    want = jax.jit(step)(variables, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    explained = regional.explain(variables, x)
    assert "cached whole (a few small layers, Counted x3" in explained, explained
    assert "__call__): looked through (it wraps repeated layers)" in explained, explained


class TwoNorms(nn.Module):
    """A layer calling a framework layer twice (its norms): still a layer."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + jnp.tanh(nn.Dense(WIDTH)(nn.LayerNorm()(x)))
        return x + jnp.tanh(nn.Dense(WIDTH)(nn.LayerNorm()(x)))


def test_nn_jit_layers_calling_framework_layers_twice_are_still_blocks() -> None:
    """``nn.jit`` around each layer, whose body calls ``nn.LayerNorm`` twice:
    the framework's own layers repeating inside it make it no wrapper of layers,
    so each lifted call stays a block."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(5):
                x = nn.jit(TwoNorms)()(x)
            return x

    model, x = Model(), jnp.ones((2, WIDTH))
    variables = model.init(jax.random.key(0), x)
    step = jax.value_and_grad(lambda v, x: (model.apply(v, x) ** 2).mean())
    regional = jaxaot.jit(step, whole_program=False)
    _same(regional(variables, x), jax.jit(step)(variables, x))
    explained = regional.explain(variables, x)
    assert "TwoNorms.__call__): 5 forward, 5 linear/transpose" in explained, explained
    assert "looked through" not in explained, explained


@pytest.mark.parametrize("many", [True, False])
def test_layers_that_loop_or_are_big_are_still_blocks(
    many: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five layers of a kind (a loop), or a few whose calls are big: blocks, as
    before (the counting trace, then one with them as blocks)."""
    from jaxaot._regional import _whole

    if not many:
        monkeypatch.setattr(_whole, "WHOLE_BELOW", 1.0)
    step, args = _linen(Pure, layers=5 if many else 3)
    regional = jaxaot.jit(step)
    _same(regional(*args), jax.jit(step)(*args))
    explained = regional.explain(*args)
    n = 5 if many else 3
    assert f"block jit(Pure.__call__): {n} forward, {n} linear/transpose" in explained, explained


def test_a_few_small_haiku_layers_are_compiled_whole() -> None:
    def net(x: jax.Array) -> jax.Array:
        for _ in range(4):
            x = x + jnp.tanh(hk.Linear(WIDTH)(x))
        return (x**2).mean()

    model = hk.without_apply_rng(hk.transform(net))
    x = jnp.ones((2, WIDTH))
    params = model.init(jax.random.key(0), x)
    step = jax.value_and_grad(model.apply)
    regional = jaxaot.jit(step)
    got, want = regional(params, x), jax.jit(step)(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    explained = regional.explain(params, x)
    assert "cached whole (a few small layers, Linear x4, each called fewer than 5" in explained, (
        explained
    )


def test_a_four_layer_haiku_transformer_is_compiled_whole_from_one_trace() -> None:
    """A Haiku transformer's train step (attention and an MLP of width 64, 4
    layers, as in ``benchmarks/real_models.py``): its layers' share of the
    program's work, backward passes and glue included, is above one split
    entry's threshold, yet each of their entries would be below it, so the
    program runs whole, as ``jax.jit`` compiles it, from its first trace."""
    width, runs = 64, []

    class Layer(hk.Module):
        def __call__(self, x: jax.Array) -> jax.Array:
            runs.append(1)
            h = hk.LayerNorm(-1, True, True)(x)
            init = hk.initializers.VarianceScaling()
            x = x + hk.MultiHeadAttention(4, width // 4, w_init=init)(h, h, h)
            h = hk.LayerNorm(-1, True, True)(x)
            return x + hk.Linear(width)(jax.nn.gelu(hk.Linear(4 * width)(h)))

    def net(tokens: jax.Array) -> jax.Array:
        x = hk.Embed(128, width)(tokens)
        for _ in range(4):
            x = Layer()(x)
        return jnp.mean(hk.Linear(128)(x) ** 2)

    model = hk.without_apply_rng(hk.transform(net))
    tokens = jax.random.randint(jax.random.key(0), (4, 32), 0, 128)
    params = model.init(jax.random.key(1), tokens)
    step = jax.value_and_grad(model.apply)
    regional = jaxaot.jit(step)
    runs.clear()
    got = regional(params, tokens)
    assert len(runs) == 4  # one trace
    _same(got, jax.jit(step)(params, tokens))
    explained = regional.explain(params, tokens)
    assert "cached whole (a few small layers, " in explained, explained
    assert ".Layer x4, each called fewer than 5 times" in explained, explained


def test_explain_before_the_first_call_leaves_the_plan_alone() -> None:
    """``explain`` first, then the call: the call's plan is the one a call alone
    makes (JAX's trace cache must not give it a trace that counted no module)."""
    step, args = _linen(Pure)
    regional = jaxaot.jit(step, whole_program=False)
    before = regional.explain(*args)
    _same(regional(*args), jax.jit(step)(*args))
    after = regional.explain(*args)
    assert "block jit(Pure.__call__): 3 forward" in before, before
    assert after == before, (before, after)


class Stateful(hk.Module):
    """Draws a key and counts its calls in Haiku state: both threaded through the block."""

    def __call__(self, x: jax.Array) -> jax.Array:
        count = hk.get_state("count", [], init=jnp.zeros)
        hk.set_state("count", count + 1)
        h = hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(WIDTH)(x))
        return x + jnp.tanh(h) * (count + 1)


def test_haiku_layers_with_random_keys_and_state_are_blocks_with_jax_jit_values() -> None:
    def net(x: jax.Array) -> jax.Array:
        for _ in range(3):
            x = Stateful()(x)
        return (x**2).mean()

    model = hk.transform_with_state(net)
    x = jnp.ones((2, WIDTH))
    params, state = model.init(jax.random.key(0), x)
    step = jax.value_and_grad(lambda p, s, k, x: model.apply(p, s, k, x), has_aux=True)
    args = (params, state, jax.random.key(1), x)
    regional = jaxaot.jit(step, whole_program=False)
    got, want = regional(*args), jax.jit(step)(*args)
    _same(got, want)
    (_, new_state), _ = got
    assert all(float(v["count"]) == 1.0 for v in new_state.values())
    assert "block jit(Stateful.__call__): 3 forward, 3 linear/transpose" in regional.explain(*args)


@jax.custom_vjp
def _clipped_tanh(x: jax.Array) -> jax.Array:
    return jnp.tanh(x)


_clipped_tanh.defvjp(
    lambda x: (jnp.tanh(x), x),
    lambda x, g: (jnp.clip(g * (1 - jnp.tanh(x) ** 2), -1.0, 1.0),),
)


class _ClippedBlock(hk.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + _clipped_tanh(hk.Linear(x.shape[-1])(x))


def test_haiku_layers_holding_a_custom_vjp_are_blocks_made_once() -> None:
    """Haiku layers whose activation has a custom VJP, under grad: each layer
    reads its own parameters. Keyed by what they read, the layers are one block (its forward and backward passes
    compiled once each), not a program per layer kept whole; values as jax.jit's."""

    model, params, x = _clipped(6)
    grad = jax.grad(model.apply)
    regional = jaxaot.jit(grad, whole_program=False)
    before = jaxaot.stats()["compiles"]
    _same(regional(params, x), jax.jit(grad)(params, x))
    made = jaxaot.stats()["compiles"] - before
    said = regional.explain(params, x)
    assert "block jit(_ClippedBlock.__call__) forward: 6 calls" in said, said
    assert "block jit(_ClippedBlock.__call__) backward: 6 calls" in said, said
    assert made <= 4, made  # the two blocks, and their glue


def _clipped(layers: int) -> tuple[Any, Any, jax.Array]:
    """A Haiku model of ``layers`` ``_ClippedBlock`` layers in a plain loop, its
    parameters and an input."""

    def net(x: jax.Array) -> jax.Array:
        for _ in range(layers):
            x = _ClippedBlock()(x)
        return (x**2).sum()

    model = hk.without_apply_rng(hk.transform(net))
    x = jnp.ones((2, WIDTH))
    return model, model.init(jax.random.key(0), x), x


def _block_inputs(layers: int, apply: Any) -> list[int]:
    """The inputs of each ``_ClippedBlock`` jit in the trace of ``apply`` (given
    the transform, its parameters and input) of a model of ``layers`` layers."""
    model, params, x = _clipped(layers)
    with scoped_blocks((_ClippedBlock,)):
        traced = jax.make_jaxpr(lambda p, x: apply(model, p, x))(params, x)
    return [
        len(eqn.invars)
        for eqn in traced.jaxpr.eqns
        if "_ClippedBlock" in str(eqn.params.get("name", ""))
    ]


@pytest.mark.parametrize(
    "apply",
    [
        lambda model, p, x: model.apply(p, x),
        lambda model, p, x: jax.grad(model.apply)(p, x),
    ],
    ids=["forward", "grad"],
)
def test_a_haiku_block_takes_the_parameters_it_reads_not_the_models(apply: Any) -> None:
    """Each layer's jit takes its own weight and bias and its input (its backward
    pass, residuals), at any depth:
    handed the whole model's parameters, a deep model's trace grew with the
    square of its depth."""
    shallow, deep = _block_inputs(2, apply), _block_inputs(8, apply)
    assert len(shallow) >= 2 and len(deep) == 4 * len(shallow), (shallow, deep)
    assert max(deep) == max(shallow) <= 4, (shallow, deep)


def test_haiku_layers_over_parameters_the_function_closes_over_are_blocks_made_once() -> None:
    """Parameters fixed by the function (constants of its program, not arguments)
    read by each layer: the layers are still one block, values as jax.jit's."""

    model, params, x = _clipped(6)
    apply = functools.partial(model.apply, params)
    regional = jaxaot.jit(jax.grad(apply), whole_program=False)
    _same(regional(x), jax.jit(jax.grad(apply))(x))
    said = regional.explain(x)
    assert "block jit(_ClippedBlock.__call__) forward: 6 calls" in said, said


def test_only_the_outermost_repeated_class_counts() -> None:
    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(WIDTH)(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return Inner()(Inner()(x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return Outer()(Outer()(x))

    x = jnp.ones((2, WIDTH))
    variables = Model().init(jax.random.key(0), x)
    with counting() as calls:
        assert isinstance(calls, Calls)
        jax.make_jaxpr(lambda v, x: Model().apply(v, x))(variables, x)
    assert calls.repeated() == (Outer,)


class JitModel(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(3):
            x = Pure()(x)
        return x


def test_a_model_under_nn_jit_splits_in_every_program_of_the_process() -> None:
    """``nn.jit`` caches its trace: a model it wraps, already run by ``jax.jit``
    (an eval step, a check against plain JAX) and then by a train step under
    ``jaxaot.jit``, still has its layers counted, found and named in the next
    program (the train step, then the loss alone), with jax.jit's values."""
    model, x = nn.jit(JitModel)(), jnp.ones((2, WIDTH))
    variables = model.init(jax.random.key(0), x)

    def loss(variables: Any, x: jax.Array) -> jax.Array:
        return (model.apply(variables, x) ** 2).mean()

    step = jax.value_and_grad(loss)
    want_loss, want_step = jax.jit(loss)(variables, x), jax.jit(step)(variables, x)
    for fn, want, calls in ((step, want_step, "3 forward"), (loss, want_loss, "3 call")):
        regional = jaxaot.jit(fn, whole_program=False)
        _same(regional(variables, x), want)
        said = regional.explain(variables, x)
        assert f"block jit(Pure.__call__): {calls}" in said, said
        assert "jit(JitModel.__call__): looked through" in said, said


def test_layers_each_called_once_start_no_executable_when_traced_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Remat'd linen layers that each build a number of their own into their
    program: each is called once, and the program is served whole. Its trace sees
    each layer's entries once, which is no repetition: no layer's executable is
    started in the background (warm processes compiled some each, never used)."""
    from jaxaot._regional import _planner, _tracing, _whole

    monkeypatch.setattr(_whole, "WHOLE_BELOW", 1.0)  # every call big: entries start early
    step, (variables, x) = _scaled_layers()
    regional = jaxaot.jit(step)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        started = _tracing.trace(
            regional._spec, (variables, x), {}, _planner._prefetch(regional._spec), False
        ).early
        for future in started.values():
            future.cancel()
        assert started == {}  # no layer's executable
        _same(regional(variables, x), jax.jit(step)(variables, x))
        assert "called once" in regional.explain(variables, x), regional.explain(variables, x)


class Member(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(WIDTH)(x))


class Ensemble(nn.Module):
    """Its stream split by ``nn.vmap``: each member draws its own mask."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        members = nn.vmap(
            Member,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=None,
            out_axes=0,
            axis_size=2,
        )
        return x + jnp.tanh(members()(x).mean(0))


class Handed(nn.Module):
    """Draws through a Dropout its parent made (at the parent's place)."""

    drop: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.drop(nn.Dense(WIDTH)(x), deterministic=False))


class Handing(nn.Module):
    def setup(self) -> None:
        self.drop = nn.Dropout(0.5)
        self.layers = [Handed(self.drop) for _ in range(2)]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


class Buffered(nn.Module):
    """Draws in ``setup``, which Flax runs in the layer's scope before its call."""

    def setup(self) -> None:
        self.dense = nn.Dense(WIDTH)
        self.noise = jax.random.normal(self.make_rng("dropout"), (WIDTH,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.dense(x)) + self.noise


class Buffering(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(2):
            x = Buffered()(x)
        return x


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (None, "Ensemble.__call__: left inline: a random stream is split or carried inside it"),
        (Handing(), "Handed.__call__: left inline: it holds a module of another scope"),
        (Buffering(), "Buffered.__call__: left inline: it draws random numbers in setup"),
    ],
    ids=["split-stream", "parents-module", "setup-draws"],
)
def test_layers_whose_draws_cannot_move_out_stay_inline_with_jax_jit_draws(
    model: Any, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream split inside the layer (``nn.vmap`` with ``split_rngs``), a module
    of the parent's scope, draws in ``setup``: the draws are not those made where
    the layer sits, so the layer stays inline, and the values are ``jax.jit``'s
    (they differed: every vmap member drew the same mask, ...)."""
    if model is None:

        class Model(nn.Module):
            @nn.compact
            def __call__(self, x: jax.Array) -> jax.Array:
                for _ in range(2):
                    x = Ensemble()(x)
                return x

        model = Model()
    x = jnp.ones((2, WIDTH))
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

    def step(variables: Any, x: jax.Array) -> jax.Array:
        return model.apply(variables, x, rngs={"dropout": jax.random.key(2)})  # type: ignore[no-any-return]

    args = (variables, x)
    regional = jaxaot.jit(step, whole_program=False)
    with caplog.at_level(logging.DEBUG, logger="jaxaot"):  # what explain would list
        _same(regional(*args), jax.jit(step)(*args))
    name, _, why = says.partition(": left inline: ")
    assert f"{name} is not a block (left inline: {why}" in caplog.text, caplog.text


def test_remat_layers_drawing_random_numbers_are_one_block() -> None:
    """``nn.remat`` of a layer with dropout: Flax folds each layer's place into its
    draws' keys, a number that is an input of the block, so the layers are one
    block, with ``jax.jit``'s values. Layers that each build a number of their own
    into their program are not: ``explain`` says which block ran how often, each
    call a different program (it said only that every block was called once)."""
    step, args = _linen(nn.remat(Dropped), rngs={"dropout": jax.random.key(2)})
    regional = jaxaot.jit(step)
    _same(regional(*args), jax.jit(step)(*args))
    said = regional.explain(*args)
    assert "checkpoint(Dropped.__call__): 3 forward" in said, said
    step, args = _scaled_layers()
    regional = jaxaot.jit(step)
    _same(regional(*args), jax.jit(step)(*args))
    said = regional.explain(*args)
    assert "every block it found is called once; " in said, said
    assert "checkpoint(Scaled.__call__) runs 3 times, each call a different program" in said


class Scaled(nn.Module):
    """A layer that builds a number of its own (its ``scale``) into its program."""

    scale: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(nn.Dense(WIDTH)(x)) * self.scale


def _scaled_layers() -> tuple[Any, tuple[Any, ...]]:
    """Three ``nn.remat`` layers, each of another ``scale``: three programs."""
    remat = nn.remat(Scaled)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for i in range(3):
                x = remat(scale=1.0 + 0.25 * i)(x)
            return x

    model, x = Model(), jnp.ones((2, WIDTH))
    variables = model.init(jax.random.key(0), x)

    def loss(variables: Any, x: jax.Array) -> jax.Array:
        return (model.apply(variables, x) ** 2).mean()

    return jax.value_and_grad(loss), (variables, x)
