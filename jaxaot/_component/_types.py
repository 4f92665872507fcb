"""Values as types: what a component's entries are keyed and traced by.

A value's type is its shape, dtype and weak type, and its sharding where the
type carries one (explicit mesh axes); other shardings are placement, not type.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._jax import ShapedArray
from .._keys._sharding import sharded_type

__all__ = ["ARRAY_SCALARS", "aval_of", "is_differentiable", "sds", "type_of", "zeros"]

#: Python and NumPy scalars a component takes as arrays.
ARRAY_SCALARS = (bool, int, float, complex, np.generic)


def aval_of(x: Any) -> Any:
    """A value's type (an array, a tracer, a scalar or a ``jax.ShapeDtypeStruct``)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        weak = bool(getattr(x, "weak_type", False))
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
            sharding.mesh, jax.sharding.AbstractMesh
        ):
            typed = ShapedArray(x.shape, x.dtype, weak_type=weak, sharding=sharding)
            if sharded_type(typed):
                return typed
        return ShapedArray(x.shape, x.dtype, weak_type=weak)
    return type_of(jax.typeof(x))


@functools.lru_cache(maxsize=4096)
def type_of(aval: Any) -> Any:
    """``aval`` as a type (see :func:`aval_of`): memoized, as a deep network passes
    the same few types to every layer (equal avals give equal types)."""
    if sharded_type(aval):
        return ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=aval.sharding)
    return ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)


def sds(aval: Any) -> jax.ShapeDtypeStruct:
    """A ``jax.ShapeDtypeStruct`` of type ``aval`` (to trace with)."""
    if sharded_type(aval):
        return jax.ShapeDtypeStruct(
            aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=aval.sharding
        )
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def is_differentiable(dtype: Any) -> bool:
    """Whether JAX differentiates values of ``dtype``: every inexact dtype, the
    bfloat16, float16, float8 and complex types included (JAX's own predicate;
    NumPy's does not know the ml_dtypes types)."""
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def zeros(aval: Any) -> Any:
    """Zeros of type ``aval`` (``float0`` tangents as NumPy zeros, as JAX makes them)."""
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, dtype=jax.dtypes.float0)
    return jax.numpy.zeros(aval.shape, aval.dtype)
