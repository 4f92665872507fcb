"""Which programs a component serves as plain JAX, and why.

A component's entry stands for its program under every transformation, and
its types are shape, dtype and weak type. Two kinds of program mean more than
that, and are served as ``jax.jit`` serves them (inlined into the caller
under tracing, compiled from the body at top level):

* programs whose types carry shardings (explicit mesh axes), and
* programs that name devices (a concrete mesh or sharding in an equation).

:func:`needs_plain_jax` tells them. :func:`needs_context` tells a program
that can only be lowered inside a context it does not have (its entry stays
in this process and is only ever transformed).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, Sharding

from .._jax import named_axis_effect, uses_primitive, walk_jaxprs
from .._keys._sharding import sharded_type

__all__ = ["needs_context", "needs_plain_jax"]


def _concrete(value: Any) -> bool:
    """A value naming devices: a device, a concrete mesh or a sharding over one."""
    if isinstance(value, jax.Device):
        return True
    if isinstance(value, Mesh):
        return not value.empty
    if isinstance(value, NamedSharding):
        return isinstance(value.mesh, Mesh) and not value.mesh.empty
    return isinstance(value, Sharding)


def _names_devices(eqn: Any) -> bool:
    for value in eqn.params.values():
        items = value if isinstance(value, list | tuple) else (value,)
        if any(_concrete(v) for v in items):
            return True
    return False


def needs_plain_jax(closed: Any) -> str | None:
    """Why a traced program has to be served as plain JAX (inlined into the caller,
    or compiled as ``jax.jit`` compiles it), or ``None``.

    * Its types carry shardings (explicit mesh axes): a cached entry's types
      would lose them, and with them output shardings, cotangent types and what
      ``jax.typeof(x).sharding`` tells the body.
    * It names devices (``with_sharding_constraint`` or ``device_put`` with a
      concrete sharding, ``shard_map`` over a concrete mesh): which devices a
      computation runs on is decided from everything it contains, and a cached
      entry hides its contents from that decision.
    """
    for jaxpr in walk_jaxprs(closed):
        for v in (*jaxpr.invars, *jaxpr.outvars):
            if sharded_type(getattr(v, "aval", None)):
                return "sharded types"
        for eqn in jaxpr.eqns:
            if _names_devices(eqn):
                return f"{eqn.primitive.name} names devices"
            if any(sharded_type(getattr(v, "aval", None)) for v in eqn.outvars):
                return "sharded types"
    return None


def needs_context(closed: Any) -> bool:
    """Whether a jaxpr can only be lowered inside a context it does not have: it uses
    a named axis bound outside it (``psum`` over an outer ``vmap`` axis), or a
    ``custom_vjp`` linear part (only transposable)."""
    return named_axis_effect(closed.effects) or uses_primitive(closed, ("custom_lin",))
