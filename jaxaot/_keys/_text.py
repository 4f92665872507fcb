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

import enum
import re
import sys
import types
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
