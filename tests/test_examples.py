"""The examples run, and the train-step example warm-starts in a second process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_quickstart(subprocess_env: dict[str, str]) -> None:
    out = _run("quickstart.py", subprocess_env)
    assert "1 function, 6 calls" in out
    assert "same key, same result: True" in out


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
