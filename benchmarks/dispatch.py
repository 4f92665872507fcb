"""Per-call overhead of a top-level component call against ``jax.jit``, and the
cost of a first call with a warm cache (no trace) against a cold one.

Run: ``python benchmarks/dispatch.py`` (prints a Markdown table of ratios).
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


def _per_call_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def dispatch_overhead(calls: int, repeats: int) -> dict[str, float]:
    def tiny(x: jax.Array, y: jax.Array) -> jax.Array:
        return x * y + 1.0

    x = jnp.ones((4,), jnp.float32)
    y = jnp.ones((4,), jnp.float32)
    jitted = jax.jit(tiny)
    comp = jaxaot.component(tiny)
    params = {"w": x, "b": y}

    def tree_tiny(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return p["w"] * x + p["b"]

    jitted_tree = jax.jit(tree_tiny)
    comp_tree = jaxaot.component(tree_tiny)
    out = {
        "jax.jit (positional arrays)": _per_call_us(lambda: jitted(x, y), calls, repeats),
        "jaxaot (positional arrays)": _per_call_us(lambda: comp(x, y), calls, repeats),
        "jax.jit (dict of params)": _per_call_us(lambda: jitted_tree(params, x), calls, repeats),
        "jaxaot (dict of params)": _per_call_us(lambda: comp_tree(params, x), calls, repeats),
    }
    return out


def trace_skip(width: int, depth: int) -> dict[str, float]:
    """First call inside ``jax.jit`` of a cached component: cold vs entry already cached."""

    def body(x: jax.Array) -> jax.Array:
        for _ in range(depth):
            x = jnp.tanh(x @ x.T @ x) + jnp.sin(x)
        return x

    x = jnp.ones((width, width), jnp.float32)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        cold = jaxaot.component(body, key="bench-trace-skip")
        start = time.perf_counter()
        jax.jit(lambda v: cold(v)).trace(x)
        t_cold = time.perf_counter() - start
        warm = jaxaot.component(body, key="bench-trace-skip")
        start = time.perf_counter()
        jax.jit(lambda v: warm(v)).trace(x)
        t_warm = time.perf_counter() - start
        assert warm.cache_info().traces == 0
    return {"first trace, cold (ms)": t_cold * 1e3, "first trace, cached entry (ms)": t_warm * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    d = dispatch_overhead(args.calls, args.repeats)
    t = trace_skip(width=64, depth=200)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    print("\n| call | µs per call | ratio to jax.jit |")
    print("|---|---|---|")
    for name, us in d.items():
        base = (
            d["jax.jit (positional arrays)"]
            if "positional" in name
            else d["jax.jit (dict of params)"]
        )
        print(f"| {name} | {us:.2f} | {us / base:.2f}× |")
    print("\n| trace of a program calling a component | ms |")
    print("|---|---|")
    for name, ms in t.items():
        print(f"| {name} | {ms:.1f} |")
    print(
        f"\ntrace-skip ratio (cached / cold): {t['first trace, cached entry (ms)'] / t['first trace, cold (ms)']:.3f}"
    )


if __name__ == "__main__":
    main()
