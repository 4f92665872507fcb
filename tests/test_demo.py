"""``jaxaot demo``: a handful of steps, cold then warm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxaot._cli import main


def test_demo_cold_then_warm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--steps", "4", "--layers", "1", "--width", "32", "--seq", "16", "--batch", "4"]
    args += ["--cache-dir", str(tmp_path / "c"), "--quiet"]
    assert main(args) == 0
    cold = capsys.readouterr().out
    assert "cold start: traced and compiled" in cold
    assert "time to first step" in cold and "steady step time" in cold
    assert str(tmp_path / "c") in cold
    assert main(args) == 0
    warm = capsys.readouterr().out
    assert "warm start: loaded from the cache" in warm
    assert "0 lowerings, 0 compiles" in warm
    loss_line = [line for line in warm.splitlines() if line.strip().startswith("loss")]
    assert loss_line and "→" in loss_line[0]


def test_demo_cold_flag_ignores_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["demo", "--steps", "3", "--layers", "1", "--width", "32", "--seq", "16", "--batch", "4"]
    assert main([*args, "--cache-dir", str(tmp_path / "c"), "--quiet"]) == 0
    capsys.readouterr()
    assert main([*args, "--cold", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "cold start" in out and "none (--cold)" in out


def test_demo_console_script(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    exe = Path(sys.executable).with_name("jaxaot")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "jaxaot"]
    args = ["demo", "--steps", "3", "--layers", "1", "--width", "32", "--seq", "16", "--batch", "4"]
    env = dict(subprocess_env)
    for _ in range(2):
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warm start" in proc.stdout
    assert os.path.isdir(env["JAXAOT_CACHE_DIR"])
