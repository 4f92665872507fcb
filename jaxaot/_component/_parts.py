"""What every key of a component holds, and the keys of derived entries."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax

from .._keys._context import config_parts
from .._keys._key import ComponentKey
from .._keys._sharding import mesh_text
from .._keys._text import type_text
from .._store._entry import ENTRY_FORMAT_VERSION

__all__ = ["DERIVE_VERSION", "base_parts", "derived_key", "types_text"]

# How jaxaot derives the entries of transformations (a key part, so entries
# derived the old way are missed, never mixed with new ones).
#   1: first version.
#   2: transposed entries compute transpose(dot_general(a, b)) as dot_general(b, a).
#   3: residuals that are elementwise arithmetic of other residuals are recomputed.
#   4: derived keys hold each parent's input types and the vmap axis's name and
#      spmd_axis_name; every dtype JAX differentiates gets tangents.
#   5: forward entries say which residuals are their own inputs
#      (``extra["forwards"]``, read by the whole-program form).
#   6: forward entries do not return the residuals that are their own inputs
#      (a layer's weights): ``extra["forwarded"]`` says where they go among the
#      residuals, and the caller passes the inputs themselves on.
#   7: pruned residuals in an order that follows from the program alone (it
#      followed addresses: a forward entry and a linear entry derived in
#      another process could disagree).
#   8: the inputs a JVP does not move are held fixed (symbolic zero tangents,
#      which a custom rule with ``symbolic_zeros`` tells apart), not given zeros.
DERIVE_VERSION = 8


def types_text(avals: Sequence[Any]) -> tuple[str, ...]:
    """The ``args`` key part: each input's type as text."""
    return tuple(type_text(a) for a in avals)


def base_parts(platform: str) -> dict[str, Any]:
    """The parts every key holds: formats, versions, the tracing context, the
    lowering platform and the abstract mesh tracing sees (executable keys add
    the concrete one)."""
    import jaxlib

    return {
        "format": ENTRY_FORMAT_VERSION,
        "derive": DERIVE_VERSION,
        "jax": jax.__version__,
        "jaxlib": str(jaxlib.__version__),
        "x64": bool(jax.config.read("jax_enable_x64")),
        "config": config_parts(),
        "platforms": (platform,),
        "mesh": mesh_text(jax.sharding.get_abstract_mesh()),
    }


@functools.lru_cache(maxsize=4096)
def _derived_key(
    parent: ComponentKey, transform: tuple[Any, ...], in_avals: tuple[Any, ...]
) -> ComponentKey:
    return parent.replace(
        args=types_text(in_avals),
        transform=(*parent.parts["transform"], (*transform, parent.parts["args"])),
    )


def derived_key(
    parent: ComponentKey, transform: tuple[Any, ...], in_avals: tuple[Any, ...]
) -> ComponentKey:
    """The key of a transformation of ``parent``'s computation taking ``in_avals``:
    the whole lineage, each transformation with the input types of the computation it
    transforms, so no two signatures share a derived entry. Memoized (a pure
    function of its arguments): every layer of a deep network derives the same keys."""
    try:
        return _derived_key(parent, transform, in_avals)
    except TypeError:  # an unhashable part (a list): the same key, not memoized
        return _derived_key.__wrapped__(parent, transform, in_avals)
