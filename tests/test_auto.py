"""Regional compilation of unmodified models: the blocks ``jaxaot.jit`` finds itself
(``jaxaot._regional._auto``, ``jaxaot._component._blocks``)."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot

WORKER = Path(__file__).with_name("_auto_worker.py")
#: The deeper program of each kind (its compile count must equal that of 2 layers'):
#: deep enough for every kind to repeat its blocks and glue (diffrax: compared at 3
#: and 4 solves, see ``first_steps``).
DEEP = 4
KINDS = [
    "jit",
    "checkpoint",
    "equinox",
    "flax_nnx",
    "flax_linen",
    "blocks",
    "equinox_loop",
    "nnx_loop",
    "jnp_var",
    "outer_jit",
    "linen_jit",
    "haiku_remat",
    "linen_loop",
    "linen_jit_loop",
    "haiku_loop",
    "diffrax_chain",
    "custom_vjp_layers",
]


def _run(layers: int, env: dict[str, str], *kinds: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(layers), *kinds],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parents[1]), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The first step of every kind of model at 2 and ``DEEP`` layers (fresh
    processes, one cache per depth), then at ``DEEP`` layers again in a warm
    process; the diffrax chain at 3 solves rather than 2 (its one field's gradient
    is summed between the backward solves from the third on: at 2 there is no
    such glue)."""
    tmp = tmp_path_factory.mktemp("auto")
    base = _worker_env()
    shallow = [f"{kind}:3" if kind == "diffrax_chain" else kind for kind in KINDS]
    # Values are compared with jax.jit's at DEEP layers; the others count compiles.
    runs = {
        "shallow": _run(2, dict(base, JAXAOT_CACHE_DIR=str(tmp / "two")), "--no-compare", *shallow)
    }
    env = dict(base, JAXAOT_CACHE_DIR=str(tmp / "deep"))
    runs["deep"] = _run(DEEP, env)
    runs["warm"] = _run(DEEP, env, "--no-compare")
    return runs


# The tests of ``first_steps`` run on one pytest-xdist worker: the fixture runs once.
@pytest.mark.xdist_group("auto_first_steps")
@pytest.mark.parametrize("kind", KINDS)
def test_unannotated_blocks_compile_once_whatever_the_depth(
    first_steps: dict[str, dict[str, Any]], kind: str
) -> None:
    """Values equal jax.jit's at ``DEEP`` layers (checked in the worker); the step is
    split; the XLA compilations of its first step are as many at ``DEEP`` layers as at
    2, and more than one (each block's forward and backward, and the glue, not one
    program)."""
    two = first_steps["shallow"][kind]
    eight = first_steps["deep"][kind]
    assert two["split"] and eight["split"], (two, eight)
    assert two["compiles"] == eight["compiles"] >= 2, (two, eight)
    assert "block " in eight["explain"], eight["explain"]
    assert f"{DEEP} forward" in eight["explain"] or f"forward: {DEEP} call" in eight["explain"], (
        eight["explain"]
    )
    # JAX's own helpers (jnp.var's inner jit) are never blocks, whatever their flag.
    assert "_var" not in eight["explain"], eight["explain"]
    # Blocks carry the user's names, and every call that is not a block says why.
    for says in SAYS.get(kind, ()):
        assert says in eight["explain"], (says, eight["explain"])


#: What ``explain`` says of each kind's blocks and non-blocks, in the user's names.
SAYS: dict[str, tuple[str, ...]] = {
    "flax_linen": ("block checkpoint(LLayer.__call__)",),
    "linen_jit": (
        "block checkpoint(LLayer.__call__)",
        "jit(LJitModel.__call__): looked through (it wraps repeated layers)",
    ),
    "linen_loop": ("block jit(LPlainBlock.__call__)",),
    "linen_jit_loop": (
        "block jit(LPlainBlock.__call__)",
        "jit(LPlainModel.__call__): looked through",
    ),
    "haiku_loop": (
        f"HBlock.__call__): {DEEP} forward",
        "in glue (called once): jit(Linear.__call__)",
    ),
    "equinox_loop": (
        "block jit(LoopLayer.__call__)",
        "in glue (called once): jit(Linear.__call__)",  # the head; the layers' own are parts
    ),
    "nnx_loop": ("block jit(NLoopLayer.__call__)",),
    "outer_jit": ("jit(loss): looked through",),
    # Calls holding custom_vjp rules (diffrax's adjoint, a user's own) are
    # differentiated whole under grad: a forward and a backward block each.
    "diffrax_chain": (
        f"block jit(diffeqsolve) forward: {DEEP} call",
        f"block jit(diffeqsolve) backward: {DEEP} call",
    ),
    "custom_vjp_layers": (
        f"block jit(layer) forward: {DEEP} call",
        f"block jit(layer) backward: {DEEP} call",
    ),
}


@pytest.mark.xdist_group("auto_first_steps")
@pytest.mark.parametrize("kind", KINDS)
def test_a_warm_process_compiles_no_block(
    first_steps: dict[str, dict[str, Any]], kind: str
) -> None:
    """Its result has the bits of the cold process's (whose values were jax.jit's)."""
    warm = first_steps["warm"][kind]
    assert warm["split"] and warm["compiles"] == 0, warm
    assert warm["digest"] == first_steps["deep"][kind]["digest"], kind


@pytest.mark.skipif(
    importlib.util.find_spec("gemma") is None,
    reason="gemma is an optional test dependency: .ci/run installs it on the Python 3.11 leg",
)
def test_gemma_transformer_splits_its_blocks_and_warm_starts(tmp_path: Path) -> None:
    """gemma's own Transformer (``nn.jit`` around a loop of ``gm.nn.Block``s), random
    init, unannotated: the outer jit is looked through, its 4 blocks are one block
    (forward and backward: the first step's compiles do not grow with depth, which
    ``first_steps`` checks on other kinds), values equal jax.jit's (in the worker),
    and a warm process compiles nothing and gives the same bits."""
    env = dict(_worker_env(), JAXAOT_CACHE_DIR=str(tmp_path / "four"))
    four = _run(4, env, "gemma")["gemma"]
    warm = _run(4, env, "--no-compare", "gemma")["gemma"]
    assert four["split"] and warm["split"], (four, warm)
    assert four["compiles"] >= 2, four
    assert "block jit(Block.__call__): 4 forward, 4 linear/transpose" in four["explain"]
    assert "jit(__call__): looked through (it wraps repeated layers)" in four["explain"]
    assert warm["compiles"] == 0 and warm["digest"] == four["digest"], (warm, four)


def _loss(ws: Any, x: jax.Array, block: Any, head: Any = None) -> jax.Array:
    for w in ws:
        x = block(w, x)
    if head is not None:
        x = head(x)
    return (x**2).mean()


def _close(got: Any, want: Any) -> None:
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        assert g.dtype == w.dtype


def test_blocks_called_once_stay_in_their_glue_and_the_switch_turns_it_off() -> None:
    layer = jax.jit(lambda w, x: jnp.tanh(x @ w) + x)
    head = jax.jit(lambda x: jnp.sin(x @ jnp.ones((8, 8))))  # one call: not a block
    ws = [jnp.eye(8) * 0.1 * (i + 1) for i in range(3)]
    x = jnp.ones((2, 8))
    step = jax.value_and_grad(lambda ws, x: _loss(ws, x, layer, head))
    regional = jaxaot.jit(step, whole_program=False)
    _close(regional(ws, x), jax.jit(step)(ws, x))
    explained = regional.explain(ws, x)
    assert "block jit(<lambda>): 3 forward" in explained, explained
    assert "in glue (called once)" in explained, explained
    off = jaxaot.jit(step, auto_regions=False)
    _close(off(ws, x), jax.jit(step)(ws, x))
    # Nothing annotated: one program, cached whole.
    assert [plan.served_whole for plan in off._plans.values()] == [
        "nothing to split: it calls no component (auto_regions=False, no blocks=)"
    ]
    assert "cached whole" in off.explain(ws, x)


def test_linen_layers_drawing_under_remat_are_one_block(compiles: list[str]) -> None:
    """A linen model of ``nn.remat`` layers with dropout: each layer's draws fold
    its place in the model into their keys, a number that differs per layer. The
    layers are still one block, drawing what they draw under ``jax.jit``: the
    losses and parameters of steps with fresh keys are ``jax.jit``'s, and a
    deeper model compiles no more than one block's programs."""
    import flax.linen as nn
    import optax

    opt = optax.adam(1e-2)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool) -> jax.Array:
            h = nn.gelu(nn.Dense(16)(nn.LayerNorm()(x)))
            h = nn.Dropout(0.3, deterministic=not train)(h)
            return x + nn.Dense(x.shape[-1])(h)

    class Model(nn.Module):
        layers: int

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(self.layers):
                x = nn.remat(Block, static_argnums=(2,))()(x, True)
            return nn.Dense(1)(x)

    from jaxaot._component import _blocks

    x = jax.random.normal(jax.random.key(1), (4, 8))
    counts = []
    for layers in (3, 5):
        _blocks.forget_blocks()  # each depth from nothing: its own compiles
        jaxaot.set_cache(jaxaot.MemoryCache())
        model = Model(layers)
        params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

        def step(params: Any, state: Any, key: jax.Array, model: Any = model) -> Any:
            def loss(p: Any) -> jax.Array:
                return jnp.mean(model.apply(p, x, rngs={"dropout": key}) ** 2)

            value, grads = jax.value_and_grad(loss)(params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        regional = jaxaot.jit(step, whole_program=False)
        explained = regional.explain(params, opt.init(params), jax.random.key(2))
        assert f"Block.__call__): {layers} forward" in explained, explained
        mine = theirs = (params, opt.init(params))
        keys = [jax.random.key(10), jax.random.key(11)]
        compiles.clear()
        for key in keys:
            *mine, got = regional(*mine, key)
            if key is keys[0]:
                counts.append(len(compiles))
            *theirs, want = jax.jit(step)(*theirs, key)
            np.testing.assert_allclose(got, want, rtol=1e-6)
        _close(mine, theirs)
    # At most a forward and a backward block and two glue programs, at either
    # depth (the deeper one may reuse this process's glue).
    assert counts[1] <= counts[0] <= 4, counts


def test_solves_traced_again_for_each_call_are_differentiated_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two diffrax solves whose vector field is made in each call (a new
    function, so JAX traces each solve again: a new body of the same program)
    under grad: the solve's forward and backward blocks are made once, by
    program, not once per call, and the gradient is ``jax.jit``'s."""
    import diffrax

    from jaxaot._component import _blocks

    def solve(w: jax.Array, y: jax.Array) -> jax.Array:
        term = diffrax.ODETerm(lambda t, y, a: jnp.tanh(a @ y))
        return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 0.5, 0.1, y, args=w).ys[-1]  # type: ignore[index]

    def loss(ws: Any, y: jax.Array) -> jax.Array:
        for w in ws:
            y = solve(w, y)
        return jnp.sum(y**2)

    made: list[str] = []
    vjp_blocks = _blocks._vjp_blocks
    monkeypatch.setattr(
        _blocks,
        "_vjp_blocks",
        lambda call, avals, name: made.append(name) or vjp_blocks(call, avals, name),
    )
    _blocks.forget_blocks()
    ws, y = [jnp.eye(4) * 0.2 * (i + 1) for i in range(2)], jnp.ones(4) / 4
    step = jax.value_and_grad(loss)
    regional = jaxaot.jit(step)
    _close(regional(ws, y), jax.jit(step)(ws, y))
    assert made == ["jit(diffeqsolve)"], made
    assert "block jit(diffeqsolve) forward: 2 call" in regional.explain(ws, y)


def test_a_solve_under_vmap_under_grad_is_traced_once() -> None:
    """diffrax's own example: a solve vmapped over the batch, under grad. Its
    rules (around a while loop) cannot be differentiated outside the program's
    trace once batched, so the solve stays in its glue, said once, and the
    program is traced once (trying to make it a block cost a trace of the whole
    program per solve function, in every process); values are ``jax.jit``'s."""
    import diffrax

    traces: list[int] = []

    def solve(w: jax.Array, y: jax.Array) -> jax.Array:
        ts = jnp.linspace(0.0, 0.5, 4)
        return diffrax.diffeqsolve(  # type: ignore[no-any-return]
            diffrax.ODETerm(lambda t, y, a: jnp.tanh(a @ y)),
            diffrax.Tsit5(),
            0.0,
            0.5,
            0.1,
            y,
            args=w,
            stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
            saveat=diffrax.SaveAt(ts=ts),
        ).ys

    def loss(w: jax.Array, ys: jax.Array) -> jax.Array:
        traces.append(1)
        return jnp.mean(jax.vmap(lambda y: solve(w, y))(ys) ** 2)

    w, ys = jnp.eye(4) * 0.3, jnp.ones((3, 4)) / 4
    step = jax.value_and_grad(loss)
    regional = jaxaot.jit(step)
    got = regional(w, ys)
    assert len(traces) == 1, len(traces)
    _close(got, jax.jit(step)(w, ys))
    assert "jit(diffeqsolve): a custom_vjp rule under vmap" in regional.explain(w, ys)


@pytest.mark.parametrize(
    ("policy", "saved"),
    [(None, 0), (jax.checkpoint_policies.dots_saveable, 1)],
)
def test_a_checkpoint_policy_decides_what_the_forward_entry_saves(policy: Any, saved: int) -> None:
    """The backward pass recomputes what the policy says: the forward entries save
    nothing but their inputs by default, and the product with ``dots_saveable``."""
    from jaxaot._component import _blocks

    def body(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w) + x

    layer = jax.checkpoint(body, policy=policy)
    _blocks.forget_blocks()  # only this test's entries
    ws = [jnp.eye(8) * 0.1 * (i + 1) for i in range(3)]
    x = jnp.ones((2, 8))
    step = jax.value_and_grad(lambda ws, x: _loss(ws, x, layer))
    regional = jaxaot.jit(step, whole_program=False)
    _close(regional(ws, x), jax.jit(step)(ws, x))
    (block,) = [b for name, b in _blocks._BLOCKS.items() if name == "checkpoint(body)"]
    forwards = [
        e
        for k, e in block.store.entries.items()
        if k.parts["transform"] and k.parts["transform"][-1][2:3] == ("forward",)
    ]
    assert forwards, list(block.store.entries)
    # The primal output, then the residuals it writes (its own inputs are forwarded).
    assert {len(e.out_avals) - 1 for e in forwards} == {saved}, [e.out_avals for e in forwards]


def test_a_changed_layer_is_a_new_block_never_a_stale_one() -> None:
    ws = [jnp.eye(8) * 0.1 * (i + 1) for i in range(3)]
    x = jnp.ones((2, 8))
    results = []
    for act in (jnp.tanh, jnp.sin):
        layer = jax.checkpoint(lambda w, x, act=act: act(x @ w) + x)
        step = jax.value_and_grad(lambda ws, x, layer=layer: _loss(ws, x, layer))
        got = jaxaot.jit(step, whole_program=False)(ws, x)
        _close(got, jax.jit(step)(ws, x))
        results.append(float(got[0]))
    assert results[0] != results[1]


def test_donation_and_the_whole_program_form_keep_jax_jit_results() -> None:
    from jaxaot._regional import _plan

    layer = jax.checkpoint(lambda w, x: jnp.tanh(x @ w) + x)

    def step(ws: Any, x: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(lambda ws: _loss(ws, x, layer))(ws)
        return [w - 0.1 * g for w, g in zip(ws, grads, strict=True)], loss

    def fresh() -> list[jax.Array]:
        return [jnp.eye(8) * 0.1 * (i + 1) for i in range(3)]

    x = jnp.ones((2, 8))
    want = jax.jit(step)(fresh(), x)
    mine = fresh()
    donated = jaxaot.jit(step, donate_argnums=0, whole_program=False)
    _close(donated(mine, x), want)
    assert all(w.is_deleted() for w in mine)
    regional = jaxaot.jit(step)
    _close(regional(fresh(), x), want)
    (plan,) = regional._plans.values()
    regional(fresh(), x)
    plan.whole.result()
    plan.mode = _plan.WHOLE
    _close(regional(fresh(), x), want)


def test_blocks_named_by_the_user_become_blocks_functions_and_modules() -> None:
    """Code without boundaries: functions, Flax NNX and linen modules named in
    ``blocks=`` are blocks (values as jax.jit gives them); the classes are left as
    they were."""
    import flax.linen as nn
    from flax import nnx

    ws = [jnp.eye(8) * 0.1 * (i + 1) for i in range(3)]
    x = jnp.ones((2, 8))

    def layer(w: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.tanh(v @ w) + v

    def floss(ws: Any, v: jax.Array) -> jax.Array:
        for w in ws:
            v = layer(w, v)
        return (v**2).mean()

    class NLayer(nnx.Module):
        def __init__(self, w: jax.Array) -> None:
            self.w = nnx.Param(w)

        def __call__(self, v: jax.Array) -> jax.Array:
            return layer(self.w[...], v)

    class NModel(nnx.Module):
        def __init__(self) -> None:
            self.layers = nnx.List([NLayer(w) for w in ws])

        def __call__(self, v: jax.Array) -> jax.Array:
            for each in self.layers:
                v = each(v)
            return v

    graphdef, state = nnx.split(NModel())

    def nloss(state: Any, v: jax.Array) -> jax.Array:
        return (nnx.merge(graphdef, state)(v) ** 2).mean()

    class LLayer(nn.Module):
        @nn.compact
        def __call__(self, v: jax.Array) -> jax.Array:
            return layer(self.param("w", lambda k, s: jnp.eye(8) * 0.1, (8, 8)), v)

    class LModel(nn.Module):
        @nn.compact
        def __call__(self, v: jax.Array) -> jax.Array:
            for i in range(3):
                v = LLayer(name=f"layer{i}")(v)
            return v

    lmodel = LModel()
    params = lmodel.init(jax.random.key(0), x)

    def lloss(p: Any, v: jax.Array) -> jax.Array:
        return (lmodel.apply(p, v) ** 2).mean()

    calls = {NLayer: NLayer.__call__, LLayer: LLayer.__call__}
    for loss, args, blocks in (
        (floss, (ws, x), (layer,)),
        (nloss, (state, x), (NLayer,)),
        (lloss, (params, x), (LLayer,)),
    ):
        step = jax.value_and_grad(loss)
        regional = jaxaot.jit(step, whole_program=False, blocks=blocks)
        _close(regional(*args), jax.jit(step)(*args))
        explained = regional.explain(*args)
        assert "3 forward" in explained, explained
    assert {cls: cls.__call__ for cls in calls} == calls  # patched for the trace only
    with pytest.raises(TypeError, match="blocks must be functions or module classes"):
        jaxaot.jit(floss, blocks=(3,))


def test_a_function_named_in_blocks_is_found_through_the_closures_that_reach_it() -> None:
    """A layer reached through closures (a step made from a loss, made from a model
    that closes over its layer), or through a partial, is the block ``blocks=``
    names; the closures hold their own function again afterwards."""
    ws = [jnp.eye(8) * 0.1 * (i + 1) for i in range(3)]
    x = jnp.ones((2, 8))

    def layer(w: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.tanh(v @ w) + v

    def make_model(layer: Any) -> Any:
        def model(ws: Any, v: jax.Array) -> jax.Array:
            for w in ws:
                v = layer(w, v)
            return v

        return model

    def make_step(loss: Any) -> Any:
        def step(ws: Any, v: jax.Array) -> Any:
            return jax.value_and_grad(loss)(ws, v)

        return step

    model = make_model(layer)

    def loss(ws: Any, v: jax.Array) -> jax.Array:
        return (model(ws, v) ** 2).mean()

    def partial_loss(model: Any, ws: Any, v: jax.Array) -> jax.Array:
        return (model(ws, v) ** 2).mean()

    for step in (make_step(loss), make_step(functools.partial(partial_loss, model))):
        regional = jaxaot.jit(step, whole_program=False, blocks=(layer,))
        _close(regional(ws, x), jax.jit(step)(ws, x))
        assert "3 forward" in regional.explain(ws, x), regional.explain(ws, x)
        cells = [c.cell_contents for c in model.__closure__ or ()]
        assert layer in cells  # (bound back after the trace)
    # A program that does not reach it says so, naming it.
    unreached = jaxaot.jit(lambda ws, v: jnp.tanh(v @ ws[0]), blocks=(layer,))
    said = unreached.explain(ws, x)
    assert f"blocks={layer.__qualname__} is called fewer than twice" in said, said


@pytest.mark.parametrize("deterministic", [True, False])
def test_nnx_layers_taking_python_flags_are_blocks_that_see_the_flags(
    deterministic: bool,
) -> None:
    """An NNX layer whose call takes a Python flag or number (``deterministic``, a
    scale), positionally or by name, and branches on it, is a block: the call
    fixes the flag, as the program around it sees it (traced, it could not be
    branched on, and the program ran as plain jax.jit)."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.lin = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x: jax.Array, deterministic: bool, *, scale: float = 1.0) -> Any:
            h = self.lin(x)
            return x + (h if deterministic else h * 0.5) * scale

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.blocks = nnx.List([Block(rngs) for _ in range(6)])

        def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
            for b in self.blocks:
                x = b(x, deterministic, scale=0.5)
            return x

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))

    def forward(state: Any, x: jax.Array, deterministic: bool) -> jax.Array:
        return nnx.merge(graphdef, state)(x, deterministic)

    x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)
    regional = jaxaot.jit(forward, static_argnames="deterministic")
    got = regional(state, x, deterministic=deterministic)
    assert "Block.__call__): 6 calls" in regional.explain(state, x, deterministic=deterministic)
    _close(got, jax.jit(forward, static_argnames="deterministic")(state, x, deterministic))


#: A module-level GraphDef, as a script's ``graphdef, state = nnx.split(model)``
#: leaves it (set by the test below).
GRAPHDEF: Any = None


def _merged_forward(params: Any, rest: Any, v: jax.Array) -> jax.Array:
    """A helper that merges the model from the global GraphDef (the step that
    calls it, through its loss, never names the GraphDef)."""
    from flax import nnx

    return nnx.merge(GRAPHDEF, params, rest)(v)


def test_nnx_layers_merged_inside_the_step_are_found_without_naming_them() -> None:
    """Flax NNX's functional form: the step merges the model from a GraphDef it
    closes over, receives, or reads as a global (itself, or in a helper its loss
    calls), and its state; no module instance reaches it. Its repeated layer class is a block all the same (the framework's
    own layers inside it are parts), with jax.jit's values and gradients."""
    from flax import nnx

    global GRAPHDEF

    class GLayer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.linear = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, v: jax.Array) -> jax.Array:
            return v + jnp.tanh(self.linear(self.norm(v)))

    class GModel(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([GLayer(rngs) for _ in range(4)])
            self.head = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, v: jax.Array) -> jax.Array:
            for layer in self.layers:
                v = layer(v)
            return self.head(v)

    graphdef, params, rest = nnx.split(GModel(nnx.Rngs(0)), nnx.Param, ...)
    GRAPHDEF = graphdef
    x = jnp.linspace(-1.0, 1.0, 24).reshape(3, 8)

    def closed(params: Any, v: jax.Array) -> jax.Array:
        return (nnx.merge(graphdef, params, rest)(v) ** 2).mean()

    def passed(graph: Any, params: Any, v: jax.Array) -> jax.Array:
        return (nnx.merge(graph, params, rest)(v) ** 2).mean()

    def global_(params: Any, v: jax.Array) -> jax.Array:
        def inner(p: Any) -> jax.Array:  # the global is read in a nested function
            return (nnx.merge(GRAPHDEF, p, rest)(v) ** 2).mean()

        return inner(params)

    def helper(params: Any, v: jax.Array) -> jax.Array:
        return (_merged_forward(params, rest, v) ** 2).mean()

    for loss, args, static in (
        (closed, (params, x), ()),
        (passed, (graphdef, params, x), (0,)),
        (global_, (params, x), ()),
        (helper, (params, x), ()),
    ):
        step = jax.value_and_grad(loss, argnums=len(static))
        # (Split: as one program, fewer than 5 small layers are compiled whole.)
        regional = jaxaot.jit(step, static_argnums=static, whole_program=False)
        _close(regional(*args), jax.jit(step, static_argnums=static)(*args))
        explained = regional.explain(*args)
        assert "GLayer.__call__): 4 forward, 4 linear/transpose" in explained, explained
        assert "LayerNorm" not in explained.split("in glue")[0], explained  # a part


def test_a_few_nnx_layers_merged_inside_the_step_are_compiled_whole_from_one_trace() -> None:
    """The functional form of three small NNX layers, each holding two
    ``nnx.Linear`` (six in all, counted in the GraphDef, which does not say that
    the layers hold them): as when the model is passed, the program is compiled
    whole from its first trace, making no block entries (it made four)."""
    from flax import nnx

    class Pair(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.a = nnx.Linear(8, 8, rngs=rngs)
            self.b = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, v: jax.Array) -> jax.Array:
            return v + self.b(jnp.tanh(self.a(v)))

    class PairModel(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([Pair(rngs) for _ in range(3)])

        def __call__(self, v: jax.Array) -> jax.Array:
            for layer in self.layers:
                v = layer(v)
            return v

    graphdef, state = nnx.split(PairModel(nnx.Rngs(0)))
    x = jnp.linspace(-1.0, 1.0, 24).reshape(3, 8)

    def loss(state: Any, v: jax.Array) -> jax.Array:
        return (nnx.merge(graphdef, state)(v) ** 2).mean()

    step = jax.value_and_grad(loss)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        before = jaxaot.stats()["lowerings"]
        regional = jaxaot.jit(step)
        _close(regional(state, x), jax.jit(step)(state, x))
        assert jaxaot.stats()["lowerings"] == before  # (no block entry made)
        explained = regional.explain(state, x)
    assert "one program, cached whole (a few small layers" in explained, explained
    assert "Pair x3" in explained, explained


def test_a_custom_vjp_block_that_cannot_be_differentiated_alone_stays_in_its_glue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where differentiating a block holding custom_vjp rules on its own fails,
    the call stays in its glue and ``explain`` says why: the step still runs,
    with jax.jit's values, never plain jax.jit for want of that block."""
    from jaxaot._regional import _auto

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no vjp today")

    monkeypatch.setattr(_auto, "vjp_call", broken)
    cleared: list[int] = []  # JAX's caches would be cleared: counted (for the tests after it)
    monkeypatch.setattr(_auto.jax, "clear_caches", lambda: cleared.append(1))

    @jax.custom_vjp
    def clip(x: jax.Array) -> jax.Array:
        return x

    clip.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))
    # Two layers, each traced again without its attempt (the plan is not given up).
    layer = jax.jit(lambda w, x: clip(jnp.tanh(x @ w)) + x)
    other = jax.jit(lambda w, x: clip(jnp.sin(x @ w)) + x)
    step = jax.value_and_grad(lambda ws, x: (_chain(other, ws, _chain(layer, ws, x)) ** 2).mean())
    ws = [jnp.eye(4) * 0.3 * (i + 1) for i in range(3)]
    x = jnp.ones((2, 4))
    regional = jaxaot.jit(step)
    _close(regional(ws, x), jax.jit(step)(ws, x))
    said = regional.explain(ws, x)
    assert "could not be differentiated alone" in said and "RuntimeError: no vjp today" in said
    assert "not split" not in said, said
    assert cleared, "JAX's caches were not cleared after a rule failed"


FAILING_RULES = """
import jax, jax.numpy as jnp, numpy as np, equinox as eqx, diffrax, jaxaot

class Field(eqx.Module):
    mlp: object

    def __call__(self, t, y, args):
        return self.mlp(y)

params, static = eqx.partition(Field(eqx.nn.MLP(2, 2, 4, 1, key=jax.random.PRNGKey(0))), eqx.is_array)

def loss(params, y0):
    term = diffrax.ODETerm(eqx.combine(params, static))
    saveat = diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 3))
    return diffrax.diffeqsolve(
        term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, saveat=saveat, max_steps=16
    ).ys.sum()

step, y0 = jax.value_and_grad(loss), jnp.ones(2)
regional = jaxaot.jit(step)
got = regional(params, y0)
want = jax.jit(lambda p, y: step(p, y))(params, y0)  # a jax.jit after it works too
for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
assert "could not be differentiated alone" in regional.explain(params, y0)

# Three solves: their forward passes are one block, their rule stays in its glue;
# explain says both, and that the note is of some of the block's calls.
def three(params, y0s):
    return jnp.stack([loss(params, y0s[i]) for i in range(3)]).sum()

said = jaxaot.jit(jax.value_and_grad(three)).explain(params, jnp.ones((3, 2)))
assert "block jit(diffeqsolve): 3 calls" in said, said
assert "jit(diffeqsolve) (some of its calls): a custom_vjp rule" in said, said
print("ok")
"""


def test_rules_that_fail_alone_leave_jax_jit_and_the_program_working(tmp_path: Path) -> None:
    """Differentiating diffrax's checkpointed loop (a solve saving at given times)
    alone fails, and the failed attempt left JAX's traces of its rules unusable:
    jaxaot.jit and every later ``jax.jit`` of the process raised ``Store empty``.
    The program is now traced afresh without the attempt, and runs with
    ``jax.jit``'s values; so does a ``jax.jit`` after it. (In a process of its own:
    the fix clears JAX's caches, which the other tests of this one would pay for.)"""
    pytest.importorskip("diffrax")
    env = dict(_worker_env(), JAXAOT_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_RULES], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def _chain(layer: Any, ws: Any, x: jax.Array) -> jax.Array:
    for w in ws:
        x = layer(w, x)
    return x


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable])
def test_checkpointed_layers_holding_a_custom_vjp_are_blocks_under_grad(policy: Any) -> None:
    """``jax.checkpoint`` around a layer with a custom-gradient activation (its body
    an open jaxpr): under grad, each call is a forward and a backward block, with
    jax.jit's values (it fell back to plain jax.jit)."""

    @jax.custom_vjp
    def act(x: jax.Array) -> jax.Array:
        return jnp.tanh(x)

    act.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))
    layer = jax.checkpoint(lambda w, x: x + act(x @ w) @ w, policy=policy)
    step = jax.value_and_grad(lambda ws, x: (_chain(layer, ws, x) ** 2).sum())
    ws = [jnp.eye(8) * 0.2 * (i + 1) for i in range(3)]
    x = jnp.ones((2, 8))
    regional = jaxaot.jit(step)
    _close(regional(ws, x), jax.jit(step)(ws, x))
    said = regional.explain(ws, x)
    assert "forward: 3 call" in said and "backward: 3 call" in said, said


def test_layers_holding_a_custom_vjp_name_their_program_once_whatever_the_depth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inner-jit layers with a custom VJP (a diffrax solve's adjoint), constants and
    an input they never read, under grad: their bodies, made lean once per body,
    are keyed once, not once per layer (naming a body of many rules cost more than the rest of a
    diffrax warm start, and grew with its depth)."""
    from jaxaot._component import _blocks

    named: list[str] = []
    program_parts = _blocks.program_parts

    def counted(closed: Any, name: str) -> Any:
        named.append(name)
        return program_parts(closed, name)

    monkeypatch.setattr(_blocks, "program_parts", counted)

    @jax.custom_vjp
    def act(x: jax.Array) -> jax.Array:
        return jnp.tanh(x)

    act.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))
    scale = jnp.linspace(0.5, 1.0, 8)  # (a constant of the layer's closed jaxpr)
    layer = jax.jit(lambda w, x, unused: x + act(x @ w) @ w * scale)
    counts = []
    for depth in (3, 6):
        ws = [jnp.eye(8) * 0.1 * (i + 1) for i in range(depth)]
        x = jnp.ones((2, 8))

        def loss(ws: Any, x: jax.Array) -> jax.Array:
            for w in ws:
                x = layer(w, x, jnp.zeros(3))
            return (x**2).sum()

        step = jax.value_and_grad(loss)
        regional = jaxaot.jit(step, whole_program=False)
        named.clear()
        with jaxaot.using_cache(jaxaot.MemoryCache()):
            _close(regional(ws, x), jax.jit(step)(ws, x))
        counts.append(len(named))
        _blocks.forget_blocks()
    assert counts[0] == counts[1] > 0, counts


def test_a_solve_holding_values_of_the_programs_trace_is_planned_and_cached(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An optimistix root find: its inner jit holds a value of the program's own
    trace (JAX 0.12 keeps it in a nested jaxpr's constants). That call is no
    block, and stays in its glue; the program is planned and cached (it ran under
    plain jax.jit, uncached, with a ClosureError)."""
    optx = pytest.importorskip("optimistix")

    def root(a: jax.Array) -> jax.Array:
        solver = optx.Newton(rtol=1e-5, atol=1e-6)
        fn = lambda y, a: y**3 + a * y - 2.0  # noqa: E731
        return optx.root_find(fn, solver, jnp.ones_like(a), args=a, max_steps=50).value

    a = jnp.array([0.5, 1.0, 2.0])
    regional = jaxaot.jit(root)
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        _close(regional(a), jax.jit(root)(a))
    assert not [r for r in caplog.records if "plain jax.jit" in r.getMessage()], caplog.text
    assert "not split" not in regional.explain(a), regional.explain(a)


def test_the_documented_equinox_recipe_finds_its_layers() -> None:
    """docs/regional.md's recipe for an Equinox model with functions in its fields:
    ``eqx.partition`` it, pass the static half as a static argument. Its layers
    are found as when the step closes over that half: the static half holds the
    same layers, not more of them (before, the model class counted two instances,
    its layers became its parts, and nothing was split)."""
    import equinox as eqx

    model = eqx.nn.MLP(16, 1, width_size=32, depth=4, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    x = jnp.ones((4, 16))

    def loss(m: Any, x: jax.Array) -> jax.Array:
        return (jax.vmap(m)(x) ** 2).mean()

    def as_static(params: Any, static: Any, x: jax.Array) -> Any:
        return jax.value_and_grad(lambda p: loss(eqx.combine(p, static), x))(params)

    def closing_over(params: Any, x: jax.Array) -> Any:
        return as_static(params, static, x)

    with jaxaot.using_cache(jaxaot.MemoryCache()):
        said = [
            jaxaot.jit(as_static, static_argnums=1).explain(params, static, x),
            jaxaot.jit(closing_over).explain(params, x),
        ]
    for text in said:
        assert "block jit(Linear.__call__): 3 vmap/forward" in text, said


def test_equinox_layers_of_one_configuration_are_traced_once() -> None:
    """Six layers of a class, of four configurations (an activation in a static
    field, a Python flag in the call): the trace runs each configuration's body
    once, as ``eqx.filter_jit`` would, and every layer computes with its own:
    values and gradients are ``jax.jit``'s."""
    import equinox as eqx

    runs: list[tuple[Any, bool]] = []

    class Layer(eqx.Module):
        linear: eqx.nn.Linear
        act: Any = eqx.field(static=True)

        def __call__(self, x: jax.Array, flip: bool) -> jax.Array:
            runs.append((self.act, flip))
            return x + self.act(self.linear(-x if flip else x))

    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    layers = [
        Layer(eqx.nn.Linear(8, 8, key=k), (jnp.tanh, jax.nn.relu)[i % 2])
        for i, k in enumerate(keys)
    ]
    x = jnp.linspace(-1.0, 1.0, 8)

    def loss(layers: list[Any], x: jax.Array) -> jax.Array:
        for i, layer in enumerate(layers):
            x = layer(x, i < 3)
        return (x**2).sum()

    step = jax.value_and_grad(loss)
    want = jax.jit(step)(layers, x)
    regional = jaxaot.jit(step)
    runs.clear()
    got = regional(layers, x)
    # (A counting trace before it runs all six layers inline.)
    assert len(runs) % 6 == 4 and set(runs[-4:]) == {
        (jnp.tanh, True),
        (jax.nn.relu, True),
        (jnp.tanh, False),
        (jax.nn.relu, False),
    }, runs
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert "Layer.__call__" in regional.explain(layers, x)


@pytest.mark.parametrize(
    "fields",
    [[1] * 3 + [1.0] * 3, [0.0] * 3 + [-0.0] * 3, [1] * 3 + [True] * 3],
    ids=["int_and_float", "zero_and_negative_zero", "int_and_bool"],
)
def test_equinox_layers_whose_static_fields_are_equal_but_differ_are_traced_apart(
    fields: list[Any],
) -> None:
    """Static fields compare equal as auxiliary data of the layers' structure
    (``1 == 1.0 == True``, ``0.0 == -0.0``) but compute apart: such layers are
    traced each on its own, and the values are ``jax.jit``'s."""
    import equinox as eqx

    class Layer(eqx.Module):
        linear: eqx.nn.Linear
        k: Any = eqx.field(static=True)

        def __call__(self, x: jax.Array) -> jax.Array:
            h = self.linear(x)
            if type(self.k) is int:
                return h + (jnp.arange(8) // 2) * self.k
            return jnp.copysign(h, jnp.float32(self.k) - 0.0 * h) * 0.5

    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    layers = [Layer(eqx.nn.Linear(8, 8, key=key), k) for key, k in zip(keys, fields, strict=True)]
    x = jnp.linspace(-1.0, 1.0, 8)

    def f(layers: list[Any], x: jax.Array) -> jax.Array:
        for layer in layers:
            x = layer(x)
        return x

    got, want = jaxaot.jit(f)(layers, x), jax.jit(f)(layers, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_equinox_layers_holding_members_of_two_enums_of_one_name_are_traced_apart() -> None:
    """Layers the step closes over, holding an enum member as a field (a Python
    value the trace fixes): members of two enums made by one factory have one
    name but other values, so the layers are traced apart, with jax.jit's values."""
    import enum

    import equinox as eqx

    def member(value: float) -> Any:
        class Mode(enum.Enum):
            A = value

        return Mode.A

    class Layer(eqx.Module):
        linear: eqx.nn.Linear
        mode: Any

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.linear(x) * self.mode.value

    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    modes = [member(2.0)] * 3 + [member(3.0)] * 3
    layers = [Layer(eqx.nn.Linear(4, 4, key=k), m) for k, m in zip(keys, modes, strict=True)]

    def f(x: jax.Array) -> jax.Array:
        for layer in layers:
            x = layer(x)
        return x

    x = jnp.linspace(-1.0, 1.0, 4)
    np.testing.assert_allclose(
        np.asarray(jaxaot.jit(f)(x)), np.asarray(jax.jit(f)(x)), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("filter_jit", [False, True])
def test_equinox_batch_norm_layers_passing_the_state_on_are_one_block(
    compiles: list[str], filter_jit: bool
) -> None:
    """Equinox layers with a ``BatchNorm`` (``eqx.nn.State``, a mean over the
    vmap axis): each layer takes the whole state and returns it, its own part
    changed, the others passed on. Each layer was then a program of its own
    (which parts it passes on), nothing was shared, and a deeper model made
    more. Parts passed on unchanged are now taken from the inputs: the layers
    are one block, a deeper model compiles no more, and values and the state
    are ``jax.jit``'s. Likewise where each layer's call is an ``eqx.filter_jit``."""
    import equinox as eqx

    class Layer(eqx.Module):
        lin: eqx.nn.Linear
        bn: eqx.nn.BatchNorm

        def __init__(self, key: jax.Array) -> None:
            self.lin = eqx.nn.Linear(8, 8, key=key)
            self.bn = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")

        def __call__(self, x: jax.Array, state: Any) -> Any:
            h, state = self.bn(self.lin(x), state)
            return x + jax.nn.relu(h), state

        if filter_jit:  # (its jit inside the block: the state passes through both)
            __call__ = eqx.filter_jit(__call__)

    class Net(eqx.Module):
        layers: list[Layer]

        def __init__(self, key: jax.Array, depth: int) -> None:
            self.layers = [Layer(k) for k in jax.random.split(key, depth)]

        def __call__(self, x: jax.Array, state: Any) -> Any:
            for layer in self.layers:
                x, state = layer(x, state)
            return x, state

    x = jax.random.normal(jax.random.key(1), (16, 8))
    counts = []
    for depth in (5, 8):  # (fewer small layers are kept in one program, unsplit)
        model, state = eqx.nn.make_with_state(Net)(jax.random.key(0), depth)
        params, static = eqx.partition(model, eqx.is_array)

        def loss(params: Any, state: Any, x: jax.Array, static: Any = static) -> Any:
            net = jax.vmap(
                eqx.combine(params, static),
                axis_name="batch",
                in_axes=(0, None),
                out_axes=(0, None),
            )
            y, state = net(x, state)
            return (y**2).mean(), state

        step = jax.value_and_grad(loss, has_aux=True)
        with jaxaot.using_cache(jaxaot.MemoryCache()):
            explained = jaxaot.jit(step).explain(params, state, x)
            assert f"Layer.__call__): {depth} vmap/forward" in explained, explained
            compiles.clear()
            got = jaxaot.jit(step)(params, state, x)
            counts.append(len(compiles))
        want = jax.jit(step)(params, state, x)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert counts[1] <= counts[0], counts


def test_values_a_layer_passes_on_unchanged_are_jax_values_as_under_jax_jit() -> None:
    """A layer that passes on, unchanged, a value that is not a JAX value (a NumPy
    float64 array, a Python int): JAX makes it a float32 or int32 value when the
    layer is called, and the code after the layer computes with that. Taken from
    the layer's inputs as it was, the code computed in float64 and with unbounded
    integers, and jaxaot.jit returned another value than jax.jit."""

    @jax.jit
    def layer(w: jax.Array, x: jax.Array, s: Any, t: Any) -> Any:
        return jnp.tanh(x @ w), s, t

    def model(ws: list[jax.Array], x: jax.Array) -> Any:
        s, t = np.ones(8, np.float64), 3
        for w in ws:
            x, s, t = layer(w, x, s, t)
        return x.sum(), (s + 1e-8) - s, (t * 2**30 * 2) // 2**30

    ws, x = [jnp.full((8, 8), 0.01 * (i + 1)) for i in range(6)], jnp.ones((4, 8))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        got = jaxaot.jit(model)(ws, x)
        assert "block jit(layer)" in jaxaot.jit(model).explain(ws, x)
    want = jax.jit(model)(ws, x)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_an_equinox_model_trained_with_adam_is_split_into_its_layers() -> None:
    """``optax.adam``'s state holds two copies of the model (its moments), so the
    model's class had three instances and was taken for the repeated layer: a
    ResNet-like model with batch norms was then served whole, nothing split (with
    ``optax.sgd`` its layers were found). A class with one instance per root that
    holds repeated layers is the model; its layers are the blocks."""
    import equinox as eqx
    import optax

    class Block(eqx.Module):
        lin: eqx.nn.Linear
        bn: eqx.nn.BatchNorm

        def __init__(self, key: jax.Array) -> None:
            self.lin = eqx.nn.Linear(16, 16, key=key)
            self.bn = eqx.nn.BatchNorm(16, "batch", mode="batch")

        def __call__(self, x: jax.Array, state: Any) -> Any:
            h, state = self.bn(self.lin(x), state)
            return x + jax.nn.relu(h), state

    class Net(eqx.Module):
        blocks: list[Block]

        def __init__(self, key: jax.Array) -> None:
            self.blocks = [Block(k) for k in jax.random.split(key, 6)]

        def __call__(self, x: jax.Array, state: Any) -> Any:
            for block in self.blocks:
                x, state = block(x, state)
            return x.sum(), state

    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    opt = optax.adam(1e-2)
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def step(params: Any, opt_state: Any, state: Any, x: jax.Array) -> Any:
        def loss(p: Any, s: Any) -> Any:
            net = jax.vmap(
                eqx.combine(p, static), axis_name="batch", in_axes=(0, None), out_axes=(0, None)
            )
            y, s = net(x, s)
            return y.mean(), s

        (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params, state)
        updates, opt_state = opt.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, state, value

    mine = theirs = (params, opt.init(params), state)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        explained = jaxaot.jit(step).explain(*mine, x)
        assert "Block.__call__): 6 vmap/forward" in explained, explained
        run = jaxaot.jit(step)
        for _ in range(2):
            *mine, got = run(*mine, x)
            *theirs, want = jax.jit(step)(*theirs, x)
            np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(mine, theirs)


def test_an_equinox_model_of_shape_dtype_structs_is_split_as_its_arrays_are() -> None:
    """A manifest gives ``jaxaot precompile`` the model as ``jax.eval_shape`` makes
    it (``jax.ShapeDtypeStruct`` leaves), as docs/precompile.md says. Its layers
    were not counted (no arrays), so precompile cached the program whole while
    the deployment, given arrays, split it and compiled its blocks. Both plan
    the same split now."""
    import equinox as eqx

    class Block(eqx.Module):
        lin: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            self.lin = eqx.nn.Linear(16, 16, key=key)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + jax.nn.gelu(self.lin(x))

    class Net(eqx.Module):
        blocks: list[Block]

        def __init__(self, key: jax.Array) -> None:
            self.blocks = [Block(k) for k in jax.random.split(key, 6)]

        def __call__(self, x: jax.Array) -> jax.Array:
            for block in self.blocks:
                x = block(x)
            return x

    def forward(model: Net, x: jax.Array) -> jax.Array:
        return jax.vmap(model)(x)

    model, x = Net(jax.random.key(0)), jnp.ones((4, 16))
    shapes = (jax.eval_shape(lambda: model), jax.ShapeDtypeStruct(x.shape, x.dtype))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        said = [jaxaot.jit(forward).explain(*args) for args in (shapes, (model, x))]
    assert "Block.__call__): 6" in said[1], said
    assert said[0] == said[1], said
