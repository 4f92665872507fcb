"""Regional-compilation depth sweep (the same as ``jaxaot bench regional``).

Train step of L transformer blocks, each contender cold in a fresh subprocess:
plain jax.jit, scan over stacked layers, jax.jit calling components, Equinox
``noinline`` layers (needs ``pip install equinox``), and ``jaxaot.jit``; plus
jax.jit with JAX's persistent cache warm and ``jaxaot.jit`` warm. Writes
``regional.md``, ``regional.json`` and ``regional.png`` (time to first result
against depth, log scale) to ``--out`` where one is named.

    python benchmarks/regional.py            # L = 4, 8, 16, 32, 48
    python benchmarks/regional.py --quick    # L = 4, 8, 16
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
    config = bench.config_from_args(parser.parse_args(["regional", *sys.argv[1:]]))
    print(bench.run(config, lambda message: print(message, file=sys.stderr)))
