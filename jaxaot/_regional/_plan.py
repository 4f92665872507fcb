"""The execution plan of a split program (``jaxaot.jit``), and its steady state.

A plan runs its steps (component executables and glue programs) in order.
Values live in a list of slots: each step reads its inputs and writes its
outputs at slot indices worked out once, when the plan is made, so a call
costs little more than the executables it runs.

Once the split program has run, its second call is timed: where its
executables take a millisecond or more each, the split program is kept (a
whole program would save nothing). Otherwise a whole-program form of it (one
executable, repeated layers as a loop: see ``_whole``) is compiled in the
background, on threads of low priority.
When it is ready, the next calls run each form a few times, timed to
completion, and the faster one (by its median call; the split program also
charged its caller's Python path, see ``overhead``) runs every later call.
A split program kept over a whole program that measured close to it is timed
against it again later (``RECHECK_AFTER``). No call waits for the whole
program: until it is ready (or if it fails) the split program runs.

The form settled on is recorded in the cache (``_choice``); a plan of the same
program in a later process reads it first and runs that form untimed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import operator
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .._env import number

logger = logging.getLogger("jaxaot")

# Timed calls of each form before choosing (the first call of each run of calls,
# below, is not timed). The median of each decides: a form whose calls vary (a
# split program of many small executables, now and then overlapping well) has a
# fastest call far below its typical one, and the typical one is what every later
# step pays; a few calls slowed by a busy machine move the median little.
SAMPLES = 5
# While choosing, each form runs this many calls in a row, and the first call of
# each run is not timed: a call measured right after the other form's measures
# some of that form's costs too (its buffers being freed, caches it evicted),
# which in back-to-back steps it would not pay.
RUN = 3
# A split program kept over a whole program whose median call was within
# RECHECK_MARGIN times its own is timed against it again, afresh, after this many
# more calls, then (if still close) after the next number: a split program of
# millisecond steps varies with what else the machine is doing, and one choice
# made at start-up would decide every later step. A whole program kept is not
# timed again (it is one executable, and its calls may bypass Python).
RECHECK_AFTER = (100, 1000)
RECHECK_MARGIN = 1.25
# A split program whose executables take this long each (the second call, timed)
# is kept without a whole-program form: entering and leaving an executable costs
# microseconds, so a whole program would save well under 1 % of such a step,
# while its background compile (of a program as big as the step) would slow the
# steps beside it for a while. ``JAXAOT_WHOLE_PROGRAM_BELOW_MS`` overrides it
# (milliseconds; ``inf``: always a whole program).
SPLIT_ONLY_SECONDS = 1e-3


def split_only_seconds() -> float:
    """:data:`SPLIT_ONLY_SECONDS`, or ``$JAXAOT_WHOLE_PROGRAM_BELOW_MS`` in seconds."""
    ms = number(
        "JAXAOT_WHOLE_PROGRAM_BELOW_MS", SPLIT_ONLY_SECONDS * 1e3, "a number of milliseconds"
    )
    return ms / 1e3


SPLIT = "split"
WHOLE = "whole"


class PlanFailed(Exception):
    """An executable of a plan could not be made; nothing was donated yet."""


def _getter(slots: Sequence[int]) -> Callable[[list[Any]], Sequence[Any]]:
    if len(slots) >= 2:
        return operator.itemgetter(*slots)
    if len(slots) == 1:
        slot = slots[0]
        return lambda env: (env[slot],)
    return lambda env: ()


@dataclass
class Step:
    """One executable in a split program: a component call or a glue program."""

    kind: str  # "component" or "glue"
    job: concurrent.futures.Future[Any]  # the executable, loaded or compiled in the background
    ins: tuple[int, ...]  # slots of its inputs
    outs: tuple[int, ...]  # slots of its outputs
    label: str
    donates: bool

    def executable(self) -> Any:
        """The executable (taking and returning flat lists), waiting for it if need be."""
        try:
            return self.job.result()
        except Exception as e:
            raise PlanFailed(f"{self.label}: {type(e).__name__}: {e}") from e


class Plan:
    """A split program for one input signature.

    Slots ``0 .. n_inputs - 1`` hold the inputs, the next ones ``fixed`` (the
    program's constants, then literals), the rest the steps' outputs.

    Its executables are loaded or compiled on a few threads while the first call
    already runs the steps whose executables are ready: the first layers' forward
    pass runs while the backward executable compiles. Before the first step that
    donates an input (and before donated inputs are deleted), the plan waits for
    every executable, so a failure leaves the inputs intact for ``jax.jit``."""

    def __init__(
        self,
        *,
        name: str,
        n_inputs: int,
        fixed: Sequence[Any],
        n_consts: int,
        n_slots: int,
        steps: list[Step],
        out_slots: Sequence[int],
        out_tree: Any,
        delete_after: Sequence[int],
        donated: Sequence[int],
        start_whole: Callable[[], tuple[concurrent.futures.Future[Any], int, bool] | None] | None,
        out_shardings: Sequence[Any] | None = None,
        in_flight: int | None = None,
        summary: str = "",
        served_whole: str | None = None,
        program: tuple[concurrent.futures.Future[Any], bool, Callable[[Any], bytes | None]]
        | None = None,
        recalled: concurrent.futures.Future[str | None] | None = None,
        remember: Callable[[str, dict[str, float]], None] | None = None,
    ) -> None:
        self.name = name
        self.summary = summary  # what the program was split into (``jaxaot.jit(...).explain``)
        # Why the program runs as one region (one cached program), where it does.
        self.served_whole = served_whole
        self.n_inputs = n_inputs
        self.fixed = list(fixed)
        self.n_consts = n_consts  # the first ``n_consts`` of ``fixed`` are the program's constants
        self.consts = tuple(self.fixed[:n_consts])
        self.blank = [None] * (n_slots - n_inputs - len(self.fixed))
        self.steps = steps
        self.out_slots = tuple(out_slots)
        self.out_tree = out_tree
        self.delete_after = list(delete_after)
        self.donated = list(donated)
        # Per flat output, the sharding ``out_shardings`` asks for (None: as computed).
        self.out_shardings = None if out_shardings is None else list(out_shardings)
        self.ready = False
        # At most this many steps queued before waiting for the oldest (None: no limit).
        self.in_flight = in_flight
        # Per step, the slots to drop once it has run: the intermediates it is the
        # last to read (or writes and nothing reads), so a step's memory is
        # released as soon as nothing needs it, as in one XLA program, not when
        # the call returns (an inference pass would otherwise hold every layer's
        # activations).
        self._dead = _last_uses(steps, n_inputs + len(self.fixed), self.out_slots)
        self._fast: list[
            tuple[Any, Callable[[list[Any]], Sequence[Any]], tuple[int, ...], tuple[int, ...]]
        ] = []
        self._get_out = _getter(self.out_slots)
        # The steady state: which form runs, and what was measured to choose it.
        self._lock = threading.Lock()
        self._start_whole = start_whole
        # Called when the mode leaves WHOLE (a C++ dispatcher sending calls
        # straight to the whole-program executable forgets them then).
        self.on_leave_whole: Callable[[], None] | None = None
        self._mode: str | None = None if start_whole is not None else SPLIT
        self._measured = False  # the split program's timed call is made
        self.whole: concurrent.futures.Future[Any] | None = None
        self.whole_calls: int | None = None  # component calls the whole program binds
        self.whole_calls_back = False  # whether it calls back into Python
        self.calls = 0
        self.timings: dict[str, list[float]] = {SPLIT: [], WHOLE: []}
        # What a split call costs its caller beyond ``run`` (the Python path that
        # finds the plan and builds the result tree), where a whole-program call
        # skips that path (JAX's C++ dispatcher): the least seen while choosing.
        self.overhead: float | None = None
        # The form an earlier process settled on, being read from the cache (see
        # ``_choice``); ``remember`` records the form this one settles on.
        self._recalled = recalled
        self._remember = remember
        self._trusted = False  # the whole program runs once ready, untimed (recalled)
        self._previous: str | None = None  # the form of the last timed-or-not call
        self._streak = 0  # calls of that form in a row
        # Split calls left before both forms are timed again (None: not again),
        # and the later intervals still to come.
        self._recheck_in: int | None = None
        self._rechecks = list(RECHECK_AFTER)
        # The whole-program executable taking the program's arguments as a tree
        # (for JAX's C++ dispatch), by the tree's structure; see ``structured``.
        self._structured: dict[Any, concurrent.futures.Future[Any]] = {}
        # A program served whole (``program``: its executable's job, whether it
        # calls back into Python, and where its bytes are) has no steps: it runs
        # as a whole program does, from its first call.
        self._payload: Callable[[Any], bytes | None] | None = None
        if program is not None:
            self.whole, self.whole_calls_back, self._payload = program
            self._mode = WHOLE

    @property
    def mode(self) -> str | None:
        """``SPLIT`` or ``WHOLE`` once chosen, ``None`` while choosing."""
        return self._mode

    @mode.setter
    def mode(self, value: str | None) -> None:
        """Sets the form (a form set from outside is kept: no later re-check)."""
        left = self._mode is WHOLE and value is not WHOLE
        self._mode = value
        self._recheck_in = None
        if left and self.on_leave_whole is not None:
            self.on_leave_whole()

    def structured(
        self,
        in_tree: Any,
        submit: Callable[[Callable[[], Any]], concurrent.futures.Future[Any]],
        payload: Callable[[Any], bytes | None],
    ) -> Any | None:
        """The whole-program executable as a ``jax.stages.Compiled`` taking the
        arguments whose ``(args, kwargs)`` tree is ``in_tree`` and returning the
        program's output tree: the same executable, loaded again with those trees
        from ``payload(executable)`` (the bytes it was loaded from) or else from
        its serialization; ``submit`` runs that on a background thread. ``None``
        until it is ready, or if it is not made (constants, host callbacks, no
        whole program)."""
        whole = self.whole
        payload = self._payload or payload
        if self.consts or self.whole_calls_back or whole is None:
            return None  # (a program calling back would run its callbacks on the zeros below)
        if not whole.done() or whole.exception() is not None:
            return None
        with self._lock:
            job = self._structured.get(in_tree)
            if job is None:
                flat = whole.result()
                out_tree = self.out_tree

                def load() -> Any:
                    from .._jax import deserialize_executable, serialize_executable

                    data = payload(flat)
                    if data is None:
                        data = serialize_executable(flat)[0]
                    exe = deserialize_executable(data, in_tree, out_tree)
                    # Run once on zeros before any call relies on it: an executable
                    # loaded from the cache and serialized again can lack its
                    # kernels on XLA:CPU ("Function ... not found" when it runs).
                    # (Made on the host and put on the device: no XLA compile.)
                    zeros = [
                        jax.device_put(np.zeros(info.shape, info.dtype))
                        for info in jax.tree_util.tree_leaves(flat.args_info)
                    ]
                    args, kwargs = jax.tree_util.tree_unflatten(in_tree, zeros)
                    jax.block_until_ready(exe(*args, **kwargs))
                    return exe

                job = self._structured[in_tree] = submit(load)
        if not job.done() or job.exception() is not None:
            return None
        return job.result()

    # -- the split program ----------------------------------------------------

    def wait(self) -> None:
        """Waits for every executable; raises ``PlanFailed`` if one could not be made."""
        if self._payload is not None:  # served whole
            self._whole_executable()
        if not self.ready:
            fast = [
                (step.executable(), _getter(step.ins), step.outs, dead)
                for step, dead in zip(self.steps, self._dead, strict=True)
            ]
            self._fast = fast
            self.ready = True

    def _env(self, leaves: Sequence[Any]) -> list[Any]:
        env = list(leaves)
        env += self.fixed
        env += self.blank
        return env

    def run(self, leaves: Sequence[Any]) -> list[Any]:
        """Runs the split program; its flat outputs."""
        env = self._env(leaves)
        if self.ready and self.in_flight is None:
            for exe, get, outs, dead in self._fast:
                for slot, value in zip(outs, exe(*get(env)), strict=True):
                    env[slot] = value
                for slot in dead:
                    env[slot] = None
        else:
            self._run_steps(env, self.in_flight)
        out = list(self._get_out(env))
        if self.delete_after:
            self.wait()
            _delete(leaves, self.delete_after, out)
        return out

    def _run_steps(self, env: list[Any], limit: int | None) -> None:
        """The steps one by one, each as soon as its executable is ready (waiting for
        every executable before the first that donates), with at most ``limit`` of
        them queued (``None``: no limit); then waits for every executable: from
        then on, the fast loop (where there is no limit)."""
        queued: list[Sequence[Any]] = []
        for step, dead in zip(self.steps, self._dead, strict=True):
            if step.donates:
                self.wait()
            if limit is not None and len(queued) >= limit:
                jax.block_until_ready(queued.pop(0))
            results = step.executable()(*[env[i] for i in step.ins])
            for slot, value in zip(step.outs, results, strict=True):
                env[slot] = value
            for slot in dead:
                env[slot] = None
            if limit is not None:
                queued.append(results)
        self.wait()

    # -- the whole program and the choice -------------------------------------

    def run_whole(self, exe: Any, leaves: Sequence[Any]) -> list[Any]:
        """Runs the whole-program executable; its flat outputs."""
        out = list(exe(*leaves, *self.consts))
        if self.donated:
            _delete(leaves, self.donated, out)
        return out

    def __call__(self, leaves: Sequence[Any]) -> list[Any]:
        mode = self.mode
        if mode is SPLIT:
            if self._recheck_in is not None:
                self._count_down()
            return self.run(leaves)
        if mode is WHOLE:
            return self.run_whole(self._whole_executable(), leaves)
        return self._undecided(leaves)

    def _whole_executable(self) -> Any:
        """The whole-program executable, waiting for it if need be (a program served
        whole runs it from its first call: raises ``PlanFailed`` if it could not be
        made)."""
        assert self.whole is not None
        try:
            return self.whole.result()
        except Exception as e:
            raise PlanFailed(f"the whole program: {type(e).__name__}: {e}") from e

    def _recall(self) -> bool:
        """Takes the form an earlier process settled on (read from the cache since
        the plan was made; waited for here): the split program for good, or the
        whole program once it is loaded, untimed. Whether one was recorded."""
        recalled = self._recalled
        if recalled is None:
            return False
        concurrent.futures.wait([recalled])
        form = recalled.result() if recalled.exception() is None else None
        with self._lock:
            if self._recalled is not recalled:
                return False
            self._recalled = None
            if form is None:
                return False  # none recorded: chosen here, by timing
            logger.debug("jaxaot.jit %s: the %s program, as recorded", self.name, form)
            if form == SPLIT or self._start_whole is None:
                self.mode = SPLIT
                return True
            started = self._start_whole()
            if started is None:
                self.mode = SPLIT
            else:
                self.whole, self.whole_calls, self.whole_calls_back = started
                self._trusted = True
        return True

    def _undecided(self, leaves: Sequence[Any]) -> list[Any]:
        with self._lock:
            self.calls += 1
            whole = self.whole
            measure = (
                whole is None
                and self.ready
                and self.calls >= 2
                and self._start_whole is not None
                and not self._measured
            )
            self._measured = self._measured or measure
        if measure and self._recall():
            return self.run(leaves)  # the form recorded by an earlier process
        if measure:
            # The program has run: time one call of the split program; where its
            # executables are big, a whole program would save nothing (see
            # ``SPLIT_ONLY_SECONDS``), else compile it in the background.
            jax.block_until_ready(leaves)
            start = time.perf_counter()
            out = self.run(leaves)
            jax.block_until_ready(out)
            per_step = (time.perf_counter() - start) / max(1, len(self.steps))
            with self._lock:
                if per_step >= split_only_seconds():
                    logger.debug(
                        "jaxaot.jit %s: %.3g ms per executable; no whole program",
                        self.name,
                        per_step * 1e3,
                    )
                    self.mode = SPLIT
                    self._settle({"split_executable": per_step * 1e3})
                elif self.whole is None and self._start_whole is not None:
                    started = self._start_whole()
                    if started is None:
                        self.mode = SPLIT
                    else:
                        self.whole, self.whole_calls, self.whole_calls_back = started
            return out
        if whole is None or not whole.done():
            return self.run(leaves)
        error = whole.exception()
        if error is not None:
            logger.debug(
                "jaxaot.jit %s: no whole-program executable (%s: %s); running the split program",
                self.name,
                type(error).__name__,
                error,
            )
            self.mode = SPLIT
            return self.run(leaves)
        if self._trusted:
            with self._lock:
                self._trusted = False
                self.mode = WHOLE
            return self.run_whole(whole.result(), leaves)
        with self._lock:
            if self._previous is None or self._streak >= RUN:
                form = WHOLE if len(self.timings[WHOLE]) <= len(self.timings[SPLIT]) else SPLIT
                self._streak = 0
            else:
                form = self._previous
            timed = form == self._previous
            self._previous = form
            self._streak += 1
        jax.block_until_ready(leaves)
        start = time.perf_counter()
        out = self.run_whole(whole.result(), leaves) if form is WHOLE else self.run(leaves)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - start
        with self._lock:
            if timed:
                self.timings[form].append(seconds)
            split, whole_t = self.timings[SPLIT], self.timings[WHOLE]
            if self.mode is None and len(split) >= SAMPLES and len(whole_t) >= SAMPLES:
                whole_ms = statistics.median(whole_t) * 1e3
                split_ms = (statistics.median(split) + (self.overhead or 0.0)) * 1e3
                self.mode = WHOLE if whole_ms < split_ms else SPLIT
                again = self.mode is SPLIT and whole_ms < split_ms * RECHECK_MARGIN
                if again and self._rechecks:
                    self._recheck_in = self._rechecks.pop(0)
                logger.debug(
                    "jaxaot.jit %s: whole program %.3g ms, split program %.3g ms a call "
                    "(medians); running the %s program%s",
                    self.name,
                    whole_ms,
                    split_ms,
                    self.mode,
                    f", timed again in {self._recheck_in} calls" if self._recheck_in else "",
                )
                if self.settled():
                    self._settle({WHOLE: whole_ms, SPLIT: split_ms})
        return out

    def _settle(self, measured: dict[str, float]) -> None:
        """Records the form settled on, for the next process (see ``_choice``)."""
        if self._remember is not None and self.mode is not None:
            self._remember(self.mode, measured)

    def note_overhead(self, seconds: float) -> None:
        """Records what one call cost its caller beyond the plan (see ``overhead``)."""
        if self.overhead is None or seconds < self.overhead:
            self.overhead = seconds

    def _count_down(self) -> None:
        """Counts a split call; once ``_recheck_in`` are made, both forms are timed
        again, afresh, and chosen between as at first."""
        with self._lock:
            if self._recheck_in is None:
                return
            self._recheck_in -= 1
            if self._recheck_in > 0:
                return
            self._recheck_in = None
            self.timings = {SPLIT: [], WHOLE: []}
            self.overhead = None
            self._previous, self._streak = None, 0
            self._mode = None

    def pending(self) -> bool:
        """Whether the steady state is still being chosen."""
        return self.mode is None

    def settled(self) -> bool:
        """Whether the steady state is chosen, with no timing of both forms to come."""
        return self.mode is not None and self._recheck_in is None


def _last_uses(steps: Sequence[Step], n_kept: int, keep: Sequence[int]) -> list[tuple[int, ...]]:
    """Per step, the slots from ``n_kept`` on, other than ``keep`` (the
    program's outputs), that no later step reads or writes."""
    last: dict[int, int] = {}
    for k, step in enumerate(steps):
        for slot in (*step.ins, *step.outs):
            last[slot] = k
    kept = set(keep)
    dead: list[list[int]] = [[] for _ in steps]
    for slot, k in last.items():
        if slot >= n_kept and slot not in kept:
            dead[k].append(slot)
    return [tuple(d) for d in dead]


def _delete(leaves: Sequence[Any], positions: Sequence[int], out: Sequence[Any]) -> None:
    """Deletes the donated inputs at ``positions`` that are not outputs."""
    kept = {id(o) for o in out}
    for i in positions:
        leaf = leaves[i]
        if isinstance(leaf, jax.Array) and not leaf.is_deleted() and id(leaf) not in kept:
            leaf.delete()
