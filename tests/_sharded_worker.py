"""Sharded ``jaxaot.jit`` programs on 8 simulated CPU devices, for
``tests/test_regional.py``: run as ``python _sharded_worker.py SCENARIO...`` in a
fresh interpreter (the device count is set before JAX is imported; one process
runs them all, so JAX is imported once). Each scenario asserts values,
gradients and output shardings against ``jax.jit`` of the same program; the
last line printed is JSON: per scenario, its counts or its traceback."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaot  # noqa: E402

WIDTH, SEQ, BATCH = 16, 4, 8
#: The axis types of every mesh the scenarios make (``main`` runs each scenario
#: with each): ``auto`` (``Mesh``-style), ``explicit`` (``jax.make_mesh``'s
#: default: shardings in types) or ``mixed`` (the first axis Explicit, the others
#: Auto). Explicit meshes are used inside ``jax.set_mesh``, as JAX's sharding
#: guide teaches.
AXES = "auto"


def mlp(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """A small residual block (cheaper to compile than the transformer block).

    Written as sharding-in-types code must be: on explicit axes, parameters
    sharded over the batch's axis (FSDP) are gathered first, and a product whose
    contracting dimension is sharded (2-D, Megatron-style) says its output
    sharding; on Auto axes these are no-ops."""
    p = {k: _gathered(v, x) for k, v in p.items()}
    h = jnp.tanh(x @ p["up"] + p["b"])
    return x + jnp.einsum("bsh,hd->bsd", h, p["down"], out_sharding=_contracted(h, x))


def _explicit_spec(x: jax.Array) -> Any:
    sharding = jax.typeof(x).sharding
    spec = getattr(sharding, "spec", None)
    return spec if spec is not None and any(e is not None for e in spec) else None


def _gathered(v: jax.Array, x: jax.Array) -> jax.Array:
    """``v`` replicated where it is sharded (explicitly) over an axis ``x`` is sharded on."""
    spec, batch = _explicit_spec(v), _explicit_spec(x)
    if spec is None or batch is None or spec[0] is None or spec[0] != batch[0]:
        return v
    return jax.sharding.reshard(v, P())


def _constrain(x: jax.Array, spec: P) -> jax.Array:
    """``x`` sharded as ``spec`` says: ``reshard`` over Explicit axes (the mesh in
    context), a sharding constraint over Auto ones."""
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit in tuple(mesh.axis_types):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def _contracted(h: jax.Array, x: jax.Array) -> Any:
    """The output sharding of ``h @ down`` where ``h``'s contracted dimension is
    sharded (explicitly): ``x``'s; else ``None`` (JAX decides)."""
    spec = _explicit_spec(h)
    if spec is None or len(spec) < 3 or spec[2] is None:
        return None
    return jax.typeof(x).sharding.spec


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    if AXES == "explicit":
        types = (AxisType.Explicit,) * len(shape)
    elif AXES == "mixed":
        types = (AxisType.Explicit,) + (AxisType.Auto,) * (len(shape) - 1)
    else:
        types = (AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=types)


def _context(mesh: jax.sharding.Mesh) -> Any:
    """``jax.set_mesh(mesh)`` where the mesh has explicit axes, else nothing."""
    import contextlib

    if AxisType.Explicit in tuple(mesh.axis_types):
        return jax.set_mesh(mesh)
    return contextlib.nullcontext()


def _block() -> Any:
    return jaxaot.component(mlp)


def _loss(blocks: Any, x: jax.Array, block_fn: Any) -> jax.Array:
    for p in blocks:
        x = block_fn(p, x)
    return jnp.mean(x**2)


def _train_step(block_fn: Any) -> Callable[..., Any]:
    optimizer = optax.sgd(1e-2)

    def step(blocks: Any, x: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(_loss)(blocks, x, block_fn)
        updates, _ = optimizer.update(grads, optimizer.init(blocks), blocks)
        return optax.apply_updates(blocks, updates), grads, loss

    return step


def _grad_step(block_fn: Any) -> Callable[..., Any]:
    return jax.value_and_grad(lambda bs, x: _loss(bs, x, block_fn), argnums=(0, 1))


def _blocks(layers: int) -> Any:
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    return [
        {
            "up": jax.random.normal(keys[2 * i], (WIDTH, 2 * WIDTH)) * 0.3,
            "b": jnp.full((2 * WIDTH,), 0.1, jnp.float32),
            "down": jax.random.normal(keys[2 * i + 1], (2 * WIDTH, WIDTH)) * 0.2,
        }
        for i in range(layers)
    ]


def _x() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (BATCH, SEQ, WIDTH))


def _put(tree: Any, shardings: Any) -> Any:
    return jax.tree_util.tree_map(jax.device_put, tree, shardings)


def _same(got: Any, want: Any, tol: float = 5e-5, shardings: bool = True) -> None:
    """Same values and (with ``shardings``) the same output shardings as jax.jit."""
    g_leaves, g_def = jax.tree_util.tree_flatten(got)
    w_leaves, w_def = jax.tree_util.tree_flatten(want)
    assert g_def == w_def, (g_def, w_def)
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves, strict=True)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)
        # Types too: shape, dtype, weak type, and the sharding a type carries.
        assert jax.typeof(g) == jax.typeof(w), (i, jax.typeof(g), jax.typeof(w))
        if shardings:
            assert g.sharding.is_equivalent_to(w.sharding, w.ndim), (i, g.sharding, w.sharding)


def _split(fn: Any) -> bool:
    """Whether jaxaot.jit split the program (rather than falling back to jax.jit)."""
    return bool(fn._plans) and all(p is not None for p in fn._plans.values())


def data_parallel() -> dict[str, Any]:
    """Batch sharded, parameters replicated: a train step (value_and_grad, an
    update); each block's executables compile once whatever the depth."""
    mesh = _mesh((8,), ("data",))
    with _context(mesh):
        repl, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        x = jax.device_put(_x(), data)
        compiles = {}
        for layers in (1, 3):
            blk = _block()
            with jaxaot.using_cache(jaxaot.MemoryCache()):
                compiles[layers] = _data_parallel_step(blk, layers, repl, x)
        return {"compiles": compiles}


def _data_parallel_step(blk: Any, layers: int, repl: Any, x: jax.Array) -> int:
    blocks = _put(_blocks(layers), jax.tree_util.tree_map(lambda _: repl, _blocks(layers)))
    regional = jaxaot.jit(_train_step(blk))
    want = jax.jit(_train_step(mlp))(blocks, x)
    got = regional(blocks, x)
    _same(got, want)
    # Steps in a row stay in agreement.
    _same(regional(got[0], x), jax.jit(_train_step(mlp))(want[0], x), tol=1e-4)
    assert _split(regional)
    return blk.cache_info().compiles


def auto_blocks() -> dict[str, Any]:
    """No annotation: each layer a jax.checkpoint region, batch sharded, parameters
    replicated. jaxaot.jit finds the blocks; they compile once whatever the depth."""
    mesh = _mesh((8,), ("data",))
    with _context(mesh):
        repl, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        x = jax.device_put(_x(), data)
        compiles = {}
        layer = jax.checkpoint(mlp)
        for layers in (2, 4):  # a block called once stays in its glue
            blocks = _put(_blocks(layers), jax.tree_util.tree_map(lambda _: repl, _blocks(layers)))
            with jaxaot.using_cache(jaxaot.MemoryCache()):
                from jaxaot._component import _blocks as block_store

                block_store.forget_blocks()
                regional = jaxaot.jit(_train_step(layer))
                _same(regional(blocks, x), jax.jit(_train_step(mlp))(blocks, x))
                assert _split(regional), regional.explain(blocks, x)
                compiles[layers] = sum(
                    b.cache_info().compiles for b in block_store._BLOCKS.values()
                )
        return {"compiles": compiles}


def _fsdp_spec(a: jax.Array) -> P:
    return P("data") if a.shape[0] % 8 == 0 else P()


def fsdp() -> dict[str, Any]:
    """Parameters sharded over the data axis (and the batch too). jax.jit shards
    the gradients it returns like the parameters; the split program returns them
    as the backward executables make them (replicated): with out_shardings saying
    where they go, every output is where jax.jit puts it."""
    mesh = _mesh((8,), ("data",))
    with _context(mesh):
        blocks = _blocks(2)
        shardings = jax.tree_util.tree_map(lambda a: NamedSharding(mesh, _fsdp_spec(a)), blocks)
        blocks = _put(blocks, shardings)
        x = jax.device_put(_x(), NamedSharding(mesh, P("data")))
        blk = _block()
        regional = jaxaot.jit(_train_step(blk))
        got, want = regional(blocks, x), jax.jit(_train_step(mlp))(blocks, x)
        _same(got, want, shardings=False)
        _same(got[0], want[0])  # the updated parameters: where jax.jit puts them
        kw = {"out_shardings": (shardings, shardings, NamedSharding(mesh, P()))}
        pinned = jaxaot.jit(_train_step(blk), **kw)
        _same(pinned(blocks, x), jax.jit(_train_step(mlp), **kw)(blocks, x))
        grads = jaxaot.jit(_grad_step(blk))
        _same(grads(blocks, x), jax.jit(_grad_step(mlp))(blocks, x), shardings=False)
        assert _split(regional) and _split(grads) and _split(pinned)
        return {"compiles": blk.cache_info().compiles}


def mesh_2d() -> dict[str, Any]:
    """A (data x model) mesh: batch over data, weights over model (Megatron-style)."""
    mesh = _mesh((2, 4), ("data", "model"))
    with _context(mesh):
        specs = {"up": P(None, "model"), "b": P("model"), "down": P("model", None)}
        blocks = [_put(b, {k: NamedSharding(mesh, specs[k]) for k in b}) for b in _blocks(2)]
        x = jax.device_put(_x(), NamedSharding(mesh, P("data")))
        blk = _block()
        regional = jaxaot.jit(_grad_step(blk))
        _same(regional(blocks, x), jax.jit(_grad_step(mlp))(blocks, x))
        assert _split(regional)
        return {"compiles": blk.cache_info().compiles}


def shard_map_component() -> dict[str, Any]:
    """A component whose body is a shard_map over the mesh in context (a psum over
    axis "i"): under an 8-device mesh, then a (2, 4) one, where the psum runs over
    2 devices; each is compiled regionally for its own mesh."""

    def body(w: jax.Array, x: jax.Array) -> jax.Array:
        def local(ws: jax.Array, xs: jax.Array) -> jax.Array:
            return jax.lax.psum(jnp.tanh(xs @ ws), "i")

        return jax.shard_map(local, in_specs=(P(), P("i")), out_specs=P())(w, x)

    comp = jaxaot.component(body)
    plain = body

    def program(fn: Any) -> Callable[..., Any]:
        def f(w: jax.Array, x: jax.Array) -> jax.Array:
            return jnp.sum(fn(w, x * 2.0) ** 2)

        return jax.value_and_grad(f)

    w = jnp.eye(WIDTH) * 0.5
    x = jnp.arange(8 * WIDTH, dtype=jnp.float32).reshape(8, WIDTH) / 100
    results = {}
    for shape, names in (((8,), ("i",)), ((2, 4), ("i", "j"))):
        mesh = _mesh(shape, names)
        # A cache of its own: an earlier scenario may have compiled for an equal mesh.
        with jax.set_mesh(mesh), jaxaot.using_cache(jaxaot.MemoryCache()):
            xs = jax.device_put(x, NamedSharding(mesh, P("i")))
            ws = jax.device_put(w, NamedSharding(mesh, P()))
            before = comp.cache_info().compiles
            regional = jaxaot.jit(program(comp))
            got = regional(ws, xs)
            want = jax.jit(program(plain))(ws, xs)
            _same(got, want)
            assert _split(regional)
            assert comp.cache_info().compiles > before  # compiled for this mesh, not reused
            results[str(shape)] = float(got[0])
    return {"values": results}


def in_out_shardings() -> dict[str, Any]:
    """in_shardings place host inputs; out_shardings place the results; as jax.jit."""
    mesh = _mesh((8,), ("data",))
    with _context(mesh):
        repl, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        blk = _block()
        blocks = jax.tree_util.tree_map(np.asarray, _blocks(2))
        x = np.asarray(_x())
        kw: dict[str, Any] = {
            "in_shardings": (repl, data),
            "out_shardings": (NamedSharding(mesh, P(None, "data")), data),
        }

        def step(fn: Any) -> Callable[..., Any]:
            def f(bs: Any, x: jax.Array) -> Any:
                y = x
                for p in bs:
                    y = fn(p, y)
                return y.reshape(BATCH * SEQ, WIDTH).T, y * 2.0

            return f

        regional = jaxaot.jit(step(blk), **kw)
        want = jax.jit(step(mlp), **kw)(blocks, x)
        _same(regional(blocks, x), want)
        assert _split(regional)
        # out_shardings alone: a single sharding for every result.
        regional = jaxaot.jit(step(blk), out_shardings=repl)
        xs = jax.device_put(x, data)
        _same(regional(blocks, xs), jax.jit(step(mlp), out_shardings=repl)(blocks, xs))
        return {"compiles": blk.cache_info().compiles}


def donation() -> dict[str, Any]:
    """Donated sharded parameters are given up, as jax.jit gives them up."""
    mesh = _mesh((8,), ("data",))
    with _context(mesh):
        blk = _block()
        x = jax.device_put(_x(), NamedSharding(mesh, P("data")))

        def params() -> Any:
            blocks = _blocks(2)
            return _put(
                blocks, jax.tree_util.tree_map(lambda a: NamedSharding(mesh, _fsdp_spec(a)), blocks)
            )

        mine, theirs = params(), params()
        got = jaxaot.jit(_train_step(blk), donate_argnums=0, whole_program=False)
        want = jax.jit(_train_step(mlp), donate_argnums=0)(theirs, x)
        out = got(mine, x)
        _same(out, want, shardings=False)
        _same(out[0], want[0])  # the updated parameters: where jax.jit puts them (see fsdp)
        assert _split(got)
        assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(mine))
        assert not x.is_deleted()
        return {"compiles": blk.cache_info().compiles}


def set_mesh() -> dict[str, Any]:
    """A program inside jax.set_mesh: partition specs in sharding constraints,
    components traced and compiled under that mesh (not a fallback)."""
    mesh = _mesh((2, 4), ("data", "model"))
    with _context(mesh):
        blk = _block()

        def program(fn: Any) -> Callable[..., Any]:
            def f(bs: Any, x: jax.Array) -> jax.Array:
                x = _constrain(x * 1.5, P("data"))
                return _loss(bs, x, fn)

            return jax.value_and_grad(f)

        with jax.set_mesh(mesh):
            blocks = _blocks(2)
            x = jax.device_put(_x(), P("data"))
            regional = jaxaot.jit(program(blk))
            _same(regional(blocks, x), jax.jit(program(mlp))(blocks, x))
            assert _split(regional)
            assert blk.cache_info().compiles >= 2
        return {"compiles": blk.cache_info().compiles}


def fallback() -> dict[str, Any]:
    """When an executable cannot be made, jax.jit runs the step with the same
    in_shardings, out_shardings and donation."""
    mesh = _mesh((8,), ("data",))
    with _context(mesh):
        repl, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        blk = _block()

        def broken(call: Any, shardings: Any = None) -> Any:
            raise RuntimeError("no executable today")

        from jaxaot._regional import _planner

        saved = _planner.region_executable
        _planner.region_executable = broken
        try:
            return _fallback(blk, repl, data)
        finally:
            _planner.region_executable = saved


def _fallback(blk: Any, repl: Any, data: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"in_shardings": (repl, data), "out_shardings": (repl, repl, repl)}

    def fresh() -> Any:
        return _put(_blocks(2), jax.tree_util.tree_map(lambda _: repl, _blocks(2)))

    x = jax.device_put(_x(), data)
    mine, theirs = fresh(), fresh()
    regional = jaxaot.jit(_train_step(blk), donate_argnums=0, **kw)
    want = jax.jit(_train_step(mlp), donate_argnums=0, **kw)(theirs, x)
    _same(regional(mine, x), want)
    assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(mine))
    assert list(regional._plans.values()) == [None]  # later calls go to jax.jit
    return {"fell_back": True}


SCENARIOS = {
    f.__name__: f
    for f in (
        data_parallel,
        fsdp,
        mesh_2d,
        shard_map_component,
        in_out_shardings,
        donation,
        set_mesh,
        fallback,
        auto_blocks,
    )
}


#: The scenarios that make a mesh of two axes: on one axis, ``mixed`` is ``explicit``.
TWO_AXES = frozenset(["mesh_2d", "shard_map_component", "set_mesh"])


def main(names: list[str], axes: list[str]) -> dict[str, Any]:
    """Runs each scenario with each of the mesh axis types ``axes`` (``mixed`` only
    where a mesh has two axes); results by ``"<axes>:<scenario>"``."""
    import traceback

    global AXES
    assert jax.device_count() == 8, jax.devices()
    results: dict[str, Any] = {}
    for kind in axes:
        AXES = kind
        for name in names:
            if kind == "mixed" and name not in TWO_AXES:
                continue
            try:
                with jaxaot.using_cache(jaxaot.MemoryCache()):  # compiled afresh for each
                    result = SCENARIOS[name]()
                results[f"{kind}:{name}"] = {"ok": True, "result": result}
            except BaseException:
                results[f"{kind}:{name}"] = {"ok": False, "error": traceback.format_exc()[-4000:]}
    return results


if __name__ == "__main__":
    axes = os.environ.get("JAXAOT_TEST_AXES", "auto,explicit,mixed").split(",")
    print(json.dumps(main(sys.argv[1:] or list(SCENARIOS), axes)))
