"""The examples run, and the training examples warm-start in a second process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run_full(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _run(script: str, env: dict[str, str], *args: str) -> str:
    return _run_full(script, env, *args).stdout


def test_quickstart(subprocess_env: dict[str, str]) -> None:
    for _ in ("cold", "warm"):  # one cache directory (subprocess_env's)
        proc = _run_full("quickstart.py", subprocess_env)
        assert "1 function, 6 calls" in proc.stdout
        assert "same key, same result: True; second traced 0 times" in proc.stdout
        # Nothing unexplained on stderr, warm or cold.
        assert "jaxaot" not in proc.stderr, proc.stderr
    assert "jaxaot: warm start: " in proc.stdout and "(0 compiles, 0.00 s compiling)" in proc.stdout


def _warm_starts(script: str, tmp_path: Path, env: dict[str, str]) -> None:
    """Runs ``script`` twice on one cache directory, each in a fresh process: the
    second loads its step (no lowering, no compile) and trains to the same losses."""
    args = ("--steps", "5", "--cache-dir", str(tmp_path / "cache"))
    cold = _run(script, env, *args)
    assert "lowerings=1, compiles=1" in cold, cold
    assert "jaxaot: cold start: " in cold and "(1 compile, " in cold
    warm = _run(script, env, *args)
    assert "lowerings=0, compiles=0" in warm, warm
    (line,) = [x for x in warm.splitlines() if x.startswith("jaxaot: ")]
    assert line.startswith("jaxaot: warm start: loaded 1 entry from the cache, made 0 here")
    assert line.endswith("(0 compiles, 0.00 s compiling)")
    (first_losses,) = [x for x in cold.splitlines() if x.startswith("loss ")]
    assert first_losses in warm
    start, end = (float(v) for v in first_losses.split()[1::2])
    assert end < start  # the updated state comes back from each step


def test_equinox_training_loop_warm_starts(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    _warm_starts("equinox_train.py", tmp_path, subprocess_env)


def test_flax_nnx_training_loop_warm_starts(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    _warm_starts("flax_nnx_train.py", tmp_path, subprocess_env)


def test_train_step_warm_starts(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    args = ("--steps", "5", "--cache-dir", str(tmp_path / "cache"))
    cold = _run("train_step.py", subprocess_env, *args)
    assert "compiles=1" in cold and "traces=1" in cold
    warm = _run("train_step.py", subprocess_env, *args)
    # A default key traces the body to find its key; nothing is lowered or compiled.
    assert "lowerings=0, compiles=0" in warm
    assert cold.splitlines()[0].split("loss")[1] == warm.splitlines()[0].split("loss")[1]
    (cost,) = [line for line in warm.splitlines() if line.startswith("cost analysis: ")]
    assert "flops " in cost and "bytes accessed " in cost and "{" not in cost


def readme_block(heading: str, language: str) -> str:
    """The first ``language`` code block under ``heading`` in the README."""
    text = (EXAMPLES.parent / "README.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    return section.split(f"```{language}\n", 1)[1].split("\n```", 1)[0]


def test_readme_short_tour_runs(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    tour = tmp_path / "tour.py"
    tour.write_text(readme_block("## A short tour", "python"))
    proc = subprocess.run(
        [sys.executable, str(tour)],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[1].startswith("CacheInfo(")
    assert lines[-1] == "(8, 4)"  # jaxaot.jit's result
    assert "{'sum': array(32." in proc.stdout
