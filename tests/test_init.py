"""The public surface: every exported name imports, and ``import jaxaot`` stays light."""

from __future__ import annotations

import subprocess
import sys

import jaxaot


def test_every_public_name_is_exported() -> None:
    for name in jaxaot.__all__:
        assert getattr(jaxaot, name) is not None, name
    assert sorted(jaxaot.__all__) == sorted(set(jaxaot.__all__))
    public = {n for n in dir(jaxaot) if not n.startswith("_")}
    assert set(jaxaot.__all__) <= public


def test_import_is_light(subprocess_env: dict[str, str]) -> None:
    code = (
        "import sys, jaxaot; "
        "heavy = [m for m in ('redis', 'fsspec', 'rich', 'optax', 'matplotlib', 'equinox') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    assert _printed(code, subprocess_env) == ""


def test_importing_every_public_name_compiles_nothing(subprocess_env: dict[str, str]) -> None:
    """No XLA compile at import (an array made at module level is one, in every
    process: a warm start would never reach zero compiles)."""
    code = (
        "import jax, jax.monitoring as m; c = []; "
        "m.register_event_duration_secs_listener("
        "lambda e, d, **k: c.append(e) if e == '/jax/core/compile/backend_compile_duration' else None); "
        "import jaxaot, jaxaot.cli; [getattr(jaxaot, n) for n in jaxaot.__all__]; print(len(c))"
    )
    assert _printed(code, subprocess_env) == "0"


def _printed(code: str, env: dict[str, str]) -> str:
    """What ``code`` prints, run by a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()
