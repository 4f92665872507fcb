"""A training loop under ``jaxaot.jit`` for ``tests/test_whole.py``: run as
``python _form_worker.py STEPS FORM[,FORM]`` in a fresh interpreter (FORM
``whole``: the program as it is; ``split``: its threshold lowered so that its
layers count as big; several forms run one after another, each with its own
``jaxaot.jit``). Prints one JSON line: for each form, the form the plan took, each
step's loss as the bits of its float32, and what it compiled and loaded."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from _steps import block, setup, train_step_factory

import jaxaot
from jaxaot._regional import _whole


def main(steps: int, form: str) -> dict[str, object]:
    threshold = _whole.WHOLE_BELOW
    _whole.WHOLE_BELOW = 1.0 if form == "split" else threshold
    step, optimizer = train_step_factory(block)
    blocks, x = setup(4)
    state = optimizer.init(blocks)
    regional = jaxaot.jit(step, donate_argnums=(0, 1))
    before = jaxaot.stats()
    losses = []
    for _ in range(steps):
        blocks, state, loss = regional(blocks, state, x)
        losses.append(int(np.asarray(loss, np.float32).view(np.uint32)))
    (plan,) = regional._plans.values()
    jaxaot.wait_for_writes()
    _whole.WHOLE_BELOW = threshold
    stats = jaxaot.stats()
    return {
        "mode": plan.mode,
        "losses": losses,
        "compiles": stats["compiles"] - before["compiles"],
        "loaded": stats["loaded"] - before["loaded"],
        "backend": jax.default_backend(),
    }


if __name__ == "__main__":
    steps = int(sys.argv[1])
    print(json.dumps({form: main(steps, form) for form in sys.argv[2].split(",")}))
