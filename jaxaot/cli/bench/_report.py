"""The benchmarks' Markdown: the table of stages every suite prints, the ratios,
and the warm-start and regional suites' reports (the sharded suite's is in
:mod:`._sharded`)."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable, Sequence

from ._config import ModelShape
from ._runner import Row, worker_env

__all__ = [
    "best_steady",
    "header",
    "machine",
    "model_sentence",
    "ratio",
    "regional_markdown",
    "stage_table",
    "steady_state_line",
    "table_head",
    "trial_ratios",
    "trials_sentence",
    "warm_start_markdown",
]


def _fmt(t: float | None) -> str:
    return "–" if t is None else f"{t:.2f}"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def setting(platform: str | None = None) -> str:
    """``jax VERSION, platform P, MACHINE``: what a run's figures come from.
    ``platform``: the workers' (default: what :func:`._runner.worker_env` gives
    them), named without starting JAX here: this process would hold an
    accelerator the workers need (most of a GPU's memory)."""
    from importlib.metadata import version

    if platform is None:
        platform = worker_env(None)["JAX_PLATFORMS"]
    return f"jax {version('jax')}, platform {platform}, {machine()}"


def header(title: str, platform: str | None = None) -> str:
    """The first words of a report: what, when, on which JAX, platform and machine."""
    return f"{title}, {datetime.date.today().isoformat()}, {setting(platform)}"


def warm_start_markdown(rows: list[Row]) -> str:
    """The warm-start suite's report: every stage of every contender, and the ratios."""

    lines = [
        f"{header('Warm-start benchmark')}. Times in seconds; "
        "time to first result = trace + lower + compile/load + first run "
        "(import and parameter initialisation excluded).",
        "",
        "| L | contender | import | trace | lower | compile / load | first run | first result | steady step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        label = r["label"]
        lines.append(
            f"| {r['layers']} | {label} | {_fmt(r['import'])} | {_fmt(r['trace'])} | {_fmt(r['lower'])} | "
            f"{_fmt(r['compile'])} | {_fmt(r['first_run'])} | **{_fmt(r['first_result'])}** | {_fmt(r['steady'])} |"
        )
    lines += ["", "Ratios (same run):", ""]
    by = {(r["layers"], r["contender"]): r for r in rows}
    for depth in sorted({r["layers"] for r in rows}):

        def get(name: str, field: str = "first_result", depth: int = depth) -> float:
            return float(by[(depth, name)][field])

        lines.append(
            f"- L={depth}: jaxaot warm / physical limit = {get('jaxaot_warm') / get('limit'):.2f}; "
            f"jaxaot warm / jit+JAX cache warm = {get('jaxaot_warm') / get('pcc_warm'):.2f}; "
            f"jaxaot cold / jit cold = {get('jaxaot_cold') / get('jit_cold'):.2f}; "
            f"steady step, jit with components / plain jit = "
            f"{get('jit_components_cold', 'steady') / get('jit_cold', 'steady'):.3f}"
        )
    lines.append(
        "\njaxaot cold's compile/load column includes its trace and lowering (one call: "
        "`Component.precompile`); export's trace column includes reading and deserializing the artifact."
    )
    return "\n".join(lines) + "\n"


def _ms(t: float | None) -> str:
    return "–" if t is None else f"{t * 1e3:.3g}"


def table_head(head: Sequence[str]) -> list[str]:
    """A Markdown table's header row and rule."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]


def stage_table(rows: list[Row], lead: Sequence[tuple[str, str]] = ()) -> list[str]:
    """The Markdown table of each row's stages, first result and steady step (ms),
    after the ``lead`` columns (header, row field) and the depth."""
    head = [h for h, _ in lead] + ["L", "contender", "trace", "lower", "compile / load"]
    head += ["first run", "first result", "steady step (ms)"]
    lines = table_head(head)
    for r in rows:
        cells = [str(r[field]) for _, field in lead] + [str(r["layers"]), r["label"]]
        cells += [_fmt(r[p]) for p in ("trace", "lower", "compile", "first_run")]
        cells += [f"**{_fmt(r['first_result'])}**", _ms(r["steady"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ratio(a: Row | None, b: Row | None, field: str = "first_result") -> str:
    """``a[field] / b[field]`` to two decimals, or a dash when either row is missing."""
    if a is None or b is None:
        return "–"
    return f"{float(a[field]) / float(b[field]):.2f}"


def best_steady(*rows: Row | None) -> Row | None:
    """The row (of those present) with the fastest steady step."""
    present = [r for r in rows if r is not None]
    return min(present, key=lambda r: float(r["steady"]), default=None)


def steady_state_line(regional: Row | None) -> list[str]:
    """The form a ``jaxaot.jit`` contender runs, as one list item."""
    if not regional or not regional.get("mode"):
        return []
    if regional["mode"] == "whole":
        return ["  - jaxaot.jit runs the whole program: one executable"]
    return [f"  - jaxaot.jit runs the split program: {regional.get('steps')} executables"]


def early_line(regional: Row | None, best: Row | None, process: str = "") -> list[str]:
    """The early steps of a ``jaxaot.jit`` contender (the calls right after the
    first, before its steady state is chosen), and the settled steady step, each
    against the best steady contender; ``process`` names a warm one."""
    if not regional or regional.get("early") is None:
        return []
    against = ""
    if best is not None and best.get("steady"):
        against = (
            f" = {regional['early'] / best['steady']:.2f}x the best steady contender; "
            f"settled steady step {_ms(regional.get('steady'))} ms = "
            f"{(regional.get('steady') or 0.0) / best['steady']:.2f}x"
        )
    return [
        f"  - {process}early steps: median of the {regional.get('early_n')} calls after the first "
        f"{_ms(regional['early'])} ms{against}"
    ]


def model_sentence(shape: ModelShape) -> str:
    """The model and step a report's figures are of."""
    return (
        f"Model width {shape.width}, batch {shape.batch}, sequence {shape.seq}; "
        f"{shape.step_text()} of L blocks"
    )


def regional_markdown(rows: list[Row], shape: ModelShape) -> str:
    """The regional suite's report: the stages, then the ratios at each depth."""
    lines = [
        f"{header('Regional-compilation benchmark')}. {model_sentence(shape)}. "
        "Seconds, except the steady step (ms). "
        "jaxaot.jit's trace column is its first call's trace and split; the rest of "
        "that call (compiling or loading executables on background threads while the steps "
        "whose executables are ready already run) is its first run. Its steady step is "
        "measured once it has chosen between its split program and its whole-program form"
        " and its background work (cache writes, executables being loaded) is done."
        + trials_sentence(rows),
        "",
        *stage_table(rows),
    ]
    by = {(r["layers"], r["contender"]): r for r in rows}
    lines += ["", "Ratios (same run):", ""]
    for depth in sorted({r["layers"] for r in rows}):

        def row(name: str, depth: int = depth) -> Row | None:
            return by.get((depth, name))

        regional = row("regional_cold")
        best = best_steady(row("jit_cold"), row("scan_cold"))
        steady = ratio(regional, best, "steady") if best else "–"
        if regional is None and best is None:
            lines += _remat_lines(depth, row)
            continue
        lines.append(
            f"- L={depth}: first result, jaxaot.jit / scan = {ratio(regional, row('scan_cold'))}, "
            f"/ noinline = {ratio(regional, row('noinline_cold'))}, / jax.jit = {ratio(regional, row('jit_cold'))}; "
            f"warm jaxaot.jit / warm jit+JAX cache = {ratio(row('regional_warm'), row('pcc_warm'))}; "
            f"steady step / best of jit and scan = {steady}, "
            f"/ jax.jit = {ratio(regional, row('jit_cold'), 'steady')}"
        )
        if regional and "trials" in regional:
            lines.append(
                "  - per trial, jaxaot.jit / scan: first result "
                f"{trial_ratios(regional, row('scan_cold'), 'first_result')}; steady step "
                f"{trial_ratios(regional, row('scan_cold'), 'steady')}"
            )
        lines += steady_state_line(regional)
        lines += early_line(regional, best)
        lines += early_line(row("regional_warm"), best, "warm process, ")
        lines += _remat_lines(depth, row)
    return "\n".join(lines) + "\n"


def _remat_lines(depth: int, row: Callable[[str], Row | None]) -> list[str]:
    """The ratios of the remat'd-layers contenders at ``depth`` (none without them)."""
    remat = row("remat_regional_cold")
    if remat is None:
        return []
    best = best_steady(row("remat_jit_cold"), row("remat_scan_cold"))
    warm, limit = row("remat_regional_warm"), row("remat_limit")
    lines = [
        f"- L={depth}, remat'd layers (no annotation): first result, jaxaot.jit / scan = "
        f"{ratio(remat, row('remat_scan_cold'))}, / jax.jit = "
        f"{ratio(remat, row('remat_jit_cold'))}; steady step / best of jit and scan = "
        f"{ratio(remat, best, 'steady') if best else '–'}; warm first result"
        f" / physical limit = {ratio(warm, limit)}"
    ]
    if "trials" in remat:
        lines.append(
            "  - per trial: first result, jaxaot.jit / scan "
            f"{trial_ratios(remat, row('remat_scan_cold'), 'first_result')}; warm / physical "
            f"limit {trial_ratios(warm, limit, 'first_result')}"
        )
    return [*lines, *steady_state_line(remat), *early_line(remat, best)]


def trials_sentence(rows: Sequence[Row]) -> str:
    """Says how many trials each figure is the median of ('' for one trial)."""
    n = max((len(r.get("trials", ())) for r in rows), default=0)
    if n < 2:
        return ""
    return (
        f" Each figure is the median of {n} trials: the contenders ran in turn, each in a "
        "fresh process, then again."
    )


def trial_ratios(a: Row | None, b: Row | None, field: str) -> str:
    """``a[field] / b[field]`` trial by trial, to two decimals ('–' without trials)."""
    if not a or not b or "trials" not in a or "trials" not in b:
        return "–"
    pairs = zip(a["trials"], b["trials"], strict=False)
    return ", ".join(f"{float(x[field]) / float(y[field]):.2f}" for x, y in pairs)
