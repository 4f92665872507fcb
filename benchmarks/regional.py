"""Regional-compilation depth sweep (the same as ``jaxaot bench regional``).

Train step of L transformer blocks, each contender cold in a fresh subprocess:
plain jax.jit, scan over stacked layers, jax.jit calling components, Equinox
``noinline`` layers (needs ``pip install equinox``), and ``jaxaot.jit``; plus
jax.jit with JAX's persistent cache warm and ``jaxaot.jit`` warm. Writes
``regional.md``, ``regional.json`` and ``regional.png`` (time to first result
against depth, log scale) to ``--out``.

    python benchmarks/regional.py            # L = 4, 8, 16, 32, 48
    python benchmarks/regional.py --quick    # L = 4, 8, 16
"""

from __future__ import annotations

import argparse
import sys

from jaxaot import _bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _bench.add_arguments(parser)
    args = parser.parse_args(["regional", *sys.argv[1:]])
    print(_bench.run(args, lambda message: print(message, file=sys.stderr)))
