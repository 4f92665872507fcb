"""``jaxaot cache verify [--fix]``: check every entry (checksum, or signature when
a key is set) and optionally remove the bad ones."""

from __future__ import annotations

import argparse

from .._output import CLIError, Output, entries_text, human_bytes
from ._view import load_records, open_cache


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fix",
        action="store_true",
        help="remove bad entries (moved to the cache's quarantine when it has one, else "
        "deleted); entries this process cannot check with its key are left alone",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --fix: also remove entries this process cannot check (signed with "
        "another key, or unsigned while $JAXAOT_CACHE_HMAC_KEY is set)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _cmd_verify(args: argparse.Namespace, out: Output) -> int:
    from ..._caches._trust import HMAC_ENV, signing

    if args.force and not args.fix:
        raise CLIError("--force only goes with --fix")
    view = open_cache(args)
    records = load_records(view)
    others = [r for r in records if r.other_format is not None]
    records = [r for r in records if r.other_format is None]
    bad = [r for r in records if r.error is not None]
    removed: dict[str, str] = {}
    if args.fix:
        for r in bad:
            if not r.removable and not args.force:
                continue  # sound for the processes that hold the key: left alone
            try:
                how = view.remove_bad(r.key, force=args.force)
            except OSError:
                continue
            if not view.exists(r.key):
                removed[r.key] = how
    signed = signing()
    status = 0 if not bad or (args.fix and len(removed) == len(bad)) else 1
    if args.json:
        out.json(
            {
                "path": view.location,
                "checked": len(records),
                "ok": len(records) - len(bad),
                "signatures": signed,
                "other_format": [{"digest": r.key, "format": r.other_format} for r in others],
                "bad": [
                    {
                        "digest": r.key,
                        "error": r.error,
                        "removable": r.removable,
                        "removed": removed.get(r.key),
                    }
                    for r in bad
                ],
            }
        )
        return status
    check = f"signatures (${HMAC_ENV})" if signed else "checksums"
    out.line(f"checked {entries_text(len(records))} in {view.location} ({check})")
    if bad:
        rows = []
        for r in bad:
            row = [r.key[:12], human_bytes(r.size), r.error or "?"]
            if args.fix:
                kept = "NOT REMOVED" if r.removable or args.force else "left alone (--force)"
                row.append(removed.get(r.key, kept))
            rows.append(row)
        columns = [("DIGEST", "left"), ("SIZE", "right"), ("PROBLEM", "left")]
        if args.fix:
            columns.append(("ACTION", "left"))
        out.table(columns, rows)
    summary = f"{len(records) - len(bad)} ok, {len(bad)} bad"
    if others:
        versions = ", ".join(sorted({str(r.other_format) for r in others}))
        summary += f", {len(others)} of another entry format ({versions}; skipped)"
    if args.fix and bad:
        summary += f", {len(removed)} removed"
        if len(removed) < len(bad):
            summary += f", {len(bad) - len(removed)} could not be removed"
    out.line(summary)
    return status
