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
#: The columns left out, first to last, of a table wider than the terminal.
_LS_GIVE_WAY = ("FLOPS", "PLATFORMS", "HITS", "KIND", "TRANSFORM", "DIGEST", "LAST USED")
#: NAME, TRANSFORM and SIGNATURE are cut to no fewer characters than this on a terminal.
_LS_NARROWEST = 12

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
    columns = list(_LS_COLUMNS)
    limits: dict[int, int] | None = None
    hidden: list[str] = []
    if args.wide:  # every cell in full, longer than the terminal if need be
        out = Output(out.stream, plain=True)
    else:
        limits = dict(_LS_LIMITS)
        if out.rich:
            columns, rows, limits, hidden = _fit(columns, rows, limits, terminal_width())
    total = sum(r.size for r in records)
    caption = f"{entries_text(len(records))}, {human_bytes(total)}"
    if hidden:
        caption += f"; not shown to fit the terminal: {', '.join(hidden)} (--wide shows all)"
    out.table(
        columns,
        rows,
        title=f"jaxaot cache {view.location}",
        caption=caption,
        limits=limits,
        middle=tuple(i for i, (h, _) in enumerate(columns) if h == "SIGNATURE"),
        fitted=True,
    )
    return 0


def _fit(
    columns: list[tuple[str, str]], rows: list[list[str]], limits: dict[int, int], width: int
) -> tuple[list[tuple[str, str]], list[list[str]], dict[int, int], list[str]]:
    """The columns, rows and cell limits of a table ``width`` characters wide: the
    NAME, TRANSFORM and SIGNATURE cells are cut (to no fewer than
    :data:`_LS_NARROWEST` characters), and if that is not enough the columns of
    :data:`_LS_GIVE_WAY` are left out, in that order; also the headers left out."""
    flexible = {0, 1, 3}
    natural = [
        max([len(header), *(len(clip(row[i], limits.get(i))) for row in rows)])
        for i, (header, _) in enumerate(columns)
    ]
    narrowest = [min(n, _LS_NARROWEST) if i in flexible else n for i, n in enumerate(natural)]

    def frame(n: int) -> int:  # a box table's borders and padding
        return 3 * n + 1

    kept = list(range(len(columns)))
    hidden = []
    for header in _LS_GIVE_WAY:
        if sum(narrowest[i] for i in kept) + frame(len(kept)) <= width:
            break
        i = next(i for i, (h, _) in enumerate(columns) if h == header)
        kept.remove(i)
        hidden.append(header)
    budget = width - frame(len(kept)) - sum(natural[i] for i in kept if i not in flexible)
    cells = {i: natural[i] for i in kept if i in flexible}
    while sum(cells.values()) > budget:  # the widest flexible column gives a character
        i = max(cells, key=lambda j: (cells[j] > narrowest[j], cells[j]))
        if cells[i] <= narrowest[i]:
            break
        cells[i] -= 1
    fitted = {kept.index(i): n for i, n in cells.items()}
    return [columns[i] for i in kept], [[row[i] for i in kept] for row in rows], fitted, hidden
