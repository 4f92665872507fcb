"""Jaxpr rewrites of derived entries: dot_general + transpose as one swapped dot_general."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot
from jaxaot._component._rewrites import fuse_dot_transposes
from jaxaot.cli import _model


@pytest.fixture(autouse=True)
def _residuals(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the residuals forward entries write: every
    component here writes residuals, however small (see ``_cost``)."""
    monkeypatch.setenv("JAXAOT_RECOMPUTE_BELOW", "0")


def _prims(fun: Callable[..., Any], avals: Sequence[Any]) -> list[str]:
    return [e.primitive.name for e in jax.make_jaxpr(fun)(*avals).jaxpr.eqns]


def _avals(*arrays: Any) -> list[Any]:
    return [jax.typeof(a) for a in arrays]


def _weight_grad(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    # What JAX's transpose rule emits for the weight of x @ w: (g^T x)^T.
    prod = jax.lax.dot_general(g, x, (((0, 1), (0, 1)), ((), ())))
    return (prod.T,)


def test_weight_gradient_transpose_becomes_one_dot() -> None:
    x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    g = jax.random.normal(jax.random.key(1), (2, 3, 5))
    assert _prims(_weight_grad, [x, g]) == ["dot_general", "transpose"]
    fused = fuse_dot_transposes(_weight_grad, _avals(x, g))
    assert _prims(fused, [x, g]) == ["dot_general"]
    (got,) = fused(x, g)
    (want,) = _weight_grad(x, g)
    assert got.shape == (4, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_batched_swap_is_fused_and_other_permutations_are_kept() -> None:
    a = jax.random.normal(jax.random.key(0), (3, 4, 5))
    b = jax.random.normal(jax.random.key(1), (3, 5, 6))
    dims = (((2,), (1,)), ((0,), (0,)))

    def swap(a: jax.Array, b: jax.Array) -> tuple[jax.Array]:
        return (jnp.transpose(jax.lax.dot_general(a, b, dims), (0, 2, 1)),)

    def move_batch(a: jax.Array, b: jax.Array) -> tuple[jax.Array]:
        return (jnp.transpose(jax.lax.dot_general(a, b, dims), (1, 0, 2)),)

    fused = fuse_dot_transposes(swap, _avals(a, b))
    assert _prims(fused, [a, b]) == ["dot_general"]
    np.testing.assert_allclose(fused(a, b)[0], swap(a, b)[0], rtol=1e-5, atol=1e-5)
    kept = fuse_dot_transposes(move_batch, _avals(a, b))
    assert _prims(kept, [a, b]) == ["dot_general", "transpose"]
    np.testing.assert_allclose(kept(a, b)[0], move_batch(a, b)[0], rtol=1e-6)


def test_a_product_with_another_use_is_not_recomputed() -> None:
    a = jnp.ones((4, 5))
    b = jnp.ones((5, 6))

    def both(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
        prod = a @ b
        return prod.T, prod * 2

    fused = fuse_dot_transposes(both, _avals(a, b))
    assert _prims(fused, [a, b]).count("dot_general") == 1
    for got, want in zip(fused(a, b), both(a, b), strict=True):
        np.testing.assert_allclose(got, want)


def test_products_inside_jit_and_checkpoint_are_fused() -> None:
    x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    g = jax.random.normal(jax.random.key(1), (2, 3, 5))
    inner = jax.checkpoint(jax.jit(_weight_grad))
    fused = fuse_dot_transposes(inner, _avals(x, g))
    assert _prims(fused, [x, g]) == ["dot_general"]
    np.testing.assert_allclose(fused(x, g)[0], _weight_grad(x, g)[0], rtol=1e-5, atol=1e-5)


def _transposed_entry_prims(comp: jaxaot.Component[..., Any], *args: Any) -> list[str]:
    closed = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(comp(*a)), argnums=(0, 1)))(*args)
    calls = [e.params["call"] for e in closed.jaxpr.eqns if e.primitive.name == "jaxaot_component"]
    transposed = [c for c in calls if c.key.parts["transform"][-1][0] == "transpose"]
    assert len(transposed) == 1
    return [e.primitive.name for e in transposed[0].jaxpr().jaxpr.eqns]


def test_backward_entries_of_a_transformer_block_have_no_weight_transposes() -> None:
    params = _model.init_block(jax.random.key(0), 16)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    comp = jaxaot.component(_model.block)
    prims = _transposed_entry_prims(comp, params, x)
    plain = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(_model.block(p, x)), argnums=(0, 1)))(
        params, x
    )
    plain_transposes = sum(e.primitive.name == "transpose" for e in plain.jaxpr.eqns)
    # The four weight gradients (qkv, proj, up, down) lose their transposes.
    assert prims.count("transpose") <= plain_transposes - 4
    got = jax.grad(lambda p, x: jnp.sum(comp(p, x) ** 2), argnums=(0, 1))(params, x)
    want = jax.grad(lambda p, x: jnp.sum(_model.block(p, x) ** 2), argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


def test_derive_version_is_a_key_part() -> None:
    from jaxaot._component._parts import DERIVE_VERSION

    comp = jaxaot.component(lambda x: x * 2, key="derive-version")
    assert comp.cache_key(jnp.ones(3)).parts["derive"] == DERIVE_VERSION >= 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dtypes_and_per_operand_precision_are_kept(dtype: Any) -> None:
    x = jax.random.normal(jax.random.key(0), (2, 3, 4)).astype(dtype)
    g = jax.random.normal(jax.random.key(1), (2, 3, 5)).astype(dtype)
    precision = (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT)

    def grad(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
        dims = (((0, 1), (0, 1)), ((), ()))
        prod = jax.lax.dot_general(
            g, x, dims, precision=precision, preferred_element_type=jnp.float32
        )
        return (prod.T,)

    fused = fuse_dot_transposes(grad, _avals(x, g))
    (eqn,) = jax.make_jaxpr(fused)(x, g).jaxpr.eqns
    assert eqn.params["preferred_element_type"] == jnp.float32
    # The operands swapped, so their precisions swap with them.
    assert tuple(eqn.params["precision"]) == (precision[1], precision[0])
    (got,) = fused(x, g)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, grad(x, g)[0], rtol=1e-5, atol=1e-5)


def test_residuals_that_are_arithmetic_of_other_residuals_are_recomputed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jaxaot._component import _call
    from jaxaot._component._rewrites import prune_residuals

    def f(w: jax.Array, x: jax.Array) -> jax.Array:
        u = x @ w
        return 0.5 * u * (1 + jnp.tanh(0.8 * (u + 0.044715 * u**3)))  # tanh-approximate GELU

    seen: list[tuple[Any, Any, Any, Any]] = []

    def spy(known: Any, unknown: Any, n_out: int) -> tuple[Any, Any]:
        pruned = prune_residuals(known, unknown, n_out)
        seen.append((known, unknown, *pruned))
        return pruned

    monkeypatch.setattr(_call, "prune_residuals", spy)
    w = jax.random.normal(jax.random.key(0), (4, 6))
    x = jax.random.normal(jax.random.key(1), (3, 4))
    comp = jaxaot.component(f)
    got = jax.value_and_grad(lambda w, x: jnp.sum(comp(w, x) ** 2), argnums=(0, 1))(w, x)
    want = jax.value_and_grad(lambda w, x: jnp.sum(f(w, x) ** 2), argnums=(0, 1))(w, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    (known, unknown, new_known, new_unknown) = seen[0]

    def producers(closed: Any) -> list[str]:
        made = {v: e.primitive.name for e in closed.jaxpr.eqns for v in e.outvars}
        return [made.get(v, "input") for v in closed.jaxpr.outvars[1:]]

    before, after = producers(known), producers(new_known)
    # 1 + tanh(.) and 1 - tanh(.)**2 are read back no more: recomputed from tanh(.).
    assert len(after) < len(before), (before, after)
    assert "tanh" in after and "add" in before and "add" not in after
    assert len(new_unknown.in_avals) == len(unknown.in_avals) - (len(before) - len(after))
    # Pruned again, nothing changes: the same jaxprs come back.
    assert prune_residuals(new_known, new_unknown, 1) == (new_known, new_unknown)


def test_benchmark_block_writes_the_same_residuals_on_every_jax() -> None:
    """The MLP of the benchmark block leaves two residuals of its hidden size
    (the pre-activation and ``tanh`` of it), whichever primitives the installed
    JAX writes tanh's derivative with (0.11.2+: ``one_minus_square``)."""
    from jaxaot._component._rewrites import prune_residuals
    from jaxaot._jax import jaxpr_as_fun, partial_eval_jaxpr
    from jaxaot.cli import _model

    batch, seq, width = 2, 4, 16
    params = _model.init_block(jax.random.key(0), width)
    x = jax.random.normal(jax.random.key(1), (batch, seq, width))
    primals, tree = jax.tree_util.tree_flatten((params, x))
    n = len(primals)

    def jvp_fn(*xs: jax.Array) -> tuple[jax.Array, jax.Array]:
        p = jax.tree_util.tree_unflatten(tree, xs[:n])
        t = jax.tree_util.tree_unflatten(tree, xs[n:])
        return jax.jvp(lambda a, b: _model.block(a, b), p, t)

    closed = jax.make_jaxpr(jvp_fn)(*primals, *primals)
    known, unknown, _, _ = partial_eval_jaxpr(closed, [False] * n + [True] * n, [False, True])
    new_known, new_unknown = prune_residuals(known, unknown, 1)
    hidden = (batch, seq, 4 * width)
    before = [a for a in known.out_avals[1:] if a.shape == hidden]
    after = [a for a in new_known.out_avals[1:] if a.shape == hidden]
    assert len(before) > 2 and len(after) == 2, (before, after)

    def nbytes(avals: Any) -> int:
        return sum(a.size * a.dtype.itemsize for a in avals)

    assert nbytes(new_known.out_avals) < nbytes(known.out_avals)
    # The same primal output and tangents, from fewer residuals.
    tangents = [jnp.full_like(p, 0.25) for p in primals]
    old = jaxpr_as_fun(known)(*primals)
    new = jaxpr_as_fun(new_known)(*primals)
    np.testing.assert_allclose(new[0], old[0], rtol=1e-6)
    want = jaxpr_as_fun(unknown)(*old[1:], *tangents)
    got = jaxpr_as_fun(new_unknown)(*new[1:], *tangents)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_forward_entries_return_no_copy_of_their_own_inputs(tmp_path: Any) -> None:
    """The backward pass of ``tanh(v @ w)`` multiplies by ``w`` and ``v``: they are
    residuals. The forward entry returns only the residual it computes (from
    tanh), not a copy of its inputs, and says where ``w`` and ``v`` go among the
    residuals. The fact is kept with the entry: a warm process reads the same,
    and the gradients are ``jax.grad``'s."""
    from jaxaot._component._rewrites import forwarded_inputs

    def f(w: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.tanh(v @ w)

    w = jnp.arange(16.0).reshape(4, 4) / 20
    v = jnp.arange(8.0).reshape(2, 4) / 10
    known = jax.make_jaxpr(lambda w, v: (f(w, v), w, jnp.tanh(v @ w), v))(w, v)
    assert forwarded_inputs(known, 1) == [[1, 0], [3, 1]]
    want = jax.grad(lambda w, v: jnp.sum(f(w, v)), argnums=(0, 1))(w, v)

    def forward_entry() -> Any:
        layer = jaxaot.component(f, key="forwards-layer")

        def grab(w: jax.Array, v: jax.Array) -> jax.Array:
            return jnp.sum(layer(w, v))

        closed = jax.make_jaxpr(jax.grad(grab, argnums=(0, 1)))(w, v)
        (entry,) = [
            eqn.params["call"].entry
            for eqn in closed.jaxpr.eqns
            if "call" in eqn.params and "forwarded" in eqn.params["call"].entry.extra
        ]
        for got, expected in zip(jax.grad(grab, argnums=(0, 1))(w, v), want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-6)
        return entry

    with jaxaot.using_cache(jaxaot.DirectoryCache(tmp_path)):
        cold = forward_entry()
        warm = forward_entry()
    # Residuals 0 and 1 are inputs 0 and 1 (w, v); the entry returns its output
    # and the residual computed from tanh, nothing of the size of w.
    assert cold.extra["forwarded"] == warm.extra["forwarded"] == [[0, 0], [1, 1]]
    assert [a.shape for a in cold.out_avals] == [(2, 4), (2, 4)]


def test_pruned_residuals_come_in_the_same_order_in_every_trace() -> None:
    """The residuals a forward entry writes are the inputs of a linear entry that
    another process may derive again from its own trace: their order follows from
    the program alone. (It followed the addresses of the program's variables: a
    warm process on jax 0.12 derived a linear entry that did not fit the forward
    entry it loaded, and jaxaot.jit fell back to jax.jit.)"""
    from jaxaot._component._rewrites import prune_residuals
    from jaxaot._jax import partial_eval_jaxpr

    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        y = x + jnp.tanh(x @ w)
        return y / jnp.sqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-5)

    w, x = jnp.eye(16) / 4, jnp.ones((16, 16))

    def layout() -> list[str]:
        closed = jax.make_jaxpr(lambda *a: jax.jvp(layer, a[:2], a[2:]))(w, x, w, x)
        known, unknown, _, _ = partial_eval_jaxpr(closed, [False, False, True, True], [False, True])
        pruned, _ = prune_residuals(known, unknown, 1)
        assert pruned is not known  # (it prunes some)
        producers = {v: e.primitive.name for e in pruned.jaxpr.eqns for v in e.outvars}
        return [f"{producers.get(v, 'in')}:{v.aval.str_short()}" for v in pruned.jaxpr.outvars]

    first = layout()
    padding = []
    for i in range(40):  # other addresses for the variables of each trace
        padding.append([object() for _ in range(i * 7)])
        assert layout() == first


def test_a_linear_entry_is_not_derived_for_a_forward_entry_of_another_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forward entry says how it saves its residuals; a linear entry derived in a
    process that would read them in another layout is refused (an error, never
    wrong gradients from residuals in each other's places)."""
    from jaxaot._component import _call

    layouts = iter(["made", "derived"])
    monkeypatch.setattr(_call, "residual_layout", lambda known, n: next(layouts))

    @jaxaot.component
    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w).sum()

    w, x = jnp.eye(4), jnp.ones((2, 4))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        with pytest.raises(RuntimeError, match="another layout"):
            jax.grad(layer)(w, x)
