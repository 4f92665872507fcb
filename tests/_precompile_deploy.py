"""A deploying process for test_manifest: calls every signature of a manifest
once with arrays of its shapes, dtypes and shardings, counting what JAX traces
to MLIR and compiles meanwhile, then compares each value with ``jax.jit``'s.

Run: ``python _precompile_deploy.py module:attr``; prints one JSON line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from typing import Any

import jax
import numpy as np

import jaxaot
from jaxaot._store import _executables
from jaxaot.cli.precompile import load_manifest

# Executables deserialized by a lookup, after its trace (not loaded ahead of it).
_by_lookup: list[int] = []
_deserialize = _executables.deserialize_executable


def _counted(*args: Any, **kwargs: Any) -> Any:
    _by_lookup.append(1)
    return _deserialize(*args, **kwargs)


_executables.deserialize_executable = _counted

EVENTS = (
    "/jax/core/compile/backend_compile_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
)


def _materialize(args: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)

    def make(leaf: Any) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            value = rng.standard_normal(leaf.shape).astype(leaf.dtype)
            return jax.device_put(value, leaf.sharding) if leaf.sharding else jax.device_put(value)
        return leaf

    return jax.tree.map(make, args)


def _in_mesh(item: Any) -> Any:
    """Inside the mesh the signature was added under, as the deployment calls it."""
    return jax.set_mesh(item.mesh) if item.mesh is not None else contextlib.nullcontext()


def _call(item: Any, args: Any) -> Any:
    with _in_mesh(item):
        return jax.block_until_ready(item.function(*args, **item.kwargs))


def main() -> None:
    manifest = load_manifest(sys.argv[1])
    calls = []
    for i, item in enumerate(manifest):
        # Two equal copies: the one jaxaot gets, and the one jax.jit gets.
        calls.append((item, _materialize(item.args, i), _materialize(item.args, i)))
    jax.block_until_ready([c[1] for c in calls] + [c[2] for c in calls])
    seen: dict[str, list[str]] = {e: [] for e in EVENTS}

    def listener(event: str, seconds: float, **kwargs: Any) -> None:
        if event in seen:
            seen[event].append(str(kwargs.get("fun_name", "?")))

    before = jaxaot.stats()
    jax.monitoring.register_event_duration_secs_listener(listener)
    # DEPLOY_CALLS calls of each: a jaxaot.jit program's later calls run through
    # JAX's C++ dispatch (and must compile and load nothing either).
    for _ in range(int(os.environ.get("DEPLOY_CALLS", "1"))):
        outs = [_call(item, a) for item, a, _ in calls]
    jax.monitoring.unregister_event_duration_listener(listener)
    after = jaxaot.stats()
    equal = []
    for (item, _, b), out in zip(calls, outs, strict=True):
        plain = jax.jit(functools.partial(item.function.__wrapped__, **item.kwargs))
        with _in_mesh(item):
            want = plain(*b)
        same = jax.tree.map(
            lambda u, v: bool(u.dtype == v.dtype and np.allclose(u, v, rtol=1e-5, atol=1e-6)),
            out,
            want,
        )
        equal.append(all(jax.tree.leaves(same)))
    print(
        json.dumps(
            {
                "compiles": seen[EVENTS[0]],
                "lowerings": seen[EVENTS[1]],
                "jaxaot": {k: after[k] - before[k] for k in ("lowerings", "compiles")},
                "prefetched": after["prefetched"] - before["prefetched"],
                "by_lookup": len(_by_lookup),
                "equal": equal,
                "devices": jax.device_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
