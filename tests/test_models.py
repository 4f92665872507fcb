"""Components as users write them with model libraries: Equinox, Flax NNX and
linen, optax, typed PRNG keys, low precision training (issue 11).

Each cross-process test runs a script in fresh processes against one
directory cache: the variants must give their own results (never each
other's), and a rerun of a variant must neither lower nor compile (its keys
are the same in every process: no address, id or counter in them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot

eqx = pytest.importorskip("equinox")
nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")


def _run(script: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


_REPORT = textwrap.dedent(
    """
    jaxaot.wait_for_writes()
    infos = [c.cache_info() for c in COMPONENTS]
    print(json.dumps({
        "value": [float(v) for v in jnp.ravel(jnp.asarray(VALUE, jnp.float32))][:8],
        "digest": KEY.digest,
        "lowerings": sum(i.lowerings for i in infos),
        "compiles": sum(i.compiles for i in infos),
    }))
    """
)


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(
        "import json, sys\nimport jax, jax.numpy as jnp, numpy as np, jaxaot\n"
        + textwrap.dedent(body)
        + _REPORT
    )
    return path


def _variants(
    tmp_path: Path, env: dict[str, str], body: str, a: str = "a", b: str = "b"
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    script = _script(tmp_path, body)
    first = _run(script, env, a)
    other = _run(script, env, b)
    again = _run(script, env, a)
    assert first["value"] != other["value"], (first, other)
    assert first["digest"] != other["digest"]
    assert again["value"] == first["value"] and again["digest"] == first["digest"]
    assert again["lowerings"] == 0 and again["compiles"] == 0, again
    return first, other, again


# -- Equinox -----------------------------------------------------------------------------

EQX_DEEP_ACTIVATION = """
import equinox as eqx
activation = jax.nn.relu if sys.argv[1] == "a" else jax.nn.gelu
model = eqx.nn.Sequential([
    eqx.nn.Linear(4, 8, key=jax.random.key(0)),
    eqx.nn.Sequential([eqx.nn.Sequential([eqx.nn.Sequential([
        eqx.nn.Lambda(activation)])])]),
    eqx.nn.Linear(8, 1, key=jax.random.key(1)),
])
x = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4)
params, static = eqx.partition(model, eqx.is_array)

@jaxaot.component
def loss(params, x):
    m = eqx.combine(params, static)
    return jnp.mean(jax.vmap(m)(x) ** 2)

VALUE = jax.jit(loss)(params, x)
COMPONENTS, KEY = [loss], loss.cache_key(params, x)
"""


def test_equinox_models_differing_deep_inside_never_share_an_entry(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    _variants(tmp_path, subprocess_env, EQX_DEEP_ACTIVATION)


EQX_MODULE_DIRECTLY = """
import equinox as eqx

class Block(eqx.Module):
    w: jax.Array
    act: object = eqx.field(static=True)
    def __call__(self, x):
        return self.act(x @ self.w)

act = jax.nn.relu if sys.argv[1] == "a" else jnp.tanh
block = Block(jnp.full((3, 3), -0.5) + jnp.eye(3), act)

@jaxaot.component
def apply(block, x):
    return block(x)

x = jnp.ones((2, 3))
VALUE = apply(block, x)
COMPONENTS, KEY = [apply], apply.cache_key(block, x)
"""


def test_equinox_module_passed_directly_with_a_static_function(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    first, other, _ = _variants(tmp_path, subprocess_env, EQX_MODULE_DIRECTLY)
    np.testing.assert_allclose(first["value"], [0.0] * 6)
    np.testing.assert_allclose(other["value"], [np.tanh(-0.5)] * 6, rtol=1e-6)


def test_equinox_key_has_no_address() -> None:
    class Block(eqx.Module):
        w: jax.Array
        act: Any = eqx.field(static=True)

    comp = jaxaot.component(lambda b, x: b.act(x @ b.w))
    key = comp.cache_key(Block(jnp.eye(2), jax.nn.relu), jnp.ones(2))
    assert "0x" not in json.dumps(key.to_json())


# -- Flax -----------------------------------------------------------------------------------

NNX_MODEL = """
from flax import nnx

class MLP(nnx.Module):
    def __init__(self, act, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.l2 = nnx.Linear(4, 1, rngs=rngs)
        self.act = act
    def __call__(self, x):
        return self.l2(self.act(self.l1(x)))

act = nnx.relu if sys.argv[1] == "a" else nnx.tanh
model = MLP(act, nnx.Rngs(0))
x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
graphdef, state = nnx.split(model)

@jaxaot.component
def closed(state, x):  # closes over the GraphDef
    return nnx.merge(graphdef, state)(x)

@jaxaot.component
def direct(graphdef, state, x):  # a GraphDef and a State passed directly
    return nnx.merge(graphdef, state)(x)

VALUE = jnp.concatenate([closed(state, x), jax.jit(direct)(graphdef, state, x)])
COMPONENTS, KEY = [closed, direct], direct.cache_key(graphdef, state, x)
"""


def test_flax_nnx_graphdef_closed_over_and_passed_directly(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    _variants(tmp_path, subprocess_env, NNX_MODEL)


LINEN_MODEL = """
import dataclasses
import flax.linen as nn

@dataclasses.dataclass(frozen=True)
class Heads:
    num_heads: int

@dataclasses.dataclass(frozen=True)
class Attn:
    heads: Heads

@dataclasses.dataclass(frozen=True)
class Layer:
    attn: Attn

@dataclasses.dataclass(frozen=True)
class Config:
    layer: Layer
    width: int = 8

class Attention(nn.Module):
    config: Config
    @nn.compact
    def __call__(self, x):
        heads = self.config.layer.attn.heads.num_heads
        q = nn.Dense(self.config.width)(x).reshape(x.shape[0], heads, -1)
        return jax.nn.softmax(q @ q.transpose(0, 2, 1) / heads).sum(-1)

class Model(nn.Module):
    config: Config
    @nn.compact
    def __call__(self, x):
        return Attention(self.config)(x)

heads = 4 if sys.argv[1] == "a" else 2
model = Model(Config(Layer(Attn(Heads(heads)))))
x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)
params = model.init(jax.random.key(0), x)

@jaxaot.component
def apply(params, x):
    return model.apply(params, x)

VALUE = apply(params, x)
COMPONENTS, KEY = [apply], apply.cache_key(params, x)
"""


def test_flax_linen_nested_config_changes_the_key(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    _variants(tmp_path, subprocess_env, LINEN_MODEL)


# -- optax and typed PRNG keys ------------------------------------------------------------

OPTAX_STEP = """
import optax
lr = 1e-1 if sys.argv[1] == "a" else 1e-2
tx = optax.adam(lr)
params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
state = tx.init(params)
x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)

@jaxaot.component
def step(params, state, x):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

p, s, _ = step(params, state, x)
p, s, _ = step(p, s, x)
VALUE = p["w"]
COMPONENTS, KEY = [step], step.cache_key(params, state, x)
"""


def test_optax_step_learning_rate_is_part_of_the_key(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    _variants(tmp_path, subprocess_env, OPTAX_STEP)


def test_optax_step_matches_plain() -> None:
    tx = optax.adamw(1e-2)
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)

    def step(params: Any, state: Any) -> Any:
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    comp = jaxaot.component(step)
    got = want = (params, tx.init(params))
    for _ in range(3):
        got, want = comp(*got), jax.jit(step)(*want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_typed_prng_keys_as_arguments_match_plain() -> None:
    def sample(key: jax.Array, x: jax.Array) -> jax.Array:
        return x + jax.random.normal(key, x.shape)

    comp = jaxaot.component(sample)
    key, x = jax.random.key(3), jnp.zeros(4)
    np.testing.assert_array_equal(comp(key, x), sample(key, x))
    np.testing.assert_array_equal(jax.jit(comp)(key, x), sample(key, x))
    keys = jax.random.split(key, 3)
    np.testing.assert_array_equal(
        jax.vmap(comp, in_axes=(0, None))(keys, x), jax.vmap(sample, in_axes=(0, None))(keys, x)
    )


TYPED_KEYS = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, jaxaot

    @jaxaot.component
    def sample(key, x):
        return x + jax.random.normal(key, x.shape), jax.random.split(key)[0]

    key, x = jax.random.key(3), jnp.zeros(4)
    a, k2 = sample(key, x)
    b = jax.jit(lambda k, x: sample(k, x)[0])(key, x)
    g = jax.grad(lambda x: sample(key, x)[0].sum())(x)
    jaxaot.wait_for_writes()
    print(json.dumps({
        "a": np.asarray(a).tolist(), "b": np.asarray(b).tolist(),
        "k2": np.asarray(jax.random.key_data(k2)).tolist(),
        "key_dtype": str(k2.dtype), "g": np.asarray(g).tolist(),
        "info": sample.cache_info()._asdict(),
    }))
    """
)


def test_typed_prng_keys_are_persisted(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """Entries whose inputs or outputs are typed keys are written, and a fresh process
    loads them (no lowering, no compile) and returns the same keys and values."""
    script = tmp_path / "keys.py"
    script.write_text(TYPED_KEYS)
    env = dict(subprocess_env, JAXAOT_CACHE_DIR=str(tmp_path / "cache"))
    cold, warm = _run(script, env), _run(script, env)
    key, x = jax.random.key(3), jnp.zeros(4)
    want = x + jax.random.normal(key, x.shape)
    for run in (cold, warm):
        np.testing.assert_array_equal(run["a"], want)
        np.testing.assert_array_equal(run["b"], want)
        np.testing.assert_array_equal(run["k2"], jax.random.key_data(jax.random.split(key)[0]))
        assert run["key_dtype"] == str(key.dtype)
    assert cold["info"]["compiles"] >= 1
    assert warm["info"]["lowerings"] == 0 and warm["info"]["compiles"] == 0, warm


# -- low precision training ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_training_steps_match_plain(dtype: Any) -> None:
    tx = optax.sgd(0.1)
    params = {"w": jnp.full((4, 4), 0.3, dtype), "b": jnp.zeros(4, dtype)}
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4).astype(dtype)

    @jaxaot.component
    def layer(p: Any, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ p["w"] + p["b"])

    def make(f: Any) -> Any:
        def step(p: Any, s: Any) -> Any:
            g = jax.grad(lambda p: jnp.mean(f(p, f(p, x)).astype(jnp.float32) ** 2))(p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.jit(step)

    got = want = (params, tx.init(params))
    for _ in range(3):
        got = make(layer)(*got)
        want = make(lambda p, x: jnp.tanh(x @ p["w"] + p["b"]))(*want)
    assert not np.array_equal(np.asarray(got[0]["w"], np.float32), np.asarray(params["w"]))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2)


def test_per_example_gradients_match_plain() -> None:
    def loss(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    comp = jaxaot.component(loss)
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    xs = jnp.linspace(0.0, 1.0, 20).reshape(5, 4)
    got = jax.jit(jax.vmap(jax.grad(comp), in_axes=(None, 0)))(w, xs)
    want = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, xs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
