"""Components with a persistent DirectoryCache: fresh processes, corruption,
planted files, faults and hostile keys."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import cold_and_warm

import jaxaot
from jaxaot._store import _entry

COMPONENTS = textwrap.dedent(
    """
    import os
    import jax, jax.numpy as jnp, jaxaot

    def _guard():
        if os.environ.get("JAXAOT_TEST_RAISE") == "1":
            raise RuntimeError("body traced in the warm process")

    @jaxaot.component(key="persist-block")
    def block(x, w):
        _guard()
        return jnp.tanh(x @ w)

    @jaxaot.component(key="persist-loss")
    def loss(params, x):
        _guard()
        return jnp.mean(block(x, params["w"]) ** 2) + jnp.sum(params["b"])

    def run():
        x = jnp.arange(12.0).reshape(3, 4) / 10
        w = jnp.ones((4, 2)) / 3
        params = {"w": w, "b": jnp.ones(2)}
        top = block(x, w)
        jitted = jax.jit(lambda x: block(x, w) * 2)(x)
        batched = jax.vmap(block, in_axes=(0, None))(x[:, None, :], w)
        grads = jax.grad(loss)(params, x)
        value = jax.jit(loss)(params, x)
        return {
            "top": top.tolist(), "jit": jitted.tolist(), "vmap": batched.tolist(),
            "grad_w": grads["w"].tolist(), "grad_b": grads["b"].tolist(), "loss": float(value),
            "traces": block.cache_info().traces + loss.cache_info().traces,
        }
    """
)

RUN = "import json, comps; print(json.dumps(comps.run()))"


def _run_in_fresh_process(
    tmp_path: Path, env: dict[str, str], raise_if_traced: bool
) -> dict[str, Any]:
    env = dict(env)
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    env["JAXAOT_TEST_RAISE"] = "1" if raise_if_traced else "0"
    proc = subprocess.run(
        [sys.executable, "-c", RUN], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_fresh_process_with_warm_cache_traces_nothing(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    (tmp_path / "comps.py").write_text(COMPONENTS)
    cold = _run_in_fresh_process(tmp_path, subprocess_env, raise_if_traced=False)
    assert cold["traces"] >= 2
    cache_dir = Path(subprocess_env["JAXAOT_CACHE_DIR"])
    assert any(cache_dir.rglob("*"))
    warm = _run_in_fresh_process(tmp_path, subprocess_env, raise_if_traced=True)
    assert warm["traces"] == 0
    for name in ("top", "jit", "vmap", "grad_w", "grad_b", "loss"):
        np.testing.assert_allclose(warm[name], cold[name], rtol=1e-6)
    x = np.arange(12.0).reshape(3, 4) / 10
    np.testing.assert_allclose(cold["top"], np.tanh(x @ (np.ones((4, 2)) / 3)), rtol=1e-5)


_CUSTOM_VJP_RUN = textwrap.dedent(
    """
    import json, logging
    import jax, jax.numpy as jnp, jaxaot
    logging.basicConfig(level=logging.WARNING, format="WARNING-LINE %(message)s")

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x) * 3), lambda r, g: (g * r,))

    @jaxaot.component
    def c(x):
        return f(x).sum()

    x = jnp.linspace(0.0, 1.0, 3)
    got = jax.jit(jax.grad(c))(x)  # (run eagerly, JAX would compile it op by op)
    want = jax.jit(jax.grad(lambda x: f(x).sum()))(x)
    assert jnp.array_equal(got, want), (got, want)
    jaxaot.wait_for_writes()
    print(json.dumps({"report": jaxaot.report(), **jaxaot.stats()}))
    """
)


def test_a_component_holding_a_custom_vjp_warm_starts_without_a_warning(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``grad`` of a component whose body holds a custom_vjp rule (its own rule's
    values): the rule's linear part stays in each process, as it must (only its
    transpose can be lowered), and is no cause for a warning that blamed a mesh or
    vmap axis, nor for a warm process's report to say "partly warm"."""
    cold, warm = cold_and_warm(
        tmp_path / "custom_vjp_run.py", _CUSTOM_VJP_RUN, subprocess_env, "WARNING-LINE"
    )
    assert cold["report"].startswith("jaxaot: cold start") and cold["made_in_process"] == 1
    assert warm["report"].startswith("jaxaot: warm start"), warm["report"]
    assert warm["lowerings"] == 0 and warm["compiles"] == 0 and warm["loaded"] > 0


_CALLBACK_RUN = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, jaxaot

    seen = []

    @jaxaot.component
    def layer(w, x):
        jax.debug.callback(lambda v: seen.append(float(v)), x.sum())
        return jnp.tanh(x @ w)

    def loss(w, x):
        return layer(w, layer(w, x)).sum()

    w, x = jnp.eye(3) * 0.5, jnp.ones((2, 3))
    got = jaxaot.jit(jax.grad(loss))(w, x)
    want = jax.grad(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w).sum())(w, x)
    assert jnp.allclose(got, want, atol=1e-6), (got, want)
    jaxaot.wait_for_writes()
    print(json.dumps({"report": jaxaot.report(), "seen": len(seen), **jaxaot.stats()}))
    """
)


_SCALARS_RUN = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, jaxaot

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: compiles.append(1)
        if event == "/jax/core/compile/backend_compile_duration" else None
    )
    c = jaxaot.component(lambda x, s: x * s)
    x = jnp.array([1.0, 2.0, 3.0])
    got = [
        jax.vmap(lambda x: c(x, 0.1))(jnp.stack([x, x])),
        jax.grad(lambda x: c(x, 2).sum())(x),
        jax.vmap(lambda x: c(x, np.float32(0.5)))(jnp.stack([x, x])),
    ]
    want = [
        jax.vmap(lambda x: x * 0.1)(jnp.stack([x, x])),
        jax.grad(lambda x: (x * 2).sum())(x),
        jax.vmap(lambda x: x * np.float32(0.5))(jnp.stack([x, x])),
    ]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and jnp.array_equal(g, w), (g, w)
    jaxaot.wait_for_writes()
    print(json.dumps({"compiles": len(compiles), **jaxaot.stats()}))
    """
)


def test_python_numbers_passed_on_by_eager_transformations_warm_start(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Eager ``vmap`` and ``grad`` of a component called with a Python number (or
    a NumPy scalar) pass it on as it is: the derived entry's executable runs it,
    so a second process loads everything and compiles nothing (each number once
    compiled op by op by JAX, in every process)."""
    cold, warm = cold_and_warm(tmp_path / "scalars.py", _SCALARS_RUN, subprocess_env, "Error")
    assert cold["compiles"] > 0 and cold["made_here"] > 0
    assert warm["compiles"] == 0 and warm["made_here"] == 0, warm


def test_entries_kept_in_each_process_leave_a_warm_start_warm(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``grad`` of components with a host callback under ``jaxaot.jit``: their
    derived entries stay in each process (the callback is bound there), and the
    program's executable is loaded. A warm process made them again, and its
    report said "partly warm" although it lowered and compiled nothing (diffrax's
    error checks, in a user's solve)."""
    script = tmp_path / "callback_run.py"
    script.write_text(_CALLBACK_RUN)
    runs = []
    env = dict(subprocess_env, JAXAOT_EXPLAIN_MISSES="1")
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "missed the cache" not in proc.stderr, proc.stderr  # (the warm process)
    cold, warm = runs
    assert cold["report"].startswith("jaxaot: cold start"), cold["report"]
    assert warm["lowerings"] == 0 and warm["compiles"] == 0 and warm["loaded"] > 0, warm
    assert warm["report"].startswith("jaxaot: warm start"), warm["report"]
    assert warm["made_in_process"] >= 1 and warm["made_here"] == warm["made_in_process"], warm
    # Made in every process, by design: no miss a cache could fix, nor explained.
    assert warm["misses"] == 0, warm
    assert warm["seen"] == cold["seen"] > 0


_CALLBACK_WHOLE_RUN = textwrap.dedent(
    """
    import json
    import numpy as np
    import jax, jax.numpy as jnp, jaxaot

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **k: compiles.append(e)
        if e == "/jax/core/compile/backend_compile_duration" else None
    )
    seen = []

    def host(v):
        seen.append(float(np.asarray(v).sum()))  # (NumPy: no eager JAX op, no compile)
        return np.asarray(v, np.float32) * np.float32(2)

    @jaxaot.component
    def block(w, x):
        return x + jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, jnp.float32), x @ w)

    w, x = jax.block_until_ready((jnp.eye(4) * 0.5, jnp.linspace(0.0, 1.0, 8).reshape(2, 4)))
    before = len(compiles)
    got = jax.block_until_ready(jaxaot.jit(lambda w, x: block(w, x) * 2)(w, x))
    made = len(compiles) - before
    want = jax.jit(lambda w, x: block.__wrapped__(w, x) * 2)(w, x)
    jaxaot.wait_for_writes()
    print(json.dumps({"compiles": made, "equal": bool(jnp.array_equal(got, want)),
                      "seen": len(seen)}))
    """
)


def test_a_program_calling_a_component_with_a_host_callback_warm_starts(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A ``jaxaot.jit`` program served whole, calling a component whose body calls
    back into Python (``pure_callback``): the program's executable is written
    with its callbacks named for rebinding, and a new process loads it and binds
    its own. It was not written ("the program ... was not traced in this
    process": the component's callbacks were not named), so ``jaxaot precompile``
    made it and every server compiled it again."""
    cold, warm = cold_and_warm(
        tmp_path / "callback_whole_run.py", _CALLBACK_WHOLE_RUN, subprocess_env, "not written"
    )
    assert cold["equal"] and warm["equal"], (cold, warm)
    assert cold["compiles"] >= 1 and warm["compiles"] == 0, (cold, warm)
    assert warm["seen"] == cold["seen"] > 0, (
        cold,
        warm,
    )  # the loaded program calls this process's host


# -- in-process helpers --------------------------------------------------------------


@pytest.fixture
def dcache(tmp_path: Path) -> jaxaot.DirectoryCache:
    cache = jaxaot.DirectoryCache(tmp_path / "cache")
    jaxaot.set_cache(cache)
    return cache


def _in_jit(comp: jaxaot.Component[..., Any], x: jax.Array) -> jax.Array:
    """Calls ``comp`` inside jax.jit: uses the lowered entry, never an executable entry."""
    return jax.jit(lambda v: comp(v))(x)


def _populate(key: str = "persist") -> tuple[jax.Array, jax.Array, str]:
    x = jnp.arange(6.0)
    comp = jaxaot.component(lambda v: jnp.sin(v) * 3, key=key)
    expected = _in_jit(comp, x)
    return x, expected, comp.cache_key(x).digest


def _raising(key: str) -> jaxaot.Component[..., Any]:
    def body(v: jax.Array) -> jax.Array:
        raise RuntimeError("traced")

    return jaxaot.component(body, key=key)


def _recomputing(key: str) -> jaxaot.Component[..., Any]:
    return jaxaot.component(lambda v: jnp.sin(v) * 3, key=key)


def _damage(path: Path, how: str) -> None:
    blob = path.read_bytes()
    n = len(blob)
    if how.startswith("truncate"):
        size = {"truncate0": 0, "truncate1": 1, "truncate_half": n // 2, "truncate_n-1": n - 1}[how]
        path.write_bytes(blob[:size])
    else:
        region = {"flip_header": 20, "flip_payload": n - 100, "flip_checksum": n - 1}[how]
        damaged = bytearray(blob)
        damaged[region] ^= 0x10
        path.write_bytes(bytes(damaged))


@pytest.mark.parametrize(
    "how",
    [
        "truncate0",
        "truncate1",
        "truncate_half",
        "truncate_n-1",
        "flip_header",
        "flip_payload",
        "flip_checksum",
    ],
)
def test_corrupt_entry_is_a_miss_with_one_warning(
    dcache: jaxaot.DirectoryCache, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    x, expected, digest = _populate()
    _damage(dcache.path_for(digest), how)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    again = _recomputing("persist")
    np.testing.assert_allclose(_in_jit(again, x), expected)
    assert again.cache_info().traces == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bad cache entry" in warnings[0].getMessage()
    assert jaxaot.stats()["corrupt_entries"] >= 1
    assert list((Path(dcache.stats()["path"]) / "quarantine").iterdir())
    # The fresh entry was written back: the next new component hits it.
    np.testing.assert_allclose(_in_jit(_raising("persist"), x), expected)


def test_many_bad_entries_of_one_cause_are_one_warning(
    dcache: jaxaot.DirectoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache whose entries were all damaged alike: each is a miss, recomputed and
    quarantined, and the damage is one warning (the others at DEBUG)."""
    names = [f"many-{i}" for i in range(4)]
    populated = [_populate(name) for name in names]
    for _, _, digest in populated:
        _damage(dcache.path_for(digest), "flip_payload")
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    for name, (x, expected, _) in zip(names, populated, strict=True):
        np.testing.assert_allclose(_in_jit(_recomputing(name), x), expected)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bad cache entry" in warnings[0], warnings
    told = [r.getMessage() for r in caplog.records if "bad cache entry" in r.getMessage()]
    assert len(told) == len(names), told  # each is still logged, at DEBUG
    assert len(list((Path(dcache.stats()["path"]) / "quarantine").iterdir())) == len(names)


def test_a_bad_entry_that_cannot_be_removed_is_said_once_not_dropped(
    dcache: jaxaot.DirectoryCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a cache this process cannot change (read-only), a bad entry stays: each
    reader recomputes, with jax.jit's values, and it is said once that it stays,
    never that it was dropped."""
    x, expected, digest = _populate("stays")
    _damage(dcache.path_for(digest), "flip_payload")
    bad = dcache.path_for(digest).read_bytes()
    from jaxaot._caches import _directory

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(_directory.DirectoryCache, "_write", read_only)
    monkeypatch.setattr(_directory.DirectoryCache, "quarantine", lambda *a, **k: None)
    monkeypatch.setattr(_directory.DirectoryCache, "delete", lambda *a, **k: False)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    for _ in range(3):
        np.testing.assert_allclose(_in_jit(_recomputing("stays"), x), expected)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not [w for w in warnings if "dropped" in w], warnings
    stays = [w for w in warnings if "could not be removed" in w]
    assert len(stays) == 1 and digest[:16] in stays[0], warnings
    assert dcache.path_for(digest).read_bytes() == bad


def test_entries_another_key_signed_are_kept_and_said_not_replaced(
    dcache: jaxaot.DirectoryCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After the signing key changes (or signing is turned on), the old entries
    stay (good for the processes with the old key); this process's own, under the
    same keys, are then not stored. That is said once and counted as a write the
    cache did not take (``jaxaot precompile`` fails on it), never taken for a
    stored entry."""
    x, expected, digest = _populate("rotated")
    unsigned = dcache.path_for(digest).read_bytes()
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "a new secret")
    before = jaxaot.stats()["cache_write_errors"]
    caplog.set_level(logging.WARNING, logger="jaxaot")
    np.testing.assert_allclose(_in_jit(_recomputing("rotated"), x), expected)
    jaxaot.wait_for_writes()
    assert dcache.path_for(digest).read_bytes() == unsigned  # kept
    assert jaxaot.stats()["cache_write_errors"] > before
    said = [r.getMessage() for r in caplog.records if "therefore not stored" in r.getMessage()]
    assert len(said) == 1 and "jaxaot cache clear" in said[0], said


def test_planted_pickle_never_runs(dcache: jaxaot.DirectoryCache, tmp_path: Path) -> None:
    x, expected, digest = _populate("planted")
    sentinel = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> Any:
            return (open, (str(sentinel), "w"))

    path = dcache.path_for(digest)
    path.write_bytes(pickle.dumps(Exploit()))
    np.testing.assert_allclose(_in_jit(_recomputing("planted"), x), expected)
    assert not sentinel.exists()
    # Even a planted pickle wrapped in valid-looking magic bytes is refused.
    path.write_bytes(_entry.MAGIC + pickle.dumps(Exploit()))
    np.testing.assert_allclose(_in_jit(_recomputing("planted"), x), expected)
    assert not sentinel.exists()


def test_read_only_cache(
    dcache: jaxaot.DirectoryCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    x, expected, _ = _populate("ro")
    from jaxaot._caches import _directory

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(_directory.DirectoryCache, "_write", read_only)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    np.testing.assert_allclose(_in_jit(_raising("ro"), x), expected)  # hits still work
    for i in range(3):  # misses compute, puts skipped
        comp = jaxaot.component(lambda v, i=i: v + i, key=f"ro-miss-{i}")
        np.testing.assert_allclose(comp(x), x + i)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # One for the read-only cache; one because the raising body is other code
    # than the one that made the entry under its explicit key.
    assert len(warnings) == 2, warnings
    assert sum("made by code that differs" in w for w in warnings) == 1
    assert len(dcache.keys()) == 1


_READ_ONLY_RUN = textwrap.dedent(
    """
    import json, logging, sys
    import jax, jax.numpy as jnp, numpy as np, jaxaot
    logging.basicConfig(level=logging.WARNING, format="WARNING-LINE %(message)s")

    @jaxaot.component(key="ro-disk-f")
    def f(x):
        return jnp.sin(x) * 2

    n = int(sys.argv[1])  # a new n is a miss: a lease, a lowering, a compile and a put
    for m in range(2, n + 1):
        x = jnp.arange(float(m))
        np.testing.assert_allclose(f(x), jax.jit(lambda v: jnp.sin(v) * 2)(x))
    jaxaot.wait_for_writes()
    print(json.dumps(jaxaot.stats()))
    """
)


def _read_only_command(root: Path, argv: list[str]) -> list[str]:
    """``argv`` run with ``root`` truly read-only: a read-only bind mount in a mount
    namespace of its own when root (whom no file mode stops), else a 0555 tree."""
    if os.geteuid() != 0:
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            d.chmod(0o555)
        return argv
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount the cache read-only")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace: {probe.stderr.decode().strip()}")
    quoted = " ".join(f"'{a}'" for a in argv)
    return [
        "unshare",
        "-m",
        "sh",
        "-c",
        f"mount --bind '{root}' '{root}' && mount -o remount,bind,ro '{root}' && exec {quoted}",
    ]


@pytest.mark.skipif(sys.platform != "linux", reason="read-only mounts")
def test_read_only_disk_gives_one_warning(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    root = Path(subprocess_env["JAXAOT_CACHE_DIR"])
    script = tmp_path / "ro_run.py"
    script.write_text(_READ_ONLY_RUN)
    first = subprocess.run(
        [sys.executable, str(script), "2"], capture_output=True, text=True, env=subprocess_env
    )
    assert first.returncode == 0, first.stderr[-3000:]
    before = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    try:
        proc = subprocess.run(
            _read_only_command(root, [sys.executable, str(script), "4"]),
            capture_output=True,
            text=True,
            env=subprocess_env,
            timeout=300,
        )
    finally:
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            d.chmod(0o700)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING-LINE")]
    # Two misses, each wanting a lease and two puts: one warning for the one cause.
    assert len(warnings) == 1, warnings
    assert str(root) in warnings[0] and "cannot be written" in warnings[0]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["hits"] >= 1 and stats["compiles"] == 2  # n=2 was read, n=3 and n=4 made
    after = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    assert after == before


def test_disk_full(
    dcache: jaxaot.DirectoryCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    x, expected, _ = _populate("full")
    from jaxaot._caches import _directory

    real_fsync = os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_directory.os, "fsync", full)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    for i in range(3):
        comp = jaxaot.component(lambda v, i=i: v * i, key=f"full-{i}")
        np.testing.assert_allclose(comp(x), x * i)
    monkeypatch.setattr(_directory.os, "fsync", real_fsync)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert dcache.stats()["temp_files"] == 0
    assert len(dcache.keys()) == 1
    np.testing.assert_allclose(_in_jit(_raising("full"), x), expected)


def test_cache_directory_vanishing_mid_run(dcache: jaxaot.DirectoryCache) -> None:
    x, expected, _ = _populate("vanish")
    shutil.rmtree(dcache.stats()["path"])
    np.testing.assert_allclose(_in_jit(_recomputing("vanish"), x), expected)
    np.testing.assert_allclose(_in_jit(_raising("vanish"), x), expected)


@pytest.mark.parametrize(
    "key", ["../../escape", "/etc/passwd", "a\x00b", "k" * 300, "ключ-鍵-🔑", "..\\..\\win"]
)
def test_hostile_user_keys_stay_inside_the_root(
    dcache: jaxaot.DirectoryCache, tmp_path: Path, key: str
) -> None:
    comp = jaxaot.component(lambda v: v + 1, key=key)
    np.testing.assert_allclose(comp(jnp.ones(2)), 2 * np.ones(2))
    root = Path(dcache.stats()["path"]).resolve()
    for path in tmp_path.rglob("*"):
        assert path == root or root in path.resolve().parents, path
    assert all(len(k) == 64 and set(k) <= set("0123456789abcdef") for k in dcache.keys())


def test_host_callback_entries_are_never_written(
    dcache: jaxaot.DirectoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    # The lowered entry (it would hold this process's callbacks) stays in the
    # process; only the executable is written, to be loaded with callbacks
    # rebound (tests/test_callbacks.py).
    def noisy(v: jax.Array) -> jax.Array:
        jax.debug.print("v={v}", v=v)
        return v * 2

    caplog.set_level(logging.DEBUG, logger="jaxaot")
    comp = jaxaot.component(noisy)
    np.testing.assert_allclose(comp(jnp.ones(2)), 2 * np.ones(2))
    jaxaot.wait_for_writes()
    written = [_entry.decode(dcache.get(k) or b"") for k in dcache.keys()]
    assert [(e.stablehlo, e.executable is not None) for e in written] == [(None, True)]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("host callbacks" in r.getMessage() for r in caplog.records)


def test_unsafe_default_directory_falls_back_to_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from jaxaot._store import _active

    unsafe = tmp_path / "shared"
    unsafe.mkdir()
    os.chmod(unsafe, 0o777)
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(unsafe))
    monkeypatch.delenv("JAXAOT_CACHE", raising=False)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    cache = _active._default_from_env()
    assert isinstance(cache, jaxaot.MemoryCache)
    assert len(caplog.records) == 1 and str(unsafe) in caplog.records[0].getMessage()
    with pytest.raises(jaxaot.UnsafeCacheDirError, match=str(unsafe)):
        jaxaot.DirectoryCache(unsafe)


def test_default_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("JAXAOT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jaxaot.default_cache_dir() == str(tmp_path / "xdg" / "jaxaot")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert jaxaot.default_cache_dir() == str(tmp_path / "home" / ".cache" / "jaxaot")
    for relative in ("cache", "~/cache"):  # invalid, as the XDG spec says: ignored
        monkeypatch.setenv("XDG_CACHE_HOME", relative)
        assert jaxaot.default_cache_dir() == str(tmp_path / "home" / ".cache" / "jaxaot")
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(tmp_path / "explicit"))
    from jaxaot._store import _active

    monkeypatch.setenv("JAXAOT_CACHE_MAX_BYTES", "12345")
    cache = _active._default_from_env()
    assert isinstance(cache, jaxaot.DirectoryCache)
    assert cache.stats()["path"] == str(tmp_path / "explicit") and cache.max_bytes == 12345
    assert oct(os.stat(tmp_path / "explicit").st_mode & 0o777) == "0o700"


# -- default keys from the traced program (issue 11) --------------------------------------

DEFAULT_KEY_RUN = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, jaxaot

    @jaxaot.component
    def block(x, w):
        return jnp.tanh(x @ w)

    @jaxaot.component
    def loss(params, x):
        return jnp.mean(block(x, params["w"]) ** 2) + jnp.sum(params["b"])

    x = jnp.arange(12.0).reshape(3, 4) / 10
    w = jnp.ones((4, 2)) / 3
    params = {"w": w, "b": jnp.ones(2)}
    how = sys.argv[1]
    if how == "top":
        out = block(x, w)
    elif how == "jit":
        out = jax.jit(lambda x: block(x, w) * 2)(x)
    elif how == "vmap":
        out = jax.vmap(block, in_axes=(0, None))(x[:, None, :], w)
    elif how == "grad":
        out = jax.grad(loss)(params, x)["w"]
    elif how == "jit_grad":
        out = jax.jit(jax.grad(loss))(params, x)["w"]
    else:
        out = jaxaot.jit(jax.grad(loss))(params, x)["w"]
    jaxaot.wait_for_writes()
    info = [block.cache_info(), loss.cache_info()]
    print(json.dumps({
        "out": jnp.asarray(out).tolist(),
        "traces": sum(i.traces for i in info),
        "lowerings": sum(i.lowerings for i in info),
        "compiles": sum(i.compiles for i in info),
    }))
    """
)


def _run_script(
    script: Path, env: dict[str, str], *args: str, cwd: Path | None = None
) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["top", "jit", "vmap", "grad", "jit_grad", "regional"])
def test_default_key_warm_process_traces_but_never_lowers_or_compiles(
    tmp_path: Path, subprocess_env: dict[str, str], how: str
) -> None:
    script = tmp_path / "run.py"
    script.write_text(DEFAULT_KEY_RUN)
    cold = _run_script(script, subprocess_env, how)
    assert cold["lowerings"] + cold["compiles"] >= 1
    warm = _run_script(script, subprocess_env, how)
    assert warm["out"] == cold["out"]
    assert warm["traces"] >= 1  # the body is traced to find its key...
    assert warm["lowerings"] == 0 and warm["compiles"] == 0, warm  # ...and nothing is remade


# Each kind of edit a user makes between two runs: files before, files after, and
# the values the component returns on jnp.ones(2) with each.
_MAIN = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, jaxaot
    import helpers

    {body}

    comp = jaxaot.component(f)
    x = jnp.ones(2)
    top = comp(x)
    jitted = jax.jit(comp)(x)
    grad = jax.grad(lambda v: comp(v).sum())(x)
    jaxaot.wait_for_writes()
    print(json.dumps({{"top": top.tolist(), "jit": jitted.tolist(), "grad": grad.tolist()}}))
    """
)

EDITS: dict[str, tuple[str, str, str, float, float]] = {
    # name: (helpers v1, helpers v2, body of f, value v1, value v2)
    "module_function": (
        "def h(x):\n    return x * 2\n",
        "def h(x):\n    return x * 3\n",
        "def f(x):\n        return helpers.h(x)",
        2.0,
        3.0,
    ),
    "module_constant": (
        "FACTOR = 2.0\n",
        "FACTOR = 5.0\n",
        "def f(x):\n        return x * helpers.FACTOR",
        2.0,
        5.0,
    ),
    "static_method": (
        "class M:\n    @staticmethod\n    def s(x):\n        return x * 2\n",
        "class M:\n    @staticmethod\n    def s(x):\n        return x * 4\n",
        "def f(x):\n        return helpers.M.s(x)",
        2.0,
        4.0,
    ),
    "method_through_self": (
        "class M:\n    def g(self, x):\n        return x * 2\n    def __call__(self, x):\n"
        "        return self.g(x)\n",
        "class M:\n    def g(self, x):\n        return x * 6\n    def __call__(self, x):\n"
        "        return self.g(x)\n",
        "f = helpers.M()",
        2.0,
        6.0,
    ),
    "class_attribute_through_self": (
        "class M:\n    scale = 2.0\n    def __call__(self, x):\n        return x * self.scale\n",
        "class M:\n    scale = 7.0\n    def __call__(self, x):\n        return x * self.scale\n",
        "f = helpers.M()",
        2.0,
        7.0,
    ),
    "import_inside_body": (
        "def h(x):\n    return x * 2\n",
        "def h(x):\n    return x * 8\n",
        "def f(x):\n        from helpers import h\n        return h(x)",
        2.0,
        8.0,
    ),
    "library_without_version": (
        "import sys, os\nsys.path.insert(0, os.path.join(os.path.dirname(__file__), "
        "'site-packages'))\nfrom nolib import h\n",
        "",  # the library itself is upgraded (see below)
        "def f(x):\n        return helpers.h(x)",
        2.0,
        9.0,
    ),
    "custom_jvp_rule": (
        "import jax, jax.numpy as jnp\n@jax.custom_jvp\ndef h(x):\n    return 2 * x\n"
        "h.defjvp(lambda p, t: (h(p[0]), 2 * t[0]))\n",
        "import jax, jax.numpy as jnp\n@jax.custom_jvp\ndef h(x):\n    return 2 * x\n"
        "h.defjvp(lambda p, t: (h(p[0]), 10 * t[0]))\n",
        "def f(x):\n        return helpers.h(x)",
        2.0,
        2.0,
    ),
    "big_closed_over_list": (
        "TABLE = [1.0] * 20000\n",
        "TABLE = [1.0] * 19999 + [3.0]\n",
        "def f(x):\n        return x * 2 * helpers.TABLE[-1]",
        2.0,
        6.0,
    ),
    "deeply_nested_value": (
        "CONFIG = {'a': {'b': {'c': {'d': {'e': {'f': {'g': {'h': 2.0}}}}}}}}\n",
        "CONFIG = {'a': {'b': {'c': {'d': {'e': {'f': {'g': {'h': 4.0}}}}}}}}\n",
        "def f(x):\n        c = helpers.CONFIG\n"
        "        return x * c['a']['b']['c']['d']['e']['f']['g']['h']",
        2.0,
        4.0,
    ),
}


@pytest.mark.parametrize("kind", sorted(EDITS))
def test_edit_then_rerun_gives_the_new_result(
    tmp_path: Path, subprocess_env: dict[str, str], kind: str
) -> None:
    v1, v2, body, want1, want2 = EDITS[kind]
    env = dict(subprocess_env)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    (tmp_path / "main.py").write_text(_MAIN.format(body=body))
    lib = tmp_path / "site-packages" / "nolib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("def h(x):\n    return x * 2\n")
    (tmp_path / "helpers.py").write_text(v1)
    first = _run_script(tmp_path / "main.py", env, cwd=tmp_path)
    if kind == "library_without_version":
        (lib / "__init__.py").write_text("def h(x):\n    return x * 9\n")
    else:
        (tmp_path / "helpers.py").write_text(v2)
    second = _run_script(tmp_path / "main.py", env, cwd=tmp_path)
    assert first["top"] == first["jit"] == [want1, want1]
    assert second["top"] == second["jit"] == [want2, want2], (first, second)
    if kind == "custom_jvp_rule":
        assert first["grad"] == [2.0, 2.0] and second["grad"] == [10.0, 10.0]
    else:
        assert second["grad"] == [want2, want2]
