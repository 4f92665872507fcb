"""Numbers and switches from ``JAXAOT_*`` environment variables, read where they
are used."""

from __future__ import annotations

import os

__all__ = ["SettingError", "flag", "number"]


class SettingError(ValueError):
    """A ``JAXAOT_*`` environment variable set to a value jaxaot cannot use (the
    command line says it in one line)."""


def number(name: str, default: float, what: str, *, minimum: float | None = None) -> float:
    """``$name`` as a number, or ``default`` where it is unset or blank.

    Raises:
      SettingError: naming the variable and ``what`` it must be, where it is not a
        number, or is below ``minimum``.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise SettingError(f"{name} must be {what}, got {text!r}") from None
    if minimum is not None and not value >= minimum:
        raise SettingError(f"{name} must be {what}, got {text!r}")
    return value


def flag(name: str) -> bool:
    """Whether ``$name`` is switched on (``1``, ``true``, ``yes`` or ``on``)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
