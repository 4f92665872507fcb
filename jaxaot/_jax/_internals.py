"""The JAX internals jaxaot reads, imported here and nowhere else.

JAX's private ``_src`` package is what a JAX release may change without
notice: every name jaxaot takes from it comes through this module, so that an
upgrade is read in one place. Modules a plain ``import jaxaot`` need not load
are imported when first asked for (:func:`internal`).
"""

from __future__ import annotations

import importlib
from typing import Any

import jax

from .._versions import check_supported

# Checked before anything below is imported: an unsupported JAX fails with the
# supported range named, not with a missing private name.
JAX_VERSION = check_supported(jax.__version__)

from jax._src import (  # noqa: E402  # noqa: E402
    ad_checkpoint,
    array,
    callback,
    checkify,
    config,
    core,
    debugging,
    dispatch,
    dtypes,
    effects,
    pjit,
    xla_bridge,
)
from jax._src.ad_util import Zero  # noqa: E402
from jax._src.interpreters import ad, batching, mlir, partial_eval  # noqa: E402
from jax._src.lib import xla_client  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax._src.lib.mlir.dialects import func as func_dialect  # noqa: E402
from jax._src.random import prng  # noqa: E402
from jax._src.sharding_impls import UNSPECIFIED  # noqa: E402

__all__ = [
    "JAX_VERSION",
    "UNSPECIFIED",
    "Zero",
    "ad",
    "ad_checkpoint",
    "array",
    "batching",
    "callback",
    "checkify",
    "config",
    "core",
    "debugging",
    "dispatch",
    "dtypes",
    "effects",
    "func_dialect",
    "internal",
    "ir",
    "mlir",
    "partial_eval",
    "pjit",
    "prng",
    "xla_bridge",
    "xla_client",
]


def internal(name: str) -> Any:
    """``jax._src.<name>`` (``"lib.lapack"``), as ``from jax._src.lib import lapack``
    reads it (a name of the package, else its submodule), imported when first
    asked for. Raises ``ImportError`` where the installed JAX has none."""
    parent, _, child = f"jax._src.{name}".rpartition(".")
    package = importlib.import_module(parent)
    found = getattr(package, child, None)
    return found if found is not None else importlib.import_module(f"{parent}.{child}")
