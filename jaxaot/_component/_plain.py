"""Which devices a component's program names, and which programs stay plain JAX.

A component's entry hides its program from its callers. One fact about the
program matters to them beyond its types: the devices it names (a
``with_sharding_constraint`` or ``device_put`` with a concrete sharding, a
``shard_map`` over a concrete mesh, a nested ``jit`` with shardings). ``jax.jit``
chooses the devices of a computation from everything it contains, so such a
component's equation carries a *device witness* (:func:`device_witness`): a
small jaxpr naming the same devices in the same order (sharding constraints on
scalars), which JAX's device assignment reads as it reads the body itself. The
cached entry is then linked into callers whose devices are its own, and a
caller on other devices gets the error ``jax.jit`` would give.

What stays plain JAX (inlined into the caller, compiled from the body at top
level), :func:`needs_plain_jax`:

* a program whose named devices cannot be written as a witness (a device this
  process does not have);
* a program whose entry must stay in this process and cannot be lowered on its
  own (:func:`needs_context`: collectives over an axis bound outside it, a
  ``custom_vjp`` rule's linear part) is not
  plain, but is never written to a cache.

Calls that run as plain JAX whatever the program (:func:`off_device`,
:func:`symbolic`), each said once per component: inputs in a memory space other
than the device's, and inputs of symbolic shape (``jax.export``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .. import _stats
from .._jax import (
    Target,
    active_target,
    named_axis_effect,
    named_shardings,
    target_devices,
    uses_primitive,
)

__all__ = [
    "Devices",
    "device_witness",
    "devices_from_json",
    "devices_of",
    "devices_to_json",
    "needs_context",
    "needs_plain_jax",
    "off_device",
    "symbolic",
]

#: The devices a program names, each distinct sharding once: a mesh (axis names,
#: sizes and types, device ids in mesh order) or a device list (ids in order), and
#: the memory kind. JSON-able, for entries of explicit-key components.
Devices = tuple[tuple[Any, ...], ...]

_AXIS = "jaxaot_devices"  # the axis of a witness mesh over a device list


def _described(sharding: Any) -> tuple[Any, ...]:
    memory_kind = sharding.memory_kind
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        mesh = sharding.mesh
        ids = tuple(int(d.id) for d in np.asarray(mesh.devices).flat)
        types = tuple(t.name for t in mesh.axis_types)
        names = tuple(str(n) for n in mesh.axis_names)
        sizes = tuple(int(z) for z in mesh.axis_sizes)
        return ("mesh", names, sizes, types, ids, memory_kind)
    ids = tuple(int(d.id) for d in sharding._device_assignment)  # noqa: SLF001
    return ("devices", ids, memory_kind)


def devices_of(closed: Any) -> Devices:
    """The meshes and devices ``closed`` names (see :data:`Devices`), each once, in
    the order JAX finds them (empty for most programs)."""
    return tuple(dict.fromkeys(_described(s) for s in named_shardings(closed)))


def _sharding_of(item: tuple[Any, ...], by_id: dict[int, Any]) -> NamedSharding:
    if item[0] == "mesh":
        _, names, sizes, types, ids, memory_kind = item
        devices = np.array([by_id[i] for i in ids]).reshape(sizes)
        mesh = Mesh(devices, tuple(names), axis_types=tuple(AxisType[t] for t in types))
    else:
        _, ids, memory_kind = item
        mesh = Mesh(np.array([by_id[i] for i in ids]), (_AXIS,), axis_types=(AxisType.Auto,))
    return NamedSharding(mesh, PartitionSpec(), memory_kind=memory_kind)


def device_witness(devices: Devices) -> Any:
    """A closed jaxpr naming ``devices`` to JAX's device assignment as a program that
    names them does: one sharding constraint on a scalar per mesh (the same mesh,
    so that outputs placed from it name the user's mesh) or device list (a
    one-axis mesh of those devices in that order). ``None`` for no devices.
    Device ids are those of the active compile target's devices, if any.

    Raises:
      KeyError: a device this process (or its target) does not have.
    """
    return _witness(devices, active_target())


@functools.lru_cache(maxsize=256)
def _witness(devices: Devices, target: Target | None) -> Any:
    if not devices:
        return None
    by_id = {int(d.id): d for d in target_devices()}
    shardings = [_sharding_of(item, by_id) for item in devices]

    def witness() -> tuple[Any, ...]:
        scalar = np.float32(0)
        return tuple(jax.lax.with_sharding_constraint(scalar, s) for s in shardings)

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return jax.make_jaxpr(witness)()


def needs_plain_jax(devices: Devices) -> str | None:
    """Why a program naming ``devices`` is served as plain JAX (see the module
    docstring), or ``None``."""
    if not devices:
        return None
    try:
        device_witness(devices)
    except Exception as e:  # a device this process does not have, a memory kind...
        return f"names devices it cannot be linked on ({type(e).__name__}: {e})"
    return None


def needs_context(closed: Any) -> tuple[bool, bool]:
    """Whether a jaxpr can only be lowered inside a context it does not have, as
    ``(outer axis, linear part)``: it uses a named axis bound outside it (``psum``
    over an outer ``vmap`` axis), or its values are typed over the manual axes of
    an enclosing ``shard_map`` (it is called inside one: a program of its own
    cannot take such types), or it holds a ``custom_vjp`` rule's linear part
    (only its transpose can be lowered, and is cached)."""
    manual = any(map(_over_manual_axes, (*closed.in_avals, *closed.out_avals)))
    outer = manual or named_axis_effect(closed.effects)
    return outer, uses_primitive(closed, ("custom_lin",))


def _over_manual_axes(aval: Any) -> bool:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return AxisType.Manual in (getattr(mesh, "axis_types", None) or ())


def devices_to_json(devices: Devices) -> list[Any]:
    return [[list(x) if isinstance(x, tuple) else x for x in item] for item in devices]


def devices_from_json(data: Sequence[Any]) -> Devices:
    """:data:`Devices` from :func:`devices_to_json`; ValueError when malformed."""
    out: list[tuple[Any, ...]] = []
    for item in data:
        if not isinstance(item, list) or not item or item[0] not in ("mesh", "devices"):
            raise ValueError(f"malformed devices {item!r:.60}")
        fields = tuple(tuple(x) if isinstance(x, list) else x for x in item)
        ids = fields[-2]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"malformed device ids {item!r:.60}")
        out.append(fields)
    return tuple(out)


# -- calls that run as plain JAX (each said once per component) ---------------------


def _memory_space(value: Any) -> str:
    """The name of the memory space a value is in (``Device``, ``Host``)."""
    space = getattr(getattr(value, "aval", None), "memory_space", None)
    return "Device" if space is None else str(getattr(space, "name", space))


def off_device(name: str, leaves: Sequence[Any]) -> bool:
    """Whether an input of a call of component ``name`` is in a memory space other
    than the device's (host memory, ``pinned_host``): components are traced and
    cached for values in device memory, so such a call runs as plain JAX, and
    says so once."""
    space = next((s for s in map(_memory_space, leaves) if s != "Device"), None)
    if space is None:
        return False
    _stats.warn_once(
        f"memory-space:{name}",
        f"jaxaot: component {name!r}: an input is in {space.lower()} memory "
        "(memory_kind='pinned_host' or another than the device's); such a call runs "
        "as plain JAX (jax.jit of the function, or inline in a trace), and is not "
        "cached: components are cached for values in device memory",
    )
    return True


def symbolic(name: str, leaves: Sequence[Any]) -> bool:
    """Whether an input of a call of component ``name`` has a symbolic dimension
    (``jax.export`` of a shape-polymorphic program): entries are made for
    concrete shapes, so such a call is traced inline, as ``jax.jit`` traces a
    function, and says so once."""
    if not any(not isinstance(d, int) for leaf in leaves for d in getattr(leaf, "shape", ())):
        return False
    _stats.warn_once(
        f"symbolic-shape:{name}",
        f"jaxaot: component {name!r}: an input has a symbolic dimension "
        "(jax.export with shape polymorphism); such a call is traced inline, as "
        "jax.jit traces the function, and is not cached: components are cached for "
        "concrete shapes",
    )
    return True
