"""``jaxaot bench``: both suites end to end on a tiny model (tables, JSON, plots)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxaot import _bench
from jaxaot._cli import main


def test_bench_all_on_a_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JAXAOT_BENCH_SHAPE", "2,8,16")
    out = tmp_path / "out"
    assert main(["bench", "all", "--layers", "2", "--repeats", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "jaxaot warm / physical limit" in text and "jaxaot.jit / scan" in text
    for name in ("warm_start", "regional"):
        assert (out / f"{name}.md").read_text().startswith(("Warm-start", "Regional"))
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads((out / "warm_start.json").read_text())
    assert {r["contender"] for r in rows} == set(_bench.CONTENDERS)
    warm = next(r for r in rows if r["contender"] == "jaxaot_warm")
    assert warm["cache_info"]["traces"] == 0 and warm["cache_info"]["compiles"] == 0
    regional = json.loads((out / "regional.json").read_text())
    assert {r["contender"] for r in regional} == set(_bench.REGIONAL)
    assert all(r["first_result"] > 0 for r in regional)


def test_bench_regional_inference_with_a_model_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("JAXAOT_BENCH_SHAPE", raising=False)
    defaults = (_bench.WIDTH, _bench.MODE)
    out = tmp_path / "out"
    argv = ["bench", "regional", "--layers", "2", "--repeats", "1", "--out", str(out)]
    argv += ["--width", "8", "--batch", "1", "--seq", "4", "--inference"]
    assert main(argv) == 0
    text = (out / "regional.md").read_text()
    assert "Model width 8, batch 1, sequence 4; forward pass (inference)" in text
    rows = json.loads((out / "regional.json").read_text())
    regional = next(r for r in rows if r["contender"] == "regional_cold")
    # The worker ran the forward pass of that model: a plan of 2 block calls and the loss,
    # whose steady state was chosen before its steady step was measured.
    assert regional["mode"] in ("split", "whole") and regional["steps"] == 3
    assert "jaxaot.jit's steady state" in text
    assert (_bench.WIDTH, _bench.MODE) == defaults  # this process's settings are back
