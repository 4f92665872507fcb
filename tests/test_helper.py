"""Whole programs compiled in a helper process of the lowest priority
(``jaxaot._regional._helper``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _steps import block, loss, setup

import jaxaot
from jaxaot._jax import deserialize_executable
from jaxaot._regional import _helper, _plan, _pool, _programs


@pytest.fixture(autouse=True)
def helper_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with the helper on (the suite turns it off elsewhere)
    and not failed, and leaves it so."""
    monkeypatch.delenv(_helper.ENV, raising=False)
    _helper._FAILED.clear()
    yield
    _helper._FAILED.clear()


def _layers(ws: jax.Array, v: jax.Array) -> list[jax.Array]:
    def body(h: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = jnp.tanh(h @ w)
        return h, jnp.sum(h)

    h, sums = jax.lax.scan(body, v, ws)
    return [h, sums, v * 2]


def _sds(*arrays: jax.Array) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def test_compiles_in_another_process_of_the_lowest_priority() -> None:
    """The helper's executable computes what ``jax.jit`` compiled here computes,
    bit for bit, with the same donation; it was made in another process, at
    niceness 19; its bytes load again (what the cache stores)."""
    ws = jax.random.normal(jax.random.key(0), (4, 8, 8), jnp.float32) * 0.3
    v = jax.random.normal(jax.random.key(1), (2, 8), jnp.float32)
    helped = _helper.compile_in_helper(_layers, _sds(ws, v), donate=(1,))
    assert helped is not None
    assert helped.pid != os.getpid()
    assert helped.niceness == min(19, os.getpriority(os.PRIO_PROCESS, 0) + _helper.HELPER_NICENESS)
    expected = jax.jit(_layers)(ws, v)
    donated = v + 0
    got = helped.executable(ws, donated)
    assert donated.is_deleted()  # the executable donates what it was asked to
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = deserialize_executable(
        helped.payload, helped.executable.in_tree, helped.executable.out_tree
    )
    np.testing.assert_array_equal(np.asarray(again(ws, v + 0)[0]), np.asarray(expected[0]))


def test_the_programs_configuration_travels() -> None:
    """JAX's configuration (here 64-bit types) is the helper's too: a float64
    program compiles there as float64."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        x = jnp.arange(3, dtype=jnp.float64) / 3

        def f(a: jax.Array) -> list[jax.Array]:
            return [a * a]

        helped = _helper.compile_in_helper(f, _sds(x), ())
        assert helped is not None
        (out,) = helped.executable(x)
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x) ** 2)
    finally:
        jax.config.update("jax_enable_x64", previous)


def test_what_cannot_travel_is_left_to_this_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sharded or weak-typed program, one that cannot be exported (a host
    callback), or any program with ``JAXAOT_COMPILE_HELPER=0``: ``None`` (the
    caller compiles it), with no warning."""
    x = jnp.ones((3,), jnp.float32)

    def f(a: jax.Array) -> list[jax.Array]:
        return [a + 1]

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    weak = jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        assert _helper.compile_in_helper(f, _sds(x), (), shardings=[sharding]) is None
        assert _helper.compile_in_helper(f, [weak], ()) is None

        def calls_back(a: jax.Array) -> list[jax.Array]:
            return [jax.pure_callback(np.sin, jax.ShapeDtypeStruct(a.shape, a.dtype), a)]

        assert _helper.compile_in_helper(calls_back, _sds(x), ()) is None
        monkeypatch.setenv(_helper.ENV, "0")
        assert not _helper.helper_enabled()
        assert _helper.compile_in_helper(f, _sds(x), ()) is None
    assert not caplog.records
    assert not _helper._FAILED.is_set()


def test_a_failing_helper_warns_once_and_programs_compile_here(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A helper that fails (here: exits at once) gives one warning naming the
    cause; from then on no helper is started and whole programs are compiled in
    this process, with the right values."""
    monkeypatch.setattr(_helper, "_COMMAND", "import sys; sys.exit(3)")
    x = jnp.arange(4.0)

    def f(a: jax.Array) -> list[jax.Array]:
        return [a * 3]

    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        assert _helper.compile_in_helper(f, _sds(x), ()) is None
        assert not _helper.helper_enabled()
        assert _helper.compile_in_helper(f, _sds(x), ()) is None
        programs = _programs.ProgramCache("whole program", helper=True)
        avals = (jax.core.ShapedArray((4,), jnp.float32),)
        exe = programs.program("a" * 64, avals, avals, (), f, lambda: False)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "exit status 3" in warnings[0], warnings
    np.testing.assert_array_equal(np.asarray(exe(x)[0]), np.asarray(x) * 3)
    assert programs.payload(exe) is None  # compiled here


def test_a_whole_program_made_in_the_helper_is_stored_and_loaded_elsewhere() -> None:
    """``ProgramCache`` (whole programs) compiles in the helper, keeps the bytes
    the executable came in (an XLA:CPU executable loaded from bytes cannot be
    serialized again) and stores them: another process's ``ProgramCache``
    loads that executable and compiles nothing."""
    ws = jnp.full((3, 4, 4), 0.25, jnp.float32)
    v = jnp.ones((2, 4), jnp.float32)
    avals = tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in (ws, v))
    out_avals = tuple(
        jax.core.ShapedArray(o.shape, o.dtype) for o in jax.eval_shape(_layers, ws, v)
    )
    made = _programs.ProgramCache("whole program", helper=True)
    exe = made.program("b" * 64, avals, out_avals, (), _layers, lambda: False)
    assert made.payload(exe) is not None  # the helper's bytes
    assert made.counters.info().compiles == 1
    jaxaot.wait_for_writes()
    other = _programs.ProgramCache("whole program", helper=True)
    loaded = other.cached("b" * 64, avals, ())
    assert loaded is not None and other.counters.info().compiles == 0
    for a, b in zip(loaded(ws, v), jax.jit(_layers)(ws, v), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jaxaot_jit_runs_a_whole_program_from_the_helper(compiles: list[str]) -> None:
    """``jaxaot.jit``'s whole-program form is compiled in the helper (no XLA
    compile of it in this process) and gives the split program's values and
    gradients."""
    step = jaxaot.jit(jax.value_and_grad(lambda bs, x: loss(bs, x, block)))
    blocks, x = setup(6)
    split = jax.block_until_ready(step(blocks, x))
    (plan,) = step._plans.values()
    before = len(compiles)
    jax.block_until_ready(step(blocks, x))  # the whole program starts
    assert plan.whole is not None
    exe = plan.whole.result()
    assert len(compiles) == before  # not compiled in this process
    assert _programs.WHOLE.payload(exe) is not None
    leaves: Any = jax.tree_util.tree_leaves((blocks, x))
    whole = plan.run_whole(exe, leaves)
    for a, b in zip(whole, jax.tree_util.tree_leaves(split), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    plan.mode = _plan.WHOLE  # as if chosen: calls go through JAX's C++ dispatcher,
    jax.block_until_ready(step(blocks, x))  # which loads the executable from its bytes
    _pool.wait_for_background()
    (job,) = plan._structured.values()
    assert job.exception() is None
    for a, b in zip(jax.tree_util.tree_leaves(step(blocks, x)), whole, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_program_the_helper_cannot_compile_is_compiled_here_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A helper that answers that this program failed to compile (the program's
    fault, not the helper's): ``None``, no warning, and the helper stays in use."""
    answer = "{'error': 'XlaRuntimeError: no', 'pid': 1, 'niceness': 19}"
    monkeypatch.setattr(
        _helper,
        "_COMMAND",
        f"import pickle, sys; sys.stdin.buffer.read(); sys.stdout.buffer.write(pickle.dumps({answer}))",
    )
    x = jnp.arange(4.0)
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        assert _helper.compile_in_helper(lambda a: [a + 1], _sds(x), ()) is None
    assert not caplog.records
    assert _helper.helper_enabled()
