"""The ``@jaxaot.component`` decorator."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import ParamSpec, TypeVar, overload

from ._component import Component

__all__ = ["component"]

P = ParamSpec("P")
R = TypeVar("R")


@overload
def component(
    fun: Callable[P, R],
    /,
    *,
    key: Hashable | Callable[..., Hashable] | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
) -> Component[P, R]: ...


@overload
def component(
    fun: None = None,
    /,
    *,
    key: Hashable | Callable[..., Hashable] | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
) -> Callable[[Callable[P, R]], Component[P, R]]: ...


def component(
    fun: Callable[P, R] | None = None,
    /,
    *,
    key: Hashable | Callable[..., Hashable] | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
) -> Component[P, R] | Callable[[Callable[P, R]], Component[P, R]]:
    """Marks ``fun`` as a component: traced, lowered and compiled once per signature.

    Args:
      fun: the function. Its arguments and results may be any pytrees of arrays.
      key: the component's identity in caches. ``None`` (the default) derives
        it from what the function computes: the traced program (its equations,
        constants and custom derivative rules), traced once per signature in
        a process, so an edited helper or a changed constant is a new key. A
        str, int or tuple of those names it explicitly, without tracing (two
        functions with one key are taken to compute the same thing); a
        callable receives the call's arguments and returns such a value.
      static_argnums, static_argnames: arguments passed as Python values, part
        of the key by value, as in ``jax.jit``: numbers, strings, enums, dtypes,
        frozen dataclasses, NamedTuples, functions and tuples or frozensets of
        those (see the docs' "Static arguments"); an unhashable value gets
        ``jax.jit``'s error, a value without a stable form a ``TypeError``
        naming it.
      donate_argnums, donate_argnames: arguments whose buffers top-level calls
        may reuse, by position or by name (completed from each other, as in
        ``jax.jit``; a name must be a positional parameter's).

    Host callbacks (``jax.debug.print``, ``jax.pure_callback``,
    ``io_callback``, Equinox's runtime checks) work in components and are
    cached: a new process loads the executable with its own callbacks bound.
    A callback must never call back into JAX.

    Example::

      @jaxaot.component
      def block(params, x):
          return jnp.tanh(x @ params["w"] + params["b"])
    """

    def wrap(f: Callable[P, R]) -> Component[P, R]:
        return Component(
            f,
            key=key,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
        )

    if fun is None:
        return wrap
    return wrap(fun)
