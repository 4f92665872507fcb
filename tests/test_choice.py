"""The steady-state form a process settled on, kept in the cache for the next
process (``jaxaot._regional._choice``)."""

from __future__ import annotations

from typing import Any

import jax
import pytest
from _steps import block, close, loss, settle, setup

import jaxaot
from jaxaot import _regional
from jaxaot._regional import _choice, _plan, _programs
from jaxaot.cli import _model


def _grad() -> Any:
    return jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))


def _want(blocks: Any, x: jax.Array) -> Any:
    return jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x)


def test_recall_gives_what_was_remembered_for_that_program_only() -> None:
    avals = (jax.core.ShapedArray((2, 3), jax.numpy.float32),)
    assert _choice.recall("a" * 64, avals, ()) is None
    _choice.remember("a" * 64, avals, (), "whole", {"whole": 1.0, "split": 2.0})
    assert _choice.recall("a" * 64, avals, ()) == "whole"
    assert _choice.recall("b" * 64, avals, ()) is None  # another program
    assert _choice.recall("a" * 64, avals, (0,)) is None  # another donation
    other = (jax.core.ShapedArray((2, 4), jax.numpy.float32),)
    assert _choice.recall("a" * 64, other, ()) is None  # other types
    _choice.remember("c" * 64, avals, (), "bogus", {})  # not a form: nothing recorded
    assert _choice.recall("c" * 64, avals, ()) is None


def test_without_a_cache_nothing_is_recorded_or_recalled() -> None:
    avals = (jax.core.ShapedArray((2,), jax.numpy.float32),)
    with jaxaot.using_cache(None):
        _choice.remember("d" * 64, avals, (), "split", {})
        assert _choice.recall("d" * 64, avals, ()) is None
    assert _choice.recall("d" * 64, avals, ()) is None


def test_the_next_function_starts_in_the_settled_form_untimed() -> None:
    """A function settles by timing both forms; its choice is recorded. The next
    function of the same program, on the same cache (a warm process), runs the
    recorded form without timing either; values are jax.grad's."""
    blocks, x = setup(3)
    want = _want(blocks, x)
    first = _grad()
    plan = settle(first, lambda: (blocks, x))
    assert len(plan.timings[_plan.SPLIT]) >= _plan.SAMPLES
    while not plan.settled():  # a close choice is timed again before it is recorded
        jax.block_until_ready(first(blocks, x))
    chosen = plan.mode
    _regional.wait_for_background()
    second = _grad()
    close(second(blocks, x), want)
    (again,) = second._plans.values()
    settle(second, lambda: (blocks, x))
    assert again.mode == chosen and again.settled()
    assert again.timings == {_plan.SPLIT: [], _plan.WHOLE: []}  # nothing timed
    close(second(blocks, x), want)


@pytest.mark.parametrize("form", ["split", "whole"])
def test_a_recorded_form_is_followed(form: str) -> None:
    """Whatever form is recorded for the program, a new function runs it: the
    split program makes no whole program at all; the whole program is loaded
    from the cache (no compile) and runs from then on. Values are jax.grad's."""
    blocks, x = setup(3)
    want = _want(blocks, x)
    first = _grad()
    plan = settle(first, lambda: (blocks, x))
    assert plan.whole is not None
    plan.whole.result()
    _regional.wait_for_background()
    plan.mode = form  # whatever was measured: record ``form``
    plan._settle({})
    _regional.wait_for_background()
    compiles = _programs.WHOLE.counters.info().compiles
    second = _grad()
    close(second(blocks, x), want)
    (again,) = second._plans.values()
    settle(second, lambda: (blocks, x))
    assert again.mode == form and again.settled()
    assert again.timings == {_plan.SPLIT: [], _plan.WHOLE: []}
    assert (again.whole is None) == (form == "split")
    assert _programs.WHOLE.counters.info().compiles == compiles
    for _ in range(3):
        close(second(blocks, x), want)


def test_a_split_program_of_big_executables_is_recorded_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A split program whose executables take long (here: every one, as the
    threshold is 0) is kept without a whole program, and that is recorded: the
    next function does not even time its second call."""
    monkeypatch.setenv("JAXAOT_WHOLE_PROGRAM_BELOW_MS", "0")
    blocks, x = setup(3)
    first = _grad()
    settle(first, lambda: (blocks, x))
    (plan,) = first._plans.values()
    assert plan.mode == _plan.SPLIT and plan.whole is None
    _regional.wait_for_background()
    measured: list[float] = []
    threshold = _plan.split_only_seconds

    def counted() -> float:
        measured.append(1.0)
        return threshold()

    monkeypatch.setattr(_plan, "split_only_seconds", counted)
    second = _grad()
    second(blocks, x)
    (again,) = second._plans.values()
    settle(second, lambda: (blocks, x))
    assert again.mode == _plan.SPLIT and again.whole is None and again.settled()
    assert measured == []  # no call was timed against the threshold
