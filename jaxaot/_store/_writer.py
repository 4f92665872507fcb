"""The writer thread: entries (and notes) are written in the background, one at a
time, while the program that made them runs."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from .. import _stats

__all__ = ["in_background", "wait_for_writes", "written"]

_writer: concurrent.futures.ThreadPoolExecutor | None = None
_pending: dict[str, concurrent.futures.Future[None]] = {}
_pending_lock = threading.Lock()


def in_background(digest: str, write: Callable[[], None]) -> concurrent.futures.Future[None]:
    """Runs ``write`` (storing the entry ``digest`` names) on the writer thread;
    returns its future. The interpreter waits for the worker at exit;
    ``wait_for_writes`` and reads of the same key wait too."""
    global _writer
    with _pending_lock:
        if _writer is None:
            _writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxaot-writer")
        future = _writer.submit(_guarded, write)
        _pending[digest] = future

    def done(_: Any) -> None:
        with _pending_lock:
            if _pending.get(digest) is future:
                del _pending[digest]

    future.add_done_callback(done)
    return future


def _guarded(write: Callable[[], None]) -> None:
    """``write``; a failure is said once per kind and ends there (the entry is not
    written; the program has its result): it never reaches ``wait_for_writes``."""
    try:
        write()
    except Exception as e:
        _stats.bump("cache_write_errors")
        _stats.warn_once(
            f"background-write:{type(e).__name__}",
            f"jaxaot: writing a cache entry failed ({type(e).__name__}: {e}); this process "
            "goes on without it, and a new process makes it again",
        )


def wait_for_writes() -> None:
    """Blocks until every entry being written in the background is written."""
    with _pending_lock:
        futures = list(_pending.values())
    for future in futures:
        future.result()


def written(digest: str) -> None:
    """Waits for the background write of the entry ``digest`` names, if one is
    under way (so that a read finds it)."""
    with _pending_lock:
        pending = _pending.get(digest)
    if pending is not None:
        pending.result()
