"""Tests for jaxaot._program: default keys from a canonical form of the traced program."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot
from jaxaot._keys._program import (
    content_digest,
    equation_digests,
    program_digest,
    program_parts,
)
from jaxaot._keys._text import strip_addresses


def _parts(f: object, *args: object) -> dict[str, object]:
    return program_parts(jax.make_jaxpr(f)(*args), "f")  # type: ignore[arg-type]


def test_names_and_source_lines_do_not_matter() -> None:
    def f(x: jax.Array) -> jax.Array:
        hidden = jnp.sin(x)
        return hidden * 2

    # Another function, other local names, defined on other lines.
    def g(value: jax.Array) -> jax.Array:
        tmp = jnp.sin(value)

        return tmp * 2

    x = jnp.ones(3)
    assert _parts(f, x) == _parts(g, x)
    assert _parts(f, x) == _parts(f, x)


def test_every_computation_change_changes_the_program() -> None:
    x = jnp.ones(3)
    base = _parts(lambda x: jnp.sin(x) * 2, x)
    for other in (
        lambda x: jnp.cos(x) * 2,
        lambda x: jnp.sin(x) * 3,
        lambda x: jnp.sin(x * 2),
        lambda x: jnp.sin(x) * 2 + 0,
    ):
        assert _parts(other, x)["program"] != base["program"]
    # Input types, weak types included, are in the program.
    assert (
        _parts(lambda x: x * 2, 1.0)["program"]
        != _parts(lambda x: x * 2, jnp.float32(1))["program"]
    )


def test_a_program_digest_sees_the_constants_of_nested_jaxprs() -> None:
    """Two programs whose text is the same, their inner ``jax.jit`` closing over
    arrays of other values (the text leaves nested constants out): their digests
    differ; the same program traced twice, or under other names, digests alike."""

    def make(scale: float) -> object:
        table = np.arange(3, dtype=np.float32) * scale
        inner = jax.jit(lambda v: v * table)
        return lambda x: jax.lax.cond(x[0] > 0, inner, lambda v: v, x) + 1

    x = jnp.ones(3)
    one, two = (jax.make_jaxpr(make(s))(x) for s in (1.0, 2.0))  # type: ignore[operator]
    assert str(one) == str(two)
    assert program_digest(one, "f") != program_digest(two, "f")
    again = jax.make_jaxpr(make(1.0))(x)  # type: ignore[operator]
    assert program_digest(again, "g") == program_digest(one, "f")


def test_constants_are_keyed_by_content_in_their_own_part() -> None:
    def make(w: np.ndarray) -> object:
        return lambda x: x @ jnp.asarray(w)

    x = jnp.ones((2, 3))
    a = _parts(make(np.ones((3, 2), np.float32)), x)
    b = _parts(make(np.full((3, 2), 2.0, np.float32)), x)
    c = _parts(make(np.ones((3, 2), np.float32)), x)
    assert a == c
    assert a["program"] == b["program"] and a["consts"] != b["consts"]


def _custom_jvp_with(scale: float) -> object:
    @jax.custom_jvp
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), scale * jnp.cos(p[0]) * t[0]))
    return f


def _custom_vjp_with(scale: float) -> object:
    @jax.custom_vjp
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (scale * jnp.cos(x) * g,))
    return f


@pytest.mark.parametrize("make", [_custom_jvp_with, _custom_vjp_with])
def test_derivative_rules_are_part_of_the_key(make: object) -> None:
    one, two, one_again = make(1.0), make(2.0), make(1.0)  # type: ignore[operator]
    a, b, c = (_parts(f, 1.0) for f in (one, two, one_again))
    assert a["program"] == b["program"]  # the primal computation is the same...
    assert a["rules"] != b["rules"]  # ...its derivative is not
    assert a == c


@pytest.mark.parametrize("make", [_custom_jvp_with, _custom_vjp_with])
def test_components_over_custom_rules_give_their_own_gradients(make: object) -> None:
    one, two = make(1.0), make(2.0)  # type: ignore[operator]
    x = jnp.float32(0.5)
    g1 = jax.grad(jaxaot.component(lambda x: one(x)))(x)  # type: ignore[operator]
    g2 = jax.grad(jaxaot.component(lambda x: two(x)))(x)  # type: ignore[operator]
    np.testing.assert_allclose(g1, np.cos(0.5), rtol=1e-6)
    np.testing.assert_allclose(g2, 2 * np.cos(0.5), rtol=1e-6)


def test_content_digest_of_typed_keys_and_arrays() -> None:
    assert content_digest(np.ones(3, np.float32)) == content_digest(jnp.ones(3))
    assert content_digest(np.ones(3, np.float32)) != content_digest(np.ones(3, np.float64))
    assert content_digest(jax.random.key(0)) != content_digest(jax.random.key(1))
    assert content_digest(jax.random.key(0)) == content_digest(jax.random.key(0))


def test_strip_addresses() -> None:
    assert strip_addresses("<function f at 0x7f00deadbeef>") == "<function f>"
    assert strip_addresses("<object object at 0xABCDEF12>") == "<object object>"


def test_closure_over_a_typed_key_is_keyed_by_content() -> None:
    def make(seed: int) -> jaxaot.Component[..., jax.Array]:
        k = jax.random.key(seed)
        return jaxaot.component(lambda x: x + jax.random.normal(k, x.shape))

    x = jnp.zeros(3)
    assert not np.array_equal(make(0)(x), make(1)(x))
    np.testing.assert_array_equal(make(1)(x), jax.random.normal(jax.random.key(1), (3,)))


def _custom_vmap_with(shift: float) -> object:
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def f(x: jax.Array) -> jax.Array:
        return jnp.cos(x)

    @f.def_vmap
    def rule(axis_size: int, in_batched: list[bool], xs: jax.Array) -> tuple[jax.Array, bool]:
        return jnp.cos(xs) + shift, in_batched[0]

    return f


def test_a_batching_rule_is_part_of_the_key() -> None:
    """A ``custom_vmap`` function's batching rule is traced (every input batched):
    a rule that computes something else (a value it closes over) changes the key,
    though the program unbatched is the same."""
    one, two, one_again = (_custom_vmap_with(s) for s in (0.0, 100.0, 0.0))
    a, b, c = (_parts(f, jnp.ones(3)) for f in (one, two, one_again))
    assert a["program"] == b["program"]
    assert a["rules"] != b["rules"]
    assert a == c


def _nested_rules(scale: float) -> object:
    """``f``, whose JVP calls ``g``, whose JVP calls ``h``, whose JVP uses ``scale``:
    only a third derivative sees ``scale``."""

    @jax.custom_jvp
    def h(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    h.defjvp(lambda p, t: (jnp.sin(p[0]), scale * jnp.cos(p[0]) * t[0]))

    @jax.custom_jvp
    def g(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    g.defjvp(lambda p, t: (jnp.sin(p[0]), h(p[0] + 1.0) * t[0]))

    @jax.custom_jvp
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]), g(p[0] + 1.0) * t[0]))
    return f


def test_rules_calling_rules_are_part_of_the_key() -> None:
    """A rule that changes three rules deep (what a third derivative runs) changes
    the key; a rule calling its own function (``_custom_jvp_with``'s) is keyed
    once, not traced again and again."""
    one, two, one_again = (_nested_rules(s) for s in (1.0, 7.0, 1.0))
    a, b, c = (_parts(f, 0.3) for f in (one, two, one_again))
    assert a["program"] == b["program"]
    assert a["rules"] != b["rules"]
    assert a == c
    assert len(a["rules"]) == 3  # f's, g's and h's
    assert len(_parts(_custom_jvp_with(1.0), jnp.float32(0.3))["rules"]) == 1


def test_equation_digests_tell_apart_what_equations_compute() -> None:
    """Equations that compute the same from inputs of the same types digest alike,
    whatever their variables and their nested jaxprs' identities (each
    ``jax.nn.relu`` call holds a jaxpr of its own); another literal, primitive or
    input type differs; an equation that calls back into the host has none."""

    def f(x: jax.Array, y: jax.Array) -> tuple[jax.Array, ...]:
        return (
            jax.nn.relu(x) * 2.0,
            jax.nn.relu(y) * 2.0,
            jax.nn.relu(y) * 3.0,
            jax.nn.relu(x).astype(jnp.float16),
            jax.pure_callback(np.sin, jax.ShapeDtypeStruct((3,), jnp.float32), x),
        )

    eqns = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3)).jaxpr.eqns
    digests = equation_digests(eqns, "f")
    names = [e.primitive.name for e in eqns]
    relus = [d for n, d in zip(names, digests, strict=True) if n == "custom_jvp_call"]
    muls = [d for n, d in zip(names, digests, strict=True) if n == "mul"]
    assert len(relus) == 4 and relus[0] == relus[1] == relus[2] == relus[3]
    assert len(muls) == 3 and muls[0] == muls[1] != muls[2]
    assert digests[names.index("convert_element_type")] not in muls
    assert digests[names.index("pure_callback")] is None


LOWERED_CODE_SCRIPT = textwrap.dedent(
    """
    import os
    import jax, jax.numpy as jnp, numpy as np, jaxaot
    from jax.extend import random as jr
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    SCALE = float(os.environ["SCALE"])  # read only when the program is lowered

    scale_p = Primitive("users_scale")
    scale_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(scale_p, mlir.lower_fun(lambda x: x * SCALE, multiple_results=False))

    def bits(key, bit_width, shape):
        return jnp.zeros(shape, jnp.uint32) + key[0] * jnp.uint32(SCALE)

    impl = jr.define_prng_impl(
        key_shape=(2,),
        seed=lambda s: jnp.stack([jnp.uint32(s), jnp.uint32(7)]),
        split=lambda k, shape: jnp.broadcast_to(k, (*shape, 2)),
        random_bits=bits,
        fold_in=lambda k, d: k + jnp.uint32(d),
        name="users_impl",
    )

    def f(x):
        drawn = jax.random.bits(jax.random.key(3, impl=impl), x.shape).astype(x.dtype)
        return scale_p.bind(x) + drawn

    x = jnp.arange(4.0)
    want = np.asarray(jax.jit(f)(x))
    for name, got in (("component", jaxaot.component(f)(x)), ("jaxaot.jit", jaxaot.jit(f)(x))):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
    jaxaot.wait_for_writes()
    print("compiles", jaxaot.stats()["compiles"])
    """
)


def test_code_that_runs_only_when_lowering_is_in_the_key(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """A user's primitive's lowering rule and a user's PRNG implementation run only
    when the program is lowered, so the traced program does not show them: what
    they read is keyed all the same. A process where they compute otherwise is
    not served the entries of the one before; one where they are the same is."""
    script = tmp_path / "lowered_code.py"
    script.write_text(LOWERED_CODE_SCRIPT)

    def run(scale: str) -> int:
        env = dict(subprocess_env, SCALE=scale)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return int(out.stdout.split()[-1])

    assert run("3") > 0
    assert run("5") > 0  # (asserts its values equal jax.jit's)
    assert run("5") == 0
