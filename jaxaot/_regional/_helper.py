"""Compiling a whole program in a helper process of the lowest priority (CPU).

XLA:CPU compiles on threads of its own pool, not on the thread that asks for
the compile, so a low priority set on that thread (``_pool``) never reaches
the work: compiling a whole program beside the split program's steps took
both cores of a 2-core machine and slowed those steps by half or more
(``docs/regional.md``). A helper process, all of whose threads run at the
lowest priority, takes only the cycles the steps leave.

The program travels as a serialized ``jax.export`` module (the same StableHLO
``jax.jit`` lowers, compiled there as ``jax.jit`` of the module's call, with
the same donation), and the executable comes back serialized, with its
argument and result trees. A program that cannot travel that way (sharded,
weak-typed, not exportable) is compiled in this process, as is every program
once the helper has failed (one warning).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from .. import _stats
from .._jax import default_platform, deserialize_executable

logger = logging.getLogger("jaxaot")

__all__ = ["HELPER_NICENESS", "Helped", "compile_in_helper", "helper_enabled"]

HELPER_NICENESS = 19
# A helper that has not answered by then is stopped (the program is compiled here).
TIMEOUT_SECONDS = 900.0
# ``JAXAOT_COMPILE_HELPER=0`` compiles whole programs in this process.
ENV = "JAXAOT_COMPILE_HELPER"
# Configuration that is this process's own, not the program's.
_OWN_CONFIG = ("platform", "cache", "distributed", "coordinator")

_FAILED = threading.Event()  # the helper failed: it is not started again


class Helped(NamedTuple):
    """A program compiled in the helper: its executable, loaded here, the bytes it
    was loaded from, and the helper's process id and niceness."""

    executable: Any
    payload: bytes
    pid: int
    niceness: int | None


def helper_enabled() -> bool:
    """Whether whole programs may be compiled in a helper process here: a CPU
    backend, one process (no distributed job), no default device set, and
    ``$JAXAOT_COMPILE_HELPER`` not ``0``."""
    if os.environ.get(ENV, "").strip() == "0" or _FAILED.is_set():
        return False
    if default_platform() != "cpu" or jax.process_count() != 1:
        return False
    return jax.config.values.get("jax_default_device") is None and bool(sys.executable)


def _travels(avals: Sequence[Any], shardings: Sequence[Any] | None) -> bool:
    """Whether a program of these input types and shardings can be compiled in
    the helper: unsharded, and no weak-typed input (an exported module's types
    are strong)."""
    if shardings is not None and any(s is not None for s in shardings):
        return False
    return not any(getattr(a, "weak_type", False) for a in avals)


def _config() -> dict[str, Any]:
    """JAX's configuration in this process, as far as it can shape a compile."""
    return {
        name: value
        for name, value in jax.config.values.items()
        if isinstance(value, bool | int | float | str)
        and not any(word in name for word in _OWN_CONFIG)
    }


def _fail(cause: str) -> None:
    _FAILED.set()
    _stats.warn_once(
        "compile helper",
        f"jaxaot: the compile helper process failed ({cause}); whole programs are "
        "compiled in this process from now on",
    )


def compile_in_helper(
    fn: Callable[..., Any],
    avals: Sequence[Any],
    donate: tuple[int, ...],
    shardings: Sequence[Any] | None = None,
) -> Helped | None:
    """``jax.jit(fn, keep_unused=True, donate_argnums=donate)`` compiled for
    ``avals`` (``jax.ShapeDtypeStruct``) in a helper process of the lowest
    priority (see ``Helped``). ``None`` when
    the program cannot travel (see the module) or the helper failed: compile
    it here."""
    if not helper_enabled() or not _travels(avals, shardings):
        return None
    try:
        exported = jax.export.export(jax.jit(fn, keep_unused=True))(*avals)
        if any(a.weak_type for a in exported.out_avals):
            return None
        request = {
            "module": bytes(exported.serialize()),
            "donate": tuple(donate),
            "config": _config(),
        }
    except Exception as e:  # not exportable: compiled here
        logger.debug("jaxaot: whole program compiled in this process (%s: %s)", type(e).__name__, e)
        return None
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # The helper imports this jaxaot, wherever this process found it.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _COMMAND],
            input=pickle.dumps(request),
            capture_output=True,
            env=env,
            timeout=TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        _fail(f"{type(e).__name__}: {e}")
        return None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        _fail(f"exit status {done.returncode}: {tail[0]}")
        return None
    try:
        answer = pickle.loads(done.stdout)
        if "error" in answer:  # the program failed to compile there: it is compiled here
            logger.debug(
                "jaxaot: the helper could not compile a whole program (%s)", answer["error"]
            )
            return None
        payload = answer["payload"]
        exe = deserialize_executable(payload, answer["in_tree"], answer["out_tree"])
    except Exception as e:
        _fail(f"unreadable answer: {type(e).__name__}: {e}")
        return None
    logger.debug("jaxaot: whole program compiled in helper process %s", answer["pid"])
    return Helped(exe, payload, answer["pid"], answer["niceness"])


# The helper lowers its priority before it imports anything (JAX's threads,
# started later, inherit it), then serves one request.
_COMMAND = f"""
import os
try:
    os.nice({HELPER_NICENESS})
except (AttributeError, OSError):
    pass
from {__name__} import serve
serve()
"""


def serve() -> None:
    """The helper's side: one request on stdin, one answer on stdout."""
    request = pickle.loads(sys.stdin.buffer.read())
    for name, value in request["config"].items():
        if jax.config.values.get(name, value) != value:
            try:
                jax.config.update(name, value)
            except Exception:  # read-only here: left as it is
                pass
    from .._jax import serialize_executable

    answer: dict[str, Any] = {
        "pid": os.getpid(),
        "niceness": os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None,
    }
    try:
        exported = jax.export.deserialize(bytearray(request["module"]))
        compiled = (
            jax.jit(exported.call, keep_unused=True, donate_argnums=request["donate"])
            .trace(*exported.in_avals)
            .lower()
            .compile()
        )
        answer["payload"], answer["in_tree"], answer["out_tree"] = serialize_executable(compiled)
    except Exception as e:  # this program's own failure: the caller compiles it
        answer["error"] = f"{type(e).__name__}: {e}"
    sys.stdout.buffer.write(pickle.dumps(answer))
    sys.stdout.buffer.flush()
