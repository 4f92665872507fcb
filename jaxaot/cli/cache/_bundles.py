"""``jaxaot cache export`` and ``jaxaot cache import``: move entries between caches
and machines as one bundle file."""

from __future__ import annotations

import argparse
import os
import tempfile

from .._output import CLIError, Output, entries_text, human_bytes
from ._view import load_records, open_cache


def _export_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", metavar="BUNDLE", help="the bundle file to write")
    p.add_argument(
        "--component",
        action="append",
        metavar="NAME",
        default=None,
        help="only this component's entries (its function name, as 'cache ls' shows); "
        "repeat for several",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _cmd_export(args: argparse.Namespace, out: Output) -> int:
    from ..._store._bundle import export_bundle

    view = open_cache(args)
    target = os.path.abspath(os.path.expanduser(args.bundle))
    # Written next to the target and moved into place only when every --component
    # matched: a failed export leaves no file (and never half a bundle).
    fd, tmp = tempfile.mkstemp(
        prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=os.path.dirname(target)
    )
    os.close(fd)
    try:
        report = export_bundle(tmp, cache=view.cache, components=args.component)
        if not report["unmatched"] and report["entries"]:
            os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    report["path"] = target
    report["source"] = view.location
    if report["unmatched"]:
        report["written"] = False
        held = sorted({r.name for r in load_records(view) if r.header is not None})
        if args.json:
            out.json(report)
            return 1
        raise CLIError(
            "no entries for component(s): "
            + ", ".join(report["unmatched"])
            + f" (in {view.location}, whose components are "
            + (", ".join(held) or "none")
            + f"); nothing written to {target}"
        )
    if not report["entries"]:  # an empty bundle would read as a successful export
        report["written"] = False
        if args.json:
            out.json(report)
            return 1
        bad = len(report["bad"])
        raise CLIError(
            f"nothing to export from {view.location}: "
            + (f"all {entries_text(bad)} failed verification" if bad else "it holds no entries")
            + f"; nothing written to {target}"
        )
    report["written"] = True
    if args.json:
        out.json(report)
        return 0
    names = ", ".join(report["names"]) or "-"
    out.line(
        f"exported {entries_text(report['entries'])} ({human_bytes(report['bytes'])}) from "
        f"{view.location} to {report['path']} (components: {names})"
    )
    if report["bad"]:
        out.line(
            f"left out {entries_text(len(report['bad']))} that failed verification: "
            + ", ".join(k[:12] for k in report["bad"])
        )
    return 0


def _import_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", metavar="BUNDLE", help="the bundle file to read")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _cmd_import(args: argparse.Namespace, out: Output) -> int:
    from ..._store._bundle import BundleError, import_bundle

    if not os.path.isfile(args.bundle):
        raise CLIError(f"no such bundle file: {args.bundle}")
    view = open_cache(args, create=True)
    try:
        report = import_bundle(args.bundle, cache=view.cache)
    except BundleError as e:
        raise CLIError(f"refused the bundle {args.bundle}: {e}; nothing imported") from None
    report["target"] = view.location
    not_stored = report.get("not_stored", [])
    status = 1 if report["refused"] or not report.get("complete", True) else 0
    if args.json:
        out.json(report)
        return status
    added, skipped, refused = report["added"], report["skipped"], report["refused"]
    out.line(
        f"imported {report['path']} into {view.location}: {len(added)} added, "
        f"{len(skipped)} skipped (already present), {len(refused)} refused"
    )
    if refused:
        out.table(
            [("DIGEST", "left"), ("PROBLEM", "left")],
            [[r["digest"][:12], r["error"]] for r in refused],
        )
    if not_stored:
        out.line(
            f"{len(not_stored)} of the added entries are not in {view.location} "
            "(a size cap smaller than the entries, or a failing store): "
            + ", ".join(str(d)[:12] for d in not_stored)
        )
    return status
