"""Helpers shared by the cache backend tests."""

from __future__ import annotations

from typing import Any

import jax

import jaxaot
from jaxaot import _entry


def make_blob(name: str = "t", payload: bytes = b"payload", tag: Any = 0) -> tuple[str, bytes]:
    """A sound entry (no JAX compilation involved) and its cache key."""
    key = jaxaot.ComponentKey({"component": f"key:{name!r}", "tag": tag})
    entry = _entry.Entry(
        key=key,
        name=name,
        in_avals=(),
        out_avals=(),
        out_tree=jax.tree_util.tree_structure(()),
        arg_names=(),
        result_paths=(),
        stablehlo=payload,
    )
    return key.digest, _entry.encode(entry)
