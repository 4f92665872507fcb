"""``jaxaot bench``: both suites on a tiny model (tables, ratios, JSON, plots), and every
contender's worker on the installed JAX."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jaxaot.cli import main
from jaxaot.cli.bench import _config, _measure, _plots, _report, _runner, _suites
from jaxaot.cli.bench._config import BenchConfig, Job, ModelShape

# ``jaxaot bench`` runs every contender in a fresh process (about 10 s each on 2 CPUs,
# 18 for ``bench all``). The tests check the same things for far less: the command's
# machinery (preparations, tables, ratios, JSON, plots) over every contender with
# workers that return made-up timings; one real worker through the command; and every
# worker branch on the installed JAX in two processes (cold, then warm).

#: Made-up first results: the ratios the tables must print follow from them.
FIRST = {
    "jit_cold": 2.0,
    "jit_components_cold": 2.2,
    "pcc_cold": 2.1,
    "pcc_warm": 1.2,
    "export_warm": 0.9,
    "jaxaot_cold": 3.0,
    "jaxaot_warm": 0.6,
    "limit": 0.3,
    "scan_cold": 4.0,
    "noinline_cold": 5.0,
    "regional_cold": 2.0,
    "regional_warm": 0.25,
    "remat_jit_cold": 2.4,
    "remat_scan_cold": 4.4,
    "remat_regional_cold": 2.1,
    "remat_regional_warm": 0.3,
    "remat_limit": 0.2,
}


def _fake_worker(calls: list[tuple[str, int, Path]]) -> Any:
    """Stands in for ``_runner.run_worker``: records the call, returns a worker's row."""

    def run(job: Job) -> dict[str, object]:
        contender, layers = job.contender, job.layers
        calls.append((contender, layers, Path(job.work)))
        row: dict[str, object] = {"contender": contender, "layers": layers, "import": 0.5}
        row.update({p: None for p in _measure.PHASES})
        if contender.endswith("_prepare"):
            row["first_result"] = 0.0
            return row
        row["trace"] = row["first_result"] = FIRST[contender]
        # Steady steps: jit with components 1.1x plain jit's; jaxaot.jit's 0.8x scan's.
        row["steady"] = {"jit_components_cold": 0.011, "regional_cold": 0.008}.get(contender, 0.010)
        if contender == "regional_cold":
            row.update(mode="whole", steps=0)
        return row

    return run


def test_bench_all_writes_tables_ratios_json_and_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, int, Path]] = []
    monkeypatch.setattr(_runner, "run_worker", _fake_worker(calls))
    out = tmp_path / "out"
    argv = ["bench", "all", "--layers", "2", "3", "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for depth in (2, 3):
        assert (
            f"- L={depth}: jaxaot warm / physical limit = 2.00; "
            "jaxaot warm / jit+JAX cache warm = 0.50; jaxaot cold / jit cold = 1.50; "
            "steady step, jit with components / plain jit = 1.100"
        ) in text
        assert (
            f"- L={depth}: first result, jaxaot.jit / scan = 0.50, / noinline = 0.40, "
            "/ jax.jit = 1.00; warm jaxaot.jit / warm jit+JAX cache = 0.21; "
            "steady step / best of jit and scan = 0.80, / jax.jit = 0.80"
        ) in text
    assert "jaxaot.jit runs the whole program: one executable" in text
    for name in ("warm_start", "regional"):
        assert (out / f"{name}.md").read_text().startswith(("Warm-start", "Regional"))
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name, table in (("warm_start", _config.CONTENDERS), ("regional", _config.REGIONAL)):
        rows = json.loads((out / f"{name}.json").read_text())
        for depth in (2, 3):
            got = [r for r in rows if r["layers"] == depth]
            assert sorted(r["contender"] for r in got) == sorted(table), name
            assert all(r["label"] == table[r["contender"]][0] for r in got)
    # Per suite and depth, a fresh work folder (warm-start's first); each preparation
    # runs once in it, before the contender that needs it, unless it ran as one already.
    runs: dict[Path, list[tuple[str, int]]] = {}
    for contender, depth, work in calls:
        runs.setdefault(work, []).append((contender, depth))
    folders = list(runs.values())
    assert len(folders) == 4
    for names, table, depth in zip(
        folders, [_config.CONTENDERS] * 2 + [_config.REGIONAL] * 2, (2, 3, 2, 3), strict=True
    ):
        expected: list[str] = []
        _order(table, expected)
        assert names == [(name, depth) for name in expected]


def _order(table: dict[str, tuple[str, str | None]], seen: list[str]) -> None:
    """Appends the workers ``table`` runs, in order: each preparation before the first
    contender that needs it, unless it already ran."""
    for name, (_, prep) in table.items():
        for step in (prep, name):
            if step is not None and step not in seen:
                seen.append(step)


def _workers(
    names: list[str], work: Path, env: dict[str, str], width: int = 16
) -> dict[str, dict[str, Any]]:
    """The worker of each of ``names`` in turn, in one fresh process (one start, not one
    each), on a one-layer tiny model of ``width`` (the shape passed in the job)."""
    code = (
        "import json, sys\n"
        "from jaxaot.cli.bench._config import Job, ModelShape\n"
        "from jaxaot.cli.bench._worker import worker\n"
        "for name in sys.argv[2:]:\n"
        f"    job = Job(name, 1, sys.argv[1], 1, ModelShape(batch=2, seq=8, width={width}))\n"
        "    print(json.dumps(worker(job, 0.0)), flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(work), *names],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["contender"] for r in rows] == names
    return {r["contender"]: r for r in rows}


def test_every_contender_runs_on_this_jax(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """Every branch of the benchmark worker, on a one-layer tiny model: the contenders
    that need no preparation and the preparations in one process, then those that load
    what a preparation stored in a second, fresh one."""
    env = subprocess_env
    every: list[str] = []
    _order(_config.CONTENDERS, every)
    _order(_config.REGIONAL, every)
    tables = {**_config.CONTENDERS, **_config.REGIONAL}
    warm = [name for name in every if name in tables and tables[name][1] is not None]
    work = tmp_path / "work"
    work.mkdir()
    rows = _workers([n for n in every if n not in warm], work, env) | _workers(warm, work, env)
    assert (work / "step.export").stat().st_size > 0
    assert (work / "step.executable").stat().st_size > 0
    assert any((work / "jax-pcc").iterdir()) and any((work / "jaxaot-cache").iterdir())
    # One call each (the trace, the compile or load, the first run) rather than stages.
    whole_calls = {"jaxaot_cold", "jaxaot_warm", "limit", "regional_cold", "regional_warm"}
    whole_calls |= {"remat_regional_cold", "remat_regional_warm", "remat_limit"}
    for name in tables:
        row = rows[name]
        phases = [row[p] for p in _measure.PHASES]
        assert row["layers"] == 1 and row["steady"] > 0, name
        assert row["first_result"] == sum(v or 0.0 for v in phases) > 0, name
        assert all(v is None or v > 0 for v in phases), (name, phases)
        assert name in whole_calls or None not in phases, (name, phases)
    # The warm process loads the step executable the cold one stored. (regional_warm's
    # process-wide counts depend on what the other contenders of these two processes
    # made, so they are not a warm process's own: test_regional checks one of those.)
    info = rows["jaxaot_warm"]["cache_info"]
    assert info["traces"] == 0 and info["compiles"] == 0 and info["hits"] > 0
    assert rows["regional_cold"]["mode"] in ("split", "whole")
    assert rows["regional_warm"]["mode"] in ("split", "whole")


def test_bench_without_out_prints_the_tables_and_writes_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --out, a run prints its tables and writes nothing: run inside a
    checkout, it leaves its files (docs included) as they were."""
    calls: list[tuple[str, int, Path]] = []
    monkeypatch.setattr(_runner, "run_worker", _fake_worker(calls))
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "all", "--layers", "2", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "- L=2: first result, jaxaot.jit / scan = 0.50" in text
    assert "written to" not in text
    assert calls and sorted(p.name for p in tmp_path.iterdir()) == []


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
    monkeypatch.setattr(_runner, "run_contenders", lambda *a, **k: ran.append("ran") or [])
    code = main(["bench", suite, "--layers", "2", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and ran == []
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxaot: error: "), err
    assert blocked in lines[0] and 'pip install ".[bench]"' in lines[0]
    assert not (tmp_path / "out").exists()


def test_bench_regional_shape_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """--width, --batch, --seq and --inference reach the benchmark in its config, and
    make the regional suite's model (the warm-start suite keeps the default one)."""
    seen: list[BenchConfig] = []

    def fake_run(config: BenchConfig, log: object) -> str:
        seen.append(config)
        return "ok"

    monkeypatch.setattr(_suites, "run", fake_run)
    argv = ["bench", "regional", "--width", "32", "--batch", "2", "--seq", "16", "--inference"]
    assert main([*argv, "--out", "unused"]) == 0
    (config,) = seen
    assert (config.width, config.batch, config.seq, config.inference) == (32, 2, 16, True)
    assert config.shape("regional") == ModelShape(batch=2, seq=16, width=32, mode="inference")
    assert config.shape("warm-start") == ModelShape()
    assert main(["bench", "regional", "--out", "unused"]) == 0
    assert seen[1].inference is False and seen[1].shape("regional").mode == "train"
    assert seen[1].out == Path("unused")
    assert main(["bench", "regional", "--width", "wide"]) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--layers", "0"],
        ["--layers", "4", "-2"],
        ["--repeats", "0"],
        ["--width", "0"],
        ["--seq", "-1"],
        ["--trials", "0"],
        ["--out", "__file__"],
    ],
)
def test_bench_refuses_bad_options_before_it_runs(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sizes and counts below 1, and an --out that is a file, are one-line errors
    (status 2) before anything runs, not a traceback or numbers minutes later."""
    ran: list[BenchConfig] = []
    monkeypatch.setattr(_suites, "run", lambda config, log: ran.append(config) or "ok")
    argv = [__file__ if a == "__file__" else a for a in argv]
    assert main(["bench", "regional", *argv]) == 2 and ran == []
    err = capsys.readouterr().err
    assert err.startswith("jaxaot: error:") and len(err.strip().splitlines()) == 1, err


def _captured(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Figures the plot functions make, kept open for inspection."""
    import matplotlib.pyplot as plt

    figures: list[object] = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    return figures


def _row(contender: str, layers: int, **phases: float) -> dict[str, object]:
    row: dict[str, object] = {"contender": contender, "layers": layers}
    row.update({p: phases.get(p) for p in _measure.PHASES})
    row["first_result"] = sum(v or 0.0 for v in phases.values())
    return row


def test_regional_report_gives_early_and_settled_steps_cold_and_warm() -> None:
    """The regional report gives, each against the best steady contender (here
    scan's 4 ms), the cold jaxaot.jit's early steps (8 ms: 2.00x) and settled
    steady step (3.6 ms: 0.90x), and the warm process's early steps (5 ms: 1.25x)."""
    scan = _row("scan_cold", 8, trace=0.1, compile=1.0, first_run=0.1) | {"steady": 0.004}
    jit = _row("jit_cold", 8, trace=0.1, compile=9.0, first_run=0.1) | {"steady": 0.005}
    cold = _row("regional_cold", 8, trace=0.3, first_run=0.4)
    cold |= {"steady": 0.0036, "early": 0.008, "early_n": 30}
    warm = _row("regional_warm", 8, trace=0.1, first_run=0.1)
    warm |= {"steady": 0.0035, "early": 0.005, "early_n": 30}
    rows = [r | {"label": r["contender"]} for r in (scan, jit, cold, warm)]
    text = _report.regional_markdown(rows, ModelShape())
    early = [line for line in text.splitlines() if "early steps" in line]
    assert len(early) == 2, text
    assert "calls after the first 8 ms = 2.00x the best steady contender" in early[0]
    assert "settled steady step 3.6 ms = 0.90x" in early[0]
    assert early[1].startswith("  - warm process, early steps")
    assert "5 ms = 1.25x" in early[1]


def test_warm_start_plot_shares_one_scale_and_names_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = _captured(monkeypatch)
    rows = [
        _row(name, depth, trace=0.1 * depth, compile=0.5 * depth, first_run=0.2)
        for depth in (4, 16)
        for name in _config.CONTENDERS
    ]
    _plots.warm_start_plot(rows, tmp_path / "w.png", note="2026-01-01, test machine")
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
        _row(name, depth, trace=0.01 * depth) for depth in (4, 16, 48) for name in _config.REGIONAL
    ]
    _plots.regional_plot(rows, tmp_path / "r.png", note="2026-01-01, test machine")
    (fig,) = figures
    (ax,) = fig.axes  # type: ignore[attr-defined]
    assert list(ax.get_xticks()) == [4, 16, 48]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "16", "48"]
    assert any("test machine" in t.get_text() for t in fig.texts)  # type: ignore[attr-defined]


def test_bench_regional_inference_with_a_model_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # One contender, in a real worker process: the command line's shape reaches it.
    monkeypatch.setattr(_config, "REGIONAL", {"regional_cold": _config.REGIONAL["regional_cold"]})
    defaults = (ModelShape().width, ModelShape().mode)
    out = tmp_path / "out"
    argv = ["bench", "regional", "--layers", "2", "--repeats", "1", "--out", str(out)]
    argv += ["--width", "8", "--batch", "1", "--seq", "4", "--inference"]
    assert main(argv) == 0
    text = (out / "regional.md").read_text()
    assert "Model width 8, batch 1, sequence 4; forward pass (inference)" in text
    rows = json.loads((out / "regional.json").read_text())
    regional = next(r for r in rows if r["contender"] == "regional_cold")
    # The worker ran the forward pass of that model: its 2 small block calls make it
    # one program, its layers a loop.
    assert regional["mode"] == "whole" and regional["steps"] == 0
    assert "jaxaot.jit runs the whole program" in text
    # Nothing of the run stays in this process: the default model is the same.
    assert (ModelShape().width, ModelShape().mode) == defaults == (256, "train")


def _bench_subprocess(argv: list[str], env: dict[str, str]) -> None:
    """``python -m jaxaot bench ...`` in a fresh process; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_bench_sharded_quick_in_a_subprocess(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``jaxaot bench sharded --quick`` with two contenders at one depth in the FSDP
    layout on Auto axes (about 50 s on a loaded 2-core machine; both layouts take twice
    that): the rows, the JSON's numbers (finite and positive, never their values), the
    table and the plot."""
    import math

    out = tmp_path / "out"
    names = ("scan_cold", "regional_cold")
    argv = ["bench", "sharded", "--quick", "--layers", "2", "--repeats", "1"]
    argv += ["--layouts", "fsdp", "--axis-types", "auto", "--contenders", *names]
    _bench_subprocess([*argv, "--out", str(out)], subprocess_env)
    rows = json.loads((out / "sharded.json").read_text())
    layouts = ("fsdp",)
    assert sorted((r["layout"], r["layers"], r["contender"]) for r in rows) == sorted(
        (layout, 2, name) for layout in layouts for name in names
    )
    for r in rows:
        assert r["devices"] == 8 and r["axis_types"] == "auto"
        for field in ("trace", "first_run", "first_result", "steady"):
            assert math.isfinite(r[field]) and r[field] > 0, (r["contender"], field)
    text = (out / "sharded.md").read_text()
    assert text.startswith("Sharded benchmark") and "8 simulated devices" in text
    for layout in layouts:
        assert f"| {layout} | 2 | jaxaot.jit, cold |" in text
        assert f"| {layout} | 2 | scan over stacked layers, cold |" in text
        assert f"- {layout}, L=2: first result, jaxaot.jit cold / scan cold = " in text
    assert "Auto axes:" in text and "Explicit axes:" not in text
    assert (out / "sharded.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_sharded_explicit_axes_in_a_subprocess(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``jaxaot bench sharded --quick --axis-types explicit`` on the 2-D layout (a 4 x 2
    data x model mesh of 8 simulated devices, shardings in the types): the physical
    limit (its preparation, a jaxaot.jit compile that stores its executable, then
    the load) in processes of their own, and the table has its explicit row. (The
    jaxaot.jit cold row is the Auto-axes test's above.)"""
    import math

    out = tmp_path / "out"
    names = ("limit",)
    argv = ["bench", "sharded", "--quick", "--layers", "2", "--repeats", "1"]
    argv += ["--layouts", "2d", "--axis-types", "explicit", "--contenders", *names]
    _bench_subprocess([*argv, "--out", str(out)], subprocess_env)
    rows = json.loads((out / "sharded.json").read_text())
    assert sorted((r["axis_types"], r["layout"], r["layers"], r["contender"]) for r in rows) == [
        ("explicit", "2d", 2, name) for name in sorted(names)
    ]
    for r in rows:
        assert r["devices"] == 8
        for field in ("first_run", "first_result", "steady"):
            assert math.isfinite(r[field]) and r[field] > 0, (r["contender"], field)
    limit = next(r for r in rows if r["contender"] == "limit")
    assert limit["compile"] > 0 and limit["trace"] is None  # a load, not a compile
    text = (out / "sharded.md").read_text()
    assert "| explicit | 2d | 2 | physical limit: read + deserialize_and_load |" in text
    assert "Explicit axes:" in text and "Auto axes:" not in text
    assert "- 2d, L=2: first result, jaxaot.jit cold / scan cold = –" in text
    assert "2d: a data x model mesh (model 2)" in text


def test_bench_sharded_reports_the_ratios_per_axis_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sharded suite's machinery with made-up workers: every layout and axis type
    by default, each contender with its preparation in a fresh work folder per mesh,
    the mesh in every job, and the ratios (cold / scan, steady / best of jax.jit and
    scan, warm / physical limit) in the lines and the summary table."""
    calls: list[tuple[str, int, Path]] = []
    fake = _fake_worker(calls)
    jobs: list[Job] = []

    def run(job: Job) -> dict[str, object]:
        jobs.append(job)
        return fake(job)  # type: ignore[no-any-return]

    monkeypatch.setattr(_runner, "run_worker", run)
    out = tmp_path / "out"
    assert main(["bench", "sharded", "--quick", "--layers", "2", "--out", str(out)]) == 0
    meshes = [(a, lo) for a in ("explicit", "auto") for lo in ("data-parallel", "fsdp", "2d")]
    expected: list[str] = []
    _order(_config.SHARDED, expected)
    assert [(j.mesh.axis_types, j.mesh.layout) for j in jobs if j.mesh] == [
        m for m in meshes for _ in expected
    ]
    assert all(j.mesh and j.mesh.devices == 8 for j in jobs)
    assert {j.shape for j in jobs} == {ModelShape(batch=8, seq=8, width=32)}
    assert [j.contender for j in jobs] == expected * len(meshes)
    assert len({w for _, _, w in calls}) == len(meshes)
    rows = json.loads((out / "sharded.json").read_text())
    assert len(rows) == len(meshes) * len(_config.SHARDED)
    text = (out / "sharded.md").read_text()
    for axes in ("Explicit", "Auto"):
        assert f"\n{axes} axes:\n" in text
    for layout in ("data-parallel", "fsdp", "2d"):
        assert (
            f"- {layout}, L=2: first result, jaxaot.jit cold / scan cold = 0.50, / jax.jit "
            "cold = 1.00; steady step, jaxaot.jit / best of jax.jit and scan (jax.jit) = 0.80; "
            "warm / cold: jaxaot.jit = 0.12, jax.jit + JAX cache = 0.60; "
            "warm first result, jaxaot.jit / physical limit = 0.83"
        ) in text
        for axes in ("explicit", "auto"):
            assert f"| {axes} | {layout} | 2 | 0.50 | 0.80 | 0.83 |" in text
    # --max-jit-layers leaves out the contenders that compile the whole unrolled step.
    jobs.clear()
    argv = ["bench", "sharded", "--quick", "--layers", "2", "--max-jit-layers", "1"]
    argv += ["--layouts", "2d", "--axis-types", "explicit", "--out", str(out)]
    assert main(argv) == 0
    ran = {j.contender for j in jobs}
    assert ran == {"scan_cold", "regional_cold", "regional_warm"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--devices", "3", "--layouts", "2d"], "even number of devices"),
        (["--width", "12", "--layouts", "fsdp"], "must be multiples of the mesh axes"),
        (["--contenders", "nope"], "unknown contenders ['nope']"),
    ],
)
def test_bench_sharded_refuses_settings_it_cannot_run(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ran: list[Job] = []
    monkeypatch.setattr(_runner, "run_worker", ran.append)
    code = main(["bench", "sharded", "--quick", *argv, "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and ran == [] and out == ""
    assert err.startswith("jaxaot: error: jaxaot bench sharded: ") and message in err, err


def test_workers_run_on_the_machines_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """``jaxaot bench`` shows the gain on the user's own machine: its workers run on
    the GPU (or TPU) the machine has, not on the CPU as they used to unless told;
    ``JAX_PLATFORMS`` still decides where set; the sharded suite's simulated
    devices are CPU devices; the report names the platform without starting JAX
    in the parent (it would hold most of the GPU's memory). The machine's GPU is
    staged: this one has none."""
    import jax

    from jaxaot import _jax
    from jaxaot.cli.bench._config import MeshLayout

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(_jax, "local_accelerator", lambda: "cuda")
    assert _runner.worker_env(None)["JAX_PLATFORMS"] == "cuda"
    mesh = _runner.worker_env(MeshLayout("data-parallel", 8, "explicit"))
    assert mesh["JAX_PLATFORMS"] == "cpu"
    assert "--xla_force_host_platform_device_count=8" in mesh["XLA_FLAGS"]
    assert ", platform cuda, " in _report.header("Regional-compilation benchmark")
    assert ", platform cuda, " in _plots.figure_note("2026-01-01")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert _runner.worker_env(None)["JAX_PLATFORMS"] == "cpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(_jax, "local_accelerator", lambda: None)
    assert _runner.worker_env(None)["JAX_PLATFORMS"] == "cpu"
    assert jax.__version__ in _report.header("X")


def test_a_job_travels_as_json() -> None:
    """What the parent passes a worker process on its command line comes back equal."""
    from jaxaot.cli.bench._config import MeshLayout

    job = Job("limit", 16, "/tmp/w", 3, ModelShape(2, 4, 8, "inference"))
    assert Job.from_json(job.to_json()) == job
    job = Job("scan_cold", 4, "/w", 1, mesh=MeshLayout("2d", 8, "explicit"))
    assert Job.from_json(job.to_json()) == job
    assert job.mesh is not None and job.mesh.mesh_shape == {"data": 4, "model": 2}
    job = Job("fleet_member", 4, "/w", 1, cache={"redis": "redis://127.0.0.1:1/0", "prefix": "p:"})
    assert Job.from_json(job.to_json()) == job


def test_bench_regional_trials_interleave_fresh_work_folders_and_report_medians(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--trials 3``: the contenders run in turn three times, each trial in its own work
    folder (so a cold contender is cold again and a warm one reads its own trial's
    preparation); each row is the median of its trials, and the table says so."""
    calls: list[tuple[str, int, Path]] = []
    base = _fake_worker(calls)
    # Trial by trial, jaxaot.jit's steady step is 0.012, 0.006, 0.008 s: median 0.008.
    steady = iter([0.012, 0.006, 0.008])

    def run(job: Job) -> dict[str, object]:
        row = base(job)
        if job.contender == "regional_cold":
            row["steady"] = next(steady)
        return row  # type: ignore[no-any-return]

    monkeypatch.setattr(_runner, "run_worker", run)
    out = tmp_path / "out"
    argv = ["bench", "regional", "--layers", "2", "--repeats", "1", "--trials", "3"]
    assert main([*argv, "--out", str(out)]) == 0
    names = [c for c, _, _ in calls]
    regional = list(_config.REGIONAL)
    # Interleaved: each trial runs every contender before the next trial starts.
    order = [n for n in names if n in regional]
    assert order == regional * 3
    folders = {c: [w for n, _, w in calls if n == c] for c in ("regional_cold", "regional_warm")}
    assert len(set(folders["regional_cold"])) == 3
    assert folders["regional_warm"] == folders["regional_cold"]  # warm reads its own trial's
    rows = json.loads((out / "regional.json").read_text())
    assert len(rows) == len(regional)
    row = next(r for r in rows if r["contender"] == "regional_cold")
    assert row["steady"] == pytest.approx(0.008)
    assert [t["steady"] for t in row["trials"]] == pytest.approx([0.012, 0.006, 0.008])
    text = (out / "regional.md").read_text()
    assert "median of 3 trials" in text
    # scan's steady step is 0.010 in every trial.
    assert "first result 0.50, 0.50, 0.50; steady step 1.20, 0.60, 0.80" in text
    assert "steady step / best of jit and scan = 0.80" in text


def test_median_row_keeps_what_every_trial_agrees_on() -> None:
    """Two trials: timings are their median; the depth and the step count, equal in
    both, stay as they are (not 48.0), and text comes from the first trial."""
    a = {"layers": 48, "steps": 97, "steady": 0.4, "mode": "split", "compile": None}
    b = {"layers": 48, "steps": 97, "steady": 0.6, "mode": "whole", "compile": 1.0}
    row = _runner.median_row([a, b])
    assert row["layers"] == 48 and type(row["layers"]) is int
    assert row["steps"] == 97 and type(row["steps"]) is int
    assert row["steady"] == pytest.approx(0.5)
    assert row["mode"] == "split" and row["compile"] is None
    assert [t["steady"] for t in row["trials"]] == [0.4, 0.6]
    assert _runner.median_row([a]) == a
    (line,) = _report.steady_state_line(_runner.median_row([a, dict(a)]))
    assert line == "  - jaxaot.jit runs the split program: 97 executables"
    (line,) = _report.steady_state_line(b)
    assert "runs the whole program" in line


# -- the fleet suite -------------------------------------------------------------------


def _member(made: int, first: float, **more: float) -> dict[str, Any]:
    """A fleet member's row: ``made`` lowerings and compiles, its first result."""
    stats = {"lowerings": made // 2, "compiles": made - made // 2, "made_here": made, **more}
    return {"contender": "fleet_member", "first_result": first, "stats": stats}


def test_bench_fleet_reports_each_group_against_the_lone_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from jaxaot.cli.bench import _fleet

    calls: list[tuple[Job, int, dict[str, str]]] = []

    def fake_members(job: Job, n: int, env: dict[str, str]) -> list[dict[str, Any]]:
        calls.append((job, n, env))
        if n == 1:
            return [_member(7, 2.0)]
        if env.get("JAXAOT_LEASE_WAIT") == "0":
            return [_member(4, 7.0)] * n
        if len(calls) == 4:  # the warm group: nothing made
            return [_member(0, 1.8)] * n
        members = [_member(2, 2.4, loaded_after_wait=5, wait_seconds=1.0)] * (n - 1)
        return [_member(2, 2.6), *members]

    monkeypatch.setattr(_fleet, "run_members", fake_members)
    monkeypatch.setattr(_fleet, "backends", lambda log: ["directory"])
    out = tmp_path / "out"
    assert main(["bench", "fleet", "--layers", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert [(job.contender, job.layers, n) for job, n, _ in calls] == [
        ("fleet_member", 2, 1),
        ("fleet_member", 2, 4),
        ("fleet_member", 2, 4),
        ("fleet_member", 2, 4),
    ]
    caches = [job.cache for job, _, _ in calls]
    assert all(c and "dir" in c for c in caches) and len({c["dir"] for c in caches if c}) == 3
    assert caches[3] == caches[1]  # the warm group runs on the cache the fleet filled
    assert "- directory, L=2, fleet: made 1.14x, first result 1.30x the lone process's " in text
    assert "(targets met)" in text
    assert "fleet, leases off: made 2.29x, first result 3.50x" in text
    assert "| directory | 2 | fleet | 4 | 8 | 1.14 | **2.60** (2.40) | 1.30 | 15 | 3.00 |" in text
    assert "fleet, warm cache (the floor): made 0.00x, first result 0.90x" in text
    assert "Command: `jaxaot bench fleet --processes 4 --layers 2`" in text
    rows = json.loads((out / "fleet.json").read_text())
    assert [r["group"] for r in rows] == ["lone", "fleet", "fleet_off", "fleet_warm"]
    assert (out / "fleet.md").read_text() in text
    assert main(["bench", "fleet", "--processes", "1", "--out", str(out)]) == 2


def test_fleet_members_start_together_and_make_each_entry_once(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Two real members on one directory cache, on a one-layer tiny model."""
    import jaxaot
    from jaxaot.cli.bench import _fleet

    shared = tmp_path / "shared"
    job = Job("fleet_member", 1, str(tmp_path), 1, ModelShape(2, 8, 32), cache={"dir": str(shared)})
    members = _fleet.run_members(job, 2, subprocess_env)
    assert len(members) == 2 and all(m["first_result"] > 0 for m in members)
    made = sum(m["stats"]["made_here"] for m in members)
    assert made == len(jaxaot.DirectoryCache(shared).keys()) >= 5
    row = _fleet.group_row("directory", "fleet", 1, members)
    assert row["made"] == sum(m["stats"]["lowerings"] + m["stats"]["compiles"] for m in members)
    assert row["first_result"] == max(m["first_result"] for m in members)


def test_bench_fleet_ratios_are_taken_within_each_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The machine's load drifts between trials: each group's ratio is to the lone
    process of its own trial, and the report gives the median of those."""
    from jaxaot.cli.bench import _fleet

    firsts = iter([2.0, 2.6, 9.0, 1.0, 4.0, 4.4, 9.0, 1.0])  # lone, fleet, off, warm; twice

    def fake_members(job: Job, n: int, env: dict[str, str]) -> list[dict[str, Any]]:
        first = next(firsts)
        return [_member(7 if n == 1 else 2, first)] + [_member(2, first - 0.1)] * (n - 1)

    monkeypatch.setattr(_fleet, "run_members", fake_members)
    monkeypatch.setattr(_fleet, "backends", lambda log: ["directory"])
    argv = ["bench", "fleet", "--processes", "2", "--trials", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    # 2.6 / 2.0 and 4.4 / 4.0: 1.30 and 1.10, whose median is 1.20 (3.5 / 3.0 would be 1.17).
    assert "fleet: made 0.57x, first result 1.20x the lone process's (targets met)" in text
    assert "the median of 2 trials' ratios" in text


# -- the precompile suite ----------------------------------------------------------------


def test_bench_precompile_quick_in_a_subprocess(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``jaxaot bench precompile --quick`` on a tiny model (about 160 s on a loaded
    2-core machine: some 20 fresh processes): every row of the table; the deployed
    processes compiled nothing after ``jaxaot precompile`` (JAX's compile events and
    jaxaot's counters) and answered every bucket; the decode loop's values equal to
    ``jax.jit``'s; where Redis runs, the pair made no more entries than one alone.
    Never timings."""
    import shutil

    out = tmp_path / "out"
    _bench_subprocess(["bench", "precompile", "--quick", "--out", str(out)], subprocess_env)
    data = json.loads((out / "precompile.json").read_text())
    for model, buckets, executables in (("decoding", 2, 2), ("serving", 4, 4)):
        deployed = data[model]["jaxaot"]
        assert deployed["buckets"] == buckets
        assert deployed["backend_compiles"] == 0, deployed
        assert deployed["jaxaot_made"] == {"lowerings": 0, "compiles": 0}
        assert data[model]["limit"]["loaded"] == executables
        assert data[model]["limit"]["ran"] == executables  # (each run once, on zeros)
        assert data[model]["limit"]["trace_seconds"] > 0
        assert deployed["again_seconds"] > 0
        assert data[model]["precompile"]["made"] > 0
        # Without a cache, the same calls compile (so the check above can fail).
        assert data[model]["jit"]["backend_compiles"] >= buckets
    assert data["decoding"]["jaxaot"]["decode_equal"] is True
    assert data["precompile"]["made1"] == data["precompile"]["made2"]
    text = (out / "precompile.md").read_text()
    assert text.startswith("Precompile benchmark")
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 22, rows
    assert sum("load + trace limit" in row for row in rows) == 2
    assert sum("load + first-run limit" in row for row in rows) == 2
    assert sum("load + trace + run limit" in row for row in rows) == 2
    # Every part of a first answer, one after another: the sum of the limits' parts.
    for part in ("decoding", "serving"):
        limit = data[part]["limit"]
        want = limit["seconds"] + limit["first_run_seconds"] + limit["trace_seconds"]
        (row,) = [r for r in rows if r.startswith(f"| {part} | load + first-run + trace")]
        assert row.split(" | ")[2] == f"{want:.2f}", row
    for target in ("0.8 x jax.jit + JAX cache warm", "1.1 x jax.jit's", "1.1 x the load limit"):
        assert f"≤ {target} |" in text
    assert "≤ 0.6 x --workers 1 |" in text
    if shutil.which("redis-server") is not None:
        assert data["redis"]["lone"] > 0 and data["redis"]["pair"] <= data["redis"]["lone"]
        assert "≤ 1.05 x one process alone |" in text
    assert "Decode values of jaxaot.jit equal to jax.jit's: True." in text


# -- the edits suite ---------------------------------------------------------------------

#: Made-up seconds from process start of each contender's 8 steps (cold, restart, then
#: each edit and its restart): the ratios the report must print follow from them.
EDIT_SECONDS = {
    "regional": [6.0, 2.0, 2.2, 2.0, 2.2, 2.0, 2.2, 2.0],
    "remat_regional": [6.0, 2.0, 3.0, 2.0, 3.0, 2.0, 3.0, 2.0],
    "jit_pcc": [10.0, 4.0, 10.0, 4.0, 12.0, 5.0, 12.0, 5.0],
    "scan_pcc": [5.0, 3.0, 5.0, 3.5, 6.0, 4.0, 6.0, 4.0],
}
#: Made-up compiles of the jaxaot contenders' processes at each step.
EDIT_COMPILES = [8, 0, 3, 0, 2, 0, 1, 0]


def test_bench_edits_runs_each_step_of_each_contender_in_its_own_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every contender runs every step, in turn across the contenders, each in a fresh
    worker on a work folder of its own; the report's ratios are those of the seconds
    the workers gave; files go to --out alone."""
    from jaxaot.cli.bench import _edits

    jobs: list[Job] = []

    def fake(job: Job) -> dict[str, Any]:
        name = job.contender.removeprefix("edit:")
        seconds = EDIT_SECONDS[name][sum(j.contender == job.contender for j in jobs)]
        jobs.append(job)
        row = {"contender": job.contender, "layers": job.layers, "import": 0.5}
        row |= {"first_run": seconds - 1.0, "from_start": seconds, "loss": 1.0}
        if name in _edits.OURS:  # what jaxaot.jit compiled and loaded in the process
            compiles = EDIT_COMPILES[(len(jobs) - 1) // len(_edits.CONTENDERS)]
            row["made"] = {"lowerings": 0, "compiles": compiles, "loaded": 8 - compiles}
        return row

    monkeypatch.setattr(_runner, "run_worker", fake)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert main(["bench", "edits", "--layers", "2", "--width", "8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    names = list(_edits.CONTENDERS)
    assert [j.contender for j in jobs] == [f"edit:{n}" for n in names] * len(_edits.STEPS)
    for i, (_, edit, extra) in enumerate(_edits.STEPS):
        step_jobs = jobs[i * len(names) : (i + 1) * len(names)]
        assert {(j.edit, j.layers, j.shape.width) for j in step_jobs} == {(edit, 2 + extra, 8)}
    folders = {n: {j.work for j in jobs if j.contender == f"edit:{n}"} for n in names}
    assert all(len(f) == 1 for f in folders.values())
    assert len(set.union(*folders.values())) == len(names)  # a cache of its own each
    header = "| L | contender | " + " | ".join(s for s, _, _ in _edits.STEPS) + " |"
    assert header in text
    assert (
        "| 2 | jaxaot.jit, component layers | 6.00 (5.00) | 2.00 (1.00) | 2.20 (1.20) | "
        "2.00 (1.00) | 2.20 (1.20) | 2.00 (1.00) | 2.20 (1.20) | 2.00 (1.00) |"
    ) in text
    # edit / its restart, then edit / the better of jax.jit and scan at that edit; from
    # the process's start, and (in parentheses) from the first call
    assert (
        "| 2 | jaxaot.jit, component layers | 1.10 (1.20) | 1.10 (1.20) | 1.10 (1.20) | "
        "0.44 (0.30) | 0.37 (0.24) | 0.37 (0.24) |"
    ) in text
    assert (
        "| 2 | jaxaot.jit, remat'd layers (no annotation) | 1.50 (2.00) | 1.50 (2.00) | "
        "1.50 (2.00) | 0.60 (0.50) | 0.50 (0.40) | 0.50 (0.40) |"
    ) in text
    assert (
        "| 2 | jax.jit + JAX persistent cache | 2.50 (3.00) | 2.40 (2.75) | 2.40 (2.75) | "
        "2.00 (2.25) | 2.00 (2.20) | 2.00 (2.20) |"
    ) in text
    assert (
        "| 2 | scan + JAX persistent cache | 1.43 (1.60) | 1.50 (1.67) | 1.50 (1.67) | "
        "1.00 (1.00) | 1.00 (1.00) | 1.00 (1.00) |"
    ) in text
    assert (
        "- jaxaot.jit, component layers, L=2: compiled / loaded executables at each step: "
        "8 / 0, 0 / 8, 3 / 5, 0 / 8, 2 / 6, 0 / 8, 1 / 7, 0 / 8"
    ) in text
    assert (
        "jaxaot.jit, component layers, L=2: met; "
        "jaxaot.jit, remat'd layers (no annotation), L=2: missed."
    ) in text
    assert "Command: `jaxaot bench edits --layers 2 --width 8 --batch 8 --seq 128`" in text
    assert sorted(p.name for p in out.iterdir()) == ["edits.json", "edits.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    rows = json.loads((out / "edits.json").read_text())
    assert len(rows) == len(names) * len(_edits.STEPS)
    assert (out / "edits.md").read_text() in text
    assert main(["bench", "edits", "--contenders", "nope"]) == 2
    assert main(["bench", "edits", "--inference"]) == 2


def test_bench_edits_end_to_end_in_a_subprocess(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The suite on a tiny model, jaxaot.jit over component layers, each step a fresh
    process: every step reported, a compile at each edit and none at a restart, the
    ratios those of the reported seconds, and files only under --out. Then the other contenders' worker branches, in one process, on the cold
    program: the same loss as jaxaot.jit's."""
    from jaxaot.cli.bench import _edits

    out, cwd = tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    argv = ["bench", "edits", "--layers", "1", "--width", "8", "--batch", "2", "--seq", "8"]
    argv += ["--contenders", "regional", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot", *argv],
        capture_output=True,
        text=True,
        env=subprocess_env,
        cwd=cwd,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["edits.json", "edits.md"]
    assert list(cwd.iterdir()) == []
    rows = json.loads((out / "edits.json").read_text())
    steps = [s for s, _, _ in _edits.STEPS]
    assert [(r["contender"], r["step"]) for r in rows] == [("regional", s) for s in steps]
    at = {r["step"]: r for r in rows}
    for step, r in at.items():
        assert r["from_start"] > r["first_run"] > 0, r
        assert r["layers"] == (5 if "2" in step or "3" in step else 1), r
        if step.startswith("restart"):  # loads what the step before it made
            assert r["made"]["compiles"] == 0 < r["made"]["loaded"], r
        else:  # cold, or an edit: the changed program compiled
            assert r["made"]["compiles"] > 0, r

    def ratios(field: str) -> list[float]:
        pairs = zip(steps[2::2], steps[3::2], strict=True)
        return [float(at[e][field]) / float(at[r][field]) for e, r in pairs]

    cells = [
        f"{a:.2f} ({b:.2f})" for a, b in zip(ratios("from_start"), ratios("first_run"), strict=True)
    ]
    line = "| 1 | jaxaot.jit, component layers | " + " | ".join(cells + ["–"] * 3) + " |"
    assert line in proc.stdout
    assert (out / "edits.md").read_text() in proc.stdout
    # The other contenders' worker branches: the loss of the same (cold) program.
    names = ["edit:remat_regional", "edit:jit_pcc", "edit:scan_pcc"]
    work = tmp_path / "work"
    work.mkdir()
    other = _workers(names, work, subprocess_env, width=8)
    losses = [other[name]["loss"] for name in names]
    assert losses == pytest.approx([at["cold"]["loss"]] * 3, rel=1e-4)
    assert any((work / "jax-pcc").iterdir()) and any((work / "jaxaot").iterdir())
