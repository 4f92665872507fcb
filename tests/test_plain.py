"""Which programs are served as plain JAX (``jaxaot._inline``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxaot._component import _plain


def _mesh1(name: str) -> jax.sharding.Mesh:
    return jax.make_mesh((1,), (name,), axis_types=(jax.sharding.AxisType.Auto,))


def test_plain_programs_are_not_inlined() -> None:
    assert _plain.needs_plain_jax(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(2))) is None
    nested = jax.make_jaxpr(jax.jit(lambda x: x @ x.T))(jnp.ones((2, 2)))
    assert _plain.needs_plain_jax(nested) is None


def test_programs_that_name_devices_are_told() -> None:
    named = jax.sharding.NamedSharding(_mesh1("x"), P("x"))
    constrained = jax.make_jaxpr(lambda x: jax.lax.with_sharding_constraint(x, named))(jnp.ones(2))
    assert "names devices" in (_plain.needs_plain_jax(constrained) or "")
    # Inside a nested jaxpr too.
    nested = jax.make_jaxpr(jax.jit(lambda x: jax.lax.with_sharding_constraint(x + 1, named)))(
        jnp.ones(2)
    )
    assert _plain.needs_plain_jax(nested) is not None
    put = jax.make_jaxpr(lambda x: jax.device_put(x, jax.devices()[0]) * 2)(jnp.ones(2))
    assert _plain.needs_plain_jax(put) is not None


def test_types_that_carry_shardings_are_told() -> None:
    plain = jax.typeof(jnp.ones(3))
    assert not _plain.sharded_type(plain)
    assert not _plain.sharded_type(None)
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones(4), P("x"))
        assert _plain.sharded_type(jax.typeof(x))
        closed = jax.make_jaxpr(lambda v: v * 2)(x)
        assert _plain.needs_plain_jax(closed) == "sharded types"
        replicated = jax.make_jaxpr(lambda v: v * 2)(jax.device_put(jnp.ones(4), P()))
        assert _plain.needs_plain_jax(replicated) is None
