"""``jaxaot cache stats``: entries, size, cap and the backend's own figures about
the store (not its per-process counters)."""

from __future__ import annotations

import argparse
from typing import Any

from .._output import Output, human_bytes
from ._text import opt, value_text
from ._view import open_cache


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")


#: A backend instance's counters of its own calls: always 0 in a fresh CLI
#: process, so ``stats`` leaves them out (``recorded hits`` is the persistent count).
_PROCESS_COUNTERS = frozenset(
    {
        "hits",
        "misses",
        "puts",
        "evictions",
        "errors",
        "skipped_offline",
        "promotions",
        "refused",
        "tier_errors",
        "tier_hits",
        "writes",
        "write_errors",
        "corrupt",
    }
)


def _is_process_counter(name: str) -> bool:
    return name in _PROCESS_COUNTERS or name.endswith(
        ("_errors", "_timeouts", "_hits", "_misses", "_puts", "_failures")
    )


def _other_text(name: str, value: object) -> str:
    """A backend figure as a person reads it: a Redis cache's ``ttl`` in seconds, or
    that its entries never expire; a figure the backend could not give, ``-``."""
    if name == "ttl":
        return "none (entries never expire)" if value is None else f"{value:g} s"
    if name.endswith("_bytes") and isinstance(value, int):
        return f"{human_bytes(value)} ({value} bytes)"
    return "-" if value is None else value_text(value)


#: How full a server with a ``maxmemory`` may be before ``stats`` says so.
_NEAR_FULL = 0.9


def _memory_warning(stats: dict[str, Any]) -> str | None:
    """What a Redis server near its ``maxmemory`` does to the cache's entries."""
    used, most = stats.get("server_used_bytes"), stats.get("server_max_bytes")
    if not isinstance(used, int) or not isinstance(most, int) or used < _NEAR_FULL * most:
        return None
    policy, evicted = stats.get("eviction_policy"), stats.get("evicted_keys")
    held = f"the server holds {human_bytes(used)} of its maxmemory {human_bytes(most)}"
    if policy == "noeviction":
        return f"{held} and evicts nothing: writes of new entries will fail"
    return (
        f"{held} and evicts keys ({policy}; {'?' if evicted is None else evicted} so far): "
        "entries are dropped and made again; raise maxmemory or give the cache a server "
        "of its own"
    )


def _cmd_stats(args: argparse.Namespace, out: Output) -> int:
    view = open_cache(args)
    stats = {k: v for k, v in view.cache.stats().items() if not _is_process_counter(k)}
    stats.setdefault("path", view.location)
    recorded = None
    if view.has_hit_counts:
        recorded = sum(view.hits(k) or 0 for k in view.keys())
    stats["recorded_hits"] = recorded
    if args.json:
        out.json(stats)
        return 0
    entries, total, cap = stats.get("entries"), stats.get("bytes"), stats.get("max_bytes")
    rows = [
        ("path", str(stats["path"])),
        ("backend", str(stats.get("backend", type(view.cache).__name__))),
        ("entries", opt(entries)),
        ("total", f"{human_bytes(total)} ({total} bytes)" if total is not None else "-"),
    ]
    other = stats.get("other_bytes")
    if isinstance(other, int):
        rows.append(("beside entries", f"{human_bytes(other)} (notes and leases)"))
    if cap is not None:
        held = (total or 0) + (other if isinstance(other, int) else 0)
        used = f", {100.0 * held / cap:.1f}% used" if total is not None and cap else ""
        rows.append(("cap", f"{human_bytes(cap)} ({cap} bytes{used})"))
    rows.append(("recorded hits", opt(recorded)))
    shown = {"path", "backend", "entries", "bytes", "other_bytes", "max_bytes", "recorded_hits"}
    # Whatever else the backend reports about the store itself (temp files, TTL, ...).
    rows += [(n.replace("_", " "), _other_text(n, v)) for n, v in stats.items() if n not in shown]
    warning = _memory_warning(stats)
    if warning is not None:
        rows.append(("warning", warning))
    out.fields(rows)
    return 0
