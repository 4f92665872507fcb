"""Tree structures as JSON: node types by import path, node data tagged.

Node data (the ``aux`` of a registered node: an Equinox module's static fields,
a Flax NNX ``State``'s keys, a dataclass's static fields) is stored as values
where it has a value form (numbers, strings, tuples, lists, dicts, dtypes,
enum members, NamedTuples and frozen dataclasses of those) and by name where it
is an object reachable by name from its module (functions, types, sentinels
such as Equinox's ``MISSING``). A tree is stored only if rebuilding it from its
JSON gives a tree equal to it, so a stored tree never reads back as another.

A tree is rebuilt only from node types and names of modules this process
already imported: an entry never makes jaxaot import (run) a module.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import sys
from typing import Any

import jax
import numpy as np

__all__ = ["LEAF", "NotPersistable", "TreeError", "tree_from_json", "tree_to_json"]


class NotPersistable(Exception):
    """An entry holds something that cannot leave this process."""


class TreeError(ValueError):
    """A stored tree names a node type this process cannot use."""


LEAF = "*"

# Nesting of node data beyond which it is not stored (far above real trees).
_MAX_AUX_DEPTH = 32

_BUILTIN_NODES: dict[str, type] = {
    "tuple": tuple,
    "list": list,
    "dict": dict,
    "None": type(None),
    "OrderedDict": collections.OrderedDict,
    "defaultdict": collections.defaultdict,
}
_BUILTIN_NAMES = {cls: name for name, cls in _BUILTIN_NODES.items()}


def _import_path(cls: type) -> str:
    if cls in _BUILTIN_NAMES:
        return _BUILTIN_NAMES[cls]
    return f"{cls.__module__}:{cls.__qualname__}"


def _lookup(path: str) -> Any:
    """The object named ``module:qualname``, looked up only in modules this process
    already imported: an entry never makes this process import (run) a module."""
    module_name, _, qualname = path.partition(":")
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        raise TreeError(f"{path}: module {module_name!r} is not imported")
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError as e:
        raise TreeError(f"{path}: {e}") from None
    return obj


def _resolve(path: str) -> type:
    """The tree node type named ``path``."""
    if path in _BUILTIN_NODES:
        return _BUILTIN_NODES[path]
    obj = _lookup(path)
    if not isinstance(obj, type):
        raise TreeError(f"{path} is not a type")
    return obj


def _name_of(value: Any) -> str | None:
    """``module:qualname`` under which ``value`` itself is found, or ``None``:
    functions and types by their own names, objects compared by identity
    (sentinels such as Equinox's ``MISSING``) by the name their type's module
    binds them to."""
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        path = f"{module}:{qualname}"
        try:
            if _lookup(path) is value:
                return path
        except TreeError:
            pass
    if type(value).__eq__ is not object.__eq__:
        # An object compared by value, not identity: a name bound to it says
        # nothing about the value another process binds to that name.
        return None
    module = getattr(type(value), "__module__", None)
    namespace = getattr(sys.modules.get(module or ""), "__dict__", None)
    if namespace is None:
        return None
    for name, bound in list(namespace.items()):
        if bound is value and not name.startswith("__"):
            return f"{module}:{name}"
    return None


def _aux_to_json(aux: Any, depth: int = 0) -> Any:
    if depth > _MAX_AUX_DEPTH:
        raise NotPersistable("tree node data nested too deeply")
    if isinstance(aux, enum.Enum):  # before numbers: an IntEnum member is an int
        return {"enum": _import_path(type(aux)), "name": aux.name}
    if aux is None or type(aux) in (bool, int, float, str):  # exactly: np.float64 is a float
        return aux
    if isinstance(aux, np.dtype) and aux.names is None:
        return {"dtype": aux.name}
    if type(aux) is tuple:
        return {"tuple": [_aux_to_json(a, depth + 1) for a in aux]}
    if type(aux) is list:
        return [_aux_to_json(a, depth + 1) for a in aux]
    if type(aux) is dict and all(isinstance(k, str) for k in aux):
        return {"dict": [[k, _aux_to_json(v, depth + 1)] for k, v in aux.items()]}
    if isinstance(aux, tuple) and hasattr(type(aux), "_fields"):  # a NamedTuple
        return {
            "namedtuple": _import_path(type(aux)),
            "items": [_aux_to_json(a, depth + 1) for a in aux],
        }
    params = getattr(type(aux), "__dataclass_params__", None)
    fields = (
        {f.name for f in dataclasses.fields(aux)}
        if params is not None and not isinstance(aux, type)
        else set()
    )
    # Rebuilt from its fields alone: one that holds more (set in __post_init__)
    # would come back without it.
    if params is not None and params.frozen and set(getattr(aux, "__dict__", {})) <= fields:
        return {
            "dataclass": _import_path(type(aux)),
            "fields": [
                [f.name, _aux_to_json(getattr(aux, f.name), depth + 1)]
                for f in dataclasses.fields(aux)
            ],
        }
    name = _name_of(aux)
    if name is not None:
        return {"ref": name}
    raise NotPersistable(f"tree node data of type {type(aux).__module__}.{type(aux).__qualname__}")


def _aux_from_json(data: Any) -> Any:
    if isinstance(data, list):
        return [_aux_from_json(a) for a in data]
    if not isinstance(data, dict):
        return data
    if "tuple" in data:
        return tuple(_aux_from_json(a) for a in data["tuple"])
    if "dict" in data:
        return {str(k): _aux_from_json(v) for k, v in data["dict"]}
    if "enum" in data:
        cls = _resolve(data["enum"])
        if not issubclass(cls, enum.Enum):
            raise TreeError(f"{data['enum']} is not an enum")
        return cls[data["name"]]
    if "dtype" in data:
        return np.dtype(data["dtype"])
    if "namedtuple" in data:
        cls = _resolve(data["namedtuple"])
        if not (issubclass(cls, tuple) and hasattr(cls, "_fields")):
            raise TreeError(f"{data['namedtuple']} is not a NamedTuple")
        return cls(*(_aux_from_json(a) for a in data["items"]))
    if "ref" in data:
        return _lookup(data["ref"])
    if "dataclass" in data:
        cls = _resolve(data["dataclass"])
        if not dataclasses.is_dataclass(cls):
            raise TreeError(f"{data['dataclass']} is not a dataclass")
        # Rebuilt field by field, as the frozen dataclass held them: no __init__ or
        # __post_init__ runs (they may compute or check what is already there).
        obj = object.__new__(cls)
        for name, value in data["fields"]:
            object.__setattr__(obj, str(name), _aux_from_json(value))
        return obj
    raise TreeError(f"unknown tree node data {sorted(data)!r:.80}")


def _node_to_json(treedef: Any) -> Any:
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return LEAF
    node_type, aux = treedef.node_data()
    try:
        aux_json = _aux_to_json(aux)
    except NotPersistable as e:
        raise NotPersistable(f"{e}, in a tree node of type {_import_path(node_type)}") from None
    return {
        "type": _import_path(node_type),
        "aux": aux_json,
        "children": [_node_to_json(c) for c in treedef.children()],
    }


def tree_to_json(treedef: Any) -> Any:
    """``treedef`` as JSON.

    Raises:
      NotPersistable: its node data has no stored form, or what would be stored
        does not rebuild a tree equal to it.
    """
    data = _node_to_json(treedef)
    try:
        # Read back as another process would: through JSON text.
        same = tree_from_json(json.loads(json.dumps(data))) == treedef
    except Exception as e:  # a node type or name this process cannot find again
        raise NotPersistable(f"tree structure cannot be rebuilt ({type(e).__name__}: {e})") from e
    if not same:
        raise NotPersistable(f"tree structure does not rebuild equal to itself: {treedef}")
    return data


LEAF_DEF = jax.tree_util.tree_structure(0)


def tree_from_json(data: Any) -> Any:
    if data == LEAF:
        return LEAF_DEF
    node_type = _resolve(data["type"])
    children = [tree_from_json(c) for c in data["children"]]
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, (node_type, _aux_from_json(data["aux"])), children
    )
