"""Values as types: what a component's entries are keyed and traced by.

A value's type is its shape, dtype and weak type, and its sharding where the
type carries one (explicit mesh axes); other shardings are placement, not type.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .._jax import ShapedArray, explicit_mesh_axes_in_scope
from .._keys._sharding import sharded_type

__all__ = [
    "ARRAY_SCALARS",
    "aval_of",
    "is_differentiable",
    "sds",
    "traced_under",
    "type_of",
]

#: Python and NumPy scalars a component takes as arrays.
ARRAY_SCALARS = (bool, int, float, complex, np.generic)


def aval_of(x: Any) -> Any:
    """A value's type (an array, a tracer, a scalar or a ``jax.ShapeDtypeStruct``)."""
    # A ShapeDtypeStruct's type is JAX's: a NamedSharding over Explicit axes (of a
    # concrete or an abstract mesh) is in it, as in an array's placed so.
    return type_of(jax.typeof(x))


@functools.lru_cache(maxsize=4096)
def type_of(aval: Any) -> Any:
    """``aval`` as a type (see :func:`aval_of`): memoized, as a deep network passes
    the same few types to every layer (equal avals give equal types)."""
    # How a value varies over the manual axes of an enclosing shard_map is part of
    # its type: a collective over them (psum) is traced for it.
    manual = _manual(aval)
    if sharded_type(aval) or manual:
        return ShapedArray(
            aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=aval.sharding, **manual
        )
    return ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _manual(aval: Any) -> dict[str, Any]:
    """``aval``'s manual-axis type as keyword arguments (none where it has none)."""
    mat = getattr(aval, "manual_axis_type", None)
    varies = any(getattr(mat, f, None) for f in ("varying", "unreduced", "reduced"))
    return {"manual_axis_type": mat} if varies else {}


def sds(aval: Any) -> jax.ShapeDtypeStruct:
    """A ``jax.ShapeDtypeStruct`` of type ``aval`` (to trace with): with the
    sharding the type carries; inside a ``vmap`` over an explicit mesh axis,
    unsharded over the mesh in context, as JAX types the values there (a nested
    trace would otherwise see a mesh without that axis, and its types could not
    be batched along it)."""
    if sharded_type(aval) or _manual(aval):
        sharding = aval.sharding
    elif explicit_mesh_axes_in_scope():
        sharding = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec())
    else:
        sharding = None
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding, **_manual(aval)
    )


@contextlib.contextmanager
def traced_under(avals: Sequence[Any]) -> Iterator[None]:
    """The mesh that types carrying shardings (explicit axes) were made under, as the
    abstract mesh in context for the block: a derived entry is traced under its
    own types' mesh, also where it is made (inside a ``vmap`` over an explicit
    axis, the context's mesh lacks that axis)."""
    mesh = next((a.sharding.mesh for a in avals if sharded_type(a)), None)
    if mesh is None or mesh == jax.sharding.get_abstract_mesh():
        yield
        return
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def is_differentiable(dtype: Any) -> bool:
    """Whether JAX differentiates values of ``dtype``: every inexact dtype, the
    bfloat16, float16, float8 and complex types included (JAX's own predicate;
    NumPy's does not know the ml_dtypes types)."""
    return bool(jnp.issubdtype(dtype, jnp.inexact))
