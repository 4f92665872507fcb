"""Tests for jaxaot._store: one component's entries and executables, and why a
lookup missed (issue 11: misses explained against the cache, across processes)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxaot
from jaxaot import _stats
from jaxaot._keys._key import ComponentKey
from jaxaot._store._entry import Entry
from jaxaot._store._lookup import Store


def _entry(key: ComponentKey) -> Entry:
    aval = jax.core.ShapedArray((3,), jnp.float32)
    return Entry(
        key=key,
        name="s",
        in_avals=(aval,),
        out_avals=(aval,),
        out_tree=jax.tree_util.tree_structure(0),
        arg_names=("x",),
        result_paths=("result",),
    )


def test_entry_is_built_once_and_written(fresh_cache: jaxaot.MemoryCache) -> None:
    store = Store("s", _stats.Counters())
    key = ComponentKey({"component": "s", "args": ("float32[3]",), "transform": ()})
    built = []

    def build() -> Entry:
        built.append(1)
        return _entry(key)

    threads = [threading.Thread(target=store.entry, args=(key, build)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [1]
    assert key.digest in fresh_cache.keys()
    other = Store("s", _stats.Counters())
    assert other.entry(key, lambda: pytest.fail("built again")).key == key  # type: ignore[arg-type]


EXPLAIN = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np, jaxaot
    n = int(sys.argv[2])
    w = np.full((n,), float(sys.argv[1]), np.float32)

    @jaxaot.component
    def layer(x):
        return jnp.tanh(x) * w

    jax.grad(lambda x: layer(x).sum())(jnp.ones(n))
    layer(jnp.ones(n))
    """
)


def _explain_run(script: Path, env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_misses_are_explained_against_entries_other_processes_wrote(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    script = tmp_path / "explain.py"
    script.write_text(EXPLAIN)
    env = dict(subprocess_env)
    env["JAXAOT_EXPLAIN_MISSES"] = "1"
    _explain_run(script, env, "2.0", "3")
    # Another input shape: the root entry differs in its argument type only.
    shape = _explain_run(script, env, "2.0", "4")
    assert "argument x: float32[3] → float32[4]" in shape, shape
    # Another constant: the program's constant, named by its index.
    const = _explain_run(script, env, "5.0", "3")
    assert "constant #0 f32[3]: [2. 2. 2.] → [5. 5. 5.]" in const, const
    root_lines = [line for line in const.splitlines() if "missed the cache" in line]
    assert root_lines
    # Derived entries are explained against derived entries, not the root one.
    assert not any("transform" in line for line in root_lines), const
    # No "holds no other entry": every miss found its closest entry in the cache.
    assert "no other entry" not in const, const


EXPLAIN_BUCKETS = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp, jaxaot
    dtype = jnp.dtype(sys.argv[1])

    @jaxaot.component
    def layer(x, a, b, c):
        return jnp.tanh(x) * a + b - c

    for n in (3, 4, 5):  # a deployment's buckets
        layer(*(jnp.ones(n, dtype) for _ in range(4)))
    """
)


def test_each_miss_is_explained_against_entries_this_process_did_not_make(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A process that misses every bucket for one cause (other dtypes than the
    precompiled ones) is told that cause at each bucket, not, from the second
    on, how the bucket differs from the one it made just before."""
    script = tmp_path / "buckets.py"
    script.write_text(EXPLAIN_BUCKETS)
    env = dict(subprocess_env, JAXAOT_EXPLAIN_MISSES="1")
    _explain_run(script, env, "float32")
    said = [line for line in _explain_run(script, env, "bfloat16").splitlines() if "missed" in line]
    assert len(said) == 3, said
    for n, line in zip((3, 4, 5), said, strict=True):
        assert f"→ bfloat16[{n}]" in line and "argument a: float32[" in line, said


def test_explain_without_a_listing_cache_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("JAXAOT_EXPLAIN_MISSES", "1")
    caplog.set_level(logging.WARNING, logger="jaxaot")

    # A name no other test's component has: candidates are found by name, and
    # this process may hold other entries of a '<lambda>'.
    def doubled_without_a_listing(x: jax.Array) -> jax.Array:
        return x * 2

    comp = jaxaot.component(doubled_without_a_listing)
    comp(jnp.ones(2))
    messages = [r.getMessage() for r in caplog.records if "missed the cache" in r.getMessage()]
    assert messages and "no other entry" in messages[0]
    assert os.environ["JAXAOT_EXPLAIN_MISSES"] == "1"


def test_entries_this_process_cannot_check_are_a_miss_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A signed cache read by a process without the key (or with another): every
    call computes locally and matches plain JAX, the entries stay byte for byte,
    and the warning comes once for the cause, not once per entry."""
    from jaxaot._store import _entry

    def f(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w) * 2

    w, x = jnp.ones((3, 4)) * 0.1, jnp.arange(6.0).reshape(2, 3)
    root = tmp_path / "signed"
    monkeypatch.setenv(_entry.HMAC_ENV, "the cache's key")
    with jaxaot.using_cache(jaxaot.DirectoryCache(root)):
        jaxaot.component(f)(w, x)
        jax.grad(lambda w: jaxaot.component(f)(w, x).sum())(w)
        jaxaot.wait_for_writes()
    files = {
        p: p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.suffix not in (".lock", ".hits")
    }
    assert len(files) >= 3
    for secret in (None, "another key"):
        if secret is None:
            monkeypatch.delenv(_entry.HMAC_ENV)
        else:
            monkeypatch.setenv(_entry.HMAC_ENV, secret)
        caplog.clear()
        _stats.reset_warnings()
        with caplog.at_level(logging.WARNING, logger="jaxaot"):
            with jaxaot.using_cache(jaxaot.DirectoryCache(root)):
                comp = jaxaot.component(f)
                got = comp(w, x)
                grad = jax.grad(lambda w, comp=comp: comp(w, x).sum())(w)
                jaxaot.wait_for_writes()
        assert jnp.allclose(got, jax.jit(f)(w, x))
        assert jnp.allclose(grad, jax.grad(lambda w: f(w, x).sum())(w))
        unusable = [r for r in caplog.records if "cannot be used by this process" in r.message]
        assert len(unusable) <= 1, [r.message for r in unusable]
        assert not [r for r in caplog.records if "dropped a bad cache entry" in r.message]
        now = {
            p: p.read_bytes()
            for p in root.rglob("*")
            if p.is_file() and p.suffix not in (".lock", ".hits")
        }
        assert {p: b for p, b in now.items() if p in files} == files
