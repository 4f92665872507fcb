"""``jaxaot bench``: both suites end to end on a tiny model (tables, JSON, plots)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from jaxaot import _bench
from jaxaot.cli import main


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


@pytest.mark.parametrize(
    "suite, blocked",
    [("warm-start", "flatbuffers"), ("regional", "equinox"), ("all", "matplotlib")],
)
def test_bench_without_the_extra_is_one_line(
    suite: str,
    blocked: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Checked before any contender runs: exit status 2, one line naming the extra."""
    monkeypatch.setitem(sys.modules, blocked, None)
    ran: list[str] = []
    monkeypatch.setattr(_bench, "run_contenders", lambda *a, **k: ran.append("ran") or [])
    code = main(["bench", suite, "--layers", "2", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and ran == []
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxaot: error: "), err
    assert blocked in lines[0] and 'pip install ".[bench]"' in lines[0]
    assert not (tmp_path / "out").exists()


def test_bench_regional_shape_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """--width, --batch, --seq and --inference reach the benchmark as args.width, ..."""
    seen: list[argparse.Namespace] = []

    def fake_run(args: argparse.Namespace, log: object) -> str:
        seen.append(args)
        return "ok"

    monkeypatch.setattr(_bench, "run", fake_run)
    argv = ["bench", "regional", "--width", "32", "--batch", "2", "--seq", "16", "--inference"]
    assert main([*argv, "--out", "unused"]) == 0
    (args,) = seen
    assert (args.width, args.batch, args.seq, args.inference) == (32, 2, 16, True)
    assert main(["bench", "regional", "--out", "unused"]) == 0
    assert seen[1].inference is False
    assert main(["bench", "regional", "--width", "wide"]) == 2


def _captured(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Figures the plot functions make, kept open for inspection."""
    import matplotlib.pyplot as plt

    figures: list[object] = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    return figures


def _row(contender: str, layers: int, **phases: float) -> dict[str, object]:
    row: dict[str, object] = {"contender": contender, "layers": layers}
    row.update({p: phases.get(p) for p in _bench.PHASES})
    row["first_result"] = sum(v or 0.0 for v in phases.values())
    return row


def test_warm_start_plot_shares_one_scale_and_names_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = _captured(monkeypatch)
    rows = [
        _row(name, depth, trace=0.1 * depth, compile=0.5 * depth, first_run=0.2)
        for depth in (4, 16)
        for name in _bench.CONTENDERS
    ]
    _bench.plot(rows, tmp_path / "w.png", note="2026-01-01, test machine")
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    axes = fig.axes  # type: ignore[attr-defined]
    assert len(axes) == 2 and axes[0].get_xlim() == axes[1].get_xlim()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]  # type: ignore[attr-defined]
    assert "trace+lower+compile" in legend and "load" in legend and "compile" in legend
    assert "2026-01-01, test machine" in fig._suptitle.get_text()  # type: ignore[attr-defined]


def test_regional_plot_ticks_at_the_depths_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = _captured(monkeypatch)
    rows = [
        _row(name, depth, trace=0.01 * depth) for depth in (4, 16, 48) for name in _bench.REGIONAL
    ]
    _bench.regional_plot(rows, tmp_path / "r.png", note="2026-01-01, test machine")
    (fig,) = figures
    (ax,) = fig.axes  # type: ignore[attr-defined]
    assert list(ax.get_xticks()) == [4, 16, 48]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "16", "48"]
    assert any("test machine" in t.get_text() for t in fig.texts)  # type: ignore[attr-defined]


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


def test_bench_sharded_quick_in_a_subprocess(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``jaxaot bench sharded --quick`` with two contenders at one depth in the FSDP
    layout (about 50 s on a loaded 2-core machine; both layouts take twice that): the
    rows, the JSON's numbers (finite and positive, never their values), the table and
    the plot."""
    import math
    import subprocess

    out = tmp_path / "out"
    names = ("scan_cold", "regional_cold")
    argv = ["bench", "sharded", "--quick", "--layers", "2", "--repeats", "1"]
    argv += ["--layouts", "fsdp", "--contenders", *names, "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot", *argv],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "sharded.json").read_text())
    layouts = ("fsdp",)
    assert sorted((r["layout"], r["layers"], r["contender"]) for r in rows) == sorted(
        (layout, 2, name) for layout in layouts for name in names
    )
    for r in rows:
        assert r["devices"] == 8
        for field in ("trace", "first_run", "first_result", "steady"):
            assert math.isfinite(r[field]) and r[field] > 0, (r["contender"], field)
    text = (out / "sharded.md").read_text()
    assert text.startswith("Sharded benchmark") and "8 simulated devices" in text
    for layout in layouts:
        assert f"| {layout} | 2 | jaxaot.jit, cold |" in text
        assert f"| {layout} | 2 | scan over stacked layers, cold |" in text
        assert f"- {layout}, L=2: first result, jaxaot.jit cold / scan cold = " in text
    assert (out / "sharded.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
