"""The precompile suite's model, manifests and timing worker (issue #37).

A small transformer (pre-norm blocks: causal single-head attention and a GELU
MLP) served two ways:

* **serving**: its forward pass over buckets of batch size x sequence length;
* **decoding**: a KV-cache decode loop: prefill buckets (a prompt's logits and
  each layer's cache, padded to the maximum length) and a decode step (one token
  per sequence, each layer updating its own cache, the caches donated).

``jaxaot precompile`` imports the manifests from here by ``module:attr``
(``serving``, ``decoding``, and their ``_quick`` forms for tests), so the sizes
are chosen by the attribute's name, never by the environment. The layers are
plain functions: ``jaxaot.component`` wraps them for jaxaot's steps, and the
``jax.jit`` contenders call them as they are.

Run as a worker (``python -c "from jaxaot.cli.bench._serving import main;
main()" JSON``) it times one contender in a fresh process and prints one JSON
line: the time until every bucket has answered once (after import and
parameter set-up), what JAX compiled meanwhile; for jaxaot's decode loop, its
steady decode step against ``jax.jit``'s and whether their values are equal.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxaot

__all__ = ["SIZES", "Sizes", "decoding", "decoding_quick", "main", "serving", "serving_quick"]

Params = dict[str, Any]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclass(frozen=True)
class Sizes:
    """The model (``layers`` blocks of ``width``, a vocabulary of ``vocab``), the
    serving buckets (``batch`` x ``seq``) and the decode loop's (a batch of
    ``decode_batch``, prompts of ``prefill``, caches of ``max_len``)."""

    width: int
    layers: int
    vocab: int
    batch: tuple[int, ...]
    seq: tuple[int, ...]
    decode_batch: int
    prefill: tuple[int, ...]
    max_len: int


#: The issue's sizes, and a tiny model for tests (``--quick``).
SIZES = {
    False: Sizes(64, 4, 256, (1, 2, 4, 8), (32, 64, 128), 4, (16, 32, 64), 128),
    True: Sizes(16, 2, 32, (1, 2), (8, 16), 2, (8,), 16),
}


# -- the model -------------------------------------------------------------------------


def _norm(x: jax.Array) -> jax.Array:
    h = x - x.mean(-1, keepdims=True)
    return h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6)


def _mlp(p: Params, x: jax.Array) -> jax.Array:
    return x + jax.nn.gelu(_norm(x) @ p["w1"]) @ p["w2"]


def _attend(p: Params, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal attention over ``x`` (batch x seq x width); its keys and values too."""
    h = _norm(x)
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    s = jnp.einsum("bqw,bkw->bqk", q, k) / np.sqrt(x.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    a = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
    return x + jnp.einsum("bqk,bkw->bqw", a, v) @ p["wo"], k, v


def block(p: Params, x: jax.Array) -> jax.Array:
    """One block of the forward pass."""
    return _mlp(p, _attend(p, x)[0])


def prefill_block(p: Params, x: jax.Array, empty: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One block over a prompt; its cache (2 x batch x max_len x width: keys,
    values) is ``empty`` with the prompt's keys and values at the start."""
    x, k, v = _attend(p, x)
    cache = jax.lax.dynamic_update_slice(empty, jnp.stack([k, v]), (0, 0, 0, 0))
    return _mlp(p, x), cache


def decode_block(
    p: Params, x: jax.Array, cache: jax.Array, pos: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One block for one token per sequence at ``pos``: writes its key and value
    into its own cache and hands the cache back (updated in place when donated)."""
    h = _norm(x)
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    cache = jax.lax.dynamic_update_slice(cache, jnp.stack([k, v])[:, :, None, :], (0, 0, pos, 0))
    s = jnp.einsum("bw,btw->bt", q, cache[0]) / np.sqrt(x.shape[-1])
    s = jnp.where(jnp.arange(cache.shape[2]) <= pos, s, -1e9)
    x = x + jnp.einsum("bt,btw->bw", jax.nn.softmax(s, axis=-1), cache[1]) @ p["wo"]
    return _mlp(p, x), cache


def make_steps(
    layer: Callable[..., Any], prefill_layer: Callable[..., Any], decode_layer: Callable[..., Any]
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """The forward pass, prefill and decode step over the given layer functions."""

    def forward(params: Params, tokens: jax.Array) -> jax.Array:
        x = params["embed"][tokens]
        for p in params["blocks"]:
            x = layer(p, x)
        return x @ params["embed"].T

    def prefill(
        params: Params, tokens: jax.Array, empty: jax.Array
    ) -> tuple[jax.Array, list[jax.Array]]:
        x, caches = params["embed"][tokens], []
        for p in params["blocks"]:
            x, cache = prefill_layer(p, x, empty)
            caches.append(cache)
        return x[:, -1] @ params["embed"].T, caches

    def decode(
        params: Params, tokens: jax.Array, caches: list[jax.Array], pos: jax.Array
    ) -> tuple[jax.Array, list[jax.Array]]:
        x, new = params["embed"][tokens], []
        for p, cache in zip(params["blocks"], caches, strict=True):
            x, cache = decode_layer(p, x, cache, pos)
            new.append(cache)
        return x @ params["embed"].T, new

    return forward, prefill, decode


# jaxaot's steps: component layers under jaxaot.jit, the caches donated.
_forward, _prefill, _decode = make_steps(
    jaxaot.component(block), jaxaot.component(prefill_block), jaxaot.component(decode_block)
)
forward = jaxaot.jit(_forward)
prefill = jaxaot.jit(_prefill)
decode = jaxaot.jit(_decode, donate_argnums=(2,))


def init(sizes: Sizes, key: jax.Array) -> Params:
    w = sizes.width
    names = {"wq": w, "wk": w, "wv": w, "wo": w, "w1": w, "w2": 4 * w}
    blocks = []
    for k in jax.random.split(key, sizes.layers):
        ks = jax.random.split(k, len(names))
        shapes = {n: (fan, 4 * w if n == "w1" else w) for n, fan in names.items()}
        blocks.append(
            {
                n: jax.random.normal(kk, shapes[n]) / np.sqrt(shapes[n][0])
                for kk, n in zip(ks, names, strict=True)
            }
        )
    return {"embed": jax.random.normal(key, (sizes.vocab, w)) * 0.1, "blocks": blocks}


def _sds(shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _cache_shape(sizes: Sizes) -> tuple[int, ...]:
    return (2, sizes.decode_batch, sizes.max_len, sizes.width)


def _serving(sizes: Sizes) -> jaxaot.Manifest:
    params = jax.eval_shape(lambda: init(sizes, jax.random.key(0)))
    return jaxaot.manifest("bench-serving").buckets(
        forward, lambda b, s: (params, _sds((b, s), jnp.int32)), batch=sizes.batch, seq=sizes.seq
    )


def _decoding(sizes: Sizes) -> jaxaot.Manifest:
    params = jax.eval_shape(lambda: init(sizes, jax.random.key(0)))
    empty = _sds(_cache_shape(sizes))
    m = jaxaot.manifest("bench-decoding").buckets(
        prefill,
        lambda b, s: (params, _sds((b, s), jnp.int32), empty),
        batch=(sizes.decode_batch,),
        seq=sizes.prefill,
    )
    tokens = _sds((sizes.decode_batch,), jnp.int32)
    return m.add(decode, params, tokens, [empty] * sizes.layers, _sds((), jnp.int32))


def serving() -> jaxaot.Manifest:
    return _serving(SIZES[False])


def serving_quick() -> jaxaot.Manifest:
    return _serving(SIZES[True])


def decoding() -> jaxaot.Manifest:
    return _decoding(SIZES[False])


def decoding_quick() -> jaxaot.Manifest:
    return _decoding(SIZES[True])


# -- the worker ------------------------------------------------------------------------


def _tokens(shape: tuple[int, ...], vocab: int, seed: int) -> jax.Array:
    return jax.device_put(np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32))


def _scalar(value: int) -> jax.Array:
    # Placed, not made by jnp.int32, which compiles a conversion.
    return jax.device_put(np.int32(value))


def _load_all(path: str) -> list[Any]:
    """The load limit: read and deserialize every executable entry of the cache at
    ``path`` (as the regional suite's remat limit does), nothing else."""
    from ._measure import load_all_executables

    return load_all_executables(jaxaot.DirectoryCache(path))


def _trace_all(model: str, sizes: Sizes) -> float:
    """The trace limit: the seconds ``jax.make_jaxpr`` takes to trace the plain
    program of every bucket once, as any process that has not yet seen a
    signature must (to know what the program is) before it can look up its
    executable."""
    manifest = _serving(sizes) if model == "serving" else _decoding(sizes)
    plain = make_steps(block, prefill_block, decode_block)
    steps = {id(forward): plain[0], id(prefill): plain[1], id(decode): plain[2]}
    start = time.perf_counter()
    for item in manifest:
        jax.make_jaxpr(steps[id(item.function)])(*item.args, **item.kwargs)
    return time.perf_counter() - start


def _decode_steady(sizes: Sizes, params: Params, steps: int, rounds: int = 6) -> dict[str, Any]:
    """jaxaot's decode step against ``jax.jit``'s (both donating the caches), from the
    same prefill and over the same tokens: the median over ``rounds`` of the mean of
    ``steps`` steps (each waited for, as a decode loop waits for its next token),
    their rounds interleaved, in turn first, so that a shared machine's load drifts
    on both alike; and whether their values are equal."""
    plain_prefill, plain_decode = make_steps(block, prefill_block, decode_block)[1:]
    start = min(sizes.prefill)
    prompt = _tokens((sizes.decode_batch, start), sizes.vocab, 1)
    empty = jnp.zeros(_cache_shape(sizes))
    n = rounds * steps + 8
    toks = [_tokens((sizes.decode_batch,), sizes.vocab, 100 + i) for i in range(n)]
    positions = [_scalar(start + i % (sizes.max_len - start)) for i in range(n)]
    fns = {"jaxaot": decode, "jit": jax.jit(plain_decode, donate_argnums=(2,))}
    state = {name: jax.jit(plain_prefill)(params, prompt, empty)[1] for name in fns}
    outs: dict[str, jax.Array] = {}
    times: dict[str, list[float]] = {name: [] for name in fns}

    def step(name: str, i: int) -> None:
        outs[name], state[name] = fns[name](params, toks[i], state[name], positions[i])
        jax.block_until_ready(outs[name])

    for name in fns:  # compile, and reach each function's C++ dispatch
        for i in range(8):
            step(name, n - 8 + i)
    for r in range(rounds):
        for name in sorted(fns, reverse=bool(r % 2)):
            t0 = time.perf_counter()
            for i in range(r * steps, (r + 1) * steps):
                step(name, i)
            times[name].append((time.perf_counter() - t0) / steps)
    same = jax.tree.map(
        lambda a, b: bool(np.allclose(a, b, rtol=1e-5, atol=1e-5)),
        (outs["jaxaot"], state["jaxaot"]),
        (outs["jit"], state["jit"]),
    )
    return {
        "steady_jaxaot": statistics.median(times["jaxaot"]),
        "steady_jit": statistics.median(times["jit"]),
        "decode_equal": all(jax.tree.leaves(same)),
    }


def main() -> None:
    """Times the contender its JSON argument names; prints one JSON line."""
    job = json.loads(sys.argv[1])
    contender, sizes = job["contender"], SIZES[bool(job["quick"])]
    result: dict[str, Any] = {"contender": contender, "model": job["model"]}
    if contender == "limit":
        from ._measure import run_once

        start = time.perf_counter()
        loaded = _load_all(job["cache"])
        result["seconds"] = time.perf_counter() - start
        result["loaded"] = len(loaded)
        start = time.perf_counter()
        result["ran"] = run_once(loaded)
        result["first_run_seconds"] = time.perf_counter() - start
        result["trace_seconds"] = _trace_all(job["model"], sizes)
        print(json.dumps(result))
        return
    if contender == "jaxaot":
        jaxaot.set_cache(jaxaot.DirectoryCache(job["cache"]))
        fwd, pre, dec = forward, prefill, decode
    else:
        if contender == "pcc":
            jax.config.update("jax_compilation_cache_dir", job["cache"])
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        plain = make_steps(block, prefill_block, decode_block)
        fwd, pre = jax.jit(plain[0]), jax.jit(plain[1])
        dec = jax.jit(plain[2], donate_argnums=(2,))
    params = jax.block_until_ready(init(sizes, jax.random.key(0)))
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]
    if job["model"] == "serving":
        calls = [
            (fwd, (params, _tokens((b, s), sizes.vocab, i)))
            for i, (b, s) in enumerate((b, s) for b in sizes.batch for s in sizes.seq)
        ]
    else:
        empty = jax.device_put(np.zeros(_cache_shape(sizes), np.float32))
        position = _scalar(max(sizes.prefill))
        tokens = _tokens((sizes.decode_batch,), sizes.vocab, 99)
        calls = [
            (pre, (params, _tokens((sizes.decode_batch, s), sizes.vocab, i), empty))
            for i, s in enumerate(sizes.prefill)
        ]
    compiles: list[float] = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == COMPILE_EVENT:
            compiles.append(duration_secs)

    before = jaxaot.stats()
    jax.monitoring.register_event_duration_secs_listener(listener)
    start = time.perf_counter()
    for fn, args in calls:
        out = jax.block_until_ready(fn(*args))
    if job["model"] == "decoding":  # one decode step on the last prompt's caches
        jax.block_until_ready(dec(params, tokens, out[1], position))
    result["seconds"] = time.perf_counter() - start
    # Every bucket answered again, warm: what running them costs once they are
    # loaded (the decode step's caches were donated: prefill buckets only).
    start = time.perf_counter()
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    result["again_seconds"] = time.perf_counter() - start
    jax.monitoring.unregister_event_duration_listener(listener)
    after = jaxaot.stats()
    result["buckets"] = len(calls) + (job["model"] == "decoding")
    result["backend_compiles"] = len(compiles)
    result["jaxaot_made"] = {k: after[k] - before[k] for k in ("lowerings", "compiles")}
    if contender == "jaxaot" and job["model"] == "decoding":
        result.update(_decode_steady(sizes, params, int(job["steps"])))
    print(json.dumps(result))
