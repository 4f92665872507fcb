"""Tree structures as JSON: node types by import path, node data tagged.

A tree is rebuilt only from node types of modules this process already
imported: an entry never makes jaxaot import (run) a module.
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import jax

__all__ = ["LEAF", "NotPersistable", "TreeError", "tree_from_json", "tree_to_json"]


class NotPersistable(Exception):
    """An entry holds something that cannot leave this process."""


class TreeError(ValueError):
    """A stored tree names a node type this process cannot use."""


LEAF = "*"


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


def _resolve(path: str) -> type:
    """The tree node type named ``path``. Only modules this process already imported
    are looked in: an entry never makes this process import (run) a module."""
    if path in _BUILTIN_NODES:
        return _BUILTIN_NODES[path]
    module_name, _, qualname = path.partition(":")
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        raise TreeError(f"tree node type {path}: module {module_name!r} is not imported")
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TreeError(f"{path} is not a type")
    return obj


def _aux_to_json(aux: Any) -> Any:
    if aux is None or isinstance(aux, bool | int | float | str):
        return aux
    if isinstance(aux, tuple):
        return {"tuple": [_aux_to_json(a) for a in aux]}
    if isinstance(aux, list):
        return [_aux_to_json(a) for a in aux]
    raise NotPersistable(f"tree node data of type {type(aux).__name__}")


def _aux_from_json(data: Any) -> Any:
    if isinstance(data, dict):
        return tuple(_aux_from_json(a) for a in data["tuple"])
    if isinstance(data, list):
        return [_aux_from_json(a) for a in data]
    return data


def tree_to_json(treedef: Any) -> Any:
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return LEAF
    node_type, aux = treedef.node_data()
    return {
        "type": _import_path(node_type),
        "aux": _aux_to_json(aux),
        "children": [tree_to_json(c) for c in treedef.children()],
    }


LEAF_DEF = jax.tree_util.tree_structure(0)


def tree_from_json(data: Any) -> Any:
    if data == LEAF:
        return LEAF_DEF
    node_type = _resolve(data["type"])
    children = [tree_from_json(c) for c in data["children"]]
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, (node_type, _aux_from_json(data["aux"])), children
    )
