"""The cache key: named parts, a stable digest, and explanations of differences.

A :class:`ComponentKey` is the complete identity of one cache entry: which
computation (a user key, or the traced program: see ``_program``), on which
inputs (tree structure, shapes, dtypes, weak types, static values), under
which transformation (plain, vmap, JVP, transpose), lowered for which
platforms, by which JAX. Equality compares every part, never a hash alone; the
``digest`` (hex SHA-256 over a canonical JSON encoding) names the entry in
byte caches and is identical across processes.
"""

from __future__ import annotations

import hashlib
import json
import types
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ComponentKey"]

PartValue = Any  # None | bool | int | float | str | tuple[PartValue, ...]


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"ComponentKey parts must be JSON-like, got {type(value).__name__}")


class ComponentKey:
    """The complete, immutable identity of one cache entry.

    Attributes:
      parts: an ordered, read-only mapping from part name to value.
      digest: hex SHA-256 of the parts, stable across processes and runs.
    """

    __slots__ = ("_items", "_digest", "_hash")

    def __init__(self, parts: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        pairs = parts.items() if isinstance(parts, Mapping) else parts
        items = tuple((str(k), _freeze(v)) for k, v in pairs)
        if len({k for k, _ in items}) != len(items):
            raise ValueError("ComponentKey: duplicate part names")
        self._items = items
        encoded = json.dumps(items, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
        self._digest = hashlib.sha256(encoded.encode("ascii")).hexdigest()
        self._hash = hash(items)

    @property
    def parts(self) -> Mapping[str, Any]:
        return types.MappingProxyType(dict(self._items))

    @property
    def digest(self) -> str:
        return self._digest

    def replace(self, **changes: Any) -> ComponentKey:
        """A key with some parts changed (and new parts appended)."""
        items = dict(self._items)
        items.update(changes)
        return ComponentKey(items)

    def explain(self, other: ComponentKey) -> list[str]:
        """Human-readable lines naming every part that differs from ``other``."""
        mine, theirs = dict(self._items), dict(other._items)
        lines: list[str] = []
        for name in list(mine) + [n for n in theirs if n not in mine]:
            a, b = mine.get(name, "<absent>"), theirs.get(name, "<absent>")
            if a != b:
                lines.extend(_explain_part(name, a, b))
        return lines

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ComponentKey):
            return NotImplemented
        return self._hash == other._hash and self._items == other._items

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        name = dict(self._items).get("component", "?")
        return f"ComponentKey({_short(name, 60)}, digest={self._digest[:16]}…)"

    def to_json(self) -> list[list[Any]]:
        return [[k, v] for k, v in self._items]

    @classmethod
    def from_json(cls, data: Any) -> ComponentKey:
        if not isinstance(data, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in data
        ):
            raise ValueError("malformed key parts")
        return cls([(k, v) for k, v in data])


def _is_named(value: Any) -> bool:
    return isinstance(value, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in value
    )


def _explain_part(name: str, a: Any, b: Any) -> list[str]:
    """The differences of one part: option by option for named parts (``config``),
    item by item for sequences of one length (``args``, ``consts``)."""
    if _is_named(a) and _is_named(b) and a and b:
        da, db = dict(a), dict(b)
        return [
            f"{name}.{k}: {_short(da.get(k, '<absent>'))} != {_short(db.get(k, '<absent>'))}"
            for k in list(da) + [k for k in db if k not in da]
            if da.get(k, "<absent>") != db.get(k, "<absent>")
        ]
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and a:
        return [
            f"{name}[{i}]: {_short(x)} != {_short(y)}"
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            if x != y
        ]
    return [f"{name}: {_short(a)} != {_short(b)}"]


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
