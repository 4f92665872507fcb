"""The steady-state form a process settled on for a split program (its split
program or its whole-program form), kept in the cache: the next process with
the same program starts in that form, without running the other and timing
both again (a warm process of small steps runs its whole program from its
first calls on).

A recorded choice is a measurement, not a result: whichever form runs, the
values are the program's. It is keyed like the whole program itself (the split
program's text, the keys of the entries it calls, the input types and donated
inputs, the platform and versions), so a program that changed, or another
platform, finds none and chooses afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax

from .._keys._key import ComponentKey
from .._store._active import get_cache
from .._store._entry import Entry
from .._store._readwrite import read, write
from ._plan import SPLIT, WHOLE
from ._programs import program_key

__all__ = ["recall", "remember"]

logger = logging.getLogger("jaxaot")

_FORMS = (SPLIT, WHOLE)
_KIND = "steady-state choice"


def _key(digest: str, avals: Sequence[Any], donated: tuple[int, ...]) -> ComponentKey:
    return program_key(_KIND, digest, avals, donated)


def recall(digest: str, avals: Sequence[Any], donated: tuple[int, ...]) -> str | None:
    """The form recorded for the program ``digest`` names (at ``avals``, with
    ``donated`` inputs) in the active cache, or ``None``."""
    cache = get_cache()
    if cache is None:
        return None
    entry = read(cache, _key(digest, avals, donated))
    if entry is None:
        return None
    form = entry.extra.get("form")
    return form if form in _FORMS else None


def remember(
    digest: str,
    avals: Sequence[Any],
    donated: tuple[int, ...],
    form: str,
    measured: dict[str, float],
) -> None:
    """Records ``form`` for the program in the active cache, with what ``measured``
    (milliseconds a call of each form, where timed) says of it."""
    cache = get_cache()
    if cache is None or form not in _FORMS:
        return
    key = _key(digest, avals, donated)
    write(
        cache,
        Entry(
            key=key,
            name=_KIND,
            in_avals=tuple(avals),
            out_avals=(),
            out_tree=jax.tree_util.tree_structure(()),
            arg_names=("",) * len(avals),
            result_paths=(),
            extra={"form": form, "measured_ms": dict(measured)},
        ),
    )
    logger.debug("jaxaot.jit: recorded the %s program as the steady form (%s)", form, measured)
