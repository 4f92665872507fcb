"""Tree structures as JSON: the output trees users' libraries build round-trip,
persist across processes, and a tree that cannot be stored says so once."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxaot
from jaxaot._store._trees import NotPersistable, tree_from_json, tree_to_json


class Act(enum.Enum):
    RELU = 1
    GELU = 2


@dataclasses.dataclass(frozen=True)
class Config:
    width: int
    act: Act
    name: str
    scales: tuple[float, ...] = (1.0, 0.5)


class Pair(NamedTuple):
    a: int
    b: str


class Block(eqx.Module):
    linear: eqx.nn.Linear
    activation: Callable[[Any], Any] = eqx.field(static=True)
    config: Config = eqx.field(static=True)
    pair: Pair = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)


class _Token:
    """A sentinel compared by identity, bound to a module-level name."""


TOKEN = _Token()


@jax.tree_util.register_pytree_node_class
class Tagged:
    def __init__(self, value: Any, tag: Any) -> None:
        self.value, self.tag = value, tag

    def tree_flatten(self) -> tuple[tuple[Any], Any]:
        return (self.value,), self.tag

    @classmethod
    def tree_unflatten(cls, tag: Any, children: Any) -> Tagged:
        return cls(children[0], tag)


class ByValue:
    """Compared by value: a module-level name bound to one says nothing of another
    process's value, so it is never stored by name."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByValue) and other.v == self.v

    def __hash__(self) -> int:
        return hash(self.v)


DEFAULT = ByValue(3)


def _block(activation: Callable[[Any], Any] = jax.nn.relu) -> Block:
    return Block(
        eqx.nn.Linear(3, 4, key=jax.random.PRNGKey(0)),
        activation,
        Config(4, Act.GELU, "b"),
        Pair(1, "x"),
        jnp.dtype(jnp.bfloat16),
    )


class _Nnx(nnx.Module):
    def __init__(self) -> None:
        self.linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        self.norm = nnx.LayerNorm(3, rngs=nnx.Rngs(0))


def _trees() -> dict[str, Any]:
    block = _block()
    mlp = eqx.nn.MLP(2, 3, 4, 2, key=jax.random.PRNGKey(0))
    return {
        "equinox linear": eqx.nn.Linear(3, 4, key=jax.random.PRNGKey(0)),
        "equinox module with static fields": block,
        "equinox mlp (filtered)": eqx.filter(mlp, eqx.is_array),
        "optax adam state": optax.adam(1e-3).init(eqx.filter(block, eqx.is_array)),
        "nnx state": nnx.split(_Nnx())[1],
        "none leaves": [None, {"a": 1, "b": None}],
        "identity sentinel": Tagged(1.0, TOKEN),
        "dict node data": Tagged(1.0, {"k": (1, 2), "j": [Act.RELU]}),
    }


@pytest.mark.parametrize("name", list(_trees()))
def test_library_trees_round_trip(name: str) -> None:
    treedef = jax.tree_util.tree_structure(_trees()[name])
    back = tree_from_json(json.loads(json.dumps(tree_to_json(treedef))))
    assert back == treedef
    assert str(back) == str(treedef)


def test_a_local_function_in_node_data_is_not_persistable_and_names_the_node() -> None:
    treedef = jax.tree_util.tree_structure(_block(lambda x: x))
    with pytest.raises(NotPersistable, match=r"function.*tests\.test_trees:Block|Block"):
        tree_to_json(treedef)


def test_objects_compared_by_value_are_not_stored_by_name() -> None:
    # Bound to DEFAULT in this module, but compared by value: no stored form.
    with pytest.raises(NotPersistable, match="ByValue"):
        tree_to_json(jax.tree_util.tree_structure(Tagged(1.0, DEFAULT)))


def test_rebuilt_frozen_dataclass_runs_no_init() -> None:
    calls: list[int] = []

    @dataclasses.dataclass(frozen=True)
    class Checked:
        n: int

        def __post_init__(self) -> None:
            calls.append(self.n)

    global _Checked
    _Checked = Checked  # reachable by name, as a module-level class would be
    Checked.__qualname__ = "_Checked"
    value = Checked(2)
    calls.clear()
    data = tree_to_json(jax.tree_util.tree_structure(Tagged(0.0, value)))
    calls.clear()
    back = tree_from_json(data)
    assert back.node_data()[1] == value
    assert calls == []


def test_unpersistable_output_tree_warns_once_and_stays_in_memory(
    fresh_cache: jaxaot.MemoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    @jaxaot.component
    def make(x: jax.Array) -> Block:
        return dataclasses.replace(_block(lambda v: v), linear=eqx.nn.Linear(3, 4, key=x))

    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        make(jax.random.PRNGKey(1))
        make.clear_cache()
        make(jax.random.PRNGKey(1))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "'make'" in warnings[0] and "Block" in warnings[0] and "function" in warnings[0]
    # Neither its lowered entry nor its executable reached the cache.
    assert list(fresh_cache.keys()) == []


def test_each_cause_of_an_unpersistable_tree_is_said_once_even_under_one_name(
    fresh_cache: jaxaot.MemoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    """Two components of one name, their results' node data of two local classes:
    each class is a cause of its own, said once (the second was silent)."""

    class Meta:
        pass

    class Other:
        pass

    def f(t: Tagged) -> Tagged:
        return Tagged(t.value * 2, t.tag)

    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        for tag in (Meta(), Other(), Other()):
            jaxaot.component(f)(Tagged(jnp.ones(2), tag))
    # (Another test's component may warn meanwhile, from the writer thread.)
    warnings = [r.getMessage() for r in caplog.records if "component 'f'" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert ".Meta" in warnings[0] and ".Other" in warnings[1], warnings


_WARM = textwrap.dedent(
    """
    import dataclasses, json, sys
    from typing import NamedTuple
    import equinox as eqx, jax, jax.numpy as jnp, optax
    from flax import nnx
    import jaxaot

    jaxaot.set_cache(jaxaot.DirectoryCache(sys.argv[1]))
    opt = optax.adam(1e-2)

    class Model(eqx.Module):
        l1: eqx.nn.Linear
        l2: eqx.nn.Linear
        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    def eqx_step(model, opt_state, x, y):
        def loss(m):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)
        l, g = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = opt.update(g, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, l

    class Net(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(3, 8, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(8, 1, rngs=nnx.Rngs(1))
        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    graphdef, _ = nnx.split(Net())

    def nnx_step(state, x, y):
        def loss(s):
            return jnp.mean((nnx.merge(graphdef, s)(x) - y) ** 2)
        l, g = jax.value_and_grad(loss)(state)
        return jax.tree.map(lambda p, d: p - 0.1 * d, state, g), l

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class TrainState:
        params: dict
        step: jax.Array
        tag: str = dataclasses.field(metadata=dict(static=True), default="run")

    def dc_step(s, x):
        return TrainState({"w": s.params["w"] - x.mean()}, s.step + 1, s.tag), None

    class Out(NamedTuple):
        value: jax.Array
        aux: object

    def nt_step(x):
        return Out(x * 2, None)

    k = jax.random.PRNGKey(0)
    model = Model(eqx.nn.Linear(3, 8, key=k), eqx.nn.Linear(8, 1, key=k))
    x, y = jnp.linspace(0, 1, 12).reshape(4, 3), jnp.ones((4, 1))
    cases = {
        "equinox": (eqx_step, (model, opt.init(eqx.filter(model, eqx.is_array)), x, y)),
        "nnx": (nnx_step, (nnx.split(Net())[1], x, y)),
        "dataclass": (dc_step, (TrainState({"w": jnp.ones(3)}, jnp.int32(0)), x)),
        "namedtuple": (nt_step, (x,)),
    }
    out = {}
    for name, (fun, args) in cases.items():
        comp = jaxaot.component(fun)
        got, want = comp(*args), jax.jit(fun)(*args)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        same = all(
            bool(jnp.array_equal(a, b)) and a.dtype == b.dtype
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        )
        info = comp.cache_info()
        out[name] = {"same": same, "lowerings": info.lowerings, "compiles": info.compiles}
    jaxaot.wait_for_writes()
    print(json.dumps(out))
    """
)


def test_updated_models_and_states_warm_start_in_a_new_process(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    script = tmp_path / "warm.py"
    script.write_text(_WARM)
    cache = str(tmp_path / "cache")

    def run() -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, str(script), cache],
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "not written to the cache" not in proc.stderr, proc.stderr[-3000:]
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result

    cold, warm = run(), run()
    for name in cold:
        assert cold[name]["same"] and warm[name]["same"], name
        assert cold[name]["compiles"] == 1, (name, cold[name])
        assert warm[name] == {"same": True, "lowerings": 0, "compiles": 0}, name


class Mode(enum.IntEnum):
    A = 1
    B = 2


def test_int_enum_node_data_comes_back_as_the_enum() -> None:
    treedef = jax.tree_util.tree_structure(Tagged(1.0, (Mode.A, 3)))
    back = tree_from_json(json.loads(json.dumps(tree_to_json(treedef))))
    tag = back.unflatten([0.0]).tag
    assert tag[0] is Mode.A and type(tag[1]) is int


@dataclasses.dataclass(frozen=True)
class Derived:
    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "twice", self.n * 2)


def test_a_dataclass_holding_more_than_its_fields_is_not_stored() -> None:
    with pytest.raises(NotPersistable):
        tree_to_json(jax.tree_util.tree_structure(Tagged(1.0, Derived(2))))
