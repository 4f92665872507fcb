"""``jaxaot cache info KEY``: everything about one entry (its header, key parts,
sections, arguments and results, cost analysis), or JSON."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

from .._output import CLIError, Output, clip, human_bytes, human_count, iso_time
from ._text import kind, opt, record_json, value_text, when_text
from ._view import Record, load_record, open_cache, resolve_key

#: Configuration options ``cache info`` shows by name; the others are counted.
_CONFIG_SHOWN = frozenset(
    [
        "config.jax_enable_x64",
        "config.jax_default_matmul_precision",
        "config.jax_numpy_rank_promotion",
        "config.jax_numpy_dtype_promotion",
        "config.jax_default_prng_impl",
    ]
)


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", metavar="KEY", help="a full digest or a unique prefix (4+ hex digits)")
    p.add_argument("--json", action="store_true", help="print the entry's details as JSON")


def _is_pairs(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in value)
    )


def _flatten(name: str, value: Any) -> list[tuple[str, str]]:
    """``name  value`` rows; name/value-pair lists and flat dicts become dotted rows."""
    if _is_pairs(value):
        return [(f"{name}.{k}", value_text(v)) for k, v in value]
    if isinstance(value, dict) and value:
        return [(f"{name}.{k}", value_text(v)) for k, v in value.items()]
    return [(name, value_text(value))]


def _labelled(names: Sequence[Any], avals: Sequence[Any], default: str) -> list[tuple[str, str]]:
    rows = []
    for i in range(max(len(names), len(avals))):
        name = str(names[i]) if i < len(names) and names[i] else f"{default} {i}"
        rows.append((name, str(avals[i]) if i < len(avals) else "?"))
    return rows


def _cmd_info(args: argparse.Namespace, out: Output) -> int:
    view = open_cache(args)
    key = resolve_key(view, args.key)
    record = load_record(view, key)
    if record is None:
        raise CLIError(f"entry {key[:16]} vanished while it was read")
    path = view.path(key)
    if args.json:
        out.json(_info_json(record, path))
        return 0 if record.error is None else 1
    overview = [
        ("digest", key),
        ("name", record.name),
        ("size", f"{human_bytes(record.size)} ({record.size} bytes)"),
    ]
    if path is not None:
        overview.append(("file", path))
    overview += [
        ("hits", opt(record.hits)),
        ("last used", when_text(record.last_used)),
    ]
    if record.header is None:
        overview.append(("error", record.error or "?"))
        out.fields(overview, title="entry")
        return 1
    h = record.header
    overview += [
        ("created", when_text(record.created)),
        # (A root entry's is none: its key parts say so.)
        *((("transform", record.transform),) if record.transform not in ("-", "") else ()),
        ("kind", kind(record)),
        ("signature", clip(str(h.get("signature", "?")), _INFO_WIDTH)),
        ("platforms", ", ".join(str(p) for p in h.get("platforms") or []) or "-"),
        ("host callbacks", "yes" if h.get("host_callbacks") else "no"),
    ]
    out.fields(overview, title="entry")
    out.fields(
        [
            ("format", value_text(h.get("format"))),
            ("jax", value_text(h.get("jax"))),
            ("jaxlib", value_text(h.get("jaxlib"))),
        ],
        title="versions",
    )
    out.fields([(n, clip(v, _INFO_WIDTH)) for n, v in _key_part_rows(record)], title="key parts")
    out.fields(
        [(n, f"{human_bytes(s)} ({s} bytes)") for n, s in record.sections.items()]
        or [("(none)", "")],
        title="sections",
    )
    _show_signature(out, h)
    _show_extra(out, h)
    return 0


def _info_json(record: Record, path: str | None) -> dict[str, Any]:
    """``cache info --json``: the entry as ``ls --json`` lists it, its file, and its
    whole header."""
    data = record_json(record)
    data["path"] = path
    if record.header is not None:
        h = record.header
        data.update(
            {
                "key_parts": record.parts,
                "versions": {"jax": h.get("jax"), "jaxlib": h.get("jaxlib")},
                "format": h.get("format"),
                "created_iso": iso_time(record.created),
                "host_callbacks": h.get("host_callbacks"),
                "arg_names": h.get("arg_names"),
                "result_paths": h.get("result_paths"),
                "in_avals": h.get("in_avals"),
                "out_avals": h.get("out_avals"),
                "out_tree": h.get("out_tree"),
                "deps": h.get("deps"),
                "extra": h.get("extra"),
            }
        )
    return data


def _key_part_rows(record: Record) -> list[tuple[str, str]]:
    """The key parts, one row each (dotted for nested values). The tracing context
    is dozens of options (more in newer JAX): the ones people change are shown, then
    a count of the rest."""
    parts: list[tuple[str, str]] = []
    config: list[tuple[str, str]] = []
    for name, value in record.parts.items():
        for n, v in _flatten(name, value):
            (config if n.startswith("config.") else parts).append((n, v))
    shown = [(n, v) for n, v in config if n in _CONFIG_SHOWN]
    if config:
        rest = len(config) - len(shown)
        at = next((i for i, (n, _) in enumerate(parts) if n == "platforms"), len(parts))
        summary = [*shown, ("config.…", f"{rest} more options (--json lists them all)")]
        parts[at:at] = summary if rest else shown
    return parts


def _show_signature(out: Output, h: dict[str, Any]) -> None:
    """The arguments and the results, by name and type (at most ``_INFO_ROWS`` each)."""
    for title, names, avals, default in (
        ("arguments", h.get("arg_names") or [], h.get("in_avals") or [], "input"),
        ("results", h.get("result_paths") or [], h.get("out_avals") or [], "output"),
    ):
        rows = _labelled(names, avals, default)
        if len(rows) > _INFO_ROWS:
            more = len(rows) - _INFO_ROWS + 1
            rows = [*rows[: _INFO_ROWS - 1], (f"… {more} more", "(--json lists them all)")]
        out.fields(rows or [("(none)", "")], title=f"{title} ({len(names) or len(avals)})")


def _show_extra(out: Output, h: dict[str, Any]) -> None:
    """XLA's cost analysis, then whatever else the entry records (``extra``)."""
    extra = dict(h.get("extra") or {})
    cost = extra.pop("cost_analysis", None)
    extra.pop("executable_in_tree", None)  # the executable's calling convention: --json
    if isinstance(cost, list) and cost and isinstance(cost[0], dict):
        cost = cost[0]
    if isinstance(cost, dict) and cost:
        out.fields(_cost_rows(cost), title="cost analysis (XLA's estimate)")
    extra_rows: list[tuple[str, str]] = []
    for name, value in extra.items():
        extra_rows += [(n, clip(v, _INFO_WIDTH)) for n, v in _flatten(str(name), value)]
    if extra_rows:
        out.fields(extra_rows, title="extra")


#: Widest value ``cache info`` prints (``--json`` has them whole), and the most
#: argument or result rows.
_INFO_WIDTH = 100
_INFO_ROWS = 12

#: The cost-analysis figures people read, in this order, and how to show them.
_COSTS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("flops", "flops", human_count),
    ("transcendentals", "transcendentals", human_count),
    ("bytes accessed", "bytes accessed", lambda v: human_bytes(int(v))),
    ("optimal_seconds", "optimal seconds", lambda v: f"{v:.3g} s"),
)


def _cost_rows(cost: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, label, fmt in _COSTS:
        value = cost.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            rows.append((label, fmt(float(value))))
    others = len([k for k in cost if k not in {c[0] for c in _COSTS}])
    if others:
        rows.append(("…", f"{others} more figures (per operand and output): --json"))
    return rows
