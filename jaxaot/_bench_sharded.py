"""``jaxaot bench sharded``: the regional suite's train step on a mesh of
simulated CPU devices.

Each contender runs in a fresh process (:func:`jaxaot._bench._run_worker`) that
gets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before it imports
JAX, builds a one-axis mesh ``("x",)`` of the ``N`` devices (automatic axes) and
places the benchmark model's inputs in one of two layouts:

* ``data-parallel``: the batch split over ``x``, the parameters replicated;
* ``fsdp``: the batch split over ``x`` and every parameter split over ``x`` on
  its first axis (for scan's stacked parameters, the first axis after the
  layer axis).

The contenders (``jax.jit`` of the unrolled step, ``jax.jit`` of a ``lax.scan``
over stacked layers, ``jaxaot.jit``, and the warm starts) are the regional
suite's, run by :func:`jaxaot._bench.worker` with this module's placement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

from . import _bench

LAYOUTS = ("data-parallel", "fsdp")

#: The regional suite's contenders that run here: name -> (label, preparation
#: contender or None).
SHARDED: dict[str, tuple[str, str | None]] = {
    name: _bench.REGIONAL[name]
    for name in ("jit_cold", "scan_cold", "regional_cold", "pcc_warm", "regional_warm")
}

#: ``--quick``: batch, sequence and width of the tiny model (the batch and the
#: width divisible by the default 8 devices), and its depths.
QUICK_SHAPE = "8,8,32"
QUICK_LAYERS = [2, 4]
DEFAULT_LAYERS = [4, 16, 48]

_LAYOUT_ENV = "JAXAOT_BENCH_LAYOUT"
_DEVICES_ENV = "JAXAOT_BENCH_DEVICES"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


# ----------------------------------------------------------------------------
# Worker side.


def _placement(layout: str, devices: int) -> _bench.Placement:
    """Where the benchmark's inputs go in ``layout`` on a one-axis mesh of ``devices``."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() != devices:
        raise RuntimeError(
            f"the worker sees {jax.device_count()} devices, not {devices}: "
            f"was {_DEVICE_FLAG} set before JAX was imported?"
        )
    mesh = jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Auto,))
    params = {
        ("data-parallel", "blocks"): P(),
        ("data-parallel", "stacked"): P(),
        ("fsdp", "blocks"): P("x"),
        ("fsdp", "stacked"): P(None, "x"),
    }

    def place(tree: Any, kind: str) -> Any:
        spec = P("x") if kind == "batch" else params[(layout, kind)]
        return jax.device_put(tree, NamedSharding(mesh, spec))

    return place


def worker_main(t_import: float) -> None:
    """Entry point of a worker process (``argv`` as :func:`jaxaot._bench.worker_main`;
    the layout and device count from the environment)."""
    place = _placement(os.environ[_LAYOUT_ENV], int(os.environ[_DEVICES_ENV]))
    _bench.worker_main(t_import, place)


# ----------------------------------------------------------------------------
# Parent side.


def worker_env(layout: str, devices: int) -> dict[str, str]:
    """The environment of a worker: the layout, and the device count in
    ``XLA_FLAGS`` (any other flags kept, any other device count replaced)."""
    flags = re.sub(rf"{_DEVICE_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    flags.append(f"{_DEVICE_FLAG}={devices}")
    return {_LAYOUT_ENV: layout, _DEVICES_ENV: str(devices), "XLA_FLAGS": " ".join(flags)}


class ArgumentError(ValueError):
    """Arguments the suite cannot run with (the CLI reports it in one line)."""


def _check(args: argparse.Namespace, layers: list[int], names: list[str]) -> None:
    unknown = sorted(set(names) - set(SHARDED))
    if unknown:
        raise ArgumentError(f"unknown contenders {unknown}; choose from {sorted(SHARDED)}")
    if _bench.BATCH % args.devices or _bench.WIDTH % args.devices:
        raise ArgumentError(
            f"batch {_bench.BATCH} and width {_bench.WIDTH} must be multiples of "
            f"--devices {args.devices} (the batch and the FSDP parameters are split over them)"
        )
    if not layers or min(layers) < 1:
        raise ArgumentError(f"--layers must be positive depths, not {layers}")


def _prefixed(log: _bench.Log, prefix: str, message: str) -> None:
    log(f"{prefix}, {message}")


def run_sharded(args: argparse.Namespace, out: Path, log: _bench.Log) -> str:
    """Runs the suite and writes ``sharded.json``, ``sharded.md`` and ``sharded.png``
    to ``out``; returns the Markdown."""
    layers = args.layers or (QUICK_LAYERS if args.quick else DEFAULT_LAYERS)
    names = args.contenders or list(SHARDED)
    _check(args, layers, names)
    table = {name: entry for name, entry in SHARDED.items() if name in names}
    max_jit = args.max_jit_layers

    def skip(name: str, depth: int) -> bool:
        return name in ("jit_cold", "pcc_warm") and depth > max_jit

    rows: list[dict[str, Any]] = []
    for layout in args.layouts or LAYOUTS:
        runner = partial(
            _bench._run_worker,
            module=__name__,
            extra_env=worker_env(layout, args.devices),
        )
        for row in _bench.run_contenders(
            table, layers, args.repeats, partial(_prefixed, log, layout), skip, runner
        ):
            row.update(layout=layout, devices=args.devices)
            rows.append(row)
        # After each layout, so that an interrupted run keeps what it measured.
        (out / "sharded.json").write_text(json.dumps(rows, indent=1))
    text = markdown(rows, args.devices)
    (out / "sharded.md").write_text(text)
    plot(rows, out / "sharded.png")
    return text


def markdown(rows: list[dict[str, Any]], devices: int) -> str:
    import jax

    lines = [
        f"Sharded benchmark, {datetime.date.today().isoformat()}, jax {jax.__version__}, "
        f"backend {jax.default_backend()}, {_bench.machine()}, {devices} simulated devices "
        f"(one mesh axis). Model width {_bench.WIDTH}, batch {_bench.BATCH}, sequence "
        f"{_bench.SEQ}; train step (value_and_grad) of L blocks. data-parallel: batch split, "
        "parameters replicated; fsdp: batch split, every parameter split on its first axis. "
        "Seconds, except the steady step (ms); columns as in the regional suite.",
        "",
        *_bench.stage_table(rows, lead=(("layout", "layout"),)),
        "",
        "Ratios (same run):",
        "",
    ]
    by = {(r["layout"], r["layers"], r["contender"]): r for r in rows}
    for layout, depth in sorted({(r["layout"], r["layers"]) for r in rows}):

        def row(name: str, key: tuple[str, int] = (layout, depth)) -> _bench.Row | None:
            return by.get((*key, name))

        regional = row("regional_cold")
        best = _bench.best_steady(row("jit_cold"), row("scan_cold"))
        lines.append(
            f"- {layout}, L={depth}: first result, jaxaot.jit cold / scan cold = "
            f"{_bench.ratio(regional, row('scan_cold'))}, / jax.jit cold = "
            f"{_bench.ratio(regional, row('jit_cold'))}; steady step, jaxaot.jit / best of "
            f"jax.jit and scan ({best['label'].split(',')[0] if best else '–'}) = "
            f"{_bench.ratio(regional, best, 'steady')}; warm / cold: jaxaot.jit = "
            f"{_bench.ratio(row('regional_warm'), regional)}, jax.jit + JAX cache = "
            f"{_bench.ratio(row('pcc_warm'), row('jit_cold'))}"
        )
        lines += _bench.steady_state_line(regional)
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, note: str | None = None) -> None:
    """Time to first result against depth, one panel per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = [lo for lo in LAYOUTS if any(r["layout"] == lo for r in rows)]
    fig, axes = plt.subplots(
        1, len(layouts), figsize=(6.5 * len(layouts), 5), squeeze=False, sharey=True
    )
    devices = rows[0]["devices"] if rows else 0
    for ax, layout in zip(axes[0], layouts, strict=True):
        sub = [r for r in rows if r["layout"] == layout]
        _bench.depth_axes(ax, sub, SHARDED, f"Train step on {devices} devices, {layout}")
    _bench.save_figure(fig, path, note)
