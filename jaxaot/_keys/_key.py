"""The cache key: named parts, a stable digest, and explanations of differences.

A :class:`ComponentKey` is the complete identity of one cache entry: which
computation (a user key, or the traced program: see ``_program``), on which
inputs (tree structure, shapes, dtypes, weak types, static values), under
which transformation (plain, vmap, JVP, transpose), lowered for which
platforms, by which JAX. Equality compares every part, never a hash alone; the
``digest`` (hex SHA-256 over a canonical JSON encoding) names the entry in
byte caches and is identical across processes.

A part's value may carry *explanation data* (:class:`Described`: a string with
a JSON-able ``about`` beside it, such as the program's equations by primitive
and its constants as short text): it is never a part, so it changes neither the
digest nor equality, and it lets :meth:`ComponentKey.explain` say in words what
changed (``constant #2 f32[3]: [1. 2. 3.] → [1. 2. 4.]``).
"""

from __future__ import annotations

import hashlib
import json
import types
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ComponentKey", "Described"]

PartValue = Any  # None | bool | int | float | str | tuple[PartValue, ...]


class Described(str):
    """A string part value with explanation data beside it (``about``, JSON-able).

    It is equal to, hashes and encodes as the plain string: the data is never a
    key part, so it cannot change a digest or turn a hit into a miss."""

    about: Any

    def __new__(cls, text: str, about: Any = None) -> Described:
        self = super().__new__(cls, text)
        self.about = about
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Described, (str(self), self.about))


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

    @property
    def about(self) -> dict[str, Any]:
        """The explanation data of the parts that carry some (see :class:`Described`)."""
        return {k: v.about for k, v in self._items if isinstance(v, Described)}

    def explain(self, other: ComponentKey) -> list[str]:
        """Lines in words naming every part in which this key differs from ``other``,
        each ``old → new`` with ``other`` as the old key: an argument by its path
        (where the program's explanation data names the arguments), a static value,
        an option or a version; a constant by its index, type and value and an
        equation by its index and primitive (where both keys carry the program's
        explanation data)."""
        if not isinstance(other, ComponentKey):
            raise TypeError(
                f"ComponentKey.explain takes another ComponentKey, got {type(other).__name__}"
            )
        mine, theirs = dict(self._items), dict(other._items)
        about_new, about_old = self.about.get("program"), other.about.get("program")
        names = (
            _arg_names(about_new, mine)
            or _arg_names(about_old, theirs)
            # (A program named by its content, jaxaot.jit's, carries its inputs' paths
            # beside its name.)
            or _arg_names(self.about.get("component"), mine)
            or _arg_names(other.about.get("component"), theirs)
        )
        lines: list[str] = []
        program: list[str] = []
        for name in list(mine) + [n for n in theirs if n not in mine]:
            new, old = mine.get(name, _ABSENT), theirs.get(name, _ABSENT)
            if new == old:
                continue
            if name == "args" and names is not None:
                lines.extend(_explain_args(old, new, names))
            elif name == "consts":
                lines.extend(_explain_consts(old, new, about_old, about_new))
            elif name == "program":
                program = _explain_program(old, new, about_old, about_new)
            else:
                lines.extend(_explain_part(name, old, new))
        if program and any(mine.get(n) != theirs.get(n) for n in _INPUT_PARTS):
            # Other inputs give another program: its change may follow from theirs.
            program = [f"{line} (perhaps from the change above)" for line in program]
        return lines + program

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
    def from_json(cls, data: Any, about: Mapping[str, Any] | None = None) -> ComponentKey:
        """The key of :meth:`to_json`'s output; ``about`` (from :attr:`about`) gives
        string parts their explanation data back."""
        if not isinstance(data, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in data
        ):
            raise ValueError("malformed key parts")
        about = about or {}
        return cls(
            [
                (k, Described(v, about[k]) if k in about and isinstance(v, str) else v)
                for k, v in data
            ]
        )


_ABSENT = "<absent>"
#: Parts whose change changes the traced program too.
_INPUT_PARTS = ("args", "static", "in_tree", "x64", "config", "mesh", "transform")

#: Part names in words, for explanations.
_PART_WORDS = {
    "jax": "JAX version",
    "jaxlib": "jaxlib version",
    "format": "entry format version",
    "derive": "derivation version",
    "x64": "jax_enable_x64",
    "platforms": "lowering platforms",
    "static": "static argument",
    "config": "tracing option",
    "xla_flags": "XLA_FLAGS",
    "libtpu_init_args": "LIBTPU_INIT_ARGS",
    "in_tree": "input tree structure",
    "out_tree": "output tree structure",
    "rules": "derivative rules",
    "donate_argnums": "donated arguments",
    "backend": "backend",
    "platform_version": "platform version",
    "device_kind": "device kind",
    "device_count": "device count",
    "process_count": "process count",
    "inputs": "input shardings",
    "context_mesh": "mesh in context",
    "mesh": "abstract mesh",
}


def _is_named(value: Any) -> bool:
    return isinstance(value, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in value
    )


def _words(name: str) -> str:
    word = _PART_WORDS.get(name)
    return f"{word} ({name})" if word is not None and word != name else name


def _change(old: Any, new: Any) -> str:
    return f"{_text(old)} → {_text(new)}"


def _text(value: Any, limit: int = 120) -> str:
    if isinstance(value, str):
        return value if len(value) <= limit else value[: limit - 1] + "…"
    return _short(value, limit)


def _explain_part(name: str, old: Any, new: Any) -> list[str]:
    """The differences of one part: option by option for named parts (``config``,
    ``static``), flag by flag for flag strings, item by item for sequences of one
    length."""
    if name == "executable" and _is_named(old) and _is_named(new):
        # What an executable adds (backend, flags, donation, shardings): each by its words.
        do, dn = dict(old), dict(new)
        lines: list[str] = []
        for k in list(dn) + [k for k in do if k not in dn]:
            if do.get(k, _ABSENT) != dn.get(k, _ABSENT):
                lines.extend(_explain_part(k, do.get(k, _ABSENT), dn.get(k, _ABSENT)))
        return lines
    if _is_named(old) and _is_named(new) and (old or new):
        do, dn = dict(old), dict(new)
        word = _PART_WORDS.get(name, name)
        return [
            f"{word} {k!r} ({name}): {_change(do.get(k, _ABSENT), dn.get(k, _ABSENT))}"
            for k in list(dn) + [k for k in do if k not in dn]
            if do.get(k, _ABSENT) != dn.get(k, _ABSENT)
        ]
    if name == "component" and isinstance(old, str) and isinstance(new, str):
        kind_old, _, digest_old = old.partition(":")
        kind_new, _, digest_new = new.partition(":")
        if kind_old == kind_new and _is_hex(digest_old) and _is_hex(digest_new):
            # A program named by its content (jaxaot.jit's glue): only the digest can say.
            program = kind_new if kind_new.endswith("program") else f"{kind_new} program"
            return [f"{program}'s content: {digest_old[:16]}… → {digest_new[:16]}…"]
    if name in ("xla_flags", "libtpu_init_args") and isinstance(old, str) and isinstance(new, str):
        return _explain_flags(name, old, new)
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) and old:
        return [
            f"{_words(name)}[{i}]: {(_type_change if name == 'args' else _change)(x, y)}"
            for i, (x, y) in enumerate(zip(old, new, strict=True))
            if x != y
        ]
    return [f"{_words(name)}: {_change(old, new)}"]


def _is_hex(text: str) -> bool:
    return len(text) >= 16 and all(c in "0123456789abcdef" for c in text)


def _flags(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for word in text.split():
        flag, _, value = word.partition("=")
        out[flag] = value if value or "=" in word else "(set)"
    return out


def _explain_flags(name: str, old: str, new: str) -> list[str]:
    fo, fn = _flags(old), _flags(new)
    lines = [
        f"{_PART_WORDS[name]} flag {flag}: {_change(fo.get(flag, _ABSENT), fn.get(flag, _ABSENT))}"
        for flag in list(fn) + [f for f in fo if f not in fn]
        if fo.get(flag, _ABSENT) != fn.get(flag, _ABSENT)
    ]
    return lines or [f"{_words(name)}: {_change(old, new)}"]


def _arg_names(about: Any, parts: Mapping[str, Any]) -> list[str] | None:
    """The arguments' paths (``x``, ``params['w']``) from the program's explanation
    data, when they name every argument of ``parts``."""
    names = about.get("args") if isinstance(about, dict) else None
    args = parts.get("args")
    if (
        isinstance(names, list)
        and isinstance(args, tuple)
        and len(names) == len(args)
        and all(isinstance(n, str) and n for n in names)
    ):
        return names
    return None


def _type_change(old: Any, new: Any) -> str:
    """An argument's type change; one in weak type alone (``~w``) said in words."""
    if isinstance(old, str) and isinstance(new, str):
        if new == old + "~w":
            return f"{old} → {old} weakly typed (a Python scalar where the entry had an array)"
        if old == new + "~w":
            return f"{new} weakly typed → {new} (an array where the entry had a Python scalar)"
    return _change(old, new)


def _explain_args(old: Any, new: Any, names: list[str]) -> list[str]:
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return [
            f"argument {names[i]}: {_type_change(x, y)}"
            for i, (x, y) in enumerate(zip(old, new, strict=True))
            if x != y
        ]
    return _explain_part("args", old, new)


def _explain_consts(old: Any, new: Any, about_old: Any, about_new: Any) -> list[str]:
    """Constants by index, type and value text (where both keys have it)."""
    if not (isinstance(old, tuple) and isinstance(new, tuple)):
        return _explain_part("consts", old, new)
    text_old = _about_list(about_old, "consts", len(old))
    text_new = _about_list(about_new, "consts", len(new))
    if len(old) != len(new):
        return [f"constants (consts): {len(old)} → {len(new)} constants"]
    lines = []
    for i, (x, y) in enumerate(zip(old, new, strict=True)):
        if x == y:
            continue
        type_old, type_new = str(x).rpartition(":")[0], str(y).rpartition(":")[0]
        what = type_new if type_old == type_new else f"{type_old} → {type_new}"
        if text_old is not None and text_new is not None:
            lines.append(f"constant #{i} {what}: {text_old[i]} → {text_new[i]}")
        else:
            lines.append(f"constant #{i} {what}: its value changed ({_change(x, y)})")
    return lines


def _about_list(about: Any, name: str, length: int) -> list[str] | None:
    items = about.get(name) if isinstance(about, dict) else None
    if isinstance(items, list) and len(items) == length and all(isinstance(t, str) for t in items):
        return items
    return None


def _explain_program(old: Any, new: Any, about_old: Any, about_new: Any) -> list[str]:
    """The first equation that differs, by index and primitive (where both keys
    carry the equations: ``primitive:digest`` per equation of the top level)."""
    eqns_old = about_old.get("eqns") if isinstance(about_old, dict) else None
    eqns_new = about_new.get("eqns") if isinstance(about_new, dict) else None
    if not (isinstance(eqns_old, list) and isinstance(eqns_new, list)):
        return [f"program (its equations or types): {_change(old, new)}"]
    for i, (x, y) in enumerate(zip(eqns_old, eqns_new, strict=False)):
        if x != y:
            prim_old, _, lit_old = (str(x).split(":", 2) + ["", ""])[:3]
            prim_new, _, lit_new = (str(y).split(":", 2) + ["", ""])[:3]
            if prim_old != prim_new:
                return [f"program: equation {i}: {prim_old} → {prim_new}"]
            if lit_old != lit_new:
                return [f"program: equation {i} ({prim_new}): constant {lit_old} → {lit_new}"]
            return [f"program: equation {i} ({prim_new}): its operands or parameters changed"]
    if len(eqns_old) != len(eqns_new):
        n = min(len(eqns_old), len(eqns_new))
        longer = eqns_new if len(eqns_new) > n else eqns_old
        verb = "added" if len(eqns_new) > n else "removed"
        prim = str(longer[n]).partition(":")[0]
        return [
            f"program: {len(eqns_old)} → {len(eqns_new)} equations (equation {n}, {prim}, {verb})"
        ]
    total = about_new.get("eqn_count") if isinstance(about_new, dict) else None
    if isinstance(total, int) and total > len(eqns_new):
        return [f"program: an equation after the first {len(eqns_new)} changed"]
    return ["program: its input or output types, or its effects, changed"]


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
