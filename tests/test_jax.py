"""The JAX-version layer: the supported range, and the internals that moved
between JAX 0.10 and 0.12 (linearization protocol, call primitives, closed
jaxprs), each checked on whichever JAX is installed."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import primitives

import jaxaot
from jaxaot import _jax as _jaxcompat
from jaxaot import _versions
from jaxaot._component._rules import component_p
from jaxaot._jax import (
    CALL_PRIMITIVES,
    JAX_VERSION,
    ClosedJaxpr,
    call_body,
    jaxpr_as_fun,
    jaxpr_program,
    with_trees,
)
from jaxaot._versions import check_supported


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("0.10.2", (0, 10, 2)),
        ("0.12.0.1", (0, 12, 0, 1)),
        ("0.11.1rc1", (0, 11, 1)),
        ("0.12.0.dev20261101", (0, 12, 0)),
    ],
)
def test_version_tuple(text: str, parsed: tuple[int, ...]) -> None:
    assert _versions.version_tuple(text) == parsed


@pytest.mark.parametrize("version", ["0.10.2", "0.11.0", "0.11.2", "0.12.0.1", "0.12.9"])
def test_supported_versions(version: str) -> None:
    assert check_supported(version) == _versions.version_tuple(version)


@pytest.mark.parametrize("version", ["0.10.1", "0.9.0", "0.13.0", "1.0.0"])
def test_unsupported_versions_name_the_range(version: str) -> None:
    with pytest.raises(
        ImportError, match=r"jax>=0\.10\.2,<0\.13.*jax " + version.replace(".", r"\.")
    ):
        check_supported(version)


def test_installed_jax_is_in_range() -> None:
    assert JAX_VERSION == _versions.version_tuple(jax.__version__)


def _python_output(code: str) -> str:
    """What a fresh interpreter running ``code`` prints."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout


def test_first_use_with_an_unsupported_jax_is_one_clear_error() -> None:
    """Where the distribution's metadata and the loaded module disagree, loading
    JAX's internals checks again."""
    code = textwrap.dedent(
        """
        import jax
        jax.__version__ = "0.13.0"
        import jaxaot
        try:
            jaxaot.component
        except ImportError as e:
            print("ImportError:", e)
        else:
            print("loaded")
        """
    )
    out = _python_output(code)
    assert out.startswith("ImportError: jaxaot supports jax>=0.10.2,<0.13"), out


def test_import_with_an_unsupported_jax_is_one_clear_error() -> None:
    code = textwrap.dedent(
        """
        from importlib import metadata
        real = metadata.version
        metadata.version = lambda name: "0.13.0" if name == "jax" else real(name)
        try:
            import jaxaot
        except ImportError as e:
            print("ImportError:", e)
        else:
            print("imported")
        """
    )
    out = _python_output(code)
    assert out.startswith("ImportError: jaxaot supports jax>=0.10.2,<0.13"), out
    assert "jax 0.13.0 is installed" in out


def _call_eqn(fn: object, *args: object) -> object:
    closed = jax.make_jaxpr(fn)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name in CALL_PRIMITIVES]
    return eqn


def test_call_body_of_jit() -> None:
    eqn = _call_eqn(lambda x: jax.jit(jnp.sin)(x) * 2, 1.0)
    body = call_body(eqn)
    assert body is not None
    jaxpr, consts = body
    assert [e.primitive.name for e in jaxpr.eqns] == ["sin"]
    assert list(consts) == []


def test_call_body_of_closed_call() -> None:
    # closed_call before 0.11.1, eval_jaxpr (the same public name) from then on.
    inner = jax.make_jaxpr(lambda x: jnp.cos(x) + 1)(1.0)

    def f(x: jax.Array) -> jax.Array:
        prim = primitives.closed_call_p
        (y,) = prim.bind(x, **prim.get_bind_params({"call_jaxpr": inner}))
        return y

    eqn = _call_eqn(f, 1.0)
    body = call_body(eqn)
    assert body is not None
    assert [e.primitive.name for e in body[0].eqns] == ["cos", "add"]


def test_call_body_is_none_for_other_equations() -> None:
    closed = jax.make_jaxpr(lambda x: jnp.sin(x))(1.0)
    assert call_body(closed.jaxpr.eqns[0]) is None


def test_closed_jaxpr_rebuilds_from_a_jaxpr_and_consts() -> None:
    w = jnp.arange(3.0)
    closed = jax.make_jaxpr(lambda x: x * w)(jnp.ones(3))
    rebuilt = ClosedJaxpr(closed.jaxpr, list(closed.consts))
    assert isinstance(rebuilt, ClosedJaxpr)
    np.testing.assert_array_equal(jaxpr_as_fun(rebuilt)(jnp.ones(3))[0], w)


def test_grad_through_a_component_uses_the_installed_linearization_protocol() -> None:
    """The direct linearization rule is registered in the installed JAX's protocol
    (4 values up to 0.11.0, 5 from 0.11.1): grad, jitted grad and vjp work and
    match plain JAX, and the derived forward entry is used (no JVP fallback)."""

    def f(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    comp = jaxaot.component(f)
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    x = jnp.linspace(0.0, 1.0, 8).reshape(2, 4)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        for transform in (jax.grad, lambda g, **kw: jax.jit(jax.grad(g, **kw))):
            got = transform(comp, argnums=(0, 1))(w, x)
            want = transform(f, argnums=(0, 1))(w, x)
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        _, pullback = jax.vjp(comp, w, x)
        np.testing.assert_allclose(
            pullback(jnp.float32(1.0))[0], jax.grad(f)(w, x), rtol=1e-5, atol=1e-6
        )
    rule = _jaxcompat.ad.primitive_linearizations[component_p]
    n_values = 5 if JAX_VERSION >= (0, 11, 1) else 4
    lengths: list[int] = []

    def count(w: jax.Array, x: jax.Array) -> list[jax.Array]:
        (eqn,) = jax.make_jaxpr(comp)(w, x).jaxpr.eqns
        out = rule(False, [True, True], w, x, call=eqn.params["call"])
        lengths.append(len(out))
        return list(out[0])

    with jaxaot.using_cache(jaxaot.MemoryCache()):
        jax.make_jaxpr(count)(w, x)
    assert lengths == [n_values]


def test_types_made_again_by_pickling_or_copying_equal_the_originals() -> None:
    """An executable loaded from its serialization unpickles its output types
    (JAX's own format): they must equal, and hash as, the same types of any other
    array, or every signature built from a warm process's outputs misses. Newer
    JAX puts an ``AutoLayout`` on every type, which pickling made anew."""
    import copy
    import pickle

    for x in (jnp.ones((2, 3)), jnp.ones((4,), jnp.bfloat16), jnp.int32(3)):
        aval = x.aval
        for again in (pickle.loads(pickle.dumps(aval)), copy.deepcopy(aval), copy.copy(aval)):
            assert again == aval and hash(again) == hash(aval)
            assert {aval: 1}[again] == 1
    layout = getattr(aval, "layout", None)
    if layout is not None:  # the JAX versions that carry it: one object
        assert pickle.loads(pickle.dumps(layout)) is layout


def test_a_jaxpr_program_binds_one_call_and_computes_what_the_jaxpr_does() -> None:
    w = jnp.arange(3.0)

    def f(x: jax.Array, unused: jax.Array, k: float) -> tuple[jax.Array, jax.Array]:
        return jnp.tanh(x * w) + k, jnp.sum(x)

    args = (jnp.linspace(0.0, 1.0, 3), jnp.ones(2), 2.0)
    closed = jax.make_jaxpr(f)(*args)
    program = jaxpr_program(closed, "step")
    assert program.__name__ == "step"
    # Traced, its equations are not bound again: one call holds them all.
    (eqn,) = jax.make_jaxpr(program)(*args).jaxpr.eqns
    assert eqn.primitive.name in CALL_PRIMITIVES
    assert eqn.params["jaxpr"] is closed and eqn.params["name"] == "step"
    compiled = jax.jit(program, keep_unused=True).trace(*args).lower().compile()
    assert "jit_step" in compiled.as_text()
    got = compiled(*args)
    want = jax.jit(f)(*args)
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(g, e)
    # Its unused input is kept, as the program's callers pass every input.
    assert len(compiled.in_tree.children()[0].children()) == 3


def test_an_executable_of_flat_arrays_takes_a_tree_as_the_same_executable(
    compiles: list[str],
) -> None:
    """The whole-program executable a jaxaot.jit plan compiled takes the call's
    argument tree for JAX's C++ dispatch as it is: neither compiled, serialized nor
    loaded again, with its donations."""

    def flat(a: jax.Array, b: jax.Array, c: jax.Array) -> list[jax.Array]:
        return [a * 2 + b, jnp.sum(c)]

    a, b, c = (jax.device_put(np.full(3, v, np.float32)) for v in (1.0, 2.0, 3.0))
    compiled = jax.jit(flat, donate_argnums=(0,)).trace(a, b, c).lower().compile()
    in_tree = jax.tree_util.tree_structure(((a, {"b": b, "c": c}), {}))
    out_tree = jax.tree_util.tree_structure({"sum": 0, "y": 0})
    before = len(compiles)
    exe = with_trees(compiled, in_tree, out_tree)
    out = exe(a, {"b": b, "c": c})
    assert len(compiles) == before
    assert exe._executable is compiled._executable
    assert sorted(out) == ["sum", "y"]
    # (Leaves in the trees' order: the dict's keys sorted, so ``sum`` first.)
    np.testing.assert_array_equal(out["sum"], np.full(3, 4.0, np.float32))
    assert float(out["y"]) == 9.0
    assert a.is_deleted()  # donated, as the flat executable donates it


def test_inner_jit_calls_are_seen_and_inlined_ones_are_told_apart() -> None:
    """The calls ``jaxaot.jit`` may turn into blocks: a user's inner ``jax.jit`` (kept
    as a call by JAX) is not inline; ``jit(..., inline=True)`` and ``jax.numpy``'s own
    helpers, which JAX inlines itself, are. (JAX 0.12 spells ``inline`` as an enum.)"""
    from jaxaot._jax import intercepting, is_inline

    seen: list[tuple[str, bool]] = []

    def hook(call: Any) -> None:
        seen.append((str(call.params.get("name")), is_inline(call)))

    kept = jax.jit(lambda x: jnp.sin(x) * 2.0)
    inlined = jax.jit(lambda x: jnp.cos(x) + 1.0, inline=True)

    def program(x: jax.Array) -> jax.Array:
        return kept(x) + inlined(x)

    with intercepting(hook):
        jax.make_jaxpr(program)(jnp.ones(3))
    assert ("<lambda>", False) in seen and ("<lambda>", True) in seen, seen


def test_compile_flags_leave_out_what_jax_s_cache_key_leaves_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jax._src import cache_key

    monkeypatch.setenv(
        "XLA_FLAGS",
        "--xla_dump_to=/tmp/d --xla_cpu_enable_fast_math=false --xla_dump_hlo_as_text "
        "--xla_force_host_platform_device_count=8",
    )
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_foo=1 --xla_dump_to=/x")
    flags = dict(_jaxcompat.compile_flags())
    assert flags == {
        "xla_flags": "--xla_cpu_enable_fast_math=false",
        "libtpu_init_args": "--xla_tpu_foo=1",
    }
    # Exactly the installed JAX's list, not a copy that drifts from it.
    assert set(cache_key.xla_flags_to_exclude_from_cache_key) == _jaxcompat.EXCLUDED_FLAGS


def test_no_deprecated_jax_api_is_read(caplog: pytest.LogCaptureFixture) -> None:
    """With DeprecationWarnings as errors (a project's ``filterwarnings = error``), a
    component and a jaxaot.jit function on an array committed to a device run and
    are split and cached: jaxaot reads no API that JAX deprecates (on jax 0.12.1,
    ``jax.sharding.SingleDeviceSharding``, which failed the call, or made jaxaot.jit
    fall back to plain jax.jit)."""
    import warnings

    x = jax.device_put(jnp.arange(4.0), jax.devices()[0])
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="jaxaot"):
        warnings.simplefilter("error", DeprecationWarning)
        np.testing.assert_array_equal(jaxaot.component(lambda v: v * 2)(x), x * 2)
        np.testing.assert_array_equal(jaxaot.jit(lambda v: v + 1)(x), x + 1)
        assert jaxaot.jit(lambda v: v + 1).explain(x).startswith("jaxaot.jit")
    assert not caplog.messages, caplog.messages
