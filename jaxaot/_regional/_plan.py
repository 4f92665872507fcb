"""The execution plan of a ``jaxaot.jit`` program: its split form, or one program.

A split plan runs its steps (component executables and glue programs) in
order. Values live in a list of slots: each step reads its inputs and writes
its outputs at slot indices worked out once, when the plan is made, so a call
costs little more than the executables it runs.

A plan of one program (a program served whole, or the whole-program form the
planner chose: see ``_whole.form``) runs one executable from its first call.
Which form a plan has is decided when it is made, from the program itself: the
same program takes the same form, and gives the same bits, in every process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from .._jax import active_target, with_trees
from .._keys._sharding import is_single_device
from .._store import _job

logger = logging.getLogger("jaxaot")

SPLIT = "split"
WHOLE = "whole"


class PlanFailed(Exception):
    """An executable of a plan could not be made; nothing was donated yet."""


def refuse_unsplit(name: str, error: Exception) -> None:
    """Under a compile target (``jaxaot precompile --target``), raises for a
    program that would run under plain ``jax.jit`` (``error``: why it cannot be
    split): that compiles for this process's devices, so nothing would be made
    for the target. The user's own error where it is one (a ``TypeError`` or
    ``ValueError``: arguments placed on this machine's devices), else a
    ``ValueError`` that says so."""
    if active_target() is None:
        return
    cause = error.__cause__ if isinstance(error, PlanFailed) else error
    if isinstance(cause, TypeError | ValueError):
        raise cause
    raise ValueError(
        f"jaxaot.jit {name}: not precompiled for {active_target()}: it would run under "
        f"plain jax.jit, on this process's devices ({type(error).__name__}: {error})"
    )


def agreed(name: str, plan: Plan | None) -> Plan | None:
    """In a multi-process job, ``plan`` if every process could split the program
    ``name`` and make every executable, else ``None`` in every process (so that
    all run ``jax.jit`` and their collectives match). The first call then waits
    for all executables before it runs. Elsewhere, ``plan``."""
    if jax.process_count() <= 1:
        return plan
    ok = plan is not None
    if plan is not None:
        try:
            plan.wait()
        except PlanFailed as e:
            logger.debug("jaxaot.jit %s: not split here (%s)", name, e)
            ok = False
    if not _job.agree(f"jit:{name}:{_job.next_decision()}", ok):
        logger.debug("jaxaot.jit %s: not split in every process; using jax.jit", name)
        return None
    return plan


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
        return _result(self.job, self.label)


class Plan:
    """The plan of a program for one input signature: split, or one program.

    Slots ``0 .. n_inputs - 1`` hold the inputs, the next ones ``fixed`` (the
    program's constants, then literals), the rest the steps' outputs.

    A split plan's executables are loaded or compiled on a few threads while the
    first call already runs the steps whose executables are ready: the first
    layers' forward pass runs while the backward executable compiles. Before the
    first step that donates an input (and before donated inputs are deleted),
    the plan waits for every executable, so a failure leaves the inputs intact
    for ``jax.jit``.

    A plan of one program (``program``: its executable's job, whether it calls
    back into Python, and where its bytes are) has no steps: every call runs
    that executable (its inputs, then its constants)."""

    def __init__(
        self,
        *,
        name: str,
        n_inputs: int,
        fixed: Sequence[Any],
        n_consts: int,
        out_tree: Any,
        donated: Sequence[int],
        n_slots: int | None = None,  # (None: a plan of one program, which has no steps)
        steps: Sequence[Step] = (),
        out_slots: Sequence[int] = (),
        delete_after: Sequence[int] = (),
        out_shardings: Sequence[Any] | None = None,
        in_flight: int | None = None,
        summary: str = "",
        served_whole: str | None = None,
        program: tuple[concurrent.futures.Future[Any], bool] | None = None,
    ) -> None:
        self.name = name
        self.summary = summary  # what the program was split into (``jaxaot.jit(...).explain``)
        # Why the program runs as one region (one cached program), where it does.
        self.served_whole = served_whole
        self.n_inputs = n_inputs
        self.fixed = list(fixed)
        self.n_consts = n_consts  # the first ``n_consts`` of ``fixed`` are the program's constants
        self.consts = tuple(self.fixed[:n_consts])
        self.blank = [None] * (n_slots - n_inputs - len(self.fixed) if n_slots else 1)
        self.steps = list(steps)
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
        self._dead = _last_uses(self.steps, n_inputs + len(self.fixed), self.out_slots)
        self._fast: list[
            tuple[Any, Callable[[list[Any]], Sequence[Any]], tuple[int, ...], tuple[int, ...]]
        ] = []
        self._get_out = _getter(self.out_slots)
        # The outputs no step writes (an input returned as it came, a constant, a
        # literal such as a static argument): jax.jit returns each as an array.
        held = n_inputs + len(self.fixed)
        self._unwritten = [i for i, slot in enumerate(self.out_slots) if slot < held]
        self._lock = threading.Lock()
        self.whole: concurrent.futures.Future[Any] | None = None
        self.whole_calls_back = False  # whether the one program calls back into Python
        # The one program's executable taking the program's arguments as a tree
        # (for JAX's C++ dispatch), by the tree's structure; see ``structured``.
        self._structured: dict[Any, Any] = {}
        self.mode = SPLIT
        if program is not None:
            self.whole, self.whole_calls_back = program
            self.mode = WHOLE

    def structured(self, in_tree: Any) -> Any | None:
        """The one program's executable as a ``jax.stages.Compiled`` taking the
        arguments whose ``(args, kwargs)`` tree is ``in_tree`` and returning the
        program's output tree: the same loaded executable, wrapped for those trees.
        ``None`` until it is ready, or if it is not made (constants, host
        callbacks, a split plan)."""
        whole = self.whole
        if self.consts or self.whole_calls_back or whole is None:
            return None
        if not whole.done() or whole.exception() is not None:
            return None
        with self._lock:
            exe = self._structured.get(in_tree)
            if exe is None:
                exe = self._structured[in_tree] = with_trees(whole.result(), in_tree, self.out_tree)
        return exe

    # -- the split program ----------------------------------------------------

    def wait(self) -> None:
        """Waits for every executable; raises ``PlanFailed`` if one could not be made."""
        if self.mode is WHOLE:
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
        if self._unwritten:
            _as_arrays(out, self._unwritten, leaves)
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

    # -- one program ------------------------------------------------------------

    def __call__(self, leaves: Sequence[Any]) -> list[Any]:
        if self.mode is not WHOLE:
            return self.run(leaves)
        out = list(self._whole_executable()(*leaves, *self.consts))
        if self._unwritten:
            _as_arrays(out, self._unwritten, leaves)
        if self.donated:
            _delete(leaves, self.donated, out)
        return out

    def _whole_executable(self) -> Any:
        """The one program's executable, waiting for it if need be (raises
        ``PlanFailed`` if it could not be made)."""
        assert self.whole is not None
        return _result(self.whole, "the whole program")


def _result(job: concurrent.futures.Future[Any], label: str) -> Any:
    try:
        return job.result()
    except Exception as e:
        raise PlanFailed(f"{label}: {type(e).__name__}: {e}") from e


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


def _as_arrays(out: list[Any], positions: Sequence[int], leaves: Sequence[Any]) -> None:
    """The outputs at ``positions`` (none computed by an executable) placed as
    ``jax.jit`` places them, with no program compiled: a value that is not an
    array (a Python scalar, a NumPy value, a literal's typed scalar) becomes one
    of its dtype and weak type, and an uncommitted input returned as it came
    moves, as jax.jit moves it before it runs, to the devices the call computes
    on: replicated over the mesh of its committed arrays, or on their one device
    (where it has none, the default device)."""
    loose = [i for i in positions if not isinstance(out[i], jax.Array) or not out[i].committed]
    if not loose:
        return
    where: Any = None
    for value in (*out, *leaves):
        if not isinstance(value, jax.Array) or not value.committed:
            continue
        sharding = value.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            where = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            break
        if is_single_device(sharding):
            where = sharding
            break
    for i in loose:
        if where is not None or not isinstance(out[i], jax.Array):
            out[i] = jax.device_put(out[i], where)


def _delete(leaves: Sequence[Any], positions: Sequence[int], out: Sequence[Any]) -> None:
    """Deletes the donated inputs at ``positions`` that are not outputs."""
    kept = {id(o) for o in out}
    for i in positions:
        leaf = leaves[i]
        if isinstance(leaf, jax.Array) and not leaf.is_deleted() and id(leaf) not in kept:
            leaf.delete()
