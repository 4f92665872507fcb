"""The whole-program form of a split program, repeated layers as loops
(``jaxaot._whole``)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _steps import block, close, loss, setup, train_step_factory

import jaxaot
from jaxaot._regional import _chains, _plan, _programs, _whole
from jaxaot.cli import _model


def _first_call_compiles(layers: int, compiles: list[str]) -> tuple[int, int]:
    """A train step's first call, as one program: XLA compiles (JAX's events) and
    whole programs compiled."""
    grad = jaxaot.jit(jax.value_and_grad(lambda bs, x: loss(bs, x, block)))
    blocks, x = setup(layers)
    _programs.WHOLE._exes.clear()  # (another test may have made this very program)
    before = len(compiles), _programs.WHOLE.counters.info().compiles
    jax.block_until_ready(grad(blocks, x))
    (plan,) = grad._plans.values()
    assert plan.mode == _plan.WHOLE
    return len(compiles) - before[0], _programs.WHOLE.counters.info().compiles - before[1]


def test_whole_program_compiles_one_layer_whatever_the_depth(compiles: list[str]) -> None:
    """Repeated layers are one loop in the whole program: its compile count does
    not grow with depth, and it is one program."""
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        shallow = _first_call_compiles(3, compiles)
        deep = _first_call_compiles(12, compiles)
    assert shallow == deep == (1, 1), (shallow, deep)


def test_no_whole_program_when_it_would_still_be_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program whose calls do not form loops would compile, whole, as long as
    jax.jit does: past ``MAX_WHOLE_CALLS`` calls, it runs split."""
    monkeypatch.setattr(_whole, "MAX_WHOLE_CALLS", 1)
    blocks, x = setup(2)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    want = jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x)
    close(grad(blocks, x), want)
    (plan,) = grad._plans.values()
    assert plan.whole is None and plan.mode == _plan.SPLIT
    assert "component calls after loops, over 1" in grad.explain(blocks, x)


def _whole_jit(f: Any, *args: Any) -> Any:
    """``f``'s whole-program form (from its jaxpr), compiled, called on ``args``."""
    closed = jax.make_jaxpr(f)(*args)
    fn, _ = _whole.program(closed.jaxpr)
    flat = jax.tree_util.tree_leaves(args)
    out = jax.jit(fn)(*flat, *closed.consts)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(jax.eval_shape(f, *args)), out)


def test_whole_program_gives_the_programs_values_however_its_loops_meet() -> None:
    """Loops that hand stacks to each other in order, reversed, in part or
    shuffled, and layer values also read one by one, all give the program's values."""
    layer = jaxaot.component(lambda w, v: jnp.tanh(v @ w))
    other = jaxaot.component(lambda w, v: jnp.sin(v @ w) + v)
    mix = jaxaot.component(lambda w, u, h: jnp.tanh(u @ w) * h)
    mix2 = jaxaot.component(lambda u, a, b: jnp.tanh(u * a) + b)
    eye = jnp.eye(4) * 0.9
    ws = [jax.random.normal(jax.random.key(i), (4, 4)) * 0.5 for i in range(6)]
    v = jax.random.normal(jax.random.key(9), (3, 4))

    def chain(ws: Any, v: jax.Array, f: Any = layer) -> jax.Array:
        for w in ws:
            v = f(w, v)
        return v

    def every_layer(ws: Any, v: jax.Array) -> jax.Array:
        hs = []
        for w in ws:
            v = layer(w, v)
            hs.append(v)
        return v + sum(h * (i + 1) for i, h in enumerate(hs))  # each layer's output, one by one

    def two_loops(ws: Any, v: jax.Array) -> Any:
        hs = []
        for w in ws:
            v = layer(w, v)
            hs.append(v)
        u, out = jnp.ones_like(v), []
        for h in hs[::-1]:  # a second loop over the first one's outputs, reversed
            u = mix(eye, u, h)
            out.append(u)
        s = jnp.ones_like(v)
        for h in [hs[2], hs[0], hs[4], hs[1]]:  # and in no order: stacked afresh
            s = mix(eye, s, h)
        return u, s, out[1:4]

    def both_ways(ws: Any, v: jax.Array) -> jax.Array:
        hs = []
        for w in ws:
            v = layer(w, v)
            hs.append(v)
        u = jnp.ones_like(v)
        for a, b in zip(hs, hs[::-1], strict=True):  # one column in order, one reversed
            u = mix2(u, a, b)
        return u

    cases = [
        (both_ways, (ws, v)),
        (jax.grad(lambda ws, v: jnp.sum(both_ways(ws, v))), (ws, v)),
        (chain, (ws, v)),
        (jax.grad(lambda ws, v: jnp.sum(chain(ws, v) ** 2), argnums=(0, 1)), (ws, v)),
        (
            jax.value_and_grad(lambda ws, v: jnp.sum(chain(ws[1:], chain(ws[:1], v, other)))),
            (ws, v),
        ),
        (every_layer, (ws, v)),
        (jax.grad(lambda ws, v: jnp.sum(every_layer(ws, v))), (ws, v)),
        (two_loops, (ws, v)),
        (jax.grad(lambda ws, v: jnp.sum(two_loops(ws, v)[1])), (ws, v)),
    ]
    for f, args in cases:
        close(_whole_jit(f, *args), jax.jit(f)(*args))


def test_a_backward_loop_reads_the_forward_loops_stacks_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a train step, the backward loop runs in reverse over the stacks the
    forward loop made (residuals) and read (parameters): nothing is cut into
    layers and stacked again between them. (Blocks that write residuals: small
    ones recompute their forward pass instead, see ``_cost``.)"""
    monkeypatch.setenv("JAXAOT_RECOMPUTE_BELOW", "0")
    blocks, x = setup(6)
    closed = jax.make_jaxpr(jax.value_and_grad(lambda bs, x: loss(bs, x, block)))(blocks, x)
    items, outvars = _chains.runs(closed.jaxpr.eqns), list(closed.jaxpr.outvars)
    loops, _ = _whole._layout(items, outvars)
    (i_forward, forward), (_, backward) = sorted(loops.items())
    assert not forward.reverse and backward.reverse
    assert forward.fresh and all(q in forward.fresh for q in forward.columns)  # the parameters
    assert not backward.fresh  # every column is a stack the forward loop left
    assert all(c is not None and not c.flip for c in backward.columns.values())
    # The residuals that are a layer's weights are read from the parameter stacks
    # the forward loop reads: the forward entry returns no copy of them.
    entry = items[i_forward].eqns[0].params["call"].entry
    weights = [q for _, q in entry.extra["forwarded"] if q in forward.columns]
    assert weights
    parameter_stacks = set(forward.fresh.values())
    read_back = {c.stack for c in backward.columns.values() if c is not None}
    assert len(read_back & parameter_stacks) >= len(weights)


def test_a_stored_whole_program_is_loaded_never_compiled() -> None:
    """A whole program another process stored is loaded, never compiled."""
    import numpy as np

    avals = (jax.core.ShapedArray((3,), jnp.float32),)
    digest = "e" * 64

    def fn(a: jax.Array) -> list[jax.Array]:
        return [a * 2]

    first = _programs.ProgramCache("whole program")
    first.program(digest, avals, avals, (), fn, lambda: False)  # compiled and stored
    assert first.counters.info().compiles == 1
    jaxaot.wait_for_writes()
    other = _programs.ProgramCache("whole program")  # another process's
    exe = other.program(digest, avals, avals, (), fn, lambda: False)
    assert other.counters.info().compiles == 0 and other.counters.info().hits == 1
    np.testing.assert_allclose(exe(jnp.ones(3))[0], np.full(3, 2.0))


def test_a_program_gives_the_same_bits_cold_warm_and_under_load(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The form is the program's: 400 training steps give bit-identical losses in
    a cold process, a warm one, one on a machine kept busy by other processes,
    and one on a cache of its own; the warm ones compile nothing. Both forms (the
    whole program, and split) run in each process, one after the other."""
    env = dict(subprocess_env, JAXAOT_CACHE_DIR=str(tmp_path / "cache"))
    cold = _train(env)
    warm = _train(env)
    # One spinning process keeps the machine busy (the other pytest-xdist worker too).
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time() + 120\nwhile time.time() < t: pass"]
    )
    try:
        loaded = _train(env)
    finally:
        busy.kill()
        busy.wait()
    other = _train(dict(env, JAXAOT_CACHE_DIR=str(tmp_path / "other")))
    for form in FORMS:
        runs = [run[form] for run in (cold, warm, loaded, other)]
        assert {run["mode"] for run in runs} == {form}
        assert len(runs[0]["losses"]) == 400 and len(set(runs[0]["losses"])) > 1
        assert all(run["losses"] == runs[0]["losses"] for run in runs), form
        assert warm[form]["compiles"] == loaded[form]["compiles"] == 0, form
        assert warm[form]["loaded"] > 0, form
        assert cold[form]["compiles"] > 0 and other[form]["compiles"] > 0, form


FORMS = ("whole", "split")


def _train(env: dict[str, str]) -> dict[str, Any]:
    worker = Path(__file__).with_name("_form_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), "400", ",".join(FORMS)],
        capture_output=True,
        text=True,
        env=dict(env, PYTHONPATH=os.pathsep.join([str(worker.parent), env.get("PYTHONPATH", "")])),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _decode_layer(p: dict[str, jax.Array], x: jax.Array, kc: jax.Array, pos: jax.Array) -> Any:
    k = x @ p["wk"]
    kc = jax.lax.dynamic_update_slice(kc, k[:, None, :], (0, pos, 0))
    s = jnp.einsum("bw,btw->bt", x, kc)
    return jnp.tanh(x + jnp.einsum("bt,btw->bw", jax.nn.softmax(s, axis=-1), kc)), kc


def test_a_decode_step_updates_its_donated_caches_in_place_through_the_fast_path() -> None:
    """A served decode step (per-layer KV caches, donated) runs as one program with
    its layers unrolled: a loop would stack the caches and cut them apart again,
    copying what was donated to be updated in place. Its executable aliases each
    donated cache to its output, calls after the first run in JAX's C++ path, and
    values and donation match jax.jit's."""
    layer = jaxaot.component(_decode_layer)
    n, b, t, w = _whole.MIN_LOOP, 2, 8, 4

    def step(params: list[Any], x: jax.Array, caches: list[jax.Array], pos: jax.Array) -> Any:
        new = []
        for p, kc in zip(params, caches, strict=True):
            x, kc = layer(p, x, kc, pos)
            new.append(kc)
        return x, new

    keys = jax.random.split(jax.random.key(1), n)
    params = [{"wk": jax.random.normal(k, (w, w)) * 0.3} for k in keys]
    x = jnp.ones((b, w))

    def caches() -> list[jax.Array]:
        return [jnp.zeros((b, t, w)) + i for i in range(n)]

    plain = jax.jit(lambda *a: step(*a), donate_argnums=(2,))
    fast = jaxaot.jit(step, donate_argnums=(2,))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        assert "layers updating a donated input in place are not looped" in fast.explain(
            params, x, caches(), jnp.int32(0)
        )
        want_in, got_in = caches(), caches()
        for i in range(3):
            want, want_in_next = plain(params, x, want_in, jnp.int32(i))
            got, got_in_next = fast(params, x, got_in, jnp.int32(i))
            assert [c.is_deleted() for c in got_in] == [c.is_deleted() for c in want_in]
            close((got, got_in_next), (want, want_in_next))
            want_in, got_in = want_in_next, got_in_next
        (plan,) = fast._plans.values()
        assert plan.mode == _plan.WHOLE and fast._hot  # later calls run in C++
        text = plan.whole.result().as_text()
    assert "while" not in text, "the layers were looped"
    assert text.count("may-alias") + text.count("must-alias") >= n, "a cache is not aliased"


def test_a_donating_train_step_keeps_its_layers_as_loops() -> None:
    """Donated parameters are read by every layer but updated by the optimizer, not
    handed back by a layer: the train step's layers stay loops (its compile does
    not grow with depth)."""
    step, optimizer = train_step_factory(block)
    blocks, x = setup(_whole.MIN_LOOP)
    state = optimizer.init(blocks)
    want = jax.jit(step)(blocks, state, x)
    fast = jaxaot.jit(step, donate_argnums=(0, 1))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        got = fast(blocks, state, x)
        (plan,) = fast._plans.values()
        assert plan.mode == _plan.WHOLE
        assert "while" in plan.whole.result().as_text()
    close(got, want)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(blocks))


def test_an_nnx_plain_loop_is_two_loops_under_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NNX model's layers in a plain Python loop, under ``value_and_grad``: each
    backward layer gets zeros for the layer's state it hands back, built between
    the layers. The layers still make one forward and one backward loop (two
    component calls, so the program runs whole where at most two are allowed),
    with jax.jit's values."""
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.lin = nnx.Linear(8, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + jnp.tanh(self.lin(self.norm(x)))

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([Layer(rngs) for _ in range(_whole.MIN_LOOP)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for layer in self.layers:
                x = layer(x)
            return x

    def loss(model: Any, x: jax.Array) -> jax.Array:
        return (model(x) ** 2).mean()

    model, x = Model(nnx.Rngs(0)), jax.random.normal(jax.random.key(1), (4, 8))
    monkeypatch.setattr(_whole, "MAX_WHOLE_CALLS", 2)
    step = jaxaot.jit(jax.value_and_grad(loss))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        got = step(model, x)
        (plan,) = step._plans.values()
        assert plan.mode == _plan.WHOLE, step.explain(model, x)
    close(got, jax.jit(jax.value_and_grad(loss))(model, x))


def _one_program(fast: Any, blocks: Any, x: jax.Array) -> tuple[Any, str]:
    """``fast``'s result for ``blocks`` and ``x``, run as one program, and that
    program's optimized HLO."""
    got = fast(blocks, x)
    (plan,) = fast._plans.values()
    assert plan.mode == _plan.WHOLE
    return got, plan.whole.result().as_text()


def test_a_few_layers_stay_unrolled_and_more_are_a_loop() -> None:
    """Runs shorter than ``MIN_LOOP`` layers are unrolled in the whole program (for
    a few layers it compiles sooner, and runs as fast); from ``MIN_LOOP`` on they
    are loops. Both give jax.jit's values."""
    grad = jax.value_and_grad(lambda bs, x: loss(bs, x, block))
    for layers, looped in ((_whole.MIN_LOOP - 1, False), (_whole.MIN_LOOP, True)):
        blocks, x = setup(layers)
        fast = jaxaot.jit(grad)
        with jaxaot.using_cache(jaxaot.MemoryCache()):
            got, text = _one_program(fast, blocks, x)
            assert ("while" in text) == looped, layers
            said = "its repeated layers as loops" if looped else "its layers unrolled"
            assert said in fast.explain(blocks, x), fast.explain(blocks, x)
        close(got, jax.value_and_grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x))


def _fused(text: str) -> set[str]:
    """The distinct fused computations of an optimized HLO module, their names
    and metadata aside (XLA:CPU compiles each distinct one once)."""
    found = re.findall(r"^%?fused_computation[^\n]*\{\n(.*?)^\}", text, flags=re.M | re.S)
    return {re.sub(r"%[\w.\-]+", "%v", re.sub(r", metadata=\{[^}]*\}", "", f)) for f in found}


def test_a_loops_layers_are_cut_from_their_stacks_by_one_program_for_all() -> None:
    """Each layer's results (its gradients, which the update reads) are cut from
    the loop's stacks at positions XLA cannot fold: a cut and the update that
    reads it are one fused program for every layer, as in an unrolled program,
    not one per layer, each compiled on its own. A deeper program compiles no
    more of them."""
    grad = jax.value_and_grad(lambda bs, x: loss(bs, x, block))

    def step(bs: Any, x: jax.Array) -> Any:
        value, grads = grad(bs, x)
        return jax.tree.map(lambda w, g: w - 0.1 * g, bs, grads), value

    kinds = []
    for layers in (_whole.MIN_LOOP + 1, 2 * _whole.MIN_LOOP + 2):
        blocks, x = setup(layers)
        with jaxaot.using_cache(jaxaot.MemoryCache()):
            got, text = _one_program(jaxaot.jit(step), blocks, x)
        assert text.count(" while(") >= 3  # forward and backward layers, and the positions
        kinds.append(len(_fused(text)))
        plain = jax.value_and_grad(lambda bs, x: loss(bs, x, _model.block))
        want = jax.tree.map(lambda w, g: w - 0.1 * g, blocks, plain(blocks, x)[1])
        close(got[0], want)
    # (Fusion choices may differ a little with depth; a program per layer and
    # gradient would add several for each added layer.)
    assert 0 < kinds[1] < kinds[0] + _whole.MIN_LOOP + 1, kinds


def test_a_loops_stacked_inputs_are_one_concatenation_per_type() -> None:
    """The inputs a loop stacks from its layers (their parameters) are stacked by
    one concatenation of them all made flat, per type, not one stack each (of
    many dimensions, which XLA:CPU builds code for far more slowly). The values
    are jax.jit's, for parameters of one type and of three."""
    grad = jax.value_and_grad(lambda bs, x: loss(bs, x, block))
    blocks, x = setup(_whole.MIN_LOOP + 1)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        got, text = _one_program(jaxaot.jit(grad), blocks, x)
    assert " while(" in text
    assert text.count("concatenate(") == 1, text.count("concatenate(")
    close(got, jax.value_and_grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x))

    def layer(p: dict[str, jax.Array], v: jax.Array) -> jax.Array:
        h = jnp.tanh(v @ p["w"] + p["b"].astype(v.dtype)) * p["n"].astype(v.dtype)
        return h + p["g"] * v

    def forward(ps: list[Any], v: jax.Array) -> jax.Array:
        for p in ps:
            v = jaxaot.component(layer)(p, v)
        return v

    keys = jax.random.split(jax.random.key(0), _whole.MIN_LOOP + 1)
    ps = [
        {
            "w": jax.random.normal(k, (8, 8)) * 0.3,
            "g": jax.random.uniform(k, (8,)),
            "b": jax.random.normal(k, (8,)).astype(jnp.bfloat16),
            "n": jnp.arange(8, dtype=jnp.int32) % (i + 2),
        }
        for i, k in enumerate(keys)
    ]
    v = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        got, text = _one_program(jaxaot.jit(forward), ps, v)
    assert " while(" in text
    assert text.count("concatenate(") == 3, text.count("concatenate(")
    close(got, jax.jit(lambda ps, v: functools.reduce(lambda v, p: layer(p, v), ps, v))(ps, v))


SUB_BYTE_LAYERS = """
import jax, jax.numpy as jnp, numpy as np, jaxaot
from jaxaot._regional import _whole

def params(i):
    r = np.random.RandomState(i)
    return {
        "w": jnp.asarray(r.randn(8, 8) * 0.3, jnp.float32),
        "a": jnp.asarray(r.randint(0, 2, size=3)).astype(jnp.int2),
        "b": jnp.asarray(r.randint(0, 2, size=1)).astype(jnp.int2),
    }

@jax.checkpoint
def layer(p, x):
    extra = jnp.sum(p["a"].astype(jnp.float32)) * 0.01 + jnp.sum(p["b"].astype(jnp.float32))
    return jnp.tanh(x @ p["w"]) + extra + x

def forward(ps, x):
    for p in ps:
        x = layer(p, x)
    return x

ps, x = [params(i) for i in range(_whole.MIN_LOOP)], jnp.ones((2, 8))
f = jaxaot.jit(forward)
assert "as loops" in f.explain(ps, x), f.explain(ps, x)
np.testing.assert_allclose(f(ps, x), jax.jit(forward)(ps, x), rtol=1e-6)
print("ok")
"""


def test_layers_of_sub_byte_parameters_are_looped_without_packing_them(
    subprocess_env: dict[str, str],
) -> None:
    """Parameters of fewer than 8 bits (``int2``) are stacked apart, not packed:
    XLA:CPU aborts the process on a concatenation of many of them."""
    proc = subprocess.run(
        [sys.executable, "-c", SUB_BYTE_LAYERS],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(subprocess_env, JAXAOT_CACHE="memory"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "ok"


def test_a_layer_of_several_calls_and_glue_repeated_is_one_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layers written as several component calls with glue between them (a linear
    layer, a norm, an activation and a residual add), repeated in a chain, are one
    loop of that period where the program would otherwise run split (over
    ``MAX_WHOLE_CALLS`` calls; within it, they stay unrolled). Glue that differs
    between periods (another constant), a period reading an older period's
    output, or a host callback in the glue keep the calls one by one. Each gives
    the program's values."""
    lin = jaxaot.component(lambda w, v: v @ w)
    norm = jaxaot.component(lambda v: (v - v.mean(-1, keepdims=True)) * 0.5)
    ws = [jax.random.normal(jax.random.key(i), (4, 4)) * 0.5 for i in range(_whole.MIN_LOOP + 1)]
    v = jax.random.normal(jax.random.key(9), (3, 4))

    def layers(ws: Any, v: jax.Array) -> jax.Array:
        for w in ws:
            v = v + jax.nn.relu(norm(lin(w, v)))
        return v

    def other_constants(ws: Any, v: jax.Array) -> jax.Array:
        for i, w in enumerate(ws):
            v = v + jax.nn.relu(norm(lin(w, v))) * (1.0 + i)
        return v

    def older(ws: Any, v: jax.Array) -> jax.Array:
        prev = v
        for w in ws:
            v, prev = prev + jax.nn.relu(norm(lin(w, v))), v
        return v

    def called_back(ws: Any, v: jax.Array) -> jax.Array:
        for w in ws:
            h = norm(lin(w, v))
            v = v + jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(h.shape, h.dtype), h)
        return v

    n = len(ws)
    closed = jax.make_jaxpr(layers)(ws, v)
    assert _whole.program(closed.jaxpr)[1] == 2 * n  # within the cap: unrolled
    monkeypatch.setattr(_whole, "MAX_WHOLE_CALLS", 2)
    for f, calls in ((layers, 2), (other_constants, 2 * n), (older, 2 * n), (called_back, 2 * n)):
        closed = jax.make_jaxpr(f)(ws, v)
        fn, bound = _whole.program(closed.jaxpr)
        assert bound == calls, f.__name__
        close(jax.jit(fn)(*ws, v, *closed.consts)[0], f(ws, v))
    grads = _whole_jit(jax.grad(lambda ws, v: layers(ws, v).sum()), ws, v)
    close(grads, jax.grad(lambda ws, v: layers(ws, v).sum())(ws, v))


def test_haiku_linear_and_batch_norm_layers_in_a_plain_loop_run_as_one_program() -> None:
    """A Haiku train step (adam) whose layers are a Linear, a BatchNorm and a
    ReLU in a plain loop, no class of its own: its calls alternate between two
    entries, and the forward and backward periods are loops, so the step runs as
    one program (it ran split: two dozen calls, over ``MAX_WHOLE_CALLS``), with
    jax.jit's values, state and updates."""
    haiku = pytest.importorskip("haiku")
    import optax

    def forward(x: jax.Array) -> jax.Array:
        x = haiku.Linear(16)(x)
        for _ in range(_whole.MIN_LOOP + 1):
            h = haiku.BatchNorm(True, True, 0.9)(haiku.Linear(16)(x), True)
            x = x + jax.nn.relu(h)
        return haiku.Linear(2)(x)

    model = haiku.transform_with_state(forward)
    x = jax.random.normal(jax.random.key(1), (8, 4))
    params, state = model.init(jax.random.key(0), x)
    opt = optax.adam(1e-2)

    def step(params: Any, opt_state: Any, state: Any, x: jax.Array) -> Any:
        def loss(p: Any, s: Any) -> Any:
            out, s = model.apply(p, s, None, x)
            return (out**2).mean(), s

        (value, state), g = jax.value_and_grad(loss, has_aux=True)(params, state)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, value

    args = (params, opt.init(params), state, x)
    fast = jaxaot.jit(step)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        got = fast(*args)
        (plan,) = fast._plans.values()
        said = fast.explain(*args)
        assert plan.mode == _plan.WHOLE, said
        assert "its repeated layers as loops" in said, said
        assert plan.whole.result().as_text().count(" while(") >= 2
    close(got, jax.jit(step)(*args))


def test_layers_of_several_calls_updating_donated_caches_stay_unrolled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode step whose layers are several calls and glue, each updating its
    own donated cache: as for layers of one call, a loop would stack the caches
    and cut them apart again, so the calls stay one by one, with the program's
    values."""
    lin = jaxaot.component(lambda w, v: v @ w)
    norm = jaxaot.component(lambda v: v - v.mean(-1, keepdims=True))
    ws = [jnp.eye(4) * (0.5 + 0.1 * i) for i in range(_whole.MIN_LOOP + 1)]

    def decode(caches: Any, v: jax.Array) -> Any:
        new = []
        for w, cache in zip(ws, caches, strict=True):
            v = v + jax.nn.relu(norm(lin(w, v)))
            new.append(cache + v)
        return new, v

    caches = [jnp.zeros((3, 4)) for _ in ws]
    v = jax.random.normal(jax.random.key(0), (3, 4))
    closed = jax.make_jaxpr(decode)(caches, v)
    monkeypatch.setattr(_whole, "MAX_WHOLE_CALLS", 2)
    donated = tuple(range(len(caches)))
    assert _whole.looped(closed.jaxpr) and not _whole.looped(closed.jaxpr, donated)
    fn, calls = _whole.program(closed.jaxpr, donated)
    assert calls == 2 * len(ws)
    got = jax.jit(fn)(*caches, v, *closed.consts)
    close(got, jax.tree_util.tree_leaves(decode(caches, v)))
