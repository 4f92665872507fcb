"""Meshes, shardings and devices as key text: values, not arrays.

A :class:`jax.sharding.Mesh` holds an array of devices, but what a program
computes depends only on what the mesh *is*: its axis names, sizes and types,
and (for a concrete mesh) which devices, in which order, of which platform and
kind. The functions here give that as text that is the same in every process
that has the same devices, for keys, and as hashable tuples for in-process
tables:

* :func:`mesh_text`: a ``Mesh`` or ``AbstractMesh``;
* :func:`spec_text`: a ``PartitionSpec`` (unreduced and reduced axes included);
* :func:`sharding_text`: a ``NamedSharding``, ``SingleDeviceSharding`` or any
  other ``Sharding`` (by its HLO sharding and devices), memory kind included;
* :func:`input_sharding_parts`: for each input of a top-level call, whether it
  is committed and its concrete sharding (or that it is a host value);
* :func:`context_mesh_parts`: the mesh a program is traced under
  (``jax.set_mesh``, ``use_abstract_mesh``).

* :func:`region_sharding_parts`: the input shardings a region of a split
  program (``jaxaot.jit``) is compiled for, and the mesh in context;
* :func:`sharded_type`: whether a type carries a sharding.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

__all__ = [
    "concrete_mesh",
    "context_mesh_parts",
    "input_sharding_parts",
    "input_sharding_sig",
    "is_sharding_value",
    "is_single_device",
    "leaf_sharding",
    "mesh_axes",
    "mesh_text",
    "region_sharding_parts",
    "sharded_type",
    "sharding_text",
    "type_sharding_from_json",
    "type_sharding_text",
    "type_sharding_to_json",
    "spec_text",
    "value_text",
]


def sharded_type(aval: Any) -> bool:
    """Whether a type carries a sharding (explicit mesh axes: ``f32[8@x]``), or
    unreduced/reduced axes, or is replicated over a mesh with explicit axes (its
    mesh is part of it: a body reads it as ``jax.typeof(x).sharding.mesh``): what
    JAX checks types by."""
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return False
    return (
        any(e is not None for e in tuple(spec))
        or bool(getattr(spec, "unreduced", None) or getattr(spec, "reduced", None))
        or _explicit_axes(getattr(sharding, "mesh", None))
    )


def _explicit_axes(mesh: Any) -> bool:
    types = getattr(mesh, "axis_types", None) or ()
    return any(_enum(t) == "Explicit" for t in types)


#: ``jax.sharding.is_single_device_sharding`` (jax 0.12.1 on): reading
#: ``jax.sharding.SingleDeviceSharding`` there warns, and a program run with
#: warnings as errors fails; older releases have only the class.
_IS_SINGLE_DEVICE = getattr(jax.sharding, "is_single_device_sharding", None)


def is_single_device(sharding: Any) -> bool:
    """Whether ``sharding`` places a value on one device."""
    if _IS_SINGLE_DEVICE is not None:
        return bool(_IS_SINGLE_DEVICE(sharding))
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


def is_sharding_value(value: Any) -> bool:
    """Whether ``value`` is a mesh, a sharding or a partition spec."""
    return isinstance(value, Mesh | AbstractMesh | Sharding | PartitionSpec)


def _enum(value: Any) -> str:
    return value.name if isinstance(value, enum.Enum) else str(value)


def mesh_axes(mesh: Any) -> str:
    """A mesh's axes as text (``name=size:type``, comma-separated): concrete and
    abstract meshes of one shape and axis types give the same."""
    names = tuple(str(n) for n in mesh.axis_names)
    sizes = tuple(int(s) for s in mesh.axis_sizes)
    types = tuple(_enum(t) for t in (getattr(mesh, "axis_types", None) or ()))
    return ",".join(
        f"{n}={s}" + (f":{types[i]}" if i < len(types) else "")
        for i, (n, s) in enumerate(zip(names, sizes, strict=True))
    )


def _device_text(device: Any) -> str:
    return f"{device.platform}:{device.device_kind}:{device.id}@{device.process_index}"


def _devices_text(devices: Sequence[Any]) -> str:
    if not devices:
        return ""
    first = devices[0]
    ids = ",".join(str(d.id) for d in devices)
    processes = ",".join(str(d.process_index) for d in devices)
    return f"{first.platform}:{first.device_kind}[{ids}]procs[{processes}]"


def mesh_text(mesh: Any) -> str:
    """A mesh as text: axes (name=size:type), and for a concrete mesh its devices in
    mesh order (platform, kind, ids, processes); for an abstract one its platform
    and device kind."""
    if mesh is None:
        return "none"
    if isinstance(mesh, Mesh):
        if mesh.empty:
            return "mesh()"
        devices = list(np.asarray(mesh.devices).flat)
        return f"mesh({mesh_axes(mesh)};{_devices_text(devices)})"
    if isinstance(mesh, AbstractMesh):
        if mesh.empty:
            return "abstract_mesh()"
        device = getattr(mesh, "abstract_device", None)
        where = (
            f"{getattr(device, 'platform', None)}:{getattr(device, 'device_kind', None)}"
            if device is not None
            else ""
        )
        return f"abstract_mesh({mesh_axes(mesh)};{where})"
    return f"{type(mesh).__qualname__}:{mesh!r}"


def _entry_text(entry: Any) -> str:
    if entry is None:
        return "_"
    if isinstance(entry, tuple):
        return "(" + ",".join(str(e) for e in entry) + ")"
    return str(entry)


def spec_text(spec: Any) -> str:
    """A partition spec as text, unreduced and reduced axes included."""
    if spec is None:
        return "none"
    inner = ",".join(_entry_text(e) for e in tuple(spec))
    extra = ""
    for what in ("unreduced", "reduced"):
        axes = getattr(spec, what, None)
        if axes:
            extra += f";{what}=" + ",".join(sorted(str(a) for a in axes))
    return f"P({inner}{extra})"


def type_sharding_text(sharding: Any) -> str:
    """The sharding a type carries (explicit mesh axes) as text: the mesh's axes
    (name=size:type) and the spec."""
    return f"{{{mesh_axes(sharding.mesh)}}}{spec_text(sharding.spec)}"


def _spec_entry_to_json(entry: Any) -> Any:
    if entry is None or isinstance(entry, str):
        return entry
    return [str(e) for e in entry]


def type_sharding_to_json(sharding: Any) -> dict[str, Any]:
    """The sharding a type carries as JSON, for entry headers: the mesh's axes
    (``[name, size, type]``) and the spec (entries, unreduced and reduced axes)."""
    mesh, spec = sharding.mesh, sharding.spec
    types = tuple(getattr(mesh, "axis_types", None) or ())
    data: dict[str, Any] = {
        "axes": [
            [str(n), int(z), _enum(types[i]) if i < len(types) else None]
            for i, (n, z) in enumerate(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        ],
        "spec": [_spec_entry_to_json(e) for e in tuple(spec)],
    }
    device = getattr(mesh, "abstract_device", None)
    if device is not None:  # part of the type: a value's mesh names its devices' kind
        data["device"] = [str(device.platform), str(device.device_kind), device.num_cores]
    for what in ("unreduced", "reduced"):
        axes = getattr(spec, what, None)
        if axes:
            data[what] = sorted(str(a) for a in axes)
    kind = getattr(spec, "unreduced_kind", None)
    if kind is not None and getattr(spec, "unreduced", None):
        data["unreduced_kind"] = _enum(kind)
    return data


def type_sharding_from_json(data: Any, context: Any = None) -> Any:
    """The sharding :func:`type_sharding_to_json` wrote, over the abstract mesh
    ``context`` (the mesh in context) when its axes are the ones written, else
    over an abstract mesh of those axes and the devices' kind written (as the
    types of the process that wrote it carried them: with no mesh set, a
    result's type must agree with the next operand's, which carries its
    devices' kind).

    Raises:
      ValueError: malformed data.
    """
    from jax.sharding import AxisType

    if not isinstance(data, dict) or not isinstance(data.get("axes"), list):
        raise ValueError("a type's sharding is not an object with axes")
    names, sizes, types = [], [], []
    for axis in data["axes"]:
        if not (isinstance(axis, list) and len(axis) == 3):
            raise ValueError(f"malformed mesh axis {axis!r:.60}")
        name, size, kind = axis
        if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"malformed mesh axis {axis!r:.60}")
        names.append(name)
        sizes.append(size)
        types.append(AxisType[kind] if isinstance(kind, str) else AxisType.Auto)
    device = _abstract_device(data.get("device"))
    mesh = context
    if mesh is None or mesh.empty or mesh_axes(mesh) != _axes_of(names, sizes, types):
        mesh = AbstractMesh(
            tuple(sizes), tuple(names), axis_types=tuple(types), abstract_device=device
        )
    entries: list[Any] = []
    for entry in data.get("spec", []):
        if entry is None or isinstance(entry, str):
            entries.append(entry)
        elif isinstance(entry, list) and all(isinstance(e, str) for e in entry):
            entries.append(tuple(entry))
        else:
            raise ValueError(f"malformed partition spec entry {entry!r:.60}")
    extra: dict[str, Any] = {}
    for what in ("unreduced", "reduced"):
        axes = data.get(what)
        if axes:
            if not (isinstance(axes, list) and all(isinstance(a, str) for a in axes)):
                raise ValueError(f"malformed {what} axes")
            extra[what] = frozenset(axes)
    kind = data.get("unreduced_kind")
    if isinstance(kind, str):
        import inspect

        default = inspect.signature(PartitionSpec).parameters.get("unreduced_kind")
        if default is not None and isinstance(default.default, enum.Enum):
            extra["unreduced_kind"] = type(default.default)[kind]
    return NamedSharding(mesh, PartitionSpec(*entries, **extra))


def _abstract_device(data: Any) -> Any:
    """The abstract device :func:`type_sharding_to_json` wrote (platform, device
    kind, cores), or ``None`` where it wrote none.

    Raises:
      ValueError: malformed data.
    """
    if data is None:
        return None
    if not (
        isinstance(data, list)
        and len(data) == 3
        and all(isinstance(d, str) for d in data[:2])
        and (data[2] is None or (isinstance(data[2], int) and not isinstance(data[2], bool)))
    ):
        raise ValueError(f"malformed abstract device {data!r:.60}")
    platform, kind, cores = data
    return jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)


def _axes_of(names: Sequence[str], sizes: Sequence[int], types: Sequence[Any]) -> str:
    return ",".join(f"{n}={z}:{_enum(t)}" for n, z, t in zip(names, sizes, types, strict=True))


def sharding_text(sharding: Any, ndim: int | None = None) -> str:
    """A sharding as text: mesh, spec and memory kind for a ``NamedSharding``; the
    device for a ``SingleDeviceSharding``; else the HLO sharding (for ``ndim``
    dimensions) and the devices."""
    memory = getattr(sharding, "memory_kind", None)
    if isinstance(sharding, NamedSharding):
        return f"named({mesh_text(sharding.mesh)};{spec_text(sharding.spec)};{memory})"
    if is_single_device(sharding):
        (device,) = tuple(sharding.device_set)
        return f"device({_device_text(device)};{memory})"
    if isinstance(sharding, Sharding):
        try:
            hlo = str(sharding._to_xla_hlo_sharding(ndim or 0))  # noqa: SLF001
        except Exception:  # a sharding that cannot say
            hlo = repr(sharding)
        devices = list(getattr(sharding, "_device_assignment", ()) or ())
        return f"{type(sharding).__name__}({hlo};{_devices_text(devices)};{memory})"
    return f"{type(sharding).__qualname__}:{sharding!r}"


def value_text(value: Any) -> str | None:
    """A mesh, sharding or spec as key text, or ``None`` for other values."""
    if isinstance(value, PartitionSpec):
        return spec_text(value)
    if isinstance(value, Mesh | AbstractMesh):
        return mesh_text(value)
    if isinstance(value, Sharding):
        return sharding_text(value)
    return None


def concrete_mesh() -> Any:
    """The concrete mesh ``jax.set_mesh`` gives, or ``None`` (none set, or under
    tracing, where only the abstract mesh counts)."""
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # under jax.jit
        return None
    return None if mesh.empty else mesh


def context_mesh_parts() -> tuple[str, str]:
    """The mesh in context: the abstract mesh tracing sees and the concrete mesh
    ``jax.set_mesh`` gives (``none`` where none is set or under tracing)."""
    return mesh_text(jax.sharding.get_abstract_mesh()), mesh_text(concrete_mesh())


def leaf_sharding(leaf: Any) -> Any:
    """A top-level input's placement: ``None`` where the call places it (host values,
    uncommitted arrays, ShapeDtypeStructs without a sharding: on the default
    device, or with the committed inputs), else its sharding."""
    if isinstance(leaf, jax.Array):
        try:
            return leaf.sharding if leaf.committed else None
        except Exception:  # a deleted array: the call reports it
            return "unknown"
    sharding = getattr(leaf, "sharding", None)  # a ShapeDtypeStruct with a sharding
    return sharding if isinstance(sharding, Sharding) else None


def input_sharding_sig(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """What tells top-level calls apart by placement, for in-process tables: each
    committed input's sharding (hashable; equal shardings compare equal)."""
    return tuple(leaf_sharding(x) for x in leaves)


def input_sharding_parts(leaves: Sequence[Any]) -> tuple[str, ...]:
    """Each top-level input's placement as key text: ``placed by the call`` (host
    values and uncommitted arrays, which go to the default device or where the
    committed inputs are), or ``committed:`` and its concrete sharding."""
    parts = []
    for leaf in leaves:
        placed = leaf_sharding(leaf)
        if placed is None:
            parts.append("placed by the call")
        elif isinstance(placed, Sharding):
            parts.append("committed:" + sharding_text(placed, np.ndim(leaf)))
        else:
            parts.append(str(placed))
    return tuple(parts)


def region_sharding_parts(
    shardings: Sequence[Any], ndims: Sequence[int]
) -> tuple[tuple[str, ...], tuple[str, str]]:
    """Key text of a region's input shardings (``default`` for ``None``), and of
    the mesh in context."""
    texts = tuple(
        "default" if s is None else sharding_text(s, n)
        for s, n in zip(shardings, ndims, strict=True)
    )
    return texts, context_mesh_parts()
