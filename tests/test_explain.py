"""Explaining misses (``jaxaot._store._explain``): no side effects on any entry, one
explanation per miss, and what changed in words."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxaot
from jaxaot import cli
from jaxaot._caches import Indexing
from jaxaot._caches._protocol import INDEX_ITEMS
from jaxaot._keys._key import ComponentKey
from jaxaot._store import _explain


@pytest.fixture
def explaining(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Any:
    monkeypatch.setenv("JAXAOT_EXPLAIN_MISSES", "1")
    caplog.set_level(logging.WARNING, logger="jaxaot")
    caplog.clear()
    return caplog


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def misses_of(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [m for m in warnings_of(caplog) if f"component {name!r} missed" in m]


def _ls(capsys: pytest.CaptureFixture[str], root: Path) -> dict[str, Any]:
    code = cli.main(["cache", "ls", "--json", "--dir", str(root)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return {r["digest"]: r for r in json.loads(out)}


_WRITER = textwrap.dedent(
    """
    import jax.numpy as jnp, jaxaot

    def other(x):
        return jnp.cos(x) * 3

    def explained(x, params):
        return jnp.tanh(x) * params["w"]

    with jaxaot.using_cache(jaxaot.DirectoryCache({root!r})):
        for n in (2, 3, 4):
            jaxaot.component(other)(jnp.ones(n))
        jaxaot.component(explained)(jnp.ones(3), {{"w": jnp.ones(3)}})
        jaxaot.wait_for_writes()
    """
)


def test_explaining_a_miss_leaves_every_directory_entry_as_cache_ls_sees_it(
    tmp_path: Path,
    subprocess_env: dict[str, str],
    explaining: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "shared"
    subprocess.run(
        [sys.executable, "-c", _WRITER.format(root=str(root))],
        env=subprocess_env,
        check=True,
        timeout=300,
    )
    before = _ls(capsys, root)
    assert len(before) >= 8  # root entries and executables of two components
    assert all(r["hits"] == 0 for r in before.values())

    def explained(x: jax.Array, params: dict[str, jax.Array]) -> jax.Array:
        return jnp.tanh(x) * params["w"]

    with jaxaot.using_cache(jaxaot.DirectoryCache(root)):
        explaining.clear()
        jaxaot.component(explained)(jnp.ones(3), {"w": jnp.ones(3, jnp.float16)})
        jaxaot.wait_for_writes()
    after = _ls(capsys, root)
    assert {k: after[k] for k in before} == before  # hits and last use as they were
    assert len(after) > len(before)
    (message,) = misses_of(explaining, "explained")
    # Explained against the other process's entry, by the argument's path.
    assert "argument params['w']: float32[3] → float16[3]" in message, message
    assert "argument x:" not in message


def test_explaining_a_miss_counts_no_memory_cache_hit(
    fresh_cache: jaxaot.MemoryCache, explaining: pytest.LogCaptureFixture
) -> None:
    def mem_a(x: jax.Array) -> jax.Array:
        return jnp.sin(x) + 1

    def mem_b(x: jax.Array) -> jax.Array:
        return jnp.sin(x) + 2

    for n in (2, 3):
        jaxaot.component(mem_a)(jnp.ones(n))
        jaxaot.component(mem_b)(jnp.ones(n))
    jaxaot.wait_for_writes()
    order = fresh_cache.keys()  # least recently used first
    hits = {k: fresh_cache.hit_count(k) for k in order}
    served = fresh_cache.stats()["hits"]
    explaining.clear()
    jaxaot.component(mem_a)(jnp.ones(4))
    jaxaot.wait_for_writes()
    assert {k: fresh_cache.hit_count(k) for k in order} == hits
    assert fresh_cache.stats()["hits"] == served
    assert fresh_cache.keys()[: len(order)] == order
    (message,) = misses_of(explaining, "mem_a")
    assert "argument x: float32[" in message and "→ float32[4]" in message, message


def test_one_warning_per_miss(
    fresh_cache: jaxaot.MemoryCache, explaining: pytest.LogCaptureFixture
) -> None:
    def once(x: jax.Array) -> jax.Array:
        return x * 2

    comp = jaxaot.component(once)
    comp(jnp.ones(3))  # misses its executable and, compiling it, its root entry
    assert len(misses_of(explaining, "once")) == 1
    explaining.clear()
    comp(jnp.ones(4))
    assert len(misses_of(explaining, "once")) == 1
    explaining.clear()
    jax.jit(comp)(jnp.ones(5))  # a root entry alone
    (message,) = misses_of(explaining, "once")
    assert "argument x: float32[4] → float32[5]" in message, message
    explaining.clear()
    comp(jnp.ones(5))  # its root entry is held: its executable's miss
    assert len(misses_of(explaining, "once")) == 1


def test_static_value_old_to_new(
    fresh_cache: jaxaot.MemoryCache, explaining: pytest.LogCaptureFixture
) -> None:
    def scaled(x: jax.Array, mode: str) -> jax.Array:
        return x * (2 if mode == "double" else 3)

    comp = jaxaot.component(scaled, static_argnames="mode")
    comp(jnp.ones(3), mode="double")
    explaining.clear()
    comp(jnp.ones(3), mode="triple")
    (message,) = misses_of(explaining, "scaled")
    assert "static argument 'mode' (static): 'double' → 'triple'" in message, message


def test_changed_constant_is_named_old_to_new(
    fresh_cache: jaxaot.MemoryCache, explaining: pytest.LogCaptureFixture
) -> None:
    def make(table: np.ndarray) -> Any:
        def const_fn(x: jax.Array) -> jax.Array:
            return jnp.tanh(x) * table

        return jaxaot.component(const_fn)

    make(np.array([1.0, 2.0, 3.0], np.float32))(jnp.ones(3))
    explaining.clear()
    make(np.array([1.0, 2.0, 4.0], np.float32))(jnp.ones(3))
    (message,) = misses_of(explaining, "const_fn")
    assert "constant #0 f32[3]: [1. 2. 3.] → [1. 2. 4.]" in message, message
    assert "program" not in message.split("differs in:")[1]


def test_changed_literal_and_equation_are_named(
    fresh_cache: jaxaot.MemoryCache, explaining: pytest.LogCaptureFixture
) -> None:
    def lit_fn(x: jax.Array) -> jax.Array:
        return jnp.tanh(x) * 2.0

    jaxaot.component(lit_fn)(jnp.ones(3))

    def lit_fn(x: jax.Array) -> jax.Array:  # type: ignore[no-redef]
        return jnp.tanh(x) * 3.0

    explaining.clear()
    jaxaot.component(lit_fn)(jnp.ones(3))
    (message,) = misses_of(explaining, "lit_fn")
    assert "program: equation 1 (mul): constant 2. → 3." in message, message

    def lit_fn(x: jax.Array) -> jax.Array:  # type: ignore[no-redef]
        return jnp.sin(x) * 3.0

    explaining.clear()
    jaxaot.component(lit_fn)(jnp.ones(3))
    (message,) = misses_of(explaining, "lit_fn")
    assert "program: equation 0: tanh → sin" in message, message


_FLAGGED = textwrap.dedent(
    """
    import logging
    import jax.numpy as jnp, jaxaot

    logging.basicConfig()

    def flagged(x):
        return x - 1

    with jaxaot.using_cache(jaxaot.DirectoryCache({root!r})):
        jaxaot.component(flagged)(jnp.ones(3))
        jaxaot.wait_for_writes()
    """
)


def test_xla_flag_named_in_words(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    if "--xla_cpu_enable_fast_math" in subprocess_env.get("XLA_FLAGS", ""):
        pytest.skip("the flag is set already")
    root = str(tmp_path / "flags")
    code = _FLAGGED.format(root=root)
    subprocess.run([sys.executable, "-c", code], env=subprocess_env, check=True, timeout=300)
    env = dict(subprocess_env, JAXAOT_EXPLAIN_MISSES="1")
    flag = "--xla_cpu_enable_fast_math=false"  # one that can change the code
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    child = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    messages = [line for line in child.stderr.splitlines() if "'flagged' missed" in line]
    # The root entry hits; the executable misses, once, for the flag.
    assert len(messages) == 1, child.stderr
    assert "XLA_FLAGS flag --xla_cpu_enable_fast_math: <absent> → false" in messages[0], messages


def test_jax_version_named_in_words(
    fresh_cache: jaxaot.MemoryCache,
    explaining: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def versioned(x: jax.Array) -> jax.Array:
        return x / 2

    jaxaot.component(versioned)(jnp.ones(3))
    real = jax.__version__
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    explaining.clear()
    jaxaot.component(versioned)(jnp.ones(3))
    (message,) = misses_of(explaining, "versioned")
    assert f"JAX version (jax): {real} → 0.0.1" in message, message


def test_no_candidates_without_notes(
    fresh_cache: jaxaot.MemoryCache, explaining: pytest.LogCaptureFixture
) -> None:
    def lonely_fn(x: jax.Array) -> jax.Array:
        return x + 41

    jaxaot.component(lonely_fn)(jnp.ones(3))
    (message,) = misses_of(explaining, "lonely_fn")
    assert "no other entry of its component and kind" in message


# -- the notes backends keep (``_caches.Indexing``) ------------------------------------


def _key(i: int) -> str:
    return f"{i:064x}"


@pytest.fixture
def redis_cache() -> Iterator[Any]:
    from test_redis import RedisServer

    server = RedisServer()
    server.start()
    try:
        yield jaxaot.RedisCache(server.url)
    finally:
        server.close()


@pytest.mark.parametrize("backend", ["memory", "directory", "tiered", "redis"])
def test_notes_are_bounded_of_held_entries_and_no_use(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cache: Any
    if backend == "memory":
        cache = jaxaot.MemoryCache()
    elif backend == "directory":
        cache = jaxaot.DirectoryCache(tmp_path / "d")
    elif backend == "tiered":
        cache = jaxaot.TieredCache(jaxaot.MemoryCache(), jaxaot.DirectoryCache(tmp_path / "t"))
    else:
        cache = request.getfixturevalue("redis_cache")
    assert isinstance(cache, Indexing)
    tag = "ab" * 32
    for i in range(3 * INDEX_ITEMS):
        cache.put(_key(i), b"entry")
        cache.note(tag, _key(i), b"note %d" % i)
    cache.note(tag, _key(3 * INDEX_ITEMS - 1), b"noted again")  # kept as it was
    cache.note(tag, _key(10**6), b"an entry never written")
    cache.delete(_key(3 * INDEX_ITEMS - 2))
    notes = cache.notes(tag)
    assert len(notes) <= INDEX_ITEMS
    assert notes[0] == (_key(3 * INDEX_ITEMS - 1), b"note %d" % (3 * INDEX_ITEMS - 1))
    assert notes[1][0] == _key(3 * INDEX_ITEMS - 3)  # deleted and unwritten ones left out
    assert sorted(cache.keys()) == sorted(_key(i) for i in range(3 * INDEX_ITEMS - 2)) + [
        _key(3 * INDEX_ITEMS - 1)
    ]
    if backend in ("memory", "directory"):
        assert all(cache.hit_count(k) == 0 for k in cache.keys())
    assert cache.stats()["entries"] == 3 * INDEX_ITEMS - 1  # notes are no entries
    assert cache.stats().get("hits", 0) == 0
    assert cache.notes("cd" * 32) == []


def test_an_explanation_reads_no_entry(
    fresh_cache: jaxaot.MemoryCache,
    explaining: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def read_fn(x: jax.Array) -> jax.Array:
        return x * 5

    jaxaot.component(read_fn)(jnp.ones(2))
    reads: list[str] = []
    real_get = fresh_cache.get

    def get(key: str) -> bytes | None:
        reads.append(key)
        return real_get(key)

    monkeypatch.setattr(fresh_cache, "get", get)
    known = set(fresh_cache.keys())
    comp = jaxaot.component(read_fn)
    key = comp.cache_key(jnp.ones(3))
    found = _explain.candidates("read_fn", key, fresh_cache)
    assert found and all(isinstance(k, ComponentKey) for k in found)
    assert reads == []
    comp(jnp.ones(3))
    assert not set(reads) & known  # only the missed keys themselves were looked up


def test_glue_recompiles_are_explained(
    fresh_cache: jaxaot.MemoryCache, explaining: pytest.LogCaptureFixture
) -> None:
    @jaxaot.component
    def glued_layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w)

    def model(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = glued_layer(w, x)
        return jnp.sin(x).sum()

    run = jaxaot.jit(model, whole_program=False)
    ws = [jnp.ones((4, 4))] * 3
    np.testing.assert_allclose(run(ws, jnp.ones((2, 4))), jax.jit(model)(ws, jnp.ones((2, 4))))
    explaining.clear()
    np.testing.assert_allclose(run(ws, jnp.ones((3, 4))), jax.jit(model)(ws, jnp.ones((3, 4))))
    glue = [m for m in warnings_of(explaining) if "jaxaot.jit model's glue program missed" in m]
    assert glue, warnings_of(explaining)
    assert any("float32[2,4] → float32[3,4]" in m for m in glue), glue
    layer = misses_of(explaining, "glued_layer")
    assert len(layer) == 1 and "argument x: float32[2,4] → float32[3,4]" in layer[0], layer
    # The whole-program form, and a program served whole, are named as such.
    for run, kind in [
        (jaxaot.jit(model), "whole program"),
        (jaxaot.jit(jnp.sin), "program (served whole)"),
    ]:
        args = (ws, jnp.ones((5, 4))) if kind == "whole program" else (jnp.ones(7),)
        explaining.clear()
        run(*args)
        name = run.__name__
        said = [m for m in warnings_of(explaining) if f"jaxaot.jit {name}'s {kind} missed" in m]
        assert said, warnings_of(explaining)
    # The whole program's inputs are named by their paths in the call, as a
    # component's are (not by their flat positions).
    explaining.clear()
    jaxaot.jit(model)(ws, jnp.ones((6, 4)))
    whole = [m for m in warnings_of(explaining) if "model's whole program missed" in m]
    assert len(whole) == 1 and "argument x: float32[5,4] → float32[6,4]" in whole[0], whole
    assert "args[" not in whole[0] and "xs[" not in whole[0], whole


def test_a_python_scalar_where_an_array_was_is_said_in_words(
    fresh_cache: jaxaot.MemoryCache, explaining: pytest.LogCaptureFixture
) -> None:
    """A call that passes a Python scalar where an earlier call passed an array
    misses on the weak type alone: the explanation says so in words, by the
    argument's path, for a component and for the whole program alike."""

    @jaxaot.component
    def scaled(x: jax.Array, t: jax.Array) -> jax.Array:
        return jnp.sin(x) * t

    def step(params: dict[str, jax.Array], t: jax.Array) -> jax.Array:
        x = params["x"]
        for _ in range(3):
            x = scaled(x, t)
        return x

    run = jaxaot.jit(step)
    params = {"x": jnp.ones(3)}
    run(params, jnp.float32(2.0))
    explaining.clear()
    np.testing.assert_allclose(run(params, 2.0), jax.jit(step)(params, 2.0))
    said = warnings_of(explaining)
    words = "float32[] → float32[] weakly typed (a Python scalar where the entry had an array)"
    assert any("component 'scaled' missed" in m and f"argument t: {words}" in m for m in said)
    whole = [m for m in said if "step's whole program missed" in m]
    assert len(whole) == 1 and f"argument t: {words}" in whole[0], said


def test_a_program_miss_is_compared_with_its_own_functions_programs(
    fresh_cache: jaxaot.MemoryCache, explaining: pytest.LogCaptureFixture
) -> None:
    """Two functions served whole: a miss of one is explained from its own earlier
    signature, never from the other function's program (it was: the closest entry
    of any program of the kind), and the words say "program's content" once."""

    def first(x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 2

    def second(x: jax.Array) -> jax.Array:
        return jnp.cos(x) + 1

    f, g = jaxaot.jit(first), jaxaot.jit(second)
    f(jnp.ones(3))
    g(jnp.ones((4, 5)))
    explaining.clear()
    np.testing.assert_allclose(f(jnp.ones(7)), jax.jit(first)(jnp.ones(7)))
    said = [m for m in warnings_of(explaining) if "jaxaot.jit first's program" in m]
    assert len(said) == 1, warnings_of(explaining)
    assert "float32[3] → float32[7]" in said[0], said
    assert "float32[4,5]" not in said[0] and "program program" not in said[0], said


def test_jax_explain_cache_misses_names_what_changed_in_the_users_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With ``jax_explain_cache_misses``, a call of ``jaxaot.jit`` traced again
    says which static value or argument type changed; JAX's own explanation of
    jaxaot's traces ("never seen function", located in jaxaot) is not given."""
    f = jaxaot.jit(lambda x, lr: x * lr, static_argnums=(1,))
    jax.config.update("jax_explain_cache_misses", True)
    try:
        with caplog.at_level(logging.WARNING):
            f(jnp.ones(3), 0.1)
            f(jnp.ones(3), 0.2)
            f(jnp.ones(4), 0.2)
            # The same type placed otherwise (sharded over a mesh): said by placement.
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
            f(jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, P("d"))), 0.2)
    finally:
        jax.config.update("jax_explain_cache_misses", False)
    said = [r.getMessage() for r in caplog.records]
    ours = [m for m in said if "planned again" in m]
    assert len(ours) == 3, said
    assert "static argument 'lr': 0.1 → 0.2" in ours[0], ours
    assert "x: float32[3] → float32[4]" in ours[1], ours
    assert "x: float32[4] on " in ours[2], ours
    assert "→ float32[4] sharded P('d',) over the mesh {'d': 1})" in ours[2], ours
    assert not [m for m in said if "never seen" in m], said


def test_a_signature_traced_again_says_how_it_was_passed_and_its_weak_type(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Traced again for an argument passed by position where it was passed by
    keyword (a static one too), or for a weakly typed array where the last call
    passed a strongly typed one of the same shape: each is said in those words,
    not as a change of "the mesh or JAX's configuration" or as ``int32[] →
    int32[]``."""
    f = jaxaot.jit(lambda x, n: x * n, static_argnames="n")
    g = jaxaot.jit(lambda x, y: x + y)
    h = jaxaot.jit(lambda x, p: x * p)
    x = jnp.ones(4)
    jax.config.update("jax_explain_cache_misses", True)
    try:
        with caplog.at_level(logging.WARNING):
            f(x, n=2)
            f(x, 2)
            g(x, y=x)
            g(x, x)
            h(x, jnp.int32(5))
            h(x, jnp.array(5))
    finally:
        jax.config.update("jax_explain_cache_misses", False)
    ours = [r.getMessage() for r in caplog.records if "planned again" in r.getMessage()]
    assert len(ours) == 3, ours
    assert ours[0].endswith("(n: by keyword → by position)"), ours
    assert ours[1].endswith("(y: by keyword → by position)"), ours
    assert ours[2].endswith("(p: int32[] → int32[] weakly typed)"), ours
