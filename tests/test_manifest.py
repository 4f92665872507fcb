"""jaxaot.Manifest and ``jaxaot precompile``, with real processes: a manifest
precompiled by worker processes leaves a later process on the same cache with
nothing to trace to MLIR or compile (JAX's own events) and values equal to
``jax.jit``'s; for components with static arguments, ``jaxaot.jit`` of a train
step, buckets and sharded signatures on 8 simulated devices. Workers and
machines on one cache (a directory, Redis) make each entry once, and a worker
killed while it holds a signature has it finished by the others.

The manifests are in ``_precompile_targets``; the deploying process is
``_precompile_deploy``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaot
from jaxaot._caches._directory import DirectoryCache
from jaxaot.cli import main

TESTS = Path(__file__).resolve().parent
LINE = re.compile(
    r"^precompiled (\d+) signatures?: (\d+) entr(?:y|ies) made, (\d+) loaded, "
    r"(\d+) already present(?:, (\d+) by other processes)?(?:, (\d+) failed)?, in [\d.]+ s$",
    re.MULTILINE,
)
EIGHT = "--xla_force_host_platform_device_count=8"


def _precompile(
    env: dict[str, str], target: str, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot", "precompile", target, *args],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _counts(stdout: str) -> dict[str, int]:
    (m,) = LINE.findall(stdout)
    names = ("signatures", "made", "loaded", "present", "elsewhere", "failed")
    return {k: int(v or 0) for k, v in zip(names, m, strict=True)}


def _deploy(env: dict[str, str], target: str) -> dict[str, Any]:
    """What a fresh process compiles over 12 calls of each signature (each runs
    the form its program decides: for these small layers, one program)."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / "_precompile_deploy.py"), target],
        cwd=TESTS,
        env={**env, "DEPLOY_CALLS": "12"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _assert_warm(result: dict[str, Any], n: int) -> None:
    assert result["compiles"] == [] and result["lowerings"] == [], result
    assert result["jaxaot"] == {"lowerings": 0, "compiles": 0}
    assert result["equal"] == [True] * n
    # Every executable was loaded while its signature was traced, as the
    # precompile noted them: none waited for its trace to end.
    assert result["prefetched"] > 0 and result["by_lookup"] == 0, result


def _env(subprocess_env: dict[str, str], cache: Path, **more: str) -> dict[str, str]:
    env = dict(subprocess_env, JAXAOT_CACHE="dir", JAXAOT_CACHE_DIR=str(cache))
    env.pop("XLA_FLAGS", None)
    env.update(more)
    return env


# -- the Python API ------------------------------------------------------------------


def test_manifest_refuses_what_it_cannot_precompile() -> None:
    m = jaxaot.manifest()
    plain = jax.jit(lambda x: x + 1)
    with pytest.raises(TypeError, match=r"Manifest.add: .* not a jaxaot component or jaxaot.jit"):
        m.add(plain, jax.ShapeDtypeStruct((2,), jnp.float32))
    f = jaxaot.jit(lambda x: x * 2)
    with pytest.raises(TypeError, match=r"buckets\(<lambda>\): seq must be positive integers"):
        m.buckets(f, lambda b, s: jnp.zeros((b, s)), batch=(1,), seq=(0,))
    with pytest.raises(TypeError, match=r"batch must be a sequence of positive integers .* got 2"):
        m.buckets(f, lambda b, s: jnp.zeros((b, s)), batch=2, seq=(4,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="worker must be in range"):
        m.precompile(worker=2, workers=2)
    assert len(m) == 0


def test_progress_labels_show_every_argument() -> None:
    """A long static value (a config's repr) is cut shorter, so that the arguments
    after it still tell two signatures apart in the progress lines."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Config:
        vocab: int = 256
        width: int = 96
        heads: int = 4
        layers: int = 4
        temperature: float = 0.7

    def step(params: Any, caches: Any, token: Any, slot: Any, cfg: Any, greedy: bool) -> Any:
        return token

    decode = jaxaot.jit(step, static_argnames=("cfg", "greedy"))
    params = {"w": jax.ShapeDtypeStruct((96, 96), jnp.float32)}
    caches = [jax.ShapeDtypeStruct((4, 128, 96), jnp.float32)] * 4
    token, slot = jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)
    m = jaxaot.manifest()
    for greedy in (True, False):
        m.add(decode, params, caches, token, slot, cfg=Config(), greedy=greedy)
    labels = [item.label for item in m]
    assert labels[0].endswith("greedy=True)") and labels[1].endswith("greedy=False)"), labels
    assert all(len(label) <= 100 and "cfg=" in label for label in labels), labels


def test_labels_tell_apart_calls_that_read_the_same() -> None:
    """Calls whose arguments print alike (trees of as many leaves, one type on two
    meshes or shardings) get labels that say what tells them apart, and a bucket
    is named by its sizes: a progress or FAILED line names one signature."""
    step = jaxaot.jit(lambda caches, token: token)
    token = jax.ShapeDtypeStruct((2,), jnp.int32)

    def caches(seq: int) -> list[dict[str, jax.ShapeDtypeStruct]]:
        return [{"k": jax.ShapeDtypeStruct((2, seq, 8), jnp.float32)}] * 2

    m = jaxaot.manifest().add(step, caches(16), token).add(step, caches(32), token)
    assert [item.label for item in m] == [
        "<lambda>(<list of 2 leaves>, i32[2])",
        "<lambda>(<list of 2 leaves>, i32[2]) [args[0][0]['k']: f32[2,32,8]]",
    ]
    m = jaxaot.manifest().buckets(step, lambda b, s: (caches(s), token), batch=(2,), seq=(16, 32))
    assert [item.label for item in m] == [
        "<lambda>(<list of 2 leaves>, i32[2]) [batch 2, seq 16]",
        "<lambda>(<list of 2 leaves>, i32[2]) [batch 2, seq 32]",
    ]
    # One type, another sharding; and one call under two meshes.
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    auto = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jaxaot.jit(lambda x: x * 2)

    def placed(spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=NamedSharding(mesh, spec))

    m = jaxaot.manifest().add(f, placed(P())).add(f, placed(P("d")))
    assert m[1].label == f"<lambda>(f32[4,2]) [args[0]: f32[4,2] sharded {P('d')}]"
    m = jaxaot.manifest()
    for where in (mesh, auto):
        with jax.set_mesh(where):
            m.add(f, jax.ShapeDtypeStruct((4, 2), jnp.float32))
    assert [item.label for item in m] == [
        "<lambda>(f32[4,2])",
        "<lambda>(f32[4,2]) [mesh d=1:Auto]",
    ]


def test_a_call_added_twice_is_one_signature() -> None:
    """Buckets whose arguments ignore the sequence length, and a call added again:
    each call once; another dtype or static value is another call."""
    f = jaxaot.jit(lambda x, scale: x * scale, static_argnames="scale")
    m = jaxaot.manifest().buckets(
        f,
        lambda b, s: (jax.ShapeDtypeStruct((b, 4), jnp.float32),),
        batch=(1, 2),
        seq=(8, 16, 32),
        kwargs={"scale": 2.0},
    )
    assert [item.label for item in m] == [
        "<lambda>(f32[1,4], scale=2.0) [batch 1, seq 8]",
        "<lambda>(f32[2,4], scale=2.0) [batch 2, seq 8]",
    ]
    m.add(f, jax.ShapeDtypeStruct((1, 4), jnp.float32), scale=2.0)
    assert len(m) == 2
    m.add(f, jax.ShapeDtypeStruct((1, 4), jnp.bfloat16), scale=2.0)
    m.add(f, jax.ShapeDtypeStruct((1, 4), jnp.float32), scale=3.0)
    m.add(jaxaot.jit(lambda x, scale: x * scale, static_argnames="scale"), m[0].args[0], scale=2.0)
    assert len(m) == 5
    # Static values that are NumPy scalars are told apart by value; types by weak type.
    g = jaxaot.jit(lambda x, n: x * n, static_argnums=1)
    sds = jax.ShapeDtypeStruct((2,), jnp.float32)
    weak = jax.ShapeDtypeStruct((2,), jnp.float32, weak_type=True)
    m = jaxaot.manifest().add(g, sds, np.int32(3)).add(g, sds, np.int32(4))
    m.add(g, sds, np.int32(3)).add(g, weak, np.int32(3))
    assert len(m) == 3


def test_calls_whose_labels_read_alike_are_told_apart_each() -> None:
    """The third of three calls that read alike is told from both others, not only
    from the first (whose difference it may share with the second)."""
    h = jaxaot.jit(lambda d: d["a"] + d["b"] + d["c"])
    f32, i32 = (jax.ShapeDtypeStruct((2,), t) for t in (jnp.float32, jnp.int32))
    m = jaxaot.manifest()
    for b, c in ((f32, f32), (i32, f32), (i32, i32)):
        m.add(h, {"a": f32, "b": b, "c": c})
    labels = [item.label for item in m]
    assert len(set(labels)) == 3, labels
    assert labels[2].endswith("[args[0]['c']: i32[2]]"), labels


def test_buckets_and_claims() -> None:
    f = jaxaot.jit(lambda x: x * 2)
    m = jaxaot.manifest("serving").buckets(
        f, lambda b, s: jax.ShapeDtypeStruct((b, s), jnp.int32), batch=(1, 2), seq=(8, 16, 32)
    )
    assert len(m) == 6
    assert [item.args[0].shape for item in m] == [(b, s) for b in (1, 2) for s in (8, 16, 32)]
    assert m[5].label == "<lambda>(i32[2,32]) [batch 2, seq 32]"
    digests = {m.digest(i, "run") for i in range(6)}
    assert len(digests) == 6  # one claim per signature
    assert m.digest(3, "run") == m.digest(3, "run") != m.digest(3, "other run")


_SERVED = """
import jax, jax.numpy as jnp, jaxaot

@jaxaot.component
def block(w, x):
    return x + jnp.tanh(x @ w)

@jaxaot.jit
def forward(ws, x):
    for w in ws:
        x = block(w, x)
    return x

manifest = jaxaot.manifest("m").add(
    forward, [jax.ShapeDtypeStruct((4, 4), jnp.float32)] * 3, jax.ShapeDtypeStruct((2, 4), jnp.float32)
)
"""


def test_a_signature_claimed_again_after_an_edit_is_another_claim(tmp_path: Path) -> None:
    """A precompile run again under the same ``--run`` name soon after the code
    changed (a component the function calls, edited) found the first run's
    claims marked done, made nothing and exited 0, and the servers compiled. A
    claim names the code the function reaches."""
    import importlib.util

    def manifest_of(source: str, name: str) -> Any:
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.manifest

    first, same = manifest_of(_SERVED, "served_a"), manifest_of(_SERVED, "served_b")
    edited = manifest_of(_SERVED.replace("jnp.tanh", "jax.nn.relu"), "served_c")
    assert first.digest(0, "prod") == same.digest(0, "prod")  # (in every process of a run)
    assert edited.digest(0, "prod") != first.digest(0, "prod")


def test_precompile_in_process_fills_the_cache(fresh_cache: jaxaot.MemoryCache) -> None:
    import _precompile_targets as targets

    report = targets.components.precompile()
    assert [r.state for r in report.items] == ["made"] * 4
    assert report.made == len(fresh_cache.keys()) > 0
    again = targets.components.precompile()  # in-process tables and the cache
    assert again.made == 0 and again.present == 4
    assert again.line().startswith("precompiled 4 signatures: 0 entries made, 0 loaded, 4 already")


def test_a_failed_signature_says_its_cause_on_its_line(fresh_cache: jaxaot.MemoryCache) -> None:
    """A static argument that cannot be hashed (a dict): the signature's line keeps
    the cause, which ``jax.jit``'s words give on a line of its own."""

    def scaled(x: jax.Array, cfg: Any) -> jax.Array:
        return x * 2

    step = jaxaot.jit(scaled, static_argnames="cfg")
    m = jaxaot.manifest().add(step, jax.ShapeDtypeStruct((3,), jnp.float32), cfg={"a": 1})
    report = m.precompile(raise_errors=False)
    assert [r.state for r in report.items] == ["failed"]
    note = report.items[0].note
    assert "\n" not in note and "static argument 'cfg' is not hashable" in note, note
    assert "unhashable type: 'dict'" in note, note


def test_a_failing_signature_leaves_the_others_precompiled(
    fresh_cache: jaxaot.MemoryCache,
) -> None:
    """A signature whose arguments its function cannot take raises what the call
    would raise, once the others are precompiled: a ``jaxaot.jit`` function that
    cannot be traced is not reported as precompiled."""
    import _precompile_targets as targets

    with pytest.raises(TypeError, match="positional argument") as raised:
        targets.failing.precompile()
    assert "2 of 4 signatures failed" in "".join(getattr(raised.value, "__notes__", []))
    report = targets.failing.precompile(raise_errors=False)
    assert [r.state for r in report.items] == ["present", "failed", "failed", "present"]
    assert "TypeError" in report.items[1].note and "path x" in report.items[2].note
    assert report.present == 2 and len(report.failed) == 2
    assert report.line().endswith(f" 2 already present, 2 failed, in {report.seconds:.1f} s")
    # The good signatures were made by the first run: their entries are in the cache.
    assert len(fresh_cache.keys()) > 0


UNPLANNED = """
import jax, jax.numpy as jnp, jaxaot
from jaxaot._regional import _jit


def _cannot_cut(*args, **kwargs):  # (a program jaxaot cannot cut, simulated)
    raise NotImplementedError("a program jaxaot cannot cut")


_jit.build_plan = _cannot_cut
step = jaxaot.jit(lambda x: jnp.tanh(x) * 2)
manifest = jaxaot.manifest().add(step, jax.ShapeDtypeStruct((4,), jnp.float32))
"""


def test_a_signature_that_runs_under_plain_jax_jit_is_not_called_present(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A ``jaxaot.jit`` signature jaxaot cannot cut runs under plain jax.jit in the
    deployment: precompile says it is not cached (not "already present") and
    exits with status 1, for nothing of it is in the cache."""
    (tmp_path / "unplanned.py").write_text(UNPLANNED)
    env = dict(
        _env(subprocess_env, tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(tmp_path), subprocess_env["PYTHONPATH"]]),
    )
    done = _precompile(env, "unplanned:manifest", "--workers", "1", check=False)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "not cached (runs under plain jax.jit" in done.stdout, done.stdout
    assert "0 already present, 1 not cached (plain jax.jit)" in done.stdout, done.stdout
    assert "1 of 1 signature cannot be cached" in done.stderr + done.stdout


# -- precompiled by workers, deployed by a fresh process ---------------------------------


@pytest.mark.parametrize("target", ["components", "train", "buckets"])
def test_precompiled_deployment_compiles_nothing(
    target: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    env = _env(subprocess_env, tmp_path / "cache")
    done = _precompile(env, f"_precompile_targets:{target}", "--workers", "2")
    counts = _counts(done.stdout)
    n = counts["signatures"]
    assert n == {"components": 4, "train": 1, "buckets": 4}[target]
    assert counts["made"] == len(DirectoryCache(tmp_path / "cache").keys()) > 0
    _assert_warm(_deploy(env, f"_precompile_targets:{target}"), n)
    if target == "components":
        # Without the precompile, the same process compiles (so the test can fail).
        cold = _deploy(_env(subprocess_env, tmp_path / "cold"), f"_precompile_targets:{target}")
        assert len(cold["compiles"]) >= 4 and cold["equal"] == [True] * n
        # A second run finds everything present and makes nothing.
        again = _counts(_precompile(env, f"_precompile_targets:{target}", "--workers", "1").stdout)
        assert again == {
            "signatures": 4,
            "made": 0,
            "loaded": 0,
            "present": 4,
            "elsewhere": 0,
            "failed": 0,
        }


@pytest.mark.parametrize(
    ("target", "n"),
    [
        ("sharded_components", 1),
        ("sharded_explicit", 2),
        ("explicit_in_set_mesh", 1),
        ("explicit_train_in_set_mesh", 1),
    ],
)
def test_sharded_components_on_eight_devices(
    target: str, n: int, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Over a ``Mesh`` (Auto axes), and over ``jax.make_mesh``'s Explicit axes, whose
    shardings are part of the types a manifest's ShapeDtypeStructs give."""
    env = _env(subprocess_env, tmp_path / "cache", XLA_FLAGS=EIGHT)
    done = _precompile(env, f"_precompile_targets:{target}", "--workers", "1")
    # (What it says of each program is said under the mesh it was added in.)
    assert "nothing of it is cached" not in done.stdout + done.stderr, done.stderr
    result = _deploy(env, f"_precompile_targets:{target}")
    assert result["devices"] == 8
    _assert_warm(result, n)


def test_sharded_train_step_on_eight_devices(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    env = _env(subprocess_env, tmp_path / "cache", XLA_FLAGS=EIGHT)
    _precompile(env, "_precompile_targets:sharded_train", "--workers", "1")
    result = _deploy(env, "_precompile_targets:sharded_train")
    assert result["devices"] == 8 and result["equal"] == [True]
    _assert_warm(result, 1)


def test_killed_worker_is_taken_over(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    marker = tmp_path / "killed"
    env = _env(subprocess_env, tmp_path / "cache", PRECOMPILE_KILL_MARKER=str(marker))
    done = _precompile(env, "_precompile_targets:killed", "--workers", "2")
    assert marker.exists()  # one worker died holding a signature
    assert re.search(r"worker \d \(pid \d+\) was killed by signal 9", done.stdout), done.stdout
    counts = _counts(done.stdout)
    assert counts["signatures"] == 6
    # Every entry made once: what the survivors made is what the cache holds.
    assert counts["made"] == len(DirectoryCache(tmp_path / "cache").keys()) > 0
    _assert_warm(_deploy(env, "_precompile_targets:killed"), 6)


def test_a_run_whose_only_worker_died_names_what_it_left_undone(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    marker = tmp_path / "killed"
    env = _env(subprocess_env, tmp_path / "cache", PRECOMPILE_KILL_MARKER=str(marker))
    proc = _precompile(env, "_precompile_targets:killed", "--workers", "1", check=False)
    assert proc.returncode == 1 and marker.exists()
    (line,) = [x for x in proc.stderr.splitlines() if "precompile incomplete" in x]
    assert "6 of 6 signatures not done (fragile(<dict of 2 leaves>, f32[2,16]), " in line, line
    assert "layer(<dict of 2 leaves>, f32[3,16])" in line, line
    assert line.endswith("and 1 more: their workers stopped)"), line


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the workers")
def test_a_terminated_run_stops_its_workers_and_says_one_line(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """SIGTERM to ``jaxaot precompile`` while its workers compile: it says one line
    and exits 143, its workers are stopped with it, and nothing prints a traceback
    (the workers printed two each when they next wrote to their gone parent)."""
    import os
    import signal
    import time

    marker = tmp_path / "stalled"
    env = _env(subprocess_env, tmp_path / "cache", PRECOMPILE_STALL_MARKER=str(marker))
    token = f"stopped-{os.getpid()}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "jaxaot", "precompile", "_precompile_targets:stalled"]
    proc = subprocess.Popen(
        [*cmd, "--workers", "2", "--run", token],
        cwd=TESTS,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():  # a worker is tracing a signature
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (out, err)
    assert err.strip().splitlines()[-1] == "jaxaot: error: terminated", err
    assert "Traceback" not in err and "Traceback" not in out, err

    def workers() -> list[str]:
        found = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(pid)
            except OSError:
                continue
        return found

    deadline = time.monotonic() + 20
    while workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not workers()


def test_two_machines_on_one_redis_make_each_entry_once(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    from test_redis import RedisServer

    from jaxaot._caches._redis import RedisCache

    server = RedisServer()
    server.start()
    try:
        machines = [
            _env(subprocess_env, tmp_path / f"local{i}", JAXAOT_CACHE=server.url) for i in (0, 1)
        ]
        cmd = [sys.executable, "-m", "jaxaot", "precompile", "_precompile_targets:buckets"]
        procs = [
            subprocess.Popen(
                [*cmd, "--workers", "2", "--run", "build-1"],
                cwd=TESTS,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for env in machines
        ]
        outs = [p.communicate(timeout=600) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, out[-2000:] + err[-2000:]
            # Its unsigned store said once per machine, not once per worker too.
            assert err.count("entries are only checksummed") == 1, err
        counts = [_counts(out) for out, _ in outs]
        entries = len(RedisCache(server.url).keys())
        assert entries > 0
        assert sum(c["made"] for c in counts) == entries  # each entry made once
        # A third machine, its local directory empty, loads everything from Redis.
        third = _env(subprocess_env, tmp_path / "local2", JAXAOT_CACHE=server.url)
        _assert_warm(_deploy(third, "_precompile_targets:buckets"), 4)
    finally:
        server.close()


def test_a_precompile_into_redis_writes_what_the_local_directory_already_held(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``JAXAOT_CACHE=redis://...`` reads the local directory first: a machine
    whose directory holds every entry (an earlier precompile, a local run) still
    fills the shared store, so that a machine with an empty directory loads
    everything from it."""
    from test_redis import RedisServer

    from jaxaot._caches._redis import RedisCache

    server = RedisServer()
    server.start()
    try:
        local = _env(subprocess_env, tmp_path / "local")
        made = _counts(_precompile(local, "_precompile_targets:buckets", "--workers", "1").stdout)
        assert made["made"] > 0
        shared = dict(local, JAXAOT_CACHE=server.url)
        again = _counts(_precompile(shared, "_precompile_targets:buckets", "--workers", "1").stdout)
        assert again["made"] == 0 and again["present"] == 4, again
        assert len(RedisCache(server.url).keys()) > 0
        other = _env(subprocess_env, tmp_path / "other", JAXAOT_CACHE=server.url)
        _assert_warm(_deploy(other, "_precompile_targets:buckets"), 4)
    finally:
        server.close()


# -- the command line -----------------------------------------------------------------


def test_cli_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["precompile", "no_colon_here"]) == 2
    assert "MANIFEST must be module:attr" in capsys.readouterr().err
    for memory in ("memory", "memory://deploy"):  # (fsspec's memory is this process's)
        assert main(["precompile", "_precompile_targets:components", "--cache", memory]) == 2
        assert "no later process can read" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as patch:  # the environment's, named as such
        patch.setenv("JAXAOT_CACHE", "memory")
        assert main(["precompile", "_precompile_targets:components"]) == 2
        assert "JAXAOT_CACHE=memory: precompiling into a cache" in capsys.readouterr().err
    assert main(["precompile", "_precompile_targets:components", "--cache", "ftp://x.invalid/y"])
    assert "cannot reach ftp://x.invalid/y: " in capsys.readouterr().err
    assert main(["precompile", "--help"]) == 0
    assert "--workers" in capsys.readouterr().out


def test_cli_bad_target_in_workers(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    env = _env(subprocess_env, tmp_path / "cache")
    proc = _precompile(env, "_precompile_targets:WIDTH", "--workers", "1", check=False)
    assert proc.returncode == 2
    assert "is not a jaxaot.Manifest" in proc.stderr and "of type int" in proc.stderr
    proc = _precompile(env, "_precompile_targets:layer", "--workers", "1", check=False)
    assert proc.returncode == 2 and "is a component, not a jaxaot.Manifest" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _precompile(env, "_precompile_targets:empty", "--workers", "1", check=False)
    assert proc.returncode == 1 and "lists no signatures" in proc.stderr


def test_cli_default_workers_share_a_gpu_four_to_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``--workers``: the machine's cores, but four per GPU where the
    workers would share the machine's GPUs (on one H100, sixteen workers took
    twice as long as four); counted from ``/dev``, staged here."""
    from jaxaot.cli import precompile

    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 16)
    gpus: list[str] = []
    monkeypatch.setattr(precompile.glob, "glob", lambda pattern: list(gpus))
    assert precompile._default_workers({}, False) == 16  # no GPU
    gpus[:] = ["/dev/nvidia0"]
    assert precompile._default_workers({}, False) == 4
    assert precompile._default_workers({"JAX_PLATFORMS": "cuda"}, False) == 4
    assert precompile._default_workers({"JAX_PLATFORMS": "cpu"}, False) == 16
    assert precompile._default_workers({}, True) == 16  # --target: the CPU compiles
    gpus[:] = [f"/dev/nvidia{i}" for i in range(8)]
    assert precompile._default_workers({}, False) == 16


def test_cli_a_worker_whose_jax_fell_back_to_the_cpu_is_refused(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """On a GPU machine, a worker whose CUDA backend failed to start (JAX's default
    memory reservation left it none) falls back to the CPU, and JAX only logs it:
    its entries would be keyed for the CPU, and the deployment would compile
    everything. The worker says so and stops, writing nothing; the workers are
    started without that reservation. (The failed start is staged in the
    manifest module: this machine has no GPU.)"""
    cache, seen = tmp_path / "cache", tmp_path / "seen"
    env = _env(subprocess_env, cache, SEEN=str(seen))
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    staged = tmp_path / "gpu_fell_back.py"
    staged.write_text(
        "import os, pathlib\n"
        "import jax, jax.numpy as jnp\n"
        "from jax._src import hardware_utils, xla_bridge\n"
        "import jaxaot\n"
        "pathlib.Path(os.environ['SEEN']).write_text("
        "os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', 'unset'))\n"
        "jax.devices()\n"
        "xla_bridge._backend_errors['cuda'] = 'no supported devices found for platform CUDA.'\n"
        "hardware_utils.has_visible_nvidia_gpu = lambda: True\n"
        "f = jaxaot.component(jnp.sin)\n"
        "manifest = jaxaot.manifest().add(f, jax.ShapeDtypeStruct((4,), jnp.float32))\n"
    )
    proc = _precompile(env, f"{staged}:manifest", "--workers", "1", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    assert "worker 0 would compile for the CPU: its cuda backend failed to start" in said
    assert "no supported devices found for platform CUDA." in said
    assert seen.read_text() == "false"
    assert not [p for p in cache.rglob("*") if p.is_file() and p.suffix != ".lock"]


def test_cli_a_manifest_that_cannot_be_made_is_one_line_naming_where(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A manifest module that raises while imported, or a function returning no
    manifest: one line saying what and where, not a traceback per worker."""
    env = _env(subprocess_env, tmp_path / "cache")
    bad = tmp_path / "badmani.py"
    bad.write_text("import jaxaot\n\nraise ValueError('no bucket sizes')\n\nf = lambda: 5\n")
    proc = _precompile(env, f"{bad}:manifest", "--workers", "2", check=False)
    assert proc.returncode == 2
    said = [line for line in proc.stderr.splitlines() if "no bucket sizes" in line]
    assert len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "raised ValueError: no bucket sizes" in said[0] and f"{bad}:3" in said[0], said
    bad.write_text("f = lambda: 5\n")
    proc = _precompile(env, f"{bad}:f", "--workers", "1", check=False)
    assert proc.returncode == 2
    assert "f() returned an object of type int, not a jaxaot.Manifest" in proc.stderr


def test_a_manifest_file_imports_the_modules_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jaxaot precompile deploy/serve.py:manifest`` run from elsewhere: the file
    imports its siblings, as ``python deploy/serve.py`` would."""
    from jaxaot.cli.precompile import load_manifest

    folder = tmp_path / "deploy"
    folder.mkdir()
    (folder / "model_parts_beside.py").write_text(
        "import jax.numpy as jnp\n\ndef act(x):\n    return jnp.tanh(x)\n"
    )
    (folder / "serve_beside.py").write_text(
        "import jax, jax.numpy as jnp, jaxaot\n"
        "from model_parts_beside import act\n"
        "f = jaxaot.jit(lambda x: act(x) * 2)\n"
        "manifest = jaxaot.manifest('beside').add(f, jax.ShapeDtypeStruct((3,), jnp.float32))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    loaded = load_manifest("deploy/serve_beside.py:manifest")
    assert loaded.name == "beside" and len(loaded) == 1


def test_cli_failing_signatures_fail_the_run_and_the_others_are_done(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Each failing signature gets a FAILED line with its error (no traceback), the
    others are precompiled (by whichever worker), and the exit status is 1."""
    env = _env(subprocess_env, tmp_path / "cache")
    proc = _precompile(env, "_precompile_targets:failing", "--workers", "2", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = re.findall(
        r"^\[\d/4\] (.*): FAILED: (TypeError: .*) \(worker \d\)$", proc.stdout, re.M
    )
    assert sorted(label for label, _ in failed) == [
        "head('not an array', mode='sum')",
        "scaled(f32[4,16], f32[4,16])",
    ]
    assert _counts(proc.stdout) == {
        "signatures": 4,
        "made": _counts(proc.stdout)["made"],
        "loaded": 0,
        "present": 0,
        "elsewhere": 0,
        "failed": 2,
    }
    assert _counts(proc.stdout)["made"] > 0
    assert "2 of 4 signatures failed" in proc.stderr and "Traceback" not in proc.stderr


def test_a_failed_signature_says_where_in_the_users_code(
    fresh_cache: jaxaot.MemoryCache,
) -> None:
    """A signature whose program raises in the user's code is reported with that
    file and line (a FAILED line has no traceback); one refused by jaxaot's own
    checks, with no line of the user's in its traceback, names none."""
    import inspect

    def body(x: jax.Array) -> jax.Array:
        return x @ x  # (4, 3) @ (4, 3): raises here

    line = inspect.getsourcelines(body)[1] + 1
    f = jaxaot.jit(body)
    head = jaxaot.component(lambda x: x.sum())
    m = jaxaot.manifest().add(f, jax.ShapeDtypeStruct((4, 3), jnp.float32))
    m.add(head, "not an array")
    report = m.precompile(raise_errors=False)
    notes = [r.note for r in report.failed]
    assert len(notes) == 2, notes
    assert notes[0].startswith("TypeError: ") and notes[0].endswith(f"(at {__file__}:{line})")
    assert "(at " not in notes[1], notes


def test_cli_a_cache_it_cannot_fill_fails_at_once(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A shared store that does not answer, or a cache directory the workers could
    not use (they would cache in memory), fails the run before any worker
    starts, instead of reporting entries made that no later process finds."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _env(subprocess_env, tmp_path / "cache")
    url = f"redis://127.0.0.1:{port}/0"
    proc = _precompile(env, "_precompile_targets:components", "--cache", url, check=False)
    assert proc.returncode == 1 and f"cannot reach {url}" in proc.stderr, proc.stderr
    assert "precompiled" not in proc.stdout and not (tmp_path / "cache").exists()

    # --cache dir is the cache directory, whatever $JAXAOT_CACHE says.
    proc = _precompile(
        dict(env, JAXAOT_CACHE=url),
        "_precompile_targets:buckets",
        "--cache",
        "dir",
        "--workers",
        "1",
    )
    assert _counts(proc.stdout)["made"] == len(DirectoryCache(tmp_path / "cache").keys()) > 0
    # A cache that does not store what is made (here: every entry is larger than
    # the cache may hold) fails the run once its signatures are done.
    proc = _precompile(
        dict(env, JAXAOT_CACHE_MAX_BYTES="1"),
        "_precompile_targets:components",
        "--workers",
        "1",
        "--cache",
        str(tmp_path / "tiny"),
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    assert "writes to the cache failed or were skipped" in said and "missing from it" in said
    # The last word is the failure, not the counts of what was made.
    assert proc.stderr.strip().splitlines()[-1].startswith("jaxaot: error: precompile failed: ")
    for where, error in [("a_file", "not a directory"), ("open", "world-writable")]:
        path = tmp_path / where
        if where == "a_file":
            path.write_text("")
        else:
            path.mkdir(mode=0o777)
            path.chmod(0o777)
        proc = _precompile(env, "_precompile_targets:components", "--cache", str(path), check=False)
        assert proc.returncode == 1 and error in proc.stderr, proc.stderr
        assert "precompiled" not in proc.stdout


def test_cli_refuses_a_cache_directory_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cache directory that exists but takes no file (a read-only mount: here its
    error, injected) is refused before any worker starts, with exit status 1:
    every entry would be made, then lost."""
    import errno
    import tempfile

    path = tmp_path / "mounted"
    path.mkdir(mode=0o700)
    real = tempfile.TemporaryFile

    def read_only(*args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("dir")) == str(path):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    monkeypatch.chdir(TESTS)
    monkeypatch.syspath_prepend(str(TESTS))
    rc = main(["precompile", "_precompile_targets:components", "--cache", str(path)])
    out, err = capsys.readouterr()
    assert rc == 1, out + err
    assert f"cannot write to the cache directory {path}: Read-only file system" in err, err
    assert "precompiled" not in out and list(path.iterdir()) == []


def test_cli_parent_leaves_jax_to_its_workers(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``jaxaot precompile``'s parent process only starts workers and reads their
    results: it never imports JAX, which would take a core from the workers."""
    code = (
        "import sys\nfrom jaxaot.cli import main\nrc = main(sys.argv[1:])\n"
        "print('JAX in the parent:', 'jax' in sys.modules)\nsys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "precompile", "_precompile_targets:components"]
        + ["--workers", "1"],
        cwd=TESTS,
        env=_env(subprocess_env, tmp_path / "cache"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "JAX in the parent: False" in proc.stdout, proc.stdout
    assert re.search(r"precompiled \d+ signatures: [1-9]\d* entries made", proc.stdout), proc.stdout


def test_progress_rich_on_a_terminal_plain_when_piped() -> None:
    import io

    from rich.console import Console

    from jaxaot.cli._output import Output
    from jaxaot.cli.precompile import _Progress

    result = {"label": "f(f32[2])", "state": "made", "made": 3, "loaded": 0, "seconds": 0.5}
    piped = io.StringIO()
    progress = _Progress(Output(piped))
    progress.count(2)
    progress.start(0, "f(f32[2])")
    progress.finish(0, result)
    progress.finish(1, {**result, "state": "elsewhere", "note": "host pid 7"})
    progress.stop()
    assert piped.getvalue().splitlines() == [
        "[1/2] f(f32[2]): 3 made, 0.50 s (worker 0)",
        "[2/2] f(f32[2]): done by another process (host pid 7) (worker 1)",
    ]
    terminal = io.StringIO()
    out = Output(terminal)
    out._console = Console(file=terminal, force_terminal=True, width=100)
    progress = _Progress(out)
    progress._bar.refresh()  # before the workers have read the manifest
    assert "0/? " in terminal.getvalue() and "None" not in terminal.getvalue()
    progress.count(1)
    progress.finish(0, result)
    progress.stop()
    assert "\x1b[" in terminal.getvalue() and "[1/1] f(f32[2]): 3 made" in terminal.getvalue()


def test_serving_example(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    examples = TESTS.parent / "examples"
    env = _env(subprocess_env, tmp_path / "unused")
    cache = str(tmp_path / "cache")
    target = f"{examples / 'precompile_serving.py'}:manifest"
    done = _precompile(env, target, "--workers", "2", "--cache", cache)
    assert "\x1b" not in done.stdout  # piped: plain lines
    assert re.search(
        r"^\[6/6\] forward\(<dict of 9 leaves>, i32\[\d,\d+\]\) \[batch \d, seq \d+\]: \d+ made",
        done.stdout,
        re.M,
    )
    assert _counts(done.stdout)["signatures"] == 6
    served = subprocess.run(
        [sys.executable, str(examples / "precompile_serving.py"), "--cache", cache],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert served.returncode == 0, served.stderr[-3000:]
    assert re.search(r"^served 6 buckets in [\d.]+ s, 0 compiles$", served.stdout, re.M)
    assert "same values as jax.jit: True" in served.stdout


def test_a_bucket_function_that_raises_names_its_bucket() -> None:
    """``make_args`` raising for one bucket: the error names that bucket, in Python
    and in ``jaxaot precompile``'s one-line error."""
    from jaxaot.cli.precompile import _raised

    def make_args(b: int, s: int) -> Any:
        if s > 8:
            raise ValueError(f"seq {s} is not supported by the tokenizer")
        return jax.ShapeDtypeStruct((b, s), jnp.int32)

    with pytest.raises(ValueError, match="tokenizer") as info:
        jaxaot.manifest("m").buckets(jaxaot.jit(lambda x: x), make_args, batch=(1, 2), seq=(8, 16))
    assert any("batch 1, seq 16" in note for note in info.value.__notes__)
    assert "make_args for the bucket batch 1, seq 16" in _raised(info.value)


def test_waiting_for_claims_other_processes_hold_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signature another process claimed (here: a lease held elsewhere, as by a
    worker that was killed) is waited for up to ``JAXAOT_LEASE_WAIT``: the wait
    is said once (``jaxaot precompile`` prints it), then it is made here."""
    monkeypatch.setenv("JAXAOT_LEASE_WAIT", "0.5")
    cache = DirectoryCache(tmp_path / "c")
    m = jaxaot.manifest("m").add(
        jaxaot.jit(lambda x: x * 3), jax.ShapeDtypeStruct((2,), jnp.float32)
    )
    held = cache.lease(m.digest(0, "r"), 60.0)  # (another open file: held as by another process)
    assert held is not None and hasattr(held, "release")
    events: list[tuple[str, str]] = []
    with jaxaot.using_cache(cache):
        report = m.precompile(run="r", on_item=lambda e, r: events.append((e, r.note)))
    held.release()
    said = "waiting for 1 signature(s) other processes claimed (a claim of one that stopped is taken over after 0.5 s)"
    assert ("waiting", said) in events, events
    assert [e for e, _ in events][-2:] == ["start", "done"] and report.items[0].made >= 1
