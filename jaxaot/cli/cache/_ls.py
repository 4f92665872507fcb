"""``jaxaot cache ls``: the entries as a table (bounded to the terminal or a
piped line) or as JSON."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

from .._output import (
    Output,
    clip,
    entries_text,
    human_bytes,
    human_count,
    human_time,
    terminal_width,
)
from ._text import kind, opt, record_json
from ._view import Record, load_records, open_cache

_SORTS: dict[str, Callable[[Record], Any]] = {
    "name": lambda r: (r.name.lower(), r.key),
    "size": lambda r: (-r.size, r.key),
    "hits": lambda r: (-(r.hits if r.hits is not None else -1), r.key),
    "last-used": lambda r: (-(r.when if r.when is not None else -math.inf), r.key),
}


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sort",
        choices=list(_SORTS),
        default="last-used",
        help="order: name (A-Z), size, hits (largest first) or last-used (newest first; default)",
    )
    p.add_argument(
        "--wide",
        action="store_true",
        help="full signatures and names (otherwise cut to fit the terminal, or to "
        f"{_LS_LIMITS[3]} characters when piped)",
    )
    p.add_argument("--json", action="store_true", help="a JSON list of entries, for scripts")


_LS_COLUMNS = [
    ("NAME", "left"),
    ("TRANSFORM", "left"),
    ("KIND", "left"),
    ("SIGNATURE", "left"),
    ("PLATFORMS", "left"),
    ("SIZE", "right"),
    ("HITS", "right"),
    ("LAST USED", "left"),
    ("FLOPS", "right"),
    ("DIGEST", "left"),
]
#: Widest NAME, TRANSFORM and SIGNATURE cells without --wide (a piped line stays
#: under about 170 characters; a terminal cuts the signature further to fit).
_LS_LIMITS = {0: 24, 1: 32, 3: 48}


def _cmd_ls(args: argparse.Namespace, out: Output) -> int:
    view = open_cache(args)
    records = sorted(load_records(view), key=_SORTS[args.sort])
    if args.json:
        out.json([record_json(r) for r in records])
        return 0
    if not records:
        out.line(f"no entries in {view.location}")
        return 0
    now = time.time()
    rows = []
    for r in records:
        if r.header is None:
            rows.append(
                [r.name, "-", "-", r.error or "", "-", human_bytes(r.size), opt(r.hits)]
                + [human_time(r.last_used, now), "-", r.key[:12]]
            )
            continue
        flops = r.flops
        rows.append(
            [
                r.name,
                r.transform,
                kind(r),
                str(r.header.get("signature", "?")),
                ",".join(str(p) for p in r.header.get("platforms") or []) or "-",
                human_bytes(r.size),
                opt(r.hits),
                human_time(r.when, now),
                human_count(flops) if flops is not None else "-",
                r.key[:12],
            ]
        )
    limits: dict[int, int] | None = None
    if args.wide:  # every cell in full, longer than the terminal if need be
        out = Output(out.stream, plain=True)
    else:
        limits = dict(_LS_LIMITS)
        if out.rich:  # the signature takes what the other columns leave of the terminal
            others = sum(
                max(len(h), *(len(clip(row[i], limits.get(i))) for row in rows))
                for i, (h, _) in enumerate(_LS_COLUMNS)
                if i != 3
            )
            limits[3] = max(12, terminal_width() - others - 3 * len(_LS_COLUMNS) - 1)
    total = sum(r.size for r in records)
    out.table(
        _LS_COLUMNS,
        rows,
        title=f"jaxaot cache {view.location}",
        caption=f"{entries_text(len(records))}, {human_bytes(total)}",
        limits=limits,
        middle=(3,),  # signatures differ at either end: keep both
    )
    return 0
