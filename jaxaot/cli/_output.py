"""Shared pieces of the ``jaxaot`` command line: one-line errors, the argument
parser, the command registry types, and output (rich tables on a terminal,
plain bounded text when piped), with the parsers and formatters of sizes,
durations and times."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, NoReturn

PROG = "jaxaot"

# ----------------------------------------------------------------------------
# Errors and the argument parser.


class CLIError(Exception):
    """A failure reported as one line on stderr (``jaxaot: error: ...``)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where a command stops its work on it (said as one line,
    exit status 143)."""


def quiet_stdout() -> None:
    """Points standard output at /dev/null: its reader went away (a closed pipe),
    and the interpreter's last flush would fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line and raise :class:`CLIError`."""

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see '{self.prog} --help')", 2)


# ----------------------------------------------------------------------------
# Output: a rich rendering on a terminal, plain aligned text otherwise.


def is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Output:
    """Writes tables, key/value blocks, lines and JSON to ``stream``.

    On a terminal (and when ``rich`` is importable) tables are drawn by rich;
    otherwise they are plain text, columns separated by two spaces, with no box
    drawing and no colors.
    """

    def __init__(self, stream: IO[str] | None = None, *, plain: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self._console: Any = None
        if not plain and is_terminal(self.stream):
            try:
                from rich.console import Console
            except ImportError:  # pragma: no cover - rich is a dependency
                pass
            else:
                self._console = Console(file=self.stream, force_terminal=True, highlight=False)

    @property
    def rich(self) -> bool:
        return self._console is not None

    def line(self, text: str = "") -> None:
        if self._console is not None:
            self._console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.stream)

    def json(self, value: Any) -> None:
        print(json.dumps(value, indent=2, sort_keys=False, default=str), file=self.stream)

    def table(
        self,
        columns: Sequence[tuple[str, str]],
        rows: Sequence[Sequence[str]],
        *,
        title: str | None = None,
        caption: str | None = None,
        limits: dict[int, int] | None = None,
        middle: Sequence[int] = (),
        fitted: bool = False,
    ) -> None:
        """``columns`` are ``(header, "left"|"right")``; ``title``/``caption`` only on a terminal.

        ``fitted``: the caller chose columns and limits that fit the terminal
        (``cache ls``), so the columns without a limit keep their cells whole;
        otherwise rich narrows every column to fit.

        ``limits`` maps a column's index to its widest cell: longer cells are cut
        with an ellipsis (``--wide`` callers pass none), in the middle for the
        columns in ``middle`` (where both ends tell rows apart). On a terminal
        the table also fits the terminal's width: the limited columns give way first.
        """
        limits = limits or {}
        rows = [
            [clip(c, limits.get(i), middle=i in middle) for i, c in enumerate(row)] for row in rows
        ]
        if self._console is not None:
            from rich.table import Table
            from rich.text import Text

            natural = [
                max([len(header), *(len(row[i]) for row in rows)])
                for i, (header, _) in enumerate(columns)
            ]
            table = Table(title=title, caption=caption, title_justify="left")
            for i, (header, justify) in enumerate(columns):
                table.add_column(
                    header,
                    justify="right" if justify == "right" else "left",
                    no_wrap=True,
                    overflow="ellipsis",
                    max_width=limits.get(i),
                    min_width=None if i in limits else natural[i] if fitted else len(header),
                    ratio=1 if i in limits else None,
                )
            for row in rows:
                table.add_row(*[Text(cell) for cell in row])
            self._console.print(table)
            return
        widths = [len(h) for h, _ in columns]
        for row in rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        for row in [[h for h, _ in columns], *rows]:
            cells = [
                c.rjust(w) if justify == "right" else c.ljust(w)
                for c, w, (_, justify) in zip(row, widths, columns, strict=True)
            ]
            print("  ".join(cells).rstrip(), file=self.stream)

    def fields(self, pairs: Sequence[tuple[str, str]], *, title: str | None = None) -> None:
        """A block of ``name  value`` lines, names aligned, under an optional title."""
        if self._console is not None:
            from rich.table import Table
            from rich.text import Text

            if title:
                self._console.print(Text(title, style="bold"))
            grid = Table.grid(padding=(0, 2))
            grid.add_column(style="cyan", no_wrap=True)
            grid.add_column(overflow="fold")
            for name, value in pairs:
                grid.add_row(Text(name), Text(value))
            self._console.print(grid)
            return
        indent = ""
        if title:
            print(f"{title}:", file=self.stream)
            indent = "  "
        width = max((len(n) for n, _ in pairs), default=0)
        for name, value in pairs:
            print(f"{indent}{name.ljust(width)}  {value}".rstrip(), file=self.stream)


# ----------------------------------------------------------------------------
# Parsing and formatting sizes, durations, times.

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*$", re.IGNORECASE)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def confirm(question: str) -> bool:
    """Asks ``question [y/N]`` on the terminal; only ``y``/``yes`` is a yes."""
    try:
        answer = input(f"{question} [y/N] ")
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``500M``, ``2G``, ``1.5GiB``...; K/M/G/T/P are powers of 1024
    (``jaxaot._store._active.parse_size``, the syntax of ``JAXAOT_CACHE_MAX_BYTES`` too)."""
    from .._store._active import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_duration(text: str) -> float:
    """Seconds from ``30s``, ``15m``, ``12h``, ``7d``, ``2w``.

    A bare number is refused: ``find -mtime 2`` means days and ``sleep 2``
    seconds, so either reading surprises someone (and ``prune`` deletes)."""
    m = _DURATION_RE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 7d)"
        )
    if not m.group(2):
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: give a unit, e.g. {m.group(1)}d for days or "
            f"{m.group(1)}h for hours (s, m, h, d, w)"
        )
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def iso_time(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def human_time(ts: float | None, now: float | None = None) -> str:
    """``42s ago``, ``3h ago``, ``5d ago``; a date for older or future times."""
    if ts is None:
        return "-"
    now = time.time() if now is None else now
    age = now - ts
    if -60 < age < 60:
        return "just now" if age < 1 else f"{int(age)}s ago"
    if 0 < age < 3600:
        return f"{int(age // 60)}m ago"
    if 0 < age < 86400:
        return f"{int(age // 3600)}h ago"
    if 0 < age < 30 * 86400:
        return f"{int(age // 86400)}d ago"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def human_count(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:g}"


def entries_text(n: int) -> str:
    return "1 entry" if n == 1 else f"{n} entries"


def clip(text: str, limit: int | None, *, middle: bool = False) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis at the end (or, with
    ``middle``, between its start and its end); unchanged without a limit."""
    if limit is None or len(text) <= limit:
        return text
    if middle:
        # Whole items (split at ", ") from both ends, the middle ones left out.
        items = text.split(", ")
        left, right = items[:1], items[-1:]
        rest = items[1:-1]

        def joined() -> str:
            return ", ".join([*left, "…", *right])

        if len(items) >= 3 and len(joined()) <= limit:
            while rest:
                item = rest.pop(0) if len(left) <= len(right) else rest.pop()
                side = left if len(left) <= len(right) else right
                if side is left:
                    left.append(item)
                else:
                    right.insert(0, item)
                if len(joined()) > limit:
                    side.remove(item)
                    break
            return joined()
    return text[: max(0, limit - 1)] + "…"


def terminal_width(default: int = 100) -> int:
    """The terminal's width (``$COLUMNS`` first), else ``default``."""
    return shutil.get_terminal_size((default, 24)).columns


@dataclass(frozen=True)
class Command:
    """One subcommand: ``configure`` adds its arguments, ``run`` does the work and
    returns the exit status."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Output], int]
    description: str = ""
    epilog: str = ""
    uses_cache: bool = True


@dataclass(frozen=True)
class Group:
    """A command with subcommands (``jaxaot cache ...``)."""

    name: str
    help: str
    commands: tuple[Command, ...]
    description: str = ""
