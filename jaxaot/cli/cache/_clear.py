"""``jaxaot cache clear``: remove every entry, after asking on the terminal unless
``--yes``."""

from __future__ import annotations

import argparse
import sys

from .._output import CLIError, Output, confirm, entries_text, human_bytes, is_terminal
from ._view import open_cache


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")


def _cmd_clear(args: argparse.Namespace, out: Output) -> int:
    view = open_cache(args)
    stats = view.cache.stats()
    n, size = int(stats.get("entries") or 0), int(stats.get("bytes") or 0)
    what = f"{entries_text(n)} ({human_bytes(size)})"
    if n == 0:
        out.line(f"no entries in {view.location}")
        return 0
    if not args.yes:
        if not is_terminal(sys.stdin):
            raise CLIError(
                f"not clearing {what} from {view.location}: stdin is not a terminal to "
                "confirm on; pass --yes"
            )
        if not confirm(f"Remove {what} from {view.location}?"):
            out.line("nothing removed")
            return 1
    before = set(view.cache.keys())
    view.cache.clear()
    now = set(view.cache.keys())
    left = len(before & now)
    if left:  # a directory it cannot write in: said, and the run fails
        out.line(
            f"removed {entries_text(len(before) - left)} of {len(before)} from "
            f"{view.location}; {entries_text(left)} could not be removed"
        )
        return 1
    out.line(f"removed {what} from {view.location}")
    if now - before:  # written meanwhile by a process using the cache: not a failure
        out.line(f"{entries_text(len(now - before))} written meanwhile by a running process")
    return 0
