"""How a worker times things: one call, the stages of ``jax.jit`` (trace, lower,
compile, first run), a steady step, and the form a ``jaxaot.jit`` step runs.

Runs in the worker process; JAX and jaxaot are imported when first needed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "EARLY_STEPS",
    "PHASES",
    "early_steps",
    "load_all_executables",
    "run_once",
    "ROUND_SECONDS",
    "block",
    "measure_stages",
    "settle",
    "steady",
    "steady_after_warmup",
    "timed",
]

#: The stages whose sum is the time to first result.
PHASES = ("trace", "lower", "compile", "first_run")

#: A steady-step round runs back-to-back calls for at least this long (seconds), so
#: that a step of a millisecond is not timed by one call on a shared machine.
ROUND_SECONDS = 0.2


def block(out: Any) -> Any:
    """``out``, once every array in it is computed."""
    import jax

    return jax.block_until_ready(out)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and the seconds it took."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def steady(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds a call: the median over ``repeats`` rounds of back-to-back calls,
    each call waited for before the next, a round lasting ``ROUND_SECONDS`` or
    one call."""
    t0 = time.perf_counter()
    block(fn())
    calls = max(1, int(ROUND_SECONDS / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            block(fn())
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def measure_stages(
    jitted: Any, args: tuple[Any, ...], result: dict[str, Any], repeats: int
) -> None:
    """Times ``jitted``'s trace, lower, compile and first run, then its steady step."""
    traced, result["trace"] = timed(lambda: jitted.trace(*args))
    lowered, result["lower"] = timed(traced.lower)
    compiled, result["compile"] = timed(lowered.compile)
    _, result["first_run"] = timed(lambda: block(compiled(*args)))
    result["steady"] = steady(lambda: compiled(*args), repeats)


#: The early steps a ``jaxaot.jit`` contender reports: the calls right after the
#: first, each waited for, before its steady state is chosen: 30 of small steps,
#: 10 where the first call took over ``EARLY_LONG_SECONDS`` or the next one over
#: ``EARLY_LONG_STEP`` (seconds).
EARLY_STEPS = (30, 10)
EARLY_LONG_SECONDS = 5.0
EARLY_LONG_STEP = 1.5


def early_steps(step: Any, args: tuple[Any, ...], result: dict[str, Any], first: float) -> None:
    """Times the calls right after the first one, one by one, as a training run
    makes them (background compiles and the choice of form running beside them):
    ``early`` is their median (seconds), ``early_n`` their number."""
    times = [timed(lambda: block(step(*args)))[1]]
    long = first > EARLY_LONG_SECONDS or times[0] > EARLY_LONG_STEP
    n = EARLY_STEPS[1] if long else EARLY_STEPS[0]
    times += [timed(lambda: block(step(*args)))[1] for _ in range(n - 1)]
    result["early"] = statistics.median(times)
    result["early_n"] = n


def settle(step: Any, args: tuple[Any, ...], result: dict[str, Any]) -> None:
    """Records the form a ``jaxaot.jit`` step's plan runs (split, or one program:
    decided by its program when the plan was made) and its executables."""
    (plan,) = step._plans.values()
    if plan is None:
        return
    result["steps"] = len(plan.steps)
    result["mode"] = plan.mode


def steady_after_warmup(fn: Callable[[], Any], repeats: int) -> float:
    """:func:`steady` of a ``jaxaot.jit`` step once its background work is done,
    as in a long run: the cache writes its first call started."""
    import jaxaot

    block(fn())
    jaxaot.wait_for_writes()
    return steady(fn, repeats)


def load_all_executables(cache: Any) -> list[Any]:
    """The load limit of a warm start: reads, verifies and deserializes every
    executable entry of ``cache``, nothing else; the executables loaded."""
    from ..._store._entry import decode
    from ..._store._executables import load_executable

    loaded = []
    for key in cache.keys():
        blob = cache.get(key)
        if blob is None:
            continue
        entry = decode(blob)
        got = None if entry.executable is None else load_executable(cache, entry.key)
        if got is not None:
            loaded.append(got[0])
    return loaded


def run_once(executables: list[Any]) -> int:
    """Runs each executable once on zeros of its input types: what a first call
    costs on top of its loading (XLA:CPU readies an executable's code when it
    first runs); how many ran."""
    from ..._jax import run_on_zeros

    ran = 0
    for exe in executables:
        try:
            run_on_zeros(exe)
            ran += 1
        except Exception:  # (one that cannot run on zeros is left out of the limit)
            continue
    return ran
