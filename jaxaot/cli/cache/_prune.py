"""``jaxaot cache prune``: remove the least recently used entries, or those unused
for longer than a duration.

On a terminal, prune says what it would remove and asks unless ``--yes``. When
stdin is not a terminal (cron, CI, a pipe) it does not ask: a size cap kept by
a scheduled job is what prune is for, and a prompt there would hang it. It
says what it removed either way."""

from __future__ import annotations

import argparse
import math
import sys
import time

from .._output import (
    CLIError,
    Output,
    confirm,
    entries_text,
    human_bytes,
    is_terminal,
    parse_duration,
    parse_size,
)
from ._view import Record, load_record, open_cache


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        metavar="N",
        help="remove least recently used entries until the entries total at most N bytes "
        "(suffixes K, M, G, T are powers of 1024: 500M, 2G)",
    )
    p.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="DURATION",
        help="remove entries not used for longer than DURATION, which needs a unit "
        "(30s, 15m, 12h, 7d, 2w)",
    )
    p.add_argument("--dry-run", action="store_true", help="show what would be removed")
    p.add_argument(
        "-y", "--yes", action="store_true", help="do not ask for confirmation on a terminal"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="list each removed entry")


def _cmd_prune(args: argparse.Namespace, out: Output) -> int:
    from ..._caches import DirectoryCache

    if args.max_bytes is None and args.older_than is None:
        raise CLIError(
            "prune needs --max-bytes N or --older-than DURATION (see 'jaxaot cache prune --help')",
            2,
        )
    view = open_cache(args)
    records = [
        r
        for r in (load_record(view, k, with_header=view.has_access_times) for k in view.keys())
        if r is not None
    ]
    if not view.has_access_times:
        # No access times from the backend: fall back to creation times in the headers.
        records = [r for r in (load_record(view, r.key) for r in records) if r is not None]
    # Least recently used first; entries with no time at all go first.
    records.sort(key=lambda r: (r.when if r.when is not None else -math.inf, r.key))
    victims: list[Record] = []
    keep = list(records)
    if args.older_than is not None:
        cutoff = time.time() - args.older_than
        victims = [r for r in keep if r.when is None or r.when < cutoff]
        keep = [r for r in keep if not (r.when is None or r.when < cutoff)]
    if args.max_bytes is not None:
        total = sum(r.size for r in keep)
        while keep and total > args.max_bytes:
            r = keep.pop(0)
            victims.append(r)
            total -= r.size
    if victims and not args.dry_run and not args.yes and is_terminal(sys.stdin):
        if args.verbose:
            for r in victims:
                out.line(f"would remove {r.key[:12]}  {human_bytes(r.size)}  {r.name}")
        what = f"{entries_text(len(victims))} ({human_bytes(sum(r.size for r in victims))})"
        if not confirm(f"Remove {what} of {len(records)} from {view.location}?"):
            out.line("nothing removed")
            return 1
    removed: list[Record] = []
    for r in victims:
        if args.dry_run or view.cache.delete(r.key):
            removed.append(r)
    verb = "would remove" if args.dry_run else "removed"
    if args.verbose:
        for r in removed:
            out.line(f"{verb} {r.key[:12]}  {human_bytes(r.size)}  {r.name}")
    if removed and not args.dry_run and isinstance(view.cache, DirectoryCache):
        view.cache.tidy()  # (the notes of what it removed)
    gone = {r.key for r in removed}
    left = [r for r in records if r.key not in gone]
    out.line(
        f"{verb} {entries_text(len(removed))} ({human_bytes(sum(r.size for r in removed))}) "
        f"from {view.location}; {entries_text(len(left))} "
        f"({human_bytes(sum(r.size for r in left))}) left"
    )
    if len(removed) < len(victims):  # a directory it cannot write in: the run fails
        out.line(f"{entries_text(len(victims) - len(removed))} could not be removed")
        return 1
    return 0
