"""Platform names as lowering uses them (``cuda``, not ``gpu``)."""

from __future__ import annotations

import jax
from jax._src import xla_bridge as _xb

__all__ = ["KNOWN_PLATFORMS", "canonical_platform", "default_platform"]

KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def canonical_platform(platform: str) -> str:
    """Maps a backend or device platform name ("gpu", "cuda", "cpu") to its lowering name."""
    try:
        return str(_xb.canonicalize_platform(platform))
    except Exception:  # an unknown platform name: keep it as given
        return platform.lower()


def default_platform() -> str:
    """The lowering platform of JAX's default backend on this machine."""
    return canonical_platform(jax.default_backend())
