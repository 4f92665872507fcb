"""What JAX's device assignment sees in a jaxpr: the concrete shardings it names."""

from __future__ import annotations

from typing import Any

from jax.sharding import Sharding

__all__ = ["named_shardings"]


def named_shardings(closed: Any) -> list[Any]:
    """The shardings over concrete devices that ``jax.jit`` takes into account when
    it chooses the devices of a computation holding ``closed`` (a closed jaxpr or
    a jaxpr): those of sharding constraints, nested ``jit`` calls, ``shard_map``
    over a concrete mesh and ``device_put`` to a memory kind, nested jaxprs
    included; in the order JAX finds them."""
    from jax._src import dispatch

    jaxpr = getattr(closed, "jaxpr", closed)
    return [s for s, _ in dispatch.get_intermediate_shardings(jaxpr) if isinstance(s, Sharding)]
