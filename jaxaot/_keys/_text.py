"""Stable text: values, types and tree structures as text that is the same in every
process (no memory addresses, no object identities), for keys and entry headers.

* :func:`stable_repr`: user keys and static arguments (``None`` where a value
  has no stable text); :func:`stable_text`: any value, best effort.
* :func:`aval_str` / :func:`type_text`: a type as ``float32[3,4]`` (``~w``
  marks a weak type; a sharding the type carries follows ``@``), and
  :func:`parse_type_text` back; :func:`jax_type_text`: JAX's own short text
  of a type (what program keys hash).
* :func:`tree_text`: a tree structure, node types by import path.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import sys
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "aval_str",
    "jax_type_text",
    "parse_aval_str",
    "prng_key_dtype",
    "qualified_name",
    "stable_repr",
    "stable_text",
    "strip_addresses",
    "tree_text",
    "type_text",
    "unstable_part",
]

_ADDRESS = re.compile(r"(?: at)? 0x[0-9a-fA-F]+")


def strip_addresses(text: str) -> str:
    """``text`` without memory addresses (``<function f at 0x7f...>`` -> ``<function f>``)."""
    return _ADDRESS.sub("", text)


def qualified_name(obj: Any) -> str:
    """``module.QualifiedName`` of a function or type (of ``obj``'s type otherwise)."""
    qualname = getattr(obj, "__qualname__", type(obj).__qualname__)
    return f"{getattr(obj, '__module__', '') or ''}.{qualname}"


# ----------------------------------------------------------------------------
# User keys, static arguments and other values.

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_MAX_DEPTH = 50


class _Unstable(Exception):
    """A part of a value with no stable text: where it sits and what it is."""

    def __init__(self, path: str, value: Any, why: str) -> None:
        super().__init__(path, why)
        self.path, self.value, self.why = path, value, why


def stable_repr(value: Any) -> str | None:
    """Text of ``value`` that is the same in every process and differs between
    values that differ, else ``None``.

    Stable: None, bool, int, float, complex, str, bytes, ``range``, ``slice``,
    ``...``, NumPy scalars, enum members, NumPy and JAX dtypes and scalar types, classes defined at module
    level (by import path), JAX meshes, shardings and partition specs (by axes,
    devices and spec); tuples (NamedTuples by type and fields), frozensets and
    hashable mappings of stable values; frozen dataclasses (``flax.struct``
    ones included) and Equinox modules, by type and every field; functions by
    import path, code digest and the values their closure and defaults hold;
    ``functools.partial``, bound methods, ``jax.jit``, ``jax.custom_jvp`` and
    ``jax.custom_vjp`` wrappers of stable parts. Types are named by import path,
    so a NamedTuple never reads as the plain tuple of its fields.
    """
    try:
        return _stable(value, "", 0, [])
    except _Unstable:
        return None


def unstable_part(value: Any) -> tuple[str, Any, str] | None:
    """Where ``value`` has no stable text (see :func:`stable_repr`): the path of the
    first such part within it (``""`` for ``value`` itself, ``.act``, ``[0]``),
    the part, and why; ``None`` where it has one."""
    try:
        _stable(value, "", 0, [])
    except _Unstable as e:
        return e.path, e.value, e.why
    return None


def _module_level_name(obj: Any, path: str) -> str:
    """``module.QualName`` of a class or function that its import path names alone."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise _Unstable(path, obj, "it has no import path")
    if "<locals>" in qualname and isinstance(obj, type):
        raise _Unstable(path, obj, f"class {qualname} is defined inside a function")
    return f"{module}.{qualname}"


def _items(values: Any, path: str, depth: int, active: list[int]) -> list[str]:
    return [_stable(v, f"{path}[{i}]", depth + 1, active) for i, v in enumerate(values)]


def _stable(value: Any, path: str, depth: int, active: list[int]) -> str:
    """The text of ``value``; ``active``: the ids of the values it sits in (a value
    within itself, as a custom_jvp whose rule closes over it, reads as a
    reference to that enclosing value by its depth)."""
    kind = type(value)
    if kind in _SCALARS:
        return repr(value)
    if id(value) in active:
        return f"<ref {active.index(id(value))}>"
    if depth > _MAX_DEPTH:
        raise _Unstable(path, value, "it nests too deeply")
    active.append(id(value))
    try:
        return _stable_kind(value, path, depth, active)
    finally:
        active.pop()


def _stable_kind(value: Any, path: str, depth: int, active: list[int]) -> str:  # noqa: C901
    kind = type(value)
    if isinstance(value, enum.Enum):
        # (With its value where that has a text: two enums of one name, made by
        # a factory or in two processes, may hold other values.)
        name = f"{kind.__module__}.{kind.__qualname__}.{value.name}"
        try:
            return f"{name}={_stable(value.value, f'{path}.value', depth + 1, active)}"
        except _Unstable:
            return name
    if kind is range:  # its repr is its value: range(0, 3), range(0, 8, 2)
        return repr(value)
    if value is Ellipsis or value is NotImplemented:
        return repr(value)
    if kind is slice:
        parts = _items((value.start, value.stop, value.step), path, depth, active)
        return f"slice({', '.join(parts)})"
    if isinstance(value, np.dtype):
        return f"dtype({value.name})"
    if isinstance(value, np.generic):
        return f"{value.dtype.name}({value.item()!r})"
    if isinstance(value, type):
        if issubclass(value, np.generic):
            return f"dtype({np.dtype(value).name})"
        dtype = getattr(value, "dtype", None)
        if isinstance(dtype, np.dtype):  # jnp.float32 and kin
            return f"{_module_level_name(value, path)}(dtype({dtype.name}))"
        return f"type({_module_level_name(value, path)})"
    if "jax" in sys.modules:  # meshes, shardings and specs (before tuples: a spec may be one)
        from ._sharding import value_text

        sharding = value_text(value)
        if sharding is not None:
            return sharding
    if isinstance(value, _SCALARS):  # a subclass of a scalar type: by its type too
        if getattr(value, "__dict__", None):
            raise _Unstable(path, value, f"a {kind.__name__} with attributes")
        base: Any = next(t for t in kind.__mro__ if t in _SCALARS)
        return f"{_module_level_name(kind, path)}({base.__repr__(value)})"
    if isinstance(value, tuple):
        parts = _items(value, path, depth, active)
        fields = getattr(kind, "_fields", None)
        if kind is tuple:
            return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
        if isinstance(fields, tuple) and len(fields) == len(parts):  # a NamedTuple
            inner = ", ".join(f"{f}={p}" for f, p in zip(fields, parts, strict=True))
            return f"{_module_level_name(kind, path)}({inner})"
        return f"{_module_level_name(kind, path)}({', '.join(parts)})"
    if isinstance(value, frozenset):
        parts = sorted(_stable(v, f"{path}{{...}}", depth + 1, active) for v in value)
        text = "frozenset({" + ", ".join(parts) + "})"
        return text if kind is frozenset else f"{_module_level_name(kind, path)}{text}"
    if dataclasses.is_dataclass(value):
        return _dataclass(value, path, depth, active)
    if isinstance(value, Mapping) and getattr(kind, "__hash__", None) is not None:
        items = sorted(
            (
                _stable(k, f"{path}[{k!r}]", depth + 1, active),
                _stable(v, f"{path}[{k!r}]", depth + 1, active),
            )
            for k, v in value.items()
        )
        inner = ", ".join(f"{k}: {v}" for k, v in items)
        return f"{_module_level_name(kind, path)}({{{inner}}})"
    if callable(value):
        return _callable(value, path, depth, active)
    if isinstance(value, list | dict | set | bytearray):
        raise _Unstable(path, value, f"a {kind.__name__} is mutable")
    raise _Unstable(path, value, "its only identity is its address")


def _dataclass(value: Any, path: str, depth: int, active: list[int]) -> str:
    kind = type(value)
    params = getattr(kind, "__dataclass_params__", None)
    frozen = bool(getattr(params, "frozen", False))
    # Equinox modules are dataclasses made immutable by their own __setattr__.
    frozen = frozen or any(
        f"{t.__module__}.{t.__qualname__}" == "equinox._module._module.Module"
        or f"{t.__module__}.{t.__qualname__}" == "equinox._module.Module"
        for t in kind.__mro__
    )
    if not frozen:
        raise _Unstable(path, value, f"dataclass {kind.__qualname__} is not frozen")
    fields = [
        f"{f.name}={_stable(getattr(value, f.name), f'{path}.{f.name}', depth + 1, active)}"
        for f in dataclasses.fields(value)
    ]
    return f"{_module_level_name(kind, path)}({', '.join(fields)})"


def _callable(value: Any, path: str, depth: int, active: list[int]) -> str:
    kind = type(value)
    if isinstance(value, types.FunctionType):
        from ._closure import code_digest

        name = _module_level_name(value, path)
        parts = [f"code={code_digest(value)}"]
        code = value.__code__
        for var, cell in zip(code.co_freevars, value.__closure__ or (), strict=False):
            try:
                contents = cell.cell_contents
            except ValueError:  # not bound yet
                continue
            text = _stable(contents, f"{path}<closure {var}>", depth + 1, active)
            parts.append(f"{var}={text}")
        if value.__defaults__:
            parts.append(
                f"defaults={_stable(value.__defaults__, f'{path}<defaults>', depth + 1, active)}"
            )
        for k, d in sorted((value.__kwdefaults__ or {}).items()):
            parts.append(f"{k}={_stable(d, f'{path}<default {k}>', depth + 1, active)}")
        return f"function({name}, {', '.join(parts)})"
    if isinstance(value, types.BuiltinFunctionType):
        owner = value.__self__
        if owner is None or isinstance(owner, types.ModuleType):
            return f"builtin({_module_level_name(value, path)})"
        text = _stable(owner, f"{path}.__self__", depth + 1, active)
        return f"builtin({value.__qualname__}, {text})"
    if isinstance(value, types.MethodType):
        func = _stable(value.__func__, path, depth + 1, active)
        return f"method({func}, {_stable(value.__self__, f'{path}.__self__', depth + 1, active)})"
    if isinstance(value, functools.partial):
        func = _stable(value.func, f"{path}.func", depth + 1, active)
        args = _stable(tuple(value.args), f"{path}.args", depth + 1, active)
        keywords = sorted(
            (k, _stable(v, f"{path}.keywords[{k!r}]", depth + 1, active))
            for k, v in value.keywords.items()
        )
        inner = ", ".join(f"{k}={v}" for k, v in keywords)
        return f"{_module_level_name(kind, path)}({func}, {args}, {{{inner}}})"
    module = getattr(kind, "__module__", "") or ""
    if module.startswith(("jax.", "jaxlib.")):
        # jax.jit, jax.custom_jvp and jax.custom_vjp wrappers: by what they wrap
        # and, for custom derivatives, by their rules.
        rules = [
            f"{attr}={_stable(getattr(value, attr), f'{path}.{attr}', depth + 1, active)}"
            for attr in ("fun", "jvp", "fwd", "bwd", "nondiff_argnums", "symbolic_zeros")
            if getattr(value, attr, None) is not None
        ]
        wrapped = getattr(value, "__wrapped__", None)
        if not rules and callable(wrapped) and wrapped is not value:
            rules = [_stable(wrapped, f"{path}.__wrapped__", depth + 1, active)]
        if rules:
            return f"{kind.__qualname__}({', '.join(rules)})"
        # JAX's own named objects (``jnp.maximum``, a ``jnp.ufunc``): by import
        # path, as JAX's functions are (their code is keyed by JAX's version).
        own_name, home = getattr(value, "__name__", None), getattr(value, "__module__", None)
        if isinstance(own_name, str) and isinstance(home, str):
            if getattr(sys.modules.get(home), own_name, None) is value:
                return f"{kind.__qualname__}({home}.{own_name})"
    raise _Unstable(path, value, "its only identity is its address")


def stable_text(value: Any, depth: int = 0) -> str:
    """Text for any value that holds no memory address: ``stable_repr`` where it
    has one; functions and types by module and qualified name; containers item
    by item; other objects by type and ``repr``, addresses removed."""
    text = stable_repr(value)
    if text is not None:
        return text
    if depth > 20:
        return f"<{qualified_name(type(value))}>"
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
        return f"<{qualified_name(value)}>"
    if isinstance(value, types.MethodType):
        return (
            f"<method {qualified_name(value.__func__)} of {stable_text(value.__self__, depth + 1)}>"
        )
    if hasattr(value, "func") and hasattr(value, "args") and hasattr(value, "keywords"):
        return (
            f"partial({stable_text(value.func, depth + 1)},{stable_text(tuple(value.args), depth + 1)},"
            f"{stable_text(dict(value.keywords), depth + 1)})"
        )
    wrapped: Any = getattr(value, "fun", None) or getattr(value, "__wrapped__", None)
    if wrapped is not None and wrapped is not value and callable(wrapped):
        # custom_jvp / custom_vjp objects, jax.jit-wrapped functions: by what they wrap.
        return f"<{qualified_name(type(value))} of {stable_text(wrapped, depth + 1)}>"
    return f"{qualified_name(type(value))}:{strip_addresses(repr(value))}"


# ----------------------------------------------------------------------------
# Types.


def _is_extended(dtype: Any) -> bool:
    try:
        np.dtype(dtype)
    except TypeError:
        return True
    return False


def aval_str(shape: tuple[int, ...], dtype: Any, weak_type: bool) -> str:
    """``f32[3,4]``-style text for one argument or result; ``~w`` marks weak types."""
    name = np.dtype(dtype).name if not _is_extended(dtype) else str(dtype)
    text = f"{name}[{','.join(str(int(d)) for d in shape)}]"
    return text + "~w" if weak_type else text


def type_text(aval: Any) -> str:
    """A type as key and header text: :func:`aval_str`, then ``@``, the mesh's axes
    and the partition spec where the type carries a sharding (explicit mesh axes:
    ``float32[16,32]@{data=8:Explicit}P(data,_)``)."""
    from ._sharding import sharded_type, type_sharding_text

    text = aval_str(aval.shape, aval.dtype, aval.weak_type)
    if sharded_type(aval):
        text += "@" + type_sharding_text(aval.sharding)
    return text


def jax_type_text(aval: Any) -> str:
    """JAX's own short text of a type (``f32[3]``), with everything the type prints
    (a sharding, a memory space), then ``~w`` for a weak type: what program keys
    hash, so whatever JAX tells types apart by tells programs apart."""
    try:
        text = aval.str_short(short_dtypes=True)
    except Exception:  # an abstract value of another kind
        text = strip_addresses(str(aval))
    return text + ("~w" if getattr(aval, "weak_type", False) else "")


def parse_aval_str(text: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    """``(shape, dtype, weak_type)`` from :func:`aval_str`'s text."""
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
# Tree structures.

_NONE_TREE: Any = None


def tree_text(treedef: Any) -> str:
    """A tree structure as text: node types by import path, node data by
    :func:`stable_text` (so an Equinox static field holding a function, or a
    Flax NNX graph definition, reads the same in every process)."""
    global _NONE_TREE
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return "*"
    if _NONE_TREE is None:
        import jax

        _NONE_TREE = jax.tree_util.tree_structure(None)
    if treedef.num_nodes == 1 and treedef.num_leaves == 0 and treedef == _NONE_TREE:
        return "None"
    node_type, aux = treedef.node_data()
    children = ",".join(tree_text(c) for c in treedef.children())
    name = qualified_name(node_type)
    if aux is None:
        return f"{name}[{children}]"
    return f"{name}<{stable_text(aux)}>[{children}]"
