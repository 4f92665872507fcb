"""How the ``jaxaot cache`` commands show an entry and its values: its kind, its
JSON form, optional numbers and times (shared by ``ls``, ``info`` and ``stats``)."""

from __future__ import annotations

import json
from typing import Any

from .._output import human_time, iso_time
from ._view import Record

__all__ = ["kind", "opt", "record_json", "value_text", "when_text"]


def kind(r: Record) -> str:
    """What an entry holds: a compiled ``executable`` or lowered ``stablehlo``."""
    if r.executable:
        return "executable"
    return "stablehlo" if "stablehlo" in r.sections else "-"


def record_json(r: Record) -> dict[str, Any]:
    h = r.header or {}
    return {
        "digest": r.key,
        "name": r.name,
        "ok": r.error is None,
        "error": r.error,
        "transform": r.transform if r.header is not None else None,
        "kind": kind(r) if r.header is not None else None,
        "signature": h.get("signature"),
        "platforms": h.get("platforms"),
        "size": r.size,
        "hits": r.hits,
        "last_used": r.last_used,
        "last_used_iso": iso_time(r.last_used),
        "created": r.created,
        "executable": r.executable,
        "flops": r.flops,
        "sections": r.sections,
    }


def opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def value_text(value: Any) -> str:
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value, separators=(", ", ": "))


def when_text(ts: float | None) -> str:
    if ts is None:
        return "-"
    return f"{iso_time(ts)} ({human_time(ts)})"
