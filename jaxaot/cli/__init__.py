"""The ``jaxaot`` command line (also ``python -m jaxaot``).

Commands::

  jaxaot demo          [--steps N] [--dir PATH | --cold] [--layers L] [--width W] ...
  jaxaot bench         [warm-start|regional|sharded|all] [--layers L ...] [--full | --quick] ...
  jaxaot cache ls      [--dir PATH | --url URL] [--sort ...] [--wide] [--json]
  jaxaot cache info    KEY [--json]
  jaxaot cache stats   [--json]
  jaxaot cache verify  [--fix] [--json]
  jaxaot cache prune   (--max-bytes N | --older-than DURATION) [--dry-run] [--yes] [-v]
  jaxaot cache clear   [--yes]
  jaxaot cache export  BUNDLE [--component NAME ...] [--json]
  jaxaot cache import  BUNDLE [--json]
  jaxaot precompile    module:manifest [--workers N] [--cache SPEC]

Layout: :mod:`._output` holds what every command shares (one-line errors, the
parser, the :class:`Command`/:class:`Group` registry types, tables and
formatters); each command lives in its own module (:mod:`.demo`,
:mod:`.bench`, :mod:`.cache`) and exports its :class:`Command` or
:class:`Group`; :data:`COMMANDS` lists them in help order.

Nothing heavy is imported before it is needed: ``jaxaot --version`` and
``--help`` never import JAX (``jaxaot/__init__.py`` loads its names lazily),
and a command imports JAX, rich or NumPy only when it runs.
"""

from __future__ import annotations

import time

#: When this module was imported: the demo's clock starts here when the
#: process start time cannot be read (the process start is preferred).
IMPORTED_AT = time.perf_counter()

import argparse  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from .._env import SettingError  # noqa: E402
from ._output import (  # noqa: E402
    PROG,
    CLIError,
    Command,
    Group,
    Output,
    Terminated,
    _Parser,
    quiet_stdout,
)

__all__ = ["COMMANDS", "CLIError", "build_parser", "main"]


def _version() -> str:
    """The installed distribution's version, else the package's (no JAX import either way)."""
    from importlib import metadata

    try:
        return metadata.version("jaxaot")
    except metadata.PackageNotFoundError:
        from .. import __version__

        return __version__


def _commands() -> list[Command | Group]:
    from .bench import BENCH
    from .cache import CACHE
    from .demo import DEMO
    from .precompile import PRECOMPILE

    return [DEMO, BENCH, CACHE, PRECOMPILE]


def __getattr__(name: str) -> Any:
    if name == "COMMANDS":  # the registry, built on first use
        return _commands()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _add_command(sub: Any, cmd: Command) -> None:
    p = sub.add_parser(
        cmd.name,
        help=cmd.help,
        description=cmd.description or cmd.help[:1].upper() + cmd.help[1:] + ".",
        epilog=cmd.epilog or None,
    )
    if cmd.uses_cache:
        from .cache import add_location_arguments

        add_location_arguments(p)
    cmd.configure(p)
    p.set_defaults(_run=cmd.run, _prog=p.prog)


def _missing(parser: argparse.ArgumentParser, names: Sequence[str]) -> Callable[..., int]:
    def run(args: argparse.Namespace, out: Output) -> int:
        raise CLIError(
            f"'{parser.prog}' needs a command ({', '.join(names)}); see '{parser.prog} --help'", 2
        )

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="jaxaot: reusable, cached, compiled building blocks for JAX programs.",
        epilog=f"Run '{PROG} COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    top = parser.add_subparsers(title="commands", metavar="COMMAND")
    commands = _commands()
    parser.set_defaults(_run=_missing(parser, [c.name for c in commands]), _prog=PROG)
    for item in commands:
        if isinstance(item, Command):
            _add_command(top, item)
            continue
        gp = top.add_parser(
            item.name,
            help=item.help,
            description=item.description or None,
            epilog=f"Run '{PROG} {item.name} COMMAND --help' for a command's options.",
        )
        gsub = gp.add_subparsers(title="commands", metavar="COMMAND")
        gp.set_defaults(_run=_missing(gp, [c.name for c in item.commands]), _prog=gp.prog)
        for cmd in item.commands:
            _add_command(gsub, cmd)
    return parser


_calls = 0


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    global _calls
    _calls += 1
    started = time.perf_counter()
    raw = sys.argv[1:] if argv is None else list(argv)
    if raw in (["--version"], ["-V"]):  # answered before anything else is imported
        print(f"{PROG} {_version()}")
        return 0
    try:
        parser = build_parser()
        try:
            args, extra = parser.parse_known_args(raw)
        except SystemExit as e:  # --help and --version
            return e.code if isinstance(e.code, int) else 0
        if extra:
            prog = getattr(args, "_prog", PROG)
            raise CLIError(f"unrecognized arguments: {' '.join(extra)} (see '{prog} --help')", 2)
        # The first command of a process counts from the process start (the demo's clock).
        args._started = started
        args._first_call = _calls == 1
        return int(args._run(args, Output()))
    except CLIError as e:
        _error(str(e))
        return e.code
    except SettingError as e:  # a JAXAOT_* variable jaxaot cannot use
        _error(str(e))
        return 1
    except Terminated:
        _error("terminated")
        return 143
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (`jaxaot cache ls | head`): stop quietly.
        quiet_stdout()
        return 1
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        _error(f"{e.strerror or e}{where}")
        return 1


def _error(message: str) -> None:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
