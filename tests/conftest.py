"""Shared fixtures: every test runs with its own empty in-memory cache, and
nothing ever touches the real home directory's cache."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

# Before JAX and jaxaot are imported anywhere: point every default location at a
# throwaway directory, so no test (or subprocess it starts) writes to $HOME.
_SESSION_TMP = tempfile.mkdtemp(prefix="jaxaot-tests-")
# Removed when this process (pytest, or one of its xdist workers) exits: the
# processes the tests start have ended by then.
atexit.register(shutil.rmtree, _SESSION_TMP, ignore_errors=True)
os.environ["JAXAOT_CACHE_DIR"] = os.path.join(_SESSION_TMP, "default-cache")
os.environ["XDG_CACHE_HOME"] = os.path.join(_SESSION_TMP, "xdg")
os.environ.pop("JAXAOT_CACHE", None)
os.environ.pop("JAXAOT_CACHE_HMAC_KEY", None)
os.environ.pop("JAXAOT_EXPLAIN_MISSES", None)
# The tests run on the CPU backend (a machine with libtpu installed, as the
# Python 3.12 leg has, otherwise probes for TPUs in this process and in every
# process the tests start); JAX_PLATFORMS set by the caller wins.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compile with XLA's backend optimization off (LLVM at -O0 on the CPU), in
# this process and in every process they start: compiling is most of the suite's
# time, and LLVM's passes most of a CPU compile's (time `python tests/_auto_worker.py
# 4` with and without the flag). No test times anything; values are compared with
# jax.jit's under the same flags, which are part of every key. A level the caller
# sets is kept: `XLA_FLAGS=--xla_backend_optimization_level=3` (XLA's default)
# runs the suite on the code users get.
OPT_FLAG = "--xla_backend_optimization_level"
if OPT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {OPT_FLAG}=0".strip()

import jax  # noqa: E402

import jaxaot  # noqa: E402
from jaxaot import _stats  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[jaxaot.MemoryCache]:
    """An empty MemoryCache as the process default for the test."""
    cache = jaxaot.MemoryCache()
    previous = jaxaot.get_cache()
    jaxaot.set_cache(cache)
    _stats.reset_warnings()
    try:
        yield cache
    finally:
        jaxaot.set_cache(previous)


@pytest.fixture
def subprocess_env(tmp_path: os.PathLike[str]) -> dict[str, str]:
    """Environment for child Python processes: the repo importable, a private cache dir."""
    env = dict(os.environ)
    env["JAXAOT_CACHE_DIR"] = os.path.join(os.fspath(tmp_path), "cache")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")]
    )
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture
def compiles() -> Iterator[list[str]]:
    """Counts every XLA backend compilation, as JAX reports them."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
