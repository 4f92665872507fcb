"""Where a split program's values are, and the shardings its regions are compiled for.

A sharded split program (an input placed on a mesh or on a device other than
the default one, or a mesh in context) compiles each region for the shardings
its inputs have: the program's inputs' (after ``in_shardings``), then the
output shardings of the executables before it, in program order
(``_planner``).

* :func:`region_sharding` / :func:`region_placement`: the sharding a region's
  input is compiled for, ``None`` for what needs none (host values,
  uncommitted arrays, arrays on the default device);
* :class:`MeshContext`: the mesh in context, carried into other threads;
* ``in_shardings``/``out_shardings`` as ``jax.jit`` takes them
  (:func:`check_shardings`, :func:`flat_targets`, :func:`reshard`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from .._env import SettingError
from .._jax import active_target, target_devices
from .._keys._sharding import is_single_device, leaf_sharding


class _Unset:
    def __repr__(self) -> str:  # (as signatures show it: help(), docs/api.md)
        return "UNSET"


#: ``in_shardings``/``out_shardings`` not given (``None`` means "unconstrained").
UNSET: Any = _Unset()

__all__ = [
    "UNSET",
    "MeshContext",
    "as_sharding",
    "canonical_sharding",
    "devices_disagree",
    "host_sharding",
    "is_target",
    "output_shardings",
    "check_shardings",
    "flat_targets",
    "in_flight_limit",
    "region_placement",
    "region_sharding",
    "reshard",
]


def _default_device() -> Any:
    if getattr(jax.config, "jax_default_device", None) is not None:
        return None  # placed by configuration: every sharding counts as given
    if active_target() is not None:
        # What a process on the target places on: its first device (where
        # regions compile unplaced inputs, ``on_target``).
        return target_devices()[0]
    return jax.local_devices()[0]


def host_sharding() -> Any:
    """Where a call places a host value (a NumPy array, a Python scalar; a Haiku
    model's initial state holds them): on the default device, as an array made
    there is. ``None`` under a mesh (placed by it) or a configured default
    device."""
    if not MeshContext().empty:
        return None
    device = _default_device()
    return None if device is None else jax.sharding.make_single_device_sharding(device)


def _default_memory(device: Any) -> str | None:
    try:
        return str(device.default_memory().kind)
    except Exception:  # a backend without memory kinds
        return None


def region_sharding(sharding: Any) -> Any:
    """The sharding a region's input is compiled for: ``None`` (compiled as
    ``jax.jit`` compiles an unplaced input) for a single-device sharding on the
    default device in its default memory, else ``sharding`` itself, in one
    spelling (:func:`canonical_sharding`)."""
    if sharding is None:
        return None
    if is_single_device(sharding):
        (device,) = tuple(sharding.device_set)
        if device == _default_device() and sharding.memory_kind in (None, _default_memory(device)):
            return None
    return canonical_sharding(sharding)


def canonical_sharding(sharding: Any) -> Any:
    """``sharding`` in one spelling: a ``NamedSharding`` whose spec ends in
    unsharded dimensions (``P("data", None, None)``, as executables report their
    outputs) as the same sharding without them (``P("data")``, as users write
    it), so that equal shardings compare equal."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    entries = list(sharding.spec)
    if not entries or entries[-1] is not None:
        return sharding
    while entries and entries[-1] is None:
        entries.pop()
    spec = sharding.spec
    extra = {
        name: getattr(spec, name)
        for name in ("unreduced", "reduced", "unreduced_kind")
        if getattr(spec, name, None)
    }
    try:
        return NamedSharding(
            sharding.mesh, PartitionSpec(*entries, **extra), memory_kind=sharding.memory_kind
        )
    except (TypeError, ValueError):  # a spec this JAX builds otherwise: keep it as it is
        return sharding


def region_placement(value: Any) -> Any:
    """What :func:`region_sharding` gives for a value: ``None`` for host values
    (NumPy arrays, Python scalars) and uncommitted arrays (placed by the call that
    takes them), else its sharding's (a ``ShapeDtypeStruct``'s own, if any)."""
    if isinstance(value, jax.ShapeDtypeStruct):
        # A signature precompiled for arrays of this sharding: placed as they will be.
        placed = value.sharding
    else:
        placed = leaf_sharding(value) if isinstance(value, jax.Array) else None
    return region_sharding(placed) if isinstance(placed, Sharding) else None


class MeshContext:
    """The mesh in context (``jax.set_mesh``, ``use_abstract_mesh``) where it is
    made, to enter in another thread: JAX keeps it per thread."""

    __slots__ = ("abstract", "concrete")

    def __init__(self) -> None:
        self.abstract = jax.sharding.get_abstract_mesh()
        try:
            self.concrete = jax.sharding.get_mesh()
        except ValueError:  # inside a trace, which sees the abstract mesh only
            self.concrete = Mesh(np.empty((), dtype=object), ())

    @property
    def empty(self) -> bool:
        return bool(self.abstract.empty) and bool(self.concrete.empty)

    def key(self) -> tuple[Any, Any]:
        """Hashable, for in-process tables."""
        return (self.abstract, self.concrete)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Makes this the mesh in context of the calling thread, for the block."""
        with contextlib.ExitStack() as stack:
            if not self.concrete.empty:
                stack.enter_context(jax.set_mesh(self.concrete))
            if not self.abstract.empty and self.abstract != jax.sharding.get_abstract_mesh():
                stack.enter_context(jax.sharding.use_abstract_mesh(self.abstract))
            yield


def check_shardings(what: str, value: Any) -> None:
    """``in_shardings``/``out_shardings``: shardings, partition specs or ``None``
    (unconstrained) in a pytree prefix of the arguments or results."""
    leaves = jax.tree_util.tree_leaves(value, is_leaf=is_target)
    for leaf in leaves:
        if not is_target(leaf):
            raise TypeError(
                f"jaxaot.jit: {what} must hold jax.sharding.Sharding, PartitionSpec or "
                f"None leaves, got {type(leaf).__name__}: {leaf!r}"
            )


def is_target(x: Any) -> bool:
    """A sharding, a partition spec or ``None`` (unconstrained)."""
    return x is None or isinstance(x, jax.sharding.Sharding | jax.sharding.PartitionSpec)


def as_sharding(x: Any, what: str) -> Any:
    """``x`` as a sharding: a partition spec over the mesh in context."""
    if isinstance(x, jax.sharding.PartitionSpec):
        mesh = jax.sharding.get_mesh()
        if mesh.empty:
            raise ValueError(f"jaxaot.jit: a PartitionSpec in {what} needs a mesh (jax.set_mesh)")
        return jax.sharding.NamedSharding(mesh, x)
    return x


def flat_targets(prefix: Any, tree: Any, what: str) -> tuple[Any, ...]:
    """For each leaf of ``tree`` (positional arguments, or results), the sharding a
    pytree prefix of it gives (``None``: unconstrained). A single sharding (or
    spec, or ``None``) counts for every leaf, as in ``jax.jit``."""
    if is_target(prefix):
        return (as_sharding(prefix, what),) * len(jax.tree_util.tree_leaves(tree))
    if isinstance(tree, tuple) and isinstance(prefix, list):
        prefix = tuple(prefix)
    leaves, prefix_def = jax.tree_util.tree_flatten(prefix, is_leaf=is_target)
    out: list[Any] = []
    subtrees = prefix_def.flatten_up_to(tree)  # type: ignore[attr-defined]
    for leaf, subtree in zip(leaves, subtrees, strict=True):
        out += [as_sharding(leaf, what)] * len(jax.tree_util.tree_leaves(subtree))
    return tuple(out)


def input_targets(in_shardings: Any, dyn_args: Any, count: int) -> tuple[Any, ...]:
    """The sharding ``in_shardings`` gives each of ``count`` leaves (the positional
    arguments' leaves, then the keyword arguments', unconstrained); none where
    they name devices that disagree (every call then goes to ``jax.jit``, which
    says what happens)."""
    targets = flat_targets(in_shardings, dyn_args, "in_shardings")
    targets += (None,) * (count - len(targets))
    if len({frozenset(t.device_set) for t in targets if t is not None}) > 1:
        return ()
    return targets


def place_inputs(leaves: list[Any], targets: tuple[Any, ...]) -> list[Any] | None:
    """The leaves placed on their targets as ``jax.jit`` places them (host values
    and uncommitted arrays are put there; ``ShapeDtypeStruct``s of ``precompile``
    and ``explain`` take them); ``None`` where a committed array or a
    ``ShapeDtypeStruct`` is elsewhere, or there are no targets."""
    if len(targets) != len(leaves):
        return None
    placed = list(leaves)
    for i, (leaf, target) in enumerate(zip(leaves, targets, strict=True)):
        if target is None:
            continue
        if isinstance(leaf, jax.Array) and leaf.committed:
            if not _equivalent(leaf.sharding, target, leaf.ndim):
                return None
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            if leaf.sharding is None:
                placed[i] = jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=target, weak_type=leaf.weak_type
                )
            elif not _equivalent(leaf.sharding, target, len(leaf.shape)):
                return None
        else:
            placed[i] = jax.device_put(leaf, target)
    return placed


def _equivalent(sharding: Any, target: Any, ndim: int) -> bool:
    """Whether ``sharding`` places a value of ``ndim`` dimensions as ``target`` does;
    ``False`` where ``target`` cannot place it at all (a spec of more dimensions:
    ``jax.jit`` then says so)."""
    try:
        return bool(sharding.is_equivalent_to(target, ndim))
    except (IndexError, ValueError):
        return False


def devices_disagree(leaves: Sequence[Any]) -> bool:
    """Whether committed arrays among ``leaves`` are on different devices (one
    committed to the default device among them): ``jax.jit`` refuses such a call,
    naming the arguments, and no program is compiled for it."""
    found: set[frozenset[Any]] = set()
    for leaf in leaves:
        sharding = leaf_sharding(leaf)
        if isinstance(sharding, Sharding):
            found.add(frozenset(sharding.device_set))
    return len(found) > 1


def reshard(out: list[Any], targets: Sequence[Any]) -> list[Any]:
    """``out`` with each array moved to its target sharding where it is elsewhere,
    and given the target itself where it is there but spelled otherwise
    (``P("model")`` for ``P("model", None)``: as ``jax.jit`` returns it, so that it
    compares equal; ``device_put`` moves nothing then)."""
    return [
        x if t is None or not isinstance(x, jax.Array) or x.sharding == t else jax.device_put(x, t)
        for x, t in zip(out, targets, strict=True)
    ]


def output_shardings(exe: Any) -> list[Any]:
    """The sharding of each output of a compiled executable."""
    return list(jax.tree_util.tree_leaves(exe.output_shardings))


def in_flight_limit() -> int | None:
    """How many multi-device executables a sharded split program may have queued
    before it waits for the oldest: XLA:CPU runs every simulated device's part of
    each queued collective on one shared thread pool, and with many executables in
    flight a collective can miss its rendezvous (XLA then ends the process). Other
    backends queue without limit. ``JAXAOT_IN_FLIGHT`` overrides (0: no limit)."""
    text = os.environ.get("JAXAOT_IN_FLIGHT", "").strip()
    if text:
        try:
            limit = int(text)
        except ValueError:
            limit = -1
        if limit < 0:
            raise SettingError(f"JAXAOT_IN_FLIGHT must be an integer >= 0, got {text!r}")
        return limit or None
    if jax.default_backend() == "cpu" and jax.local_device_count() > 1:
        return 8
    return None
