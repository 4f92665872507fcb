"""Executables loaded while their program is traced (``_store._prefetch``): a warm
process loads a signature's executables ahead, on the loader thread, and takes
only those stored under the very keys its trace computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot
from jaxaot._store import _entry, _prefetch

# A train step of component layers under jaxaot.jit, and a component called at the
# top level; ``STEP_VARIANT=edited`` changes the layer's code (the same names and
# signatures): the executables noted for it are then another program's.
STEP = textwrap.dedent(
    """
    import json, os, sys
    import jax, jax.numpy as jnp, numpy as np, jaxaot
    from jaxaot._store import _executables, _prefetch

    # Who deserialized which executable: the lookups themselves, or the loader.
    counts = {"lookup": 0, "ahead": 0}
    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapped
    _executables.deserialize_executable = counting("lookup", _executables.deserialize_executable)
    _prefetch.deserialize_executable = counting("ahead", _prefetch.deserialize_executable)

    EDITED = os.environ.get("STEP_VARIANT") == "edited"
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, s, **k: compiles.append(e)
        if e == "/jax/core/compile/backend_compile_duration" else None
    )

    def layer(w, x):
        return jnp.sin(x @ w) if EDITED else jnp.tanh(x @ w)

    block = jaxaot.component(layer)

    def loss(params, x, lay):
        for w in params:
            x = lay(w, x)
        return jnp.mean(x ** 2)

    step = jaxaot.jit(jax.value_and_grad(lambda p, x: loss(p, x, block)))
    top = jaxaot.component(lambda w, x: jnp.cos(x @ w) if EDITED else jnp.exp(-(x @ w) ** 2))

    rng = np.random.default_rng(0)
    f32 = lambda *shape, s=1.0: jax.device_put((rng.standard_normal(shape) * s).astype(np.float32))
    params = [f32(16, 16, s=0.25) for _ in range(6)]
    x = f32(8, 16)
    value, grads = step(params, x)
    out = top(params[0], x)
    jax.block_until_ready((value, grads, out))
    n = len(compiles)
    want_value, want_grads = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, layer)))(params, x)
    want_out = jax.jit(top.__wrapped__)(params[0], x)
    for _, loading in list(_prefetch._ready.values()):
        loading.result()  # (the loader's count complete)
    stats = jaxaot.stats()
    print(json.dumps({
        "compiles": n, "deserialized": counts, "prefetched": stats["prefetched"],
        "value": float(value), "grads": [np.asarray(g).tolist() for g in grads],
        "out": np.asarray(out).tolist(),
        "equal": bool(np.allclose(value, want_value, rtol=1e-5)
            and all(np.allclose(g, h, rtol=1e-5, atol=1e-6) for g, h in zip(grads, want_grads))
            and np.allclose(out, want_out, rtol=1e-5, atol=1e-6)),
    }))
    """
)


def _python(script: Path, code: str, env: dict[str, str]) -> str:
    """The last line ``code``, written to ``script`` and run in a fresh process, printed."""
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _run(tmp_path: Path, env: dict[str, str], variant: str = "") -> dict[str, Any]:
    return dict(json.loads(_python(tmp_path / "step.py", STEP, dict(env, STEP_VARIANT=variant))))


def test_a_warm_process_loads_every_executable_ahead_and_only_the_right_ones(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    cold = _run(tmp_path, subprocess_env)
    assert cold["equal"] and cold["compiles"] > 0
    assert cold["prefetched"] == 0 and cold["deserialized"]["ahead"] == 0

    warm = _run(tmp_path, subprocess_env)
    assert warm["equal"] and warm["compiles"] == 0, warm
    # Every executable the warm process ran was loaded on the loader thread while
    # its program was traced; none by a lookup, after the trace.
    assert warm["deserialized"]["lookup"] == 0, warm
    assert warm["prefetched"] == warm["deserialized"]["ahead"] > 0, warm
    assert warm["value"] == cold["value"] and warm["grads"] == cold["grads"]
    assert warm["out"] == cold["out"]

    # The layer's code changed, its names and signatures did not: what was noted
    # for them loads ahead, but is another program's, and none of it is taken.
    edited = _run(tmp_path, subprocess_env, "edited")
    assert edited["equal"], edited
    assert edited["compiles"] > 0 and edited["prefetched"] == 0, edited
    assert edited["deserialized"]["ahead"] > 0, edited  # (loaded, and dropped)
    assert edited["value"] != cold["value"]

    # Each program's executables are noted under the same tags: a restart of the
    # edited one loads its own ahead.
    again = _run(tmp_path, subprocess_env, "edited")
    assert again["compiles"] == 0 and again["deserialized"]["lookup"] == 0, again
    assert again["prefetched"] > 0 and again["value"] == edited["value"]


# -- the module's parts, in this process --------------------------------------------


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch) -> jaxaot.MemoryCache:
    # As in a new process: nothing looked up or loading yet.
    monkeypatch.setattr(_prefetch, "_looked_up", set())
    monkeypatch.setattr(_prefetch, "_ready", type(_prefetch._ready)())
    return jaxaot.MemoryCache()


def _stored_executables(cache: jaxaot.MemoryCache) -> list[_entry.Entry]:
    entries = [_entry.decode(b) for k in cache.keys() if (b := cache.get(k)) is not None]
    return [e for e in entries if e.executable is not None]


def _fill(cache: jaxaot.MemoryCache) -> list[_entry.Entry]:
    @jaxaot.component
    def f(x: jax.Array) -> jax.Array:
        return jnp.tanh(x) * 2

    @jaxaot.component
    def g(x: jax.Array) -> jax.Array:
        return jnp.sin(x) + 1

    with jaxaot.using_cache(cache):
        f(jnp.ones(3))
        g(jnp.ones(3))
    jaxaot.wait_for_writes()  # (executables are written in the background)
    _prefetch._looked_up.clear()  # (as in the next process)
    return _stored_executables(cache)


def _loaded_ahead(cache: jaxaot.MemoryCache, digest: str) -> None:
    _prefetch._looked_up.discard(digest)  # (as in a process that has not looked it up)
    _prefetch._start(cache, digest)


def test_an_executable_is_taken_only_under_the_key_it_was_stored_under(
    cache: jaxaot.MemoryCache,
) -> None:
    a, b = _fill(cache)
    # b's bytes planted under a's digest: loaded ahead, never taken for a's key.
    cache.put(a.key.digest, cache.get(b.key.digest) or b"")
    _loaded_ahead(cache, a.key.digest)
    assert _prefetch.take(cache, a.key) is None
    # Loaded ahead from one cache, it is not taken for a lookup in another.
    _loaded_ahead(cache, b.key.digest)
    assert _prefetch.take(jaxaot.MemoryCache(), b.key) is None
    _loaded_ahead(cache, b.key.digest)
    before = jaxaot.stats()["prefetched"]
    taken = _prefetch.take(cache, b.key)
    assert taken is not None and taken[0].key == b.key
    assert jaxaot.stats()["prefetched"] == before + 1
    np.testing.assert_allclose(taken[1](jnp.ones(3)), np.sin(np.ones(3)) + 1, rtol=1e-6)
    # Taken once: a second lookup reads it as any lookup does, and a signature
    # that shares it does not load it again.
    assert _prefetch.take(cache, b.key) is None
    _prefetch._start(cache, b.key.digest)
    assert b.key.digest not in _prefetch._ready


def test_notes_name_the_executables_a_signature_used_in_the_order_used(
    cache: jaxaot.MemoryCache,
) -> None:
    a, b = _fill(cache)
    keys = {a.key.digest: a.key, b.key.digest: b.key}
    with _prefetch.ahead(cache, "fn", lambda: "sig", lambda: "cpu"):
        for digest in keys:
            _prefetch.noted(lambda d=digest: keys[d])
    jaxaot.wait_for_writes()  # (notes are written by the writer thread)
    t = _prefetch.tag("fn", "sig", "cpu")
    assert [d for d, _ in cache.notes(t)] == list(keys)[::-1]  # (most recent first)
    assert _prefetch._in_order(cache.notes(t)) == list(keys)  # (loaded as used)
    # A later process that used another executable first: its own come first, in
    # its order, then the earlier process's.
    later = [("c" * 64, b"later:2"), ("d" * 64, b"later:1"), *cache.notes(t)]
    assert _prefetch._in_order(later) == ["d" * 64, "c" * 64, *keys]
    # Another signature, function or platform has notes of its own.
    for other in (("fn", "other", "cpu"), ("other", "sig", "cpu"), ("fn", "sig", "tpu")):
        assert cache.notes(_prefetch.tag(*other)) == []
    # Outside a signature's first lookup nothing is noted (the key is not built).
    _prefetch.noted(lambda: pytest.fail("key built outside a first lookup"))


def test_a_signature_that_cannot_be_named_or_a_cache_without_notes_loads_nothing_ahead(
    cache: jaxaot.MemoryCache,
) -> None:
    def unnamed() -> str:
        raise RuntimeError("a static argument whose repr fails")

    with _prefetch.ahead(cache, "fn", unnamed, lambda: "cpu"):
        _prefetch.noted(lambda: pytest.fail("noted for a signature without a tag"))

    class Plain:  # a cache of the user's: get and put, no notes
        def get(self, key: str) -> bytes | None:
            return None

    with _prefetch.ahead(Plain(), "fn", lambda: "sig", lambda: "cpu"):  # type: ignore[arg-type]
        _prefetch.noted(lambda: pytest.fail("noted in a cache without notes"))


def test_under_a_compile_target_nothing_is_loaded_ahead_or_noted(
    cache: jaxaot.MemoryCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jaxaot precompile --target tpu:...`` makes executables for devices this
    machine lacks: none is loaded here, and none is noted."""
    a, _ = _fill(cache)
    with _prefetch.ahead(cache, "fn", lambda: "sig", lambda: "cpu"):
        _prefetch.noted(a.key)
    jaxaot.wait_for_writes()
    assert [d for d, _ in cache.notes(_prefetch.tag("fn", "sig", "cpu"))] == [a.key.digest]
    monkeypatch.setattr(_prefetch, "active_target", lambda: object())
    monkeypatch.setattr(_prefetch, "_start", lambda *a: pytest.fail("loaded under a target"))
    with _prefetch.ahead(cache, "fn", lambda: "sig", lambda: "cpu"):
        _prefetch.noted(lambda: pytest.fail("noted under a target"))


def test_a_warm_program_with_host_callbacks_calls_its_own(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """An executable with host callbacks binds them from this process's own trace
    of the program, which has not run when the loader starts: it is left to the
    lookup, after the trace, and the warm process's callbacks are its own."""
    code = textwrap.dedent(
        """
        import json
        import jax, jax.numpy as jnp, numpy as np, jaxaot
        seen = []

        def checked(x):
            jax.debug.callback(lambda v: seen.append(float(v)), x.sum())
            return x * 2

        step = jaxaot.jit(lambda x: jaxaot.component(checked)(jnp.sin(x)) + 1)
        out = step(jnp.arange(4.0))
        jax.effects_barrier()
        print(json.dumps({"out": np.asarray(out).tolist(), "seen": seen}))
        """
    )
    runs = [json.loads(_python(tmp_path / "cb.py", code, subprocess_env)) for _ in range(2)]
    want = (np.sin(np.arange(4.0)) * 2 + 1).tolist()
    for run in runs:
        np.testing.assert_allclose(run["out"], want, rtol=1e-6)
        np.testing.assert_allclose(run["seen"], [float(np.sin(np.arange(4.0)).sum())], rtol=1e-6)


def test_a_process_without_a_cache_notes_nothing(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    env = {k: v for k, v in subprocess_env.items() if not k.startswith("JAXAOT_CACHE")}
    env["JAXAOT_CACHE"] = "none"
    env["HOME"] = os.fspath(tmp_path)
    code = (
        "import jax.numpy as jnp, jaxaot\n"
        "f = jaxaot.jit(lambda x: jaxaot.component(lambda y: y * 3)(x) + 1)\n"
        "print(float(f(jnp.ones(2)).sum()), jaxaot.stats()['prefetched'])\n"
    )
    assert _python(tmp_path / "nocache.py", code, env).split() == ["8.0", "0"]
    assert not any(tmp_path.rglob("*.index"))
