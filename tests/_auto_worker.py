"""Train steps of unmodified models (no jaxaot annotation) under ``jaxaot.jit``, for
``tests/test_auto.py``: run as ``python _auto_worker.py LAYERS`` in a fresh
interpreter. For each kind of block boundary (an inner ``jax.jit`` layer, a
``jax.checkpoint`` layer, Equinox ``filter_checkpoint``, Flax NNX ``nnx.remat``,
Flax linen ``nn.remat``), it runs the first step, counts the XLA compilations
JAX reports, compares values with ``jax.jit``'s (not with ``--no-compare``), and
prints one JSON line: per kind, its compile count, whether the step was split, the
explanation and a digest of the result's bits."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxaot
from jaxaot._component import _blocks
from jaxaot._regional import _programs

WIDTH = 16
COMPILES: list[str] = []
#: Eager operations diffrax runs on concrete values while it is traced (so under
#: any jit of it, jax.jit's too): programs of JAX's own, not of the step.
EAGER = frozenset(["jit(convert_element_type)", "jit(bitwise_or)"])
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: (
        COMPILES.append(event)
        if event == "/jax/core/compile/backend_compile_duration" and kw.get("fun_name") not in EAGER
        else None
    )
)


#: Each kind's layer has a scale of its own: each kind's programs differ, so JAX's
#: own in-process caches never serve one kind's compilations to another.
SCALE = {"jit": 1.0}


def _layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w) * SCALE["jit"] + x


def _weights(layers: int) -> list[jax.Array]:
    return [jnp.eye(WIDTH) * 0.1 * (i + 1) for i in range(layers)]


def _x() -> jax.Array:
    return jnp.arange(4 * WIDTH, dtype=jnp.float32).reshape(4, WIDTH) / 64


def functions(layers: int, wrap: Callable[[Any], Any]) -> tuple[Any, tuple[Any, ...]]:
    """A loop of layers, each wrapped in ``wrap`` (jax.jit, jax.checkpoint)."""
    block = wrap(_layer)

    def loss(ws: Any, x: jax.Array) -> jax.Array:
        for w in ws:
            x = block(w, x)
        return (x**2).mean()

    return jax.value_and_grad(loss), (_weights(layers), _x())


class ELayer(eqx.Module):
    w: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return _layer(self.w, x)


def equinox(layers: int) -> tuple[Any, tuple[Any, ...]]:
    def loss(model: Any, x: jax.Array) -> jax.Array:
        for layer in model:
            x = eqx.filter_checkpoint(lambda m, v: m(v))(layer, x)
        return (x**2).mean()

    return jax.value_and_grad(loss), ([ELayer(w) for w in _weights(layers)], _x())


class NLayer(nnx.Module):
    def __init__(self, w: jax.Array) -> None:
        self.w = nnx.Param(w)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _layer(self.w[...], x)


class NModel(nnx.Module):
    def __init__(self, layers: int) -> None:
        self.layers = nnx.List([NLayer(w) for w in _weights(layers)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = nnx.remat(lambda m, v: m(v))(layer, x)
        return x


def flax_nnx(layers: int) -> tuple[Any, tuple[Any, ...]]:
    graphdef, state = nnx.split(NModel(layers))

    def loss(state: Any, x: jax.Array) -> jax.Array:
        return (nnx.merge(graphdef, state)(x) ** 2).mean()

    return jax.value_and_grad(loss), (state, _x())


class LLayer(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("w", lambda key, shape: jnp.eye(WIDTH) * 0.1, (WIDTH, WIDTH))
        return _layer(w, x)


class LModel(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.layers):
            x = nn.remat(LLayer)(name=f"layer{i}")(x)
        return x


def flax_linen(layers: int) -> tuple[Any, tuple[Any, ...]]:
    model = LModel(layers)
    params = model.init(jax.random.key(0), _x())

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return (model.apply(params, x) ** 2).mean()

    return jax.value_and_grad(loss), (params, _x())


class PlainLayer(eqx.Module):
    """A layer with no boundary: a block only because ``blocks=`` names it."""

    w: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return _layer(self.w, x)


def named(layers: int) -> tuple[Any, tuple[Any, ...]]:
    def loss(model: Any, x: jax.Array) -> jax.Array:
        for layer in model:
            x = layer(x)
        return (x**2).mean()

    return jax.value_and_grad(loss), ([PlainLayer(w) for w in _weights(layers)], _x())


class LoopLayer(eqx.Module):
    """A layer with no boundary, in a plain loop: a block because its class has
    several instances in the step's arguments. The Equinox layers it holds (two
    alike) are its parts, not blocks of their own."""

    w: jax.Array
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.down)(jnp.tanh(jax.vmap(self.up)(x)))
        return _layer(self.w, x) + 0.1 * h


def _loop_layer(w: jax.Array, i: int) -> LoopLayer:
    up, down = (eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in jax.random.split(jax.random.key(i)))
    return LoopLayer(w, up, down)


def equinox_loop(layers: int) -> tuple[Any, tuple[Any, ...]]:
    def loss(model: Any, x: jax.Array) -> jax.Array:
        for layer in model["layers"]:
            x = layer(x)
        return (jax.vmap(model["head"])(x) ** 2).mean()

    model = {
        "layers": [_loop_layer(w, i) for i, w in enumerate(_weights(layers))],
        "head": eqx.nn.Linear(WIDTH, 2, key=jax.random.key(1)),
    }
    return jax.value_and_grad(loss), (model, _x())


class NLoopLayer(nnx.Module):
    """Its Flax layers (two alike) are its parts, not blocks of their own."""

    def __init__(self, w: jax.Array) -> None:
        self.w = nnx.Param(w)
        self.norm = nnx.LayerNorm(WIDTH, rngs=nnx.Rngs(0))
        self.up = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(1))
        self.down = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        return _layer(self.w[...], self.norm(x)) + 0.1 * self.down(jnp.tanh(self.up(x)))


class NLoopModel(nnx.Module):
    def __init__(self, layers: int) -> None:
        self.layers = nnx.List([NLoopLayer(w) for w in _weights(layers)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


def nnx_loop(layers: int) -> tuple[Any, tuple[Any, ...]]:
    def loss(model: Any, x: jax.Array) -> jax.Array:
        return (model(x) ** 2).mean()

    return jax.value_and_grad(loss), (NLoopModel(layers), _x())


def _norm(x: jax.Array) -> jax.Array:
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5)


def jnp_var(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """Checkpoint layers around a norm made of ``jnp.var`` (an inner jit of JAX's own)."""
    block = jax.checkpoint(lambda w, x: _layer(w, _norm(x)))

    def loss(ws: Any, x: jax.Array) -> jax.Array:
        for w in ws:
            x = block(w, _norm(x))
        return (_norm(x) ** 2).mean()

    return jax.value_and_grad(loss), (_weights(layers), _x())


def outer_jit(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """Checkpoint layers inside a ``jax.jit`` of the whole loss."""
    block = jax.checkpoint(lambda w, x: _layer(w, x) * 0.5 + x * 0.5)

    @jax.jit
    def loss(ws: Any, x: jax.Array) -> jax.Array:
        for w in ws:
            x = block(w, x)
        return (x**2).mean()

    return jax.value_and_grad(loss), (_weights(layers), _x())


class LJitModel(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.layers):
            x = nn.remat(LLayer)(name=f"layer{i}")(x) * 0.5
        return x


def linen_jit(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """linen ``nn.remat`` layers in a model wrapped in ``nn.jit`` (as gemma's)."""
    model = nn.jit(LJitModel)(layers)
    params = model.init(jax.random.key(0), _x())

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return (model.apply(params, x) ** 2).mean()

    return jax.value_and_grad(loss), (params, _x())


def haiku_remat(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """``hk.remat`` layers: each checkpoint receives the whole Haiku state."""
    import haiku as hk

    def net(x: jax.Array) -> jax.Array:
        for _ in range(layers):
            x = hk.remat(lambda v: v + jnp.tanh(hk.Linear(WIDTH)(v)) * 0.25)(x)
        return x

    model = hk.without_apply_rng(hk.transform(net))
    params = model.init(jax.random.key(0), _x())

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return (model.apply(params, x) ** 2).mean()

    return jax.value_and_grad(loss), (params, _x())


class LPlainBlock(nn.Module):
    """A linen layer with no boundary, in a plain loop: a block because its class
    is called several times with the same types (a static flag included)."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        h = _layer(self.param("w", lambda k: jnp.eye(WIDTH) * 0.1), nn.LayerNorm()(x))
        return h * 0.5 if train else h


class LPlainModel(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.layers):
            x = LPlainBlock()(x, True)
        return nn.Dense(2)(x)


def linen_loop(layers: int) -> tuple[Any, tuple[Any, ...]]:
    model = LPlainModel(layers)
    params = model.init(jax.random.key(0), _x())

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return (model.apply(params, x) ** 2).mean()

    return jax.value_and_grad(loss), (params, _x())


def linen_jit_loop(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """A plain loop of linen layers in a model wrapped in ``nn.jit`` (gemma's form)."""
    model = nn.jit(LPlainModel)(layers)
    params = model.init(jax.random.key(0), _x())

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return (model.apply(params, x) ** 2).mean()

    return jax.value_and_grad(loss), (params, _x())


def haiku_loop(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """A plain loop of Haiku modules (a transformer-like block: norm, two linears)."""
    import haiku as hk

    class HBlock(hk.Module):
        def __call__(self, x: jax.Array) -> jax.Array:
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
            h = jax.nn.gelu(hk.Linear(2 * WIDTH)(h))
            return x + hk.Linear(WIDTH)(h) * 0.5

    def net(x: jax.Array) -> jax.Array:
        for _ in range(layers):
            x = HBlock()(x)
        return hk.Linear(2)(x)

    model = hk.without_apply_rng(hk.transform(net))
    params = model.init(jax.random.key(0), _x())

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return (model.apply(params, x) ** 2).mean()

    return jax.value_and_grad(loss), (params, _x())


@jax.custom_vjp
def _clipped(x: jax.Array) -> jax.Array:
    """The identity, with its cotangent clipped (a user's own custom_vjp)."""
    return x


_clipped.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))


def custom_vjp_layers(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """Inner jit layers holding a user's custom_vjp, with an integer input and
    output (a step counter) beside the arrays they differentiate."""

    @jax.jit
    def layer(w: jax.Array, x: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _clipped(jnp.tanh(x @ w)) * (1.0 + 0.01 * i) + x, i + 1

    def loss(ws: Any, x: jax.Array) -> jax.Array:
        i = jnp.zeros((), jnp.int32)
        for w in ws:
            x, i = layer(w, x, i)
        return (x**2).mean() + i

    return jax.value_and_grad(loss), (_weights(layers), _x())


class Field(eqx.Module):
    w: jax.Array

    def __call__(self, t: Any, y: jax.Array, args: Any) -> jax.Array:
        return jnp.tanh(self.w @ y)


def diffrax_chain(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """A chain of diffrax solves (Tsit5, a PID controller, an Equinox field, its
    default error checks) under ``value_and_grad``."""
    import diffrax

    def solve(field: Any, y: jax.Array) -> jax.Array:
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field),
            diffrax.Tsit5(),
            0.0,
            0.5,
            0.1,
            y,
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-6),
        )
        return sol.ys[-1]  # type: ignore[no-any-return,index]

    def loss(field: Any, y: jax.Array) -> jax.Array:
        for _ in range(layers):
            y = solve(field, y)
        return (y**2).sum()

    return jax.value_and_grad(loss), (Field(jnp.eye(WIDTH) * 0.5), jnp.ones(WIDTH) / 4)


def gemma_config(layers: int) -> Any:
    """A tiny Gemma-3-like configuration (local sliding-window attention layers)."""
    from gemma import gm
    from gemma.gm.nn import _config, _modules

    return _config.TransformerConfig(
        num_embed=128,
        embed_dim=32,
        hidden_dim=64,
        num_heads=2,
        head_dim=16,
        num_kv_heads=1,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        attention_types=(_modules.AttentionType.LOCAL_SLIDING,) * layers,
        query_pre_attn_norm=_config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
        attn_logits_soft_cap=None,
        sliding_window_size=8,
        transpose_gating_einsum=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
        vision_encoder=None,
    ), gm


def gemma(layers: int) -> tuple[Any, tuple[Any, ...]]:
    """gemma's own ``gm.nn.Transformer`` (its ``__call__`` wrapped in ``nn.jit``),
    random init, under ``value_and_grad`` of a cross-entropy."""
    config, gm = gemma_config(layers)
    model = gm.nn.Transformer(config=config, dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 1, 128)
    params = jax.jit(model.init)(jax.random.PRNGKey(1), tokens)

    def loss(params: Any, tokens: Any) -> jax.Array:
        logits = model.apply(params, tokens).logits
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))

    return jax.value_and_grad(loss), (params, tokens)


KINDS: dict[str, Callable[[int], tuple[Any, tuple[Any, ...]]]] = {
    "jit": lambda n: functions(n, jax.jit),
    "checkpoint": lambda n: functions(n, jax.checkpoint),
    "equinox": equinox,
    "flax_nnx": flax_nnx,
    "flax_linen": flax_linen,
    "blocks": named,
    "equinox_loop": equinox_loop,
    "nnx_loop": nnx_loop,
    "jnp_var": jnp_var,
    "outer_jit": outer_jit,
    "linen_jit": linen_jit,
    "haiku_remat": haiku_remat,
    "linen_loop": linen_loop,
    "linen_jit_loop": linen_jit_loop,
    "haiku_loop": haiku_loop,
    "diffrax_chain": diffrax_chain,
    "custom_vjp_layers": custom_vjp_layers,
    "gemma": gemma,
}
#: Blocks named by the user, per kind (``jaxaot.jit(..., blocks=...)``).
BLOCKS: dict[str, tuple[Any, ...]] = {"blocks": (PlainLayer,)}


def digest(tree: Any) -> str:
    """The exact bits of a result: its leaves' dtypes, shapes and bytes."""
    sha = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        array = np.asarray(leaf)
        sha.update(f"{array.dtype}{array.shape}".encode())
        sha.update(array.tobytes())
    return sha.hexdigest()


def run(kind: str, layers: int, compare: bool = True) -> dict[str, Any]:
    """``compare``: check the values against jax.jit's (at one depth, in the cold
    process, is enough: a warm process's digest is checked against it)."""
    SCALE["jit"] = 1.0 + 0.1 * list(KINDS).index(kind)
    step, args = KINDS[kind](layers)
    _blocks.forget_blocks()  # this kind's first step, as in a fresh process
    _programs.GLUE._exes.clear()
    _programs.WHOLE._exes.clear()
    # A cache of its own per kind: two kinds whose glue programs are alike (a
    # plain loop of linen layers, with and without nn.jit) never count each
    # other's entries, however their writes and the next kind's reads interleave.
    folder = os.environ.get("JAXAOT_CACHE_DIR")
    cache = jaxaot.DirectoryCache(os.path.join(folder, kind)) if folder else None
    with jaxaot.using_cache(cache) if cache is not None else contextlib.nullcontext():
        return _first_step(kind, step, args, compare)


def _first_step(kind: str, step: Any, args: Any, compare: bool) -> dict[str, Any]:
    regional = jaxaot.jit(step, whole_program=False, blocks=BLOCKS.get(kind, ()))
    before = len(COMPILES)
    got = jax.block_until_ready(regional(*args))
    compiles = len(COMPILES) - before
    if compare:
        want = jax.jit(step)(*args)
        leaves = jax.tree_util.tree_leaves(want)
        for g, w in zip(jax.tree_util.tree_leaves(got), leaves, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
            assert g.dtype == w.dtype
    # The cache writes the first step started are done before the next kind or
    # process.
    jaxaot.wait_for_writes()
    split = all(plan is not None for plan in regional._plans.values())
    explain = regional.explain(*args)
    return {"compiles": compiles, "split": split, "explain": explain, "digest": digest(got)}


if __name__ == "__main__":
    depth = int(sys.argv[1])
    compare = "--no-compare" not in sys.argv[2:]
    # A kind may name its own depth: ``diffrax_chain:3``.
    named = [k for k in sys.argv[2:] if k != "--no-compare"] or [k for k in KINDS if k != "gemma"]
    runs = {}
    for token in named:
        kind, _, layers = token.partition(":")
        runs[kind] = run(kind, int(layers or depth), compare)
    print(json.dumps(runs))
