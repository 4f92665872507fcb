"""Early device-to-host copies, for metrics that a training loop reads later."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import jax
import numpy as np

T = TypeVar("T")


class HostCopy(Generic[T]):
    """A pytree whose array leaves are being copied to the host.

    ``result()`` waits for the copies and returns the same pytree with NumPy
    values (non-array leaves are returned as they were)."""

    __slots__ = ("_tree", "_value")

    def __init__(self, tree: T) -> None:
        self._tree = tree
        self._value: Any = None

    def done(self) -> bool:
        """Whether every array leaf is ready on its device (the copy may still run)."""
        return all(
            leaf.is_ready()  # type: ignore[attr-defined]
            for leaf in jax.tree_util.tree_leaves(self._tree)
            if isinstance(leaf, jax.Array)
        )

    def result(self) -> T:
        if self._value is None:
            self._value = (jax.tree_util.tree_map(_to_numpy, self._tree),)
        return self._value[0]  # type: ignore[no-any-return]


def _to_numpy(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
        return np.asarray(leaf)
    return leaf


def to_host_async(tree: T) -> HostCopy[T]:
    """Starts copying every array leaf of ``tree`` to the host, and returns at once.

    The copies run while the program goes on (``jax.copy_to_host_async``);
    ``.result()`` gives the pytree of NumPy values, as ``jax.device_get``
    would. Typical use: fetch last step's metrics while this step runs::

        pending = jaxaot.to_host_async(metrics)
        params, opt_state, metrics = train_step(params, opt_state, batch)
        log(pending.result())
    """
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            jax.copy_to_host_async(leaf)
    return HostCopy(tree)
