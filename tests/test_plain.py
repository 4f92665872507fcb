"""Which devices a component's program names, its device witness, and which programs
stay plain JAX (``jaxaot._component._plain``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxaot._component import _plain
from jaxaot._jax import named_shardings
from jaxaot._keys._sharding import sharded_type


def _mesh1(name: str) -> jax.sharding.Mesh:
    return jax.make_mesh((1,), (name,), axis_types=(jax.sharding.AxisType.Auto,))


def test_programs_naming_no_devices_name_none() -> None:
    for closed in (
        jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(2)),
        jax.make_jaxpr(jax.jit(lambda x: x @ x.T))(jnp.ones((2, 2))),
    ):
        assert _plain.devices_of(closed) == ()
        assert _plain.needs_plain_jax(()) is None
        assert _plain.device_witness(()) is None


def test_the_devices_a_program_names_are_found_nested_too() -> None:
    device = jax.devices()[0]
    named = jax.sharding.NamedSharding(_mesh1("x"), P("x"))
    constrained = jax.make_jaxpr(lambda x: jax.lax.with_sharding_constraint(x, named))(jnp.ones(2))
    assert _plain.devices_of(constrained) == (
        ("mesh", ("x",), (1,), ("Auto",), (device.id,), named.memory_kind),
    )
    nested = jax.make_jaxpr(jax.jit(lambda x: jax.lax.with_sharding_constraint(x + 1, named)))(
        jnp.ones(2)
    )
    assert _plain.devices_of(nested) == _plain.devices_of(constrained)


def test_a_witness_names_the_same_devices_to_jax() -> None:
    """JAX's device assignment reads the witness as it reads the program itself."""
    named = jax.sharding.NamedSharding(_mesh1("x"), P("x"))
    closed = jax.make_jaxpr(lambda x: jax.lax.with_sharding_constraint(x, named))(jnp.ones(2))
    devices = _plain.devices_of(closed)
    witness = _plain.device_witness(devices)
    assert [s._device_assignment for s in named_shardings(witness)] == [
        s._device_assignment for s in named_shardings(closed)
    ]
    assert _plain.devices_of(witness) == devices
    assert _plain.needs_plain_jax(devices) is None
    assert _plain.devices_from_json(_plain.devices_to_json(devices)) == devices


def test_devices_this_process_lacks_stay_plain() -> None:
    missing = max(d.id for d in jax.devices()) + 1000
    reason = _plain.needs_plain_jax((("devices", (missing,), None),))
    assert reason is not None and "names devices" in reason


def test_types_that_carry_shardings_are_not_plain() -> None:
    assert not sharded_type(jax.typeof(jnp.ones(3)))
    assert not sharded_type(None)
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones(4), P("x"))
        assert sharded_type(jax.typeof(x))
        closed = jax.make_jaxpr(lambda v: v * 2)(x)
        assert _plain.devices_of(closed) == ()
        assert _plain.needs_plain_jax(_plain.devices_of(closed)) is None
