"""Subprocess worker for the fleet tests (tests/test_leases.py): one cold process
of a fleet that shares one cache.

Run as ``python tests/_fleet_worker.py JSON``. The JSON names the cache
(``{"dir": PATH}`` or ``{"redis": URL, "prefix": P}``) and optionally:

* ``"go"``: a file to wait for before the workload starts (the start barrier;
  the worker prints ``ready`` when it begins to wait);
* ``"hang"``: a file; the first time this process holds a lease it creates
  ``hang + ".holding"`` and then blocks, while still holding the lease, until
  ``hang`` exists (or for ever if it never does): a holder stuck or killed in
  the middle of making an entry.

The workload is a small ``jaxaot.jit`` train step over component layers (lowered
and derived entries, region and glue executables, the whole-program form)
and one direct call of the component (its top-level executable). The worker
checks its results against ``jax.jit``'s, waits for its background work, and
prints one JSON line: ``ok``, its pid and ``jaxaot.stats()``. jaxaot's DEBUG
log goes to stderr (the tests read "waiting for" from it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jaxaot
from jaxaot._store import _once


def open_cache(spec: dict[str, Any]) -> Any:
    if "dir" in spec:
        return jaxaot.DirectoryCache(spec["dir"])
    return jaxaot.RedisCache(spec["redis"], prefix=spec["prefix"], timeout=1.0)


def hang_in_first_lease(flag: Path) -> None:
    """Makes the first make under a lease block (the lease held and renewed) until
    ``flag`` exists."""
    original = _once._make
    hung: list[bool] = []

    def make(fn: Any, store: Any, lease: Any, ttl: float) -> Any:
        if lease is None or hung:
            return original(fn, store, lease, ttl)
        hung.append(True)

        def stuck() -> Any:
            Path(str(flag) + ".holding").touch()
            while not flag.exists():
                time.sleep(0.02)
            return fn()

        return original(stuck, store, lease, ttl)

    _once._make = make


@jaxaot.component
def layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w) + 0.5 * x


def make_step(layer_fn: Any) -> Any:
    def loss(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = layer_fn(w, x)
        return jnp.mean(x**2)

    return jax.value_and_grad(loss)


def main() -> None:
    config = json.loads(sys.argv[1])
    logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(message)s")
    logging.getLogger("jaxaot").setLevel(logging.DEBUG)
    jaxaot.set_cache(open_cache(config["cache"]))
    if config.get("hang"):
        hang_in_first_lease(Path(config["hang"]))
    ws = [jnp.full((16, 16), 0.02 * (i + 1)) + jnp.eye(16) * 0.1 for i in range(3)]
    x = jnp.linspace(-1.0, 1.0, 4 * 16).reshape(4, 16)
    if config.get("go"):
        print("ready", flush=True)
        while not os.path.exists(config["go"]):
            time.sleep(0.005)
    got = jax.block_until_ready((jaxaot.jit(make_step(layer))(ws, x), layer(ws[0], x)))
    jaxaot.wait_for_writes()
    stats = jaxaot.stats()
    plain = layer.__wrapped__
    want = (jax.jit(make_step(plain))(ws, x), jax.jit(plain)(ws[0], x))
    ok = all(
        bool(jnp.allclose(a, b, rtol=1e-5, atol=1e-6))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )
    print(json.dumps({"ok": ok, "pid": os.getpid(), **stats}), flush=True)


if __name__ == "__main__":
    main()
