"""The benchmarks' plots (PNG, by matplotlib with the Agg backend): the warm-start
suite's stages as stacked bars, and time to first result against depth for the
regional and sharded suites. Each figure carries the date and machine of its
numbers."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from ._config import CONTENDERS, REGIONAL, Table
from ._measure import PHASES
from ._report import setting
from ._runner import Row

__all__ = ["depth_axes", "figure_note", "regional_plot", "save_figure", "warm_start_plot"]


#: What each contender's "compile" phase is: a real compile, one call that
#: traces, lowers and compiles (``Component.precompile`` on a cold cache), or a
#: load of a stored executable.
STAGE_OF_COMPILE = {
    "jaxaot_cold": "trace+lower+compile",
    "jaxaot_warm": "load",
    "pcc_warm": "load",
    "limit": "load",
}
STAGE_COLORS = {
    "trace": "#4c72b0",
    "lower": "#55a868",
    "compile": "#c44e52",
    "trace+lower+compile": "#dd8452",
    "load": "#937860",
    "first run": "#8172b2",
}


def _stage_bar(ax: Any, y: int, name: str, row: Row, labelled: set[str]) -> None:
    """One contender's stages as one stacked bar at ``y`` (each stage named in the
    legend once: ``labelled`` holds those already named)."""
    left = 0.0
    for phase in PHASES:
        value = float(row.get(phase) or 0.0)
        if value <= 0:
            continue
        stage = STAGE_OF_COMPILE.get(name, "compile") if phase == "compile" else phase
        stage = stage.replace("_", " ")
        ax.barh(
            y,
            value,
            left=left,
            color=STAGE_COLORS[stage],
            label=None if stage in labelled else stage,
        )
        labelled.add(stage)
        left += value


def figure_note(date: str | None = None) -> str:
    """The date, JAX version, platform and machine a figure's numbers come from."""
    return f"{date or datetime.date.today().isoformat()}, {setting()}"


def warm_start_plot(rows: list[Row], path: Path, note: str | None = None) -> None:
    """Stacked bars of each contender's stages, one panel per depth, one seconds scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r["layers"] for r in rows})
    names = [n for n in CONTENDERS if any(r["contender"] == n for r in rows)]
    fig, axes = plt.subplots(
        1, len(depths), figsize=(6 * len(depths), 5.2), squeeze=False, sharex=True
    )
    labelled: set[str] = set()
    for ax, depth in zip(axes[0], depths, strict=True):
        sub = {r["contender"]: r for r in rows if r["layers"] == depth}
        for y, name in enumerate(names):
            _stage_bar(ax, y, name, sub.get(name) or {}, labelled)
        ax.set_yticks(range(len(names)), [CONTENDERS[n][0] for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds to first result (same scale in every panel)")
        ax.set_title(f"train step, {depth} layers")
        ax.grid(True, axis="x", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    order = [s for s in STAGE_COLORS if s in labels]
    fig.legend(
        [handles[labels.index(s)] for s in order],
        order,
        loc="lower right",
        fontsize=8,
        ncol=len(order),
    )
    fig.suptitle(f"Warm start: time to first result by stage ({note or figure_note()})", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def depth_axes(ax: Any, rows: list[Row], table: Table, title: str) -> None:
    """One line per contender of ``table``: time to first result against depth
    (log-log), ticked at the depths run."""
    from matplotlib.ticker import NullLocator

    for name, (label, _) in table.items():
        pts = sorted((r["layers"], r["first_result"]) for r in rows if r["contender"] == name)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    depths = sorted({r["layers"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel("seconds to first result (log)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig: Any, path: Path, note: str | None) -> None:
    """Writes ``fig`` with the date and machine of its numbers in a corner."""
    import matplotlib.pyplot as plt

    fig.text(0.01, 0.01, note or figure_note(), fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def regional_plot(
    rows: list[Row], path: Path, note: str | None = None, table: Table | None = None
) -> None:
    """Time to first result against depth, one line per contender, ticks at the depths run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    depth_axes(
        ax,
        rows,
        REGIONAL if table is None else table,
        "Train step: time to first result against depth",
    )
    save_figure(fig, path, note)
