"""The plan of a ``jaxaot.jit`` program (``jaxaot._regional._plan``): split, or
one program, as its program decides when the plan is made (``_whole.form``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from _steps import block, close, loss, setup, train_step_factory

import jaxaot
from jaxaot._regional import _plan, _programs, _whole
from jaxaot.cli import _model


def _plan_of(fn: Any) -> _plan.Plan:
    (plan,) = fn._plans.values()
    assert plan is not None
    return plan  # type: ignore[no-any-return]


def test_small_components_run_as_one_program_from_the_first_call() -> None:
    """Layers of little work: the plan is one program (its layers as loops) from
    its first call, never timed against a split form; a train step's values,
    gradients and optimizer state equal jax.jit's, steps in a row too."""
    plain, optimizer = train_step_factory(_model.block)
    step, _ = train_step_factory(block)
    blocks, x = setup(_whole.MIN_LOOP)
    state = optimizer.init(blocks)
    regional = jaxaot.jit(step)
    a, b = regional(blocks, state, x), jax.jit(plain)(blocks, state, x)
    plan = _plan_of(regional)
    assert plan.mode == _plan.WHOLE and plan.steps == [] and plan.served_whole is None
    close(a, b)
    for _ in range(3):
        a, b = regional(a[0], a[1], x), jax.jit(plain)(b[0], b[1], x)
    close(a, b, tol=1e-4)
    assert jax.tree.map(lambda u: u.dtype, a) == jax.tree.map(lambda u: u.dtype, b)
    said = regional.explain(blocks, state, x)
    assert "runs as one program, its repeated layers as loops (component calls of work" in said


def test_big_components_run_split_from_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of work at the threshold or above (the threshold lowered here, so
    that the test's small layers count as big): split, each component compiled
    once, and ``explain`` says why, before and after the first call."""
    monkeypatch.setattr(_whole, "WHOLE_BELOW", 1.0)
    blocks, x = setup(3)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    said = grad.explain(blocks, x)
    assert "runs split, each component compiled once (component calls of work up to" in said
    close(grad(blocks, x), jax.jit(jax.grad(lambda bs, x: loss(bs, x, _model.block)))(blocks, x))
    plan = _plan_of(grad)
    assert plan.mode == _plan.SPLIT and len(plan.steps) > 3 and plan.whole is None
    assert grad.explain(blocks, x) == said


def test_components_of_unknown_work_run_split() -> None:
    """A component whose work cannot be known from its program (a while loop of
    data-dependent length) keeps the program split."""

    @jaxaot.component
    def iterate(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.lax.while_loop(
            lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0)
        )[0]

    w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))
    fn = jaxaot.jit(lambda w, x: iterate(w, iterate(w, x)).sum())
    assert "runs split" in fn.explain(w, x) and "unknown" in fn.explain(w, x)
    close(
        fn(w, x),
        jax.jit(lambda w, x: iterate.__wrapped__(w, iterate.__wrapped__(w, x)).sum())(w, x),
    )
    assert _plan_of(fn).mode == _plan.SPLIT


def test_a_failed_whole_program_gives_jax_jit_results(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("no whole program today")

    monkeypatch.setattr(_programs.WHOLE, "program", broken)
    blocks, x = setup(2)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    want = jax.jit(jax.grad(lambda bs, x: loss(bs, x, _model.block)))(blocks, x)
    for _ in range(2):
        close(grad(blocks, x), want)
    assert list(grad._plans.values()) == [None]  # given up for jax.jit, once


def test_whole_program_donates_like_jax_jit() -> None:
    step, optimizer = train_step_factory(block)
    blocks, x = setup(3)
    state = optimizer.init(blocks)
    expected = jax.jit(step)(blocks, state, x)
    regional = jaxaot.jit(step, donate_argnums=(0, 1))
    b, s = jax.tree_util.tree_map(jnp.copy, (blocks, state))
    got = regional(b, s, x)
    assert _plan_of(regional).mode == _plan.WHOLE
    close(got, expected)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves((b, s)))
    assert not x.is_deleted()


def test_whole_program_off_on_request() -> None:
    blocks, x = setup(2)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)), whole_program=False)
    for _ in range(2):
        grad(blocks, x)
    plan = _plan_of(grad)
    assert plan.whole is None and plan.mode == _plan.SPLIT
    assert "runs" not in grad.explain(blocks, x)


def test_a_split_program_drops_each_intermediate_after_its_last_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import weakref

    produced: list[weakref.ref[Any]] = []
    most_alive: list[int] = []
    executable = _plan.Step.executable

    def watched(self: _plan.Step) -> Any:
        exe = executable(self)

        def run(*args: Any) -> Any:
            most_alive.append(sum(r() is not None for r in produced))
            out = exe(*args)
            produced.extend(weakref.ref(o) for o in out)
            return out

        return run

    monkeypatch.setattr(_plan.Step, "executable", watched)
    layers = 8
    blocks, x = setup(layers)
    forward = jaxaot.jit(lambda bs, x: loss(bs, x, block), whole_program=False)
    want = jax.jit(lambda bs, x: loss(bs, x, _model.block))(blocks, x)
    for call in range(2):  # the first call (executables still coming) and the fast loop
        produced.clear()
        most_alive.clear()
        got = forward(blocks, x)
        close(got, want)
        assert got.dtype == want.dtype
        (plan,) = forward._plans.values()
        assert plan.ready and len(plan.steps) > layers
        # Layer k's activations are dropped once layer k + 1 has read them: at most
        # the last step's outputs are held, not one per layer.
        assert len(most_alive) == len(plan.steps)
        assert max(most_alive) <= 1, (call, most_alive)


@pytest.mark.parametrize("whole_program", [False, True])
def test_outputs_no_step_writes_are_arrays_as_under_jax_jit(whole_program: bool) -> None:
    """Outputs that no executable computes (an argument returned as it came, a
    static argument, a default, a NumPy or jnp constant) come back as jax.jit
    returns them: arrays of the same dtype and weak type, from the first call
    (executables still coming) and from the fast loop, in the split form as in
    the one-program form."""
    import numpy as np

    @jax.checkpoint
    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(x @ w)

    table = np.arange(2, dtype=np.float32)
    shift = jnp.float32(2.0)

    def step(ws: Any, x: Any, lr: Any, host: Any, scale: float = 1.0, *, n: int) -> Any:
        for w in ws:
            x = layer(w, x)
        aux = {"lr": lr, "host": host, "scale": scale, "n": n, "table": table, "shift": shift}
        return x.sum() * lr, aux

    ws, x = [jnp.eye(8) * 0.1] * 6, jnp.ones((4, 8))
    host = np.ones(3)  # float64 on the host: jax.jit gives float32 without x64
    want = jax.jit(step, static_argnames="n")(ws, x, 0.1, host, n=3)
    run = jaxaot.jit(step, static_argnames="n", whole_program=whole_program)
    for _ in range(2):
        got = run(ws, x, 0.1, host, n=3)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert isinstance(g, jax.Array), type(g)
            assert (g.dtype, g.weak_type, g.shape) == (w.dtype, w.weak_type, w.shape)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
            g.block_until_ready()
    if not whole_program:
        assert _plan_of(run).mode == _plan.SPLIT


_ON_A_MESH = """
import json
import jax, jax.numpy as jnp, jaxaot
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

@jax.checkpoint
def layer(w, x):
    return x + jnp.tanh(x @ w)

def step(ws, x, lr, frozen, *, n):
    for w in ws:
        x = layer(w, x)
    return x.sum() * lr, {"lr": lr, "n": n, "x": x, "frozen": frozen}

same = []
frozen = jnp.zeros(3)  # uncommitted: jax.jit moves it to the call's devices

def compare(ws, x):
    want = jax.jit(step, static_argnames="n")(ws, x, 0.1, frozen, n=3)
    for whole in (False, True):
        fun = jaxaot.jit(step, static_argnames="n", whole_program=whole)
        for _ in range(3):  # the first call, then the fast paths
            got = fun(ws, x, 0.1, frozen, n=3)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                same.append([str(g.sharding), str(w.sharding), g.dtype == w.dtype])

for types in ((AxisType.Explicit,), (AxisType.Auto,)):
    mesh = jax.make_mesh((8,), ("d",), axis_types=types)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("d")))
        ws = [jax.device_put(jnp.eye(8) * 0.1, NamedSharding(mesh, P()))] * 6
        compare(ws, x)
one = jax.devices()[1]  # committed to one device that is not the default
compare([jax.device_put(jnp.eye(8) * 0.1, one)] * 6, jax.device_put(jnp.ones((16, 8)), one))
print(json.dumps(same))
"""


def test_outputs_no_step_writes_are_placed_on_the_calls_mesh(
    subprocess_env: dict[str, str],
) -> None:
    """On a mesh (explicit and auto axes, 8 simulated devices), an output no
    executable computes is replicated over the call's mesh, as jax.jit places it
    (not on one device); an uncommitted input returned as it came is on the
    call's mesh, or its one committed device, as under jax.jit: in both forms, on
    the first call and the fast paths."""
    import json
    import subprocess
    import sys

    flags = f"{subprocess_env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = {**subprocess_env, "XLA_FLAGS": flags}
    proc = subprocess.run(
        [sys.executable, "-c", _ON_A_MESH], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(pairs) == 3 * 2 * 3 * 5  # (meshes, forms, calls, outputs)
    for got, want, dtype in pairs:
        assert got == want and dtype, (got, want)
