"""The distributed runtime's key-value client (``jax.distributed``)."""

from __future__ import annotations

from typing import Any

__all__ = ["distributed_client"]


def distributed_client() -> Any | None:
    """The client of a multi-process job's key-value store, or ``None`` outside one
    (a single process, or a runtime without a client)."""
    try:
        import jax

        if jax.process_count() <= 1:
            return None
        from jax._src import distributed  # the runtime client is not public API

        return distributed.global_state.client
    except Exception:  # not initialized, or an older runtime without a client
        return None
