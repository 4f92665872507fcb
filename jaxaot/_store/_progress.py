"""An opt-in display of long makes: with ``JAXAOT_PROGRESS=1`` and stderr a
terminal, work on a miss (tracing, lowering, compiling) that runs longer than
:data:`SHOW_AFTER` seconds shows a line on stderr saying what is being made and
for how long, gone when it is done.

The display is drawn by ``rich``, imported only once a line is shown; without
the variable, or off a terminal, or without rich, nothing is imported and
nothing is drawn.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .._env import flag

__all__ = ["PROGRESS_ENV", "SHOW_AFTER", "enabled", "showing"]

PROGRESS_ENV = "JAXAOT_PROGRESS"
#: Seconds a make runs before its line is shown (short makes never draw anything).
SHOW_AFTER = 0.5

_lock = threading.Lock()
_display: Any = None  # the rich Progress while any line is shown
_shown: set[int] = set()  # the display's task ids still running


def enabled() -> bool:
    """Whether makes are shown: ``$JAXAOT_PROGRESS`` is on, stderr is a terminal
    and rich is installed."""
    if not flag(PROGRESS_ENV):
        return False
    try:
        if not sys.stderr.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    return importlib.util.find_spec("rich") is not None


@contextlib.contextmanager
def showing(what: str) -> Iterator[None]:
    """Shows ``making WHAT`` with a spinner and the time so far while the block
    runs, once it has run :data:`SHOW_AFTER` seconds (when :func:`enabled`)."""
    if not enabled():
        yield
        return
    task: list[int] = []  # the line's task id once shown; -1 once the block is done
    timer = threading.Timer(SHOW_AFTER, _show, (what, task))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with _lock:
            _hide(task)
            task.append(-1)  # a timer that fires late shows nothing


def _show(what: str, task: list[int]) -> None:
    global _display
    with _lock:
        if task:
            return
        if _display is None:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            _display = Progress(
                SpinnerColumn(),
                TextColumn("jaxaot: making {task.description}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            _display.start()
        tid = _display.add_task(what, total=None)
        _shown.add(tid)
        task.append(tid)


def _hide(task: list[int]) -> None:
    """Under ``_lock``: removes the block's line; the display goes with the last."""
    global _display
    for tid in (t for t in task if t >= 0):
        _shown.discard(tid)
        if _display is not None:
            _display.remove_task(tid)
    if _display is not None and not _shown:
        _display.stop()
        _display = None
