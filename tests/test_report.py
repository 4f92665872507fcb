"""jaxaot.report(), JAXAOT_VERBOSE=1 and the opt-in progress display
(jaxaot._stats.report, jaxaot._store._progress)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot
from jaxaot import _stats

PROGRAM = textwrap.dedent(
    """
    import json, logging, os, sys
    if os.environ.get("CONFIGURE_LOGGING"):
        logging.basicConfig(level=logging.INFO)
    import jax, jax.numpy as jnp, numpy as np, jaxaot

    @jaxaot.component
    def step(w, x):
        return jnp.tanh(x @ w).sum()

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    np.testing.assert_allclose(step(w, x), jax.jit(lambda w, x: jnp.tanh(x @ w).sum())(w, x))
    jaxaot.wait_for_writes()
    print(jaxaot.report())
    print(json.dumps({"rich": "rich" in sys.modules, **jaxaot.stats()}))
    """
)


def _run(tmp_path: Path, env: dict[str, str], **extra: str) -> tuple[str, dict[str, float], str]:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env={**env, **extra},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line, counts = proc.stdout.strip().splitlines()[-2:]
    return line, json.loads(counts), proc.stderr


def test_report_tells_a_cold_run_from_a_warm_one(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    line, counts, _ = _run(tmp_path, subprocess_env)
    assert line.startswith("jaxaot: cold start: loaded 0 entries from the cache, made 2 here")
    assert "(1 compile, " in line
    assert counts["compiles"] == 1 and counts["loaded"] == 0 and counts["compile_seconds"] > 0
    line, counts, _ = _run(tmp_path, subprocess_env)
    assert line == (
        "jaxaot: warm start: loaded 1 entry from the cache, made 0 here "
        "(0 compiles, 0.00 s compiling)"
    )
    assert counts["compiles"] == 0 and counts["loaded"] == 1 and counts["compile_seconds"] == 0


def test_entries_a_process_reads_back_from_its_own_writes_are_no_warm_start(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A function wrapped twice in one process on a new cache: the second wrapper
    reads what the first wrote. Still a cold start; the next process's is warm."""
    script = tmp_path / "twice.py"
    script.write_text(
        "import jax.numpy as jnp, jaxaot\n"
        "def f(x):\n    return x * 2.0\n"
        "jaxaot.component(f)(jnp.ones(4))\n"
        "jaxaot.wait_for_writes()\n"
        "jaxaot.component(f)(jnp.ones(4))\n"
        "print(jaxaot.report())\n"
    )
    env = {**subprocess_env, "JAXAOT_CACHE": "dir", "JAXAOT_CACHE_DIR": str(tmp_path / "c")}
    lines = [
        subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
        ).stdout.strip()
        for _ in range(2)
    ]
    assert lines[0].startswith("jaxaot: cold start: loaded 0 entries"), lines
    assert lines[1].startswith("jaxaot: warm start"), lines


def test_verbose_logs_the_report_at_exit(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    line, _, err = _run(tmp_path, subprocess_env)
    assert "jaxaot:" not in err  # not opted in: nothing on stderr
    line, _, err = _run(tmp_path, subprocess_env, JAXAOT_VERBOSE="1")
    assert err.strip().splitlines()[-1] == line  # the same line, logged at exit
    assert line.startswith("jaxaot: warm start")
    # A program that configured logging gets it once, through its own handler.
    line, _, err = _run(tmp_path, subprocess_env, JAXAOT_VERBOSE="1", CONFIGURE_LOGGING="1")
    assert [x for x in err.splitlines() if "warm start" in x] == [f"INFO:jaxaot:{line}"], err


def test_compile_seconds_count_only_what_jaxaot_made() -> None:
    before = _stats.stats()
    jax.jit(lambda v: jnp.cos(v) * 3 + 1)(jnp.arange(7.0)).block_until_ready()  # plain JAX
    middle = _stats.stats()
    assert middle["compile_seconds"] == before["compile_seconds"]

    @jaxaot.component
    def fresh(v: jax.Array) -> jax.Array:
        return jnp.cos(v) * 5 - 2

    np.testing.assert_allclose(fresh(jnp.arange(9.0)), jnp.cos(jnp.arange(9.0)) * 5 - 2)
    after = _stats.stats()
    assert after["compiles"] == middle["compiles"] + 1
    assert after["compile_seconds"] > middle["compile_seconds"]
    assert after["made_here"] > middle["made_here"]


def test_a_transformed_component_run_op_by_op_counts_its_compile(
    compiles: list[str],
) -> None:
    """``jax.vmap`` or ``jax.grad`` of a component outside ``jax.jit``: JAX compiles
    the call op by op, outside jaxaot's cache. That compile counts in ``stats()``, so
    a process that ran one is not reported warm (it said "0 compiles")."""

    @jaxaot.component
    def eager_layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w) + x

    w, xs = jnp.eye(3) * 0.5, jnp.ones((4, 2, 3))
    jax.block_until_ready((w, xs))
    for run in (
        lambda: jax.vmap(eager_layer, in_axes=(None, 0))(w, xs),
        lambda: jax.grad(lambda w: eager_layer(w, xs[0]).sum())(w),
    ):
        before, seen = _stats.stats(), len(compiles)
        jax.block_until_ready(run())
        after = _stats.stats()
        assert len(compiles) > seen  # JAX compiled the call op by op
        assert after["compiles"] > before["compiles"], (before, after)
    assert not _stats.report().startswith("jaxaot: warm start")


def test_report_is_public() -> None:
    assert "report" in jaxaot.__all__ and jaxaot.report is _stats.report
    assert jaxaot.report().startswith("jaxaot: ")


def test_progress_is_not_imported_or_shown_unless_opted_in_on_a_terminal(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    env = {k: v for k, v in subprocess_env.items() if k != "JAXAOT_PROGRESS"}
    _, counts, err = _run(tmp_path, env)
    assert counts["rich"] is False  # import jaxaot and a compile stay light
    cold = str(tmp_path / "another-cache")  # a cold run: its make would be shown
    _, counts, err = _run(tmp_path, env, JAXAOT_PROGRESS="1", JAXAOT_CACHE_DIR=cold)
    assert counts["compiles"] == 1
    assert counts["rich"] is False and "making" not in err  # stderr is a pipe here


@pytest.mark.skipif(os.name != "posix", reason="pseudo-terminals")
def test_progress_shows_a_long_make_on_a_terminal(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    pytest.importorskip("rich")
    import pty

    script = tmp_path / "program.py"
    # Every make counts as long here, so that this small one shows.
    script.write_text("import jaxaot._store._progress as p; p.SHOW_AFTER = 0.0\n" + PROGRAM)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            env={**subprocess_env, "JAXAOT_PROGRESS": "1", "TERM": "xterm"},
        )
        os.close(slave)
        slave = -1
        shown = b""
        while True:
            ready, _, _ = select.select([master], [], [], 120)
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        out, _ = proc.communicate(timeout=120)
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert proc.returncode == 0, shown.decode(errors="replace")[-3000:]
    assert b"jaxaot: making step" in shown
    assert json.loads(out.decode().strip().splitlines()[-1])["rich"] is True
