"""What ``jax.jit``'s caches key on: the tracing context, and the axis environment."""

from __future__ import annotations

from typing import Any

__all__ = ["explicit_mesh_axes_in_scope", "trace_context", "trace_context_items"]


def trace_context() -> Any:
    """The configuration state ``jax.jit``'s caches key on (x64, matmul precision,
    dtype and rank promotion, PRNG implementation, the axis environment, ...):
    hashable, for in-process tables."""
    from jax._src import config as _config

    return _config.trace_context()


def trace_context_items() -> tuple[tuple[str, Any], ...]:
    """:func:`trace_context` option by option: ``(name, value)`` pairs, the values
    as JAX holds them (enums, meshes, the axis environment...)."""
    from jax._src import config as _config

    names = getattr(_config, "trace_context_names", ())
    names = tuple(names() if callable(names) else names)
    values = tuple(trace_context())
    return tuple(
        (str(names[i]) if i < len(names) else f"context[{i}]", v) for i, v in enumerate(values)
    )


def explicit_mesh_axes_in_scope() -> frozenset[Any]:
    """The explicit mesh axes a ``vmap`` in scope maps over (empty outside one)."""
    from jax._src import core as _core

    env = _core.get_axis_env()
    return frozenset(getattr(env, "explicit_mesh_axis_names", ()) or ())
