"""Warm-start benchmark (the same as ``jaxaot bench warm-start``).

Each contender runs in a fresh subprocess: plain jax.jit, jax.jit with JAX's
persistent compilation cache (cold and warm), a jax.export artifact, a jaxaot
component (cold and warm), and the physical limit (reading a serialized
executable and ``deserialize_and_load``). Writes ``warm_start.md``,
``warm_start.json`` and ``warm_start.png`` to ``--out`` where one is named.

    python benchmarks/warm_start.py                # L = 4 and 16
    python benchmarks/warm_start.py --full         # L = 4, 8, 16 and 48
"""

from __future__ import annotations

import argparse
import sys

from jaxaot.cli import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bench.add_arguments(parser)
    config = bench.config_from_args(parser.parse_args(["warm-start", *sys.argv[1:]]))
    print(bench.run(config, lambda message: print(message, file=sys.stderr)))
