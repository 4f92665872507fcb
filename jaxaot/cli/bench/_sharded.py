"""``jaxaot bench sharded``: the regional suite's step on a mesh of simulated CPU
devices, for each layout and axis type asked for.

Each contender runs in a fresh process that gets
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before it imports JAX
(:func:`._runner.worker_env`), builds the mesh of its :class:`~._config.MeshLayout`
and places the model's inputs there (:mod:`._mesh`). The contenders are the
regional suite's ``jax.jit``, scan over stacked layers and ``jaxaot.jit``, cold
and warm, and the warm-start suite's physical limit (reading and loading the
executable of the step calling component blocks). The report gives, for each
axis type, layout and depth: ``jaxaot.jit`` cold against scan, its steady step
against the better of ``jax.jit`` and scan, and its warm first result against
the physical limit.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from . import _runner
from ._config import (
    AXIS_TYPES,
    LAYOUTS,
    SHARDED,
    ArgumentError,
    BenchConfig,
    Job,
    MeshLayout,
    ModelShape,
    saved,
)
from ._plots import depth_axes, save_figure
from ._report import best_steady, header, model_sentence, ratio, stage_table, steady_state_line
from ._runner import Log, Row

__all__ = ["DEFAULT_LAYERS", "QUICK_LAYERS", "markdown", "plot", "run_sharded"]

QUICK_LAYERS = [2, 4]
DEFAULT_LAYERS = [4, 16, 48]

#: Contenders that compile the whole unrolled step (``--max-jit-layers``).
_WHOLE_PROGRAM = ("jit_cold", "pcc_warm", "limit")

_LAYOUT_TEXT = {
    "data-parallel": "data-parallel: batch split over one data axis, parameters replicated",
    "fsdp": "fsdp: batch split, every parameter split on its first axis (one data axis)",
    "2d": "2d: a data x model mesh (model 2), batch split on data, the attention and MLP "
    "weights on model (qkv and up by columns, proj and down by rows)",
}


def _prefixed(log: Log, prefix: str, message: str) -> None:
    log(f"{prefix}, {message}")


def _meshes(config: BenchConfig) -> list[MeshLayout]:
    return [
        MeshLayout(layout, config.devices, axes)
        for axes in config.axis_types or AXIS_TYPES
        for layout in config.layouts or LAYOUTS
    ]


def _check(config: BenchConfig, shape: ModelShape, layers: list[int], names: list[str]) -> None:
    unknown = sorted(set(names) - set(SHARDED))
    if unknown:
        raise ArgumentError(f"unknown contenders {unknown}; choose from {sorted(SHARDED)}")
    for mesh in _meshes(config):
        mesh.check(shape)
    if not layers or min(layers) < 1:
        raise ArgumentError(f"--layers must be positive depths, not {layers}")


def run_sharded(config: BenchConfig, log: Log) -> str:
    """Runs the suite and writes ``sharded.json``, ``sharded.md`` and ``sharded.png``
    to ``config.out``; returns the Markdown."""
    shape = config.shape("sharded")
    layers = list(config.layers or (QUICK_LAYERS if config.quick else DEFAULT_LAYERS))
    names = list(config.contenders or SHARDED)
    _check(config, shape, layers, names)
    table = {name: entry for name, entry in SHARDED.items() if name in names}

    def skip(name: str, depth: int) -> bool:
        return name in _WHOLE_PROGRAM and depth > config.max_jit_layers

    rows: list[Row] = []
    for mesh in _meshes(config):
        job = Job("", 0, "", config.repeats, shape, mesh)
        prefixed = partial(_prefixed, log, f"{mesh.layout}, {mesh.axis_types} axes")
        for row in _runner.run_contenders(table, job, layers, prefixed, skip):
            row.update(layout=mesh.layout, axis_types=mesh.axis_types, devices=mesh.devices)
            rows.append(row)
        # After each mesh, so that an interrupted run keeps what it measured.
        if data := saved(config, "sharded.json"):
            data.write_text(json.dumps(rows, indent=1))
    text = markdown(rows, shape, config.devices)
    if markdown_file := saved(config, "sharded.md"):
        markdown_file.write_text(text)
    if png := saved(config, "sharded.png"):
        plot(rows, png)
    return text


def _groups(rows: list[Row]) -> list[tuple[str, str, int]]:
    """(axis types, layout, depth) of the rows, in the suite's order."""
    seen = {(r["axis_types"], r["layout"], r["layers"]) for r in rows}
    return sorted(seen, key=lambda g: (AXIS_TYPES.index(g[0]), LAYOUTS.index(g[1]), g[2]))


def markdown(rows: list[Row], shape: ModelShape, devices: int) -> str:
    """The suite's report: every stage, then per axis type the ratios at each layout
    and depth, and a table of the three ratios that matter."""
    layouts = [lo for lo in LAYOUTS if any(r["layout"] == lo for r in rows)]
    lines = [
        f"{header('Sharded benchmark', 'cpu')}, {devices} simulated devices. {model_sentence(shape)}. "
        + "; ".join(_LAYOUT_TEXT[lo] for lo in layouts)
        + ". Axis types: explicit (jax.make_mesh's default: shardings in the types, inputs "
        "placed and the step traced under jax.set_mesh) or auto (XLA propagates them). "
        "Seconds, except the steady step (ms); columns as in the regional suite.",
        "",
        *stage_table(rows, lead=(("axes", "axis_types"), ("layout", "layout"))),
        "",
        "Ratios (same run):",
    ]
    by = {(r["axis_types"], r["layout"], r["layers"], r["contender"]): r for r in rows}
    summary = []
    for axes in [a for a in AXIS_TYPES if any(r["axis_types"] == a for r in rows)]:
        lines += ["", f"{axes.capitalize()} axes:", ""]
        for group in [g for g in _groups(rows) if g[0] == axes]:
            ratios = _Ratios({name: by.get((*group, name)) for name in SHARDED})
            lines += ratios.lines(group[1], group[2])
            summary.append(f"| {' | '.join(str(g) for g in group)} | {ratios.summary()} |")
    lines += [
        "",
        "| axes | layout | L | jaxaot.jit cold / scan cold | steady step, jaxaot.jit / best "
        "of jax.jit and scan | jaxaot.jit warm / physical limit |",
        "|---|---|---|---|---|---|",
        *summary,
    ]
    return "\n".join(lines) + "\n"


class _Ratios:
    """The ratios of one axis type, layout and depth (its rows by contender)."""

    def __init__(self, rows: dict[str, Row | None]) -> None:
        self.rows = rows
        self.regional = rows["regional_cold"]
        self.best = best_steady(rows["jit_cold"], rows["scan_cold"])

    def summary(self) -> str:
        return " | ".join(
            [
                ratio(self.regional, self.rows["scan_cold"]),
                ratio(self.regional, self.best, "steady"),
                ratio(self.rows["regional_warm"], self.rows["limit"]),
            ]
        )

    def lines(self, layout: str, depth: int) -> list[str]:
        row, regional, best = self.rows, self.regional, self.best
        best_name = best["label"].split(",")[0] if best else "–"
        return [
            f"- {layout}, L={depth}: first result, jaxaot.jit cold / scan cold = "
            f"{ratio(regional, row['scan_cold'])}, / jax.jit cold = "
            f"{ratio(regional, row['jit_cold'])}; steady step, jaxaot.jit / best of "
            f"jax.jit and scan ({best_name}) = {ratio(regional, best, 'steady')}; "
            f"warm / cold: jaxaot.jit = {ratio(row['regional_warm'], regional)}, "
            f"jax.jit + JAX cache = {ratio(row['pcc_warm'], row['jit_cold'])}; "
            f"warm first result, jaxaot.jit / physical limit = "
            f"{ratio(row['regional_warm'], row['limit'])}",
            *steady_state_line(regional),
        ]


def plot(rows: list[Row], path: Path, note: str | None = None) -> None:
    """Time to first result against depth: a row of panels per axis type, one
    panel per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = [lo for lo in LAYOUTS if any(r["layout"] == lo for r in rows)]
    kinds = [a for a in AXIS_TYPES if any(r["axis_types"] == a for r in rows)]
    fig, axes = plt.subplots(
        len(kinds),
        len(layouts),
        figsize=(6.5 * len(layouts), 5 * len(kinds)),
        squeeze=False,
        sharey=True,
    )
    devices = rows[0]["devices"] if rows else 0
    for panels, kind in zip(axes, kinds, strict=True):
        for ax, layout in zip(panels, layouts, strict=True):
            sub = [r for r in rows if r["layout"] == layout and r["axis_types"] == kind]
            title = f"Train step on {devices} devices, {layout}, {kind} axes"
            depth_axes(ax, sub, SHARDED, title)
    save_figure(fig, path, note)
