"""The tracing context as key parts: what ``jax.jit``'s own caches key on (x64,
matmul precision, dtype and rank promotion, the mesh in context, the axis
environment, ...), option by option, as text that is the same in every process;
and a ``vmap`` axis as a key part."""

from __future__ import annotations

import enum
from typing import Any

import jax

from .._jax import trace_context_items
from ._sharding import value_text
from ._text import strip_addresses

__all__ = ["axis_data_parts", "config_parts"]


def _context_part(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return tuple(_context_part(v) for v in value)
    mesh = value_text(value)
    if mesh is not None:  # the mesh in context (``jax.set_mesh``, ``use_abstract_mesh``)
        return mesh
    sizes = getattr(value, "axis_sizes", None)
    if sizes is not None:  # the axis environment: named axes in scope
        return (
            "axis_env",
            tuple(sorted((str(k), int(v)) for k, v in dict(sizes).items())),
            tuple(sorted(str(n) for n in getattr(value, "spmd_axis_names", ()) or ())),
            tuple(sorted(str(n) for n in getattr(value, "explicit_mesh_axis_names", ()) or ())),
        )
    return strip_addresses(f"{type(value).__name__}:{value!r}")


def config_parts() -> tuple[tuple[str, Any], ...]:
    """Everything ``jax.jit``'s own caches key on (its trace context), option by
    option (``(name, value)`` pairs), and the PRNG implementation."""
    return (
        *((name, _context_part(v)) for name, v in trace_context_items()),
        ("jax_default_prng_impl", str(getattr(jax.config, "jax_default_prng_impl", None))),
    )


def axis_data_parts(axis_data: Any) -> tuple[Any, ...]:
    """A vmap axis as a key part: its name (where it has one), size, ``spmd_axis_name``
    and explicit mesh axis."""

    def name(n: Any) -> Any:
        if n is None or isinstance(n, str | int):
            return n
        if isinstance(n, tuple):
            return tuple(name(x) for x in n)
        return f"<{type(n).__name__}>"  # an unnamed axis

    return (
        name(getattr(axis_data, "name", None)),
        int(axis_data.size),
        name(getattr(axis_data, "spmd_name", None)),
        name(getattr(axis_data, "explicit_mesh_axis", None)),
    )
