"""JAX's single-device sharding across versions: ``jax.sharding.SingleDeviceSharding``
is deprecated from jax 0.12.1 on (reading it warns, and a program run with
warnings as errors fails), and the functions that replace it are not in older
releases. Its class is the same in every release."""

from __future__ import annotations

from typing import Any

from jax._src.sharding_impls import SingleDeviceSharding as _SingleDeviceSharding

__all__ = ["is_single_device", "single_device"]


def is_single_device(sharding: Any) -> bool:
    """Whether ``sharding`` places a value on one device (a ``SingleDeviceSharding``)."""
    return isinstance(sharding, _SingleDeviceSharding)


def single_device(device: Any, memory_kind: str | None = None) -> Any:
    """A sharding placing a value on ``device`` (in ``memory_kind``, if given)."""
    return _SingleDeviceSharding(device, memory_kind=memory_kind)
