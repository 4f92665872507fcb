"""One transformer block's gradient, its forward and backward passes each
compiled on their own: JAX's own split (``jax.vjp`` under one ``jax.jit``, its
backward under another) against ``jaxaot.jit``'s split program of a component
block (its forward entry, then its backward entry), and ``jax.jit`` of the
whole gradient as one program for scale.

JAX's transpose of a matmul's weight gradient is ``transpose(dot_general(g, x))``;
compiled alone, XLA:CPU fuses that transpose with the elementwise producers of
``g`` and the dot misses its fast kernel. jaxaot's backward entries compute
``dot_general(x, g)`` instead, so its split should cost about what JAX's own
split's forward costs plus less than its backward.

Run: ``python benchmarks/backward.py`` (prints a Markdown table, milliseconds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxaot


def init_block(key: jax.Array, width: int) -> dict[str, jax.Array]:
    k = jax.random.split(key, 4)
    shapes = {"qkv": (width, 3 * width), "proj": (width, width)}
    shapes |= {"up": (width, 4 * width), "down": (4 * width, width)}
    pairs = zip(k, shapes.items(), strict=True)
    params = {name: jax.random.normal(k_, s) * s[0] ** -0.5 for k_, (name, s) in pairs}
    return params | {"ln1": jnp.ones(width), "ln2": jnp.ones(width)}


def block(p: dict[str, jax.Array], x: jax.Array, heads: int = 4) -> jax.Array:
    """A pre-norm transformer block: causal attention, then a GELU MLP (4x)."""
    b, s, w = x.shape

    def norm(x: jax.Array, gain: jax.Array) -> jax.Array:
        x = x - x.mean(-1, keepdims=True)
        return x * jax.lax.rsqrt((x**2).mean(-1, keepdims=True) + 1e-5) * gain

    q, k, v = jnp.split((norm(x, p["ln1"]) @ p["qkv"]).reshape(b, s, 3 * heads, -1), 3, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (w // heads) ** 0.5
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e30)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v).reshape(b, s, w)
    x = x + out @ p["proj"]
    return x + jax.nn.gelu(norm(x, p["ln2"]) @ p["up"]) @ p["down"]


def _ms(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def measure(batch: int, seq: int, width: int, repeats: int) -> dict[str, float]:
    params = init_block(jax.random.key(0), width)
    x = jax.random.normal(jax.random.key(1), (batch, seq, width), jnp.float32)
    ct = jnp.ones_like(x)

    # JAX's own split: the forward with its residuals, then the backward alone.
    forward = jax.jit(lambda p, x: jax.vjp(block, p, x))
    _, pullback = forward(params, x)
    backward = jax.jit(lambda pullback, g: pullback(g))

    def grad_of(layer: Callable[..., jax.Array]) -> Callable[..., Any]:
        return jax.grad(lambda p, x, g: jnp.sum(layer(p, x) * g), argnums=(0, 1))

    # jaxaot: the split program (no whole-program form), no cache: the block's
    # forward entry and its backward entry, each an executable of its own.
    jaxaot.set_cache(None)
    split = jaxaot.jit(grad_of(jaxaot.component(block)), whole_program=False)
    whole = jax.jit(grad_of(block))
    times = {
        "jax forward (with residuals)": _ms(lambda: forward(params, x), repeats),
        "jax backward": _ms(lambda: backward(pullback, ct), repeats),
        "jaxaot.jit split program: forward + backward entries": _ms(
            lambda: split(params, x, ct), repeats
        ),
        "jax.jit of the whole gradient (one program)": _ms(lambda: whole(params, x, ct), repeats),
    }
    times["jax forward + backward"] = times["jax forward (with residuals)"] + times["jax backward"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8,128,256", help="batch,seq,width")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    batch, seq, width = (int(v) for v in args.shape.split(","))
    times = measure(batch, seq, width, args.repeats)
    print(f"One block, batch {batch}, sequence {seq}, width {width}; milliseconds (median).\n")
    print("| executables | ms |")
    print("|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.1f} |")
    ratio = times["jaxaot.jit split program: forward + backward entries"]
    print(f"\nsplit gradient, jaxaot / jax: {ratio / times['jax forward + backward']:.2f}")


if __name__ == "__main__":
    main()
