"""A component's work, and small components recomputing their forward pass
under differentiation instead of writing residuals (``_component._cost``)."""

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
from jaxaot._component import _cost
from jaxaot.cli import _model


def _forward_entries(comp: jaxaot.Component[..., Any]) -> list[Any]:
    """The component's forward entries of a linearization."""
    return [
        e
        for k, e in comp.store.entries.items()
        if k.parts["transform"] and k.parts["transform"][-1][0] == "linearize"
        if k.parts["transform"][-1][2] == "forward"
    ]


def _close(got: Any, want: Any, tol: float = 1e-5) -> None:
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
        )


def _work(fun: Any, *args: Any) -> float | None:
    return _cost.work(jax.make_jaxpr(fun)(*args))


# -- the estimate ---------------------------------------------------------------------


def test_work_counts_products_elements_and_loop_trips() -> None:
    x, w = jnp.ones((3, 4)), jnp.ones((4, 6))
    # 2 * 3 * 6 * 4 for the product, 18 elements for tanh.
    assert _work(lambda x, w: jnp.tanh(x @ w), x, w) == 2 * 3 * 6 * 4 + 18
    # A batched product: 2 * (5 * 3 * 6) * 4.
    xs, ws = jnp.ones((5, 3, 4)), jnp.ones((5, 4, 6))
    assert _work(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), xs, ws) == 2 * 5 * 3 * 6 * 4

    def scanned(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=7)[0]

    assert _work(scanned, jnp.ones((3, 4)), jnp.ones((4, 4))) == 7 * 2 * 3 * 4 * 4
    branches = (lambda x: x @ w, lambda x: jnp.zeros((3, 6)))
    branch = _work(lambda p, x: jax.lax.cond(p, *branches, x), True, x)
    assert branch is not None and 2 * 3 * 6 * 4 <= branch < 2 * (2 * 3 * 6 * 4)  # the costlier
    loop = jax.lax.while_loop
    assert _work(lambda x: loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1]), (0, x)), x) is None


def test_work_of_a_convolution() -> None:
    x = jnp.ones((2, 3, 16, 16))  # NCHW
    k = jnp.ones((8, 3, 3, 3))  # OIHW
    got = _work(lambda x, k: jax.lax.conv(x, k, (1, 1), "SAME"), x, k)
    assert got == 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)


def test_a_bad_threshold_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXAOT_RECOMPUTE_BELOW", "lots")
    with pytest.raises(ValueError, match="JAXAOT_RECOMPUTE_BELOW"):
        _cost.recompute_below()
    monkeypatch.setenv("JAXAOT_RECOMPUTE_BELOW", "1e3")
    assert _cost.recompute_below() == 1e3


# -- small components recompute; big ones, checkpoints and callbacks do not --------------


def _block_loss(comp: Any, blocks: list[Any], x: jax.Array) -> jax.Array:
    for p in blocks:
        x = comp(p, x)
    return jnp.mean(x.astype(jnp.float32) ** 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_small_block_recomputes_and_matches_jax_jit(dtype: Any) -> None:
    """A small transformer block under ``value_and_grad``: its forward entry returns
    its output alone (no residuals), the backward entry recomputes the rest; values,
    gradients and dtypes are those of ``jax.jit`` of the plain block."""
    blocks = _model.init_blocks(jax.random.key(0), 3, 16)
    blocks = jax.tree.map(lambda a: a.astype(dtype), blocks)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16)).astype(dtype)
    comp = jaxaot.component(_model.block)
    step = jax.value_and_grad(lambda b, x: _block_loss(comp, b, x), argnums=(0, 1))
    want = jax.jit(jax.value_and_grad(lambda b, x: _block_loss(_model.block, b, x), (0, 1)))
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    _close(step(blocks, x), want(blocks, x), tol)
    _close(jax.jit(step)(blocks, x), want(blocks, x), tol)
    (forward,) = _forward_entries(comp)
    assert forward.key.parts["transform"][-1][3:4] == ("recompute",)
    assert len(forward.out_avals) == 1  # the block's output: no residuals
    assert forward.key.parts["platforms"] == ("cpu",)


def test_a_block_above_the_threshold_writes_residuals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXAOT_RECOMPUTE_BELOW", "100")  # below this block's work
    blocks = _model.init_blocks(jax.random.key(0), 2, 16)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    comp = jaxaot.component(_model.block)
    got = jax.grad(lambda b, x: _block_loss(comp, b, x))(blocks, x)
    want = jax.jit(jax.grad(lambda b, x: _block_loss(_model.block, b, x)))(blocks, x)
    _close(got, want)
    (forward,) = _forward_entries(comp)
    assert "recompute" not in forward.key.parts["transform"][-1]
    assert len(forward.out_avals) > 1  # the output, then residuals


def test_a_program_that_may_run_as_one_program_keeps_residuals() -> None:
    """Under ``jaxaot.jit`` (whole-program form allowed) a small block keeps its
    residuals: in one program they cost no executable output, and recomputing
    would compile and run its forward pass twice. Values equal jax.jit's."""
    blocks = _model.init_blocks(jax.random.key(0), 3, 16)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    comp = jaxaot.component(_model.block)
    step = jax.value_and_grad(lambda b, x: _block_loss(comp, b, x))
    want = jax.jit(jax.value_and_grad(lambda b, x: _block_loss(_model.block, b, x)))(blocks, x)
    _close(jaxaot.jit(step)(blocks, x), want)
    (forward,) = _forward_entries(comp)
    assert "recompute" not in forward.key.parts["transform"][-1]
    assert len(forward.out_avals) > 1  # the output, then residuals


def test_recomputing_and_writing_residuals_give_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two forms are different entries (different keys), never mixed up: the
    same step with each gives the same values, and each form's entries exist."""
    blocks = _model.init_blocks(jax.random.key(0), 2, 16)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    comp = jaxaot.component(_model.block)
    step = jax.jit(jax.value_and_grad(lambda b, x: _block_loss(comp, b, x)))
    recomputed = step(blocks, x)
    monkeypatch.setenv("JAXAOT_RECOMPUTE_BELOW", "0")
    written = jax.jit(jax.value_and_grad(lambda b, x: _block_loss(comp, b, x)))(blocks, x)
    _close(recomputed, written)
    forms = {"recompute" in e.key.parts["transform"][-1] for e in _forward_entries(comp)}
    assert forms == {True, False}


def test_a_checkpoint_policy_inside_a_component_is_kept() -> None:
    """A component whose body is a ``jax.checkpoint`` region saves what its policy
    says (here the product), not what jaxaot would choose."""

    def body(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w) * 2

    comp = jaxaot.component(jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable))
    w, x = jnp.eye(8) * 0.3, jnp.ones((2, 8))
    got = jax.grad(lambda w: jnp.sum(comp(w, x)))(w)
    _close(got, jax.grad(lambda w: jnp.sum(body(w, x)))(w))
    (forward,) = _forward_entries(comp)
    assert "recompute" not in forward.key.parts["transform"][-1]
    assert len(forward.out_avals) == 2  # the output and the saved product


def test_a_component_with_a_callback_runs_it_as_often_as_jax_jit() -> None:
    """Recomputing a forward pass would run its callbacks again: a component that
    calls back is never recomputed."""
    seen: list[int] = []

    def body(w: jax.Array, x: jax.Array) -> jax.Array:
        jax.debug.callback(lambda: seen.append(1))
        return jnp.tanh(x @ w)

    w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))
    comp = jaxaot.component(body)
    jax.block_until_ready(jax.jit(jax.grad(lambda w: jnp.sum(comp(w, x))))(w))
    jax.effects_barrier()
    ours, seen[:] = len(seen), []
    jax.block_until_ready(jax.jit(jax.grad(lambda w: jnp.sum(body(w, x))))(w))
    jax.effects_barrier()
    assert ours == len(seen) == 1


def test_custom_vjp_integer_inputs_and_vmap_recompute_correctly() -> None:
    """What users put in small layers: a ``custom_vjp`` function, an integer input
    (a position, not differentiated), outputs of several dtypes; under ``vmap``."""

    @jax.custom_vjp
    def clip_grad(x: jax.Array) -> jax.Array:
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))

    def body(w: jax.Array, x: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = jnp.sin(clip_grad(x) @ w) * (step + 1).astype(x.dtype)
        return y, step + 1

    comp = jaxaot.component(body)
    w = jax.random.normal(jax.random.key(0), (4, 4))
    x = jax.random.normal(jax.random.key(1), (5, 3, 4))
    step = jnp.arange(5, dtype=jnp.int32)

    def loss(f: Any, w: jax.Array, x: jax.Array) -> jax.Array:
        y, s = jax.vmap(f, in_axes=(None, 0, 0))(w, x, step)
        return jnp.sum(y**2) + jnp.sum(s)

    got = jax.jit(jax.grad(lambda w, x: loss(comp, w, x), argnums=(0, 1)))(w, x)
    want = jax.jit(jax.grad(lambda w, x: loss(body, w, x), argnums=(0, 1)))(w, x)
    _close(got, want)
    assert any("recompute" in e.key.parts["transform"][-1] for e in _forward_entries(comp))


def test_jaxaot_jit_train_step_runs_one_output_forward_executables() -> None:
    """In ``jaxaot.jit``'s split program of a small model's train step, each layer's
    forward executable returns the layer's output alone; the step equals
    ``jax.jit``'s, and so does its whole-program form."""
    from jaxaot._regional import _plan

    blocks = _model.init_blocks(jax.random.key(0), 4, 16)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    comp = jaxaot.component(_model.block)
    step = jax.value_and_grad(lambda b, x: _block_loss(comp, b, x))
    want = jax.jit(jax.value_and_grad(lambda b, x: _block_loss(_model.block, b, x)))(blocks, x)
    regional = jaxaot.jit(step, whole_program=False)
    _close(regional(blocks, x), want)
    (plan,) = regional._plans.values()
    layer_steps = [s for s in plan.steps if s.kind == "component"]
    assert len(layer_steps) == 8  # 4 forward, 4 backward
    assert sorted(len(s.outs) for s in layer_steps)[:4] == [1, 1, 1, 1]
    assert plan.whole is None
    # The same program as one program (what its small layers decide by default).
    whole = jaxaot.jit(step)
    _close(whole(blocks, x), want)
    (plan,) = whole._plans.values()
    assert plan.mode == _plan.WHOLE


# -- a fresh process decides as the first did -----------------------------------------

_SCRIPT = textwrap.dedent(
    """
    import json, jax, jax.numpy as jnp, jaxaot
    from jaxaot.cli import _model

    comp = jaxaot.component(_model.block, key="cost-block")
    blocks = _model.init_blocks(jax.random.key(0), 2, 16)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))

    def loss(b, x):
        for p in b:
            x = comp(p, x)
        return jnp.mean(x ** 2)

    g = jax.grad(loss)(blocks, x)
    forms = sorted(
        "recompute" in k.parts["transform"][-1]
        for k in comp.store.entries
        if k.parts["transform"] and k.parts["transform"][-1][2:3] == ("forward",)
    )
    info = comp.cache_info()
    print(json.dumps({"forms": forms, "lowerings": info.lowerings, "traces": info.traces,
                      "g": float(jnp.sum(jnp.abs(g[0]["qkv"])))}))
    """
)


def test_a_warm_process_recomputes_too_and_makes_nothing(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The work estimate is kept with the entry: a process that loads the block
    from the cache picks the same form (the same keys) and traces and lowers
    nothing."""

    def run() -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT],
            capture_output=True,
            text=True,
            env=subprocess_env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    cold = run()
    assert cold["forms"] == [True] and cold["lowerings"] > 0
    warm = run()
    assert warm["forms"] == [True]
    assert warm["lowerings"] == 0 and warm["traces"] == 0
    assert warm["g"] == cold["g"]


def test_whether_an_entry_recomputes_does_not_depend_on_the_platform() -> None:
    """The choice is made from the entry's program alone: the same small entry
    recomputes for a GPU or a TPU as it does for the CPU."""
    from types import SimpleNamespace

    for platforms in (("cpu",), ("cuda",), ("tpu",)):
        small = SimpleNamespace(
            platforms=platforms, host_callbacks=False, effects=frozenset(), extra={"work": 1e3}
        )
        big = SimpleNamespace(
            platforms=platforms, host_callbacks=False, effects=frozenset(), extra={"work": 1e12}
        )
        assert _cost.recomputes(small) and not _cost.recomputes(big), platforms
