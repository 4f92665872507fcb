"""Top-level executables in the cache: zero-trace warm starts, foreign and
damaged executables, cost analysis and profiler annotations."""

from __future__ import annotations

import json
import logging
import os
import re
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
from jaxaot._jax import host_cpu_text
from jaxaot._store import _entry, _executables, _lookup, _writer

STEP_MODULE = textwrap.dedent(
    """
    import os
    import jax, jax.numpy as jnp, jaxaot

    @jaxaot.component(key="exe-step", donate_argnums=(0,))
    def step(params, x):
        if os.environ.get("JAXAOT_TEST_RAISE") == "1":
            raise RuntimeError("traced in the warm process")
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(params)
        return {"w": params["w"] - 0.1 * grads["w"]}, loss

    def run():
        params = {"w": jnp.ones((4, 3)) / 4}
        x = jnp.arange(8.0).reshape(2, 4) / 8
        losses = []
        for _ in range(3):
            params, loss = step(params, x)
            losses.append(float(loss))
        info = step.cache_info()
        return {"losses": losses, "w": params["w"].tolist(), "info": info._asdict(),
                "costs": step.cost_analysis(params, x)}
    """
)


def _run(
    tmp_path: Path,
    env: dict[str, str],
    raise_if_traced: bool,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    env = dict(env)
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    env["JAXAOT_TEST_RAISE"] = "1" if raise_if_traced else "0"
    env.update(extra_env or {})
    code = "import json, stepmod; print(json.dumps(stepmod.run()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_warm_process_does_not_trace_lower_or_compile(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    (tmp_path / "stepmod.py").write_text(STEP_MODULE)
    cold = _run(tmp_path, subprocess_env, raise_if_traced=False)
    assert cold["info"]["traces"] == 1 and cold["info"]["compiles"] == 1
    warm = _run(tmp_path, subprocess_env, raise_if_traced=True)
    assert warm["info"]["traces"] == 0
    assert warm["info"]["lowerings"] == 0
    assert warm["info"]["compiles"] == 0
    assert warm["info"]["hits"] >= 1
    np.testing.assert_allclose(warm["losses"], cold["losses"], rtol=1e-6)
    np.testing.assert_allclose(warm["w"], cold["w"], rtol=1e-6)
    assert warm["costs"] == cold["costs"] and warm["costs"]["flops"] > 0


def test_other_xla_flags_are_a_different_executable(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    (tmp_path / "stepmod.py").write_text(STEP_MODULE)
    _run(tmp_path, subprocess_env, raise_if_traced=False)
    flagged = _run(
        tmp_path,
        subprocess_env,
        raise_if_traced=False,
        extra_env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"},
    )
    assert flagged["info"]["compiles"] == 1  # not the executable made under other flags
    assert flagged["info"]["traces"] == 0  # the lowered entry is shared


def test_dump_flags_warm_start_and_code_flags_recompile(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # As JAX's persistent cache: dumping HLO to a new folder cannot change the
    # code, so the executable is loaded; an optimization level changes it.
    (tmp_path / "stepmod.py").write_text(STEP_MODULE)
    flags = subprocess_env.get("XLA_FLAGS", "")  # (the suite's own, conftest.py)
    cold = _run(tmp_path, subprocess_env, raise_if_traced=False)
    dumped = _run(
        tmp_path,
        subprocess_env,
        raise_if_traced=True,
        extra_env={
            "XLA_FLAGS": f"{flags} --xla_dump_to={tmp_path / 'dump'} --xla_dump_hlo_as_text"
        },
    )
    assert dumped["info"]["compiles"] == 0 and dumped["info"]["traces"] == 0
    assert dumped["losses"] == cold["losses"]
    optimized = _run(
        tmp_path,
        subprocess_env,
        raise_if_traced=False,
        extra_env={
            "XLA_FLAGS": re.sub(r"--xla_backend_optimization_level=\S*", "", flags)
            + f" --xla_dump_to={tmp_path / 'dump2'} --xla_backend_optimization_level=1"
        },
    )
    assert optimized["info"]["compiles"] == 1


def _exe_entries(cache: jaxaot.MemoryCache) -> list[tuple[str, _entry.Entry]]:
    jaxaot.wait_for_writes()  # a slow compile (a loaded machine) is stored in the background
    out = []
    for k in cache.keys():
        e = _entry.decode(cache.get(k) or b"")
        if e.executable is not None:
            out.append((k, e))
    return out


def test_executable_key_parts(fresh_cache: jaxaot.MemoryCache) -> None:
    comp = jaxaot.component(lambda x: x * 2, key="exe-parts", donate_argnums=())
    comp(jnp.ones(3))
    [(_, entry)] = _exe_entries(fresh_cache)
    parts = dict(entry.key.parts["executable"])
    assert parts["backend"] == jax.devices()[0].client.platform  # "cpu" here, "gpu" on CUDA
    assert parts["device_kind"] == jax.devices()[0].device_kind
    assert parts["device_count"] == jax.device_count()
    assert {"platform_version", "xla_flags", "donate_argnums", "process_count"} <= set(parts)
    assert parts["host_cpu"] == host_cpu_text()  # (a CPU executable)


def test_another_cpus_executable_is_neither_loaded_nor_dropped(
    fresh_cache: jaxaot.MemoryCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache shared by machines whose CPUs differ (with and without AVX-512): each
    compiles for its own CPU, and neither removes the other's executable (XLA:CPU
    would refuse to load it, and some jaxlib versions crash on it)."""
    comp = jaxaot.component(lambda x: jnp.sin(x) * 3, key="exe-cpu")
    x = jnp.arange(3.0)
    comp(x)
    [(digest, _)] = _exe_entries(fresh_cache)
    machine = host_cpu_text().split()[0]
    monkeypatch.setattr(
        "jaxaot._store._executables.host_cpu_text", lambda: f"{machine} 0123456789abcdef"
    )
    again = jaxaot.component(lambda x: jnp.sin(x) * 3, key="exe-cpu")
    np.testing.assert_allclose(again(x), np.sin(np.arange(3.0)) * 3, rtol=1e-6)
    assert again.cache_info().compiles == 1
    entries = dict(_exe_entries(fresh_cache))
    assert digest in entries and len(entries) == 2
    cpus = {dict(e.key.parts["executable"])["host_cpu"] for e in entries.values()}
    assert cpus == {host_cpu_text(), f"{machine} 0123456789abcdef"}


def test_the_host_cpu_names_its_instruction_set_not_its_kernels_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from jaxaot._jax import _runtime

    def text_for(flags: str) -> str:
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        real_open = open
        monkeypatch.setattr(
            "builtins.open",
            lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k),
        )
        monkeypatch.setattr("platform.machine", lambda: "x86_64")
        _runtime.host_cpu_text.cache_clear()
        try:
            return _runtime.host_cpu_text()
        finally:
            monkeypatch.undo()
            _runtime.host_cpu_text.cache_clear()

    base = "fpu sse sse2 pni ssse3 sse4_1 sse4_2 avx avx2 fma"
    assert text_for(base) == text_for(base + " hypervisor constant_tsc")  # (a VM's, a kernel's)
    assert text_for(base) == text_for(" ".join(reversed(base.split())))
    assert text_for(base) != text_for(base + " avx512f avx512bw")
    assert text_for(base).startswith("x86_64 ")
    # No flags to read (macOS, Windows): the processor's name tells CPUs apart.
    monkeypatch.setattr(_runtime, "_processor_name", lambda: "Apple M1")
    m1 = text_for("")
    monkeypatch.setattr(_runtime, "_processor_name", lambda: "Apple M3 Pro")
    assert text_for("") != m1


def test_foreign_entry_planted_under_our_key_is_never_loaded(
    fresh_cache: jaxaot.MemoryCache,
) -> None:
    comp = jaxaot.component(lambda x: jnp.cos(x), key="exe-foreign")
    x = jnp.arange(3.0)
    comp(x)
    [(digest, entry)] = _exe_entries(fresh_cache)
    # An executable made for another device kind, planted under our digest.
    parts = dict(entry.key.parts["executable"])
    parts["device_kind"] = "TPU v9"
    entry.key = entry.key.replace(executable=tuple(parts.items()))
    fresh_cache.delete(digest)
    fresh_cache.put(digest, _entry.encode(entry))
    again = jaxaot.component(lambda x: jnp.cos(x), key="exe-foreign")
    np.testing.assert_allclose(again(x), np.cos(np.arange(3.0)), rtol=1e-6)
    assert again.cache_info().compiles == 1


def test_damaged_executable_section_is_a_miss(
    fresh_cache: jaxaot.MemoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    comp = jaxaot.component(lambda x: x + 10, key="exe-damaged")
    x = jnp.arange(3.0)
    comp(x)
    [(digest, entry)] = _exe_entries(fresh_cache)
    entry.executable = b"\x80\x04garbage" + bytes(200)  # well-formed entry, unloadable payload
    fresh_cache.delete(digest)
    fresh_cache.put(digest, _entry.encode(entry))
    caplog.set_level(logging.WARNING, logger="jaxaot")
    again = jaxaot.component(lambda x: x + 10, key="exe-damaged")
    np.testing.assert_allclose(again(x), np.arange(3.0) + 10)
    assert again.cache_info().compiles == 1
    assert len([r for r in caplog.records if "cached executable" in r.getMessage()]) == 1
    # The bad entry was replaced by a good one: the next component loads it.
    third = jaxaot.component(lambda x: x + 10, key="exe-damaged")
    np.testing.assert_allclose(third(x), np.arange(3.0) + 10)
    assert third.cache_info().compiles == 0


def test_cost_analysis_is_a_plain_dict() -> None:
    comp = jaxaot.component(lambda a, b: jnp.tanh(a @ b))
    a, b = jnp.ones((8, 16)), jnp.ones((16, 4))
    costs = comp.cost_analysis(a, b)
    assert isinstance(costs, dict)
    assert costs["flops"] >= 2 * 8 * 16 * 4
    assert "bytes accessed" in costs and "transcendentals" in costs
    assert all(isinstance(v, float) for v in costs.values())
    assert comp.cost_analysis(jax.ShapeDtypeStruct((8, 16), jnp.float32), b) == costs
    assert comp.cache_info().compiles == 1  # one executable serves both


def test_cost_analysis_none_when_backend_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoCosts:
        def cost_analysis(self) -> None:
            return None

    assert _executables.cost_dict(NoCosts()) is None


def test_executions_are_annotated_for_the_profiler(tmp_path: Path) -> None:
    comp = jaxaot.component(lambda x: x * 3, key="profiled")
    x = jnp.ones(3)
    comp(x)
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            comp(x).block_until_ready()
    blobs = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert b"jaxaot:<lambda>" in blobs


def test_big_executables_are_written_in_the_background(
    fresh_cache: jaxaot.MemoryCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_lookup, "BACKGROUND_AFTER_SECONDS", 0.0)
    comp = jaxaot.component(lambda x: jnp.sinh(x), key="exe-background")
    x = jnp.arange(3.0)
    np.testing.assert_allclose(comp(x), np.sinh(np.arange(3.0)), rtol=1e-6)
    # Another component with the key waits for the pending write and loads it.
    again = jaxaot.component(lambda x: jnp.sinh(x), key="exe-background")
    np.testing.assert_allclose(again(x), np.sinh(np.arange(3.0)), rtol=1e-6)
    assert again.cache_info().compiles == 0
    jaxaot.wait_for_writes()
    assert len(_exe_entries(fresh_cache)) == 1
    assert not _writer._pending


def test_an_executable_that_cannot_be_serialized_is_said_once(
    fresh_cache: jaxaot.MemoryCache,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An executable that cannot be written (a host callback only its lowering adds,
    as lineax's solves do) runs, and one warning says that a new process compiles
    it again."""

    def unpicklable(exe: Any) -> Any:
        raise AttributeError("Can't pickle local object '_wrapped_callback'")

    monkeypatch.setattr(_executables, "serialize_executable", unpicklable)
    caplog.set_level(logging.WARNING, logger="jaxaot")

    @jaxaot.component
    def unserialized(x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 3

    for n in (3, 4):
        np.testing.assert_allclose(unserialized(jnp.ones(n)), np.sin(np.ones(n)) * 3, rtol=1e-6)
    said = [r.getMessage() for r in caplog.records if "not written to the cache" in r.getMessage()]
    assert len(said) == 1 and "'unserialized'" in said[0] and "compiles it again" in said[0], said


LINALG = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np, jaxaot

    @jaxaot.component
    def plain(x):
        return jnp.tanh(x @ x.T)

    @jaxaot.component
    def solve(m, b):
        return jnp.linalg.solve(m, b), jnp.linalg.cholesky(m @ m.T + jnp.eye(3))

    m = jnp.eye(3) * 2.0 + 0.1
    b = jnp.arange(3.0)
    np.testing.assert_array_equal(plain(m), jax.jit(plain.__wrapped__)(m))
    lapack_before = "scipy.linalg" in sys.modules  # set up for a program calling none?
    got = solve(m, b)  # first: nothing in this process has lowered a LAPACK call
    made = jaxaot.stats()["compiles"]
    want = jax.jit(solve.__wrapped__)(m, b)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    print(made, jaxaot.stats()["loaded"], int(lapack_before))
    """
)


def test_an_executable_calling_lapack_runs_in_a_process_that_lowered_none(
    subprocess_env: dict[str, str],
) -> None:
    """A program calling LAPACK (``jnp.linalg``) loaded in a fresh process, before
    anything there lowered a LAPACK call: it called a kernel JAX had not set up
    yet, and the process crashed. It runs, with ``jax.jit``'s values. Setting the
    kernels up imports SciPy, a cost a warm start pays only when a program it
    loads calls LAPACK: loading one that calls none leaves them alone."""

    def run() -> list[int]:
        proc = subprocess.run(
            [sys.executable, "-c", LINALG],
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
        return [int(v) for v in proc.stdout.split()]

    assert run()[0] == 2  # cold: compiled both
    assert run() == [0, 2, 0]  # warm: loaded both and ran, LAPACK set up for one only


def test_an_executable_for_another_input_tree_is_dropped_not_called(
    fresh_cache: jaxaot.MemoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    """The sound executable entry of another program with the same input types but
    another input tree, planted under a key (re-checksummed: an unsigned cache's
    writer can): a miss with a warning, never called with inputs it was not
    compiled for, and not counted as ``loaded``."""
    import hashlib

    def pair(x: jax.Array, y: jax.Array) -> jax.Array:
        return x * 2 + y

    def named(d: dict[str, jax.Array]) -> jax.Array:
        return d["a"] - d["b"]

    x, y = jnp.arange(3.0), jnp.ones(3)
    jaxaot.component(pair)(x, y)
    jaxaot.wait_for_writes()  # (executables are written in the background)
    mine = set(fresh_cache.keys())
    jaxaot.component(named)({"a": x, "b": y})
    jaxaot.wait_for_writes()

    def executable_entry(digests: set[str]) -> tuple[str, dict[str, Any], dict[str, bytes]]:
        for digest in digests:
            header, sections = _entry.verify(fresh_cache.get(digest))  # type: ignore[arg-type]
            if "executable" in sections:
                return digest, header, sections
        raise AssertionError("no executable entry")

    digest, header, _ = executable_entry(mine)
    _, other, sections = executable_entry(set(fresh_cache.keys()) - mine)
    other["key"], other["digest"] = header["key"], header["digest"]
    raw = json.dumps(other).encode()
    payload = b"".join(sections[name] for name, _ in other["sections"])
    body = _entry._PREFIX.pack(_entry.MAGIC, _entry.ENTRY_FORMAT_VERSION, 0, len(raw)) + raw
    body += payload
    fresh_cache.put(digest, body + hashlib.sha256(body).digest())
    before = jaxaot.stats()["loaded"]
    caplog.set_level(logging.WARNING, logger="jaxaot")
    np.testing.assert_allclose(jaxaot.component(pair)(x, y), jax.jit(pair)(x, y))
    assert any("input tree is not the call's" in r.getMessage() for r in caplog.records)
    assert jaxaot.stats()["loaded"] == before  # (its lowered entry was written here)


def test_an_executable_xla_cannot_serialize_is_said_once_with_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """XLA:CPU at times cannot serialize a program holding a sort (its comparator
    compiled to a fast path, ``LessThan``): said once per program, with XLA's
    words and what they mean, not once per attempt."""
    error = RuntimeError("UNIMPLEMENTED: `LessThan` is not serializable.")
    with caplog.at_level(logging.DEBUG, logger="jaxaot"):
        for _ in range(2):
            _executables.not_serializable("sorted_step", error)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "'sorted_step' is not written to the cache" in warned[0]
    assert "`LessThan` is not serializable" in warned[0]
    assert "cannot serialize a sort" in warned[0]
