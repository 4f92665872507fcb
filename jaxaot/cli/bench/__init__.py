"""``jaxaot bench``: the warm-start, regional-compilation, sharded, fleet and
research-loop (edits) benchmarks.

Every contender runs in its own fresh Python process, so that nothing warm in
one process helps another; prepared artifacts (JAX's persistent cache, a
``jax.export`` artifact, a serialized executable, a jaxaot cache) live in a work
folder shared by the processes of one trial. Each worker prints one JSON line
of timings; the parent prints Markdown tables, and writes them with JSON and PNG
plots to the folder ``--out`` names (none by default).

A run is configured by one value, a :class:`BenchConfig` (the command line
builds it from its options); each worker gets its :class:`~._config.Job`
(contender, depth, model shape, mesh) as JSON on its command line. Nothing is
configured through module globals or the environment.

Layout:

* :mod:`._config`: the model's shape, the sharded suite's meshes, a worker's
  job, the run's settings, each suite's contenders;
* :mod:`._worker`: the timing worker (one contender, in a fresh process), with
  :mod:`._measure` (how it times) and :mod:`._mesh` / :mod:`._blocks` (the
  sharded suite's meshes, placements and explicit-axes blocks);
* :mod:`._runner`: worker processes, preparations, trials and their medians;
* :mod:`._report` and :mod:`._plots`: Markdown tables and ratios, PNG plots;
* :mod:`._suites`: the warm-start and regional suites; :mod:`._sharded`: the
  sharded suite; :mod:`._fleet`: the fleet suite; :mod:`._precompile`: the
  precompile suite, with its model, manifests and worker in :mod:`._serving`;
  :mod:`._edits`: the research loop (edits and restarts);
* :mod:`._command`: the options, the config they make, the extras check.
"""

from __future__ import annotations

from ._command import BENCH, add_arguments, config_from_args
from ._config import BenchConfig, MeshLayout, ModelShape
from ._runner import Log

__all__ = [
    "BENCH",
    "BenchConfig",
    "MeshLayout",
    "ModelShape",
    "add_arguments",
    "config_from_args",
    "run",
]


def run(config: BenchConfig, log: Log) -> str:
    """Runs the suites ``config`` names and writes their files; returns their Markdown."""
    from ._suites import run as run_suites

    return run_suites(config, log)
