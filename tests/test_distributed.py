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
                      "top": top.tolist(), "value": float(value), "grad": grad.tolist(),
                      "report": jaxaot.report()}))
    jax.distributed.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(
    tmp_path: Path,
    env: dict[str, str],
    n: int = 4,
    worker: str = WORKER,
    devices: int | None = None,
    timeout: float = 300,
) -> list[dict[str, Any]]:
    """Runs ``worker`` as an ``n``-process job (each with ``devices`` CPU devices
    and a cold cache of its own); each process's last line of output, as JSON."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    port = _free_port()
    procs = []
    for pid in range(n):
        penv = dict(env)
        penv["JAXAOT_CACHE_DIR"] = str(tmp_path / f"cache-{pid}")  # a cold cache per process
        penv.setdefault("JAXAOT_DISTRIBUTED_TIMEOUT", "120")
        if devices is not None:
            penv["XLA_FLAGS"] = (
                f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
            )
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
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_each_signature_is_made_once_per_job(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    cold = _job(tmp_path, subprocess_env)
    assert sum(r["traces"] for r in cold) == 1, cold
    # The others loaded what process 0 made, and say so (not "cold start: loaded 0").
    assert all("partly warm" in r["report"] for r in cold[1:]), [r["report"] for r in cold]
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


SHARDED_WORKER = textwrap.dedent(
    """
    import contextlib, json, os, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    pid, n, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid,
                               initialization_timeout=120)
    import numpy as np
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
    import jaxaot

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    # Auto axes, or Explicit ones (jax.make_mesh's default: shardings in types,
    # used inside jax.set_mesh).
    explicit = os.environ.get("JAXAOT_TEST_AXES", "auto") == "explicit"
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
    mesh2 = jax.make_mesh((2, 4), ("a", "b"), axis_types=(kind,) * 2)

    def layer(w, x):
        return jnp.tanh(x @ w)

    block = jaxaot.component(layer)

    def loss(body, w, x):
        return jnp.mean(body(w, body(w, x)) ** 2)

    def global_array(sharding, value):
        # Each process holds the rows its devices hold.
        return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

    def shards(a):
        return sorted((str(s.index), np.asarray(s.data).tolist()) for s in a.addressable_shards)

    def same(got, want, what):
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (what, g.sharding, w.sharding)
            for (gi, gv), (wi, wv) in zip(shards(g), shards(w)):
                assert gi == wi, what
                np.testing.assert_allclose(gv, wv, rtol=1e-6, atol=1e-6, err_msg=what)

    w_host = np.eye(8, dtype=np.float32) * 0.5 + 0.05
    x_host = np.arange(128, dtype=np.float32).reshape(16, 8) / 128
    results, split = [], []
    def case(name, wsh, xsh):
        w, x = global_array(wsh, w_host), global_array(xsh, x_host)
        same(block(w, x), jax.jit(layer)(w, x), name + " top level")
        pinned = (NamedSharding(wsh.mesh, P()), wsh)
        step = lambda body: jax.jit(jax.value_and_grad(lambda w, x: loss(body, w, x)),
                                    out_shardings=pinned)
        same(step(block)(w, x), step(layer)(w, x), name + " under jit")
        regional = jaxaot.jit(jax.value_and_grad(lambda w, x: loss(block, w, x)),
                              out_shardings=pinned)
        same(regional(w, x), step(layer)(w, x), name + " in jaxaot.jit")
        split.append(all(plan is not None for plan in regional._plans.values()))
        results.append(float(step(block)(w, x)[0]))

    for name, wsh, xsh in [
        ("rows", NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))),
        ("replicated", NamedSharding(mesh, P()), NamedSharding(mesh, P())),
        # (With shardings in types, w sharded over "b" would contract a sharded
        # dimension in the second layer: a program jax.jit refuses.)
        ("2d", NamedSharding(mesh2, P() if explicit else P(None, "b")),
         NamedSharding(mesh2, P("a", None))),
    ]:
        with jax.set_mesh(wsh.mesh) if explicit else contextlib.nullcontext():
            case(name, wsh, xsh)
    jaxaot.wait_for_writes()
    info = block.cache_info()
    print(json.dumps({"pid": pid, "lowerings": info.lowerings, "compiles": info.compiles,
                      "values": results, "split": split}))
    sys.stdout.flush()
    jax.distributed.shutdown()
    """
)


def _sharded_job(
    tmp_path: Path, env: dict[str, str], worker: str = SHARDED_WORKER
) -> list[dict[str, Any]]:
    """Two processes with 4 CPU devices each: a global mesh of 8."""
    return _job(tmp_path, env, n=2, worker=worker, devices=4, timeout=400)


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_a_two_host_job_on_a_global_mesh(
    tmp_path: Path, subprocess_env: dict[str, str], axes: str
) -> None:
    """Two processes x 4 devices on a global mesh of Auto or Explicit axes (shardings
    in types): values and shardings as jax.jit, one lowering per job, split in
    every process, and a warm job lowers and compiles nothing."""
    subprocess_env = dict(subprocess_env, JAXAOT_TEST_AXES=axes)
    cold = _sharded_job(tmp_path, subprocess_env)
    leader, other = cold
    assert leader["lowerings"] >= 1 and other["lowerings"] == 0, cold  # one lowering per job
    # Top level: one executable per input sharding; jaxaot.jit: the block's
    # forward and backward, per sharding. Every process compiles the same.
    assert leader["compiles"] == other["compiles"] > 3, cold
    assert leader["values"] == other["values"], cold
    assert leader["split"] == other["split"] == [True] * 3, cold  # split, not fallen back
    warm = _sharded_job(tmp_path, subprocess_env)
    assert [r["lowerings"] for r in warm] == [0, 0], warm
    assert [r["compiles"] for r in warm] == [0, 0], warm
    assert [r["values"] for r in warm] == [leader["values"]] * 2, warm


# Process 1 cannot make one of jaxaot.jit's executables (its compiler fails
# where process 0's does not): both processes must run jax.jit, or their
# collectives would not match.
DIVERGING_WORKER = SHARDED_WORKER.replace(
    "import jaxaot\n",
    textwrap.dedent(
        """
        import jaxaot
        from jaxaot._regional import _planner
        if pid == 1:
            def _fails(*a, **k):
                raise RuntimeError("this process cannot compile")
            _planner.region_executable = _fails
        """
    ),
    1,
)


# Process 1 reaches its first jaxaot.jit call after JAXAOT_DISTRIBUTED_TIMEOUT
# (a slower data loader): process 0 has counted it as a no by then, and process 1
# must take that answer, not decide alone.
LATE_WORKER = SHARDED_WORKER.replace(
    "    regional = jaxaot.jit(",
    "    if pid == 1 and not split:\n"
    "        import time; time.sleep(3 * float(os.environ['JAXAOT_DISTRIBUTED_TIMEOUT']))\n"
    "    regional = jaxaot.jit(",
    1,
)


def test_a_process_late_for_a_decision_takes_the_jobs_answer(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A process that answers a split-or-fallback decision after the others
    stopped waiting takes the job's answer (a fallback, there), never its own:
    the same program, so the same collectives, and jax.jit's values, in both."""
    assert LATE_WORKER != SHARDED_WORKER
    env = dict(subprocess_env, JAXAOT_DISTRIBUTED_TIMEOUT="2")
    leader, other = _sharded_job(tmp_path, env, LATE_WORKER)
    assert leader["values"] == other["values"]
    assert leader["split"] == other["split"] and leader["split"][0] is False, (leader, other)


def test_every_process_takes_the_same_split_or_fallback_decision(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    assert DIVERGING_WORKER != SHARDED_WORKER
    env = dict(subprocess_env, JAXAOT_DISTRIBUTED_TIMEOUT="60")
    leader, other = _sharded_job(tmp_path, env, DIVERGING_WORKER)
    assert leader["values"] == other["values"]
    assert leader["split"] == other["split"] == [False] * 3, (leader, other)


LOCAL_SIGNATURES = textwrap.dedent(
    """
    import json, os, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    pid, n, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid,
                               initialization_timeout=120)
    import jax.numpy as jnp
    import jaxaot

    @jaxaot.component
    def block(w, x):
        return jnp.tanh(x @ w)

    w = jnp.eye(4) * 0.5 + 0.1
    shared = block(w, jnp.ones((2, 4)))  # every process: process 0 makes it
    values = [jax.jit(lambda v: block(w, v))(jnp.ones((rows, 4))).tolist()
              for rows in ((3, 5, 7) if pid == 1 else ())]  # signatures of process 1 only
    info, stats = block.cache_info(), jaxaot.stats()
    print(json.dumps({"pid": pid, "lowerings": info.lowerings, "values": values,
                      "shared": shared.tolist(), "timeouts": stats["lease_wait_timeouts"]}))
    sys.stdout.flush()
    jax.distributed.shutdown()
    """
)


def test_a_signature_process_0_never_makes_holds_up_no_process_one_wait_per_entry(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A signature only one process calls (process-local shapes; likewise a body
    that depends on the process, or one process 0 failed to trace) is never made
    by process 0. Its other processes make it themselves once process 0 has not
    started it within the start wait, and then, process 0 being behind them, every
    entry process 0 has not started, without waiting: before, each such entry
    cost one full ``JAXAOT_DISTRIBUTED_TIMEOUT``."""
    env = {**subprocess_env, "JAXAOT_DISTRIBUTED_TIMEOUT": "3"}
    leader, other = _job(tmp_path, env, n=2, worker=LOCAL_SIGNATURES)
    assert leader["lowerings"] == 1 and other["lowerings"] == 3, (leader, other)
    assert other["shared"] == leader["shared"]
    want = [np.tanh(np.ones((rows, 4)) @ (np.eye(4) * 0.5 + 0.1)) for rows in (3, 5, 7)]
    for got, expected in zip(other["values"], want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert other["timeouts"] == 0, other  # none ran out: given up on, once
