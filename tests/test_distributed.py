"""One compile per job: 4 CPU processes joined by jax.distributed on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    pid, n, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid,
                               initialization_timeout=120)
    import jax.numpy as jnp
    import jaxaot

    traces = []

    @jaxaot.component(key="dist-block")
    def block(w, x):
        traces.append(1)
        return jnp.tanh(x @ w)

    def loss(w, x):
        return jnp.sum(block(w, block(w, x)) ** 2)

    w = jnp.eye(4) * 0.5 + 0.1
    x = jnp.arange(8.0).reshape(2, 4) / 8
    top = block(w, x)
    value, grad = jax.jit(jax.value_and_grad(loss))(w, x)
    info = block.cache_info()
    print(json.dumps({"pid": pid, "traces": len(traces), "compiles": info.compiles,
                      "top": top.tolist(), "value": float(value), "grad": grad.tolist()}))
    jax.distributed.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(tmp_path: Path, env: dict[str, str], n: int = 4) -> list[dict[str, Any]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    procs = []
    for pid in range(n):
        penv = dict(env)
        penv["JAXAOT_CACHE_DIR"] = str(tmp_path / f"cache-{pid}")  # a cold cache per process
        penv["JAXAOT_DISTRIBUTED_TIMEOUT"] = "120"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(pid), str(n), str(port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=penv,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_each_signature_is_made_once_per_job(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    cold = _job(tmp_path, subprocess_env)
    assert sum(r["traces"] for r in cold) == 1, cold
    # Top-level executables are bound to each process's device: one compile each.
    assert [r["compiles"] for r in cold] == [1, 1, 1, 1], cold
    for r in cold[1:]:
        np.testing.assert_array_equal(r["top"], cold[0]["top"])
        assert r["value"] == cold[0]["value"]
        np.testing.assert_array_equal(r["grad"], cold[0]["grad"])
    warm = _job(tmp_path, subprocess_env)
    assert sum(r["traces"] for r in warm) == 0, warm
    assert sum(r["compiles"] for r in warm) == 0, warm
    assert warm[0]["value"] == cold[0]["value"]
    assert all(os.listdir(tmp_path / f"cache-{pid}") for pid in range(4))


SLOW_LEADER = textwrap.dedent(
    """
    import json, os, sys, time
    import jax
    jax.config.update("jax_platforms", "cpu")
    pid, n, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid,
                               initialization_timeout=120)
    import jax.numpy as jnp
    import jaxaot

    traces = []

    @jaxaot.component(key="dist-slow")
    def f(x):
        traces.append(1)
        if pid == 0 and os.environ.get("LEADER_FAILS") == "1":
            raise RuntimeError("process 0 cannot make this entry")
        return jnp.cos(x) * 3

    x = jnp.arange(4.0)  # every process's backend is up (backend start-up is collective)
    if pid == 0 and os.environ.get("LEADER_FAILS") != "1":
        time.sleep(8)  # longer than the others wait
    try:
        value = jax.jit(lambda v: f(v) + 1)(x).tolist()
    except RuntimeError:
        value = None
    print(json.dumps({"pid": pid, "traces": len(traces), "value": value}))
    sys.stdout.flush()
    # As a job ends: process 0 hosts the coordination service, and a process
    # whose coordinator vanishes while it still talks to it is aborted by the
    # runtime (SIGABRT). The shutdown barrier keeps process 0 up until every
    # process is done.
    jax.distributed.shutdown()
    os._exit(0)
    """
)


@pytest.mark.parametrize("leader_fails", [False, True], ids=["leader-too-slow", "leader-fails"])
def test_waiters_make_the_entry_themselves(
    tmp_path: Path, subprocess_env: dict[str, str], leader_fails: bool
) -> None:
    script = tmp_path / "slow.py"
    script.write_text(SLOW_LEADER)
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(subprocess_env)
        env["JAXAOT_CACHE_DIR"] = str(tmp_path / f"cache-{pid}")
        env["JAXAOT_DISTRIBUTED_TIMEOUT"] = "2"
        env["LEADER_FAILS"] = "1" if leader_fails else "0"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(pid), "2", str(port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    leader, waiter = results
    expected = (np.cos(np.arange(4.0)) * 3 + 1).tolist()
    assert waiter["traces"] == 1, results  # made it itself, after the timeout or failure
    np.testing.assert_allclose(waiter["value"], expected, rtol=1e-6)
    if leader_fails:
        assert leader["value"] is None
    else:
        np.testing.assert_allclose(leader["value"], expected, rtol=1e-6)
