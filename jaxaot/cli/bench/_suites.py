"""The suites a ``jaxaot bench`` run is made of: what each runs (its contenders,
depths and model, from the :class:`~._config.BenchConfig`) and the files each
writes to ``config.out`` where one is named (``<suite>.md``, ``.json``, ``.png``)."""

from __future__ import annotations

from . import _config, _runner
from ._config import BenchConfig, Job, saved, write
from ._plots import regional_plot, warm_start_plot
from ._report import regional_markdown, warm_start_markdown
from ._runner import Log

__all__ = ["run"]


def run(config: BenchConfig, log: Log) -> str:
    """Runs the suites ``config.suite`` names; returns their Markdown."""
    texts = []
    if config.suite in ("warm-start", "all"):
        texts.append(_warm_start(config, log))
    if config.suite in ("regional", "all"):
        texts.append(_regional(config, log))
    if config.suite == "sharded":
        from ._sharded import run_sharded

        texts.append(run_sharded(config, log))
    if config.suite == "fleet":
        from ._fleet import run_fleet

        texts.append(run_fleet(config, log))
    if config.suite == "precompile":
        from ._precompile import run_precompile

        texts.append(run_precompile(config, log))
    if config.suite == "edits":
        from ._edits import run_edits

        texts.append(run_edits(config, log))
    return "\n".join(texts)


def _warm_start(config: BenchConfig, log: Log) -> str:
    layers = config.layers or ([4, 8, 16, 48] if config.full else [4, 16])
    job = Job("", 0, "", config.repeats, config.shape("warm-start"))
    rows = _runner.run_contenders(_config.CONTENDERS, job, layers, log)
    text = warm_start_markdown(rows)
    write(config, "warm_start", rows, text)
    if png := saved(config, "warm_start.png"):
        warm_start_plot(rows, png)
    return text


def _have_equinox() -> bool:
    try:
        import equinox  # noqa: F401
    except ImportError:
        return False
    return True


def _regional(config: BenchConfig, log: Log) -> str:
    layers = config.layers or ([4, 8, 16] if config.quick else [4, 8, 16, 32, 48])
    have_equinox = _have_equinox()
    if not have_equinox:
        log("equinox is not installed: skipping the noinline contender (pip install equinox)")

    def skip(name: str, depth: int) -> bool:
        if name == "noinline_cold" and not have_equinox:
            return True
        if config.contenders is not None and name not in config.contenders:
            return True
        whole = name in ("jit_cold", "jit_components_cold", "pcc_warm", "remat_jit_cold")
        return whole and depth > config.max_jit_layers

    shape = config.shape("regional")
    table = _config.REGIONAL  # looked up when run
    unknown = sorted(set(config.contenders or ()) - set(table))
    if unknown:
        raise _config.ArgumentError(f"unknown contenders {unknown}; choose from {sorted(table)}")
    job = Job("", 0, "", config.repeats, shape)
    rows = _runner.run_contenders(table, job, layers, log, skip, trials=config.trials)
    text = regional_markdown(rows, shape)
    write(config, "regional", rows, text)
    if png := saved(config, "regional.png"):
        regional_plot(rows, png, table=table)
    return text
