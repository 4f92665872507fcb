"""``jaxaot bench``'s command line: its options, the :class:`~._config.BenchConfig`
they make, and the extras each suite needs, checked before anything runs."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from .._output import CLIError, Command, Output, positive_int
from ._config import AXIS_TYPES, LAYOUTS, SUITES, ArgumentError, BenchConfig, ModelShape

__all__ = ["BENCH", "EXTRAS", "add_arguments", "config_from_args", "missing_extras"]

#: What each suite imports, and why (the ``bench`` extra installs them all).
EXTRAS = {
    "matplotlib": "the plots",
    "flatbuffers": "jax.export, the warm-start suite's export contender",
    "equinox": "the regional suite's Equinox noinline contender",
}
SUITE_NEEDS = {
    "warm-start": ("matplotlib", "flatbuffers"),
    "regional": ("matplotlib", "equinox"),
    "sharded": ("matplotlib",),
    "fleet": (),
    "precompile": (),
    "edits": (),
    "all": ("matplotlib", "flatbuffers", "equinox"),
}


def importable(name: str) -> bool:
    """Whether ``import name`` would find the module (without importing it)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_extras(suite: str) -> list[str]:
    return [name for name in SUITE_NEEDS.get(suite, tuple(EXTRAS)) if not importable(name)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``jaxaot bench``."""
    default = ModelShape()
    parser.add_argument(
        "suite",
        nargs="?",
        default="warm-start",
        choices=SUITES,
        help="which benchmark (default warm-start; all = warm-start and regional; edits = "
        "the research loop: restarts and edits, each a fresh process)",
    )
    parser.add_argument(
        "--processes",
        type=positive_int,
        default=4,
        help="fleet: cold processes started together on one new cache (default 4)",
    )
    parser.add_argument(
        "--layers", type=positive_int, nargs="+", default=None, help="depths to run"
    )
    parser.add_argument("--full", action="store_true", help="warm-start: also L=8 and L=48")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="regional: stop at L=16; sharded: L=2 and 4 on a tiny model (for tests)",
    )
    parser.add_argument(
        "--max-jit-layers",
        type=int,
        default=48,
        help="regional, sharded: run the whole-program jax.jit contenders (and the sharded "
        "suite's physical limit) only up to this depth (default 48)",
    )
    _add_sharded_arguments(parser)
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="steady-state repeats (default 3)"
    )
    parser.add_argument(
        "--trials",
        type=positive_int,
        default=1,
        help="regional: run the contenders this many times, interleaved, each in a fresh "
        "process, and report each one's median (default 1)",
    )
    for flag, what, value in (
        ("--width", "model width", default.width),
        ("--batch", "batch size", default.batch),
        ("--seq", "sequence length", default.seq),
    ):
        parser.add_argument(
            flag,
            type=positive_int,
            default=None,
            help=f"regional, sharded, fleet, edits: {what} (default {value})",
        )
    parser.add_argument(
        "--inference",
        action="store_true",
        help="regional, sharded: time the forward pass alone, not the train step",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="a folder for the tables, JSON and plots (default: none, the tables are printed)",
    )


def _add_sharded_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices",
        type=positive_int,
        default=8,
        help="sharded: simulated CPU devices on the mesh (default 8; the 2d layout's mesh "
        "is N/2 x 2)",
    )
    parser.add_argument(
        "--contenders",
        nargs="+",
        default=None,
        metavar="NAME",
        help="regional, sharded, edits: run only these contenders (default: all of them)",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=None,
        choices=LAYOUTS,
        help="sharded: the layouts to run (default all three)",
    )
    parser.add_argument(
        "--axis-types",
        nargs="+",
        default=None,
        choices=AXIS_TYPES,
        help="sharded: the mesh's axis types, explicit (jax.make_mesh's default: shardings "
        "in the types, under jax.set_mesh) and/or auto (default both)",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run the parsed options describe."""
    from pathlib import Path

    return BenchConfig(
        suite=args.suite,
        layers=tuple(args.layers) if args.layers else None,
        full=args.full,
        quick=args.quick,
        repeats=args.repeats,
        trials=args.trials,
        max_jit_layers=args.max_jit_layers,
        width=args.width,
        batch=args.batch,
        seq=args.seq,
        inference=args.inference,
        devices=args.devices,
        contenders=tuple(args.contenders) if args.contenders else None,
        layouts=tuple(args.layouts) if args.layouts else None,
        axis_types=tuple(args.axis_types) if args.axis_types else None,
        processes=args.processes,
        out=None if args.out is None else Path(args.out),
    )


def _cmd_bench(args: argparse.Namespace, out: Output) -> int:
    missing = missing_extras(args.suite)
    if missing:
        needs = "; ".join(f"{name} ({EXTRAS[name]})" for name in missing)
        raise CLIError(
            f'jaxaot bench {args.suite} needs {needs}: pip install ".[bench]" '
            "(in a checkout of jaxaot; or pip install 'jaxaot[bench]')",
            2,
        )
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CLIError(f"--out {args.out}: not a folder (the tables, JSON and plots go there)", 2)
    from . import _suites

    config = config_from_args(args)
    try:
        text = _suites.run(config, lambda message: print(message, file=sys.stderr))
    except ArgumentError as e:
        raise CLIError(f"jaxaot bench {args.suite}: {e}", 2) from e
    out.line(text)
    if config.out is not None:
        out.line(f"tables, JSON and plots written to {os.path.abspath(config.out)}")
    return 0


BENCH = Command(
    "bench",
    "benchmark warm starts, regional compilation, sharded steps and fleets of cold processes",
    add_arguments,
    _cmd_bench,
    description="Run the warm-start benchmark (jax.jit, JAX's persistent cache, jax.export, "
    "jaxaot, the physical limit) and/or the regional-compilation depth sweep (jax.jit, scan, "
    "Equinox noinline, jaxaot.jit), and/or the sharded suite (jax.jit, scan, jaxaot.jit and "
    "the physical limit on a mesh of simulated CPU devices, data-parallel, FSDP and 2-D, "
    "explicit and auto axes; not part of all), and/or the fleet suite (N cold processes "
    "started together on one new cache, directory and Redis, against one alone; not part "
    "of all), and/or the edits suite (a research loop: cold, restart, three edits and their "
    "restarts, jaxaot.jit against jax.jit and scan with JAX's persistent cache; not part of "
    "all), each contender in a fresh process; write Markdown tables, JSON and PNG plots.",
    epilog='Needs the bench extra (pip install ".[bench]": matplotlib, flatbuffers, equinox); '
    "without it the command stops at once and names what is missing (exit status 2).",
    uses_cache=False,
)
