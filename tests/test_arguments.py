"""Static and dynamic arguments of components (``_component/_arguments``): what
static values are accepted and how they are keyed, within a process and across
processes, and the errors that name an argument."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot


class Act(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


@dataclasses.dataclass(frozen=True)
class Inner:
    scale: float = 2.0
    dtype: Any = jnp.float32


@dataclasses.dataclass(frozen=True)
class Cfg:
    n: int = 2
    act: Act = Act.TANH
    inner: Inner = Inner()
    shape: tuple[int, ...] = (3,)


@dataclasses.dataclass(frozen=True)
class SameFields:
    n: int = 2
    act: Act = Act.TANH
    inner: Inner = Inner()
    shape: tuple[int, ...] = (3,)


class Pair(NamedTuple):
    n: int
    scale: float


@flax.struct.dataclass
class FlaxCfg:
    n: int
    act: Act


class EqxCfg(eqx.Module):
    n: int
    activation: Any


def _uses(x: jax.Array, cfg: Any) -> jax.Array:
    """A body whose result depends on every kind of static value below."""
    if isinstance(cfg, Cfg | SameFields):
        y = x * cfg.n * cfg.inner.scale
        y = jnp.tanh(y) if cfg.act is Act.TANH else jax.nn.relu(y)
        return y.astype(cfg.inner.dtype) + jnp.zeros(cfg.shape, cfg.inner.dtype)
    if isinstance(cfg, Pair):
        return x * cfg.n + cfg.scale
    if isinstance(cfg, FlaxCfg):
        return x * cfg.n if cfg.act is Act.RELU else -x
    if isinstance(cfg, EqxCfg):
        return cfg.activation(x * cfg.n)
    if isinstance(cfg, Act):
        return jnp.tanh(x) if cfg is Act.TANH else jax.nn.relu(x)
    if isinstance(cfg, tuple | frozenset):
        return x + sum(_uses(x, c) for c in sorted(cfg, key=repr))
    if callable(cfg) and not isinstance(cfg, type):
        return cfg(x)
    return x.astype(cfg)


def _scaled(x: jax.Array, k: float) -> jax.Array:
    return x * k


def _closure(k: float) -> Any:
    return lambda x: x * k


STATICS = [
    Cfg(),
    Cfg(n=3, act=Act.RELU, inner=Inner(0.5, jnp.bfloat16), shape=(2, 3)),
    Pair(2, 0.5),
    Act.RELU,
    (Act.TANH, Pair(1, 1.0), (Cfg(),)),
    frozenset({Act.TANH, Pair(3, 1.0)}),
    FlaxCfg(4, Act.RELU),
    EqxCfg(2, jax.nn.gelu),
    jax.nn.gelu,
    jax.nn.relu,
    functools.partial(jax.nn.gelu, approximate=False),
    functools.partial(_scaled, k=3.0),
    _closure(4.0),
    jnp.bfloat16,
    np.dtype("int32"),
]


@pytest.mark.parametrize("value", STATICS, ids=lambda v: type(v).__name__)
def test_static_values_match_jax_jit(value: Any) -> None:
    x = jnp.linspace(-1.0, 1.0, 3)
    expected = jax.jit(_uses, static_argnames="cfg")(x, cfg=value)
    comp = jaxaot.component(_uses, static_argnames="cfg")
    by_name, by_position = comp(x, cfg=value), comp(x, value)
    for out in (by_name, by_position):
        assert out.dtype == expected.dtype and out.shape == expected.shape
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    assert comp.cache_info().compiles == 1  # by name and by position: one entry


# Pairs of different values: never one key, even where jax.jit's hash and
# equality would call them the same (1 and True) or a NamedTuple reads like a tuple.
DIFFERENT = [
    (Cfg(), Cfg(n=3)),
    (Cfg(), Cfg(inner=Inner(dtype=jnp.bfloat16))),
    (Cfg(), SameFields()),
    (Pair(1, 2.0), (1, 2.0)),
    (Act.TANH, Act.RELU),
    ((1,), (True,)),
    (frozenset({Pair(1, 1.0)}), frozenset({Pair(1, 2.0)})),
    (FlaxCfg(1, Act.RELU), FlaxCfg(2, Act.RELU)),
    (EqxCfg(2, jax.nn.gelu), EqxCfg(2, jax.nn.relu)),
    (jax.nn.gelu, jax.nn.relu),
    (functools.partial(jax.nn.gelu, approximate=True), functools.partial(jax.nn.gelu)),
    (_closure(2.0), _closure(3.0)),
    (jnp.float32, jnp.bfloat16),
    (jnp.float32, np.float32),
    (np.dtype("int32"), np.dtype("int64")),
]


@pytest.mark.parametrize(("a", "b"), DIFFERENT, ids=lambda v: type(v).__name__)
def test_different_static_values_give_different_keys(a: Any, b: Any) -> None:
    comp = jaxaot.component(lambda x, cfg: x, key="statics", static_argnames="cfg")
    x = jnp.ones(3)
    ka, kb = comp.cache_key(x, cfg=a), comp.cache_key(x, cfg=b)
    assert ka.digest != kb.digest
    assert ka.digest == comp.cache_key(x, cfg=a).digest


def test_equal_static_values_share_a_key() -> None:
    comp = jaxaot.component(lambda x, cfg: x, key="statics", static_argnames="cfg")
    x = jnp.ones(3)
    assert comp.cache_key(x, cfg=Cfg(n=5)).digest == comp.cache_key(x, cfg=Cfg(n=5)).digest
    assert (
        comp.cache_key(x, cfg=_closure(2.0)).digest == comp.cache_key(x, cfg=_closure(2.0)).digest
    )


def test_a_static_argument_passed_by_position_or_by_keyword_is_one_key(
    compiles: list[str],
) -> None:
    """A deployment calls ``dense(w, x, n=2, act="tanh")`` where its manifest gave
    ``n`` by position: the same entry, loaded rather than compiled again."""

    def dense(w: jax.Array, x: jax.Array, n: int, *, act: str = "tanh") -> jax.Array:
        h = x @ w
        for _ in range(n):
            h = jnp.tanh(h) if act == "tanh" else jnp.sin(h)
        return h

    comp = jaxaot.component(dense, static_argnums=(2,), static_argnames=("act",))
    w, x = jnp.ones((3, 3)) / 3, jnp.arange(6.0).reshape(2, 3)
    by_position = comp.cache_key(w, x, 2, act="tanh")
    assert comp.cache_key(w, x, n=2, act="tanh").digest == by_position.digest
    assert comp.cache_key(w, x, 2, act="sin").digest != by_position.digest
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        want = comp(w, x, 2, act="tanh")
        comp.clear_cache()
        before = len(compiles)
        got = comp(w, x, n=2, act="tanh")
    assert len(compiles) == before  # (loaded from the cache)
    np.testing.assert_array_equal(got, want)
    plain = jax.jit(dense, static_argnums=(2,), static_argnames=("act",))
    np.testing.assert_allclose(got, plain(w, x, 2, act="tanh"), rtol=1e-6)


WORKER = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, jaxaot
    from test_arguments import STATICS, _uses

    x = jnp.linspace(-1.0, 1.0, 3)
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(kw.get("fun_name", ""))
        if event == "/jax/core/compile/backend_compile_duration" else None
    )
    default = jaxaot.component(_uses, static_argnames="cfg")
    explicit = jaxaot.component(_uses, key="explicit", static_argnames="cfg")
    out = {"keys": [], "values": []}
    for value in STATICS:
        out["keys"].append(
            [default.cache_key(x, cfg=value).digest, explicit.cache_key(x, cfg=value).digest]
        )
        out["values"].append([default(x, cfg=value).tolist(), explicit(x, cfg=value).tolist()])
    out["info"] = [list(default.cache_info()), list(explicit.cache_info())]
    out["compiles"] = events
    print(json.dumps(out))
    """
)


def _run(tmp_path: Path, env: dict[str, str], seed: str) -> dict[str, Any]:
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])
    env["PYTHONHASHSEED"] = seed  # str hashes differ between the two processes
    proc = subprocess.run(
        [sys.executable, "-c", WORKER], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_static_values_keep_their_keys_in_a_second_process(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    cold = _run(tmp_path, subprocess_env, "1")
    warm = _run(tmp_path, subprocess_env, "2")
    assert warm["keys"] == cold["keys"]
    assert len({k for pair in cold["keys"] for k in pair}) == 2 * len(STATICS)
    for a, b in zip(warm["values"], cold["values"], strict=True):
        np.testing.assert_allclose(a, b)
    assert cold["info"][0][4] == len(STATICS) and cold["info"][1][4] == len(STATICS)
    # hits, misses, traces, lowerings, compiles: the warm process lowers and compiles nothing
    assert warm["info"][0][3:] == [0, 0] and warm["info"][1][3:] == [0, 0]
    assert warm["info"][1][2] == 0  # explicit keys: not even a trace
    assert warm["compiles"] == []


class _Opaque:
    """Hashable by identity: no value form."""


@dataclasses.dataclass
class _Mutable:
    n: int = 1
    __hash__ = object.__hash__


def _local_class_instance() -> Any:
    @dataclasses.dataclass(frozen=True)
    class Local:
        n: int = 1

    return Local()


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (_Opaque(), "_Opaque"),
        (Cfg(inner=Inner(dtype=_Opaque())), r"cfg\.inner\.dtype is a _Opaque"),
        (EqxCfg(1, _Opaque()), r"cfg\.activation is a _Opaque"),
        (_Mutable(), "not frozen"),
        (_local_class_instance(), "defined inside a function"),
        ((1, _closure(_Opaque())), r"cfg\[1\]<closure k> is a _Opaque"),
    ],
)
def test_static_without_a_stable_form_is_refused_by_name(
    value: Any, where: str, fresh_cache: jaxaot.MemoryCache
) -> None:
    comp = jaxaot.component(_uses, static_argnames="cfg")
    with pytest.raises(TypeError, match=r"jaxaot.component '_uses': static argument 'cfg'") as e:
        comp(jnp.ones(3), cfg=value)
    e.match(where)
    assert "frozen dataclasses" in str(e.value)  # says what to pass instead
    assert fresh_cache.keys() == []
    # jax.jit takes it (keyed in its process only), and so does jaxaot.jit.
    for jit in (jax.jit, jaxaot.jit):
        np.testing.assert_allclose(
            jit(lambda x, cfg: x + 1, static_argnames="cfg")(jnp.ones(3), cfg=value), 2.0
        )


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("value", [{"a": 1}, [1, 2], _Unhashable(), Cfg(shape=[3])])  # type: ignore[arg-type]
def test_unhashable_static_gets_jax_jits_error(value: Any) -> None:
    def f(x: jax.Array, d: Any) -> jax.Array:
        return x

    with pytest.raises(ValueError, match="Non-hashable static arguments are not supported") as ref:
        jax.jit(f, static_argnums=1)(jnp.ones(2), value)
    comp = jaxaot.component(f, static_argnums=1)
    with pytest.raises(ValueError, match="Non-hashable static arguments are not supported") as e:
        comp(jnp.ones(2), value)
    assert isinstance(e.value, TypeError)  # a bad argument of a component, too
    assert str(e.value).startswith("jaxaot.component 'f': static argument 'd' is not hashable")
    # jax.jit's sentences, word for word
    jax_words = str(ref.value).split("The error was")[0].split(", ")[0]
    assert jax_words in str(e.value)


@pytest.mark.parametrize(
    ("args", "path", "what"),
    [
        (({"scale": "a", "w": jnp.ones(2)}, jnp.ones(2)), r"params\['scale'\]", "a str 'a'"),
        ((EqxCfg(jnp.ones(2), jax.nn.gelu), jnp.ones(2)), r"params\.activation", "a function"),
        ((jnp.ones(2), None, object()), r"rest\[0\]", "an object"),
    ],
)
def test_leaf_errors_name_the_path(args: tuple[Any, ...], path: str, what: str) -> None:
    def f(params: Any, x: jax.Array, *rest: Any) -> Any:
        return x

    comp = jaxaot.component(f)
    with pytest.raises(
        TypeError, match=rf"jaxaot.component 'f': the argument at path {path} is {what}"
    ):
        comp(*args)
    with pytest.raises(TypeError, match=path):  # jax.jit names the same path
        jax.jit(f)(*args)


@dataclasses.dataclass(frozen=True)
class Activation:
    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x)


FIRST_ACT = Activation()


@dataclasses.dataclass(frozen=True)  # type: ignore[no-redef]
class Activation:  # noqa: F811  (redefined, as a notebook cell run again would)
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x)


SECOND_ACT = Activation()


def test_two_static_values_with_one_text_are_two_calls_in_a_process() -> None:
    # The redefined class reads the same by its import path, but is another
    # value: traced again, as jax.jit would.
    comp = jaxaot.component(lambda x, act: act(x), static_argnames="act")
    x = -jnp.ones(2)
    np.testing.assert_array_equal(comp(x, act=FIRST_ACT), jnp.tanh(x))
    np.testing.assert_array_equal(comp(x, act=SECOND_ACT), jax.nn.relu(x))


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda f: f(jnp.ones(3), y=jnp.ones(3)), "got an unexpected keyword argument 'y'"),
        (lambda f: f(jnp.ones(3), jnp.ones(3), 1.0), "takes 2 positional arguments but 3 were"),
    ],
)
def test_calls_that_do_not_fit_say_what_python_says(call: Any, says: str) -> None:
    """An unexpected keyword or too many positional arguments is named as Python
    (and ``jax.jit``) name it, not as the first missing argument."""

    @jaxaot.component
    def f(params: jax.Array, x: jax.Array) -> jax.Array:
        return x * params

    with pytest.raises(TypeError, match=f"jaxaot.component 'f': {says}"):
        call(f)


@pytest.mark.parametrize("donate", [-1, (-2,), 1, (0, -1)])
@pytest.mark.parametrize("wrap", ["component", "jaxaot.jit"])
def test_donate_argnums_donate_what_this_jax_jit_donates(wrap: str, donate: Any) -> None:
    """A negative ``donate_argnums`` donates what the installed ``jax.jit`` donates:
    nothing on JAX 0.10, the argument counted from the last one later; code that
    reuses such an argument under ``jax.jit`` keeps working under jaxaot."""

    def f(a: Any, b: Any) -> Any:
        return a + b, a * 2.0

    def deleted(fn: Callable[..., Any]) -> tuple[bool, bool]:
        a, b = jnp.ones(3), jnp.ones(3)
        jax.block_until_ready(fn(a, b))
        return a.is_deleted(), b.is_deleted()

    make = jaxaot.component if wrap == "component" else jaxaot.jit
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        assert deleted(make(f, donate_argnums=donate)) == deleted(jax.jit(f, donate_argnums=donate))
