"""Tests for jaxaot._rules: the ``jaxaot_component`` primitive under transformations.

Every test compares a component against the plain function it wraps, and counts
how many times the Python body ran (a list appended to in the body, and
``Component.cache_info().traces``). "Cached" tests make a second component with
the same explicit ``key=`` whose body raises: it can only give the right answer
if every entry it needs (including derived vmap/JVP/transpose entries) comes
from the active cache.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import checkify, io_callback
from jax.test_util import check_grads

import jaxaot
from jaxaot._store import _entry

RTOL = 1e-5
ATOL = 1e-5


@pytest.fixture(autouse=True)
def cache() -> Any:
    """A fresh in-memory cache for every test, so no test sees another's entries."""
    c = jaxaot.MemoryCache()
    with jaxaot.using_cache(c):
        yield c


def make(fn: Callable[..., Any], key: str) -> tuple[jaxaot.Component[..., Any], list[int]]:
    """A component of ``fn`` with an explicit key, and a list that grows per body run."""
    calls: list[int] = []

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fn(*args, **kwargs)

    return jaxaot.component(body, key=key), calls


def raising(fn: Callable[..., Any], key: str) -> jaxaot.Component[..., Any]:
    """A component with ``fn``'s signature and ``key`` whose body must never run."""

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the body of a cached component was traced")

    return jaxaot.component(body, key=key)


def assert_tree_close(got: Any, want: Any) -> None:
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape
        assert g.dtype == w.dtype
        if w.dtype == jax.dtypes.float0:
            continue
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def arange(*shape: int, dtype: Any = np.float32, start: float = 0.3) -> np.ndarray:
    n = int(np.prod(shape))
    return (start + 0.17 * np.arange(n, dtype=np.float64)).reshape(shape).astype(dtype)


def cached_entries(cache: jaxaot.MemoryCache) -> list[_entry.Entry]:
    return [_entry.decode(cache.get(k)) for k in cache.keys()]


# ----------------------------------------------------------------------------
# vmap


def f_tree(p: dict[str, Any], x: Any) -> tuple[Any, Any]:
    """Output 0 depends on w, b and x; output 1 depends on b and x only."""
    return jnp.tanh(p["w"] * x + p["b"]), jnp.sum(x**2) * p["b"]


def p_of(w: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    return {"w": w, "b": b}


B = 2  # batch size
N = 3  # feature size

VMAP_CASES = {
    # name: (in_axes, out_axes, args)
    "x0": ((None, 0), 0, (p_of(arange(N), arange(N, start=-0.2)), arange(B, N))),
    "all0": (0, 0, (p_of(arange(B, N), arange(B, N, start=-0.4)), arange(B, N, start=0.1))),
    "x_neg": ((None, -1), 0, (p_of(arange(N), arange(N, start=-0.2)), arange(N, B))),
    "x_nonleading": ((None, 1), 0, (p_of(arange(N), arange(N, start=-0.2)), arange(N, B))),
    "dict_axes": (
        ({"w": 0, "b": None}, 1),
        0,
        (p_of(arange(B, N), arange(N, start=-0.2)), arange(N, B)),
    ),
    "dict_neg_axes": (
        ({"w": -1, "b": 0}, None),
        0,
        (p_of(arange(N, B), arange(B, N, start=-0.2)), arange(N)),
    ),
    "out1": ((None, 0), 1, (p_of(arange(N), arange(N, start=-0.2)), arange(B, N))),
    "out_neg": ((0, 0), -1, (p_of(arange(B, N), arange(B, N)), arange(B, N, start=0.5))),
    "out_per_output": (
        ({"w": 0, "b": None}, 1),
        (1, 0),
        (p_of(arange(B, N), arange(N, start=-0.2)), arange(N, B)),
    ),
    # Only w is batched: output 1 does not depend on it and may stay unmapped.
    "out_unbatched": (
        ({"w": 0, "b": None}, None),
        (1, None),
        (p_of(arange(B, N), arange(N, start=-0.2)), arange(N)),
    ),
}


@pytest.mark.parametrize("case", list(VMAP_CASES))
def test_vmap_matches_plain(case: str) -> None:
    in_axes, out_axes, args = VMAP_CASES[case]
    comp, calls = make(f_tree, key=f"vmap-{case}")
    got = jax.vmap(comp, in_axes=in_axes, out_axes=out_axes)(*args)
    want = jax.vmap(f_tree, in_axes=in_axes, out_axes=out_axes)(*args)
    assert_tree_close(got, want)
    assert len(calls) == 1
    assert comp.cache_info().traces == 1


@pytest.mark.parametrize(
    "case", ["x0", "x_neg", "dict_axes", "out_neg", "out_per_output", "out_unbatched"]
)
def test_vmap_inside_jit(case: str) -> None:
    in_axes, out_axes, args = VMAP_CASES[case]
    comp, calls = make(f_tree, key=f"vmapjit-{case}")
    got = jax.jit(jax.vmap(comp, in_axes=in_axes, out_axes=out_axes))(*args)
    want = jax.vmap(f_tree, in_axes=in_axes, out_axes=out_axes)(*args)
    assert_tree_close(got, want)
    assert len(calls) == 1


@pytest.mark.parametrize("case", ["x0", "dict_axes", "out_per_output"])
def test_jit_inside_vmap(case: str) -> None:
    in_axes, out_axes, args = VMAP_CASES[case]
    comp, calls = make(f_tree, key=f"jitvmap-{case}")
    got = jax.vmap(jax.jit(lambda p, x: comp(p, x)), in_axes=in_axes, out_axes=out_axes)(*args)
    want = jax.vmap(f_tree, in_axes=in_axes, out_axes=out_axes)(*args)
    assert_tree_close(got, want)
    assert len(calls) == 1


def test_vmap_unbatched_output_stays_unbatched() -> None:
    def f(x: Any, y: Any) -> tuple[Any, Any]:
        return jnp.sin(x) * 2.0, jnp.cos(y) + 1.0

    comp, _ = make(f, key="unbatched")
    x, y = arange(B, N), arange(N, start=-0.5)
    got = jax.vmap(comp, in_axes=(0, None), out_axes=(0, None))(x, y)
    want = jax.vmap(f, in_axes=(0, None), out_axes=(0, None))(x, y)
    assert_tree_close(got, want)
    assert got[1].shape == (N,)
    # Also inside jit, and with the roles of the arguments swapped.
    got = jax.jit(jax.vmap(comp, in_axes=(None, 0), out_axes=(None, 0)))(y, x)
    want = jax.vmap(f, in_axes=(None, 0), out_axes=(None, 0))(y, x)
    assert_tree_close(got, want)


def _independent_loop(x: Any, y: Any) -> tuple[Any, Any]:
    return lax.fori_loop(0, 3, lambda i, c: (c[0] * 1.1, c[1] + 1.0), (x, y))


_split_helper = jax.jit(lambda x, y: (jnp.sin(x), jnp.cos(y)))


def _independent_jit(x: Any, y: Any) -> tuple[Any, Any]:
    return _split_helper(x, y)


def _independent_cond(x: Any, y: Any) -> tuple[Any, Any]:
    return lax.cond(jnp.sum(y) > 0, lambda a, b: (a * 2.0, b), lambda a, b: (-a, b * 3.0), x, y)


@pytest.mark.parametrize(
    "fn", [_independent_loop, _independent_jit], ids=["fori_loop_carry", "inner_jit"]
)
def test_vmap_unbatched_output_through_subcomputation(fn: Callable[..., Any]) -> None:
    """Plain JAX keeps output 1 unbatched (it depends only on y, which is not
    batched) even though both outputs come out of one multi-output equation;
    so must the component."""
    comp, _ = make(fn, key=f"unbatched-sub-{fn.__name__}")
    x, y = arange(B, N), arange(N, start=-0.5)
    want = jax.vmap(fn, in_axes=(0, None), out_axes=(0, None))(x, y)
    got = jax.vmap(comp, in_axes=(0, None), out_axes=(0, None))(x, y)
    assert_tree_close(got, want)


def test_vmap_unbatched_predicate_output() -> None:
    """Output 1 depends on y only (through the predicate too): unbatched when only x is."""
    comp, _ = make(_independent_cond, key="unbatched-cond")
    x, y = arange(B, N), arange(N, start=-0.5)
    want = jax.vmap(_independent_cond, in_axes=(0, None), out_axes=(0, None))(x, y)
    got = jax.vmap(comp, in_axes=(0, None), out_axes=(0, None))(x, y)
    assert_tree_close(got, want)


def f_odd_outputs(x: Any, s: Any) -> dict[str, Any]:
    """A passthrough, a constant, a Python literal and a scalar-input output."""
    return {"same": x, "const": jnp.ones(2), "lit": 1.5, "scaled": x * s + jnp.sin(s)}


ODD_TRANSFORMS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "call": lambda f: f(arange(N), np.float32(0.7)),
    "vmap_x": lambda f: jax.vmap(f, in_axes=(0, None))(arange(B, N), np.float32(0.7)),
    "vmap_s": lambda f: jax.vmap(f, in_axes=(None, 0))(arange(N), arange(B)),
    "vmap_s_out1": lambda f: jax.vmap(
        f, in_axes=(None, 0), out_axes={"same": None, "const": None, "lit": None, "scaled": 1}
    )(arange(N), arange(B)),
    "grad": lambda f: jax.grad(
        lambda x, s: sum(jnp.sum(v) for v in jax.tree_util.tree_leaves(f(x, s))), argnums=(0, 1)
    )(arange(N), np.float32(0.7)),
    "jvp": lambda f: jax.jvp(f, (arange(N), np.float32(0.7)), (arange(N), np.float32(2.0))),
    "vjp": lambda f: jax.vjp(f, arange(N), np.float32(0.7))[1](
        {"same": arange(N), "const": arange(2), "lit": np.float32(1.0), "scaled": arange(N)}
    ),
    "jit_vmap_grad": lambda f: jax.jit(
        jax.vmap(jax.grad(lambda x, s: jnp.sum(f(x, s)["scaled"] * f(x, s)["same"]), argnums=1))
    )(arange(B, N), arange(B)),
}


@pytest.mark.parametrize("name", list(ODD_TRANSFORMS))
def test_passthrough_constant_and_scalar_outputs(name: str) -> None:
    comp, calls = make(f_odd_outputs, key=f"odd-{name}")
    # Compared with jax.jit of the function: like it, a component returns the
    # Python literal as a (weakly typed) float32 array.
    assert_tree_close(ODD_TRANSFORMS[name](comp), ODD_TRANSFORMS[name](jax.jit(f_odd_outputs)))
    assert len(calls) == 1


def test_kwargs_and_static_args_under_transformations() -> None:
    calls: list[int] = []

    def f(x: Any, n: int, *, y: Any) -> Any:
        calls.append(1)
        return jnp.sin(x) ** n * y

    comp = jaxaot.component(f, key="kw-static", static_argnums=1)

    def use(fn: Callable[..., Any]) -> Any:
        x, y = arange(B, N), arange(N, start=0.4)
        return (
            jax.vmap(lambda x: fn(x, 2, y=y))(x),
            jax.vmap(lambda y: fn(x[0], 3, y=y), in_axes=1, out_axes=1)(x.T),
            jax.grad(lambda x, y: jnp.sum(fn(x, 2, y=y)), argnums=(0, 1))(x[0], y),
        )

    def plain(x: Any, n: int, *, y: Any) -> Any:
        return jnp.sin(x) ** n * y

    assert_tree_close(use(comp), use(plain))
    assert len(calls) == 2  # one per static value


@pytest.mark.parametrize("jit", [False, True])
def test_nested_vmap(jit: bool) -> None:
    comp, calls = make(f_tree, key="nested")
    b1, b2 = 2, 4
    p = p_of(arange(b2, N), arange(N, start=-0.3))
    x = arange(b1, b2, N, start=0.05)
    inner_axes = (None, 0)  # over b1 (x's axis 0 after the outer map removes b2)
    outer_axes = ({"w": 0, "b": None}, 1)  # over b2

    def nest(f: Callable[..., Any]) -> Callable[..., Any]:
        return jax.vmap(jax.vmap(f, in_axes=inner_axes, out_axes=(0, 1)), in_axes=outer_axes)

    run = jax.jit(nest(comp)) if jit else nest(comp)
    assert_tree_close(run(p, x), nest(f_tree)(p, x))
    assert len(calls) == 1


@pytest.mark.parametrize("case", ["x0", "dict_axes", "out_per_output", "out_unbatched"])
@pytest.mark.parametrize("jit", [False, True])
def test_vmap_entry_is_cached(case: str, jit: bool) -> None:
    in_axes, out_axes, args = VMAP_CASES[case]
    key = f"vmap-cached-{case}-{jit}"
    comp, calls = make(f_tree, key=key)

    def run(c: Any) -> Any:
        g = jax.vmap(c, in_axes=in_axes, out_axes=out_axes)
        return (jax.jit(g) if jit else g)(*args)

    first = run(comp)
    assert len(calls) == 1
    again = raising(f_tree, key=key)
    second = run(again)
    assert_tree_close(second, first)
    assert_tree_close(second, jax.vmap(f_tree, in_axes=in_axes, out_axes=out_axes)(*args))
    assert again.cache_info().traces == 0
    assert again.cache_info().misses == 0


# ----------------------------------------------------------------------------
# Autodiff


def f_scalar(x: Any, y: Any) -> Any:
    return jnp.sum(jnp.sin(x) * y) + jnp.sum(x**3) * jnp.cos(y[0])


def f_vec(x: Any, y: Any) -> Any:
    return jnp.tanh(x * y) + x**2


XY = (arange(N, start=0.2), arange(N, start=-0.6))

AD_TRANSFORMS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "grad": lambda f: jax.grad(f_sum(f), argnums=(0, 1))(*XY),
    "grad_arg1": lambda f: jax.grad(f_sum(f), argnums=1)(*XY),
    "value_and_grad": lambda f: jax.value_and_grad(f_sum(f))(*XY),
    "jvp": lambda f: jax.jvp(f, XY, (np.ones(N, np.float32), arange(N, start=-1.0))),
    "jvp_one_tangent": lambda f: jax.jvp(lambda x: f(x, XY[1]), (XY[0],), (arange(N),)),
    "vjp": lambda f: jax.vjp(f, *XY)[1](arange(N, start=0.7)),
    "linearize": lambda f: jax.linearize(f, *XY)[1](arange(N), arange(N, start=0.4)),
    "hessian": lambda f: jax.hessian(f_sum(f), argnums=(0, 1))(*XY),
    "grad_of_grad": lambda f: jax.grad(lambda x, y: jnp.sum(jax.grad(f_sum(f))(x, y)))(*XY),
    "jacfwd": lambda f: jax.jacfwd(f)(*XY),
    "jacrev": lambda f: jax.jacrev(f, argnums=1)(*XY),
    "jit_grad": lambda f: jax.jit(jax.grad(f_sum(f)))(*XY),
    "grad_jit": lambda f: jax.grad(jax.jit(f_sum(f)))(*XY),
    "vmap_grad": lambda f: jax.vmap(jax.grad(f_sum(f)), in_axes=(0, None))(
        arange(B, N, start=0.1), XY[1]
    ),
    "grad_vmap": lambda f: jax.grad(
        lambda x, y: jnp.sum(jax.vmap(f, in_axes=(0, None))(x, y) ** 2)
    )(arange(B, N, start=0.1), XY[1]),
}


def f_sum(f: Callable[..., Any]) -> Callable[..., Any]:
    return lambda x, y: jnp.sum(f(x, y) ** 2)


@pytest.mark.parametrize("name", list(AD_TRANSFORMS))
def test_autodiff_matches_plain(name: str) -> None:
    comp, calls = make(f_vec, key=f"ad-{name}")
    got = AD_TRANSFORMS[name](comp)
    want = AD_TRANSFORMS[name](f_vec)
    assert_tree_close(got, want)
    assert len(calls) == 1


@pytest.mark.parametrize("fn", [f_scalar, f_vec], ids=["scalar", "vector"])
def test_check_grads(fn: Callable[..., Any]) -> None:
    comp, calls = make(fn, key=f"check-grads-{fn.__name__}")
    x, y = XY
    x, y = x.astype(np.float64), y.astype(np.float64)
    with jax.enable_x64(True):
        check_grads(comp, (x, y), order=2, modes=("fwd", "rev"))
    assert len(calls) == 1


def test_grad_scalar_and_hessian() -> None:
    comp, calls = make(f_scalar, key="scalar")
    assert_tree_close(jax.grad(comp, argnums=(0, 1))(*XY), jax.grad(f_scalar, argnums=(0, 1))(*XY))
    assert_tree_close(jax.hessian(comp)(*XY), jax.hessian(f_scalar)(*XY))
    assert_tree_close(jax.jacrev(jax.grad(comp))(*XY), jax.jacrev(jax.grad(f_scalar))(*XY))
    assert len(calls) == 1


def f_mixed(x: Any, n: Any) -> tuple[Any, Any]:
    """A float and an integer input, a float and an integer output."""
    return jnp.sin(x) * n.astype(x.dtype) + x**2, n * 2 + 1


XN = (arange(N, start=0.4), np.array([1, 2, 3], dtype=np.int32))


def _float0(a: Any) -> np.ndarray:
    return np.zeros(np.shape(a), dtype=jax.dtypes.float0)


MIXED_TRANSFORMS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "grad": lambda f: jax.grad(lambda x, n: jnp.sum(f(x, n)[0]))(*XN),
    "grad_int_arg": lambda f: jax.grad(
        lambda x, n: jnp.sum(f(x, n)[0]), argnums=(0, 1), allow_int=True
    )(*XN),
    "grad_has_aux": lambda f: jax.grad(
        lambda x, n: (jnp.sum(f(x, n)[0]), f(x, n)[1]), has_aux=True
    )(*XN),
    "jvp_float0": lambda f: jax.jvp(f, XN, (arange(N, start=1.0), _float0(XN[1]))),
    "vjp": lambda f: jax.vjp(f, *XN)[1]((arange(N, start=0.9), _float0(XN[1]))),
    "hessian": lambda f: jax.hessian(lambda x, n: jnp.sum(f(x, n)[0] ** 2))(*XN),
    "vmap_grad": lambda f: jax.vmap(jax.grad(lambda x, n: jnp.sum(f(x, n)[0])))(
        arange(B, N), np.arange(B * N, dtype=np.int32).reshape(B, N)
    ),
    "jit_value_and_grad": lambda f: jax.jit(
        jax.value_and_grad(lambda x, n: jnp.sum(f(x, n)[0] * f(x, n)[1]))
    )(*XN),
}


@pytest.mark.parametrize("name", list(MIXED_TRANSFORMS))
def test_integer_inputs_and_outputs(name: str) -> None:
    comp, calls = make(f_mixed, key=f"mixed-{name}")
    got = MIXED_TRANSFORMS[name](comp)
    want = MIXED_TRANSFORMS[name](f_mixed)
    assert_tree_close(got, want)
    assert len(calls) == 1


def test_integer_check_grads() -> None:
    comp, _ = make(f_mixed, key="mixed-check")
    n = XN[1]
    with jax.enable_x64(True):
        check_grads(
            lambda x: comp(x, n)[0], (XN[0].astype(np.float64),), order=2, modes=("fwd", "rev")
        )


CACHED_AD = [
    "grad",
    "value_and_grad",
    "jvp",
    "vjp",
    "linearize",
    "hessian",
    "jit_grad",
    "vmap_grad",
    "grad_vmap",
]


@pytest.mark.parametrize("name", CACHED_AD)
def test_derived_autodiff_entries_are_cached(name: str) -> None:
    key = f"ad-cached-{name}"
    comp, calls = make(f_vec, key=key)
    first = AD_TRANSFORMS[name](comp)
    assert len(calls) == 1
    again = raising(f_vec, key=key)
    second = AD_TRANSFORMS[name](again)
    assert_tree_close(second, first)
    assert_tree_close(second, AD_TRANSFORMS[name](f_vec))
    assert again.cache_info().traces == 0
    assert again.cache_info().misses == 0


def test_mixed_derived_entries_are_cached() -> None:
    comp, _ = make(f_mixed, key="mixed-cached")
    first = MIXED_TRANSFORMS["jvp_float0"](comp), MIXED_TRANSFORMS["grad"](comp)
    again = raising(f_mixed, key="mixed-cached")
    second = MIXED_TRANSFORMS["jvp_float0"](again), MIXED_TRANSFORMS["grad"](again)
    assert_tree_close(second, first)
    assert again.cache_info().traces == 0


def test_body_traced_once_for_many_transformations() -> None:
    comp, calls = make(f_scalar, key="many")
    x, y = XY
    xb = arange(B, N, start=0.1)
    assert_tree_close(comp(x, y), f_scalar(x, y))
    assert_tree_close(
        jax.vmap(comp, in_axes=(0, None))(xb, y), jax.vmap(f_scalar, (0, None))(xb, y)
    )
    assert_tree_close(jax.grad(comp)(x, y), jax.grad(f_scalar)(x, y))
    assert_tree_close(jax.hessian(comp)(x, y), jax.hessian(f_scalar)(x, y))
    assert_tree_close(jax.jit(jax.grad(comp))(x, y), jax.grad(f_scalar)(x, y))
    assert_tree_close(
        jax.vmap(jax.hessian(comp), in_axes=(0, None))(xb, y),
        jax.vmap(jax.hessian(f_scalar), in_axes=(0, None))(xb, y),
    )
    assert comp.cache_info().traces == 1
    assert len(calls) == 1


# ----------------------------------------------------------------------------
# Control flow and nesting


def step(c: Any, x: Any) -> Any:
    return jnp.tanh(c * x + 0.5) + 0.1 * c


XS = arange(4, N, start=-0.3)  # four scan steps
C0 = arange(N, start=0.25)

CONTROL: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "scan": lambda f: lambda c, xs: lax.scan(lambda c, x: (f(c, x), jnp.sum(c)), c, xs),
    "cond_true": lambda f: (
        lambda c, xs: lax.cond(jnp.sum(c) > 0, lambda c: f(c, xs[0]), lambda c: -c, c)
    ),
    "cond_false": lambda f: (
        lambda c, xs: lax.cond(jnp.sum(c) < 0, lambda c: f(c, xs[0]), lambda c: -c, c)
    ),
    "fori_loop": lambda f: (
        lambda c, xs: lax.fori_loop(0, 3, lambda i, c: f(c, jnp.asarray(xs)[i]), c)
    ),
    "while_loop": lambda f: (
        lambda c, xs: lax.while_loop(
            lambda s: s[0] < 3, lambda s: (s[0] + 1, f(s[1], jnp.asarray(xs)[s[0]])), (0, c)
        )[1]
    ),
    "checkpoint": lambda f: lambda c, xs: jax.checkpoint(lambda c: f(f(c, xs[0]), xs[1]))(c),
    "checkpoint_in_scan": lambda f: (
        lambda c, xs: lax.scan(jax.checkpoint(lambda c, x: (f(c, x), None)), c, xs)[0]
    ),
}

DIFFERENTIABLE = [
    "scan",
    "cond_true",
    "cond_false",
    "fori_loop",
    "checkpoint",
    "checkpoint_in_scan",
]


def _loss(g: Callable[..., Any]) -> Callable[..., Any]:
    return lambda c, xs: sum(jnp.sum(leaf**2) for leaf in jax.tree_util.tree_leaves(g(c, xs)))


@pytest.mark.parametrize("name", list(CONTROL))
@pytest.mark.parametrize("jit", [False, True])
def test_control_flow(name: str, jit: bool) -> None:
    comp, calls = make(step, key=f"control-{name}")
    g = CONTROL[name](comp)
    got = (jax.jit(g) if jit else g)(C0, XS)
    assert_tree_close(got, CONTROL[name](step)(C0, XS))
    assert len(calls) == 1


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_grad_through_control_flow(name: str) -> None:
    comp, calls = make(step, key=f"control-grad-{name}")
    got = jax.grad(_loss(CONTROL[name](comp)), argnums=(0, 1))(C0, XS)
    want = jax.grad(_loss(CONTROL[name](step)), argnums=(0, 1))(C0, XS)
    assert_tree_close(got, want)
    assert len(calls) == 1


@pytest.mark.parametrize("name", ["scan", "fori_loop", "checkpoint", "cond_true"])
def test_vmap_of_control_flow(name: str) -> None:
    comp, calls = make(step, key=f"control-vmap-{name}")
    c0 = arange(B, N, start=0.2)
    got = jax.vmap(CONTROL[name](comp), in_axes=(0, None))(c0, XS)
    want = jax.vmap(CONTROL[name](step), in_axes=(0, None))(c0, XS)
    assert_tree_close(got, want)
    assert len(calls) == 1


def test_check_grads_through_scan_and_checkpoint() -> None:
    comp, _ = make(step, key="control-check")
    g = CONTROL["checkpoint_in_scan"](comp)
    with jax.enable_x64(True):
        check_grads(
            g, (C0.astype(np.float64), XS[:2].astype(np.float64)), order=2, modes=("fwd", "rev")
        )


def inner_fn(a: Any, b: Any) -> Any:
    return jnp.sin(a) * b + a


def make_nested(key: str) -> tuple[Any, list[int], Any, list[int], Callable[..., Any]]:
    inner, inner_calls = make(inner_fn, key=key + "-inner")

    def outer_fn(x: Any, y: Any) -> Any:
        return inner(inner(x, y), y * 2.0) + inner(y, x)

    def plain(x: Any, y: Any) -> Any:
        return inner_fn(inner_fn(x, y), y * 2.0) + inner_fn(y, x)

    outer, outer_calls = make(outer_fn, key=key + "-outer")
    return inner, inner_calls, outer, outer_calls, plain


NESTED: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "call": lambda f: f(*XY),
    "jit": lambda f: jax.jit(f)(*XY),
    "grad": lambda f: jax.grad(f_sum(f), argnums=(0, 1))(*XY),
    "vmap": lambda f: jax.vmap(f, in_axes=(0, None))(arange(B, N), XY[1]),
    "vmap_out1": lambda f: jax.vmap(f, in_axes=(None, 1), out_axes=1)(XY[0], arange(N, B)),
    "jit_vmap_grad": lambda f: jax.jit(jax.vmap(jax.grad(f_sum(f)), in_axes=(0, None)))(
        arange(B, N), XY[1]
    ),
    "hessian": lambda f: jax.hessian(f_sum(f))(*XY),
    "jvp": lambda f: jax.jvp(f, XY, (arange(N), arange(N, start=1.0))),
}


@pytest.mark.parametrize("name", list(NESTED))
def test_component_calling_component(name: str) -> None:
    inner, inner_calls, outer, outer_calls, plain = make_nested(f"nested-{name}")
    assert_tree_close(NESTED[name](outer), NESTED[name](plain))
    assert len(outer_calls) == 1
    assert len(inner_calls) == 1  # one signature of inner, however often it is called


def test_nested_components_cached() -> None:
    _, _, outer, _, plain = make_nested("nested-cached")
    first = NESTED["jit_vmap_grad"](outer), NESTED["grad"](outer)
    inner2 = raising(inner_fn, key="nested-cached-inner")

    @functools.wraps(plain)
    def outer2_fn(x: Any, y: Any) -> Any:
        raise NotImplementedError

    outer2 = jaxaot.component(outer2_fn, key="nested-cached-outer")
    second = NESTED["jit_vmap_grad"](outer2), NESTED["grad"](outer2)
    assert_tree_close(second, first)
    assert outer2.cache_info().traces == 0
    assert inner2.cache_info().traces == 0


# ----------------------------------------------------------------------------
# Inside jax.jit: one linked function, N call sites


def f_unary(x: Any) -> Any:
    return jnp.sin(x) * 2.0 + 1.0


def _calls_n(f: Callable[..., Any], n: int) -> Callable[..., Any]:
    def g(x: Any) -> Any:
        for _ in range(n):
            x = f(x)
        return x

    return g


def _linked(text: str) -> tuple[list[str], dict[str, int]]:
    privates = re.findall(r"func\.func private @([\w$.-]+)", text)
    mine = [s for s in privates if "jaxaot" in s]
    return mine, {s: len(re.findall(rf"call @{re.escape(s)}\(", text)) for s in mine}


@pytest.mark.parametrize("n", [1, 5])
def test_jit_links_one_function_n_calls(n: int) -> None:
    comp, calls = make(f_unary, key=f"jit-link-{n}")
    x = arange(N)
    g = _calls_n(comp, n)
    text = jax.jit(g).lower(x).as_text()
    mine, counts = _linked(text)
    assert len(mine) == 1, text
    assert counts[mine[0]] == n, text
    assert len(calls) == 1
    assert comp.cache_info().traces == 1
    assert_tree_close(jax.jit(g)(x), _calls_n(f_unary, n)(x))
    assert comp.cache_info().traces == 1

    again = raising(f_unary, key=f"jit-link-{n}")
    g2 = _calls_n(again, n)
    text2 = jax.jit(g2).lower(x).as_text()
    mine2, counts2 = _linked(text2)
    assert len(mine2) == 1 and counts2[mine2[0]] == n, text2
    assert_tree_close(jax.jit(g2)(x), _calls_n(f_unary, n)(x))
    assert again.cache_info().traces == 0


def test_jit_two_signatures_two_functions() -> None:
    comp, calls = make(f_unary, key="jit-two-sigs")

    def g(x: Any, y: Any) -> Any:
        return jnp.sum(comp(comp(x))) + jnp.sum(comp(comp(y)))

    text = jax.jit(g).lower(arange(N), arange(2 * N)).as_text()
    mine, counts = _linked(text)
    assert len(mine) == 2, text
    assert sorted(counts.values()) == [2, 2]
    assert len(calls) == 2  # once per signature


def test_jit_of_vmap_links_derived_once() -> None:
    comp, calls = make(f_unary, key="jit-vmap-link")
    g = jax.vmap(_calls_n(comp, 5))
    text = jax.jit(g).lower(arange(B, N)).as_text()
    mine, counts = _linked(text)
    assert len(mine) == 1, text
    assert counts[mine[0]] == 5
    assert len(calls) == 1
    assert_tree_close(jax.jit(g)(arange(B, N)), jax.vmap(_calls_n(f_unary, 5))(arange(B, N)))


def test_top_level_call_compiles_once() -> None:
    comp, calls = make(f_unary, key="top-level")
    x = arange(N)
    for _ in range(3):
        assert_tree_close(comp(x), f_unary(x))
    info = comp.cache_info()
    assert info.traces == 1
    assert info.compiles == 1
    assert len(calls) == 1


# ----------------------------------------------------------------------------
# Platforms

PLATFORM_PROGRAMS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "call": lambda f: lambda x: f(x) * 3.0,
    "vmap": lambda f: lambda x: jax.vmap(f)(jnp.stack([x, x + 1.0])),
    "grad": lambda f: jax.grad(lambda x: jnp.sum(f(x))),
}


@pytest.mark.parametrize("name", list(PLATFORM_PROGRAMS))
def test_multi_platform_lowering(name: str, cache: jaxaot.MemoryCache) -> None:
    comp, _ = make(f_unary, key=f"platforms-{name}")
    g = PLATFORM_PROGRAMS[name](comp)
    x = arange(N)
    lowered = jax.jit(g).trace(x).lower(lowering_platforms=("cpu", "cuda", "tpu"))
    text = lowered.as_text()
    assert "stablehlo.case" in text
    component_id = "key:" + repr(f"platforms-{name}")
    platforms = {
        e.key.parts["platforms"]
        for e in cached_entries(cache)
        if e.key.parts["component"] == component_id
    }
    assert ("cpu",) in platforms
    assert ("cuda",) in platforms
    assert ("tpu",) in platforms
    # The program still runs here, on the CPU.
    assert_tree_close(jax.jit(g)(x), PLATFORM_PROGRAMS[name](f_unary)(x))


@pytest.mark.parametrize("n", [1, 5])
def test_multi_platform_links_one_function_per_platform(n: int) -> None:
    comp, calls = make(f_unary, key=f"platform-link-{n}")
    x = arange(N)
    text = jax.jit(_calls_n(comp, n)).trace(x).lower(lowering_platforms=("cpu", "cuda", "tpu"))
    text = text.as_text()
    mine, counts = _linked(text)
    assert len(mine) == 3, text  # one linked function per platform, not per call
    assert all(c == n for c in counts.values()), counts
    assert text.count("stablehlo.case") >= 1


@pytest.mark.parametrize("name", list(PLATFORM_PROGRAMS))
def test_multi_platform_traces_body_once(name: str) -> None:
    """One signature, one trace: the other platforms' entries are lowered from
    the same trace (as jax.jit does), not by running the body again."""
    key = f"platform-once-{name}"
    comp, calls = make(f_unary, key=key)
    g = PLATFORM_PROGRAMS[name](comp)
    x = arange(N)
    jax.jit(g).trace(x).lower(lowering_platforms=("cpu", "cuda", "tpu"))
    assert len(calls) == 1
    assert comp.cache_info().traces == 1


@pytest.mark.parametrize("name", list(PLATFORM_PROGRAMS))
def test_multi_platform_entries_are_cached(name: str) -> None:
    key = f"platform-cached-{name}"
    comp, _ = make(f_unary, key=key)
    x = arange(N)
    lower = lambda f: (  # noqa: E731
        jax.jit(PLATFORM_PROGRAMS[name](f))
        .trace(x)
        .lower(lowering_platforms=("cpu", "cuda", "tpu"))
        .as_text()
    )
    first = lower(comp)
    again = raising(f_unary, key=key)
    second = lower(again)
    assert "stablehlo.case" in second
    assert len(_linked(second)[0]) == len(_linked(first)[0])
    assert again.cache_info().traces == 0


def test_platform_entries_differ() -> None:
    comp, _ = make(f_unary, key="platform-keys")
    x = arange(N)
    jax.jit(lambda x: comp(x)).trace(x).lower(lowering_platforms=("cpu", "cuda", "tpu"))
    cache = jaxaot.get_cache()
    assert isinstance(cache, jaxaot.MemoryCache)
    by_platform = {}
    for e in cached_entries(cache):
        by_platform[e.key.parts["platforms"]] = e
    assert set(by_platform) >= {("cpu",), ("cuda",), ("tpu",)}
    digests = {e.key.digest for e in by_platform.values()}
    assert len(digests) == len(by_platform)
    for e in by_platform.values():
        assert e.stablehlo is not None


# ----------------------------------------------------------------------------
# Host callbacks and effects


def f_debug_print(x: Any) -> Any:
    jax.debug.print("jaxaot-debug x0={v}", v=x[0])
    return x * 2.0


def f_pure_callback(x: Any) -> Any:
    y = jax.pure_callback(
        lambda a: np.sin(np.asarray(a)).astype(np.float32),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        x,
    )
    return y * 2.0 + x


IO_LOG: list[np.ndarray] = []


def _record(a: Any) -> np.ndarray:
    IO_LOG.append(np.array(a))
    return np.asarray(a) + np.float32(1.0)


def f_io_callback(x: Any) -> Any:
    y = io_callback(_record, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return y * 3.0


CALLBACK_FNS = {
    "debug_print": f_debug_print,
    "pure_callback": f_pure_callback,
    "io_callback": f_io_callback,
}

CALLBACK_WANT = {
    "debug_print": lambda x: x * 2.0,
    "pure_callback": lambda x: np.sin(x) * 2.0 + x,
    "io_callback": lambda x: (x + 1.0) * 3.0,
}


def _check_side_effect(name: str, capsys: Any, x: np.ndarray, times: int) -> None:
    """The callback ran ``times`` times in all (once since the previous check)."""
    jax.effects_barrier()
    if name == "debug_print":
        out = capsys.readouterr().out  # only what was printed since the last check
        assert out.count("jaxaot-debug x0=0.3") == 1, out
    elif name == "io_callback":
        assert len(IO_LOG) == times
        for logged in IO_LOG:
            np.testing.assert_allclose(logged, x)


@pytest.mark.parametrize("name", list(CALLBACK_FNS))
@pytest.mark.parametrize("where", ["top", "jit"])
def test_host_callbacks(name: str, where: str, capsys: Any, cache: jaxaot.MemoryCache) -> None:
    IO_LOG.clear()
    capsys.readouterr()
    comp, calls = make(CALLBACK_FNS[name], key=f"callback-{name}-{where}")
    x = arange(N)
    # Checked before running: an entry that holds a callback but is not marked
    # as such would be linked as serialized StableHLO with a dangling callback.
    assert comp.entry(x).host_callbacks is True
    run = comp if where == "top" else jax.jit(lambda x: comp(x) + 0.0)
    got = run(x)
    assert_tree_close(got, CALLBACK_WANT[name](x).astype(np.float32))
    _check_side_effect(name, capsys, x, 1)
    # A second run calls back again (the callback is not constant-folded away).
    assert_tree_close(run(x), got)
    _check_side_effect(name, capsys, x, 2)
    assert len(calls) == 1

    assert comp.entry(x).host_callbacks is True
    component_id = "key:" + repr(f"callback-{name}-{where}")
    stored = [e for e in cached_entries(cache) if e.key.parts["component"] == component_id]
    assert stored == []
    with pytest.raises(_entry.NotPersistable):
        _entry.encode(comp.entry(x))

    # For contrast: an ordinary component used alongside it is written.
    plain, _ = make(f_unary, key=f"callback-contrast-{name}-{where}")
    plain(x)
    assert any(
        e.key.parts["component"] == "key:" + repr(f"callback-contrast-{name}-{where}")
        for e in cached_entries(cache)
    )


def test_debug_print_under_grad_and_vmap(capsys: Any) -> None:
    capsys.readouterr()
    comp, calls = make(f_debug_print, key="callback-grad")
    x = arange(N)
    assert comp.entry(x).host_callbacks is True  # before running: see test_host_callbacks
    g = jax.grad(lambda x: jnp.sum(comp(x) ** 2))(x)
    np.testing.assert_allclose(g, 8.0 * x, rtol=RTOL)
    v = jax.jit(jax.vmap(comp))(arange(B, N))
    np.testing.assert_allclose(v, 2.0 * arange(B, N), rtol=RTOL)
    jax.effects_barrier()
    out = capsys.readouterr().out
    assert out.count("jaxaot-debug") >= 1 + B, out
    assert len(calls) == 1


def f_io_ordered(x: Any) -> Any:
    return io_callback(_record, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=True) * 2.0


def f_print_ordered(x: Any) -> Any:
    jax.debug.print("ordered {v}", v=x, ordered=True)
    return x + 1.0


@pytest.mark.parametrize("fn", [f_io_ordered, f_print_ordered], ids=["io_callback", "debug_print"])
@pytest.mark.parametrize("where", ["top", "jit", "vmap"])
def test_ordered_effects_refused_with_name(fn: Callable[..., Any], where: str) -> None:
    comp, _ = make(fn, key=f"ordered-{fn.__name__}-{where}")
    x = arange(N)
    run = {"top": comp, "jit": jax.jit(comp), "vmap": jax.vmap(comp)}[where]
    arg = arange(B, N) if where == "vmap" else x
    with pytest.raises(ValueError, match=fn.__name__) as info:
        run(arg)
    assert "ordered" in str(info.value)


# -- checkify sees into components -------------------------------------------------------


def _log2(x: jax.Array) -> jax.Array:
    return jnp.log(x) * 2.0


def _pick(x: jax.Array, i: jax.Array) -> jax.Array:
    return x[i]


def _checked_double(x: jax.Array) -> jax.Array:
    checkify.check(jnp.all(x > 5), "x too small: {}", x[0])
    return x * 2.0


@pytest.mark.parametrize("where", ["checkify", "jit_of_checkify", "checkify_of_jit"])
def test_checkify_reports_the_errors_inside_a_component_as_inside_jax_jit(where: str) -> None:
    """checkify's automatic checks and ``checkify.check`` inside a component are
    reported as they are inside ``jax.jit`` (a NaN names the primitive that made
    it), where without a rule the call was bound unchecked and reported nothing."""

    def run(f: Callable[..., Any], errors: Any, *args: Any) -> tuple[Any, Any]:
        if where == "checkify":
            return checkify.checkify(f, errors=errors)(*args)
        if where == "jit_of_checkify":
            return jax.jit(checkify.checkify(f, errors=errors))(*args)
        return checkify.checkify(jax.jit(lambda *a: f(*a)), errors=errors)(*args)

    cases = [
        (_log2, checkify.float_checks, (-jnp.ones(2),)),
        (_pick, checkify.index_checks, (jnp.ones(2), jnp.asarray(5))),
        (_checked_double, checkify.user_checks, (jnp.ones(2),)),
        (_checked_double, checkify.user_checks, (jnp.full(2, 9.0),)),
    ]
    for fn, errors, args in cases:
        comp, _ = make(fn, key=f"checkify-{fn.__name__}-{where}")
        want_err, want = run(jax.jit(fn), errors, *args)
        got_err, got = run(comp, errors, *args)
        assert got_err.get() == want_err.get(), (fn.__name__, args)
        np.testing.assert_array_equal(got, want)
    assert "nan generated by primitive: log" in str(
        run(make(_log2, "c")[0], checkify.float_checks, -jnp.ones(2))[0].get()
    )


def test_jet_of_a_component_is_jet_of_its_body() -> None:
    """``jax.experimental.jet`` (Taylor series) sees through a component, to the
    third order, with several outputs, directly and inside jax.jit (it raised
    KeyError: jaxaot_component)."""
    from jax.experimental import jet

    def f(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.sin(x) * y, jnp.exp(x * 0.5) + y**2

    comp, _ = make(f, key="jet-f")
    x, y = jnp.arange(3.0), jnp.linspace(0.5, 1.5, 3)
    series = ([jnp.ones(3), jnp.full(3, 0.5), jnp.zeros(3)], [jnp.full(3, 0.25)] * 3)
    want = jet.jet(f, (x, y), series)
    for run in (comp, jax.jit(lambda a, b: comp(a, b))):
        got = jet.jet(run, (x, y), series)
        for g, w in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


# -- every dtype JAX differentiates (issue 11) --------------------------------------------


def _tanh_loss(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w).sum()


@pytest.mark.parametrize(
    "dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.complex64]
)
@pytest.mark.parametrize("jit", [False, True])
def test_low_precision_and_complex_gradients_match_plain(dtype: Any, jit: bool) -> None:
    w = (jax.random.normal(jax.random.key(0), (4, 4)) * 0.5).astype(dtype)
    x = jax.random.normal(jax.random.key(1), (3, 4)).astype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        loss = lambda w, x: jnp.abs(jnp.tanh(x @ w)).sum()  # noqa: E731
    else:
        loss = _tanh_loss
    comp = jaxaot.component(loss)
    grad = jax.grad(comp, argnums=(0, 1))
    plain = jax.grad(loss, argnums=(0, 1))
    if jit:
        grad, plain = jax.jit(grad), jax.jit(plain)
    got, want = grad(w, x), plain(w, x)
    for g, p in zip(got, want, strict=True):
        assert g.dtype == p.dtype
        assert np.any(np.asarray(p.astype(jnp.complex64)) != 0)
        np.testing.assert_allclose(
            np.asarray(g.astype(jnp.complex64)), np.asarray(p.astype(jnp.complex64)), rtol=0.15
        )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_jvp_and_vjp_match_plain(dtype: Any) -> None:
    def f(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w)

    comp = jaxaot.component(f)
    w = jnp.full((4, 4), 0.25, dtype)
    x = jnp.ones((2, 4), dtype)
    t = jnp.ones_like(w)
    _, got = jax.jvp(lambda w: comp(w, x), (w,), (t,))
    _, want = jax.jvp(lambda w: f(w, x), (w,), (t,))
    assert got.dtype == want.dtype == dtype and np.any(np.asarray(want) != 0)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2)
    ct = jnp.ones((2, 4), dtype)
    (gw,) = jax.vjp(lambda w: comp(w, x), w)[1](ct)
    (pw,) = jax.vjp(lambda w: f(w, x), w)[1](ct)
    np.testing.assert_allclose(np.asarray(gw, np.float32), np.asarray(pw, np.float32), rtol=2e-2)


def test_bf16_transformer_block_has_no_zero_gradient_leaf() -> None:
    from jaxaot.cli import _model

    params = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16), _model.init_block(jax.random.key(0), 32)
    )
    x = jax.random.normal(jax.random.key(1), (2, 8, 32)).astype(jnp.bfloat16)
    block = jaxaot.component(_model.block)
    got = jax.grad(lambda p: jnp.mean(block(p, x).astype(jnp.float32) ** 2))(params)
    # The reference under jax.jit: op by op, it alone took half a minute.
    want = jax.jit(jax.grad(lambda p: jnp.mean(_model.block(p, x).astype(jnp.float32) ** 2)))(
        params
    )
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        assert g.dtype == jnp.bfloat16
        assert np.any(np.asarray(g, np.float32) != 0), jax.tree_util.keystr(path)
    for g, p in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(p, np.float32), atol=0.1)


def test_integer_inputs_get_float0_tangents() -> None:
    def f(x: jax.Array, n: jax.Array) -> jax.Array:
        return x * n.astype(x.dtype)

    comp = jaxaot.component(f)
    x, n = jnp.ones(3, jnp.bfloat16), jnp.arange(3)
    got = jax.grad(
        lambda x, n: comp(x, n).astype(jnp.float32).sum(), argnums=(0, 1), allow_int=True
    )(x, n)
    want = jax.grad(lambda x, n: f(x, n).astype(jnp.float32).sum(), argnums=(0, 1), allow_int=True)
    want_g = want(x, n)
    assert got[1].dtype == want_g[1].dtype == jax.dtypes.float0
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), [0, 1, 2])


# -- derived entries carry the whole primal signature (issue 11) --------------------------


def test_derived_entries_differ_per_primal_dtype() -> None:
    comp = jaxaot.component(_tanh_loss)
    x32 = jnp.ones((2, 4), jnp.float32)
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        w = jnp.full((4, 4), 0.1, dtype)
        g = jax.grad(comp)(w, x32.astype(dtype))
        assert g.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(g, np.float32),
            np.asarray(jax.grad(_tanh_loss)(w, x32.astype(dtype)), np.float32),
            rtol=2e-2,
        )


def test_derived_entries_differ_per_primal_shape() -> None:
    def layer(x: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.tanh(x + b)

    comp = jaxaot.component(layer)
    x = jnp.ones((4, 8))
    for b in (jnp.full((8,), 0.5), jnp.full((1, 8), 0.5), jnp.full((4, 8), 0.5)):
        got = jax.grad(lambda b: comp(x, b).sum())(b)
        want = jax.grad(lambda b: layer(x, b).sum())(b)
        assert got.shape == b.shape
        np.testing.assert_allclose(got, want, rtol=RTOL)


def test_derived_keys_hold_the_parents_input_types() -> None:
    comp = jaxaot.component(lambda x, b: jnp.tanh(x + b), key="derived-lineage")
    x = jnp.ones((4, 8))
    keys = []
    for b in (jnp.ones(8), jnp.ones((1, 8))):
        fwd, make_lin = comp.entry(x, b) and _root(comp, x, b).linearize((True, True), [x, b])
        keys.append(fwd.key)
        for t in fwd.key.parts["transform"]:
            assert t[-1] == _root(comp, x, b).key.parts["args"]
    assert keys[0] != keys[1]


def _root(comp: Any, *args: Any) -> Any:
    call, _ = comp._root_call(args, {}, allow_sds=True)
    return call


def test_vmap_entries_differ_per_axis_name() -> None:
    comp = jaxaot.component(lambda x: jnp.sin(x) * 2, key="vmap-axis-names")
    xs = jnp.ones((4, 3))
    for name in (None, "batch", "other"):
        np.testing.assert_allclose(jax.vmap(comp, axis_name=name)(xs), jnp.sin(xs) * 2)
    vmapped = [k for k in comp.store.entries if k.parts["transform"]]
    assert len(vmapped) == 3
    names = {k.parts["transform"][0][2][0] for k in vmapped}
    assert len(names) == 3 and {"batch", "other"} < names


# -- bodies JAX can transform (issue 11): custom rules and collectives --------------------


@jax.custom_vjp
def _clip_gradient(x: jax.Array) -> jax.Array:
    return x


def _clip_fwd(x: jax.Array) -> tuple[jax.Array, None]:
    return x, None


def _clip_bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
    return (jnp.clip(g, -0.5, 0.5),)


_clip_gradient.defvjp(_clip_fwd, _clip_bwd)


@jax.custom_vjp
def _straight_through(x: jax.Array) -> jax.Array:
    return jnp.round(x)


_straight_through.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))


def _with_custom_vjp(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.sum(_clip_gradient(x @ w) ** 2) + jnp.sum(_straight_through(w))


@pytest.mark.parametrize("how", ["grad", "jit_grad", "vmap_grad", "grad_jit", "regional"])
def test_custom_vjp_inside_a_component(how: str) -> None:
    comp = jaxaot.component(_with_custom_vjp)
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    x = jnp.linspace(0.0, 2.0, 8).reshape(2, 4)

    def run(f: Callable[..., Any]) -> Any:
        g = jax.grad(f, argnums=(0, 1))
        if how == "grad":
            return g(w, x)
        if how == "jit_grad":
            return jax.jit(g)(w, x)
        if how == "vmap_grad":
            return jax.vmap(g, in_axes=(None, 0))(w, jnp.stack([x, 2 * x]))
        if how == "grad_jit":
            return jax.grad(jax.jit(f), argnums=(0, 1))(w, x)
        return jaxaot.jit(g)(w, x)

    got, want = run(comp), run(_with_custom_vjp)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_custom_vjp_under_jvp_errors_naming_the_component() -> None:
    comp = jaxaot.component(_with_custom_vjp)
    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    with pytest.raises(Exception, match="_with_custom_vjp"):
        jax.jvp(lambda w: comp(w, x), (w,), (w,))


@jax.custom_vjp
def _sine(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


_sine.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))


@pytest.mark.parametrize("how", ["hessian", "jit_hessian", "jvp_of_grad"])
def test_forward_over_reverse_of_a_custom_vjp_component_differentiates_its_rule(
    how: str,
) -> None:
    """``jax.hessian`` of a component whose body calls a ``custom_vjp`` function
    differentiates the function's fwd and bwd rules, as under ``jax.jit`` (the
    forward pass of a small component, recomputed by its backward entry, was the
    custom_vjp function itself, which JAX refuses to differentiate forward)."""

    def body(x: jax.Array) -> jax.Array:
        return (_sine(x) * x).sum()

    runs = {
        "hessian": lambda f: jax.hessian(f)(x),
        "jit_hessian": lambda f: jax.jit(jax.hessian(f))(x),
        "jvp_of_grad": lambda f: jax.jvp(jax.grad(f), (x,), (x,)),
    }
    x = jnp.linspace(0.1, 1.0, 3)
    assert_tree_close(runs[how](jaxaot.component(body)), runs[how](jax.jit(body)))


@jax.custom_jvp
def _softclip(x: jax.Array) -> jax.Array:
    return jnp.tanh(x)


@_softclip.defjvp
def _softclip_jvp(primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    return jnp.tanh(x), 0.5 * t


@pytest.mark.parametrize("how", ["grad", "jvp", "vmap_jvp", "jit_grad", "regional"])
def test_custom_jvp_inside_a_component(how: str) -> None:
    def f(x: jax.Array) -> jax.Array:
        return jnp.sum(_softclip(x) * x)

    comp = jaxaot.component(f)
    x = jnp.linspace(-1.0, 1.0, 5)

    def run(g: Callable[..., Any]) -> Any:
        if how == "grad":
            return jax.grad(g)(x)
        if how == "jvp":
            return jax.jvp(g, (x,), (jnp.ones_like(x),))
        if how == "vmap_jvp":
            return jax.vmap(lambda t: jax.jvp(g, (x,), (t,))[1])(jnp.eye(5))
        if how == "jit_grad":
            return jax.jit(jax.grad(g))(x)
        return jaxaot.jit(jax.grad(g))(x)

    got, want = run(comp), run(f)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def _batch_norm(x: jax.Array) -> jax.Array:
    mean = lax.pmean(x, "batch")
    var = lax.pmean((x - mean) ** 2, "batch")
    return (x - mean) / jnp.sqrt(var + 1e-5) + lax.axis_index("batch") + lax.psum(1.0, "batch")


@pytest.mark.parametrize("how", ["vmap", "jit_vmap", "vmap_jit", "grad_vmap"])
def test_collectives_over_an_outer_vmap_axis(how: str) -> None:
    comp = jaxaot.component(_batch_norm)
    xs = jnp.linspace(0.0, 1.0, 12).reshape(4, 3)

    def run(f: Callable[..., Any]) -> Any:
        v = jax.vmap(f, axis_name="batch")
        if how == "vmap":
            return v(xs)
        if how == "jit_vmap":
            return jax.jit(v)(xs)
        if how == "vmap_jit":
            return jax.vmap(jax.jit(f), axis_name="batch")(xs)
        return jax.grad(lambda xs: jnp.sum(v(xs) ** 2))(xs)

    np.testing.assert_allclose(run(comp), run(_batch_norm), rtol=1e-4, atol=1e-4)


def test_collective_outside_its_axis_errors_naming_the_component() -> None:
    comp = jaxaot.component(_batch_norm)
    with pytest.raises(Exception, match="_batch_norm"):
        comp(jnp.ones(3))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_inputs_that_are_residuals_are_passed_on_not_returned(dtype: Any) -> None:
    """The backward pass of ``tanh(x @ w * scale)`` multiplies by the layer's own
    inputs ``w`` and ``x`` (and a Python scalar ``scale``, weakly typed): the
    forward entry does not return them, and the linear entry gets the inputs
    themselves.
    Gradients and their dtypes are ``jax.grad``'s, called directly, under
    ``jax.jit`` and under ``jaxaot.jit`` (3 layers, weights bfloat16 too)."""

    def layer(w: Any, x: Any, scale: Any) -> Any:
        return jnp.tanh((x @ w) * scale)

    comp = jaxaot.component(layer, key=f"forwarded-{jnp.dtype(dtype).name}")
    ws = [(arange(N, N, start=0.1 * k) / N).astype(dtype) for k in range(1, 4)]
    x = arange(2, N, start=0.3).astype(dtype)

    def loss(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(ws: Any, x: Any) -> Any:
            for w in ws:
                x = fn(w, x, 0.5)
            return jnp.sum(x.astype(jnp.float32) ** 2)

        return run

    want = jax.grad(loss(layer), argnums=(0, 1))(ws, x)
    closed = jax.make_jaxpr(jax.grad(loss(comp), argnums=(0, 1)))(ws, x)
    forwarded = {
        tuple(map(tuple, eqn.params["call"].entry.extra["forwarded"]))
        for eqn in closed.jaxpr.eqns
        if "call" in eqn.params and "forwarded" in eqn.params["call"].entry.extra
    }
    assert len(forwarded) == 1 and {0, 1} <= {q for _, q in next(iter(forwarded))}
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    for run in (
        jax.grad(loss(comp), argnums=(0, 1)),
        jax.jit(jax.grad(loss(comp), argnums=(0, 1))),
        jaxaot.jit(jax.grad(loss(comp), argnums=(0, 1)), whole_program=False),
    ):
        got = run(ws, x)
        assert jax.tree_util.tree_map(lambda a: a.dtype, got) == jax.tree_util.tree_map(
            lambda a: a.dtype, want
        )
        assert all(float(jnp.abs(g.astype(jnp.float32)).max()) > 0 for g in got[0])
        for g, w in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol
            )


def _symbolic_jvp(scale: float) -> Callable[..., Any]:
    """``x * y``, whose JVP takes another branch when ``y`` is not differentiated
    (its tangent a symbolic zero): ``scale`` stands for an edit of that branch."""

    @jax.custom_jvp
    def f(x: jax.Array, y: jax.Array) -> jax.Array:
        return x * y

    def f_jvp(primals: Any, tangents: Any) -> Any:
        (x, y), (tx, ty) = primals, tangents
        if type(ty) is jax.custom_derivatives.SymbolicZero:
            return x * y, tx * y * scale
        return x * y, tx * y + x * ty

    f.defjvp(f_jvp, symbolic_zeros=True)
    return f


def _symbolic_vjp(scale: float) -> Callable[..., Any]:
    """``(x * y, x + y)``, whose backward pass takes other branches when ``y`` is not
    differentiated and when the second output's cotangent is a symbolic zero."""

    @jax.custom_vjp
    def f(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        return x * y, x + y

    def fwd(x: Any, y: Any) -> Any:
        return (x.value * y.value, x.value + y.value), (x.value, y.value, y.perturbed)

    def bwd(res: Any, cts: Any) -> Any:
        x, y, y_perturbed = res
        ct_prod, ct_sum = cts
        ct_sum = 10.0 * scale if type(ct_sum) is jax.custom_derivatives.SymbolicZero else ct_sum
        ct_x = ct_prod * y * (1.0 if y_perturbed else scale) + ct_sum
        return ct_x, ct_prod * x + ct_sum

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def _symbolic_vmap(scale: float) -> Callable[..., Any]:
    """``w * x``, whose batching rule takes another branch when only ``x`` is batched."""
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def f(w: jax.Array, x: jax.Array) -> jax.Array:
        return w * x

    @f.def_vmap
    def rule(axis_size: int, in_batched: list[bool], w: jax.Array, x: jax.Array) -> Any:
        if in_batched == [False, True]:
            return w * x * scale, True
        w = w if in_batched[0] else jnp.broadcast_to(w, (axis_size, *w.shape))
        x = x if in_batched[1] else jnp.broadcast_to(x, (axis_size, *x.shape))
        return w * x, True

    return f


def _grad_and_jvp(fn: Callable[..., Any], x: jax.Array, y: jax.Array) -> Callable[[], Any]:
    """The gradient of ``fn`` at ``(x, y)`` and its JVP along ``x`` alone (``y``'s
    tangent a symbolic zero), when called."""
    return lambda: (jax.grad(fn)(x, y), jax.jvp(lambda x: fn(x, y), (x,), (x,))[1])


def _transformed(kind: str, scale: float) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A transformation of a component calling a rule that sees which inputs are
    differentiated or batched, and of the plain function."""
    x, y = jnp.arange(1.0, 5.0), jnp.arange(2.0, 6.0)
    if kind == "jvp, nested":
        # The rule in a component that another component calls: the outer one's
        # transformations see what the inner rule sees.
        inner = jaxaot.component(_symbolic_jvp(scale))

        def nested(x: jax.Array, y: jax.Array) -> jax.Array:
            return inner(x, y).sum()

        def plain(x: jax.Array, y: jax.Array) -> jax.Array:
            return inner.__wrapped__(x, y).sum()

        return _grad_and_jvp(jaxaot.component(nested), x, y), _grad_and_jvp(plain, x, y)
    if kind == "jvp":
        f = _symbolic_jvp(scale)

        def jvp_loss(x: jax.Array, y: jax.Array) -> jax.Array:
            return f(x, y).sum()

        return _grad_and_jvp(jaxaot.component(jvp_loss), x, y), _grad_and_jvp(jvp_loss, x, y)
    if kind == "vjp":
        g = _symbolic_vjp(scale)

        def vjp_loss(x: jax.Array, y: jax.Array) -> jax.Array:
            return g(x, y)[0].sum()

        def both(x: jax.Array, y: jax.Array) -> jax.Array:
            prod, total = g(x, y)
            return (prod + total).sum()

        def grads(loss: Any, both: Any) -> Any:
            return lambda: (jax.grad(loss)(x, y), jax.grad(both, argnums=(0, 1))(x, y))

        # (The component returns both outputs; the loss uses the first only.)
        outputs = jaxaot.component(lambda x, y: g(x, y))
        return (
            grads(lambda x, y: outputs(x, y)[0].sum(), jaxaot.component(both)),
            grads(vjp_loss, both),
        )
    h = _symbolic_vmap(scale)

    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return h(w, x)

    xs = jnp.ones((3, 4)) * x

    def batch(fn: Any) -> Any:
        return lambda: (jax.vmap(fn, in_axes=(None, 0))(y, xs), jax.vmap(fn)(xs, xs))

    return batch(jaxaot.component(layer)), batch(layer)


@pytest.mark.parametrize("kind", ["jvp", "vjp", "vmap", "jvp, nested"])
def test_a_rule_that_sees_which_inputs_are_transformed_sees_what_jax_shows_it(kind: str) -> None:
    """A ``custom_jvp`` or ``custom_vjp`` rule with ``symbolic_zeros`` is told which
    tangents are zero, which inputs are perturbed and which cotangents are zero; a
    ``custom_vmap`` rule, which inputs are batched. Inside a component it is told
    what it is told under ``jax.jit``: values as the plain function's."""
    got, want = _transformed(kind, 3.0)
    for g, w in zip(jax.tree.leaves(got()), jax.tree.leaves(want()), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["jvp", "vjp", "vmap", "jvp, nested"])
def test_transformations_of_a_rule_that_sees_masks_are_keyed_by_what_they_compute(
    kind: str, cache: Any
) -> None:
    """The rule is traced for the component's key with every input differentiated
    (or batched): a rule edited only where some input is not (``scale``) leaves the
    key as it was. Each transformation of such a program is keyed by what it
    computes: the edited rule's values, not the entries of the one before."""
    before, _ = _transformed(kind, 1.0)
    before()
    assert cache.keys()  # the entries of the rule before the edit
    got, want = _transformed(kind, 3.0)
    for g, w in zip(jax.tree.leaves(got()), jax.tree.leaves(want()), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
