"""A training loop under ``jaxaot.jit`` for ``tests/test_whole.py``: run as
``python _form_worker.py STEPS FORM`` in a fresh interpreter (FORM ``whole``:
the program as it is; ``split``: its threshold lowered so that its layers count
as big). Prints one JSON line: the form the plan took, each step's loss as the
bits of its float32, and what this process compiled and loaded."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from _steps import block, setup, train_step_factory

import jaxaot
from jaxaot._regional import _whole


def main(steps: int, form: str) -> dict[str, object]:
    if form == "split":
        _whole.WHOLE_BELOW = 1.0
    step, optimizer = train_step_factory(block)
    blocks, x = setup(4)
    state = optimizer.init(blocks)
    regional = jaxaot.jit(step, donate_argnums=(0, 1))
    losses = []
    for _ in range(steps):
        blocks, state, loss = regional(blocks, state, x)
        losses.append(int(np.asarray(loss, np.float32).view(np.uint32)))
    (plan,) = regional._plans.values()
    jaxaot.wait_for_writes()
    stats = jaxaot.stats()
    return {
        "mode": plan.mode,
        "losses": losses,
        "compiles": stats["compiles"],
        "loaded": stats["loaded"],
        "backend": jax.default_backend(),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2])))
