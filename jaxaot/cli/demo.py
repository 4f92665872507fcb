"""``jaxaot demo``: train a small transformer language model whose block and train
step are components, and show what a warm cache does to the start-up time.

Run it twice: the second run loads the compiled train step from the cache
instead of tracing and compiling it.

What it reports, and how it is measured:

* time to first step: from the start of the process (read from ``/proc`` on
  Linux; elsewhere from the import of the command line) to the first step's
  loss on the host; split into imports, model initialisation and the first
  step (trace and compile, or load, then run).
* steady step time: the wall time of the second half of the steps, every
  step's outputs finished (``block_until_ready``), divided by their number.
* persistent cache: look-ups that reached the cache (the directory, Redis,
  ...), so hits are entries made by an earlier process. Look-ups served by
  this process's own tables are not counted; with ``--cold`` there is no cache.
* fleet: entries this process made, and entries it waited for while another
  process sharing the cache made them (then loaded), with the time it waited
  (``jaxaot.stats()``: ``made_here``, ``loaded_after_wait``, ``wait_seconds``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ._output import CLIError, Command, Output, positive_int

VOCAB = 64


@dataclass
class DemoResult:
    """What a demo run measured (seconds)."""

    time_to_first_step: float
    clock: str
    phases: dict[str, float]
    steady_step: float | None
    first_loss: float
    last_loss: float
    steps: int
    cache: str
    persistent: dict[str, Any] | None
    stats: dict[str, float] = field(default_factory=dict)
    step_info: dict[str, int] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers", type=positive_int, default=2, help="transformer blocks (default 2)"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=300, help="training steps (default 300)"
    )
    parser.add_argument("--width", type=positive_int, default=128, help="model width (default 128)")
    parser.add_argument("--seq", type=positive_int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=positive_int, default=16, help="batch size (default 16)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--dir",
        "--cache-dir",
        dest="dir",
        metavar="PATH",
        default=None,
        help="the cache directory (default: the default cache, as $JAXAOT_CACHE says)",
    )
    where.add_argument(
        "--cold", action="store_true", help="use no cache at all (no reads, no writes)"
    )
    parser.add_argument("--quiet", action="store_true", help="no status line or progress bar")


def batches(batch: int, seq: int, seed: int = 0) -> Any:
    """Endless batches of arithmetic sequences modulo VOCAB: easy to learn, no download."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(seq + 1)
    while True:
        start = rng.integers(0, VOCAB, size=(batch, 1))
        stride = rng.integers(1, 8, size=(batch, 1))
        yield ((start + stride * t) % VOCAB).astype(np.int32)


#: The longest a process may take from its start to importing ``jaxaot.cli`` (the
#: interpreter, then the console script): a ``/proc`` start time further back comes
#: from a clock kept apart from ``/proc/uptime`` (as some sandboxes keep them).
STARTUP_MOST_S = 10.0


def process_start() -> float | None:
    """The ``time.perf_counter()`` reading at which this process started, from
    ``/proc`` (Linux, 10 ms resolution), or ``None`` where that cannot be read or
    is implausible: after ``jaxaot.cli``'s import, or over ``STARTUP_MOST_S``
    before it."""
    from . import IMPORTED_AT

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    start = time.perf_counter() - age
    return start if 0.0 <= IMPORTED_AT - start <= STARTUP_MOST_S else None


# ----------------------------------------------------------------------------
# Counting the look-ups that reach the persistent cache.


class Counted:
    """A cache that counts the ``get`` calls that reach it (hits and misses) and the
    ``put`` calls, and otherwise is the cache it wraps (extras included)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.hits = self.misses = self.puts = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return repr(self.inner)

    def __getattr__(self, name: str) -> Any:  # path_for, quarantine, url, ...
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def get(self, key: str) -> bytes | None:
        value = self.inner.get(key)
        sound = value is not None and _sound(key, value)
        with self._lock:
            if sound:
                self.hits += 1
            else:  # none, or a damaged entry (dropped and made again: not a hit)
                self.misses += 1
        return value  # type: ignore[no-any-return]

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        with self._lock:
            self.puts += 1
        self.inner.put(key, value)

    def delete(self, key: str) -> bool:
        return bool(self.inner.delete(key))

    def keys(self) -> list[str]:
        return list(self.inner.keys())

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, Any]:
        return dict(self.inner.stats())


def _sound(key: str, blob: bytes) -> bool:
    """Whether ``blob`` is a sound entry for ``key``."""
    from .._caches import BadEntry
    from .._store._entry import check_stored

    try:
        check_stored(key, blob)
    except BadEntry:
        return False
    return True


def describe(cache: Any) -> str:
    """Where a cache keeps its entries: a path, a URL, ``memory``, or its tiers."""
    if cache is None:
        return "none"
    cache = getattr(cache, "inner", cache)
    tiers = getattr(cache, "tiers", None)
    if tiers:
        return "tiers: " + " → ".join(describe(t) for t in tiers)
    path_for = getattr(cache, "path_for", None)
    if path_for is not None:
        return os.path.dirname(os.path.dirname(os.fspath(path_for("00" * 32))))
    url = getattr(cache, "url", None)
    if url is not None:
        return str(url)
    if type(cache).__name__ == "MemoryCache":
        return "memory (this process only)"
    return type(cache).__name__


def _counted(cache: Any) -> tuple[Any, list[tuple[str, Counted]]]:
    """``cache`` with counters; for a TieredCache, one per tier as well."""
    from .. import TieredCache
    from .._store._entry import check_stored

    if isinstance(cache, TieredCache):
        tiers = [Counted(t) for t in cache.tiers]
        # Rebuilt over the counted tiers with the check that lets it copy a
        # verified hit into the faster tiers (set_cache gives a bare one its check).
        counted = TieredCache(
            *tiers, check=cache.check or check_stored, write_back=cache.write_back
        )
        return Counted(counted), [(describe(t), t) for t in tiers]
    return Counted(cache), []


def _open_cache(args: argparse.Namespace) -> tuple[Any, str]:
    import jaxaot

    from .._caches import UnsafeCacheDirError

    if args.cold:
        return None, "none (--cold)"
    if args.dir is not None:
        path = os.path.abspath(os.path.expanduser(args.dir))
        try:
            cache: Any = jaxaot.DirectoryCache(path)
        except UnsafeCacheDirError as e:
            raise CLIError(str(e)) from None
        except OSError as e:
            raise CLIError(f"cannot use the cache directory {path}: {e.strerror or e}") from None
        return cache, describe(cache)
    raw = os.environ.get("JAXAOT_CACHE", "")
    try:
        cache = jaxaot.get_cache()
    except (ImportError, ValueError) as e:
        text = str(e)
        if isinstance(e, ImportError) and "redis" in raw.lower() and "redis" not in text:
            text += " (pip install 'jaxaot[redis]')"
        raise CLIError(f"JAXAOT_CACHE={raw}: {text}" if raw else text) from None
    return cache, describe(cache)


# ----------------------------------------------------------------------------
# The run.


class _Status:
    """A rich status line on stderr (only on a terminal, and not with --quiet)."""

    def __init__(self, enabled: bool) -> None:
        self._status: Any = None
        self.console: Any = None
        if enabled:
            from rich.console import Console

            self.console = Console(stderr=True)
            self._status = self.console.status("importing JAX and jaxaot…")
            self._status.start()

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def run(args: argparse.Namespace, origin: float, clock: str = "process start") -> DemoResult:
    """Trains ``args.steps`` steps; times are measured from ``origin`` (a ``perf_counter``)."""
    status = _Status(not args.quiet and _stderr_is_terminal())
    try:
        return _run(args, origin, clock, status)
    finally:
        status.stop()


def _stderr_is_terminal() -> bool:
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):
        return False


def _run(args: argparse.Namespace, origin: float, clock: str, status: _Status) -> DemoResult:
    import jax
    import optax

    import jaxaot

    from . import _model

    t_imports = time.perf_counter()
    status.update("opening the cache…")
    base, where = _open_cache(args)
    counted, tiers = _counted(base) if base is not None else (None, [])
    jaxaot.set_cache(counted)

    before = jaxaot.stats()
    block = jaxaot.component(_model.block)
    optimizer = optax.adam(3e-3)

    def loss_fn(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        return _model.lm_loss(params, tokens, block)

    @jaxaot.component(donate_argnums=(0, 1))
    def train_step(params: dict[str, Any], opt_state: Any, tokens: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # The initialisation is a component too: eagerly, its random ops compile one
    # by one (seconds); as a component it compiles once, and loads when warm.
    @jaxaot.component(static_argnums=(1, 2, 3))
    def init(seed: jax.Array, layers: int, width: int, seq: int) -> Any:
        params = _model.init_lm(jax.random.key(seed), layers, width, VOCAB, seq)
        return params, optimizer.init(params)

    status.update("initialising the model…")
    params, opt_state = init(jax.numpy.int32(0), args.layers, args.width, args.seq)
    jax.block_until_ready((params, opt_state))
    data = batches(args.batch, args.seq)
    t_init = time.perf_counter()
    status.update(
        "first step: loading the train step from the cache, or tracing and compiling it…"
        if counted is not None
        else "first step: tracing and compiling the train step (--cold)…"
    )

    losses: list[float] = []
    pending: jaxaot.HostCopy[Any] | None = None
    progress = None
    task: Any = None
    marks: list[float] = []  # after each step
    try:
        for i in range(args.steps):
            params, opt_state, loss = train_step(params, opt_state, next(data))
            if pending is not None:  # last step's loss, copied while this step ran
                losses.append(float(pending.result()))
            pending = jaxaot.to_host_async(loss)
            if i == 0:
                losses.append(float(pending.result()))
                pending = None
                status.stop()
                if status.console is not None and args.steps > 1:
                    progress = _progress(status.console, args.steps)
                    task = progress.add_task("train", total=args.steps, loss="…")
            if i == args.steps - 1:
                jax.block_until_ready((params, opt_state, loss))
            marks.append(time.perf_counter())
            if progress is not None:
                progress.update(task, advance=1, loss=f"{losses[-1]:.3f}")
        if pending is not None:
            losses.append(float(pending.result()))
    finally:
        if progress is not None:
            progress.stop()
    t_first = marks[0]
    steady = None
    if args.steps >= 2:
        start = (args.steps - 1) // 2  # the second half of the steps after the first
        steady = (marks[-1] - marks[start]) / (args.steps - 1 - start)
    jaxaot.wait_for_writes()  # entries still being written count as written
    persistent = None
    if counted is not None:
        persistent = {
            "hits": counted.hits,
            "misses": counted.misses,
            "written": counted.puts,
            "tiers": [{"tier": name, "hits": t.hits, "written": t.puts} for name, t in tiers],
        }
    return DemoResult(
        time_to_first_step=t_first - origin,
        clock=clock,
        phases={
            "imports": t_imports - origin,
            "init": t_init - t_imports,
            "first step": t_first - t_init,
        },
        steady_step=steady,
        first_loss=losses[0],
        last_loss=losses[-1],
        steps=args.steps,
        cache=where,
        persistent=persistent,
        stats={k: v - before.get(k, 0) for k, v in jaxaot.stats().items()},
        step_info=train_step.cache_info()._asdict(),
    )


def _progress(console: Any, total: int) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]training[/]"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    progress.start()
    return progress


def summary_rows(result: DemoResult) -> list[tuple[str, str]]:
    # A warm start loads what it needs: no lowering, no compile (default keys trace
    # the body once to find their key).
    warm = result.step_info.get("compiles", 1) == 0 and result.step_info.get("lowerings", 1) == 0
    how = "loaded from the cache" if warm else "traced and compiled"
    ph = result.phases
    rows = [
        (
            "time to first step",
            f"{result.time_to_first_step:.2f} s since the {result.clock}: "
            f"{ph['imports']:.2f} s Python and imports, {ph['init']:.2f} s model init, "
            f"{ph['first step']:.2f} s first step ({how}, run)",
        ),
        (
            "steady step time",
            f"{result.steady_step * 1e3:.1f} ms (wall time per finished step, second half)"
            if result.steady_step is not None
            else "- (needs --steps 2 or more)",
        ),
        ("loss", f"{result.first_loss:.3f} → {result.last_loss:.3f} over {result.steps} steps"),
    ]
    p = result.persistent
    if p is None:
        rows.append(("persistent cache", "none: every entry made in this process"))
    else:
        rows.append(
            (
                "persistent cache",
                f"{p['hits']} hits, {p['misses']} misses, {p['written']} written "
                "(hits: entries made by an earlier process)",
            )
        )
        for t in p["tiers"]:
            rows.append(("  tier", f"{t['tier']}: {t['hits']} hits, {t['written']} written"))
    s = result.stats
    rows += [
        (
            "this process",
            f"{s.get('traces', 0)} traces, {s.get('lowerings', 0)} lowerings, "
            f"{s.get('compiles', 0)} compiles",
        ),
        (
            "fleet",
            f"{s.get('made_here', 0):g} entries made here, {s.get('loaded_after_wait', 0):g} "
            f"made by other processes while this one waited "
            f"({s.get('wait_seconds', 0.0):.2f} s)",
        ),
        ("train step", f"warm start: {how}" if warm else f"cold start: {how}"),
        ("cache location", result.cache),
    ]
    return rows


# ----------------------------------------------------------------------------
# The command.


def _cmd_demo(args: argparse.Namespace, out: Output) -> int:
    import importlib.util

    # optax is the demo extra, not a base dependency: say so before anything runs.
    if "optax" in sys.modules:
        have_optax = sys.modules["optax"] is not None
    else:
        have_optax = importlib.util.find_spec("optax") is not None
    if not have_optax:
        raise CLIError(
            'jaxaot demo needs optax (its optimizer): pip install ".[demo]" '
            "(in a checkout of jaxaot; or pip install 'jaxaot[demo]')",
            2,
        )
    origin, clock = getattr(args, "_started", time.perf_counter()), "command start"
    if getattr(args, "_first_call", False):
        start = process_start()
        if start is not None:
            origin, clock = start, "process start"
        else:
            from . import IMPORTED_AT

            origin = IMPORTED_AT
    try:
        result = run(args, origin, clock)
    except ValueError as e:  # bad sizes, a bad JAXAOT_CACHE_MAX_BYTES, ...
        raise CLIError(str(e)) from None
    out.fields(summary_rows(result), title="jaxaot demo")
    return 0


DEMO = Command(
    "demo",
    "train a small transformer whose block and train step are components",
    add_arguments,
    _cmd_demo,
    description="Train a small transformer language model (components for the block and the "
    "train step, optax, generated data) and report the time to the first step (from the "
    "process start), the steady step time, the loss, and the persistent cache's hits and "
    "misses. Run it twice to see the warm start.",
    epilog="The first run traces and compiles the train step and writes it to the cache; "
    "the next run loads it. --cold uses no cache; --dir PATH a cache directory of its own.",
    uses_cache=False,
)
