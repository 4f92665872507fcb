"""``jaxaot bench``: the warm-start, regional-compilation and sharded benchmarks
(:mod:`jaxaot._bench` and :mod:`jaxaot._bench_sharded` run them), with their
extras checked before anything runs."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from ._output import CLIError, Command, Output

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


def _configure(parser: argparse.ArgumentParser) -> None:
    from .. import _bench

    _bench.add_arguments(parser)
    # The regional suite's model shape and mode, unless the benchmark defines them itself.
    have = set(parser._option_string_actions)
    for flag, dest, what in (
        ("--width", "width", "model width"),
        ("--batch", "batch", "batch size"),
        ("--seq", "seq", "sequence length"),
    ):
        if flag not in have:
            parser.add_argument(
                flag,
                dest=dest,
                type=int,
                default=None,
                metavar="N",
                help=f"regional: the {what} (default: the benchmark model's)",
            )
    if "--inference" not in have:
        parser.add_argument(
            "--inference",
            action="store_true",
            help="regional: time the forward pass only (no gradient)",
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
    from .. import _bench, _bench_sharded

    try:
        text = _bench.run(args, lambda message: print(message, file=sys.stderr))
    except _bench_sharded.ArgumentError as e:
        raise CLIError(f"jaxaot bench {args.suite}: {e}", 2) from e
    out.line(text)
    out.line(f"tables, JSON and plots written to {os.path.abspath(args.out)}")
    return 0


BENCH = Command(
    "bench",
    "benchmark warm starts, regional compilation and sharded steps against JAX's own caches",
    _configure,
    _cmd_bench,
    description="Run the warm-start benchmark (jax.jit, JAX's persistent cache, jax.export, "
    "jaxaot, the physical limit) and/or the regional-compilation depth sweep (jax.jit, scan, "
    "Equinox noinline, jaxaot.jit), and/or the sharded suite (jax.jit, scan, jaxaot.jit on a "
    "mesh of simulated CPU devices, data-parallel and FSDP; not part of all), each contender "
    "in a fresh process; write Markdown tables, JSON and PNG plots.",
    epilog='Needs the bench extra (pip install ".[bench]": matplotlib, flatbuffers, equinox); '
    "without it the command stops at once and names what is missing (exit status 2).",
    uses_cache=False,
)
