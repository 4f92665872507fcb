"""The plan of a split program and its steady state: the choice between the split
program and its whole-program form (``jaxaot._plan``)."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from _steps import block, close, loss, settle, setup, train_step_factory

import jaxaot
from jaxaot._regional import _plan, _programs
from jaxaot.cli import _model


class _VirtualClock:
    """The plan's clock in these tests: it advances only by the time the stand-in
    forms say they take, so a busy machine cannot change what is measured."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


_CLOCK = _VirtualClock()


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The virtual clock, and a whole program whatever the split program's calls
    take (these tests are about the choice between the two)."""
    monkeypatch.setattr(_plan, "time", _CLOCK)


def test_whole_program_gives_jax_jit_results_and_the_faster_form_is_kept() -> None:
    step, optimizer = train_step_factory(block)
    plain, _ = train_step_factory(_model.block)
    blocks, x = setup(4)
    state = optimizer.init(blocks)
    regional = jaxaot.jit(step)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        plan = settle(regional, lambda: (blocks, state, x))
    assert plan.whole is not None and plan.whole.exception() is None
    split, whole = plan.timings[_plan.SPLIT], plan.timings[_plan.WHOLE]
    assert len(split) >= _plan.SAMPLES and len(whole) >= _plan.SAMPLES
    faster = _plan.WHOLE if statistics.median(whole) < statistics.median(split) else _plan.SPLIT
    assert plan.mode == faster
    want = jax.jit(plain)(blocks, state, x)
    for mode in (_plan.WHOLE, _plan.SPLIT):
        plan.mode = mode
        a, b = regional(blocks, state, x), want
        close(a, b)
        for _ in range(2):  # steps in a row stay in agreement
            a = regional(a[0], a[1], x)
            b = jax.jit(plain)(b[0], b[1], x)
        close(a, b, tol=1e-4)


def test_whole_program_never_blocks_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    release = threading.Event()
    program = _programs.WHOLE.program

    def slow(*args: Any) -> Any:
        assert release.wait(60)
        return program(*args)

    monkeypatch.setattr(_programs.WHOLE, "program", slow)
    blocks, x = setup(3)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    want = jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x)
    for _ in range(4):  # the whole program is stuck compiling: the split program answers
        close(grad(blocks, x), want)
    (plan,) = grad._plans.values()
    assert plan.whole is not None and not plan.whole.done() and plan.pending()
    release.set()
    plan = settle(grad, lambda: (blocks, x))
    close(grad(blocks, x), want)


def test_a_failed_whole_program_leaves_the_split_program(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("no whole program today")

    monkeypatch.setattr(_programs.WHOLE, "program", broken)
    caplog.set_level("DEBUG", logger="jaxaot")
    blocks, x = setup(2)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    plan = settle(grad, lambda: (blocks, x))
    assert plan.mode == _plan.SPLIT
    assert any("no whole-program executable" in r.getMessage() for r in caplog.records)
    close(grad(blocks, x), jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x))


def test_whole_program_donates_like_jax_jit() -> None:
    step, optimizer = train_step_factory(block)
    blocks, x = setup(3)
    state = optimizer.init(blocks)
    expected = jax.jit(step)(blocks, state, x)
    regional = jaxaot.jit(step, donate_argnums=(0, 1))

    def fresh() -> tuple[Any, Any, jax.Array]:
        copy = jax.tree_util.tree_map(jnp.copy, (blocks, state))
        return copy[0], copy[1], x

    plan = settle(regional, fresh)
    plan.mode = _plan.WHOLE
    b, s, _ = fresh()
    got = regional(b, s, x)
    close(got, expected)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves((b, s)))
    assert not x.is_deleted()


def test_whole_program_off_on_request() -> None:
    blocks, x = setup(2)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)), whole_program=False)
    for _ in range(4):
        grad(blocks, x)
    (plan,) = grad._plans.values()
    assert plan.whole is None and plan.mode == _plan.SPLIT


def test_the_choice_times_each_form_after_a_call_of_the_same_form(
    monkeypatch: pytest.MonkeyPatch,
    virtual_clock: None,
) -> None:
    """A form's call right after the other form's pays some of that form's costs:
    here every whole-program call that follows a split call takes 60 ms more (the
    split program's leftovers), while back to back it is the faster form. The choice
    times each form in runs of calls of the same form, not those first calls, so it
    keeps the whole program; alternating single calls would have kept the split one."""
    blocks, x = setup(3)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    want = jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x)
    close(grad(blocks, x), want)
    (plan,) = grad._plans.values()
    forms: list[str] = []
    run, run_whole = plan.run, plan.run_whole

    def split_run(leaves: Any) -> Any:
        forms.append(_plan.SPLIT)
        _CLOCK.sleep(0.03)
        return run(leaves)

    def whole_run(exe: Any, leaves: Any) -> Any:
        after_split = bool(forms) and forms[-1] == _plan.SPLIT
        forms.append(_plan.WHOLE)
        _CLOCK.sleep(0.07 if after_split else 0.01)
        return run_whole(exe, leaves)

    monkeypatch.setattr(plan, "run", split_run)
    monkeypatch.setattr(plan, "run_whole", whole_run)
    settle(grad, lambda: (blocks, x))
    assert plan.mode == _plan.WHOLE
    # Runs of the same form while choosing (the split calls before the whole program
    # was ready come first).
    first_whole = forms.index(_plan.WHOLE)
    runs = [len(list(g)) for _, g in itertools.groupby(forms[first_whole:])]
    assert all(n == _plan.RUN for n in runs[:-1]) and len(runs) >= 4
    close(grad(blocks, x), want)


def test_the_choice_goes_by_each_forms_typical_call_not_its_fastest(
    monkeypatch: pytest.MonkeyPatch,
    virtual_clock: None,
) -> None:
    """A split program of many small executables varies from call to call, and now
    and then one is much faster than it usually is. Here one split call in four
    takes 5 ms and the others 60 ms, while every whole-program call takes 20 ms:
    the choice keeps the whole program (by fastest calls it would keep the split
    one), and the whole program still gives ``jax.grad``'s result."""
    blocks, x = setup(3)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    want = jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x)
    close(grad(blocks, x), want)
    (plan,) = grad._plans.values()
    split_calls = itertools.count()
    run, run_whole = plan.run, plan.run_whole

    def split_run(leaves: Any) -> Any:
        _CLOCK.sleep(0.005 if next(split_calls) % 4 == 1 else 0.06)
        return run(leaves)

    def whole_run(exe: Any, leaves: Any) -> Any:
        _CLOCK.sleep(0.02)
        return run_whole(exe, leaves)

    monkeypatch.setattr(plan, "run", split_run)
    monkeypatch.setattr(plan, "run_whole", whole_run)
    settle(grad, lambda: (blocks, x))
    split = plan.timings[_plan.SPLIT]
    assert min(split) < min(plan.timings[_plan.WHOLE])  # the fastest split call is faster
    assert plan.mode == _plan.WHOLE
    close(grad(blocks, x), want)


def _timed_forms(
    monkeypatch: pytest.MonkeyPatch, plan: _plan.Plan, seconds: dict[str, float]
) -> dict[str, int]:
    """Makes each form of ``plan`` take ``seconds[form]`` more a call (changeable
    later); returns how many calls of each form were made."""
    made = {_plan.SPLIT: 0, _plan.WHOLE: 0}
    run, run_whole = plan.run, plan.run_whole

    def split_run(leaves: Any) -> Any:
        made[_plan.SPLIT] += 1
        _CLOCK.sleep(seconds[_plan.SPLIT])
        return run(leaves)

    def whole_run(exe: Any, leaves: Any) -> Any:
        made[_plan.WHOLE] += 1
        _CLOCK.sleep(seconds[_plan.WHOLE])
        return run_whole(exe, leaves)

    monkeypatch.setattr(plan, "run", split_run)
    monkeypatch.setattr(plan, "run_whole", whole_run)
    return made


def _settled_grad(
    monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float], blocks: Any, x: Any, want: Any
) -> tuple[Any, _plan.Plan, dict[str, int]]:
    """A ``jaxaot.jit`` gradient of 3 blocks whose forms take ``seconds`` more a
    call, run until its first choice: the function, its plan, the calls made."""
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    close(grad(blocks, x), want)
    (plan,) = grad._plans.values()
    made = _timed_forms(monkeypatch, plan, seconds)
    settle(grad, lambda: (blocks, x))
    return grad, plan, made


def test_a_close_choice_of_the_split_program_is_timed_again_and_can_change(
    monkeypatch: pytest.MonkeyPatch, virtual_clock: None
) -> None:
    """The split program measures a little faster (20 ms against 24 ms) and is
    kept; later it is slower (the machine's load changed). After the calls of
    ``RECHECK_AFTER``, both forms are timed again from fresh samples and the whole
    program is chosen; it gives ``jax.grad``'s result."""
    monkeypatch.setattr(_plan, "RECHECK_AFTER", (6, 10))
    blocks, x = setup(3)
    want = jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x)
    seconds = {_plan.SPLIT: 0.02, _plan.WHOLE: 0.024}
    grad, plan, made = _settled_grad(monkeypatch, seconds, blocks, x, want)
    assert plan.mode == _plan.SPLIT and not plan.settled()
    seconds[_plan.SPLIT] = 0.06
    for _ in range(5):  # the split program runs, and nothing is timed
        close(grad(blocks, x), want)
    assert plan.mode == _plan.SPLIT and made[_plan.WHOLE] <= 2 * _plan.SAMPLES + 2
    before = made[_plan.WHOLE]
    close(grad(blocks, x), want)  # the 6th: timing starts again
    assert plan.pending() and plan.timings == {_plan.SPLIT: [], _plan.WHOLE: []}
    settle(grad, lambda: (blocks, x))
    assert plan.mode == _plan.WHOLE and plan.settled() and made[_plan.WHOLE] > before
    assert min(plan.timings[_plan.SPLIT]) >= 0.06  # fresh samples only
    close(grad(blocks, x), want)


@pytest.mark.parametrize(("overhead", "chosen"), [(0.0, _plan.SPLIT), (0.002, _plan.WHOLE)])
def test_the_split_program_is_charged_its_callers_python_path(
    monkeypatch: pytest.MonkeyPatch, virtual_clock: None, overhead: float, chosen: str
) -> None:
    """The split program's calls measure 20 ms, the whole program's 21 ms. A
    split call also costs its caller's Python path (finding the plan, building
    the result tree), which a whole-program call skips (JAX's C++ dispatcher):
    charged 2 ms a call, the split program loses; charged nothing, it wins."""
    blocks, x = setup(3)
    want = jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    close(grad(blocks, x), want)
    (plan,) = grad._plans.values()
    _timed_forms(monkeypatch, plan, {_plan.SPLIT: 0.02, _plan.WHOLE: 0.021})
    seen: list[float] = []

    def note(seconds: float) -> None:
        seen.append(seconds)
        plan.overhead = overhead

    monkeypatch.setattr(plan, "note_overhead", note)
    settle(grad, lambda: (blocks, x))
    assert seen and all(s > 0 for s in seen)  # measured on every call while choosing
    assert plan.mode == chosen
    close(grad(blocks, x), want)


def test_the_least_overhead_seen_is_kept_and_a_recheck_forgets_it() -> None:
    plan = _plan.Plan(
        name="f",
        n_inputs=0,
        fixed=(),
        n_consts=0,
        n_slots=1,
        steps=[],
        out_slots=(),
        out_tree=jax.tree_util.tree_structure(()),
        delete_after=(),
        donated=(),
        start_whole=None,
    )
    for seconds in (3e-4, 1e-4, 2e-4):
        plan.note_overhead(seconds)
    assert plan.overhead == 1e-4
    plan._recheck_in = 1
    plan._count_down()
    assert plan.overhead is None and plan.pending()


def test_a_clear_or_imposed_choice_is_not_timed_again(
    monkeypatch: pytest.MonkeyPatch, virtual_clock: None
) -> None:
    """A split program far faster than the whole program (10 ms against 40 ms)
    is kept for good; so is a form set from outside after a close choice."""
    monkeypatch.setattr(_plan, "RECHECK_AFTER", (3, 3))
    blocks, x = setup(3)
    want = jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x)
    seconds = {_plan.SPLIT: 0.01, _plan.WHOLE: 0.04}
    grad, plan, made = _settled_grad(monkeypatch, seconds, blocks, x, want)
    assert plan.mode == _plan.SPLIT and plan.settled()
    before = made[_plan.WHOLE]
    seconds[_plan.SPLIT] = 0.05
    for _ in range(8):
        close(grad(blocks, x), want)
    assert made[_plan.WHOLE] == before and plan.mode == _plan.SPLIT and plan.settled()
    # A close choice, then the form set from outside (as ``jaxaot bench`` does);
    # on another cache (on this one the choice above is recorded, and followed).
    close_seconds = {_plan.SPLIT: 0.02, _plan.WHOLE: 0.024}
    jaxaot.set_cache(jaxaot.MemoryCache())
    grad2, plan2, made2 = _settled_grad(monkeypatch, close_seconds, blocks, x, want)
    assert plan2.mode == _plan.SPLIT and not plan2.settled()
    plan2.mode = _plan.SPLIT
    before = made2[_plan.WHOLE]
    for _ in range(8):
        close(grad2(blocks, x), want)
    assert made2[_plan.WHOLE] == before and plan2.settled()


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


def test_big_executables_are_kept_without_a_whole_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the split program's executables take a millisecond or more each (its
    second call, timed), no whole program is made: it would save nothing, and its
    background compile would slow the steps beside it."""
    monkeypatch.setattr(_plan, "time", _CLOCK)
    monkeypatch.delenv("JAXAOT_WHOLE_PROGRAM_BELOW_MS")
    blocks, x = setup(3)
    grad = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    want = jax.grad(lambda bs, x: loss(bs, x, _model.block))(blocks, x)
    close(grad(blocks, x), want)
    (plan,) = grad._plans.values()
    run = plan.run

    def slow_run(leaves: Any) -> Any:
        _CLOCK.sleep(len(plan.steps) * 2 * _plan.SPLIT_ONLY_SECONDS)
        return run(leaves)

    monkeypatch.setattr(plan, "run", slow_run)
    for _ in range(4):
        close(grad(blocks, x), want)
    assert plan.mode == _plan.SPLIT and plan.settled() and plan.whole is None
    # Below the threshold (set here, as a busy machine can slow any call), the
    # whole program is made and chosen between.
    # (On another cache: on this one the choice above is recorded, and followed.)
    monkeypatch.setenv("JAXAOT_WHOLE_PROGRAM_BELOW_MS", str(1e6))
    small = jaxaot.jit(jax.grad(lambda bs, x: loss(bs, x, block)))
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        settled = settle(small, lambda: (blocks, x))
    assert settled.whole is not None
    monkeypatch.setenv("JAXAOT_WHOLE_PROGRAM_BELOW_MS", "soon")
    with pytest.raises(ValueError, match="JAXAOT_WHOLE_PROGRAM_BELOW_MS"):
        _plan.split_only_seconds()
