"""The sharded suite's worker side: the mesh a :class:`MeshLayout` names, where
the benchmark's inputs go on it, and the block the model runs there.

* ``data-parallel``: one ``data`` axis over every device; the batch split over
  it, the parameters replicated.
* ``fsdp``: the same axis; the batch split, and every parameter split on its
  first axis (for scan's stacked parameters, the first axis after the layer axis).
* ``2d``: a ``data`` x ``model`` mesh (``model`` of size 2); the batch split on
  ``data``, the attention and MLP weights on ``model`` (``qkv`` and ``up`` by
  their columns, ``proj`` and ``down`` by their rows), the norms' gains replicated.

With ``explicit`` axes (``jax.make_mesh``'s default) the arrays are placed with
their shardings in their types and the worker runs under ``jax.set_mesh``; the
FSDP and 2-D layouts then run the blocks of :mod:`._blocks`, which say where
their values go where JAX's sharding rules cannot tell. With ``auto`` axes the
worker runs the benchmark's own block, and XLA propagates the shardings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._config import MeshLayout

__all__ = ["DEVICE_FLAG", "Placement", "placement"]

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _unplaced(tree: Any, kind: str) -> Any:
    return tree


@dataclass(frozen=True)
class Placement:
    """How a worker places its inputs and which block its model runs.

    ``place(tree, kind)`` puts one of the benchmark's inputs on devices: kind
    ``"blocks"`` (the per-layer parameter dicts), ``"stacked"`` (the same
    parameters stacked for scan) or ``"batch"`` (the input activations).
    ``block`` replaces the benchmark model's block (``None``: the model's own).
    ``mesh``, when set, is the mesh the worker runs under (``jax.set_mesh``).
    """

    place: Callable[[Any, str], Any] = _unplaced
    block: Callable[..., Any] | None = None
    mesh: Any = None

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The context the worker places, traces and runs in."""
        if self.mesh is None:
            yield
            return
        import jax

        with jax.set_mesh(self.mesh):
            yield


def _param_spec(layout: str, name: str) -> tuple[str | None, ...]:
    """The partition of one block parameter (by its name in the block's dict)."""
    if layout == "fsdp":
        return ("data",)
    if layout == "2d" and name in ("qkv", "up"):
        return (None, "model")
    if layout == "2d" and name in ("proj", "down"):
        return ("model", None)
    return ()


def placement(layout: MeshLayout) -> Placement:
    """The mesh of ``layout``, and where the benchmark's inputs go on it."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() != layout.devices:
        raise RuntimeError(
            f"the worker sees {jax.device_count()} devices, not {layout.devices}: "
            f"was {DEVICE_FLAG} set before JAX was imported?"
        )
    explicit = layout.axis_types == "explicit"
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    sizes = layout.mesh_shape
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(axis_type,) * len(sizes))

    def param(path: Any, leaf: Any, stacked: bool) -> Any:
        spec = _param_spec(layout.layout, str(getattr(path[-1], "key", "")))
        spec = (None, *spec) if stacked else spec
        return jax.device_put(leaf, NamedSharding(mesh, P(*spec)))

    def place(tree: Any, kind: str) -> Any:
        if kind == "batch":
            return jax.device_put(tree, NamedSharding(mesh, P("data")))
        stacked = kind == "stacked"
        return jax.tree_util.tree_map_with_path(lambda p, x: param(p, x, stacked), tree)

    block = None
    if explicit and layout.layout != "data-parallel":
        from . import _blocks

        block = _blocks.gathered_block if layout.layout == "fsdp" else _blocks.model_parallel_block
    return Placement(place, block, mesh if explicit else None)
