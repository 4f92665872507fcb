"""Host callbacks (``jax.debug.print``, ``pure_callback``, ``io_callback``,
Equinox's runtime checks and so diffrax's): their executables are cached and
loaded in another process with that process's callbacks bound; a changed
callback is a new key; where they cannot be rebound, one WARNING."""

from __future__ import annotations

import json
import logging
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
from jaxaot._jax import _callbacks, rebind_unsupported
from jaxaot._store import _entry

MODULE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, jaxaot, equinox as eqx
    from jax.experimental import io_callback

    LOG = []

    def record(a):
        LOG.append(np.asarray(a).tolist())
        return np.asarray(a)

    def body(x):
        jax.debug.print("printer sees {s}", s=x.sum())
        y = jax.pure_callback(lambda a: np.sin(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return io_callback(record, jax.ShapeDtypeStruct(x.shape, x.dtype), y) + 1

    def check(x):
        return eqx.error_if(x * 2, x < 0, "negative input")

    def solve_body(y0):
        try:
            import diffrax
        except ImportError:  # the Equinox check stands in (as diffrax uses it)
            return check(y0)
        term = diffrax.ODETerm(lambda t, y, args: -y)
        return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0).ys

    @jaxaot.component
    def printer(x):
        return body(x)

    @jaxaot.component
    def checked(x):
        return check(x)

    @jaxaot.component
    def solve(y0):
        return solve_body(y0)

    @jaxaot.component
    def outer(x):  # calls a component with callbacks: lowered inline with them
        return printer(x) * 2

    def run():
        compiled = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, d, **kw: compiled.append(str(kw.get("fun_name")))
            if event == "/jax/core/compile/backend_compile_duration" else None
        )
        x = jnp.arange(3.0)
        y0 = jnp.ones(2)
        got = {"printer": printer(x), "checked": checked(x), "solve": solve(y0), "outer": outer(x)}
        try:
            checked(-x - 1).block_until_ready()
            raised = "no error"
        except Exception as e:
            raised = str(e)
        jax.effects_barrier()
        stats = {k: jaxaot.stats()[k] for k in ("lowerings", "compiles", "hits")}
        names = ("printer", "checked", "solve", "outer")
        ours = [n for n in compiled if any(c in n for c in names)]
        # Plain jax.jit, after the counts (and what the components printed).
        print("PLAIN JIT", flush=True)
        want = {"printer": jax.jit(body)(x), "checked": jax.jit(check)(x),
                "solve": jax.jit(solve_body)(y0), "outer": jax.jit(lambda v: body(v) * 2)(x)}
        callbacks = jaxaot._jax.has_host_callbacks(jax.make_jaxpr(solve_body)(y0))
        jax.effects_barrier()
        return {
            "got": {k: np.asarray(v).tolist() for k, v in got.items()},
            "dtypes": {k: str(v.dtype) for k, v in got.items()},
            "want": {k: np.asarray(v).tolist() for k, v in want.items()},
            "want_dtypes": {k: str(v.dtype) for k, v in want.items()},
            "raised": raised, "stats": stats, "compiled": ours,
            "io_log": LOG[:1], "solve_calls_back": callbacks,
        }
    """
)


def _run(tmp_path: Path, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    env = dict(env)
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    code = "import json, cbmod; print('RESULT', json.dumps(cbmod.run()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), proc.stdout + proc.stderr


def _script(path: Path, source: str, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """Runs ``source`` as a script at ``path`` in a new process: the JSON its last
    line prints, and what it said on its standard error."""
    path.write_text(source)
    proc = subprocess.run(
        [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _assert_jit_values(result: dict[str, Any]) -> None:
    for name in result["got"]:
        np.testing.assert_allclose(result["got"][name], result["want"][name], rtol=1e-6)
    assert result["dtypes"] == result["want_dtypes"]


@pytest.mark.skipif(rebind_unsupported() is not None, reason="this JAX cannot rebind callbacks")
def test_diffrax_equinox_and_debug_print_warm_start(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    (tmp_path / "cbmod.py").write_text(MODULE)
    cold, _ = _run(tmp_path, subprocess_env)
    assert cold["solve_calls_back"] is True  # diffrax's default checks are callbacks
    assert cold["stats"]["compiles"] == 4 and cold["compiled"]
    _assert_jit_values(cold)

    warm, out = _run(tmp_path, subprocess_env)
    assert warm["stats"]["lowerings"] == 0
    assert warm["stats"]["compiles"] == 0 and warm["compiled"] == []
    assert warm["stats"]["hits"] >= 4
    _assert_jit_values(warm)
    assert warm["got"] == cold["got"]
    # The callbacks ran in the warm process: its print, its io_callback's list,
    # and Equinox's check raised on bad input.
    assert out.split("PLAIN JIT")[0].count("printer sees 3.0") == 2  # printer's and outer's
    assert len(warm["io_log"]) == 1
    np.testing.assert_allclose(np.asarray(warm["io_log"][0]) + 1, warm["got"]["printer"], rtol=1e-6)
    assert "negative input" in warm["raised"]
    assert "negative input" in cold["raised"]
    assert "WARNING" not in out


def _exe_entries(cache: jaxaot.MemoryCache) -> list[_entry.Entry]:
    jaxaot.wait_for_writes()
    entries = [_entry.decode(cache.get(k) or b"") for k in cache.keys()]
    return [e for e in entries if e.executable is not None]


LOG: list[Any] = []


def _log(a: Any) -> Any:
    LOG.append(np.asarray(a).copy())
    return np.asarray(a)


def _logged(x: jax.Array) -> jax.Array:
    from jax.experimental import io_callback

    return io_callback(_log, jax.ShapeDtypeStruct(x.shape, x.dtype), x * 2) + 1


def test_loaded_executable_calls_back(fresh_cache: jaxaot.MemoryCache) -> None:
    LOG.clear()
    comp = jaxaot.component(_logged)
    x = jnp.arange(4.0)
    np.testing.assert_allclose(comp(x), jax.jit(_logged)(x))
    assert len(_exe_entries(fresh_cache)) == 1
    comp.clear_cache()  # the next call loads the executable from the cache
    before = comp.cache_info()
    got = comp(x)
    after = comp.cache_info()
    assert after.compiles == before.compiles and after.lowerings == before.lowerings
    assert after.hits > before.hits
    np.testing.assert_allclose(got, np.arange(4.0) * 2 + 1)
    jax.effects_barrier()
    assert len(LOG) == 3  # jax.jit's run, the first run, the loaded executable's
    np.testing.assert_allclose(LOG[-1], np.arange(4.0) * 2)


_SOURCE = """
import jax, numpy as np

def body(x):
    def host(a):
        return np.asarray(a) * {factor}
    return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
"""


def _program(source: str) -> str:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<string>", "exec"), namespace)
    comp = jaxaot.component(namespace["body"])
    return str(comp.cache_key(jnp.ones(3)).parts["program"])


def test_changed_callback_body_is_a_new_key() -> None:
    twice = _program(_SOURCE.format(factor=2))
    assert _program(_SOURCE.format(factor=2)) == twice
    assert _program(_SOURCE.format(factor=3)) != twice


def test_changed_closure_value_is_a_new_key() -> None:
    def make(tag: str) -> Any:
        def body(x: jax.Array) -> jax.Array:
            jax.debug.callback(lambda v: print(tag, v), x)
            return x + 1

        return jaxaot.component(body)

    x = jnp.ones(2)
    one = make("a").cache_key(x).parts["program"]
    assert make("a").cache_key(x).parts["program"] == one
    assert make("b").cache_key(x).parts["program"] != one


def _printing(x: jax.Array) -> jax.Array:
    jax.debug.print("printing {x}", x=x)
    return x * 3


def test_jax_that_cannot_rebind_warns_once(
    fresh_cache: jaxaot.MemoryCache,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(
        _callbacks, "rebind_unsupported", lambda: "jaxlib 0.0 cannot bind host callbacks"
    )
    caplog.set_level(logging.WARNING, logger="jaxaot")
    comp = jaxaot.component(_printing)
    for n in (2, 3):
        x = jnp.arange(float(n))
        np.testing.assert_allclose(comp(x), jax.jit(_printing)(x))
    jax.effects_barrier()
    assert "printing [0. 1. 2.]" in capsys.readouterr().out
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "_printing" in warnings[0] and "cannot bind host callbacks" in warnings[0]
    assert _exe_entries(fresh_cache) == []


def test_explicit_key_stays_in_process_with_one_warning(
    fresh_cache: jaxaot.MemoryCache,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.WARNING, logger="jaxaot")
    comp = jaxaot.component(_printing, key="printing-v1")
    for n in (2, 3):
        np.testing.assert_allclose(comp(jnp.arange(float(n))), np.arange(float(n)) * 3)
    jax.effects_barrier()
    assert "printing [0. 1.]" in capsys.readouterr().out
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "explicit key" in warnings[0], warnings
    assert fresh_cache.keys() == []


def test_same_program_with_other_objects_calls_its_own(fresh_cache: jaxaot.MemoryCache) -> None:
    # Two components of one name and program whose callbacks see different
    # objects: neither runs the other's callback, cached or not.
    def make(log: list[Any]) -> Any:
        def body(x: jax.Array) -> jax.Array:
            jax.debug.callback(lambda v: log.append(np.asarray(v).copy()), x)
            return x + 1

        return jaxaot.component(body)

    logs: tuple[list[Any], list[Any]] = ([], [])
    first, second = make(logs[0]), make(logs[1])
    x = jnp.arange(3.0)
    first(x)
    second(x * 2)
    first.clear_cache()
    first(x * 3)
    jax.effects_barrier()
    np.testing.assert_allclose(np.stack(logs[0]), [np.arange(3.0), np.arange(3.0) * 3])
    np.testing.assert_allclose(np.stack(logs[1]), [np.arange(3.0) * 2])


def test_callback_component_inside_jit_says_once_it_is_not_loaded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    @jaxaot.component
    def noisy(x: jax.Array) -> jax.Array:
        jax.debug.print("sum {}", x.sum())
        return x * 2

    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        a = jax.jit(lambda x: noisy(x) + 1)(jnp.ones(3))
        b = jax.jit(lambda x: noisy(x) + 2)(jnp.ones(3))
    np.testing.assert_array_equal(a, np.full(3, 3.0))
    np.testing.assert_array_equal(b, np.full(3, 4.0))
    said = [r.getMessage() for r in caplog.records if "calls the host" in r.getMessage()]
    assert len(said) == 1 and "'noisy'" in said[0], said


_REGIONAL = textwrap.dedent(
    """
    import json, sys
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    import jaxaot

    names = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **k: names.append(k.get("fun_name"))
        if e == "/jax/core/compile/backend_compile_duration" else None
    )
    seen = []

    def note(s):
        seen.append(float(s) * SCALE)

    def f(x):
        x = eqx.error_if(x, x < 0, "negative input")
        jax.debug.callback(note, x.sum())
        return jnp.tanh(x) * 2

    x = jnp.ones(3)
    n = len(names)
    out = jax.block_until_ready(jaxaot.jit(f)(x))
    compiles = len(names) - n
    try:
        jax.block_until_ready(jaxaot.jit(f)(-x))
        raised = False
    except Exception as e:
        raised = "negative input" in str(e)
    jaxaot.wait_for_writes()
    same = bool(np.array_equal(out, jax.jit(f)(x)))
    print(json.dumps({"compiles": compiles, "seen": seen, "raised": raised, "same": same}))
    """
)


def test_a_jaxaot_jit_program_with_callbacks_warm_starts_with_them_bound(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # The glue program of jaxaot.jit (here served whole) holds Equinox's check
    # and a debug callback: stored, and loaded with the new process's callbacks.
    def run(scale: str) -> dict[str, Any]:
        source = f"SCALE = {scale}\n" + _REGIONAL
        return _script(tmp_path / f"regional_{scale}.py", source, subprocess_env)[0]

    cold = run("1.0")
    warm = run("1.0")
    assert cold["compiles"] >= 1 and cold["same"] and cold["raised"]
    # Its callback ran in jaxaot.jit's call and in jax.jit's, here, in the warm process.
    assert warm == {"compiles": 0, "seen": [3.0, 3.0], "raised": True, "same": True}, warm
    # A process whose callback sees another global loads the same program with
    # its own callback bound, never the stored process's.
    other = run("2.0")
    assert other["compiles"] == 0 and other["seen"] == [6.0, 6.0] and other["raised"]


def test_an_ordered_callback_program_warm_starts_and_calls_back_in_the_new_process(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # An ordered callback takes and gives a token, which a function rebuilt from
    # its equation does not: the new process binds the callbacks of its own
    # lowering of the program instead, and the callback runs there, in order.
    script = tmp_path / "ordered.py"
    script.write_text(
        textwrap.dedent(
            """
            import json
            import jax, jax.numpy as jnp, jaxaot
            from jax.experimental import io_callback
            names = []
            jax.monitoring.register_event_duration_secs_listener(
                lambda e, d, **k: names.append(e)
                if e == "/jax/core/compile/backend_compile_duration" else None
            )
            log = []
            def f(x):
                io_callback(lambda v: log.append(float(v)), None, x.sum(), ordered=True)
                io_callback(lambda v: log.append(-float(v)), None, x.max(), ordered=True)
                return x * 2
            x = jnp.ones(3)
            n = len(names)
            out = jaxaot.jit(f)(x)
            compiles = len(names) - n
            jaxaot.wait_for_writes()
            print(json.dumps({"out": out.tolist(), "log": log, "compiles": compiles}))
            """
        )
    )
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(script)],
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "not written to the cache" not in proc.stderr, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["compiles"] >= 1, cold
    assert warm == {"out": [2.0, 2.0, 2.0], "log": [3.0, -1.0], "compiles": 0}, warm


def test_values_a_partial_binds_are_part_of_the_callback_key() -> None:
    import functools

    from jaxaot._keys._callbacks import callback_text

    def text(scale: float) -> str:
        def f(x: jax.Array) -> jax.Array:
            out = jax.ShapeDtypeStruct(x.shape, x.dtype)
            return jax.pure_callback(functools.partial(np.multiply, scale), out, x)  # type: ignore[no-any-return]

        eqn = next(e for e in jax.make_jaxpr(f)(jnp.ones(2)).jaxpr.eqns if "callback" in str(e))
        return callback_text(eqn)

    assert text(2.0) != text(3.0)
    assert text(2.0) == text(2.0)


_LOWERED = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    import jaxaot

    names = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **k: names.append(e)
        if e == "/jax/core/compile/backend_compile_duration" else None
    )
    seen = []

    def note(s):
        seen.append(float(s) * SCALE)
        return np.asarray(s, np.float32)

    def renamed(s):
        return note(s)

    # A library's primitive whose lowering calls back into Python (as lineax's
    # solves check their results): the traced program holds no callback.
    checked_p = Primitive("checked_sum")
    checked_p.def_abstract_eval(lambda x: jax.core.ShapedArray((), x.dtype))

    def checked(x):
        callback = globals()[CALLBACK]
        return jax.pure_callback(callback, jax.ShapeDtypeStruct((), jnp.float32), x.sum())

    checked_p.def_impl(checked)
    mlir.register_lowering(checked_p, mlir.lower_fun(checked, multiple_results=False))

    def f(x):
        return jnp.tanh(x) * checked_p.bind(x)

    x = jnp.ones(3)
    n = len(names)
    out = jax.block_until_ready(jaxaot.jit(f)(x))
    compiles = len(names) - n
    jaxaot.wait_for_writes()
    same = bool(np.array_equal(out, jax.jit(f)(x)))
    print(json.dumps({"compiles": compiles, "seen": seen, "same": same}))
    """
)


def test_a_program_whose_lowering_adds_callbacks_warm_starts_with_its_own_bound(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A program whose host callbacks its lowering adds (no equation of its traced
    program makes them) is stored, and a new process binds those of its own
    lowering of the program: it compiles nothing and its callback runs there."""

    def run(scale: str, callback: str = "note") -> tuple[dict[str, Any], str]:
        source = f"SCALE = {scale}\nCALLBACK = {callback!r}\n" + _LOWERED
        return _script(tmp_path / f"lowered_{scale}_{callback}.py", source, subprocess_env)

    cold, said = run("1.0")
    assert cold["compiles"] >= 1 and cold["same"] and cold["seen"] == [3.0, 3.0], cold
    assert "not written to the cache" not in said, said
    warm, _ = run("1.0")
    assert warm == {"compiles": 0, "seen": [3.0, 3.0], "same": True}, warm
    # Another process's callback sees its own global: its own lowering's is bound.
    other, _ = run("2.0")
    assert other == {"compiles": 0, "seen": [6.0, 6.0], "same": True}, other
    # A lowering that calls back into other functions than the stored program's
    # (the primitive's lowering changed, its jaxpr did not) loads nothing: compiled.
    changed, _ = run("1.0", "renamed")
    assert changed["compiles"] >= 1 and changed["same"] and changed["seen"] == [3.0, 3.0]


def test_an_entry_whose_callbacks_cannot_be_lowered_again_is_a_miss_and_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, compiles: list[str]
) -> None:
    """A program whose callbacks its lowering gives (an ordered callback) is
    stored; where lowering it again fails in a process, its entry is not loaded
    there (the program is compiled) and stays in the cache, sound, for others."""
    from jax.experimental import io_callback

    from jaxaot._regional import _programs

    log: list[float] = []

    def f(x: jax.Array) -> jax.Array:
        io_callback(lambda v: log.append(float(v)), None, x.sum(), ordered=True)
        return x * 2

    cache = jaxaot.MemoryCache()
    x = jnp.ones(3)
    with jaxaot.using_cache(cache):
        jax.block_until_ready(jaxaot.jit(f)(x))
        jaxaot.wait_for_writes()
        stored = sorted(cache.keys())
        assert stored

        def fails(*args: Any) -> Any:
            raise RuntimeError("no lowering here")

        # As a new process would: nothing of this one's programs in memory.
        monkeypatch.setattr(_programs, "lowered", fails)
        _programs.GLUE._exes.clear()
        _programs.WHOLE._exes.clear()
        before = len(compiles)
        with caplog.at_level(logging.WARNING, logger="jaxaot"):
            out = jaxaot.jit(f)(x)
        assert len(compiles) > before  # compiled, not loaded
        np.testing.assert_array_equal(out, x * 2)
        assert log == [3.0, 3.0]
        assert not [r for r in caplog.records if "dropped" in r.getMessage()], caplog.text
        assert set(stored) <= set(cache.keys())
