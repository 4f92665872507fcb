"""The JAX versions jaxaot supports, checked without importing JAX.

``jaxaot/__init__.py`` checks the installed distribution's version when
jaxaot is imported (``importlib.metadata``: no JAX import, so ``import
jaxaot`` stays light), and ``_jaxcompat`` checks ``jax.__version__`` again
when JAX is loaded. Either way, a JAX outside the range is one ``ImportError``
naming the range, never an ``AttributeError`` deep inside.
"""

from __future__ import annotations

import re

SUPPORTED_JAX = ((0, 10, 2), (0, 13, 0))  # [first supported, first unsupported)
SUPPORTED_JAX_TEXT = "jax>=0.10.2,<0.13"


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; a suffix such as ``.dev20260101`` or
    ``rc1`` ends the number."""
    parts: list[int] = []
    for piece in text.split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):
            break
    return tuple(parts)


def check_supported(version: str) -> tuple[int, ...]:
    """The version tuple of JAX ``version``; ImportError naming the supported range
    when jaxaot does not support it."""
    parsed = version_tuple(version)
    if not SUPPORTED_JAX[0] <= parsed < SUPPORTED_JAX[1]:
        raise ImportError(
            f"jaxaot supports {SUPPORTED_JAX_TEXT}, but jax {version} is installed: "
            f"install a supported JAX (pip install '{SUPPORTED_JAX_TEXT}' "
            "'jaxlib>=0.10.2,<0.13')"
        )
    return parsed


def check_installed() -> None:
    """Checks the installed ``jax`` distribution, if there is one (a missing JAX
    fails later, at its import, with Python's own error)."""
    from importlib import metadata

    try:
        version = metadata.version("jax")
    except metadata.PackageNotFoundError:
        return
    check_supported(version)
