"""Compile targets (``jaxaot._jax._target``, ``jaxaot precompile --target``).

Without libtpu (Python 3.11, CI's first leg): parsing, refusals (GPUs, malformed
targets, libtpu missing: the CLI exits 2 naming the extra), and the topology key
part of devices with coordinates. With libtpu (``jaxaot[tpu-aot]``, Python >=
3.12, CI's second leg): a precompile for ``tpu:v5e:2x2`` in worker processes
writes executables keyed for that topology (backend tpu, its device kind, 4
devices, its topology), and a later CPU process on the same cache loads none of
them: it compiles, and its values equal ``jax.jit``'s. Loading on a real TPU is
not tested here (no TPU).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxaot
from jaxaot._caches._directory import DirectoryCache
from jaxaot._jax import _target
from jaxaot._jax._target import (
    Target,
    TargetError,
    parse_target,
    platform_version_text,
    set_target,
    topology_text,
)
from jaxaot._store._entry import decode
from jaxaot.cli import main

TESTS = Path(__file__).resolve().parent
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU,
    reason="libtpu is not installed (jaxaot[tpu-aot], Python >= 3.12: CI's second leg)",
)


@pytest.fixture
def no_target() -> Iterator[None]:
    """The test's target is undone after it."""
    before = set_target(None)
    try:
        yield
    finally:
        set_target(before)


# -- without libtpu ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("tpu:v5e:2x2", Target("tpu", "v5e:2x2")),
        ("tpu:v4:2x2x1", Target("tpu", "v4:2x2x1")),
        ("TPU:v5p:2x2x1_twisted", Target("tpu", "v5p:2x2x1_twisted")),
        (" tpu:v6e:4x4 ", Target("tpu", "v6e:4x4")),
    ],
)
def test_parse(text: str, want: Target) -> None:
    assert parse_target(text) == want
    assert parse_target(want.spec) == want


@pytest.mark.parametrize(
    "text", ["tpu", "tpu:", "tpu:v5e", "tpu:v5e:2", "tpu:2x2", "v5e:2x2", "cpu"]
)
def test_parse_refuses_malformed(text: str) -> None:
    with pytest.raises(TargetError, match="v5e:2x2"):
        parse_target(text)


@pytest.mark.parametrize("text", ["cuda:h100:8", "gpu:a100", "rocm:mi300"])
def test_parse_refuses_gpus(text: str) -> None:
    with pytest.raises(TargetError, match="23971"):
        parse_target(text)


def _device(i: int, coords: tuple[int, ...] | None, core: int = 0, process: int = 0) -> Any:
    return SimpleNamespace(id=i, coords=coords, core_on_chip=core, process_index=process)


def test_topology_text() -> None:
    devices = [
        _device(1, (1, 0, 0)),
        _device(0, (0, 0, 0)),
        _device(3, (1, 1, 0), process=1),
        _device(2, (0, 1, 0), process=1),
    ]
    text = topology_text(devices)
    assert text == "2x2x1 cores=1; 0@0,0,0/0:0 1@1,0,0/0:0 2@0,1,0/0:1 3@1,1,0/0:1"
    assert topology_text(list(reversed(devices))) == text  # in id order, whatever given
    # Other coordinates, cores or processes: another topology.
    moved = [*devices[:3], _device(2, (0, 1, 0), process=0)]
    assert topology_text(moved) != text
    two_cores = [_device(0, (0, 0, 0), 0), _device(1, (0, 0, 0), 1)]
    assert topology_text(two_cores) == "1x1x1 cores=2; 0@0,0,0/0:0 1@0,0,0/1:0"
    # Devices without coordinates (CPUs, GPUs) have none: their keys are unchanged.
    assert topology_text(jax.devices()) is None
    assert topology_text([]) is None


def test_platform_version_text() -> None:
    built = "TFRT TPU v5 lite\nBuilt on Oct 22 2026 00:45:19 (1792655119) cl/1004524046"
    tpu = SimpleNamespace(platform="tpu", platform_version=built + " compile_only_runtime")
    real = SimpleNamespace(platform="tpu", platform_version=built)
    assert platform_version_text(tpu) == platform_version_text(real)
    assert platform_version_text(tpu) == " ".join(built.split())
    cpu = jax.devices()[0].client
    assert platform_version_text(cpu) == str(cpu.platform_version)


def test_no_target_keys_unchanged(no_target: None) -> None:
    from jaxaot._store._executables import executable_parts, target_process_keys

    parts = dict(executable_parts(()))
    assert parts["backend"] == jax.default_backend()
    assert parts["device_count"] == jax.device_count()
    assert "topology" not in parts
    assert jaxaot.target_devices() == jax.devices()
    assert target_process_keys(jaxaot.ComponentKey({"executable": ()})) == []


def test_libtpu_missing_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_target: None
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a)
    )
    _target._topology_devices.cache_clear()
    with pytest.raises(TargetError, match=r"jaxaot\[tpu-aot\]"):
        set_target(parse_target("tpu:v5e:2x2"))
    assert _target.active_target() is None
    assert main(["precompile", "_precompile_targets:topology", "--target", "tpu:v5e:2x2"]) == 2
    assert 'pip install "jaxaot[tpu-aot]"' in capsys.readouterr().err
    _target._topology_devices.cache_clear()


def test_cli_refuses_bad_targets(capsys: pytest.CaptureFixture[str]) -> None:
    for text, words in [
        ("v5e:2x2", "expected tpu:GENERATION:CHIPS"),
        ("cuda:h100:8", "no deviceless GPU compile"),
        ("tpu:v5e:banana", "is not a TPU topology"),
    ]:
        assert main(["precompile", "_precompile_targets:topology", "--target", text]) == 2
        assert words in capsys.readouterr().err


# -- with libtpu ---------------------------------------------------------------------


@needs_libtpu
def test_topology_devices(no_target: None) -> None:
    target = parse_target("tpu:v5e:2x2")
    set_target(target)
    devices = jaxaot.target_devices()
    assert [d.id for d in devices] == [0, 1, 2, 3]
    assert {d.platform for d in devices} == {"tpu"}
    assert {d.device_kind for d in devices} == {"TPU v5 lite"}
    assert (
        topology_text(devices) == "2x2x1 cores=1; 0@0,0,0/0:0 1@1,0,0/0:0 2@0,1,0/0:0 3@1,1,0/0:0"
    )
    with pytest.raises(TargetError, match="libtpu cannot describe this topology"):
        set_target(parse_target("tpu:v99:2x2"))
    assert _target.active_target() == target  # a failed set leaves the active one


def _executable_parts(blobs: list[bytes]) -> list[dict[str, Any]]:
    parts = []
    for blob in blobs:
        entry = decode(blob)
        executable = entry.key.parts.get("executable")
        if entry.executable is not None and executable:
            parts.append({**dict(executable), "platforms": entry.key.parts["platforms"]})
    return parts


@needs_libtpu
def test_component_under_a_target_in_process(no_target: None) -> None:
    """A component precompiled for a 2-process topology (v5e:2x4): one entry per
    process index, keyed for the topology; calling it under the target is refused;
    unsharded arguments compile for the target's first device."""
    cache = jaxaot.MemoryCache()

    @jaxaot.component
    def affine(w: jax.Array, x: jax.Array) -> jax.Array:
        return x @ w + 1.0

    with jaxaot.using_cache(cache):
        set_target(parse_target("tpu:v5e:2x4"))
        devices = jaxaot.target_devices()
        assert len(devices) == 8 and {d.process_index for d in devices} == {0, 1}
        mesh = Mesh(np.array(devices), ("d",))
        w = jax.ShapeDtypeStruct(
            (16, 16), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec())
        )
        x = jax.ShapeDtypeStruct(
            (8, 16), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("d"))
        )
        compiled = affine.precompile(w, x)
        assert {d.platform for d in compiled.input_shardings[0][1].device_set} == {"tpu"}
        one = affine.precompile(
            jax.ShapeDtypeStruct((16, 16), jnp.float32), np.ones((4, 16), np.float32)
        )
        assert one.input_shardings[0][0].device_set == {devices[0]}
        with pytest.raises(RuntimeError, match="compile target tpu:v5e:2x4"):
            affine(jnp.ones((16, 16)), jnp.ones((4, 16)))
        with pytest.raises(TypeError, match="placed on cpu devices"):
            affine.precompile(
                jnp.ones((16, 16)), jax.device_put(jnp.ones((4, 16)), jax.devices()[0])
            )
        jaxaot.wait_for_writes()
        set_target(None)
        parts = _executable_parts([cache.get(k) for k in cache.keys()])  # type: ignore[misc]
    # Two signatures, each written for process 0 and process 1.
    assert sorted((p["device_count"], p["process_index"]) for p in parts) == [
        (8, 0),
        (8, 0),
        (8, 1),
        (8, 1),
    ]
    for p in parts:
        assert p["backend"] == "tpu" and p["device_kind"] == "TPU v5 lite"
        assert p["process_count"] == 2 and p["platforms"] == ("tpu",)
        assert p["topology"].startswith("2x4x1 cores=1; ")
        assert "compile_only_runtime" not in p["platform_version"]
    # Without the target, the same signature is CPU's again (its own keys).
    assert affine.cache_key(np.ones((16, 16), np.float32), np.ones((4, 16), np.float32)).parts[
        "platforms"
    ] == (jax.default_backend(),)


@needs_libtpu
def test_jit_under_a_target_in_process(no_target: None) -> None:
    cache = jaxaot.MemoryCache()

    @jaxaot.component
    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w)

    @jaxaot.jit
    def net(w: jax.Array, x: jax.Array) -> jax.Array:
        for _ in range(3):
            x = layer(w, x)
        return x.sum()

    with jaxaot.using_cache(cache):
        set_target(parse_target("tpu:v5e:2x2"))
        mesh = Mesh(np.array(jaxaot.target_devices()), ("d",))
        w = jax.ShapeDtypeStruct(
            (16, 16), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec())
        )
        x = jax.ShapeDtypeStruct(
            (8, 16), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("d"))
        )
        net.precompile(w, x)
        net.precompile(
            jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32)
        )
        with pytest.raises(RuntimeError, match="jaxaot.jit net: called under the compile target"):
            net(jnp.ones((16, 16)), jnp.ones((8, 16)))
        # Shardings over this machine's devices (jax.devices(), not target_devices()):
        # under plain jax.jit it would compile for the CPU, nothing for the target.
        cpu = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec())
        with pytest.raises(TypeError, match="placed on cpu devices"):
            net.precompile(
                jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=cpu),
                jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=cpu),
            )
        jaxaot.wait_for_writes()
        set_target(None)
        parts = _executable_parts([cache.get(k) for k in cache.keys()])  # type: ignore[misc]
    assert parts and all(p["backend"] == "tpu" and p["device_count"] == 4 for p in parts)


def _precompile(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jaxaot", "precompile", *args],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@needs_libtpu
def test_precompile_for_a_topology_is_not_loaded_on_cpu(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``jaxaot precompile --target tpu:v5e:2x2`` writes executables keyed for that
    topology; a later CPU process (4 simulated devices) on the same cache loads
    none of them (it compiles every signature) and computes jax.jit's values."""
    cache = tmp_path / "cache"
    env = dict(subprocess_env, JAXAOT_CACHE="dir", JAXAOT_CACHE_DIR=str(cache))
    env.pop("XLA_FLAGS", None)
    proc = _precompile(
        env, "_precompile_targets:topology", "--target", "tpu:v5e:2x2", "--workers", "2"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "precompiled 2 signatures for tpu:v5e:2x2: " in proc.stdout
    store = DirectoryCache(cache)
    parts = _executable_parts([store.get(k) for k in store.keys()])  # type: ignore[misc]
    assert len(parts) == 2, parts
    for p in parts:
        assert p["backend"] == "tpu" and p["device_kind"] == "TPU v5 lite"
        assert p["device_count"] == 4 and p["process_count"] == 1 and p["process_index"] == 0
        assert p["topology"] == "2x2x1 cores=1; 0@0,0,0/0:0 1@1,0,0/0:0 2@0,1,0/0:0 3@1,1,0/0:0"
        assert p["platforms"] == ("tpu",)
    before = set(store.keys())

    deploy = subprocess.run(
        [sys.executable, str(TESTS / "_precompile_deploy.py"), "_precompile_targets:topology"],
        cwd=TESTS,
        env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    result = json.loads(deploy.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    # Nothing of the TPU's was loaded: jaxaot compiled both signatures (JAX saw it).
    assert result["jaxaot"]["compiles"] >= 2 and len(result["compiles"]) >= 2, result
    assert result["equal"] == [True, True]
    # The TPU entries are left in place, next to the CPU's own.
    assert before < set(store.keys())


@needs_libtpu
def test_precompile_unknown_topology_exits_2(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    env = dict(subprocess_env, JAXAOT_CACHE="dir", JAXAOT_CACHE_DIR=str(tmp_path / "cache"))
    proc = _precompile(
        env, "_precompile_targets:topology", "--target", "tpu:v99:2x2", "--workers", "1"
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "libtpu cannot describe this topology" in proc.stdout + proc.stderr
