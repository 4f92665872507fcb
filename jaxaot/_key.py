"""Cache keys: named parts, a stable digest, and explanations of differences.

A :class:`ComponentKey` is the complete identity of one cache entry: which
computation (a user key, or the traced program: see ``_program``), on which
inputs (tree structure, shapes, dtypes, weak types, static values), under
which transformation (plain, vmap, JVP, transpose), lowered for which
platforms, by which JAX. Equality compares every part, never a hash alone; the
``digest`` (hex SHA-256 over a canonical JSON encoding) names the entry in
byte caches and is identical across processes.
"""

from __future__ import annotations

import dis
import enum
import hashlib
import json
import re
import sys
import sysconfig
import types
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

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


# ----------------------------------------------------------------------------
# Stable representations of user keys and static arguments.

_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def stable_repr(value: Any) -> str | None:
    """``repr`` of ``value`` if it is stable across processes, else ``None``.

    Stable: None, bool, int, float, complex, str, bytes, enum members, NumPy
    dtypes and scalar types, JAX meshes, shardings and partition specs (by
    axes, devices and spec), and tuples/frozensets of those.
    """
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if isinstance(value, np.dtype):
        return f"dtype({value.name})"
    if isinstance(value, type) and issubclass(value, np.generic):
        return f"dtype({np.dtype(value).name})"
    if isinstance(value, tuple):
        parts = [stable_repr(v) for v in value]
        if any(p is None for p in parts):
            return None
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"  # type: ignore[arg-type]
    if isinstance(value, frozenset):
        parts = [stable_repr(v) for v in value]
        if any(p is None for p in parts):
            return None
        return "frozenset({" + ", ".join(sorted(parts)) + "})"  # type: ignore[arg-type]
    if "jax" in sys.modules:  # meshes, shardings and specs: values, with their devices
        from ._sharding import value_text

        return value_text(value)
    return None


# ----------------------------------------------------------------------------
# Abstract values.


def aval_str(shape: tuple[int, ...], dtype: Any, weak_type: bool) -> str:
    """``f32[3,4]``-style text for one argument or result; ``~w`` marks weak types."""
    name = np.dtype(dtype).name if not _is_extended(dtype) else str(dtype)
    text = f"{name}[{','.join(str(int(d)) for d in shape)}]"
    return text + "~w" if weak_type else text


def _is_extended(dtype: Any) -> bool:
    try:
        np.dtype(dtype)
    except TypeError:
        return True
    return False


def parse_aval_str(text: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    weak = text.endswith("~w")
    if weak:
        text = text[:-2]
    name, _, dims = text.partition("[")
    if not dims.endswith("]"):
        raise ValueError(f"malformed aval {text!r}")
    inner = dims[:-1]
    shape = tuple(int(d) for d in inner.split(",")) if inner else ()
    if name.startswith("key<"):
        return shape, prng_key_dtype(name), weak
    return shape, np.dtype(name), weak


#: The PRNG implementations whose typed keys entries may hold (by public name).
_PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def prng_key_dtype(name: str) -> Any:
    """The dtype of typed PRNG keys named ``name`` (``key<fry>``), built through the
    public API; ValueError for an implementation jaxaot does not know."""
    import jax

    for impl in _PRNG_IMPLS:
        try:
            dtype = jax.eval_shape(lambda impl=impl: jax.random.key(0, impl=impl)).dtype
        except Exception:  # an implementation this JAX does not have
            continue
        if str(dtype) == name:
            return dtype
    raise ValueError(f"unknown PRNG key type {name!r}")


# ----------------------------------------------------------------------------
# What a function sees by name (for explicit keys and in-process tables).


class ClosureError(ValueError):
    """A component's function closes over a value that cannot be part of its key."""


def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    prefixes = {paths.get(n, "") for n in ("stdlib", "platstdlib", "purelib", "platlib")}
    for p in sys.path:
        if p.endswith(("site-packages", "dist-packages")):
            prefixes.add(p)
    return tuple(sorted(p for p in prefixes if p))


_LIBRARY_PREFIXES = _library_prefixes()


def _is_project_code(code: types.CodeType) -> bool:
    filename = code.co_filename
    if filename.startswith("<"):
        return filename.startswith(("<stdin>", "<string>"))
    return not filename.startswith(_LIBRARY_PREFIXES)


_CODE_CACHE: dict[types.CodeType, tuple[str, tuple[str, ...]]] = {}


def _code_digest(code: types.CodeType) -> tuple[str, tuple[str, ...]]:
    """A digest of a code object and its nested code, and the global names it loads."""
    cached = _CODE_CACHE.get(code)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    names: list[str] = []

    def visit(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                visit(const)
            else:
                h.update(repr(const).encode())
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str):
                names.append(ins.argval)

    visit(code)
    result = (h.hexdigest(), tuple(dict.fromkeys(names)))
    if len(_CODE_CACHE) < 100_000:
        _CODE_CACHE[code] = result
    return result


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '') or ''}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _is_tracer(value: Any) -> bool:
    from ._jaxcompat import Tracer

    return isinstance(value, Tracer)


def _is_array(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return True
    import jax

    return isinstance(value, jax.Array) or _is_tracer(value)


# ----------------------------------------------------------------------------
# Tree structures and other values as text that is the same in every process.

_ADDRESS = re.compile(r"(?: at)? 0x[0-9a-fA-F]+")


def strip_addresses(text: str) -> str:
    """``text`` without memory addresses (``<function f at 0x7f...>`` -> ``<function f>``)."""
    return _ADDRESS.sub("", text)


def stable_text(value: Any, depth: int = 0) -> str:
    """Text for any value that holds no memory address: ``stable_repr`` where it
    has one; functions and types by module and qualified name; containers item
    by item; other objects by type and ``repr``, addresses removed."""
    text = stable_repr(value)
    if text is not None:
        return text
    if depth > 20:
        return f"<{_qualified(type(value))}>"
    if isinstance(value, list | tuple):
        inner = ",".join(stable_text(v, depth + 1) for v in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        items = sorted(
            (stable_text(k, depth + 1), stable_text(v, depth + 1)) for k, v in value.items()
        )
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, frozenset | set):
        return "set(" + ",".join(sorted(stable_text(v, depth + 1) for v in value)) + ")"
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType | type):
        return f"<{_qualified(value)}>"
    if isinstance(value, types.MethodType):
        return f"<method {_qualified(value.__func__)} of {stable_text(value.__self__, depth + 1)}>"
    if hasattr(value, "func") and hasattr(value, "args") and hasattr(value, "keywords"):
        return (
            f"partial({stable_text(value.func, depth + 1)},{stable_text(tuple(value.args), depth + 1)},"
            f"{stable_text(dict(value.keywords), depth + 1)})"
        )
    wrapped: Any = getattr(value, "fun", None) or getattr(value, "__wrapped__", None)
    if wrapped is not None and wrapped is not value and callable(wrapped):
        # custom_jvp / custom_vjp objects, jax.jit-wrapped functions: by what they wrap.
        return f"<{_qualified(type(value))} of {stable_text(wrapped, depth + 1)}>"
    return f"{_qualified(type(value))}:{strip_addresses(repr(value))}"


def tree_text(treedef: Any) -> str:
    """A tree structure as text: node types by import path, node data by
    :func:`stable_text` (so an Equinox static field holding a function, or a
    Flax NNX graph definition, reads the same in every process)."""
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return "*"
    if treedef.num_nodes == 1 and treedef.num_leaves == 0 and treedef == _NONE_TREE:
        return "None"
    node_type, aux = treedef.node_data()
    children = ",".join(tree_text(c) for c in treedef.children())
    name = _qualified(node_type)
    if aux is None:
        return f"{name}[{children}]"
    return f"{name}<{stable_text(aux)}>[{children}]"


def _none_tree() -> Any:
    import jax

    return jax.tree_util.tree_structure(None)


_NONE_TREE = _none_tree()


# ----------------------------------------------------------------------------
# Explicit keys: the function's arrays, and a digest of its code.


def _named_values(fun: Any) -> Iterable[tuple[str, Any]]:
    """The values ``fun`` can see without an argument: closure cells, defaults and
    the globals it names (through partials, bound methods and wrappers)."""
    seen: set[int] = set()
    stack: list[Any] = [fun]
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, types.MethodType):
            yield "self", f.__self__
            stack.append(f.__func__)
            continue
        if hasattr(f, "func") and hasattr(f, "args") and hasattr(f, "keywords"):
            for i, a in enumerate(f.args):
                yield f"partial argument {i}", a
            for k, v in f.keywords.items():
                yield f"partial keyword {k!r}", v
            stack.append(f.func)
            continue
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None and wrapped is not f:
            stack.append(wrapped)
        code = getattr(f, "__code__", None)
        if not isinstance(f, types.FunctionType) or code is None:
            continue
        for name, cell in zip(code.co_freevars, f.__closure__ or (), strict=False):
            try:
                yield f"free variable {name!r}", cell.cell_contents
            except ValueError:
                continue
        for i, d in enumerate(f.__defaults__ or ()):
            yield f"default argument {i}", d
        for k, d in (f.__kwdefaults__ or {}).items():
            yield f"default argument {k!r}", d
        if _is_project_code(code):
            _, global_names = _code_digest(code)
            for name in global_names:
                if name in f.__globals__:
                    yield f"global {name!r}", f.__globals__[name]


def refuse_closed_arrays(fun: Any, component: str) -> None:
    """Raises :class:`ClosureError` if ``fun`` sees an array (or a tracer) through a
    closure cell, a default or a global it names, directly or inside a pytree: an
    explicit key would not cover its value."""
    import jax

    for where, value in _named_values(fun):
        if (
            isinstance(value, types.ModuleType | type)
            or callable(value)
            and not _is_pytree_node(value)
        ):
            continue
        try:
            leaves = jax.tree_util.tree_leaves_with_path(value)
        except Exception:  # not a pytree we can walk
            continue
        for path, leaf in leaves:
            if _is_array(leaf) and not _is_sharding_value(leaf):
                shape = tuple(getattr(leaf, "shape", ()))
                kind = "a traced value" if _is_tracer(leaf) else "an array"
                raise ClosureError(
                    f"jaxaot.component {component!r}: the function closes over {kind} "
                    f"({where}{jax.tree_util.keystr(path)}, shape {shape}, dtype "
                    f"{getattr(leaf, 'dtype', '?')}). Its explicit key does not cover the "
                    "array's value, so a cached result could belong to another array. Pass "
                    "it to the component as an argument instead."
                )


def _is_sharding_value(value: Any) -> bool:
    from ._sharding import is_sharding_value

    return is_sharding_value(value)


def _is_pytree_node(value: Any) -> bool:
    import jax

    treedef: Any = jax.tree_util.tree_structure(value)
    return bool(treedef.num_nodes > 1)


def code_digest(fun: Any) -> str:
    """A digest of the code of ``fun`` (through partials, methods and wrappers) and of
    the project functions it names: to tell that an explicit-key entry was made by
    other code."""
    h = hashlib.sha256()
    seen: set[int] = set()
    stack: list[Any] = [fun]
    while stack and len(seen) < 1000:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, types.MethodType):
            stack.append(f.__func__)
            continue
        inner = getattr(f, "func", None) or getattr(f, "__wrapped__", None)
        if inner is not None and inner is not f:
            stack.append(inner)
        code = getattr(f, "__code__", None)
        if not isinstance(f, types.FunctionType) or code is None or not _is_project_code(code):
            continue
        digest, global_names = _code_digest(code)
        h.update(digest.encode())
        for name in global_names:
            value = f.__globals__.get(name)
            if isinstance(value, types.FunctionType):
                stack.append(value)
    return h.hexdigest()[:32]


def seen_values(fun: Any) -> tuple[Any, ...]:
    """The objects ``fun`` sees by name now (closure cells, defaults, the globals
    it names): a trace of ``fun`` made while :func:`same_values` holds saw the
    same bindings (what a rebound global or a new closure changes)."""
    return tuple(value for _, value in _named_values(fun))


def same_values(before: tuple[Any, ...], fun: Any) -> bool:
    now = seen_values(fun)
    return len(now) == len(before) and all(a is b for a, b in zip(now, before, strict=True))


def closed_tracer(fun: Any) -> str | None:
    """Where ``fun`` sees a traced value by name (``free variable 'w'``), if it does."""
    import jax

    for where, value in _named_values(fun):
        if _is_tracer(value):
            return where
        if isinstance(value, list | tuple | dict):
            for path, leaf in jax.tree_util.tree_leaves_with_path(value):
                if _is_tracer(leaf):
                    return where + jax.tree_util.keystr(path)
    return None
