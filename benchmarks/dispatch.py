"""Per-call overhead of a top-level component call against ``jax.jit``, the
cost of a first call with a warm cache (no trace) against a cold one, and the
time a ``jaxaot.jit`` split program spends outside its executables.

Run: ``python benchmarks/dispatch.py`` (prints Markdown tables);
``python benchmarks/dispatch.py --split-only --width 32 --layers 32`` for the
last table alone (``--inference`` for the forward pass, ``--blocked`` to wait
for every call before the next).
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


def split_overhead(
    width: int,
    batch: int,
    seq: int,
    layers: int,
    inference: bool,
    calls: int,
    repeats: int,
    skip_jit: bool = False,
    blocked: bool = False,
) -> dict[str, float]:
    """µs per call of a ``jaxaot.jit`` step of ``layers`` transformer blocks: its split
    program, the same executables called back to back with their inputs ready
    (what the split program cannot go below), its whole-program form and that
    form's executable called directly (what jaxaot.jit adds to it),
    ``jax.jit`` (unless ``skip_jit``: it compiles slowly), and a scan over stacked
    layers. Contenders alternate round by round; medians of the rounds. With
    ``blocked``, each call is waited for before the next (as ``jaxaot bench``
    times a steady step), so nothing overlaps from one call to the next."""
    from jaxaot._regional import _plan
    from jaxaot.cli import _model

    blocks = _model.init_blocks(jax.random.key(0), layers, width)
    x = jax.random.normal(jax.random.key(1), (batch, seq, width))

    def make(block_fn: Any) -> Any:
        def loss(bs: Any, x: jax.Array) -> jax.Array:
            for p in bs:
                x = block_fn(p, x)
            return jnp.mean(x**2)

        return loss if inference else jax.value_and_grad(loss)

    with jaxaot.using_cache(jaxaot.MemoryCache()):
        fn = jaxaot.jit(make(jaxaot.component(_model.block)))
        jax.block_until_ready(fn(blocks, x))
        (plan,) = fn._plans.values()
        while plan.pending():
            jax.block_until_ready(fn(blocks, x))
    leaves = jax.tree_util.tree_leaves(((blocks, x), {}))
    env = plan._env(leaves)
    replay = []
    for exe, get, outs, _ in plan._fast:
        ins = get(env)
        for slot, value in zip(outs, exe(*ins), strict=True):
            env[slot] = value
        replay.append((exe, ins))

    def executables() -> Any:
        out = None
        for exe, ins in replay:
            out = exe(*ins)
        return out

    def form(mode: str) -> Callable[[], Any]:
        def run() -> Any:
            plan.mode = mode
            return fn(blocks, x)

        return run

    jitted = jax.jit(make(_model.block))
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *blocks)

    def scan_loss(st: Any, x: jax.Array) -> jax.Array:
        h, _ = jax.lax.scan(lambda h, p: (_model.block(p, h), None), x, st)
        return jnp.mean(h**2)

    scanned = jax.jit(scan_loss if inference else jax.value_and_grad(scan_loss))

    def whole_alone() -> Any:
        assert plan.whole is not None
        return plan.whole.result()(*leaves, *plan.consts)

    contenders = {
        "split program": form(_plan.SPLIT),
        "its executables alone": executables,
        "whole program": form(_plan.WHOLE),
        "its executable alone": whole_alone,
        "jax.jit": lambda: jitted(blocks, x),
        "scan over stacked layers": lambda: scanned(stacked, x),
    }
    if plan.whole is None or plan.whole.exception() is not None:
        del contenders["whole program"], contenders["its executable alone"]
    if skip_jit:
        del contenders["jax.jit"]
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    for run in contenders.values():
        jax.block_until_ready(run())
    for _ in range(repeats):
        for name, run in contenders.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                out = run()
                if blocked:
                    jax.block_until_ready(out)
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
            cpu[name].append((time.process_time() - start_cpu) / calls * 1e6)
    result = {name: statistics.median(v) for name, v in samples.items()}
    result.update({f"{name} (CPU)": statistics.median(v) for name, v in cpu.items()})
    result["executables per call"] = float(len(plan.steps))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--split-only", action="store_true", help="only the split-program table")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--inference", action="store_true")
    parser.add_argument("--skip-jit", action="store_true", help="no jax.jit contender")
    parser.add_argument("--blocked", action="store_true", help="wait for each call before the next")
    args = parser.parse_args()
    r = split_overhead(
        args.width,
        args.batch,
        args.seq,
        args.layers,
        args.inference,
        20,
        args.repeats,
        skip_jit=args.skip_jit,
        blocked=args.blocked,
    )
    n = r.pop("executables per call")
    print(
        f"jax {jax.__version__}: jaxaot.jit {'forward' if args.inference else 'train'} step, "
        f"{args.layers} blocks of width {args.width}, batch {args.batch}, seq {args.seq}; "
        f"split program of {n:.0f} executables"
    )
    print("\n| contender | µs per call (wall) | µs per call (process CPU) |")
    print("|---|---|---|")
    for name, us in r.items():
        if not name.endswith("(CPU)"):
            print(f"| {name} | {us:.0f} | {r[name + ' (CPU)']:.0f} |")
    for clock in ("", " (CPU)"):
        outside = r["split program" + clock] - r["its executables alone" + clock]
        print(
            f"\ntime outside the executables{clock}: {outside:.0f} µs a call, "
            f"{outside / n:.1f} µs an executable"
        )
        if "whole program" in r:
            outside = r["whole program" + clock] - r["its executable alone" + clock]
            print(f"time outside the whole-program executable{clock}: {outside:.0f} µs a call")
    if args.split_only:
        return
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
