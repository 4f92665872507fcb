"""Serialized executables, and JAX's C++ dispatcher over executables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "cpp_dispatcher",
    "deserialize_executable",
    "fastpath_miss",
    "serialize_executable",
]


def serialize_executable(compiled: Any) -> tuple[bytes, Any, Any]:
    """(payload, in_tree, out_tree) of a ``jax.stages.Compiled``."""
    from jax.experimental import serialize_executable as _se

    return _se.serialize(compiled)  # type: ignore[no-any-return]


def deserialize_executable(payload: bytes, in_tree: Any, out_tree: Any) -> Any:
    """A loaded ``jax.stages.Compiled`` from ``serialize_executable``'s payload.

    The payload is JAX's own format (it includes a pickle of the executable's
    metadata): call this only on bytes whose checksum or signature verified."""
    from jax.experimental import serialize_executable as _se

    return _se.deserialize_and_load(payload, in_tree, out_tree)


def cpp_dispatcher(name: str, cache_miss: Callable[..., Any]) -> Callable[..., Any]:
    """A C++ dispatcher (as ``jax.jit`` uses) over many executables: calls with a
    signature it has seen run in C++; the others go to ``cache_miss``, which
    returns ``(outputs, fastpath_data_or_None, False)`` (see ``fastpath_miss``)."""
    from jax._src import tree_util as _tree_util
    from jax._src.interpreters import pxla as _pxla
    from jax._src.lib import _jax

    return _jax.pjit(  # type: ignore[no-any-return]
        name,
        None,
        cache_miss,
        [],
        [],
        _pxla.JitGlobalCppCacheKeys(),
        _tree_util.dispatch_registry,
        _pxla.cc_shard_arg,
    )


def fastpath_miss(
    compiled: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Any, Any, bool]:
    """Runs ``compiled`` and returns what a C++ dispatcher's cache miss returns, with
    the executable's fast-path data when it has some (so later calls stay in C++)."""
    call = getattr(compiled, "_call", None)
    if call is None and hasattr(compiled, "_executable") and hasattr(compiled, "_params"):
        call = compiled._executable.create_cpp_call(compiled._params)
        if call is not None:
            compiled._call = call
    miss = getattr(call, "_cache_miss", None)
    if miss is None:
        return compiled(*args, **kwargs), None, False
    return miss(*args, **kwargs)  # type: ignore[no-any-return]
