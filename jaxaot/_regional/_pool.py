"""The threads that load and compile a plan's executables."""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from .._jax import options_set, thread_options
from ._placement import MeshContext

__all__ = ["submit_jobs"]

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def submit_jobs(
    jobs: dict[Any, Callable[[], Any]],
) -> dict[Any, concurrent.futures.Future[Any]]:
    """Starts the jobs (loading or compiling executables), in order, on a pool of
    threads: XLA compiles without holding the GIL, so a block's forward and
    backward executables compile at the same time, and while earlier steps run.
    Each job sees the caller's context (the cache set by ``using_cache``), mesh
    (``jax.set_mesh``) and JAX options set in a ``with`` block
    (``jax.enable_x64``): JAX keeps the last two per thread."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = max(2, os.cpu_count() or 1)
            _POOL = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxaot-jit")
        pool = _POOL
    mesh = MeshContext()
    if not mesh.empty:
        jobs = {k: functools.partial(_with_mesh, mesh, job) for k, job in jobs.items()}
    options = thread_options()
    if options:  # (``with jax.enable_x64(True):``: lowered for 64-bit types)
        jobs = {k: functools.partial(_with_options, options, job) for k, job in jobs.items()}
    return {k: pool.submit(contextvars.copy_context().run, job) for k, job in jobs.items()}


def _with_mesh(mesh: MeshContext, job: Callable[[], Any]) -> Any:
    with mesh.entered():
        return job()


def _with_options(options: tuple[tuple[Any, Any], ...], job: Callable[[], Any]) -> Any:
    with options_set(options):
        return job()
