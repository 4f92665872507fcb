"""The chains of layers in a split program (``jaxaot._regional._chains``): runs
of one entry and repeated sequences of equations, and the loops the whole
program makes of them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _steps import close

import jaxaot
from jaxaot._regional import _chains, _whole


def test_runs_of_one_entry_become_one_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chained calls of one entry are a run; a call of another entry, or one that
    reads an older member's output, ends it. (Here runs of 3 are loops.)"""
    monkeypatch.setattr(_whole, "MIN_LOOP", 3)
    a = jaxaot.component(lambda w, v: jnp.tanh(v @ w))
    b = jaxaot.component(lambda w, v: jnp.sin(v @ w))
    w = jnp.eye(3) * 0.5

    def f(v: jax.Array) -> jax.Array:
        h1 = a(w, v)
        h2 = a(w, h1)
        h3 = a(w, h2)
        h4 = b(w, h3)
        return a(w, h4 + h1)  # reads h1: not chained to the run above

    v = jnp.ones((2, 3))
    jaxpr = jax.make_jaxpr(f)(v).jaxpr
    items = _chains.runs(jaxpr.eqns)
    kinds = [len(i.eqns) if isinstance(i, _chains.Run) else i.primitive.name for i in items]
    assert kinds == [3, "jaxaot_component", "add", "jaxaot_component"], kinds
    fn, calls = _whole.program(jaxpr)
    assert calls == 3
    consts = jax.make_jaxpr(f)(v).consts
    close(jax.jit(fn)(v, *consts)[0], f(v))


def test_a_run_goes_on_past_equations_that_read_nothing_it_makes() -> None:
    """A value built between two layers from the program's inputs alone (autodiff's
    zero cotangents between backward layers) does not end the run: it is made
    before the loop. One that reads a layer's output does end it; the layer and
    that glue, repeated, are then a loop of periods of two equations."""
    layer = jaxaot.component(lambda w, z, v: jnp.tanh(v @ w) + z)
    w = jnp.eye(3) * 0.5

    def free(v: jax.Array, s: jax.Array) -> jax.Array:
        for i in range(5):
            v = layer(w, jnp.full((2, 3), s * (i + 1)), v)
        return v

    def bound(v: jax.Array, s: jax.Array) -> jax.Array:
        for _ in range(5):
            v = layer(w, v * s, v)
        return v

    args = (jnp.ones((2, 3)), jnp.float32(0.1))
    for f, looped in ((free, True), (bound, False)):
        closed = jax.make_jaxpr(f)(*args)
        items = _chains.runs(closed.jaxpr.eqns)
        lengths = [len(i.eqns) for i in items if isinstance(i, _chains.Run)]
        assert lengths == ([5] if looped else []), (f.__name__, lengths)
        if not looped:
            (run,) = _chains.periods(items, _whole.MIN_LOOP)
            assert [len(group.eqns) for group in run.eqns] == [2] * 5
        fn, calls = _whole.program(closed.jaxpr)
        assert calls == (1 if looped else 5)
        close(jax.jit(fn)(*args, *closed.consts)[0], f(*args))
