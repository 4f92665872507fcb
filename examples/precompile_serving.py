"""Precompile a serving deployment's buckets, then serve them with nothing to compile.

The manifest (``manifest`` below) names every call the server makes: the
forward pass of a small model for each bucket of batch size × sequence length,
given as ``jax.ShapeDtypeStruct``s. Fill the cache once, before the servers
start, in parallel worker processes:

    jaxaot precompile examples/precompile_serving.py:manifest --workers 2

then start the server; its first call of every bucket loads its executables
from the cache and compiles nothing:

    python examples/precompile_serving.py

(``--cache DIR`` on both points them at a cache directory other than the
default one; ``--cache redis://host:6379/0`` at a shared store.)
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxaot

WIDTH, LAYERS, VOCAB = 64, 4, 256
BATCH, SEQ = (1, 2, 4), (32, 64)


@jaxaot.component
def block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One pre-norm residual MLP block."""
    h = x - x.mean(-1, keepdims=True)
    h = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6)
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


@jaxaot.jit
def forward(params: dict[str, object], tokens: jax.Array) -> jax.Array:
    """Logits of the next token at every position."""
    x = params["embed"][tokens]  # type: ignore[index]
    for p in params["blocks"]:  # type: ignore[attr-defined]
        x = block(p, x)
    return x @ params["embed"].T  # type: ignore[attr-defined]


def init(key: jax.Array) -> dict[str, object]:
    keys = jax.random.split(key, 2 * LAYERS + 1)
    blocks = [
        {
            "w1": jax.random.normal(keys[2 * i], (WIDTH, 4 * WIDTH)) / WIDTH**0.5,
            "w2": jax.random.normal(keys[2 * i + 1], (4 * WIDTH, WIDTH)) / (4 * WIDTH) ** 0.5,
        }
        for i in range(LAYERS)
    ]
    return {"embed": jax.random.normal(keys[-1], (VOCAB, WIDTH)) * 0.1, "blocks": blocks}


def bucket(batch: int, seq: int) -> tuple[object, jax.ShapeDtypeStruct]:
    """The arguments of one bucket's call, as shapes and dtypes."""
    params = jax.eval_shape(init, jax.random.key(0))
    return params, jax.ShapeDtypeStruct((batch, seq), jnp.int32)


#: What the server calls: one forward pass per bucket.
manifest = jaxaot.manifest("precompile_serving").buckets(forward, bucket, batch=BATCH, seq=SEQ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--cache", default=None, help="a cache directory or store URL, as jaxaot precompile's"
    )
    args = parser.parse_args()
    if args.cache:
        os.environ["JAXAOT_CACHE"] = args.cache  # read at the first call, as JAXAOT_CACHE is
    params = init(jax.random.key(0))
    requests = [jax.device_put(np.zeros((b, s), np.int32)) for b in BATCH for s in SEQ]
    # XLA compiles while the buckets are served, as JAX itself reports them.
    compiles: list[str] = []

    def listener(event: str, seconds: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(str(kwargs.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    start = time.perf_counter()
    answers = [jax.block_until_ready(forward(params, tokens)) for tokens in requests]
    served = time.perf_counter() - start
    jax.monitoring.unregister_event_duration_listener(listener)
    print(f"served {len(requests)} buckets in {served:.2f} s, {len(compiles)} compiles")
    plain = jax.jit(forward.__wrapped__)
    same = all(
        bool(jnp.allclose(answer, plain(params, tokens), atol=1e-5))
        for answer, tokens in zip(answers, requests, strict=True)
    )
    print(f"same values as jax.jit: {same}")


if __name__ == "__main__":
    # Serve with this file's functions as the module `precompile_serving` (the name
    # `jaxaot precompile` gave them): run as a script, they would be `__main__.forward`
    # and `__main__.block`, other functions with other keys.
    import precompile_serving

    precompile_serving.main()
