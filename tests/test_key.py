"""ComponentKey: parts, equality, digests across processes, explanations, and
function fingerprints."""

from __future__ import annotations

import dataclasses
import enum
import functools
import pickle
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot
from jaxaot._keys._closure import (
    ClosureError,
    code_digest,
    refuse_closed_arrays,
)
from jaxaot._keys._key import ComponentKey, Described
from jaxaot._keys._text import parse_aval_str, stable_repr, stable_text, tree_text

REQUIRED_PARTS = {
    "format",
    "derive",
    "jax",
    "jaxlib",
    "x64",
    "config",
    "platforms",
    "component",
    "in_tree",
    "static",
    "args",
    "transform",
}


def test_parts_are_complete_and_ordered() -> None:
    comp = jaxaot.component(lambda x, n: x * n, key="parts", static_argnums=1)
    key = comp.cache_key(jnp.ones((2, 3), jnp.float32), 4)
    assert REQUIRED_PARTS <= set(key.parts)
    assert key.parts["args"] == ("float32[2,3]",)
    assert key.parts["static"] == (("n", "4"),)
    assert key.parts["component"] == "key:'parts'"
    assert key.parts["transform"] == ()
    assert key.parts["jax"] == jax.__version__
    assert key.parts["x64"] is False
    assert list(key.parts)[0] == "format"


def test_equality_compares_parts_not_hashes() -> None:
    a = ComponentKey({"component": "a", "args": ("float32[3]",)})
    b = ComponentKey({"component": "b", "args": ("float32[3]",)})
    b._hash = a._hash  # force a hash collision
    b._digest = a._digest  # and a digest collision
    assert a != b
    assert a == ComponentKey({"component": "a", "args": ("float32[3]",)})
    assert len({a, b}) == 2


def test_keys_are_immutable() -> None:
    key = ComponentKey({"component": "a"})
    with pytest.raises(TypeError):
        key.parts["component"] = "b"  # type: ignore[index]
    assert key.replace(component="b").parts["component"] == "b"
    assert key.parts["component"] == "a"


def test_explain_names_every_differing_part() -> None:
    a = ComponentKey({"component": "a", "args": ("float32[3]",), "x64": False})
    b = a.replace(args=("float32[4]",), x64=True)
    lines = a.explain(b)
    assert lines == ["args[0]: float32[4] → float32[3]", "jax_enable_x64 (x64): True → False"]
    assert a.explain(a) == []


def test_explanation_data_is_not_a_part() -> None:
    about = {"args": ["x"], "consts": ["[1. 2. 3.]"], "eqns": ["tanh:0:"], "eqn_count": 1}
    plain = ComponentKey({"component": "a", "program": "abc", "args": ("float32[3]",)})
    described = ComponentKey(
        {"component": "a", "program": Described("abc", about), "args": ("float32[3]",)}
    )
    assert described == plain and hash(described) == hash(plain)
    assert described.digest == plain.digest
    assert described.to_json() == plain.to_json()
    assert described.about == {"program": about} and plain.about == {}
    assert described.replace(x64=True).about == {"program": about}
    back = ComponentKey.from_json(described.to_json(), described.about)
    assert back == described and back.about == described.about
    assert pickle.loads(pickle.dumps(described)).about == described.about


def _described(
    args: tuple[str, ...], consts: tuple[str, ...], texts: list[str], eqns: list[str]
) -> ComponentKey:
    about = {"args": ["x", "params['w']"], "consts": texts, "eqns": eqns, "eqn_count": len(eqns)}
    program = "p:" + ",".join(eqns)
    return ComponentKey(
        {"program": Described(program, about), "consts": consts, "args": args, "transform": ()}
    )


def test_explain_in_words() -> None:
    old = _described(("f32[3]", "f32[3]"), ("f32[3]:d1",), ["[1. 2. 3.]"], ["tanh:a:", "mul:b:2."])
    shape = _described(
        ("f32[3]", "f32[5]"), ("f32[3]:d1",), ["[1. 2. 3.]"], ["tanh:a:", "mul:c:2."]
    )
    assert shape.explain(old)[0] == "argument params['w']: f32[3] → f32[5]"
    const = _described(
        ("f32[3]", "f32[3]"), ("f32[3]:d2",), ["[1. 2. 4.]"], ["tanh:a:", "mul:b:2."]
    )
    assert const.explain(old) == ["constant #0 f32[3]: [1. 2. 3.] → [1. 2. 4.]"]
    eqn = _described(("f32[3]", "f32[3]"), ("f32[3]:d1",), ["[1. 2. 3.]"], ["sin:a:", "mul:b:2."])
    assert eqn.explain(old) == ["program: equation 0: tanh → sin"]
    lit = _described(("f32[3]", "f32[3]"), ("f32[3]:d1",), ["[1. 2. 3.]"], ["tanh:a:", "mul:d:3."])
    assert lit.explain(old) == ["program: equation 1 (mul): constant 2. → 3."]
    # Without explanation data: by index and digest, still old → new.
    bare = ComponentKey({"consts": ("f32[3]:d1",), "program": "p1"})
    assert bare.replace(consts=("f32[3]:d2",), program="p2").explain(bare) == [
        "constant #0 f32[3]: its value changed (f32[3]:d1 → f32[3]:d2)",
        "program (its equations or types): p1 → p2",
    ]


def test_explain_versions_statics_and_flags_in_words() -> None:
    old = ComponentKey(
        {
            "jax": "0.10.1",
            "static": (("mode", "'a'"),),
            "config": (("jax_numpy_rank_promotion", "'allow'"),),
            "executable": (("xla_flags", "--xla_a=1 --xla_b"), ("donate_argnums", ())),
        }
    )
    new = ComponentKey(
        {
            "jax": "0.10.2",
            "static": (("mode", "'b'"),),
            "config": (("jax_numpy_rank_promotion", "'raise'"),),
            "executable": (("xla_flags", "--xla_a=2 --xla_c=x"), ("donate_argnums", (0,))),
        }
    )
    assert new.explain(old) == [
        "JAX version (jax): 0.10.1 → 0.10.2",
        "static argument 'mode' (static): 'a' → 'b'",
        "tracing option 'jax_numpy_rank_promotion' (config): 'allow' → 'raise'",
        "XLA_FLAGS flag --xla_a: 1 → 2",
        "XLA_FLAGS flag --xla_c: <absent> → x",
        "XLA_FLAGS flag --xla_b: (set) → <absent>",
        "donated arguments (donate_argnums): () → (0,)",
    ]


def test_json_round_trip() -> None:
    a = ComponentKey(
        {"component": "a", "static": (("n", "1"),), "transform": (("vmap", (0, None), 3),)}
    )
    assert ComponentKey.from_json(a.to_json()) == a
    assert ComponentKey.from_json(a.to_json()).digest == a.digest
    with pytest.raises(ValueError):
        ComponentKey.from_json([["a"]])


@pytest.mark.parametrize(
    "part", ["jax", "jaxlib", "platforms", "x64", "format", "derive", "config"]
)
def test_changing_any_environment_part_changes_digest(part: str) -> None:
    comp = jaxaot.component(lambda x: x, key="env")
    key = comp.cache_key(jnp.ones(2))
    changed = key.replace(**{part: ("something", "else")})
    assert changed != key and changed.digest != key.digest


def test_x64_is_part_of_the_key() -> None:
    comp = jaxaot.component(lambda x: x, key="x64")
    key32 = comp.cache_key(jax.ShapeDtypeStruct((2,), jnp.float32))
    with jax.enable_x64(True):
        key64 = comp.cache_key(jax.ShapeDtypeStruct((2,), jnp.float32))
    assert key32.parts["x64"] is False and key64.parts["x64"] is True
    assert key32 != key64


DIGEST_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, jaxaot
    def block(x, y, *, scale):
        return jnp.tanh(x @ y) * scale
    c = jaxaot.component(block, static_argnames="scale")
    print(c.cache_key(jnp.ones((2, 3)), jnp.ones((3, 4), jnp.int32), scale=2.5).digest)
    print(jaxaot.component(block, key=("blk", 1), static_argnames="scale").cache_key(
        jnp.ones((2, 3)), jnp.ones((3, 4)), scale=1.0).digest)
    """
)


def test_digest_is_identical_in_two_fresh_processes(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    script = tmp_path / "digest.py"
    script.write_text(DIGEST_SCRIPT)
    outs = [
        subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            env=subprocess_env,
            check=True,
        ).stdout
        for _ in range(2)
    ]
    assert outs[0] == outs[1]
    assert len(outs[0].split()) == 2 and all(len(d) == 64 for d in outs[0].split())


HELPER_V1 = "def helper(x):\n    return x * 2\n"
HELPER_V2 = "def helper(x):\n    return x * 3\n"
MAIN_SRC = textwrap.dedent(
    """
    import jax.numpy as jnp
    from helpers_mod import helper

    def block(x):
        return helper(x) + 1
    """
)
MAIN_SRC_EDITED = MAIN_SRC.replace("+ 1", "+ 2")
PRINT_KEY = "import jax.numpy as jnp, jaxaot, main_mod; print(jaxaot.component(main_mod.block).cache_key(jnp.ones(3)).digest)"


def _digest_in_fresh_process(pkg: Path, env: dict[str, str]) -> str:
    env = dict(env)
    env["PYTHONPATH"] = str(pkg) + ":" + env["PYTHONPATH"]
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run(
        [sys.executable, "-c", PRINT_KEY], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()


def test_editing_source_or_a_project_helper_changes_the_key(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    pkg = tmp_path / "proj"
    pkg.mkdir()
    (pkg / "helpers_mod.py").write_text(HELPER_V1)
    (pkg / "main_mod.py").write_text(MAIN_SRC)
    d1 = _digest_in_fresh_process(pkg, subprocess_env)
    assert d1 == _digest_in_fresh_process(pkg, subprocess_env)
    (pkg / "helpers_mod.py").write_text(HELPER_V2)
    d2 = _digest_in_fresh_process(pkg, subprocess_env)
    assert d2 != d1
    (pkg / "main_mod.py").write_text(MAIN_SRC_EDITED)
    d3 = _digest_in_fresh_process(pkg, subprocess_env)
    assert d3 not in (d1, d2)


_W = np.ones(2, np.float32)
_NS = types.SimpleNamespace(w=np.ones(3, np.float32), scale=2.0)


class _K:
    w = np.ones(4, np.float32)
    unread = np.ones(5, np.float32)
    scale = 2.0


@dataclasses.dataclass
class _Config:
    w: Any
    scale: float = 2.0

    def apply(self, x: Any) -> Any:
        return x * self.w


_CONFIG = _Config(np.ones(6, np.float32))


def _helper(x: Any) -> Any:
    return x * _W


def _plain_helper(x: Any) -> Any:
    return x * _NS.scale * _K.scale


def _inner() -> Any:
    w = np.ones(7, np.float32)

    def inner(x: Any) -> Any:
        return x * w

    return inner


_INNER = _inner()


class _Trainer:
    table = np.ones(8, np.float32)

    def __init__(self) -> None:
        self.params = np.ones(3, np.float32)  # (read by no method below but ``total``)
        self.scale = 2.0

    def scaled(self, x: Any) -> Any:
        return x * self.scale

    def total(self, x: Any) -> Any:
        return x * self.params.sum()

    @property
    def weights(self) -> Any:
        return self.params

    def by_property(self, x: Any) -> Any:
        return x * self.weights

    def by_helper(self, x: Any) -> Any:
        return x * self._own()

    def _own(self) -> Any:
        return self.params

    @staticmethod
    def helper(x: Any) -> Any:
        return x * _W

    @classmethod
    def looked_up(cls, x: Any) -> Any:
        return x * cls.table


class _Slotted:
    __slots__ = ("w",)

    def __init__(self) -> None:
        self.w = np.ones(9, np.float32)

    def scaled(self, x: Any) -> Any:
        return x * self.w


class _AttrDict(dict):  # (a config idiom: ``CFG.scale`` reads ``CFG["scale"]``)
    __getattr__ = dict.__getitem__


_TRAINER = _Trainer()
_SLOTTED = _Slotted()
_TABLES = types.SimpleNamespace(act=jnp.tanh, table=np.zeros(8, np.float32))
_ATTRS = _AttrDict(scale=2.0)


def test_explicit_keys_refuse_arrays_reached_through_helpers_and_attributes() -> None:
    """Arrays a function reaches by name beyond its own closure: through a helper
    it calls, a closure it holds, the attributes it reads of an object or a class
    (a namespace, a plain dataclass, a class attribute), an object's method. An
    explicit key covers none of them, so each is refused, and the message says
    where; what is not an array, or not read, is no reason."""
    cases = [
        (lambda x: _helper(x), r"global '_helper', which reads global '_W', shape \(2,\)"),
        (lambda x: x * _NS.w, r"attribute _NS\.w, shape \(3,\)"),
        (lambda x: x * _K.w, r"attribute _K\.w, shape \(4,\)"),
        (lambda x: x * _CONFIG.w, r"attribute _CONFIG\.w, shape \(6,\)"),
        (lambda x: _CONFIG.apply(x), r"attribute _CONFIG\.apply, which reads _CONFIG\.w"),
        (lambda x: _INNER(x), r"global '_INNER', which reads free variable 'w', shape \(7,\)"),
    ]
    for fun, says in cases:
        with pytest.raises(ClosureError, match=says):
            refuse_closed_arrays(fun, "f")
    config = _CONFIG
    with pytest.raises(ClosureError, match=r"attribute config\.w, shape \(6,\)"):
        refuse_closed_arrays(lambda x: x * config.w, "f")
    refuse_closed_arrays(_plain_helper, "f")  # numbers, and a class's unread array
    refuse_closed_arrays(lambda x: x * _CONFIG.scale, "f")
    # Methods: what their code reads of their object (or class), not all it holds.
    refuse_closed_arrays(lambda x: _TRAINER.scaled(x), "f")
    refuse_closed_arrays(lambda x: _TABLES.act(x), "f")  # a function held as data
    refuse_closed_arrays(lambda x: x * _ATTRS.scale, "f")  # (its lookups raise KeyError)
    for fun, says in [
        (
            lambda x: _TRAINER.total(x),
            r"_TRAINER\.total, which reads _TRAINER\.params, shape \(3,\)",
        ),
        (lambda x: _Trainer.helper(x), r"_Trainer\.helper, which reads global '_W'"),
        (lambda x: _Trainer.looked_up(x), r"_Trainer\.looked_up, which reads _Trainer\.table"),
        (lambda x: x * _SLOTTED.w, r"attribute _SLOTTED\.w, shape \(9,\)"),
        (lambda x: _SLOTTED.scaled(x), r"_SLOTTED\.scaled, which reads _SLOTTED\.w"),
        (lambda x: _TRAINER.by_property(x), r"which reads _TRAINER\.params, shape \(3,\)"),
        (lambda x: _TRAINER.by_helper(x), r"which reads _TRAINER\.params, shape \(3,\)"),
    ]:
        with pytest.raises(ClosureError, match=says):
            refuse_closed_arrays(fun, "f")


def test_explicit_keys_refuse_arrays_through_closures_defaults_and_partials() -> None:
    import functools

    def g(x: Any, k: Any = 1) -> Any:
        return x * k

    refuse_closed_arrays(functools.partial(g, k=3), "g")  # Python values are fine
    with pytest.raises(ClosureError, match=r"partial keyword 'k'.*shape \(2,\)"):
        refuse_closed_arrays(functools.partial(g, k=np.ones(2)), "g")

    class Holder:
        def __init__(self) -> None:
            self.w = jnp.ones((4,), jnp.int32)

        def __call__(self, x: Any) -> Any:
            return x * self.w

    table = {"w": np.zeros((2, 2))}
    with pytest.raises(ClosureError, match=r"free variable 'table'\['w'\].*\(2, 2\)"):
        refuse_closed_arrays(lambda x: x * table["w"], "f")
    # What a method's object or a callable object holds is what it computes with:
    # its attributes (no pytree), or the leaves of a pytree (an Equinox module).
    for fun in (Holder().__call__, Holder()):
        with pytest.raises(ClosureError, match=r"self\.w, shape \(4,\)"):
            refuse_closed_arrays(fun, "f")

    import equinox as eqx

    class Module(eqx.Module):
        w: jax.Array

        def __call__(self, x: Any) -> Any:
            return x * self.w

    for fun in (Module(jnp.ones(3)), Module(jnp.ones(3)).__call__):
        with pytest.raises(ClosureError, match=r"self\.w, shape \(3,\)"):
            refuse_closed_arrays(fun, "f")
    refuse_closed_arrays(Holder, "f")  # a class: what it computes with is its arguments
    params = {"layers": [{"w": jnp.ones(3)}]}
    with pytest.raises(ClosureError, match=r"\['layers'\]\[0\]\['w'\]"):
        refuse_closed_arrays(lambda x: x * params["layers"][0]["w"], "f")


def test_code_digest_follows_project_helpers() -> None:
    def helper(x: Any) -> Any:
        return x * 2

    def other_helper(x: Any) -> Any:
        return x * 3

    assert code_digest(lambda x: x * 2) == code_digest(lambda x: x * 2)
    assert code_digest(lambda x: x * 2) != code_digest(lambda x: x * 3)
    assert code_digest(helper) != code_digest(other_helper)


_ALPHA = 0.5


def test_code_digest_with_values_covers_the_numbers_a_function_reads() -> None:
    """An explicit-key entry's code digest: a global number or a closure's
    string the function reads is part of it (another value is other code)."""
    global _ALPHA

    def scaled(x: Any) -> Any:
        return x * _ALPHA

    def closing(mode: str) -> Any:
        return lambda x: x if mode == "id" else -x

    before, plain = code_digest(scaled, with_values=True), code_digest(scaled)
    _ALPHA = 0.9
    try:
        assert code_digest(scaled, with_values=True) != before
        assert code_digest(scaled) == plain  # (keys' digests stay as they were)
    finally:
        _ALPHA = 0.5
    assert code_digest(scaled, with_values=True) == before
    assert code_digest(closing("id"), with_values=True) != code_digest(
        closing("neg"), with_values=True
    )


def test_stable_text_and_tree_text_hold_no_address() -> None:
    class Thing:
        pass

    text = stable_text((jax.nn.relu, Thing(), {"b": 1, "a": [np.float32]}, jnp.sin))
    assert "0x" not in text and "relu" in text and "sin" in text
    assert stable_text({"b": 1, "a": 2}) == stable_text({"a": 2, "b": 1})
    tree = jax.tree_util.tree_structure({"a": (1, None), "b": [2]})
    assert tree_text(tree) == tree_text(jax.tree_util.tree_structure({"b": [0], "a": (0, None)}))
    assert "0x" not in tree_text(tree)


def test_stable_repr() -> None:
    assert stable_repr((1, "a", None, 2.5)) == "(1, 'a', None, 2.5)"
    assert stable_repr((1,)) == "(1,)"
    assert stable_repr(np.dtype("float32")) == "dtype(float32)"
    assert stable_repr(np.float32) == "dtype(float32)"
    assert stable_repr(jnp.float32) == "jax.numpy.float32(dtype(float32))"  # not np.float32
    assert stable_repr([1]) is None
    assert stable_repr(object()) is None
    assert stable_repr(frozenset({2, 1})) == stable_repr(frozenset({1, 2}))
    # Values whose repr is their value, which jax.jit takes as static arguments.
    texts = [stable_repr(v) for v in (range(3), range(0, 3, 2), ..., slice(1, None, 2), (1,))]
    assert None not in texts and len(set(texts)) == len(texts)
    assert stable_repr(range(3)) == stable_repr(range(0, 3))


def test_explain_takes_a_key() -> None:
    key = ComponentKey({"a": 1})
    with pytest.raises(TypeError, match="ComponentKey.explain takes another ComponentKey, got str"):
        key.explain("nope")  # type: ignore[arg-type]


class _Pair(NamedTuple):
    a: int
    b: float


class _Mode(enum.Enum):
    FAST = 1


def test_stable_repr_of_values_users_pass_as_static() -> None:
    from jaxaot._keys._text import unstable_part

    Pair, Mode = _Pair, _Mode

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        n: int
        act: Any = jax.nn.gelu

    assert stable_repr(Pair(1, 2.0)) == f"{Pair.__module__}.{Pair.__qualname__}(a=1, b=2.0)"
    assert stable_repr(Pair(1, 2.0)) != stable_repr((1, 2.0))
    assert stable_repr((1,)) != stable_repr((True,))  # equal and of one hash to jax.jit
    assert "Mode.FAST" in (stable_repr(Mode.FAST) or "")

    def member(value: float) -> enum.Enum:  # two enums of one name, other values
        class Made(enum.Enum):
            A = value

        return Made.A

    assert stable_repr(member(2.0)) != stable_repr(member(3.0))
    # A class defined in a function is not named by its import path alone.
    assert stable_repr(Cfg(1)) is None
    assert unstable_part(Cfg(1)) is not None and "inside a function" in unstable_part(Cfg(1))[2]
    gelu = stable_repr(jax.nn.gelu)
    assert gelu is not None and "jax._src.nn.functions.gelu" in gelu and "0x" not in gelu
    assert stable_repr(jax.nn.relu) is not None  # a custom_jvp whose rule refers to it
    assert stable_repr(functools.partial(jax.nn.gelu, approximate=False)) != stable_repr(
        functools.partial(jax.nn.gelu, approximate=True)
    )
    # JAX's ufuncs are objects named by their import path, each its own.
    ufuncs = [stable_repr(op) for op in (jnp.maximum, jnp.minimum, jnp.add, jnp.negative)]
    assert None not in ufuncs and len(set(ufuncs)) == 4 and "jax.numpy.maximum" in ufuncs[0]
    assert stable_repr(functools.partial(jnp.maximum)) is not None
    scale = [2.0, 3.0]
    assert stable_repr(lambda x: x * scale[0]) is None  # a closure over a mutable list
    where, part, why = unstable_part((1, (Mode.FAST, object()))) or ("", None, "")
    assert where == "[1][1]" and type(part) is object and "address" in why
    assert unstable_part((1, "a")) is None


def test_aval_text_round_trip() -> None:
    assert parse_aval_str("float32[2,3]~w") == ((2, 3), np.dtype("float32"), True)
    assert parse_aval_str("int8[]") == ((), np.dtype("int8"), False)
    with pytest.raises(ValueError):
        parse_aval_str("float32")
