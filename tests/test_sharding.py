"""Meshes, shardings and many devices (``jaxaot._sharding`` and how components use it).

The multi-device tests run in subprocesses that set
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX is imported;
each script compares values and output shardings with ``jax.jit`` of the same
function and exits non-zero (with a traceback) if any differs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxaot
from jaxaot._keys import _sharding

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import jaxaot

def same(got, want, what):
    got_l, want_l = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got_l) == len(want_l), what
    for g, w in zip(got_l, want_l):
        assert g.dtype == w.dtype, (what, g.dtype, w.dtype)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6,
                                   err_msg=what)
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (what, g.sharding, w.sharding)

def auto_mesh(shape, names, devices=None):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                         **({} if devices is None else {"devices": devices}))
"""


def run_devices(script: str, devices: int = 8, cache: Path | None = None) -> str:
    """Runs ``script`` (after PRELUDE) in a fresh interpreter with ``devices`` CPU
    devices (and ``cache`` as jaxaot's cache); returns its stdout."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    )
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("JAXAOT_CACHE_DIR", None)
    if cache is not None:
        env["JAXAOT_CACHE_DIR"] = str(cache)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


# -- key text ------------------------------------------------------------------------


def _mesh1(name: str) -> jax.sharding.Mesh:
    return jax.make_mesh((1,), (name,), axis_types=(jax.sharding.AxisType.Auto,))


def test_specs_and_meshes_read_as_text_that_tells_them_apart() -> None:
    assert _sharding.spec_text(P("x", None, ("a", "b"))) == "P(x,_,(a,b))"
    assert _sharding.spec_text(P("x")) != _sharding.spec_text(P(None, "x"))
    mesh = _mesh1("x")
    text = _sharding.mesh_text(mesh)
    assert "x=1" in text and f"[{jax.devices()[0].id}]" in text
    assert _sharding.mesh_text(mesh.abstract_mesh).startswith("abstract_mesh(x=1")
    other = _mesh1("y")
    assert _sharding.mesh_text(other) != text
    named = jax.sharding.NamedSharding(mesh, P("x"))
    assert _sharding.sharding_text(named) != _sharding.sharding_text(
        jax.sharding.NamedSharding(mesh, P())
    )
    make_single = getattr(jax.sharding, "make_single_device_sharding", None)
    if make_single is None:  # (JAX before 0.12)
        make_single = jax.sharding.SingleDeviceSharding
    single = make_single(jax.devices()[0])
    assert _sharding.sharding_text(single).startswith("device(")
    assert _sharding.value_text(3) is None
    assert all(_sharding.is_sharding_value(v) for v in (mesh, named, single, P("x")))


def test_placement_parts_tell_committed_inputs_from_those_the_call_places() -> None:
    x = jnp.ones(3)
    committed = jax.device_put(x, jax.devices()[0])
    parts = _sharding.input_sharding_parts([x, committed, 1.0, jax.ShapeDtypeStruct((3,), "f4")])
    assert parts[0] == parts[2] == parts[3] == "placed by the call"
    assert parts[1].startswith("committed:device(")


def test_static_meshes_shardings_and_specs_are_accepted_and_keyed() -> None:
    mesh = _mesh1("x")

    @jaxaot.component(static_argnums=(1, 2))
    def constrain(x: jax.Array, spec: P, m: jax.sharding.Mesh) -> jax.Array:
        return jax.lax.with_sharding_constraint(x * 2, jax.sharding.NamedSharding(m, spec))

    x = jnp.arange(4.0)
    got = constrain(x, P("x"), mesh)
    want = jax.jit(
        lambda x: jax.lax.with_sharding_constraint(x * 2, jax.sharding.NamedSharding(mesh, P("x")))
    )(x)
    assert jnp.array_equal(got, want)
    assert constrain.cache_key(x, P("x"), mesh) != constrain.cache_key(x, P(), mesh)


def test_a_closed_over_mesh_is_a_value_for_explicit_keys() -> None:
    mesh = _mesh1("x")
    sharding = jax.sharding.NamedSharding(mesh, P("x"))

    @jaxaot.component(key="constrained-double")
    def double(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x * 2, sharding)

    assert jnp.array_equal(double(jnp.arange(3.0)), jnp.arange(3.0) * 2)


# -- many devices ----------------------------------------------------------------------


def test_top_level_calls_compile_one_executable_per_input_sharding() -> None:
    run_devices(
        """
        mesh = auto_mesh((8,), ("x",))
        mesh2 = auto_mesh((2, 4), ("a", "b"))
        def body(x, w):
            return jnp.tanh(x @ w), x.sum()
        f = jaxaot.component(body)
        x = jnp.arange(128.0).reshape(16, 8) / 128
        w = jnp.ones((8, 8)) / 8
        placements = [
            jax.device_put(x, NamedSharding(mesh, P("x"))),
            jax.device_put(x, NamedSharding(mesh, P())),
            jax.device_put(x, NamedSharding(mesh, P(None, "x"))),
            jax.device_put(x, NamedSharding(mesh2, P("a", "b"))),
            jax.device_put(x, jax.devices()[3]),
            x,
        ]
        for i, xi in enumerate(placements):
            wi = w if i != 4 else jax.device_put(w, jax.devices()[3])
            same(f(xi, wi), jax.jit(body)(xi, wi), f"placement {i}")
        info = f.cache_info()
        assert info.compiles == len(placements), info
        for i, xi in enumerate(placements):  # again: nothing new
            wi = w if i != 4 else jax.device_put(w, jax.devices()[3])
            same(f(xi, wi), jax.jit(body)(xi, wi), f"placement {i} again")
        assert f.cache_info().compiles == len(placements), f.cache_info()
        assert f.cache_info().traces == 1, f.cache_info()  # one program: one trace
        # Donation of a sharded input at top level.
        g = jaxaot.component(lambda x: x + 1, donate_argnums=0)
        xs = jax.device_put(x, NamedSharding(mesh, P("x")))
        out = g(xs)
        assert xs.is_deleted()
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 2), out.sharding
        """
    )


def test_bodies_that_name_meshes_give_what_jax_jit_gives() -> None:
    run_devices(
        """
        mesh = auto_mesh((8,), ("x",))
        rows = NamedSharding(mesh, P("x"))

        def constrained(x):
            return jax.lax.with_sharding_constraint(jnp.sin(x) * 2, rows)

        def summed(x):
            return jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh,
                                 in_specs=P("x"), out_specs=P())(x)

        x = jnp.arange(32.0).reshape(16, 2)
        for body in (constrained, summed):
            for comp in (jaxaot.component(body), jaxaot.component(body, key=body.__name__)):
                want = jax.jit(body)(x)
                same(comp(x), want, f"{body.__name__} top level")
                same(jax.jit(comp)(x), want, f"{body.__name__} under jit")
                same(jax.jit(comp)(jax.device_put(x, rows)), jax.jit(body)(jax.device_put(x, rows)),
                     f"{body.__name__} sharded input")
                grad = jax.jit(jax.grad(lambda v: comp(v).sum()))(x)
                same(grad, jax.jit(jax.grad(lambda v: body(v).sum()))(x), f"{body.__name__} grad")

        # A static mesh and spec, and meshes that differ only in device order.
        @jaxaot.component(static_argnums=(1, 2))
        def put(x, m, spec):
            return jax.lax.with_sharding_constraint(x + 1, NamedSharding(m, spec))
        flipped = auto_mesh((8,), ("x",), devices=jax.devices()[::-1])
        x8 = jnp.arange(128.0).reshape(16, 8)
        for m in (mesh, flipped):
            for spec in (P("x"), P(None, "x"), P()):
                same(put(x8, m, spec), jax.jit(put.__wrapped__, static_argnums=(1, 2))(x8, m, spec),
                     f"static {spec}")
        assert put.cache_key(x8, mesh, P("x")) != put.cache_key(x8, flipped, P("x"))
        """
    )


def test_explicit_sharding_types_are_kept() -> None:
    run_devices(
        """
        mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))

        def scaled(x):  # branches on the type's sharding
            spec = jax.typeof(x).sharding.spec
            return jnp.sin(x) * (2.0 if spec and spec[0] == "x" else 3.0)

        def contract(x, w):
            return jnp.einsum("bd,de->be", x, w, out_sharding=P("x", None))

        def moved(x):
            return jax.sharding.reshard(x * 2, P(None, "x"))

        c_scaled = jaxaot.component(scaled)
        c_contract = jaxaot.component(contract)
        c_moved = jaxaot.component(moved)
        with jax.set_mesh(mesh):
            x = jax.device_put(jnp.arange(64.0).reshape(16, 4) / 64, P("x"))
            xr = jax.device_put(jnp.arange(64.0).reshape(16, 4) / 64, P())
            w = jax.device_put(jnp.ones((4, 8)) / 4, P())
            xw = jax.device_put(jnp.ones((8, 16)), P())
            for args, comp, body in [((x,), c_scaled, scaled), ((xr,), c_scaled, scaled),
                                     ((x, w), c_contract, contract), ((xw,), c_moved, moved)]:
                same(comp(*args), jax.jit(body)(*args), f"{body.__name__} top level")
                same(jax.jit(comp)(*args), jax.jit(body)(*args), f"{body.__name__} under jit")
                loss = lambda f: (lambda *a: f(*a).sum())
                same(jax.grad(loss(comp))(*args), jax.jit(jax.grad(loss(body)))(*args),
                     f"{body.__name__} grad")
            batched = jax.device_put(jnp.ones((8, 16, 4)), P("x"))
            same(jax.jit(jax.vmap(c_scaled))(batched), jax.jit(jax.vmap(scaled))(batched),
                 "vmap over a sharded axis")

        # A replicated input's type holds its mesh: a body that reads it (a batch per
        # shard, a reshard over the type's mesh) computes what jax.jit computes, with
        # the mesh in context or not (it read an empty mesh: one shard, or an error).
        def per_shard(x):
            return x.reshape(jax.typeof(x).sharding.mesh.shape["x"], -1).sum(1)

        def spread(x):
            mesh = jax.typeof(x).sharding.mesh
            return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, P("x"))) * 2

        replicated = jax.device_put(jnp.arange(16.0), jax.sharding.NamedSharding(mesh, P()))
        for body in (per_shard, spread):
            comp = jaxaot.component(body)
            with jax.set_mesh(mesh):
                same(comp(replicated), jax.jit(body)(replicated), f"{body.__name__} in context")
            same(comp(replicated), jax.jit(body)(replicated), f"{body.__name__}")
            same(jax.jit(comp)(replicated), jax.jit(body)(replicated), f"{body.__name__} in jit")
            same(jaxaot.jit(lambda x: comp(x) + 1)(replicated), jax.jit(body)(replicated) + 1,
                 f"{body.__name__} in jaxaot.jit")
        """
    )


def test_context_meshes_are_part_of_keys() -> None:
    run_devices(
        """
        def summed(x):  # shard_map over the mesh in context
            return jax.shard_map(lambda a: jax.lax.psum(a, "x"), in_specs=P("x"), out_specs=P())(x)

        f = jaxaot.component(summed)
        x = jnp.arange(16.0)
        keys = set()
        for shape, names in [((8,), ("x",)), ((2, 4), ("x", "y")), ((8,), ("x",))]:
            with jax.set_mesh(auto_mesh(shape, names)):
                same(f(x), jax.jit(summed)(x), f"top level under {shape}")
                same(jax.jit(f)(x), jax.jit(summed)(x), f"under jit under {shape}")
                keys.add(f.cache_key(x))
        assert len(keys) == 2, keys

        # vmap with an spmd axis, then without: each gets its own sharding.
        mesh = auto_mesh((8,), ("x",))
        g = lambda v: jnp.sin(v) @ jnp.ones((4, 4))
        c = jaxaot.component(g)
        xs = jax.device_put(jnp.ones((8, 2, 4)), NamedSharding(mesh, P("x")))
        with jax.set_mesh(mesh):
            same(jax.jit(jax.vmap(c, spmd_axis_name="x"))(xs),
                 jax.jit(jax.vmap(g, spmd_axis_name="x"))(xs), "spmd vmap")
            same(jax.jit(jax.vmap(c))(xs), jax.jit(jax.vmap(g))(xs), "plain vmap")
        # pmap over a component keeps working.
        same(jax.pmap(c)(jnp.ones((8, 2, 4))), jax.pmap(g)(jnp.ones((8, 2, 4))), "pmap")
        """
    )


WARM = """
devices = int(os.environ["XLA_FLAGS"].rsplit("=", 1)[1])
shape = tuple(int(s) for s in sys.argv[1].split("x")) if len(sys.argv) > 1 else (devices,)
names = ("x", "y")[: len(shape)]
spec = P(*names[:1]) if sys.argv[2:] == [] or sys.argv[2] == "rows" else P()
mesh = auto_mesh(shape, names)

def body(x, w):
    return jnp.tanh(x @ w) * 2

f = jaxaot.component(body)
x = jax.device_put(jnp.arange(64.0).reshape(16, 4) / 64, NamedSharding(mesh, spec))
w = jnp.ones((4, 4)) / 4
same(f(x, w), jax.jit(body)(x, w), "warm")
jaxaot.wait_for_writes()
info = f.cache_info()
print(f"compiles={info.compiles} lowerings={info.lowerings} hits={info.hits}")
"""


def _counts(out: str) -> dict[str, int]:
    line = out.strip().splitlines()[-1]
    return {k: int(v) for k, v in (item.split("=") for item in line.split())}


def test_warm_processes_load_only_executables_made_for_their_shardings(tmp_path: Path) -> None:
    cache = tmp_path / "cache"

    def run(devices: int, *argv: str) -> dict[str, int]:
        script = "sys.argv = ['x', " + ", ".join(repr(a) for a in argv) + "]\n" + WARM
        return _counts(run_devices(script, devices=devices, cache=cache))

    first = run(8, "8", "rows")
    assert first["compiles"] == 1 and first["lowerings"] == 1, first
    warm = run(8, "8", "rows")  # same mesh and sharding: load, nothing made
    assert warm["compiles"] == 0 and warm["lowerings"] == 0 and warm["hits"] >= 1, warm
    for devices, argv in [(8, ("8", "replicated")), (8, ("2x4", "rows")), (4, ("4", "rows"))]:
        other = run(devices, *argv)  # another sharding, mesh or device count: a compile
        assert other["compiles"] == 1, (devices, argv, other)


PLACED = """
d = np.array(jax.devices())
meshes = {
    "last four": jax.sharding.Mesh(d[4:].reshape(2, 2), ("data", "model")),
    "reversed": jax.sharding.Mesh(d[::-1].reshape(4, 2), ("data", "model")),
}

@jaxaot.component
def block(w, x):
    return x + jnp.tanh(x @ w)

@jaxaot.component
def calling(x):  # a host callback: its executable is rebound to this process's
    y = jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jnp.sin(y)

step = jaxaot.jit(lambda w, x: block(w, block(w, x)).sum())
w, x = np.full((8, 8), 0.1, np.float32), np.arange(64, dtype=np.float32).reshape(8, 8) / 64
cases = [(name, NamedSharding(m, P()), NamedSharding(m, P("data"))) for name, m in meshes.items()]
one = jax.sharding.SingleDeviceSharding(d[3])
cases.append(("device 3", one, one))
jit_block = jax.jit(block.__wrapped__)
for name, ws, xs in cases:
    wp, xp = jax.device_put(w, ws), jax.device_put(x, xs)
    same(block(wp, xp), jit_block(wp, xp), name)
    same(jax.jit(block)(wp, xp), jit_block(wp, xp), name + " in jax.jit")
    same(step(wp, xp), jax.jit(step.__wrapped__)(wp, xp), name + " jaxaot.jit")
    same(calling(xp), jax.jit(calling.__wrapped__)(xp), name + " callback")
s = jaxaot.stats()
print(f"compiles={s['compiles']} lowerings={s['lowerings']} loaded={s['loaded']}")
"""


def test_warm_processes_load_executables_for_any_devices_in_any_order(tmp_path: Path) -> None:
    """Executables for a mesh over some of the devices, over all of them in another
    order, or for one device other than the first: a warm process loads each onto
    those devices (it ran them on all the devices in their default order, and
    aborted), with ``jax.jit``'s values and shardings."""
    cold = _counts(run_devices(PLACED, cache=tmp_path / "cache"))
    assert cold["compiles"] >= 9, cold
    warm = _counts(run_devices(PLACED, cache=tmp_path / "cache"))
    assert warm["compiles"] == 0 and warm["lowerings"] == 0, warm
    assert warm["loaded"] >= 9, warm


def test_jax_jit_of_components_with_any_shardings() -> None:
    run_devices(
        """
        mesh = auto_mesh((2, 4), ("data", "model"))
        def layer(p, x):
            return jnp.tanh(x @ p["w"] + p["b"])
        block = jaxaot.component(layer)
        def loss(p, x, body):
            for _ in range(3):
                x = body(p, x)
            return (x ** 2).mean()
        p = {"w": jnp.ones((8, 8)) / 8, "b": jnp.zeros(8)}
        x = jnp.arange(128.0).reshape(16, 8) / 128
        for pspec, xspec in [(P(), P("data")), (P("model"), P("data")), (P(None, "model"), P())]:
            put = lambda a: jax.device_put(a, NamedSharding(mesh, pspec if a.ndim == 2 else P()))
            ps = jax.tree_util.tree_map(put, p)
            xs = jax.device_put(x, NamedSharding(mesh, xspec))
            # Output shardings pinned as FSDP code pins them: gradients like the parameters.
            outs = (NamedSharding(mesh, P()), jax.tree_util.tree_map(lambda a: a.sharding, ps))
            step = lambda body, **kw: jax.jit(
                jax.value_and_grad(lambda p, x: loss(p, x, body)), **kw)
            same(step(block, out_shardings=outs)(ps, xs), step(layer, out_shardings=outs)(ps, xs),
                 f"{pspec} {xspec} pinned")
            # Unpinned: the same values (XLA picks the shardings of unpinned outputs).
            got, want = step(block)(ps, xs), step(layer)(ps, xs)
            for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
        """,
    )


# -- sharding in types (jax.make_mesh's default: Explicit axes) --------------------------

TYPES = """
def same_types(got, want, what):
    same(got, want, what)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert jax.typeof(g) == jax.typeof(w), (what, jax.typeof(g), jax.typeof(w))

def linked(fn, *args):
    '''Whether jax.jit(fn) links a component's module (a call), not its inlined body.'''
    return "call @jaxaot_" in jax.jit(fn).lower(*args).as_text()
"""


def test_sharded_types_are_entries_linked_and_transformed_as_jax_jit() -> None:
    """Types with shardings (explicit axes) are cache entries: lowered, linked into
    callers, derived under grad, jvp and vmap (over the sharded axis, with and
    without spmd_axis_name); values, shardings and types as jax.jit gives them."""
    run_devices(
        TYPES
        + textwrap.dedent(
            """
        mesh = jax.make_mesh((8,), ("data",))  # Explicit axes: JAX's default
        assert mesh.axis_types == (AxisType.Explicit,)

        def body(x, w):
            return jnp.tanh(x @ w) * 2

        f = jaxaot.component(body)
        with jax.set_mesh(mesh):
            x = jax.device_put(jnp.arange(512.0).reshape(16, 32) / 512, P("data"))
            w = jnp.ones((32, 32)) / 32
            assert str(jax.typeof(x)) == "float32[16@data,32]"
            same_types(f(x, w), jax.jit(body)(x, w), "top level")
            two = lambda g: (lambda x, w: g(g(x, w), w))
            same_types(jax.jit(two(f))(x, w), jax.jit(two(body))(x, w), "under jit")
            assert linked(two(f), x, w)
            lowered = f.cache_info().lowerings
            assert lowered >= 1, f.cache_info()

            loss = lambda g: (lambda x, w: two(g)(x, w).sum())
            grads = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
            same_types(grads, jax.jit(jax.grad(loss(body), argnums=(0, 1)))(x, w), "grad")
            assert str(jax.typeof(grads[0])) == "float32[16@data,32]"
            assert linked(jax.grad(loss(f), argnums=(0, 1)), x, w)
            assert f.cache_info().lowerings > lowered  # forward, linear, transposed entries

            t = jnp.ones_like(x)
            jvp = lambda g: jax.jit(lambda x, t: jax.jvp(lambda v: g(v, w), (x,), (t,)))
            same_types(jvp(f)(x, t), jvp(body)(x, t), "jvp")

            xs = jax.device_put(jnp.arange(256.0).reshape(8, 1, 32) / 256, P("data"))
            for kw in ({}, {"spmd_axis_name": "data"}):
                vm = lambda g: jax.vmap(g, in_axes=(0, None), **kw)
                same_types(jax.jit(vm(f))(xs, w), jax.jit(vm(body))(xs, w), f"vmap {kw}")
                assert linked(vm(f), xs, w), kw
                grad_w = lambda g: jax.jit(jax.grad(lambda w: vm(g)(xs, w).sum()))
                same_types(grad_w(f)(w), grad_w(body)(w), f"grad of vmap {kw}")
        """
        )
    )


def test_an_explicit_key_entry_keeps_its_sharded_types_in_a_warm_process(tmp_path: Path) -> None:
    """A sharded-type entry is written with its types' shardings, and a warm process
    (explicit key: nothing traced) links it with those types."""
    script = TYPES + textwrap.dedent(
        """
        mesh = jax.make_mesh((8,), ("data",))
        f = jaxaot.component(lambda x, w: jnp.tanh(x @ w), key="explicit-sharded-v1")
        with jax.set_mesh(mesh):
            x = jax.device_put(jnp.arange(512.0).reshape(16, 32) / 512, P("data"))
            w = jnp.ones((32, 32)) / 32
            got = jax.jit(lambda x, w: f(x, w) + 1)(x, w)
            same_types(got, jax.jit(lambda x, w: jnp.tanh(x @ w) + 1)(x, w), "under jit")
            entry = f.entry(x, w)
            assert "[16@data,32]" in str(entry.out_avals[0]), entry.out_avals
        jaxaot.wait_for_writes()
        info = f.cache_info()
        print(f"traces={info.traces} lowerings={info.lowerings} hits={info.hits}")
        """
    )
    cold = _counts(run_devices(script, cache=tmp_path / "cache"))
    assert cold["lowerings"] == 1 and cold["traces"] == 1, cold
    warm = _counts(run_devices(script, cache=tmp_path / "cache"))
    assert warm["lowerings"] == 0 and warm["traces"] == 0 and warm["hits"] >= 1, warm


def test_bodies_naming_the_callers_devices_are_linked_and_placed_as_jax_jit() -> None:
    """A body pinning its activations to a concrete mesh (Auto axes) is a linked entry;
    the caller's computation is placed on that mesh as jax.jit places it, also when
    its inputs are uncommitted; another device order is another entry."""
    run_devices(
        TYPES
        + textwrap.dedent(
            """
        mesh = auto_mesh((8,), ("x",))
        rows = NamedSharding(mesh, P("x"))

        def layer(x, w):
            return jax.lax.with_sharding_constraint(jnp.tanh(x @ w), rows)

        f = jaxaot.component(layer)
        x = jnp.arange(512.0).reshape(16, 32) / 512
        w = jnp.ones((32, 32)) / 32
        two = lambda g: (lambda x, w: g(g(x, w), w) * 2)
        for xs in (x, jax.device_put(x, rows)):  # uncommitted, then committed to the mesh
            same_types(jax.jit(two(f))(xs, w), jax.jit(two(layer))(xs, w), "under jit")
            assert linked(two(f), xs, w)
        assert f.cache_info().lowerings >= 1, f.cache_info()
        loss = lambda g: (lambda w: two(g)(x, w).sum())
        same(jax.jit(jax.grad(loss(f)))(w), jax.jit(jax.grad(loss(layer)))(w), "grad")
        step = jaxaot.jit(jax.value_and_grad(loss(f)))
        same(step(w), jax.jit(jax.value_and_grad(loss(layer)))(w), "jaxaot.jit")
        assert all(p is not None for p in step._plans.values())  # split, not jax.jit

        flipped = auto_mesh((8,), ("x",), devices=jax.devices()[::-1])
        g = jaxaot.component(
            lambda x, w: jax.lax.with_sharding_constraint(jnp.tanh(x @ w), NamedSharding(flipped, P("x")))
        )
        assert g.cache_key(x, w) != f.cache_key(x, w)
        """
        )
    )


def test_single_device_inputs_on_any_device_are_split() -> None:
    """Inputs committed to a device other than the first: jaxaot.jit splits the
    program (no fallback) and the results are where jax.jit puts them."""
    run_devices(
        """
        block = jaxaot.component(lambda w, v: jnp.tanh(v @ w) + v)
        def loss(ws, v, body):
            for w in ws:
                v = body(w, v)
            return (v ** 2).mean()
        dev = jax.devices()[3]
        ws = [jax.device_put(jnp.eye(8) * 0.1 * (i + 1), dev) for i in range(3)]
        v = jax.device_put(jnp.ones((4, 8)), dev)
        step = jaxaot.jit(jax.value_and_grad(lambda ws, v: loss(ws, v, block)))
        got = step(ws, v)
        same(got, jax.jit(jax.value_and_grad(lambda ws, v: loss(ws, v, block.__wrapped__)))(ws, v),
             "device 3")
        assert all(p is not None for p in step._plans.values())  # split, not jax.jit
        assert all(leaf.devices() == {dev} for leaf in jax.tree_util.tree_leaves(got))
        """
    )


def test_arguments_on_devices_that_do_not_fit_together_raise_what_jax_jit_raises() -> None:
    """Arrays committed to two device sets, and in_shardings over two device sets:
    components, jaxaot.jit and its precompile raise jax.jit's own error, with the
    user's argument names, and say nothing of jaxaot (it is the program's error, not
    a limitation)."""
    out = run_devices(
        """
        import logging, sys
        logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="LOGGED %(message)s")
        devs = jax.devices()
        m1, m2 = jax.sharding.Mesh(devs[:4], ("a",)), jax.sharding.Mesh(devs[4:], ("a",))
        s1, s2 = jax.sharding.NamedSharding(m1, P("a")), jax.sharding.NamedSharding(m2, P())
        x = jax.device_put(jnp.ones((8, 4)), s1)
        w = jax.device_put(jnp.ones((4, 4)), s2)

        def f(x, w):
            return jnp.tanh(x @ w)

        def error(fn, *args):
            try:
                fn(*args)
            except Exception as e:
                return type(e), str(e)
            raise AssertionError("no error")

        want = error(jax.jit(f), x, w)
        assert "argument x of f" in want[1], want
        for fn in (jaxaot.component(f), jaxaot.jit(f), jaxaot.jit(jax.grad(lambda x, w: f(x, w).sum()))):
            got = error(fn, x, w)
            assert got[0] is want[0] and "incompatible devices" in got[1], got
            assert "args[" not in got[1], got
        got = error(jaxaot.jit(f).precompile, x, w)  # not reported as precompiled
        assert got[0] is ValueError and "incompatible devices" in got[1], got
        want = error(jax.jit(f, in_shardings=(s1, s2)), x.copy(), w.copy())
        got = error(jaxaot.jit(f, in_shardings=(s1, s2)), x.copy(), w.copy())
        assert got == want, (got, want)

        # One argument committed to the default device, the other to another device
        # or a mesh: jax.jit's error (the default device is no placement left to the
        # call once an array is committed there), and nothing is compiled for it.
        mesh = jax.sharding.Mesh(devs, ("a",))
        on0 = jax.device_put(jnp.ones((8, 4)), devs[0])
        for other in (jax.device_put(jnp.ones((4, 4)), devs[3]),
                      jax.device_put(jnp.ones((4, 4)), jax.sharding.NamedSharding(mesh, P()))):
            want = error(jax.jit(f), on0, other)
            assert "argument x of f" in want[1] and "incompatible devices" in want[1], want
            before = jaxaot.stats()["compiles"]
            for fn in (jaxaot.component(f), jaxaot.jit(f)):
                assert error(fn, on0, other) == want
            assert jaxaot.stats()["compiles"] == before

        # in_shardings whose spec has more dimensions than a committed argument:
        # jax.jit's error, naming the argument.
        s3 = jax.sharding.NamedSharding(mesh, P(None, None, "a"))
        x2 = jax.device_put(jnp.ones((8, 8)), jax.sharding.NamedSharding(mesh, P("a")))
        want = error(jax.jit(lambda x: x.sum(), in_shardings=s3), x2)
        assert "rank" in want[1], want
        assert error(jaxaot.jit(lambda x: x.sum(), in_shardings=s3), x2) == want
        """
    )
    assert "LOGGED" not in out, out


WARM_EXPLICIT = """
devices = jax.device_count()
mesh = jax.make_mesh((devices,), ("data",))  # Explicit axes
from jaxaot._regional import _programs

def layer(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"])

block = jaxaot.component(layer)

def loss(ps, x, body):
    for p in ps:
        x = body(p, x) + 0.5 * x  # a result's type meets an input's
    return (x ** 2).mean()

def run():
    put = lambda v, spec: jax.device_put(v, jax.sharding.NamedSharding(mesh, spec))
    ps = [{"w": put(jnp.eye(16) * 0.1 * (i + 1), P()), "b": put(jnp.full((16,), 0.01 * i), P())}
          for i in range(4)]
    x = put(jnp.arange(512.0).reshape(32, 16) / 512, P("data"))
    step = jaxaot.jit(train(lambda ps, x: loss(ps, x, block)))
    got = step(ps, x)
    same_types(got, jax.jit(train(lambda ps, x: loss(ps, x, layer)))(ps, x), "step")
    assert all(p is not None for p in step._plans.values())  # split, not jax.jit

if sys.argv[1:] == ["set_mesh"]:
    train = jax.value_and_grad
    with jax.set_mesh(mesh):
        run()
else:  # the arrays' types carry the mesh, and none is set: the forward pass
    # (without a mesh in context, JAX cannot shard the weights' gradient sums)
    train = lambda f: f
    run()
jaxaot.wait_for_writes()
info, glue = block.cache_info(), _programs.GLUE.counters.info()
print(f"lowerings={info.lowerings} compiles={info.compiles + glue.compiles}")
"""


@pytest.mark.parametrize("context", ["set_mesh", "none"])
def test_an_explicit_mesh_step_warm_starts_and_another_mesh_compiles(
    tmp_path: Path, context: str
) -> None:
    """jaxaot.jit of a train step on an Explicit mesh, inside ``jax.set_mesh`` or
    with no mesh set (the arrays' types carry it): a warm process with the same
    mesh gives what jax.jit gives (its results' types from the cache match its
    inputs', device kind included) and lowers and compiles nothing; one with
    another device count compiles."""
    cache, script = tmp_path / "cache", TYPES + f"sys.argv[1:] = [{context!r}]\n" + WARM_EXPLICIT
    cold = _counts(run_devices(script, cache=cache))
    assert cold["lowerings"] > 0 and cold["compiles"] > 0, cold
    warm = _counts(run_devices(script, cache=cache))
    assert warm == {"lowerings": 0, "compiles": 0}, warm
    if context == "set_mesh":
        other = _counts(run_devices(script, devices=4, cache=cache))
        assert other["compiles"] > 0, other


CONSTRAINED_GRAD = """
from jaxaot._regional import _programs
mesh = auto_mesh((2, 4), ("data", "model"))
layer = jaxaot.component(lambda w, x: jax.lax.with_sharding_constraint(
    jnp.tanh(x @ w), NamedSharding(mesh, P("data", None))))
plain = lambda w, x: jax.lax.with_sharding_constraint(
    jnp.tanh(x @ w), NamedSharding(mesh, P("data", None)))

def loss(body, w, x, y):
    return jnp.mean((body(w, body(w, x)) - y) ** 2)

w = jax.device_put(np.eye(8, dtype=np.float32) * 0.5, NamedSharding(mesh, P(None, "model")))
x = jax.device_put(np.ones((16, 8), np.float32), NamedSharding(mesh, P("data")))
y = jax.device_put(np.zeros((16, 8), np.float32), NamedSharding(mesh, P("data")))
step = jaxaot.jit(jax.value_and_grad(lambda w, x, y: loss(layer, w, x, y)))
same(step(w, x, y), jax.jit(jax.value_and_grad(lambda w, x, y: loss(plain, w, x, y)))(w, x, y),
     "step")
jaxaot.wait_for_writes()
info, glue = layer.cache_info(), _programs.GLUE.counters.info()
print(f"lowerings={info.lowerings} compiles={info.compiles + glue.compiles}")
"""


def test_a_body_constraining_its_result_to_a_mesh_warm_starts_its_glue(tmp_path: Path) -> None:
    """A component whose body names a mesh (Auto axes) types its results with that
    mesh: a process that loads its entries types them alike, so autodiff's glue is
    the program the making process compiled (not one with an extra cast): a warm
    process compiles nothing, and the processes of a job run one program."""
    cold = _counts(run_devices(CONSTRAINED_GRAD, cache=tmp_path / "cache"))
    assert cold["lowerings"] > 0 and cold["compiles"] > 0, cold
    warm = _counts(run_devices(CONSTRAINED_GRAD, cache=tmp_path / "cache"))
    assert warm == {"lowerings": 0, "compiles": 0}, warm


LAYERS_ON_MESHES = """
import sys
from jax.sharding import Mesh
kind = sys.argv[1]

def layer(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"])

lay = jax.checkpoint(layer) if kind == "checkpoint" else jax.jit(layer)

def model(params, x):
    for p in params:
        x = lay(p, x)
    return x

params = [{"w": jnp.eye(16) * 0.1 * i, "b": jnp.zeros(16)} for i in range(6)]
x = jnp.ones((16, 16))
f = jaxaot.jit(model)
placements = [
    ((2, 4), ("data", "model"), None),
    ((8, 1), ("batch", "model"), None),
    ((2, 2), ("data", "model"), jax.devices()[4:]),
]
for shape, names, devices in placements:
    mesh = Mesh(np.array(devices or jax.devices()).reshape(shape), names)
    args = (jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(x, NamedSharding(mesh, P(names[0]))))
    got, want = f(*args), jax.jit(model)(*args)
    same(got, want, f"{kind} on {shape}")
    assert jax.typeof(got).sharding.mesh == jax.typeof(want).sharding.mesh, (shape, got)
got, want = f(params, x), jax.jit(model)(params, x)  # on no mesh at all
same(got, want, "unplaced")
assert jax.typeof(got).sharding.mesh == jax.typeof(want).sharding.mesh, jax.typeof(got)
explicit = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
with jax.set_mesh(explicit):  # (a result typed by another mesh is refused here)
    same(jax.jit(lambda a: a @ a.T)(got), jax.jit(lambda a: a @ a.T)(want), "explicit")
print("ok")
"""


@pytest.mark.parametrize("kind", ["checkpoint", "jit"])
def test_layers_traced_on_one_mesh_give_results_typed_by_the_mesh_of_each_call(
    tmp_path: Path, kind: str
) -> None:
    """Checkpoint or jit layers that ``jaxaot.jit`` finds, traced on one Auto mesh,
    then called on others and on none, in this process and the next: their
    results are typed by the mesh each call's values are on, as under jax.jit
    (a layer's jaxpr types its results by the mesh it was traced on, which its
    program's key now holds)."""
    script = LAYERS_ON_MESHES.replace("sys.argv[1]", repr(kind))
    for _ in range(2):  # cold, then a warm process on the same cache
        assert run_devices(script, cache=tmp_path / "cache").split()[-1] == "ok"


def test_in_shardings_over_devices_that_disagree_raise_jax_jits_error() -> None:
    """``in_shardings`` naming a mesh of 8 devices for one argument and one device
    for another (an optimizer's step counter left where it was made): the call
    raises ``jax.jit``'s error, which names both arguments, and not an error of
    an executable compiled for other shardings, naming ``args[1]``."""
    out = run_devices(
        """
        mesh = auto_mesh((4, 2), ("data", "model"))
        w = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P("data", None)))
        count = jnp.zeros([], jnp.int32)
        shardings = (NamedSharding(mesh, P("data", None)), count.sharding)
        step = lambda w, c: (w * 2.0, c + 1)
        for make in (jax.jit, jaxaot.jit):
            try:
                make(step, in_shardings=shardings)(w, count)
            except ValueError as e:
                print(type(e).__name__, str(e).splitlines()[0])
        """
    )
    want, got = out.strip().splitlines()[-2:]
    assert "incompatible devices" in want and "argument c of" in want, want
    assert got == want


def test_out_shardings_come_back_spelled_as_given() -> None:
    """``out_shardings`` spelled with trailing unsharded dimensions
    (``P("model", None)``) that the executable's results meet as ``P("model")``: the
    results carry the given shardings, equal (``==``) to jax.jit's, not only
    equivalent, and a jax.jit fed them compiles nothing more."""
    out = run_devices(
        """
        mesh = auto_mesh((4, 2), ("data", "model"))
        s = NamedSharding(mesh, P("model", None))
        rows = NamedSharding(mesh, P("data", None))
        w = jax.device_put(jnp.ones((8, 8)), s)
        x = jax.device_put(jnp.ones((16, 8)), rows)
        step = lambda w, x: (w * 2.0, jnp.tanh(x @ w), (x @ w).sum())
        outs = (s, rows, NamedSharding(mesh, P()))
        want = jax.jit(step, in_shardings=(s, rows), out_shardings=outs)(w, x)
        for make in (jaxaot.jit, jax.jit):
            got = make(step, in_shardings=(s, rows), out_shardings=outs)(w, x)
            print([g.sharding == o.sharding for g, o in zip(got, want)], [g.sharding == t for g, t in zip(got, outs)])
        """
    )
    aot, jit = out.strip().splitlines()[-2:]
    assert aot == jit == "[True, True, True] [True, True, True]", out


def test_a_component_called_inside_a_shard_map_gives_jax_jit_values() -> None:
    """A component with no collective called inside a ``shard_map`` body (as the
    body itself, its output varying over the axis; and on an invariant input
    only), on an auto and an explicit mesh, under ``jax.jit``, ``jaxaot.jit`` and
    ``grad``: its values are typed over the shard_map's manual axes, so it is
    lowered with its caller, as one with a collective is (it failed with a bare
    AssertionError while its entry was lowered on its own)."""
    run_devices(
        """
        for types in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((8,), ("data",), axis_types=(types,))
            x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("data")))
            w = jnp.full((2, 2), 0.5)
            body = lambda w, x: jnp.tanh(x @ w) * 2
            scale = lambda w: w * 3

            def outer(f, g):
                def inner(w, x):
                    return f(g(w), x)
                return jax.shard_map(inner, mesh=mesh, in_specs=(P(), P("data")),
                                     out_specs=P("data"))

            def loss(f, g):
                return lambda w, x: outer(f, g)(w, x).sum()

            comp, comp_scale = jaxaot.component(body), jaxaot.component(scale)
            with jax.set_mesh(mesh):
                want = jax.jit(outer(body, scale))(w, x)
                same(jax.jit(outer(comp, comp_scale))(w, x), want, f"{types} in jax.jit")
                same(jaxaot.jit(outer(comp, comp_scale))(w, x), want, f"{types} in jaxaot.jit")
                want = jax.jit(jax.grad(loss(body, scale)))(w, x)
                same(jax.jit(jax.grad(loss(comp, comp_scale)))(w, x), want, f"{types} grad")
        """
    )


def test_collectives_over_an_enclosing_shard_map_axis_give_jax_jit_values() -> None:
    """A component whose body takes a collective over the axis of the shard_map
    it is called in (``psum``, ``pmean``, ``axis_index``), under ``jax.jit``,
    ``jaxaot.jit`` and ``grad``, with the default ``check_vma``: how its inputs
    vary over that axis is part of their types, so it is traced as ``jax.jit``
    traces it (it failed: "pvary is a invariant->variant collective")."""
    run_devices(
        """
        mesh = auto_mesh((8,), ("data",))
        x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("data")))
        w = jnp.full((2, 2), 0.5)
        bodies = {
            "psum": lambda w, x: jax.lax.psum(jnp.tanh(x @ w), "data"),
            "pmean": lambda w, x: jax.lax.pmean(jnp.tanh(x @ w), "data"),
            "axis_index": lambda w, x: jax.lax.psum(x @ w * jax.lax.axis_index("data"), "data"),
        }

        def loss(f):
            inner = lambda w, x: f(w, x).sum()
            return lambda w, x: jax.shard_map(
                inner, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
            )(w, x)

        for name, body in bodies.items():
            comp = jaxaot.component(body)
            want = jax.jit(jax.value_and_grad(loss(body)))(w, x)
            same(jax.jit(jax.value_and_grad(loss(comp)))(w, x), want, name + " in jax.jit")
            same(jaxaot.jit(jax.value_and_grad(loss(comp)))(w, x), want, name + " in jaxaot.jit")
        """
    )
