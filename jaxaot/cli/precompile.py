"""``jaxaot precompile``: build every executable a deployment's manifest names
into a cache, in parallel worker processes, running nothing.

``jaxaot precompile MANIFEST [--workers N] [--cache SPEC] [--target tpu:TOPOLOGY]``.
``MANIFEST`` is ``module:attr`` (or ``path/to/file.py:attr``): a
:class:`jaxaot.Manifest`, or a function of no arguments that returns one.
Each of the ``N`` workers (default: the machine's cores; on a GPU machine, four
per GPU, which the workers share) is a fresh Python
process (``sys.executable``: never a fork of a process that has started JAX)
that imports the manifest and precompiles its share (``Manifest.precompile``:
signatures are claimed through the cache's leases, so the workers of every
machine pointed at one shared cache split the work, and a worker that dies has
its signatures taken over by the others).

Workers talk to this process through lines on their stdout that start with
:data:`MARK` and hold one JSON object (the manifest's size, a signature
started, done, or done elsewhere; an error); anything else they print passes
through (to stderr). This process tells every worker, on its stdin, the index
of each signature done, so that none of them loads what another made. On a terminal the progress is a rich bar; piped, one plain line per
signature. The last line says what was made, loaded and already present, and
the time taken.

With ``--target`` (``tpu:v5e:2x2``), every worker makes that TPU topology its
compile target before it imports the manifest (``jaxaot.target_devices()``
gives its devices, to build shardings over): executables are compiled for,
and keyed as, the topology, from any machine with libtpu installed.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import IO, Any

from .._precompiled import ItemResult, PrecompileReport
from ._output import CLIError, Command, Output, Terminated, positive_int, quiet_stdout

__all__ = ["MARK", "PRECOMPILE", "load_manifest", "worker_main"]

#: What starts a worker's report lines on its stdout.
MARK = "@jaxaot-precompile "

_WORKER_CODE = (
    "import sys; from jaxaot.cli.precompile import worker_main; sys.exit(worker_main(sys.argv[1:]))"
)


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target",
        metavar="MANIFEST",
        help="module:attr or path/to/file.py:attr: a jaxaot.Manifest, or a function of no "
        "arguments returning one",
    )
    parser.add_argument(
        "--target",
        dest="compile_target",
        metavar="PLATFORM:TOPOLOGY",
        default=None,
        help="compile for devices this machine does not have: a TPU topology "
        '(tpu:v5e:2x2, tpu:v4:2x2x1); needs libtpu (pip install "jaxaot[tpu-aot]", '
        "Python >= 3.12). Executables are keyed for the topology: only processes on it "
        "load them",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        help="worker processes (default: the machine's cores; four per GPU on a GPU machine)",
    )
    parser.add_argument(
        "--cache",
        metavar="SPEC",
        default=None,
        help="the cache to fill: a cache directory, or any $JAXAOT_CACHE value (dir, "
        "redis://host:port/db, gs://bucket/path, file:///shared/path...); default: "
        "$JAXAOT_CACHE, else the default cache directory",
    )
    parser.add_argument(
        "--run",
        metavar="ID",
        default=None,
        help="a name for this run, the same on every machine that shares the cache "
        "(a build id, a commit): machines with the same ID split the signatures between "
        "them; without one, each run makes every entry once all the same (through the "
        "entries' leases) but visits every signature",
    )


def _split_target(target: str) -> tuple[str, str]:
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise CLIError(f"MANIFEST must be module:attr or path/to/file.py:attr, got {target!r}", 2)
    return where, attr


def _raised(error: Exception) -> str:
    """``error`` in one line, with where it was raised (the file and line)."""
    notes = "".join(f"; {n}" for n in getattr(error, "__notes__", ()))
    text = " ".join(f"{type(error).__name__}: {error}{notes}".split())
    if isinstance(error, SyntaxError) and error.filename:
        return f"{text} ({error.filename}:{error.lineno})"
    from .._regional._manifest import raised_at

    where = raised_at(error)
    return f"{text} ({where})" if where else text


def load_manifest(target: str) -> Any:
    """The :class:`jaxaot.Manifest` that ``target`` (``module:attr`` or
    ``file.py:attr``) names; one left unnamed is named ``target`` (its claims'
    name: machines that split one run must name it alike).

    Raises:
      CLIError: ``target`` is malformed, cannot be imported, or names no manifest.
    """
    import jaxaot

    where, attr = _split_target(target)
    try:
        if where.endswith(".py") or os.sep in where:
            # Named by its file's stem, as `import stem` names it in the deployment:
            # functions are keyed by their module's name.
            name = os.path.splitext(os.path.basename(where))[0]
            folder = os.path.dirname(os.path.abspath(where))
            if folder not in sys.path:
                sys.path.insert(0, folder)  # its own imports, as `python file.py` finds them
            spec = importlib.util.spec_from_file_location(name, where)
            if spec is None or spec.loader is None:
                raise CLIError(f"cannot load {where!r} (not a Python file)", 2)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` finds modules
            module = importlib.import_module(where)
    except CLIError:
        raise
    except FileNotFoundError as e:
        raise CLIError(f"cannot load {where!r}: {e.strerror}", 2) from None
    except ImportError as e:
        raise CLIError(f"cannot import {where!r}: {e}", 2) from None
    except Exception as e:  # its own code raised (a SyntaxError, a bad Manifest.add)
        raise CLIError(
            f"importing {where!r} raised {_raised(e)} (import it in Python for the traceback)",
            2,
        ) from None
    try:
        value = getattr(module, attr)
    except AttributeError:
        raise CLIError(f"{where!r} has no attribute {attr!r}", 2) from None
    if isinstance(value, jaxaot.Component | jaxaot.RegionalFunction):
        raise CLIError(
            f"{target} is a {'component' if isinstance(value, jaxaot.Component) else 'jaxaot.jit function'}"
            ", not a jaxaot.Manifest: list its calls in one (jaxaot.manifest().add(fn, *args), "
            "with jax.ShapeDtypeStruct arguments) and name that",
            2,
        )
    called = not isinstance(value, jaxaot.Manifest) and callable(value)
    if called:
        try:
            value = value()
        except Exception as e:
            raise CLIError(
                f"{target}() raised {_raised(e)} (call it in Python for the traceback)", 2
            ) from None
    if not isinstance(value, jaxaot.Manifest):
        raise CLIError(
            f"{target}() returned an object of type {type(value).__name__}, not a jaxaot.Manifest"
            if called
            else f"{target} is not a jaxaot.Manifest (or a function of no arguments returning "
            f"one): it is of type {type(value).__name__}",
            2,
        )
    if value.name == "manifest":  # unnamed: named by where it was found
        value.name = target
    return value


#: The most signatures an incomplete run names.
_NAMED = 5


def _report(stream: IO[str], event: str, **fields: Any) -> None:
    stream.write(MARK + json.dumps({"event": event, **fields}) + "\n")
    stream.flush()


def _compile_target(text: str | None) -> Any:
    """The compile target ``--target`` names (checked, libtpu included), or ``None``.

    Raises:
      CLIError: malformed, a GPU, or libtpu missing (status 2).
    """
    if not text:
        return None
    from .._jax._target import TargetError, check_tpu_available, parse_target

    try:
        target = parse_target(text)
        check_tpu_available()
    except TargetError as e:
        raise CLIError(str(e), 2) from None
    return target


def _refuse_a_fallback(worker: int) -> None:
    """Stops a worker whose JAX fell back to the CPU on an accelerator machine
    (JAX only logs it): its entries would be keyed for the CPU, and the
    deployment would compile everything the manifest names."""
    from .._jax import accelerator_left_out

    why = accelerator_left_out()
    if why is not None:
        raise CLIError(
            f"worker {worker} would compile for the CPU: {why}. Run fewer --workers, or "
            "set JAX_PLATFORMS=cpu to precompile for the CPU",
            1,
        )


def worker_main(argv: list[str]) -> int:
    """A worker: ``MANIFEST WORKER WORKERS RUN [COMPILE_TARGET]``. Precompiles its
    share, reporting on stdout."""
    target, worker, workers, run = argv[0], int(argv[1]), int(argv[2]), argv[3]
    compile_target = argv[4] if len(argv) > 4 else ""
    out = sys.stdout
    finished: set[int] = set()
    from .._caches._trust import unsigned_said_by_parent

    unsigned_said_by_parent()  # (the parent opened the store first, and said it)

    def listen() -> None:  # the signatures the other workers finished
        for line in sys.stdin:
            if line.strip().isdigit():
                finished.add(int(line))

    threading.Thread(target=listen, name="jaxaot-precompile-finished", daemon=True).start()
    try:
        if compile_target:
            # Before the manifest is imported: it may build shardings over the
            # target's devices (jaxaot.target_devices()).
            from .._jax._target import TargetError, set_target

            try:
                set_target(_compile_target(compile_target))
            except TargetError as e:
                raise CLIError(str(e), 2) from None
        manifest = load_manifest(target)
        _report(out, "manifest", count=len(manifest), labels=[item.label for item in manifest])
        if not compile_target:
            _refuse_a_fallback(worker)
        from .. import _stats

        lost = _stats.stats()["cache_write_errors"]
        manifest.precompile(
            worker=worker,
            workers=workers,
            run=run,
            on_item=lambda event, result: _report(out, event, **result.as_dict()),
            finished=finished,
            raise_errors=False,  # each failed signature is reported, and the others done
        )
        lost = _stats.stats()["cache_write_errors"] - lost
        if lost:
            # A fault was warned about once; a precompile that says nothing more
            # would leave a deployment to find the entries missing.
            raise CLIError(
                f"{int(lost)} write{'s' if lost != 1 else ''} to the cache failed or "
                f"{'were' if lost != 1 else 'was'} skipped (see the warning above): entries "
                "are missing from it",
                1,
            )
    except BrokenPipeError:
        # The parent is gone (terminated): nobody to report to, no reason to go on.
        quiet_stdout()
        return 1
    except CLIError as e:
        _report(out, "error", message=str(e))
        return e.code
    except Exception as e:
        traceback.print_exc()
        _report(out, "error", message=f"{type(e).__name__}: {e}")
        return 1
    _report(out, "end")
    return 0


def _cache_env(spec: str | None) -> dict[str, str]:
    """The environment that points a worker at the cache ``spec`` names."""
    env = dict(os.environ)
    if spec is None:
        setting = env.get("JAXAOT_CACHE", "dir")
    else:
        setting = spec
    from .._store._active import cache_setting, url_scheme

    try:
        parsed = cache_setting(setting)
    except ValueError:
        if spec is None:
            raise CLIError(f"$JAXAOT_CACHE: {setting!r} is not a cache setting", 2) from None
        parsed = None  # a directory path
    if parsed is None or parsed.kind == "dir":
        from .._store._active import default_cache_dir
        from .cache._view import open_cache

        if parsed is None:  # a path
            env["JAXAOT_CACHE_DIR"] = os.path.abspath(os.path.expanduser(setting))
        elif parsed.path is not None:
            env["JAXAOT_CACHE_DIR"] = parsed.path
        env["JAXAOT_CACHE"] = "dir"
        path = env.get("JAXAOT_CACHE_DIR") or default_cache_dir()
        # A directory the workers could not use (a file, unsafe permissions) would
        # have them cache in memory: say so here instead of "made" and status 0.
        open_cache(argparse.Namespace(dir=path, url=None), create=True)
        try:  # (a read-only directory: every entry would be made, then lost)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            raise CLIError(
                f"cannot write to the cache directory {path}: {e.strerror or e}"
            ) from None
    elif parsed.kind in ("memory", "off") or url_scheme(setting) == "memory":
        raise CLIError(
            f"{'--cache ' if spec is not None else 'JAXAOT_CACHE='}{setting}: precompiling "
            "into a cache that no later process can read; "
            "give a directory or a shared store",
            2,
        )
    else:
        if parsed.kind == "url":
            from .cache._view import open_url

            open_url(setting, create=True)  # a store that does not answer fails here, at once
        env["JAXAOT_CACHE"] = setting
    return env


class _Worker:
    def __init__(self, index: int, proc: subprocess.Popen[str]) -> None:
        self.index = index
        self.proc = proc
        self.error: str | None = None
        self.thread: threading.Thread | None = None


def _read(worker: _Worker, events: queue.Queue[tuple[int, dict[str, Any] | None]]) -> None:
    assert worker.proc.stdout is not None
    for line in worker.proc.stdout:
        if line.startswith(MARK):
            try:
                events.put((worker.index, json.loads(line[len(MARK) :])))
            except ValueError:
                pass
        else:
            sys.stderr.write(line)  # what the target prints, out of the progress' way
    events.put((worker.index, None))


class _Progress:
    """A rich bar on a terminal, one plain line per signature otherwise."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.total: int | None = None
        self.done = 0
        self.current: dict[int, str] = {}
        self._bar: Any = None
        self._task: Any = None
        if out.rich:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("[bold]precompiling[/]"),
                BarColumn(),
                TextColumn("{task.completed}/{task.fields[of]}"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[now]}"),
                console=out._console,
                transient=True,
            )
            self._bar.start()
            # (Until the workers have read the manifest, its size is not known.)
            self._task = self._bar.add_task(
                "precompile", total=None, of="?", now="reading the manifest"
            )

    def count(self, total: int) -> None:
        if self.total is None:
            self.total = total
            if self._bar is not None:
                self._bar.update(self._task, total=total, of=str(total), now="")

    def _refresh(self) -> None:
        if self._bar is not None:
            now = "; ".join(f"w{w}: {label}" for w, label in sorted(self.current.items()))
            self._bar.update(self._task, completed=self.done, now=now[:80])

    def start(self, worker: int, label: str) -> None:
        self.current[worker] = label
        self._refresh()

    def finish(self, worker: int, result: dict[str, Any]) -> None:
        self.current.pop(worker, None)
        self.done += 1
        what = {
            "made": f"{result['made']} made",
            "loaded": f"{result['loaded']} loaded",
            "present": "already present",
            "plain": "not cached (" + str(result.get("note", "")) + ")",
            "failed": "FAILED: " + str(result.get("note", "")),
            "elsewhere": f"done by another process ({result.get('note', '?')})",
        }.get(result["state"], result["state"])
        took = "" if result["state"] in ("elsewhere", "failed") else f", {result['seconds']:.2f} s"
        text = (
            f"[{self.done}/{self.total or '?'}] {result['label']}: {what}{took} (worker {worker})"
        )
        self.say(text)
        self._refresh()

    def say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            self.out.line(text)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _tell(procs: list[_Worker], index: int) -> None:
    """Tells every worker that signature ``index`` is done (they skip it)."""
    for worker in procs:
        stdin = worker.proc.stdin
        if stdin is None or worker.proc.poll() is not None:
            continue
        try:
            stdin.write(f"{index}\n")
            stdin.flush()
        except (OSError, ValueError):  # it has ended
            pass


def _close(worker: _Worker) -> None:
    if worker.proc.stdin is not None:
        try:
            worker.proc.stdin.close()
        except OSError:
            pass


# Workers per local GPU by default: they share it (each starts a CUDA client,
# and XLA autotunes on it), and past a few more workers only add that start.
# Measured by `jaxaot precompile examples/precompile_serving.py:manifest` with
# --workers 1, 4 and 16 on one GPU (docs/precompile.md, "Example").
_PER_GPU = 4


def _default_workers(env: dict[str, str], for_a_target: bool) -> int:
    """The machine's cores, or fewer where the workers share its GPUs: the
    devices are counted from ``/dev`` (this process does not import JAX)."""
    cores = os.cpu_count() or 1
    platforms = env.get("JAX_PLATFORMS", "").lower()
    if for_a_target or (platforms and not {"cuda", "gpu"} & set(platforms.split(","))):
        return cores
    gpus = len(glob.glob("/dev/nvidia[0-9]*"))
    return min(cores, _PER_GPU * gpus) if gpus else cores


def _on_sigterm() -> tuple[bool, Any]:
    """Makes SIGTERM stop the run as Ctrl-C does (its workers killed, one line said);
    whether it could (not outside the main thread), and the handler it replaced."""

    def stop(signum: int, frame: Any) -> None:
        raise Terminated()

    try:
        return True, signal.signal(signal.SIGTERM, stop)
    except ValueError:
        return False, None


def _run(args: argparse.Namespace, out: Output) -> int:
    _split_target(args.target)
    compile_target = _compile_target(args.compile_target)
    env = _cache_env(args.cache)
    if compile_target is not None:
        # The workers compile for the target's devices, and need none of this
        # machine's accelerators (unless told otherwise): JAX starts on the CPU,
        # without trying (and locking) a local TPU.
        env.setdefault("JAX_PLATFORMS", "cpu")
    else:
        # The workers share this machine's GPUs: JAX's default reservation of most
        # of a GPU's memory per process leaves the other workers' compiles none
        # (XLA's autotuner runs out of memory), or their CUDA backend fails to
        # start and JAX falls back to the CPU (refused, _refuse_a_fallback).
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    workers = args.workers or _default_workers(env, compile_target is not None)
    run = args.run or secrets.token_hex(8)
    started = time.perf_counter()
    events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
    procs: list[_Worker] = []
    for w in range(workers):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER_CODE,
                args.target,
                str(w),
                str(workers),
                run,
                compile_target.spec if compile_target is not None else "",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        worker = _Worker(w, proc)
        worker.thread = threading.Thread(target=_read, args=(worker, events), daemon=True)
        worker.thread.start()
        procs.append(worker)

    progress = _Progress(out)
    total: int | None = None
    previous = _on_sigterm()
    results: list[ItemResult] = []
    finished: set[int] = set()
    labels: dict[int, str] = {}  # (what a signature not done is called)
    open_streams = workers
    try:
        while open_streams:
            w, event = events.get()
            if event is None:
                open_streams -= 1
                continue
            kind = event.get("event")
            if kind == "manifest":
                total = int(event["count"])
                progress.count(total)
                labels = dict(enumerate(event.get("labels", [])))
            elif kind == "start":
                progress.start(w, str(event["label"]))
            elif kind == "waiting":
                progress.say(f"worker {w}: {event.get('note', '')}")
            elif kind in ("done", "elsewhere"):
                result = ItemResult.from_dict(event)
                results.append(result)
                if result.index not in finished:
                    finished.add(result.index)
                    progress.finish(w, event)
                    _tell(procs, result.index)
                else:
                    progress.current.pop(w, None)
            elif kind == "error":
                procs[w].error = str(event.get("message", ""))
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (Terminated)
        for worker in procs:
            worker.proc.kill()
        raise
    finally:
        if previous[0]:  # (None: a handler not set from Python, restored as the default)
            signal.signal(signal.SIGTERM, previous[1] or signal.SIG_DFL)
        progress.stop()
        for worker in procs:
            _close(worker)
            worker.proc.wait()
    report = PrecompileReport(total or 0, results, time.perf_counter() - started)
    failed = [w for w in procs if w.proc.returncode != 0]
    for worker in failed if total is not None else []:
        code = worker.proc.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        out.line(
            f"worker {worker.index} (pid {worker.proc.pid}) {how}"
            + (f": {worker.error}" if worker.error else "")
        )
    if total is None:
        errors = [w.error for w in failed if w.error]
        raise CLIError(errors[0] if errors else "no worker read the manifest", 2 if errors else 1)
    missing = sorted(set(range(total)) - finished)
    out.line(report.line(compile_target.spec if compile_target is not None else ""))
    if total == 0:
        raise CLIError(f"{args.target} lists no signatures: nothing was precompiled", 1)
    if missing:
        names = ", ".join(labels.get(i, f"#{i}") for i in missing[:_NAMED])
        more = f" and {len(missing) - _NAMED} more" if len(missing) > _NAMED else ""
        raise CLIError(
            f"precompile incomplete: {len(missing)} of {total} signatures not done "
            f"({names}{more}: their workers stopped)",
            1,
        )
    if report.failed:
        raise CLIError(
            f"{len(report.failed)} of {total} signature{'s' if total != 1 else ''} failed "
            "(see FAILED above; the manifest's precompile() in Python raises the first, with "
            "its traceback)",
            1,
        )
    if report.plain:
        raise CLIError(
            f"{len(report.plain)} of {total} signature{'s' if total != 1 else ''} cannot be "
            "cached: they run under plain jax.jit in the deployment too (see 'not cached' "
            "above, and DEBUG logs for why)",
            1,
        )
    errors = [w.error for w in failed if w.error]
    if errors:
        # Last, after the counts: they say what was made, not that it reached the cache.
        raise CLIError(f"precompile failed: {errors[0]}", 1)
    return 0


PRECOMPILE = Command(
    "precompile",
    "build every executable a deployment's manifest names into the cache",
    _configure,
    _run,
    description="Load or compile every executable the signatures of a jaxaot.Manifest need, "
    "without running anything, into the cache a deployment will read. Workers split the "
    "signatures through the cache's leases; several machines pointed at one shared cache "
    "split them the same way, and a worker that dies has its signatures taken over.",
    epilog="Exit status: 0 when every signature was precompiled (here or by another "
    "process on the cache); 1 when one failed or was left undone, the cache is unusable or did "
    "not store an entry, or the manifest lists none; 2 for a bad MANIFEST, --target, or a "
    "--cache of memory or off.",
    uses_cache=False,
)
