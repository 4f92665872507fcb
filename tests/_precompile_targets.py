"""Manifests for test_manifest: precompiled by ``jaxaot precompile`` in worker
processes, then deployed by ``_precompile_deploy`` in a fresh process.

``PRECOMPILE_KILL_MARKER``: a path; the first process to trace ``fragile``
creates it and kills itself (SIGKILL) while it holds that signature's claim.
``PRECOMPILE_STALL_MARKER``: a path; each process that traces ``stalling``
creates it, then sleeps for a minute (a precompile to stop meanwhile).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import jaxaot

WIDTH = 16


def _sds(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _params(n: int, width: int = WIDTH, sharding: Any = None) -> list[dict[str, Any]]:
    return [
        {
            "w": jax.ShapeDtypeStruct((width, width), jnp.float32, sharding=sharding),
            "b": jax.ShapeDtypeStruct((width,), jnp.float32, sharding=sharding),
        }
        for _ in range(n)
    ]


# -- components, a static argument included ------------------------------------


@jaxaot.component
def layer(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w"] + p["b"])


@jaxaot.component(static_argnames=("mode",))
def head(x: jax.Array, *, mode: str) -> jax.Array:
    return jnp.sum(x, axis=-1) if mode == "sum" else jnp.max(x, axis=-1)


components = (
    jaxaot.manifest()
    .add(layer, _params(1)[0], _sds(4, WIDTH))
    .add(layer, _params(1)[0], _sds(8, WIDTH))
    .add(head, _sds(4, WIDTH), mode="sum")
    .add(head, _sds(4, WIDTH), mode="max")
)


# -- jaxaot.jit of a train step ----------------------------------------------------


def _loss(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    for p in params:
        x = layer(p, x)
    return jnp.mean((x - y) ** 2)


@jaxaot.jit
def train_step(
    params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array
) -> tuple[list[dict[str, jax.Array]], jax.Array]:
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


train = jaxaot.manifest().add(train_step, _params(3), _sds(8, WIDTH), _sds(8, WIDTH))


# -- serving buckets --------------------------------------------------------------


@jaxaot.jit
def serve(params: list[dict[str, jax.Array]], tokens: jax.Array) -> jax.Array:
    x = jnp.tanh(tokens[..., None] * jnp.ones(WIDTH))
    for p in params:
        x = layer(p, x)
    return x.mean(axis=1)


def buckets() -> jaxaot.Manifest:
    """A zero-argument function that returns a manifest: 2 batch sizes × 2 lengths."""
    return jaxaot.manifest().buckets(
        serve, lambda b, s: (_params(2), _sds(b, s)), batch=(1, 2), seq=(4, 8)
    )


# -- signatures that cannot be precompiled, among others that can ----------------


@jaxaot.jit
def scaled(x: jax.Array) -> jax.Array:
    return 2 * head(x, mode="sum")


#: good, bad (one argument too many: jax.jit cannot trace it either), bad (a
#: string where the component takes an array), good.
failing = (
    jaxaot.manifest()
    .add(head, _sds(4, WIDTH), mode="sum")
    .add(scaled, _sds(4, WIDTH), _sds(4, WIDTH))
    .add(head, "not an array", mode="sum")
    .add(scaled, _sds(8, WIDTH))
)
empty = jaxaot.manifest()


# -- sharded signatures (8 devices) ---------------------------------------------------


def _mesh(explicit: bool = False) -> tuple[NamedSharding, NamedSharding]:
    if explicit:  # jax.make_mesh's axes: the shardings are in the values' types
        mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    else:
        mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    return NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())


def sharded_components() -> jaxaot.Manifest:
    """A component over data sharded on 8 devices, parameters replicated."""
    data, replicated = _mesh()
    x = jax.ShapeDtypeStruct((16, WIDTH), jnp.float32, sharding=data)
    return jaxaot.manifest().add(layer, _params(1, sharding=replicated)[0], x)


def sharded_train() -> jaxaot.Manifest:
    """The train step over data sharded on 8 devices, parameters replicated."""
    data, replicated = _mesh()
    x = jax.ShapeDtypeStruct((16, WIDTH), jnp.float32, sharding=data)
    return jaxaot.manifest().add(train_step, _params(2, sharding=replicated), x, x)


@jaxaot.jit
def evaluate(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    return _loss(params, x, y)


def sharded_explicit() -> jaxaot.Manifest:
    """On an Explicit mesh, with no mesh set: a component, and a ``jaxaot.jit``
    program in which the components' results meet its inputs (their types'
    meshes must agree)."""
    data, replicated = _mesh(explicit=True)
    x = jax.ShapeDtypeStruct((16, WIDTH), jnp.float32, sharding=data)
    return (
        jaxaot.manifest()
        .add(layer, _params(1, sharding=replicated)[0], x)
        .add(evaluate, _params(2, sharding=replicated), x, x)
    )


def explicit_in_set_mesh() -> jaxaot.Manifest:
    """Built inside ``jax.set_mesh`` (the deployment calls inside it too), its
    parameters' ShapeDtypeStructs over the abstract mesh (as ``jax.eval_shape``
    gives them there): precompiled inside the same mesh, on its devices."""
    data, _ = _mesh(explicit=True)
    mesh = data.mesh
    x = jax.ShapeDtypeStruct((16, WIDTH), jnp.float32, sharding=data)
    with jax.set_mesh(mesh):
        abstract = NamedSharding(mesh.abstract_mesh, PartitionSpec())
        return jaxaot.manifest().add(evaluate, _params(2, sharding=abstract), x, x)


def explicit_train_in_set_mesh() -> jaxaot.Manifest:
    """The train step on an Explicit mesh, built inside ``jax.set_mesh``: its
    backward pass contracts the sharded batch, which traces only there."""
    data, replicated = _mesh(explicit=True)
    x = jax.ShapeDtypeStruct((16, WIDTH), jnp.float32, sharding=data)
    with jax.set_mesh(data.mesh):
        return jaxaot.manifest().add(train_step, _params(2, sharding=replicated), x, x)


# -- a worker killed while it holds a signature -----------------------------------------


@jaxaot.component
def fragile(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    marker = os.environ.get("PRECOMPILE_KILL_MARKER")
    if marker:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
    return jnp.sin(x @ p["w"]) + p["b"]


killed = jaxaot.manifest()
for _n in (2, 3, 4, 5, 6, 7):
    killed.add(layer if _n % 2 else fragile, _params(1)[0], _sds(_n, WIDTH))


# -- a run stopped while its workers are busy ---------------------------------------


@jaxaot.component
def stalling(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    marker = os.environ.get("PRECOMPILE_STALL_MARKER")
    if marker:
        with open(marker, "a"):
            pass
        time.sleep(60)
    return jnp.cos(x @ p["w"]) + p["b"]


stalled = jaxaot.manifest()
for _n in (2, 3, 4, 5):
    stalled.add(stalling, _params(1)[0], _sds(_n, WIDTH))


# -- a TPU topology (``--target tpu:v5e:2x2``), or this process's devices ----------


def topology() -> jaxaot.Manifest:
    """Signatures over the compile target's first 4 devices (``jaxaot.target_devices()``:
    a TPU topology's under ``--target``, this process's otherwise), and one unsharded."""
    mesh = Mesh(np.array(jaxaot.target_devices()[:4]), ("d",))
    rows, replicated = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())
    return (
        jaxaot.manifest()
        .add(
            layer,
            _params(1, sharding=replicated)[0],
            jax.ShapeDtypeStruct((8, WIDTH), jnp.float32, sharding=rows),
        )
        .add(head, _sds(4, WIDTH), mode="sum")
    )
