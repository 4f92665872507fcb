"""Compile targets: compiling for devices this process does not have.

A :class:`Target` names a TPU topology (``tpu:v5e:2x2``, ``tpu:v4:2x2x1``);
its devices come from JAX's topology descriptions
(``jax.experimental.topologies.get_topology_desc``, which needs libtpu: the
``jaxaot[tpu-aot]`` extra, Python >= 3.12). They belong to a compile-only
client: programs placed on them lower and compile for that topology, and
nothing of them runs.

One target is *active* in a process at a time (:func:`set_target`, set by a
``jaxaot precompile --target`` worker before it imports the manifest). Key
parts and lowering platforms read it: :func:`target_devices` (the devices
keys describe and shardings are built over), :func:`target_platform`. With no
target active, every function here answers what ``jax.devices()`` and
``jax.default_backend()`` answer, and keys are what they were without targets.

:func:`topology_text` and :func:`platform_version_text` describe devices the
same way for a real TPU process and for a topology's devices, so that a
process on the target computes the keys a precompile for it wrote.

GPUs: JAX has no deviceless GPU compile (``get_topology_desc`` is TPU-only;
jax-ml/jax#23971, #28376): ``cuda:``/``rocm:``/``gpu:`` targets are refused
with :class:`TargetError`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax

__all__ = [
    "EXTRA",
    "Target",
    "TargetError",
    "active_target",
    "check_tpu_available",
    "on_target",
    "parse_target",
    "platform_version_text",
    "refuse_call",
    "set_target",
    "target_devices",
    "target_platform",
    "topology_text",
]

#: How to install what TPU targets need.
EXTRA = 'pip install "jaxaot[tpu-aot]" (Python >= 3.12, Linux: it installs libtpu)'

# A TPU topology as libtpu names it: a chip generation, then the chips per
# dimension (``2x2``, ``2x2x1``), optionally twisted.
_TOPOLOGY = re.compile(r"^(v[0-9]+[a-z]*):([0-9]+(?:x[0-9]+){1,2})(_twisted|_untwisted)?$")
_GPU = ("cuda", "rocm", "gpu")


class TargetError(ValueError):
    """A target that is malformed, or that this process cannot compile for."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: ``platform`` (``"tpu"``) and ``topology`` (``"v5e:2x2"``)."""

    platform: str
    topology: str

    @property
    def spec(self) -> str:
        """The target as :func:`parse_target` reads it: ``tpu:v5e:2x2``."""
        return f"{self.platform}:{self.topology}"

    def __str__(self) -> str:
        return self.spec

    @property
    def devices(self) -> list[Any]:
        """The topology's devices (compile-only), in id order.

        Raises:
          TargetError: libtpu is missing, or it does not know the topology.
        """
        return list(_topology_devices(self.platform, self.topology))


def parse_target(text: str) -> Target:
    """The :class:`Target` ``text`` names: ``tpu:GENERATION:CHIPS`` (``tpu:v5e:2x2``,
    ``tpu:v4:2x2x1``, ``tpu:v5p:2x2x1_twisted``). Checks the spelling only
    (:attr:`Target.devices` asks libtpu).

    Raises:
      TargetError: malformed, or a platform without deviceless compiles (GPUs).
    """
    platform, sep, topology = text.strip().partition(":")
    platform = platform.lower()
    if platform in _GPU:
        raise TargetError(
            f"--target {text}: JAX cannot compile for a GPU without one (no deviceless "
            "GPU compile: jax-ml/jax#23971, #28376); precompile without --target on a "
            "machine with that GPU kind instead (see Targets in docs/precompile.md)"
        )
    if platform != "tpu" or not sep:
        raise TargetError(
            f"--target {text!r}: expected tpu:GENERATION:CHIPS, for example tpu:v5e:2x2 or "
            "tpu:v4:2x2x1 (the only targets without their devices are TPU topologies)"
        )
    if not _TOPOLOGY.match(topology.lower()):
        raise TargetError(
            f"--target {text!r}: {topology!r} is not a TPU topology; expected "
            "GENERATION:CHIPS, for example v5e:2x2, v5e:2x4 or v4:2x2x1"
        )
    return Target(platform, topology.lower())


def check_tpu_available() -> None:
    """Raises :class:`TargetError` (naming the extra) where libtpu is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        why = (
            f"this is Python {sys.version_info.major}.{sys.version_info.minor}; libtpu "
            "needs 3.12 or later"
            if sys.version_info < (3, 12)
            else "libtpu is not installed"
        )
        raise TargetError(f"TPU targets need libtpu ({why}): {EXTRA}")


@functools.lru_cache(maxsize=16)
def _topology_devices(platform: str, topology: str) -> tuple[Any, ...]:
    check_tpu_available()
    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) as it loads, meant
    # for processes that drive TPU chips; a topology description drives none,
    # and precompile workers (or test processes) load it side by side.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(topology_name=topology, platform=platform)
    except Exception as e:  # libtpu's own words: an unknown generation or shape...
        words = str(e).strip().splitlines()
        raise TargetError(
            f"--target {platform}:{topology}: libtpu cannot describe this topology "
            f"({type(e).__name__}: {words[0] if words else e!r})"
        ) from None
    return tuple(sorted(desc.devices, key=lambda d: int(d.id)))


_lock = threading.Lock()
_active: Target | None = None


def set_target(target: Target | None) -> Target | None:
    """Makes ``target`` the active target of this process (``None``: none); returns
    the one it replaces. Its devices are looked up first (so a target that cannot
    be compiled for is never active).

    Process-wide, not per thread: jaxaot compiles in background threads too.

    Raises:
      TargetError: the target's devices cannot be had (see :attr:`Target.devices`).
    """
    global _active
    if target is not None:
        target.devices  # noqa: B018 - raises here, not in the first key
    with _lock:
        previous, _active = _active, target
    return previous


def active_target() -> Target | None:
    """The active target, or ``None``."""
    return _active


def target_devices() -> list[Any]:
    """The devices of the active compile target (``jaxaot precompile --target``),
    or ``jax.devices()`` when there is none: build a manifest's shardings over
    these, and its signatures compile for the target.

    Under a target they are compile-only devices: no array can be placed on
    them; ``jax.ShapeDtypeStruct``s with shardings over them can.
    """
    target = _active
    return target.devices if target is not None else list(jax.devices())


def target_platform() -> str | None:
    """The lowering platform of the active target, or ``None``."""
    target = _active
    return target.platform if target is not None else None


def refuse_call(what: str, precompile: str) -> None:
    """Raises ``RuntimeError`` if a compile target is active: ``what`` (the function
    called) cannot run on its devices, only be precompiled (``precompile`` names
    the method)."""
    target = _active
    if target is not None:
        raise RuntimeError(
            f"{what}: called under the compile target {target}, whose devices cannot run "
            f"anything; precompile it (jaxaot.Manifest, {precompile}) with "
            "ShapeDtypeStructs instead"
        )


def _array_like(leaf: Any) -> bool:
    """Whether ``leaf`` is an array or a ``ShapeDtypeStruct`` (not a Python scalar)."""
    if getattr(leaf, "shape", None) is None or getattr(leaf, "dtype", None) is None:
        return False
    return not isinstance(leaf, int | float | complex | bool)


def _target_sharding(leaf: Any, target: Target, where: str) -> Any:
    """``leaf``'s sharding if it is over ``target``'s devices, ``None`` for no
    sharding (or not an array).

    Raises:
      TypeError: a sharding over other devices."""
    sharding = getattr(leaf, "sharding", None) if _array_like(leaf) else None
    if sharding is None:
        return None
    if isinstance(leaf, jax.Array) and not leaf.committed:
        return None  # placed by the call
    if set(sharding.device_set) <= set(target.devices):
        return sharding
    platforms = sorted({d.platform for d in sharding.device_set})
    raise TypeError(
        f"{where}: under the compile target {target} an argument is placed on "
        f"{'/'.join(platforms)} devices of this process; give a jax.ShapeDtypeStruct, "
        "unsharded (placed on the target's first device) or with a sharding over "
        "jaxaot.target_devices()"
    )


def on_target(leaves: Sequence[Any], where: str) -> list[Any]:
    """The array arguments ``leaves`` of a precompile under the active compile
    target, as it compiles them: ``ShapeDtypeStruct``s with their sharding over
    the target's devices; where none has one, those without a sharding placed
    on the target's first device (a one-device program, as a process on the
    target places what the call places: on its default device); otherwise
    those without one left to the call (with the placed ones, as ``jax.jit``
    does). Anything but an array is kept. Without a target, ``leaves``.

    Raises:
      TypeError: an array placed on devices that are not the target's (``where``
        names the function).
    """
    target = _active
    if target is None:
        return list(leaves)
    shardings = [_target_sharding(x, target, where) for x in leaves]
    alone = all(s is None for s in shardings)
    first = jax.sharding.make_single_device_sharding(target.devices[0])
    out = []
    for leaf, sharding in zip(leaves, shardings, strict=True):
        if not _array_like(leaf):
            out.append(leaf)
        else:
            weak = bool(getattr(leaf, "weak_type", False))
            placed = sharding if sharding is not None else first if alone else None
            out.append(
                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=weak, sharding=placed)
            )
    return out


def topology_text(devices: Sequence[Any]) -> str | None:
    """The topology ``devices`` form, as a key part: the chips' extent per
    dimension and cores per chip, then each device (in id order) as
    ``id@x,y,z/core:process``. ``None`` for devices without coordinates (CPUs,
    GPUs): their keys have no topology part. A real TPU process and a
    topology's compile-only devices give the same text for the same slice
    (the same ids, coordinates and process indices)."""
    if not devices or getattr(devices[0], "coords", None) is None:
        return None
    ordered = sorted(devices, key=lambda d: int(d.id))
    coords = [tuple(int(c) for c in d.coords) for d in ordered]
    extent = "x".join(str(max(c[i] for c in coords) + 1) for i in range(len(coords[0])))
    cores = len({int(getattr(d, "core_on_chip", 0)) for d in ordered})
    each = " ".join(
        f"{int(d.id)}@{','.join(map(str, c))}/{int(getattr(d, 'core_on_chip', 0))}"
        f":{int(d.process_index)}"
        for d, c in zip(ordered, coords, strict=True)
    )
    return f"{extent} cores={cores}; {each}"


def platform_version_text(client: Any) -> str:
    """A client's platform version as keys hold it. For TPUs, the libtpu build
    with its whitespace made single spaces and without the word
    ``compile_only_runtime`` (which a compile-only client adds): the same text
    for a topology's client and a real TPU process with the same libtpu (as far
    as libtpu's strings go; see docs/precompile.md). Other platforms: as reported."""
    text = str(client.platform_version)
    if str(client.platform) != "tpu":
        return text
    return " ".join(text.replace("compile_only_runtime", " ").split())
