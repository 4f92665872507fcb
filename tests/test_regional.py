"""jaxaot.jit: regional compilation of programs made of components."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import cold_and_warm
from _steps import BATCH, WIDTH, block, close, loss, setup, train_step_factory
from jax import lax

import jaxaot
from jaxaot._regional import _plan, _planner, _programs
from jaxaot.cli import _model


def test_train_step_matches_jax_jit() -> None:
    step, optimizer = train_step_factory(block)
    plain, _ = train_step_factory(_model.block)
    blocks, x = setup(3)
    state = optimizer.init(blocks)
    regional = jaxaot.jit(step)
    want = jax.jit(plain)(blocks, state, x)
    got = regional(blocks, state, x)
    close(got, want)
    # A few steps in a row stay in agreement.
    a, b = got, want
    for _ in range(2):
        a = regional(a[0], a[1], x)
        b = jax.jit(plain)(b[0], b[1], x)
    close(a, b, tol=1e-4)


def test_gradients_match() -> None:
    blocks, x = setup(2)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block), argnums=(0, 1)))
    want = jax.jit(jax.grad(lambda bs, x: loss(bs, x, _model.block), argnums=(0, 1)))(blocks, x)
    close(grad(blocks, x), want)


def _compiles_for(layers: int, compiles: list[str], whole: bool) -> int:
    step, optimizer = train_step_factory(block)
    blocks, x = setup(layers)
    state = optimizer.init(blocks)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        block.clear_cache()
        _programs.GLUE._exes.clear()
        _programs.WHOLE._exes.clear()  # (another test may have made this very program)
        before = len(compiles)
        jax.block_until_ready(jaxaot.jit(step, whole_program=whole)(blocks, state, x))
        return len(compiles) - before


@pytest.mark.parametrize("whole", [True, False], ids=["one-program", "split"])
def test_compile_count_does_not_grow_with_depth(whole: bool, compiles: list[str]) -> None:
    """Split, each component compiles once (its forward and backward entries) and
    the glue; as one program, its layers are loops: one compile."""
    counts = {layers: _compiles_for(layers, compiles, whole) for layers in (4, 12, 24)}
    assert counts[4] == counts[12] == counts[24], counts
    assert counts[4] == 1 if whole else counts[4] > 2, counts


def test_plain_jit_compiles_more_as_depth_grows(compiles: list[str]) -> None:
    """The same step under plain jax.jit: one whole-program compile each time, for
    contrast (the count is 1, but its size grows); jaxaot.jit's compiles are
    per block kind, checked above."""
    step, optimizer = train_step_factory(block)
    blocks, x = setup(2)
    state = jax.block_until_ready(optimizer.init(blocks))  # its own small compiles
    before = len(compiles)
    jax.jit(step)(blocks, state, x)
    assert len(compiles) - before == 1


def _hetero_block_a(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ p["w"])


def _hetero_block_b(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(x @ p["u"] @ p["v"])


def _hetero(repeats: int) -> tuple[Any, Any, list[str]]:
    k = jax.random.split(jax.random.key(0), 2 * repeats)
    layers = []
    for i in range(repeats):  # a, b, a, b, ...: two block kinds with different parameter shapes
        layers.append(("a", {"w": jax.random.normal(k[2 * i], (WIDTH, WIDTH)) * 0.1}))
        layers.append(
            (
                "b",
                {
                    "u": jax.random.normal(k[2 * i + 1], (WIDTH, 3)) * 0.1,
                    "v": jnp.ones((3, WIDTH)) * 0.1,
                },
            )
        )
    return [p for _, p in layers], jnp.ones((BATCH, WIDTH)), [kind for kind, _ in layers]


def _hetero_loss(params: Any, x: jax.Array, kinds: list[str], fa: Any, fb: Any) -> jax.Array:
    for kind, p in zip(kinds, params, strict=True):
        x = fa(p, x) if kind == "a" else fb(p, x)
    return jnp.sum(x**2)


@pytest.mark.parametrize("repeats", [2, 6])
def test_heterogeneous_model_compiles_each_kind_once(repeats: int, compiles: list[str]) -> None:
    comp_a = jaxaot.component(_hetero_block_a)
    comp_b = jaxaot.component(_hetero_block_b)
    params, x, kinds = _hetero(repeats)
    regional = jaxaot.jit(
        jax.value_and_grad(lambda p, x: _hetero_loss(p, x, kinds, comp_a, comp_b)),
        whole_program=False,
    )
    want = jax.jit(
        jax.value_and_grad(lambda p, x: _hetero_loss(p, x, kinds, _hetero_block_a, _hetero_block_b))
    )(params, x)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        _programs.GLUE._exes.clear()
        before = len(compiles)
        got = regional(params, x)
        total = len(compiles) - before
    close(got, want, tol=1e-4)
    # Each kind: one forward entry (outputs and residuals) and the transpose of its
    # linear entry, shared by every layer of the kind (the first layer, whose
    # input is not differentiated, included).
    assert comp_a.cache_info().compiles == 2, comp_a.cache_info()
    assert comp_b.cache_info().compiles == 2, comp_b.cache_info()
    assert comp_a.cache_info().traces == 1 and comp_b.cache_info().traces == 1
    glue = total - 4
    assert 0 < glue <= 4, total  # a few glue programs, the same whatever the depth


def test_donation() -> None:
    step, optimizer = train_step_factory(block)
    blocks, x = setup(2)
    state = optimizer.init(blocks)
    expected = jax.jit(step)(blocks, state, x)
    regional = jaxaot.jit(step, donate_argnums=(0, 1))
    got = regional(blocks, state, x)
    close(got, expected)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(blocks))
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(state))
    assert not x.is_deleted()


def _pointers(tree: Any) -> list[int]:
    return [leaf.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("form", ["split", "whole"])
def test_a_donated_input_is_reused_in_place_on_every_call(form: str) -> None:
    """A donated input read by component layers: its buffer goes from layer to
    layer (each donates its input to its output) and the result is written over
    it, on every call, as under jax.jit; the whole-program form reuses it too."""
    comp = jaxaot.component(lambda w, v: jnp.tanh(v @ w) + v)

    def f(x: jax.Array, ws: Any) -> jax.Array:
        for w in ws:
            x = comp(w, x)
        return x

    ws = [jnp.eye(8) * 0.5 * (i + 1) for i in range(3)]
    x, y = jnp.arange(32.0).reshape(4, 8) / 32, jnp.arange(32.0).reshape(4, 8) / 32
    regional = jaxaot.jit(f, donate_argnums=0, whole_program=form == "whole")
    plain = jax.jit(f, donate_argnums=0)
    for _ in range(4):
        before, before_plain = x.unsafe_buffer_pointer(), y.unsafe_buffer_pointer()
        x, y = regional(x, ws), plain(y, ws)
        assert y.unsafe_buffer_pointer() == before_plain  # what jax.jit does
        assert x.unsafe_buffer_pointer() == before
        close(x, y)
    (plan,) = regional._plans.values()
    assert plan is not None and plan.mode == form
    # All three layers donate: one executable of the entry, whatever the depth
    # (none in the whole-program form, which binds the entry's program).
    assert comp.cache_info().compiles == (1 if form == "split" else 0)


def test_a_program_served_whole_reuses_a_donated_input() -> None:
    def f(x: jax.Array, ws: Any) -> jax.Array:  # nothing to split
        for w in ws:
            x = jnp.tanh(x @ w) + x
        return x

    ws = [jnp.eye(8) * 0.5 * (i + 1) for i in range(3)]
    x, y = jnp.ones((4, 8)), jnp.ones((4, 8))
    regional, plain = jaxaot.jit(f, donate_argnums=0), jax.jit(f, donate_argnums=0)
    for _ in range(3):
        before = x.unsafe_buffer_pointer()
        x, y = regional(x, ws), plain(y, ws)
        assert x.unsafe_buffer_pointer() == before
        close(x, y)
    (plan,) = regional._plans.values()
    assert plan.served_whole is not None


def test_a_donating_train_step_updates_its_state_in_place() -> None:
    """A split train step donating its parameters and optimizer state writes the new
    ones over the old, every call, as jax.jit does (and gives jax.jit's values)."""
    step, optimizer = train_step_factory(block)
    blocks, x = setup(2)
    mine = (blocks, optimizer.init(blocks))
    theirs = jax.tree_util.tree_map(jnp.copy, mine)
    regional = jaxaot.jit(step, donate_argnums=(0, 1), whole_program=False)
    plain = jax.jit(step, donate_argnums=(0, 1))
    for _ in range(3):
        before, before_plain = _pointers(mine), _pointers(theirs)
        *mine, value = regional(*mine, x)
        *theirs, want = plain(*theirs, x)
        assert _pointers(theirs) == before_plain
        assert _pointers(mine) == before
        close((mine, value), (theirs, want), tol=1e-4)


def test_donation_is_part_of_a_component_executable() -> None:
    """One entry called with its input donated and without: two executables, so
    the call that donates nothing never runs one that donates (its input stays)."""
    comp = jaxaot.component(lambda w, v: jnp.tanh(v @ w) + v)

    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        return comp(w, comp(w, x))

    w = jnp.eye(8) * 0.5
    donating = jaxaot.jit(f, donate_argnums=0, whole_program=False)
    keeping = jaxaot.jit(f, whole_program=False)
    x = jnp.ones((4, 8))
    want = jax.jit(f)(x, w)
    close(donating(jnp.ones((4, 8)), w), want)
    close(keeping(x, w), want)
    assert not x.is_deleted()
    assert comp.cache_info().compiles == 2


def test_vmap_and_nested_components() -> None:
    inner = jaxaot.component(lambda w, v: jnp.sin(v @ w))

    @jaxaot.component
    def outer(w: jax.Array, v: jax.Array) -> jax.Array:
        return inner(w, v) + inner(w, v * 2)

    def f(w: jax.Array, xs: jax.Array) -> jax.Array:
        ys = jax.vmap(outer, in_axes=(None, 0))(w, xs)
        return jnp.sum(ys**2)

    w, xs = jnp.ones((3, 3)) * 0.3, jnp.arange(12.0).reshape(4, 3) / 12
    got = jaxaot.jit(jax.value_and_grad(f))(w, xs)
    want = jax.value_and_grad(f)(w, xs)
    close(got, want)


def test_component_under_scan_still_correct(caplog: pytest.LogCaptureFixture) -> None:
    comp = jaxaot.component(lambda c, x: (c + jnp.sin(x), c * x))

    def f(xs: jax.Array) -> Any:
        return lax.scan(comp, jnp.zeros(3), xs)

    xs = jnp.arange(12.0).reshape(4, 3)
    caplog.set_level("DEBUG", logger="jaxaot")
    close(jaxaot.jit(f)(xs), jax.jit(f)(xs))
    assert any("compiled inline" in r.getMessage() for r in caplog.records)


def test_explain_of_a_call_that_fails_raises_its_error_as_the_call_does() -> None:
    """A call with a shape error or a missing argument fails; ``explain`` of it
    raises the same error (as ``jax.jit(f).trace`` does), rather than saying the
    program would run under ``jax.jit``."""

    def f(w: jax.Array, x: jax.Array) -> jax.Array:
        return x @ w

    regional = jaxaot.jit(f)
    for args in [(jnp.ones((3, 3)), jnp.ones((2, 4))), (jnp.ones((3, 3)),)]:
        with pytest.raises(TypeError) as plain:
            jax.jit(f)(*args)
        with pytest.raises(TypeError) as explained:
            regional.explain(*args)
        assert str(explained.value) == str(plain.value)
    assert "f: one program" in regional.explain(jnp.ones((3, 3)), jnp.ones((2, 3)))


def test_explain_compiles_nothing(compiles: list[str]) -> None:
    """On an empty cache, ``explain`` traces and cuts programs of every kind (a
    train step of components, a prefill of checkpoint blocks, components under a
    ``fori_loop``, a program with nothing to split) and compiles none of them;
    what it says is what the calls then run."""
    comp = jaxaot.component(lambda w, v: jnp.tanh(v @ w) + v)
    layer = jax.checkpoint(lambda w, h: jnp.sin(h @ w) + h)

    def step(ws: Any, v: jax.Array) -> Any:
        def loss(ws: Any) -> jax.Array:
            h = v
            for w in ws:
                h = comp(w, h)
            return jnp.sum(h**2)

        grads = jax.grad(loss)(ws)
        return [w - 0.1 * g for w, g in zip(ws, grads, strict=True)]

    def prefill(ws: Any, h: jax.Array) -> jax.Array:
        for w in ws:
            h = layer(w, h)
        return h

    def looped(w: jax.Array, v: jax.Array) -> jax.Array:
        return lax.fori_loop(0, 3, lambda i, h: comp(w, h), v)

    def split_and_looped(ws: Any, v: jax.Array) -> jax.Array:
        return looped(ws[0], prefill(ws, v))

    ws, v = [jnp.eye(4) * 0.1 * (i + 1) for i in range(3)], jnp.ones((2, 4))
    cases = [
        (step, (ws, v), "component <lambda>: 3 forward, 3 linear/transpose\n  glue: 2"),
        (prefill, (ws, v), "block checkpoint(<lambda>): 3 call"),
        (
            looped,
            (ws[0], v),
            "cached whole (kept whole: its layers run under scan/fori_loop (as with nn.scan",
        ),
        # A split program whose glue loops over a layer says so, not "kept whole".
        (split_and_looped, (ws, v), "3 calls\n  glue: 1 program\n  in glue, under scan/fori_loop:"),
        # (Saying how a layer called in a loop would split.)
        (lambda v: jnp.sin(v) * 2, (v,), "repeats no block; a layer called in a loop splits"),
    ]
    compiles.clear()  # the inputs' own (eager) compiles
    for fn, args, says in cases:
        regional = jaxaot.jit(fn)
        explained = regional.explain(*args)
        assert compiles == [], (explained, compiles)
        assert says in explained, explained
        assert "glue: 1 program" not in explained or "split into" in explained, explained
        close(regional(*args), jax.jit(fn)(*args))
        assert regional.explain(*args) == explained  # the plan made by the call says the same
        compiles.clear()


def test_jax_stages_are_those_of_jax_jit(compiles: list[str]) -> None:
    """``trace``, ``lower`` and ``eval_shape`` give JAX's stages of the whole program,
    as ``jax.jit`` of it gives them (static and donated arguments, ShapeDtypeStructs
    included), for reading its jaxpr, StableHLO, cost and output types; they run
    nothing of jaxaot's, and the program's calls still go through the cache."""
    comp = jaxaot.component(lambda w, v: jnp.tanh(v @ w) + v)

    def step(ws: Any, v: jax.Array, n: int) -> Any:
        for w in ws:
            v = comp(w, v)
        return {"out": v * n, "sum": jnp.sum(v).astype(jnp.bfloat16)}

    ws, v = [jnp.eye(4) * 0.1 * (i + 1) for i in range(3)], jnp.ones((2, 4))
    regional = jaxaot.jit(step, static_argnums=2)
    plain = jax.jit(step, static_argnums=2)
    sds = jax.ShapeDtypeStruct(v.shape, v.dtype)
    compiles.clear()
    assert str(regional.trace(ws, v, 3).jaxpr) == str(plain.trace(ws, v, 3).jaxpr)
    lowered = regional.lower(ws, sds, 3)
    assert lowered.as_text() == plain.lower(ws, sds, 3).as_text()
    assert regional.eval_shape(ws, sds, 3) == jax.eval_shape(plain, ws, sds, 3)
    assert compiles == []
    costs = lowered.compile().cost_analysis()
    assert costs and "flops" in (costs[0] if isinstance(costs, list) else costs)
    before = jaxaot.stats()["compiles"]
    close(regional(ws, v, 3), plain(ws, v, 3))
    assert jaxaot.stats()["compiles"] > before  # the call compiled through jaxaot


def test_a_bad_cache_setting_is_raised_as_a_component_raises_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``JAXAOT_*`` setting to fix is the user's error, raised as a component's
    call raises it: not a program silently run under plain ``jax.jit``."""
    from jaxaot._env import SettingError
    from jaxaot._store import _active

    monkeypatch.setenv("JAXAOT_CACHE", "floppy")
    monkeypatch.setattr(_active, "_default", _active._UNSET)
    comp = jaxaot.component(lambda w, v: jnp.tanh(v @ w) + v)
    step = jaxaot.jit(lambda ws, v: comp(ws[1], comp(ws[0], v)))
    ws, v = [jnp.eye(4), 2 * jnp.eye(4)], jnp.ones((2, 4))
    for run in (comp, step.explain, step):
        with pytest.raises(SettingError, match="JAXAOT_CACHE.*'floppy'"):
            run(*(ws, v) if run is not comp else (ws[0], v))


def test_program_without_components_and_static_args() -> None:
    f = jaxaot.jit(lambda x, n: x * n, static_argnums=1)
    np.testing.assert_allclose(f(jnp.ones(3), 4), 4 * np.ones(3))
    g = jaxaot.jit(lambda x, n: block(x["p"], x["x"]) * n, static_argnums=1)
    blocks, x = setup(1)
    close(g({"p": blocks[0], "x": x}, 2), 2 * _model.block(blocks[0], x))


def test_each_call_runs_the_plan_of_its_own_signature() -> None:
    """A step loop calls with one signature again and again; a call whose types,
    weak types, shapes, structure or placement differ from the last call's gets
    its own plan (and jax.jit's result and dtype), however the calls alternate."""
    scale = jaxaot.component(lambda w, s: jnp.tanh(w * s))

    def f(ws: Any, s: jax.Array) -> Any:
        return [scale(w, s) for w in ws]

    regional, plain = jaxaot.jit(f), jax.jit(f)
    w16 = [jnp.full((3,), 0.5, jnp.bfloat16)] * 2
    weak, strong = jnp.asarray(2.0), jnp.asarray(2.0, jnp.float32)
    assert jax.typeof(weak).weak_type and not jax.typeof(strong).weak_type
    cases = [
        (w16, weak),  # bfloat16 result
        (w16, strong),  # the same values and dtypes, but a strong float32: float32 result
        (w16, weak),
        ([w.astype(jnp.float32) for w in w16], weak),
        (w16 * 2, weak),  # four layers: another structure
        ([jnp.full((4,), 0.5, jnp.bfloat16)] * 2, weak),
        (w16, jax.device_put(weak, jax.devices()[0])),  # committed where it was: the same plan
        (w16, strong),
    ]
    for ws, s in cases * 2:
        got, want = regional(ws, s), plain(ws, s)
        assert [g.dtype for g in got] == [v.dtype for v in want], (ws[0].dtype, s)
        assert [g.shape for g in got] == [v.shape for v in want]
        assert [jax.typeof(g).weak_type for g in got] == [jax.typeof(v).weak_type for v in want]
        close(got, want, tol=1e-2)
    assert len(regional._plans) == 5


def test_calls_whose_plan_runs_the_whole_program_dispatch_in_cpp() -> None:
    """Once a signature's plan runs its whole-program form, calls of that
    signature go from JAX's C++ dispatcher straight to the executable. Calls of
    any other signature (a weak or strong scalar, a dtype, a structure), calls
    and calls inside a trace come back to Python, and each gets what jax.jit gives."""
    from jaxaot._regional import _plan

    layer = jaxaot.component(lambda w, v: jnp.tanh(v @ w))

    def loss_of(ws: Any, v: jax.Array, s: Any) -> jax.Array:
        for w in ws:
            v = layer(w, v) * s
        return jnp.sum(v**2)

    def step(ws: Any, v: jax.Array, s: Any) -> Any:
        value, grads = jax.value_and_grad(loss_of)(ws, v, s)
        return value, grads, s * 2  # weak if ``s`` is

    ws = [jax.random.normal(jax.random.key(i), (4, 4)) * 0.5 for i in range(4)]
    v = jax.random.normal(jax.random.key(9), (3, 4))
    strong = jnp.asarray(0.9, jnp.float32)
    regional, plain = jaxaot.jit(step), jax.jit(step)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        regional(ws, v, strong)
        (plan,) = regional._plans.values()
        assert plan is not None and plan.mode == _plan.WHOLE  # small layers: one program
        # The calls the C++ dispatcher gave back to Python (a new signature may then
        # be served from its plan's executable at once, if that is ready), and
        # the calls that ran the Python path.
        misses: list[Any] = []
        slow_calls: list[Any] = []
        miss, slow = regional._dispatch_miss, regional._call_slow

        def counted_miss(*args: Any, **kwargs: Any) -> Any:
            misses.append(args[2])
            return miss(*args, **kwargs)

        def counted_slow(args: Any, kwargs: Any, *rest: Any, **more: Any) -> Any:
            slow_calls.append(args[2])
            return slow(args, kwargs, *rest, **more)

        regional._dispatch_miss = counted_miss  # type: ignore[method-assign]
        regional._call_slow = counted_slow  # type: ignore[method-assign]
        regional._reset_dispatch()
        regional(ws, v, strong)
        regional(ws, v, strong)
        misses.clear()

        def check(*args: Any) -> None:
            got, want = regional(*args), plain(*args)
            for g, w in zip(
                jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
            ):
                assert (g.dtype, g.shape) == (w.dtype, w.shape), args[2]
                assert jax.typeof(g).weak_type == jax.typeof(w).weak_type, args[2]
            close(got, want, tol=1e-2)

        for _ in range(3):
            check(ws, v, strong)
        assert misses == []  # in C++
        others = [
            (ws, v, 0.9),  # a Python float: weak
            (ws, v, jnp.asarray(0.9)),  # a weak array
            (ws, v.astype(jnp.bfloat16), strong),
            (ws[:3], v, strong),
            (ws, v, jnp.asarray(0.9, jnp.bfloat16)),
        ]
        for args in others:
            check(*args)
        assert len(misses) == len(others)
        check(ws, v, strong)
        assert len(misses) == len(others)  # its fast path stayed
        slow_calls.clear()
        close(jax.jit(regional)(ws, v, strong), plain(ws, v, strong))  # inside a trace
        assert len(misses) == len(others) and len(slow_calls) == 1


def test_static_arguments_and_typed_keys_dispatch_in_cpp_keyed_by_their_values() -> None:
    """A decode step with static arguments (by name and by position) and a typed
    PRNG key: once its plan runs the whole program, its calls go from JAX's C++
    dispatcher to the executable, the static values keying it as under jax.jit
    (each value its own program, its fast path kept), with jax.jit's results."""
    layer = jaxaot.component(lambda w, v: jnp.tanh(v @ w))

    def step(ws: Any, v: jax.Array, key: jax.Array, scale: float, greedy: bool = True) -> Any:
        for w in ws:
            v = layer(w, v) * scale
        noise = 0.0 if greedy else jax.random.normal(key, v.shape)
        return v + noise, jax.random.split(key)[0]

    ws = [jax.random.normal(jax.random.key(i), (4, 4)) * 0.5 for i in range(3)]
    v, key = jax.random.normal(jax.random.key(9), (2, 4)), jax.random.key(3)
    regional = jaxaot.jit(step, static_argnums=(3,), static_argnames=("greedy",))
    plain = jax.jit(step, static_argnums=(3,), static_argnames=("greedy",))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        misses: list[Any] = []
        miss = regional._dispatch_miss

        def counted(*args: Any, **kwargs: Any) -> Any:  # a call given back to Python
            misses.append((args[3], kwargs.get("greedy")))
            return miss(*args, **kwargs)

        regional._dispatch_miss = counted  # type: ignore[method-assign]
        regional._reset_dispatch()
        calls = [(0.5, True), (0.5, False), (2.0, True)]
        for scale, greedy in calls:  # each signature's plan, then its fast path's executable
            regional(ws, v, key, scale, greedy=greedy)
            regional(ws, v, key, scale, greedy=greedy)
        assert all(p is not None and p.mode == _plan.WHOLE for p in regional._plans.values())
        misses.clear()
        for _ in range(2):
            for scale, greedy in calls:
                got = regional(ws, v, key, scale, greedy=greedy)
                want = plain(ws, v, key, scale, greedy=greedy)
                close(got[0], want[0])
                assert jax.random.key_data(got[1]).tolist() == jax.random.key_data(want[1]).tolist()
        assert misses == []  # in C++, each static value its own program
        close(regional(ws, v, key, 3.0)[0], plain(ws, v, key, 3.0)[0])  # a new value: Python
        assert misses == [(3.0, None)]


def test_calls_of_a_split_program_skip_the_cpp_dispatcher() -> None:
    """While no plan runs a whole program, the C++ dispatcher has no fast path to
    give, so calls go straight to the Python path (a miss would cost each call
    its dispatch and a call back): no call reaches ``_dispatch_miss``. Results
    are jax.jit's."""
    layer = jaxaot.component(lambda w, v: jnp.tanh(v @ w))

    def step(ws: Any, v: jax.Array) -> Any:
        return jax.value_and_grad(lambda ws, v: jnp.sum(_chain(layer, ws, v) ** 2))(ws, v)

    ws = [jax.random.normal(jax.random.key(i), (4, 4)) * 0.5 for i in range(3)]
    v = jax.random.normal(jax.random.key(9), (3, 4))
    regional = jaxaot.jit(step, whole_program=False)
    misses: list[Any] = []
    miss = regional._dispatch_miss

    def counted(*args: Any, **kwargs: Any) -> Any:
        misses.append(args)
        return miss(*args, **kwargs)

    regional._dispatch_miss = counted  # type: ignore[method-assign]
    regional._reset_dispatch()  # a dispatcher calling ``counted``
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        for _ in range(4):
            close(regional(ws, v), jax.jit(step)(ws, v))
    (plan,) = regional._plans.values()
    assert plan is not None and plan.mode == "split"
    assert misses == []


def _chain(layer: Any, ws: Any, v: jax.Array) -> jax.Array:
    for w in ws:
        v = layer(w, v)
    return v


def test_a_whole_program_calling_back_keeps_its_calls_in_python() -> None:
    """A whole program whose layers call back into Python never gets the C++ fast
    path (loading it would run the program once on zeros): every call comes back
    to Python, and the callback only ever sees the program's own values."""
    import numpy as np

    from jaxaot._regional import _plan

    seen: list[float] = []

    def host(v: Any) -> Any:
        seen.append(float(np.abs(v).min()))
        return np.asarray(v)

    layer = jaxaot.component(
        lambda w, v: jax.pure_callback(host, jax.ShapeDtypeStruct(v.shape, v.dtype), v @ w) + 1.0
    )

    def f(ws: Any, v: jax.Array) -> jax.Array:
        for w in ws:
            v = layer(w, v)
        return v

    ws = [jnp.eye(3)] * 3
    v = jnp.ones((2, 3))
    regional = jaxaot.jit(f)
    regional(ws, v)
    (plan,) = regional._plans.values()
    assert plan.mode == _plan.WHOLE
    for _ in range(3):
        close(regional(ws, v), jax.jit(f)(ws, v))
    assert plan.whole_calls_back and not plan._structured
    assert seen and min(seen) >= 1.0  # never the zeros


def test_a_call_under_another_configuration_is_traced_under_it() -> None:
    """A configuration jax.jit traces again for (here strict dtype promotion) gets
    its own plan, before and after the whole program runs in C++: mixing
    bfloat16 and float32 raises as under jax.jit, and the default configuration
    still computes."""
    from jaxaot._regional import _plan

    layer = jaxaot.component(lambda w, v: jnp.tanh(v @ w))

    def f(ws: Any, v: jax.Array, h: jax.Array) -> jax.Array:
        for w in ws:
            v = layer(w, v)
        return jnp.sum(v + h)  # float32 + bfloat16

    ws = [jnp.eye(4) * 0.5] * 3
    v, h = jnp.ones((2, 4)), jnp.ones((2, 4), jnp.bfloat16)
    regional, plain = jaxaot.jit(f), jax.jit(f)
    for fast in (False, True):
        if fast:  # the whole program, then its calls in C++
            (plan,) = [p for p in regional._plans.values() if p is not None]
            assert plan.mode == _plan.WHOLE
            for _ in range(2):
                regional(ws, v, h)
        close(regional(ws, v, h), plain(ws, v, h))
        with jax.numpy_dtype_promotion("strict"):
            with pytest.raises(jax.dtypes.TypePromotionError):
                plain(ws, v, h)
            with pytest.raises(jax.dtypes.TypePromotionError):
                regional(ws, v, h)
        close(regional(ws, v, h), plain(ws, v, h))


def test_inside_jax_jit_behaves_as_jax_jit() -> None:
    f = jaxaot.jit(lambda p, x: block(p, x) * 3)
    blocks, x = setup(1)
    close(jax.jit(f)(blocks[0], x), 3 * _model.block(blocks[0], x))


WARM_MODULE = textwrap.dedent(
    """
    import os
    import jax, jax.numpy as jnp, jaxaot
    from jaxaot._regional import _programs

    @jaxaot.component(key="regional-warm-block")
    def block(p, x):
        if os.environ.get("JAXAOT_TEST_RAISE") == "1":
            raise RuntimeError("traced in the warm process")
        return x + jnp.tanh(x @ p)

    def loss(ps, x):
        for p in ps:
            x = block(p, x)
        return jnp.sum(x ** 2)

    def run():
        ps = [jnp.eye(4) * (0.1 * (i + 1)) for i in range(5)]
        x = jnp.ones((2, 4))
        f = jaxaot.jit(jax.value_and_grad(loss), whole_program=False)
        value, grads = f(ps, x)
        info = block.cache_info()
        # The same program as one program (what its small layers decide).
        whole_value, _ = jaxaot.jit(jax.value_and_grad(loss))(ps, x)
        whole = _programs.WHOLE.counters.info()
        # A step loop feeds each step's outputs (made by executables loaded from
        # the cache, in the warm process) back in: still the first call's plan.
        sgd = jaxaot.jit(
            lambda ps, x: [p - 0.1 * g for p, g in zip(ps, jax.grad(loss)(ps, x))],
            whole_program=False,
        )
        qs = ps
        for _ in range(8):
            qs = sgd(qs, x)
        return {"value": float(value), "grads": [g.tolist() for g in grads], "traces": info.traces,
                "compiles": info.compiles, "whole_value": float(whole_value),
                "whole_compiles": whole.compiles, "whole_hits": whole.hits,
                "all_compiles": block.cache_info().compiles, "sgd_plans": len(sgd._plans),
                "sgd": [q.tolist() for q in qs]}
    """
)


def test_warm_process_compiles_no_component(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    (tmp_path / "regmod.py").write_text(WARM_MODULE)
    env = dict(subprocess_env)
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    code = "import json, regmod; print(json.dumps(regmod.run()))"
    results = []
    for raise_if_traced in ("0", "1"):
        env["JAXAOT_TEST_RAISE"] = raise_if_traced
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = results
    # One forward and one backward entry, shared by all layers.
    assert cold["traces"] == 1 and cold["compiles"] == 2
    assert warm["traces"] == 0 and warm["compiles"] == 0
    # The whole-program form: compiled once, then loaded; it compiles no component either.
    assert cold["whole_compiles"] == 1 and warm["whole_compiles"] == 0 and warm["whole_hits"] == 1
    assert warm["all_compiles"] == 0
    # The loop's outputs have the types of its inputs: one plan, cold and warm
    # (a warm process once saw the loaded executables' output types as others).
    assert cold["sgd_plans"] == warm["sgd_plans"] == 1
    # Without the whole program, the loop runs the same executables in both
    # processes (compiled, then loaded): bit for bit the same (README).
    np.testing.assert_array_equal(warm["sgd"], cold["sgd"])
    np.testing.assert_allclose(warm["whole_value"], cold["value"], rtol=1e-6)
    np.testing.assert_allclose(warm["value"], cold["value"], rtol=1e-6)
    np.testing.assert_allclose(warm["grads"], cold["grads"], rtol=1e-6)


UNSPLIT_PROGRAMS = textwrap.dedent(
    """
    import json, logging, sys
    import jax, jax.numpy as jnp, numpy as np, jaxaot
    from jax import lax
    from jaxaot import _regional

    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    def looped(w, x):  # a loop JAX stages out: nothing for jaxaot.jit to split
        return lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ w) + h, x)

    def plain(ws, x):  # a plain loop of layers, no blocks: nothing to split either
        for w in ws:
            x = jnp.tanh(x @ w) + x
        return jnp.sum(x**2), x

    w, x = jnp.eye(8) * 0.5, jnp.arange(16.0).reshape(2, 8) / 16
    ws = [w * (i + 1) / 4 for i in range(4)]
    out = {}
    for name, fn, args in [("looped", looped, (w, x)), ("plain", plain, (ws, x))]:
        regional = jaxaot.jit(fn)
        before = len(events)  # the inputs exist: only the call's own compiles count
        got = jax.block_until_ready(regional(*args))
        again = jax.block_until_ready(regional(*args))
        again = jax.block_until_ready(regional(*args))  # from JAX's C++ dispatcher
        compiled = events[before:]
        want = jax.jit(fn)(*args)
        for g, a, v in zip(*map(jax.tree_util.tree_leaves, (got, again, want)), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(v))
            np.testing.assert_array_equal(np.asarray(a), np.asarray(v))
            assert g.dtype == v.dtype
        out[name] = {"compiles": compiled, "explain": regional.explain(*args)}
    jaxaot.wait_for_writes()
    out["stats"] = jaxaot.stats()
    print(json.dumps(out))
    """
)


def test_a_program_that_is_not_split_is_cached_whole(subprocess_env: dict[str, str]) -> None:
    """A program jaxaot.jit cannot split (a ``fori_loop``; a plain loop without
    blocks) is still one cached region: a second process loads it and compiles
    nothing, as JAX's own compile events count, where jax.jit without JAX's
    persistent cache would compile it again; its values are jax.jit's."""
    results, logs = [], []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", UNSPLIT_PROGRAMS],
            capture_output=True,
            text=True,
            env=subprocess_env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        logs.append(proc.stderr)
    cold, warm = results
    for name in ("looped", "plain"):
        assert len(cold[name]["compiles"]) == 1, cold[name]  # once, then from this process
        assert warm[name]["compiles"] == [], warm[name]
        assert "cached whole" in warm[name]["explain"], warm[name]["explain"]
        assert "nothing to split" in warm[name]["explain"], warm[name]["explain"]
    assert cold["stats"]["compiles"] == 2 and cold["stats"]["misses"] == 2, cold["stats"]
    assert warm["stats"]["compiles"] == 0 and warm["stats"]["hits"] == 2, warm["stats"]
    # Said once at INFO, per function: that it is served whole, and why.
    for log in logs:
        lines = [line for line in log.splitlines() if "served whole" in line]
        assert len(lines) == 2 and all(line.startswith("INFO:jaxaot:") for line in lines), log


def test_a_program_served_whole_dispatches_in_cpp() -> None:
    """A program served whole runs as a whole program does: calls of a signature
    seen before go from JAX's C++ dispatcher straight to its executable (no
    slower than jax.jit's calls); another signature comes back to Python and
    gets jax.jit's result."""

    def f(x: jax.Array, s: Any) -> Any:
        return jnp.sin(x) * s, s * 2

    regional, plain = jaxaot.jit(f), jax.jit(f)
    x, strong = jnp.arange(4.0), jnp.asarray(0.5, jnp.float32)
    misses: list[Any] = []
    slow = regional._call_slow

    def counted(args: Any, kwargs: Any, *rest: Any, **more: Any) -> Any:
        misses.append(args[1])
        return slow(args, kwargs, *rest, **more)

    regional._call_slow = counted  # type: ignore[method-assign]
    for _ in range(2):  # its executable, then the one taking the argument tree
        regional(x, strong)
    regional(x, strong)
    misses.clear()

    def check(*args: Any) -> None:
        got, want = regional(*args), plain(*args)
        for g, w in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            assert jax.typeof(g) == jax.typeof(w)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    for _ in range(3):
        check(x, strong)
    assert misses == []  # in C++
    check(x, 0.5)  # a Python float: weak, another signature
    assert len(misses) == 1
    (plan, _) = regional._plans.values()
    assert plan.served_whole is not None


def test_a_failed_executable_falls_back_to_jax_jit_with_inputs_intact(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Executables compile in the background while the first call runs; when one
    cannot be made, the call still gives jax.jit's result, and donated inputs are
    only given up once every executable exists."""
    comp = jaxaot.component(lambda w, v: jnp.tanh(v @ w) + v)
    calls = {"n": 0}

    def broken(call: Any, shardings: Any = None) -> Any:
        calls["n"] += 1
        raise RuntimeError("no executable today")

    monkeypatch.setattr(_planner, "region_executable", broken)

    def step(ws: Any, v: jax.Array) -> Any:
        def loss(ws: Any) -> jax.Array:
            h = v
            for w in ws:
                h = comp(w, h)
            return jnp.sum(h**2)

        grads = jax.grad(loss)(ws)
        return [w - 0.1 * g for w, g in zip(ws, grads, strict=True)]

    ws = [jnp.eye(3) * 0.5, jnp.eye(3) * 0.25]
    v = jnp.arange(6.0).reshape(2, 3) / 6
    want = jax.jit(step)(ws, v)
    caplog.set_level("DEBUG", logger="jaxaot")
    regional = jaxaot.jit(step, donate_argnums=0, whole_program=False)
    got = regional(ws, v)
    close(got, want)
    assert calls["n"] >= 1
    assert any("not split" in r.getMessage() for r in caplog.records)
    # The fallback ran with the donated inputs: jax.jit gave them up, not a half-run plan.
    assert all(w.is_deleted() for w in ws)
    # Later calls go straight to jax.jit.
    n = calls["n"]
    ws2 = [jnp.eye(3) * 0.5, jnp.eye(3) * 0.25]
    close(regional(ws2, v), want)
    assert calls["n"] == n


def test_precompile_waits_for_every_executable() -> None:
    blocks, x = setup(3)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        block.clear_cache()
        grad.precompile(blocks, x)
        (plan,) = grad._plans.values()
        assert plan is not None and plan.ready
        assert all(step.job.done() for step in plan.steps)
        close(grad(blocks, x), jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x))


def test_a_precompile_whose_compile_failed_at_run_time_fails_and_plans_again(
    monkeypatch: pytest.MonkeyPatch, fresh_cache: jaxaot.MemoryCache
) -> None:
    """XLA failing at run time (seen on a GPU: out of memory while autotuning,
    beside other precompile workers) fails the precompile with XLA's error. It
    used to leave the signature to plain jax.jit for good and report it done, so
    the deployment compiled it. A later precompile plans it again and caches it."""

    def fn(bs: Any, x: jax.Array) -> jax.Array:
        return loss(bs, x * 1.2345, block)  # a program no other test compiled

    blocks, x = setup(3)
    grad = jaxaot.jit(jax.grad(fn))
    real = _programs.lowered

    class Failing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def compile(self) -> Any:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: staged out of memory")

    monkeypatch.setattr(_programs, "lowered", Failing)
    with pytest.raises(jax.errors.JaxRuntimeError, match="staged out of memory"):
        grad.precompile(blocks, x)
    monkeypatch.setattr(_programs, "lowered", real)
    grad.precompile(blocks, x)
    assert not grad.explain(blocks, x).startswith(f"jaxaot.jit {grad.__name__}: jax.jit")
    close(grad(blocks, x), jax.grad(fn)(blocks, x))


def test_autodiff_executables_start_compiling_during_the_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forward and transposed executables are submitted while the program is
    still being traced (and each is compiled once)."""
    from jaxaot._regional import _planner

    events: list[str] = []
    submit = _planner.submit_jobs

    def recording(jobs: dict[Any, Any]) -> Any:
        events.extend(f"submit {k.parts['transform'][-1][0]}" for k in jobs if hasattr(k, "parts"))
        return submit(jobs)

    monkeypatch.setattr(_planner, "submit_jobs", recording)
    comp = jaxaot.component(lambda w, v: jnp.sin(v @ w))

    def loss(ws: Any, v: jax.Array) -> jax.Array:
        for i, w in enumerate(ws):
            v = comp(w, v)
            events.append(f"traced layer {i}")
        return jnp.sum(v)

    ws = [jnp.eye(3) * 0.5] * 3
    v = jnp.ones((2, 3))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        got = jaxaot.jit(jax.grad(loss), whole_program=False)(ws, v)
    close(got, jax.grad(loss)(ws, v))
    assert events.index("submit linearize") < events.index("traced layer 2")
    assert events.count("submit linearize") == 1 and events.count("submit transpose") == 1
    assert comp.cache_info().compiles == 2


def test_no_input_is_donated_before_every_executable_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    comp = jaxaot.component(lambda w, v: jnp.tanh(v @ w))

    def broken(call: Any, shardings: Any = None) -> Any:
        raise RuntimeError("no executable today")

    monkeypatch.setattr(_planner, "region_executable", broken)

    def f(a: jax.Array, w: jax.Array) -> jax.Array:
        return comp(w, a * 2)  # the glue computing a * 2 is a's last use: it donates a

    a, w = jnp.ones((2, 3)), jnp.eye(3)
    want = jax.jit(f)(a, w)
    got = jaxaot.jit(f, donate_argnums=0)(a, w)
    close(got, want)
    assert a.is_deleted()


def test_a_component_used_at_top_level_and_in_jaxaot_jit_shares_one_cache(
    tmp_path: Path,
) -> None:
    """The top-level executable of an entry takes the call's pytrees; jaxaot.jit's
    takes flat arrays. They are different cache entries, so neither is handed
    to the other's caller."""
    comp = jaxaot.component(lambda p, x: jnp.tanh(x @ p["w"]) + p["b"], key="both-ways")
    p = {"w": jnp.eye(3) * 0.5, "b": jnp.ones(3)}
    x = jnp.arange(6.0).reshape(2, 3)
    want = jnp.tanh(x @ p["w"]) + p["b"]
    with jaxaot.using_cache(jaxaot.DirectoryCache(tmp_path / "cache")):
        close(comp(p, x), want)
        jaxaot.wait_for_writes()
        comp.clear_cache()  # as a fresh process would: everything comes from the directory
        close(jaxaot.jit(lambda p, x: comp(p, x) * 2)(p, x), 2 * want)
        comp.clear_cache()
        close(comp(p, x), want)


# -- sharded programs (8 simulated CPU devices, in a fresh interpreter) --------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario of ``_sharded_worker`` run in one subprocess that sets the
    device count before importing JAX, on meshes of each axis type (Auto,
    Explicit: ``jax.make_mesh``'s default, and mixed where a mesh has two axes);
    per ``"<axes>:<scenario>"``, its counts or its traceback."""
    tmp = tmp_path_factory.mktemp("sharded")
    env = dict(os.environ)
    env["JAXAOT_CACHE_DIR"] = str(tmp / "cache")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    )
    env["JAX_PLATFORMS"] = "cpu"
    worker = Path(__file__).with_name("_sharded_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


AXES = ["auto", "explicit", "mixed"]
#: For scenarios whose meshes have one axis, where ``mixed`` (the first axis
#: Explicit, the others Auto) is ``explicit``.
ONE_AXIS = ["auto", "explicit"]


def _scenario(results: dict[str, Any], name: str, axes: str) -> Any:
    outcome = results[f"{axes}:{name}"]
    assert outcome["ok"], outcome["error"]
    return outcome["result"]


# One worker runs every scenario (the fixture runs once per pytest-xdist worker).
@pytest.mark.xdist_group("sharded_scenarios")
@pytest.mark.parametrize("axes", ONE_AXIS)
def test_sharded_data_parallel_train_step_compiles_each_block_once(
    sharded: dict[str, Any], axes: str
) -> None:
    """Batch sharded, parameters replicated: values, gradients and output shardings
    are jax.jit's, and the block's executables compile once whatever the depth."""
    compiles = _scenario(sharded, "data_parallel", axes)["compiles"]
    assert compiles["1"] == compiles["3"] > 0


@pytest.mark.xdist_group("sharded_scenarios")
@pytest.mark.parametrize("axes", ONE_AXIS)
def test_sharded_unannotated_blocks_compile_once_whatever_the_depth(
    sharded: dict[str, Any], axes: str
) -> None:
    """jax.checkpoint layers with no jaxaot annotation, batch sharded: found as
    blocks, split, values and shardings as jax.jit gives them."""
    compiles = _scenario(sharded, "auto_blocks", axes)["compiles"]
    assert compiles["2"] == compiles["4"] > 0


@pytest.mark.xdist_group("sharded_scenarios")
@pytest.mark.parametrize("axes", ONE_AXIS)
def test_sharded_fsdp_parameters(sharded: dict[str, Any], axes: str) -> None:
    assert _scenario(sharded, "fsdp", axes)["compiles"] > 0


@pytest.mark.xdist_group("sharded_scenarios")
@pytest.mark.parametrize("axes", AXES)
def test_sharded_2d_mesh(sharded: dict[str, Any], axes: str) -> None:
    assert _scenario(sharded, "mesh_2d", axes)["compiles"] > 0


@pytest.mark.xdist_group("sharded_scenarios")
@pytest.mark.parametrize("axes", AXES)
def test_sharded_shard_map_component_under_two_meshes(sharded: dict[str, Any], axes: str) -> None:
    values = _scenario(sharded, "shard_map_component", axes)["values"]
    assert values["(8,)"] != values["(2, 4)"]  # the psum ran over 8 devices, then over 2


@pytest.mark.xdist_group("sharded_scenarios")
@pytest.mark.parametrize("axes", ONE_AXIS)
def test_sharded_in_and_out_shardings(sharded: dict[str, Any], axes: str) -> None:
    _scenario(sharded, "in_out_shardings", axes)


@pytest.mark.xdist_group("sharded_scenarios")
@pytest.mark.parametrize("axes", ONE_AXIS)
def test_sharded_donation(sharded: dict[str, Any], axes: str) -> None:
    _scenario(sharded, "donation", axes)


@pytest.mark.xdist_group("sharded_scenarios")
@pytest.mark.parametrize("axes", AXES)
def test_sharded_inside_set_mesh(sharded: dict[str, Any], axes: str) -> None:
    _scenario(sharded, "set_mesh", axes)


@pytest.mark.xdist_group("sharded_scenarios")
@pytest.mark.parametrize("axes", ONE_AXIS)
def test_sharded_failure_falls_back_to_jax_jit_with_its_shardings(
    sharded: dict[str, Any], axes: str
) -> None:
    assert _scenario(sharded, "fallback", axes)["fell_back"]


def test_jit_checks_its_shardings() -> None:
    with pytest.raises(TypeError, match="in_shardings must hold"):
        jaxaot.jit(lambda x: x, in_shardings=(3,))
    with pytest.raises(TypeError, match="out_shardings must hold"):
        jaxaot.jit(lambda x: x, out_shardings="replicated")


DEEP_SHARDED = """
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import jaxaot
from jaxaot.cli import _model as M

mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
blocks = M.init_blocks(jax.random.key(0), 48, 16)
x = jax.random.normal(jax.random.key(1), (16, 8, 16))
blk = jaxaot.component(M.block)

def loss(bs, x):
    for p in bs:
        x = blk(p, x)
    return jnp.mean(x ** 2)

step = jaxaot.jit(jax.value_and_grad(loss))
sharded = (jax.device_put(blocks, NamedSharding(mesh, P())),
           jax.device_put(x, NamedSharding(mesh, P("x"))))
for _ in range(3):
    value, grads = step(*sharded)
jax.block_until_ready(grads)
assert all(plan is not None and plan.in_flight for plan in step._plans.values())
want_value, want_grads = step(blocks, x)  # the single-device split program
np.testing.assert_allclose(value, want_value, rtol=1e-5)
for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)  # sums in another order
"""


def test_a_deep_sharded_step_on_cpu_devices_runs(subprocess_env: dict[str, str]) -> None:
    """48 blocks data-parallel over 8 CPU devices: ~100 executables a step with
    collectives. Queued without limit, one of them misses its rendezvous and XLA
    ends the process; the split program keeps at most a few in flight."""
    env = dict(subprocess_env)
    env.pop("JAXAOT_IN_FLIGHT", None)
    proc = subprocess.run(
        [sys.executable, "-c", DEEP_SHARDED],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_a_program_it_cannot_plan_runs_under_jax_jit_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, compiles: list[str]
) -> None:
    """Where jaxaot cannot plan a program, it runs under plain jax.jit (jax.jit's
    values), one warning says so and why, and what jax.jit compiles for it counts
    in ``jaxaot.stats()`` (a process serving it is not warm); a program whose own
    code fails raises jax.jit's error, with no such warning."""
    import logging

    from jaxaot import _stats
    from jaxaot._regional import _jit

    def cannot(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a primitive jaxaot does not know")

    monkeypatch.setattr(_jit, "build_plan", cannot)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    _stats.reset_warnings()
    f = jaxaot.jit(lambda x: jnp.sin(x) * 2)
    xs = [jnp.ones(n) for n in (3, 4, 3)]
    before, compiles[:] = jaxaot.stats()["compiles"], []
    got = [f(x) for x in xs]
    assert len(compiles) == 2  # (one per signature)
    assert jaxaot.stats()["compiles"] - before == len(compiles), jaxaot.stats()
    for x, y in zip(xs, got, strict=True):
        np.testing.assert_allclose(y, np.sin(np.asarray(x)) * 2, rtol=1e-6)
    said = [r.getMessage() for r in caplog.records if "runs under plain jax.jit" in r.getMessage()]
    assert len(said) == 1 and "NotImplementedError: a primitive jaxaot does not know" in said[0]
    caplog.clear()
    broken = jaxaot.jit(lambda x: x @ jnp.ones((5, 5)))
    with pytest.raises(TypeError):
        broken(jnp.ones((2, 3)))
    assert not [r for r in caplog.records if "runs under plain jax.jit" in r.getMessage()]


def test_debug_nans_and_disable_jit_work_as_under_jax_jit() -> None:
    """As under ``jax.jit``: a NaN under ``jax_debug_nans`` raises
    ``FloatingPointError``, on the C++ path too; under ``jax.disable_jit`` the
    function runs once, as Python, on concrete values (it was traced first)."""
    seen: list[Any] = []

    def f(x: jax.Array) -> jax.Array:
        seen.append(type(x))
        return jnp.log(x) * 2

    regional = jaxaot.jit(f)
    x = jnp.array([1.0, -1.0])
    for _ in range(2):  # the second call takes the C++ path
        regional(jnp.ones(2))
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError, match="invalid value"):
            regional(x)
    seen.clear()
    with jax.disable_jit():
        out = regional(x)
    assert len(seen) == 1 and not issubclass(seen[0], jax.core.Tracer), seen
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.log(x) * 2))


def test_a_decorated_method_binds_its_instance_as_under_jax_jit() -> None:
    """``@jaxaot.jit`` on a method of a pytree class (an Equinox module): the
    instance is the first argument, as under ``jax.jit`` (it was left out: "missing
    a required positional argument")."""
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        w: jax.Array

        @jaxaot.jit
        def apply(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(x @ self.w)

    net, x = Net(jnp.eye(3) * 0.5), jnp.ones((2, 3))
    np.testing.assert_array_equal(np.asarray(net.apply(x)), np.asarray(jnp.tanh(x @ net.w)))
    assert isinstance(Net.apply, jaxaot.RegionalFunction)  # unbound: the function itself


@pytest.mark.parametrize("whole", [True, False])
def test_compiled_programs_are_named_after_the_function(
    whole: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Compile logs (and so the profiler and HLO module names) call the glue and
    whole programs jaxaot compiles for ``jaxaot.jit(step)`` ``jit(step)``, as
    ``jax.jit`` does (they were ``jit(jaxpr_as_fun)`` and ``jit(fun)``), and the
    blocks' forward and backward entries after their block, never
    ``jit(jaxpr_as_fun)``."""

    def step(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = jax.jit(lambda w, x: jnp.tanh(x @ w))(w, x)
        return x.sum()

    ws, x = [jnp.eye(4) * (i + 1) for i in range(6)], jnp.ones((2, 4))
    jax.config.update("jax_log_compiles", True)  # in every thread (compiles run in the background)
    try:
        with caplog.at_level(logging.WARNING):
            jaxaot.jit(jax.grad(step), whole_program=whole)(ws, x)
    finally:
        jax.config.update("jax_log_compiles", False)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling jit(")]
    assert any(m.startswith("Compiling jit(step)") for m in said), said
    assert not [m for m in said if "jit(fun)" in m or "jaxpr_as_fun" in m], said


def test_in_shardings_precompile_from_shapes(
    fresh_cache: jaxaot.MemoryCache, compiles: list[str]
) -> None:
    """A function with ``in_shardings`` precompiles from ``jax.ShapeDtypeStruct``s
    (a manifest's signatures), without or with that sharding, as ``jax.jit(...).lower``
    takes them; the call then compiles nothing. (It used to put the shapes on the
    devices with ``jax.device_put`` and fail.)"""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))

    def f(x: jax.Array) -> jax.Array:
        return jnp.tanh(x) * 2.5

    fn = jaxaot.jit(f, in_shardings=sharding)
    fn.precompile(jax.ShapeDtypeStruct((8, 4), jnp.float32))
    fn.precompile(jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding))
    made = len(compiles)
    assert made >= 1
    x = np.linspace(0, 1, 32, dtype=np.float32).reshape(8, 4)
    got = fn(x)
    assert len(compiles) == made
    want = jax.jit(f, in_shardings=sharding)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.is_equivalent_to(want.sharding, 2)


def test_in_an_enable_x64_block_it_lowers_for_64_bit_types(
    fresh_cache: jaxaot.MemoryCache,
) -> None:
    """Inside ``with jax.enable_x64(True):`` (JAX keeps it per thread), the plan's
    executables are made on other threads: they see the block's options, so a
    float64 call runs and is cached as ``jax.jit``'s would be. (They were lowered
    for float32 and the call raised, or a Python float fell back to plain
    ``jax.jit``.)"""
    layer = jaxaot.component(lambda w, x: jnp.tanh(x @ w))

    def f(w: jax.Array, x: jax.Array, scale: float) -> jax.Array:
        for _ in range(3):
            x = layer(w, x)
        return x * scale

    fn = jaxaot.jit(f)
    with jax.enable_x64(True):
        w = jnp.linspace(0, 1, 64).reshape(8, 8) / 3
        x = jnp.ones((4, 8))
        assert x.dtype == jnp.float64
        got = fn(w, x, 1.5)
        want = jax.jit(f)(w, x, 1.5)
        assert got.dtype == want.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)
        said = fn.explain(w, x, 1.5)
        assert not said.startswith("jaxaot.jit f: jax.jit"), said
    small = fn(np.ones((8, 8), np.float32), np.ones((4, 8), np.float32), 1.5)
    assert small.dtype == jnp.float32


def test_donate_argnames_as_jax_jit_takes_it(fresh_cache: jaxaot.MemoryCache) -> None:
    """``donate_argnames``, as ``jax.jit`` takes it: the argument is donated
    whether passed by position or by name; a name that is no parameter is a
    ValueError (it used to be a TypeError: an unexpected keyword)."""
    layer = jaxaot.component(lambda w, x: jnp.tanh(x @ w))

    def step(state: dict[str, jax.Array], x: jax.Array, *, scale: float = 1.0) -> Any:
        y = layer(state["w"], layer(state["w"], x))
        return {"w": state["w"] * 0.5 + y.sum() * scale}, y

    fn = jaxaot.jit(step, donate_argnames="state")
    want = jax.jit(step)({"w": jnp.eye(4) * 0.5}, jnp.ones((2, 4)))
    for call in (
        lambda st: fn(st, jnp.ones((2, 4))),
        lambda st: fn(state=st, x=jnp.ones((2, 4))),
    ):
        state = {"w": jnp.eye(4) * 0.5}
        got = call(state)
        assert state["w"].is_deleted()
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6),
            got,
            want,
        )
    with pytest.raises(ValueError, match="donate_argnames"):
        jaxaot.jit(step, donate_argnames="nope")


def test_a_call_inside_another_trace_says_once_that_it_is_an_inner_jit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Inside ``jax.jit`` (or ``grad``, ``vmap``) a jaxaot.jit function is an inner
    jit of the caller's program: it computes what jax.jit does, and says so once,
    at INFO, rather than letting the call read as a cached program of its own."""
    inner = jaxaot.jit(lambda x: jnp.sin(x) * 2)
    caplog.set_level("INFO", logger="jaxaot")
    for n in (3, 4):
        x = jax.device_put(np.linspace(0.0, 1.0, n, dtype=np.float32))
        got = jax.jit(lambda x: inner(x) + 1)(x)
        np.testing.assert_array_equal(got, jax.jit(lambda x: jnp.sin(x) * 2 + 1)(x))
    np.testing.assert_allclose(jax.grad(lambda x: inner(x).sum())(x), 2 * np.cos(x), rtol=1e-6)
    said = [r for r in caplog.records if "inside another trace" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO", caplog.text
    assert "<lambda>" in said[0].getMessage()


_FED_BACK = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, jaxaot

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None
    )

    @jax.checkpoint
    def layer(w, x):
        return x + jnp.tanh(x @ w)

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = layer(w, h)
            return jnp.mean(h**2)

        value, grads = jax.value_and_grad(loss)(ws)
        return [w - 0.1 * g for w, g in zip(ws, grads, strict=True)], value

    ws, x = [jnp.eye(16) * 0.1 for _ in range(4)], jnp.ones((4, 16))
    run = jaxaot.jit(step, whole_program=sys.argv[1] == "whole")
    want_ws, want = ws, None
    ws, _ = run(ws, x)
    traces, before = jaxaot.stats()["traces"], len(compiles)
    for _ in range(3):
        ws, value = run(ws, x)
    after = len(compiles)
    for _ in range(4):
        want_ws, want = jax.jit(step)(want_ws, x)
    print(json.dumps({
        "plans": len(run._plans),
        "compiles": after - before,
        "traces": jaxaot.stats()["traces"] - traces,
        "same": bool(jnp.allclose(value, want, rtol=1e-5)),
    }))
    """
)


@pytest.mark.parametrize("form", ["split", "whole"])
def test_outputs_fed_back_find_the_plan_of_the_inputs(
    form: str, subprocess_env: dict[str, str]
) -> None:
    """A train loop feeds a step's outputs back as its next inputs. They have the
    inputs' types, made by another route (an executable's results, not eager
    ops'): the next calls find the same plan, trace nothing and compile nothing
    (jax 0.12 compares types by identity: it made a second plan). In a fresh
    process, where no other route has made these types first."""
    proc = subprocess.run(
        [sys.executable, "-c", _FED_BACK, form],
        env={**subprocess_env, "JAXAOT_CACHE": "memory"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"plans": 1, "compiles": 0, "traces": 0, "same": True}, got


def test_region_executables_are_named_after_their_blocks() -> None:
    """Each region executable compiles under its block's name (``jit(block)``,
    ``jit(checkpoint(layer))``), as jax.jit names a program after its function,
    in JAX's compile events (and so the profiler and HLO): never ``jit(<lambda>)``."""
    names: list[str] = []

    def listen(event: str, seconds: float, **kw: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(kw.get("fun_name")))

    @jax.checkpoint
    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(x @ w)

    @jaxaot.component
    def named_block(w: jax.Array, x: jax.Array) -> jax.Array:
        return x + jnp.sin(x @ w)

    def step(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = named_block(w, layer(w, x))
        return jnp.mean(x**2)

    ws, x = [jnp.eye(8) * 0.1 for _ in range(4)], jnp.ones((2, 8))
    jax.block_until_ready((ws, x))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        got = jaxaot.jit(jax.grad(step), whole_program=False)(ws, x)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    close(got, jax.jit(jax.grad(step))(ws, x))
    assert "jit(named_block)" in names and "jit(checkpoint(layer))" in names, names
    assert not any("<lambda>" in n for n in names), names


def _inner_jit_model(scale: float, program: str) -> Any:
    """A step whose glue calls a ``jax.jit`` function closing over an array that
    ``scale`` sets: inside a ``cond``, a ``scan`` and a ``vmap``, around component
    layers (``program``: none, split, whole) or none."""
    table = np.arange(4, dtype=np.float32) * scale

    @jax.jit
    def inner(v: jax.Array) -> jax.Array:
        return v * table

    @jaxaot.component
    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(x @ w)

    def step(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        x = lax.cond(x[0, 0] > 0, inner, lambda v: v, x)
        x, _ = lax.scan(lambda c, _: (inner(c), None), x, None, length=2)
        if program != "none":
            for w in ws:
                x = inner(layer(w, x))
        return jax.vmap(inner)(x) + 1

    return step


@pytest.mark.parametrize("program", ["none", "split", "whole"])
def test_programs_differing_only_in_a_nested_constant_are_not_shared(program: str) -> None:
    """Two functions whose programs print alike, their inner ``jax.jit`` closing
    over different arrays (a jaxpr's text leaves out the constants of the jaxprs
    it nests), each give jax.jit's values: in the program served whole, the
    split program's glue and its whole-program form."""
    ws, x = [jnp.eye(4) * 0.1 for _ in range(3)], jnp.ones((2, 4))
    whole = program == "whole"
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        for scale in (1.0, 2.0, 3.0):
            step = _inner_jit_model(scale, program)
            got = jaxaot.jit(step, whole_program=whole)(ws, x)
            close(got, jax.jit(step)(ws, x))


def test_callbacks_over_different_arrays_run_their_own() -> None:
    """Two programs alike but for the array their host callback closes over each
    call their own callback, in one process: neither runs the other's executable."""
    for scale in (1.0, 2.0):
        table = np.arange(4, dtype=np.float32) * scale

        def step(x: jax.Array, table: np.ndarray = table) -> jax.Array:
            y = jax.pure_callback(lambda v: (v * table).astype(v.dtype), x, x)
            return y + 1

        got = jaxaot.jit(step)(jnp.ones(4))
        np.testing.assert_array_equal(got, jax.jit(step)(jnp.ones(4)))


_EDITED_CONSTANT = """
import sys, json
import numpy as np, jax, jax.numpy as jnp, jaxaot
TABLE = np.arange(4, dtype=np.float32) * float(sys.argv[1])  # the edit

@jax.jit
def inner(v):
    return v * TABLE

def f(x):
    return inner(x) + 1

x = jnp.ones(4)
got = jaxaot.jit(f)(x)
jaxaot.wait_for_writes()
print(json.dumps({"got": got.tolist(), "want": jax.jit(f)(x).tolist()}))
"""


def test_an_edited_constant_of_an_inner_jit_is_not_served_stale(
    subprocess_env: dict[str, str],
) -> None:
    """A module's array that an inner ``jax.jit`` reads, edited between two
    processes on one cache: the second process computes with the edited array."""
    for scale in ("1", "2"):
        proc = subprocess.run(
            [sys.executable, "-c", _EDITED_CONSTANT, scale],
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["got"] == got["want"], (scale, got)


def test_a_program_xla_cannot_serialize_is_said_once_and_kept_here(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A program with a host callback whose executable XLA fails to serialize (an
    XLA:CPU sort comparator, at times): it runs, with jax.jit's values, and is
    said once not to be written; ``wait_for_writes`` returns."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("UNIMPLEMENTED: 'LessThan' is not serializable")

    monkeypatch.setattr(_programs, "serialize_with_callbacks", refused)
    seen: list[float] = []

    def step(x: jax.Array) -> jax.Array:
        jax.debug.callback(lambda v: seen.append(float(v)), x.sum())
        return jnp.sort(x) * 2

    caplog.set_level(logging.WARNING, logger="jaxaot")
    x = jnp.array([3.0, 1.0, 2.0])
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        got = jaxaot.jit(step)(x)
        jaxaot.wait_for_writes()
    np.testing.assert_array_equal(got, jax.jit(step)(x))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "is not written to the cache (RuntimeError" in said[0], said
    assert seen == [6.0, 6.0]


_BATCH_NORM_RUN = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, equinox as eqx, jaxaot

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **k: compiles.append(e)
        if e == "/jax/core/compile/backend_compile_duration" else None
    )

    # A repeated layer taking a mean over an enclosing vmap axis, as jax.jit
    # traces it and as Equinox's BatchNorm (eqx.nn.State) does.
    inner = jax.jit(lambda w, x: jnp.tanh(x @ w) - jax.lax.pmean(x, "b"))

    def plain(ws, xs):
        def one(x):
            for w in ws:
                x = inner(w, x)
            return x.sum()
        return jax.vmap(one, axis_name="b")(xs)

    class Block(eqx.Module):
        lin: eqx.nn.Linear
        bn: eqx.nn.BatchNorm
        def __init__(self, key):
            self.lin = eqx.nn.Linear(8, 8, key=key)
            self.bn = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        def __call__(self, x, state):
            h, state = self.bn(self.lin(x), state)
            return x + jax.nn.relu(h), state

    class Net(eqx.Module):
        blocks: list
        def __init__(self, key):
            self.blocks = [Block(k) for k in jax.random.split(key, 4)]
        def __call__(self, x, state):
            for b in self.blocks:
                x, state = b(x, state)
            return x, state

    model, state = eqx.nn.make_with_state(Net)(jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, state, x):
        net = eqx.combine(params, static)
        y, state = jax.vmap(net, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            x, state
        )
        return (y ** 2).mean(), state

    step = jax.value_and_grad(loss, has_aux=True)
    cases = {
        "plain": (plain, ([jnp.full((4, 4), 0.1)] * 5, jnp.ones((3, 2, 4)))),
        "batch_norm": (step, (params, state, jnp.linspace(-1, 1, 64).reshape(8, 8))),
    }
    out = {}
    for name, (fn, args) in cases.items():
        before = len(compiles)
        got = jaxaot.jit(fn)(*args)
        made = len(compiles) - before
        want = jax.jit(fn)(*args)
        equal = all(
            a.dtype == b.dtype and bool(jnp.array_equal(a, b))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        ) and jax.tree.structure(got) == jax.tree.structure(want)
        out[name] = {"compiles": made, "equal": equal}
    jaxaot.wait_for_writes()
    print(json.dumps(out))
    """
)


def test_a_layer_taking_a_collective_over_an_outer_vmap_axis_warm_starts_unwarned(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A repeated layer taking a mean over an enclosing vmap axis (a batch norm:
    Equinox's ``BatchNorm`` with ``eqx.nn.State``) becomes a block that can only be
    lowered inside the program calling it. That program is cached, so a new
    process compiles nothing: the warning that the block "is not written to the
    cache, so a new process compiles it again" was wrong, in every process."""
    cold, warm = cold_and_warm(
        tmp_path / "batch_norm_run.py", _BATCH_NORM_RUN, subprocess_env, "not written to the cache"
    )
    for name in ("plain", "batch_norm"):
        assert cold[name]["equal"] and warm[name]["equal"], (name, cold, warm)
        assert cold[name]["compiles"] >= 1 and warm[name]["compiles"] == 0, (name, cold, warm)


def test_a_step_that_updates_its_arguments_in_place_is_told_the_updates_are_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The Flax NNX tutorial's step (``optimizer.update(model, grads)`` in place,
    returning the loss) trains nothing under jax.jit and jaxaot.jit alike: the
    function gets copies of its arguments' containers. jaxaot.jit says so, once,
    naming the arguments; a step that returns what it changed is not warned of."""
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for layer in self.layers:
                x = nnx.relu(layer(x))
            return x

    def in_place(model: MLP, opt: nnx.Optimizer, x: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - 1) ** 2).mean())(model)
        opt.update(model, grads)
        return loss

    def returned(model: MLP, opt: nnx.Optimizer, x: jax.Array) -> Any:
        return in_place(model, opt, x), model, opt

    x = jnp.ones((8, 4))
    caplog.set_level(logging.WARNING, logger="jaxaot")
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        for step in (returned, in_place):
            model = MLP(nnx.Rngs(0))
            opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            run = jaxaot.jit(step)
            for _ in range(3):
                run(model, opt, x)
    said = [r.getMessage() for r in caplog.records if "in place" in r.getMessage()]
    assert len(said) == 1 and "'in_place'" in said[0] and "args[0].layers[0]" in said[0], said


@pytest.mark.parametrize("whole_program", [False, True])
def test_a_step_fed_numpy_arrays_then_its_own_outputs_is_planned_once(
    whole_program: bool,
) -> None:
    """A train state of NumPy arrays (Haiku's initial batch-norm state, a checkpoint
    read from disk), then the step's own outputs, then NumPy arrays again: the
    same types on the default device, one plan (it was traced again on the second
    step), with jax.jit's values each time."""
    layer = jaxaot.component(lambda w, x: jnp.tanh(x @ w))

    def step(ws: Any, x: Any, count: Any) -> Any:
        for w in ws:
            x = layer(w, x)
        return x, count + 1

    ws = [np.eye(4, dtype=np.float32) * 0.5] * 6
    state = (np.ones((2, 4), np.float32), np.zeros((), np.float32))
    fast = jaxaot.jit(step, whole_program=whole_program)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        for feed in (lambda s: s, lambda s: s, lambda s: tuple(map(np.asarray, s))):
            state = feed(state)
            got = fast(ws, *state)
            close(got, jax.jit(step)(ws, *state))
            state = got
    assert len(fast._plans) == 1


def test_a_function_transformed_outside_any_jit_says_once_that_nothing_is_cached(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``jax.grad`` and ``jax.vmap`` of a ``jaxaot.jit`` function, called eagerly:
    JAX compiles the transformed program in every process and jaxaot caches
    none of it. One warning per function says so, and how to cache it; under an
    outer jit (whose program holds it) nothing is said. Values are jax.jit's."""
    ws = [jnp.eye(4) * 0.5] * 3
    x = jnp.ones((2, 4))

    def loss(ws: Any, x: jax.Array) -> jax.Array:
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    fast = jaxaot.jit(loss)
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        close(jax.jit(jax.grad(fast))(ws, x), jax.grad(jax.jit(loss))(ws, x))
        assert not caplog.records
        for _ in range(2):
            close(jax.grad(fast)(ws, x), jax.grad(jax.jit(loss))(ws, x))
            close(
                jax.vmap(fast, (None, 0))(ws, x[:, None]), jax.vmap(loss, (None, 0))(ws, x[:, None])
            )
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1, said
    assert "jaxaot.jit loss: called under jax.grad" in said[0]
    assert "jaxaot.jit(jax.grad(loss))" in said[0]


PLACED_AND_HOST = """
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
import jaxaot

jaxaot.set_cache(jaxaot.MemoryCache())
d0, d1 = jax.devices()[:2]
layer = jaxaot.component(lambda w, x: jnp.tanh(x @ w))

def f(w, x):
    for _ in range(3):
        x = layer(w, x)
    return x

on_d1 = [jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(d1))] * 2
w, x = np.eye(8, dtype=np.float32) / 3, np.ones((8, 8), np.float32)
fast = jaxaot.jit(f)
fast.precompile(*on_d1)
got = fast(jax.device_put(w, d1), jax.device_put(x, d1))
assert len(fast._plans) == 1, "the call on device 1 was not the precompiled plan"
assert got.sharding == jax.sharding.SingleDeviceSharding(d1)
host = fast(w, x)  # NumPy arrays: placed on the default device, as jax.jit places them
want = jax.jit(f)(w, x)
assert len(fast._plans) == 2 and host.sharding == want.sharding, (host.sharding, want.sharding)
np.testing.assert_allclose(host, want, rtol=1e-6)
np.testing.assert_allclose(got, want, rtol=1e-6)
"""


def test_host_values_share_the_default_devices_plan_not_a_precompiled_placement(
    subprocess_env: dict[str, str],
) -> None:
    """A signature precompiled for arrays on device 1 serves calls with arrays
    there; a call with NumPy arrays is placed on the default device, as jax.jit
    places it, by a plan of its own (two CPU devices, in a subprocess)."""
    proc = subprocess.run(
        [sys.executable, "-c", PLACED_AND_HOST],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("whole_program", [True, False])
def test_a_configuration_that_changes_the_lowering_changes_the_program(
    whole_program: bool,
) -> None:
    """``jax_threefry_partitionable`` leaves the jaxpr of a draw as it was and
    changes its lowering: after the option changes, the same function (and a new
    one of the same body) draws as ``jax.jit`` draws, not the bits of the
    program compiled before."""

    def draw(key: jax.Array) -> jax.Array:
        return jax.random.normal(key, (3,)) * 2.0

    key = jax.random.key(0)
    same = jaxaot.jit(draw, whole_program=whole_program)
    before = bool(jax.config.jax_threefry_partitionable)
    same(key)
    try:
        jax.config.update("jax_threefry_partitionable", not before)
        want = jax.jit(draw)(key)
        fresh = jaxaot.jit(draw, whole_program=whole_program)
        for got in (same(key), fresh(key)):
            np.testing.assert_array_equal(got, want)
    finally:
        jax.config.update("jax_threefry_partitionable", before)
    np.testing.assert_array_equal(same(key), jax.jit(draw)(key))
