"""The component decorator: keys, top-level calls, pytrees, arguments, errors,
debug info, threads and logging."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import textwrap
import threading
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot
from jaxaot._jax import default_platform
from jaxaot._store import _entry

Point = namedtuple("Point", ["x", "y"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    a: jax.Array
    b: jax.Array


def _raising(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("body must not be traced")


# -- 1. same key, same computation ---------------------------------------------


def test_same_key_is_served_without_tracing(fresh_cache: jaxaot.MemoryCache) -> None:
    first = jaxaot.component(lambda x: jnp.sin(x) * 2, key="shared")
    second = jaxaot.component(_raising, key="shared")
    x = jnp.arange(4.0)
    expected = first(x)
    np.testing.assert_allclose(second(x), expected)
    np.testing.assert_allclose(jax.jit(second)(x), expected)
    assert second.cache_info().traces == 0
    assert second.cache_info().hits >= 1
    assert first.cache_info().traces == 1
    # One entry for the lowered component, one for its top-level executable.
    entries = [_entry.decode(fresh_cache.get(k) or b"") for k in fresh_cache.keys()]
    assert sorted(e.executable is not None for e in entries) == [False, True]


_SCALE = 0.5


def _scaled(x: jax.Array) -> jax.Array:
    return x * _SCALE


def test_an_explicit_key_served_after_a_global_number_changed_says_so(
    fresh_cache: jaxaot.MemoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    """An explicit key promises the computation: served the entry a process made
    when a global it reads was another number, the component says so, once."""
    global _SCALE
    x = jnp.ones(3)
    np.testing.assert_allclose(jaxaot.component(_scaled, key="scaled-v1")(x), x * 0.5)
    _SCALE = 0.9
    try:
        with caplog.at_level(logging.WARNING, logger="jaxaot"):
            jaxaot.component(_scaled, key="scaled-v1")(x)  # (the promise, kept as given)
    finally:
        _SCALE = 0.5
    said = [r.getMessage() for r in caplog.records if "made by code that differs" in r.getMessage()]
    assert len(said) == 1 and "'_scaled' (key 'scaled-v1')" in said[0], caplog.text
    # A callable key is named by the value it gave, not by the callable's address.
    caplog.clear()
    x = jnp.ones(4)
    jaxaot.component(_scaled, key=lambda x: ("scaled", x.shape[0]))(x)
    _SCALE = 0.9
    try:
        with caplog.at_level(logging.WARNING, logger="jaxaot"):
            jaxaot.component(_scaled, key=lambda x: ("scaled", x.shape[0]))(x)
    finally:
        _SCALE = 0.5
    said = [r.getMessage() for r in caplog.records if "made by code that differs" in r.getMessage()]
    assert len(said) == 1 and "(key ('scaled', 4))" in said[0], caplog.text


def test_an_explicit_key_served_after_a_default_changed_says_so(
    fresh_cache: jaxaot.MemoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    """A default argument (positional or keyword-only) edited between runs under one
    explicit key: the component says, once, that the entry was made by other code."""
    x = jnp.ones(3)
    for source in (
        "def f(x, scale={}):\n    return x * scale\n",
        "def f(x, *, scale={}):\n    return x * scale\n",
    ):
        caplog.clear()
        fns = []
        for value in (2.0, 3.0):
            space: dict[str, Any] = {}
            exec(source.format(value), space)  # (each run's function)
            fns.append(space["f"])
        key = f"scaled-{len(source)}"
        np.testing.assert_allclose(jaxaot.component(fns[0], key=key)(x), x * 2.0)
        with caplog.at_level(logging.WARNING, logger="jaxaot"):
            jaxaot.component(fns[1], key=key)(x)  # (the promise, kept as given)
        said = [m for m in caplog.messages if "made by code that differs" in m]
        assert len(said) == 1 and "a default" in said[0], caplog.text


_READS = {
    "a NumPy scalar": "import numpy as np\nV = np.float32({v})\ndef f(x):\n    return x * V\n",
    "a dict": "V = {{'k': {v}}}\ndef f(x):\n    return x * V['k']\n",
    "a tuple": "V = ({v},)\ndef f(x):\n    return x * V[0]\n",
    "an enum member": (
        "import enum\nclass E(enum.Enum):\n    a = {v}\nV = E.a\n"
        "def f(x):\n    return x * V.value\n"
    ),
    "an attribute of self": (
        "class C:\n    k = {v}\n    def m(self, x):\n        return x * self.k\nf = C().m\n"
    ),
    "a bound argument of a partial": (
        "import functools\ndef g(x, k):\n    return x * k\nf = functools.partial(g, k={v})\n"
    ),
    "the backward rule of a custom_vjp": (
        "import jax\n@jax.custom_vjp\ndef act(x):\n    return x\n"
        "act.defvjp(lambda x: (x, None), lambda _, g: (g * {v},))\n"
        "def f(x):\n    return act(x) * 2.0\n"
    ),
    "the rule of a custom_jvp": (
        "import jax\n@jax.custom_jvp\ndef act(x):\n    return x\n"
        "act.defjvp(lambda p, t: (p[0], t[0] * {v}))\n"
        "def f(x):\n    return act(x) * 2.0\n"
    ),
}


@pytest.mark.parametrize("what", sorted(_READS))
def test_an_explicit_key_served_after_a_plain_value_it_reads_changed_says_so(
    fresh_cache: jaxaot.MemoryCache, caplog: pytest.LogCaptureFixture, what: str
) -> None:
    """The numbers an explicit-key function reads through NumPy scalars, small
    containers, enum members, its object's attributes or a partial's arguments,
    and the custom derivative rules of the functions it calls, are as much its
    code as a plain global: edited between runs, the component
    says so, once; unedited, it says nothing."""
    x = jnp.ones(3)
    fns = []
    for value in (2.0, 2.0, 3.0):
        space: dict[str, Any] = {}
        exec(_READS[what].format(v=value), space)  # (each run's function)
        fns.append(space["f"])
    key = f"reads-{what}"
    np.testing.assert_allclose(jaxaot.component(fns[0], key=key)(x), x * 2.0)
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        jaxaot.component(fns[1], key=key)(x)
        assert not [m for m in caplog.messages if "made by code that differs" in m]
        jaxaot.component(fns[2], key=key)(x)  # (the promise, kept as given)
    said = [m for m in caplog.messages if "made by code that differs" in m]
    assert len(said) == 1 and f"(key '{key}')" in said[0], caplog.text


_HELPERS = """
import numpy as np
ALPHA = {alpha}
TABLE = np.full(3, 2.0, np.float32)

def h(x):
    return x * {factor}
"""


def test_an_explicit_key_sees_what_it_reads_through_a_project_module(
    fresh_cache: jaxaot.MemoryCache,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``import helpers as H``; ``H.h(x)``, ``H.ALPHA``: an explicit-key component
    served an entry made when the project module's function or number was
    another says so, as when it names them directly; an array it reads there is
    refused (its key cannot cover the array's value)."""
    import importlib

    name = f"helpers_{abs(hash(tmp_path)) % 10**8}"
    source = tmp_path / f"{name}.py"
    source.write_text(_HELPERS.format(alpha=0.5, factor=2.0))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    space: dict[str, Any] = {"H": module}
    exec("def by_function(x):\n    return H.h(x)\n", space)
    exec("def by_number(x):\n    return x * H.ALPHA\n", space)
    exec("def by_array(x):\n    return x * H.TABLE\n", space)
    x = jnp.ones(3)
    for fun in ("by_function", "by_number"):
        jaxaot.component(space[fun], key=fun)(x)
    with pytest.raises(jaxaot.ClosureError, match="global 'H.TABLE', shape"):
        jaxaot.component(space["by_array"], key="by_array")(x)
    source.write_text(_HELPERS.format(alpha=0.75, factor=3.0))  # the edit
    importlib.reload(module)
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        for fun in ("by_function", "by_number"):
            jaxaot.component(space[fun], key=fun)(x)  # (the promise, kept as given)
    said = [r.getMessage() for r in caplog.records if "made by code that differs" in r.getMessage()]
    assert len(said) == 2, caplog.text
    assert "'by_function' (key 'by_function')" in said[0] and "(key 'by_number')" in said[1]


def test_raising_body_runs_for_a_new_signature() -> None:
    jaxaot.component(lambda x: x + 1, key="k")(jnp.ones(3))
    second = jaxaot.component(_raising, key="k")
    with pytest.raises(NotImplementedError):
        second(jnp.ones(4))


@pytest.mark.parametrize(
    "a, b",
    [
        ((jnp.ones(3),), (jnp.ones(4),)),
        ((jnp.ones(3),), (jnp.ones(3, jnp.int32),)),
        ((jnp.ones(3),), (jnp.ones((3, 1)),)),
        ((1.0,), (jnp.float32(1.0),)),  # weak type differs
        (({"a": jnp.ones(3)},), ({"b": jnp.ones(3)},)),  # tree structure differs
    ],
)
def test_signature_changes_the_key(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    comp = jaxaot.component(lambda x: x, key="sig")
    ka, kb = comp.cache_key(*a), comp.cache_key(*b)
    assert ka != kb and ka.digest != kb.digest
    assert ka.explain(kb)


def test_static_values_and_platform_change_the_key() -> None:
    comp = jaxaot.component(lambda x, n: x * n, key="st", static_argnums=1)
    x = jnp.ones(3)
    assert comp.cache_key(x, 2) != comp.cache_key(x, 3)
    assert comp.cache_key(x, 2) == comp.cache_key(x, 2)
    key = comp.cache_key(x, 2)
    assert key.parts["platforms"] == (default_platform(),)  # the backend's, e.g. cpu or cuda
    other = "rocm" if key.parts["platforms"] == ("cuda",) else "cuda"
    assert key.replace(platforms=(other,)) != key
    np.testing.assert_allclose(comp(x, 2), 2 * x)
    np.testing.assert_allclose(comp(x, 3), 3 * x)


# -- 2. top level ----------------------------------------------------------------


def test_top_level_matches_and_reuses_the_executable() -> None:
    calls = []

    def f(x: jax.Array, y: jax.Array) -> jax.Array:
        calls.append(1)
        return jnp.tanh(x) @ y

    comp = jaxaot.component(f)
    x, y = jnp.ones((3, 4)), jnp.arange(8.0).reshape(4, 2)
    expected = f(x, y)
    for _ in range(5):
        np.testing.assert_allclose(comp(x, y), expected, rtol=1e-6)
    info = comp.cache_info()
    assert info.traces == 1 and len(calls) == 2  # one trace by jaxaot, one plain call here
    assert info.compiles == 1 and info.lowerings == 1
    comp(jnp.ones((2, 4)), y)
    assert comp.cache_info().compiles == 2


def test_component_has_wrapped_and_stage_methods() -> None:
    def f(x: jax.Array) -> jax.Array:
        return x * 3

    comp = jaxaot.component(f)
    assert comp.__wrapped__ is f
    assert comp.__name__ == "f"
    sds = jax.ShapeDtypeStruct((2,), jnp.float32)
    traced = comp.trace(sds)
    lowered = comp.lower(sds)
    assert isinstance(traced, jax.stages.Traced)
    assert isinstance(lowered, jax.stages.Lowered)
    np.testing.assert_allclose(lowered.compile()(jnp.ones(2)), 3 * jnp.ones(2))
    assert "stablehlo.multiply" in lowered.as_text()
    assert isinstance(comp.cache_key(sds), jaxaot.ComponentKey)


def test_python_scalars_and_numpy_inputs() -> None:
    comp = jaxaot.component(lambda x, s: x * s)
    np.testing.assert_allclose(comp(np.ones(3, np.float32), 2.0), 2 * np.ones(3))
    out = comp(jnp.ones(3, jnp.float32), 2.0)
    assert out.dtype == jnp.float32


# -- 3. inside jit ----------------------------------------------------------------


def test_inside_jit_one_function_many_calls() -> None:
    comp = jaxaot.component(lambda x: jnp.sin(x) + 1)

    def g(x: jax.Array) -> jax.Array:
        for _ in range(4):
            x = comp(x)
        return x

    x = jnp.arange(3.0)
    text = jax.jit(g).lower(x).as_text()
    assert text.count("func.func private @jaxaot_") == 1
    assert text.count("call @jaxaot_") == 4
    np.testing.assert_allclose(
        jax.jit(g)(x), g.__wrapped__(x) if hasattr(g, "__wrapped__") else _plain_g(x), rtol=1e-6
    )
    assert comp.cache_info().traces == 1


def _plain_g(x: jax.Array) -> jax.Array:
    for _ in range(4):
        x = jnp.sin(x) + 1
    return x


# -- 7. pytrees and arguments ---------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x,
        lambda x: (x,),
        lambda x: [x],
        lambda x: (x, None, {"k": x * 2}),
        lambda x: Point(x, x + 1),
        lambda x: State(a=x, b=-x),
        lambda x: {"loss": jnp.sum(x), "aux": [x, (x,)]},
    ],
)
def test_result_structure_is_preserved(make: Any) -> None:
    comp = jaxaot.component(make)
    x = jnp.arange(3.0)
    expected = make(x)
    for got in (comp(x), jax.jit(comp)(x)):
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
        jax.tree_util.tree_map(np.testing.assert_allclose, got, expected)


def test_pytree_inputs_and_keyword_arguments() -> None:
    def f(p: dict[str, Any], pt: Point, s: State, *, scale: jax.Array, none: Any = None) -> Any:
        assert none is None
        return p["w"] * pt.x + s.a * scale + pt.y - s.b

    comp = jaxaot.component(f)
    args = ({"w": jnp.ones(2)}, Point(jnp.ones(2), jnp.ones(2)), State(jnp.ones(2), jnp.ones(2)))
    expected = f(*args, scale=jnp.float32(3.0))
    np.testing.assert_allclose(comp(*args, scale=jnp.float32(3.0)), expected)
    np.testing.assert_allclose(
        jax.jit(lambda *a: comp(*a, scale=jnp.float32(3.0)))(*args), expected
    )


def test_static_argnums_and_argnames() -> None:
    def f(x: jax.Array, n: int, *, mode: str) -> jax.Array:
        return x * n if mode == "mul" else x + n

    comp = jaxaot.component(f, static_argnums=1, static_argnames="mode")
    x = jnp.ones(3)
    np.testing.assert_allclose(comp(x, 3, mode="mul"), 3 * x)
    np.testing.assert_allclose(comp(x, 3, mode="add"), x + 3)
    np.testing.assert_allclose(jax.jit(lambda v: comp(v, 2, mode="mul"))(x), 2 * x)
    np.testing.assert_allclose(comp(x, 3, mode="mul"), 3 * x)
    assert comp.cache_info().traces == 3


@pytest.mark.parametrize("bad", [[1, 2], {"a": 1}, object(), np.ones(2)])
def test_unhashable_or_unstable_static_is_refused(
    bad: Any, fresh_cache: jaxaot.MemoryCache
) -> None:
    comp = jaxaot.component(lambda x, n: x, static_argnums=1)
    with pytest.raises(TypeError, match=r"<lambda>.*static argument 'n'"):
        comp(jnp.ones(2), bad)
    assert fresh_cache.keys() == []


def test_donate_argnums_at_top_level() -> None:
    comp = jaxaot.component(lambda x, y: x + y, donate_argnums=0)
    x, y = jnp.ones(1024), jnp.ones(1024)
    out = comp(x, y)
    np.testing.assert_allclose(out, 2 * np.ones(1024))
    assert x.is_deleted()
    assert not y.is_deleted()


def test_donate_argnames_as_jax_jit_takes_it() -> None:
    """``donate_argnames`` donates the named argument, passed by position or by
    name, as under jax.jit; a keyword-only parameter is refused, by name."""

    def step(state: jax.Array, x: jax.Array) -> jax.Array:
        return state + x

    comp = jaxaot.component(step, donate_argnames="state")
    for call in (lambda s, x: comp(s, x), lambda s, x: comp(state=s, x=x)):
        state, x = jnp.ones(256), jnp.ones(256)
        np.testing.assert_array_equal(call(state, x), jax.jit(step)(jnp.ones(256), x))
        assert state.is_deleted() and not x.is_deleted()

    def only(a: jax.Array, *, b: jax.Array) -> jax.Array:
        return a + b

    with pytest.raises(ValueError, match=r"'only'.*donate_argnames \['b'\] are not positional"):
        jaxaot.component(only, donate_argnames="b")


# -- 9. nothing silently stale ------------------------------------------------------------


def test_closed_over_array_is_refused_with_an_explicit_key() -> None:
    w = jnp.ones((3, 2), jnp.float32)
    comp = jaxaot.component(lambda x: x @ w, key="closes-over-w")
    with pytest.raises(
        jaxaot.ClosureError, match=r"free variable 'w'.*shape \(3, 2\), dtype float32.*argument"
    ):
        comp(jnp.ones((1, 3)))


def test_closed_over_array_content_is_part_of_a_default_key() -> None:
    def make(w: jax.Array) -> jaxaot.Component[..., Any]:
        return jaxaot.component(lambda x: x @ w)

    x = jnp.ones((1, 3))
    a, b = jnp.ones((3, 2)), 2 * jnp.ones((3, 2))
    np.testing.assert_allclose(make(a)(x), x @ a)
    np.testing.assert_allclose(make(b)(x), x @ b)
    np.testing.assert_allclose(jax.jit(lambda v: make(b)(v))(x), x @ b)
    assert make(a).cache_key(x) != make(b).cache_key(x)
    assert make(a).cache_key(x) == make(a + 0).cache_key(x)


def test_closed_over_tracer_is_refused() -> None:
    def outer(x: jax.Array, w: jax.Array) -> jax.Array:
        inner = jaxaot.component(lambda v: v * w)
        return inner(x)

    with pytest.raises(ValueError, match="traced value"):
        jax.jit(outer)(jnp.ones(2), jnp.ones(2))


def test_changing_a_closed_over_scalar_never_returns_the_old_result() -> None:
    scale = [2.0]

    def make() -> jaxaot.Component[..., Any]:
        s = scale[0]
        return jaxaot.component(lambda x: x * s)

    x = jnp.ones(3)
    np.testing.assert_allclose(make()(x), 2 * x)
    scale[0] = 5.0
    np.testing.assert_allclose(make()(x), 5 * x)
    np.testing.assert_allclose(jax.jit(lambda v: make()(v))(x), 5 * x)


GLOBAL_SCALE = 2.0


def _uses_global(x: jax.Array) -> jax.Array:
    return x * GLOBAL_SCALE


def test_changing_a_global_changes_the_key() -> None:
    """A changed global is another program, so another key, for a component that
    traces it anew (a new process, a new component); one that traced it already
    keeps that trace in its process, as jax.jit does."""
    global GLOBAL_SCALE
    x = jnp.ones(3)
    comp = jaxaot.component(_uses_global)
    k1 = comp.cache_key(x)
    np.testing.assert_allclose(jax.jit(lambda v: comp(v))(x), 2 * x)
    GLOBAL_SCALE = 7.0
    try:
        again = jaxaot.component(_uses_global)
        assert again.cache_key(x) != k1
        np.testing.assert_allclose(jax.jit(lambda v: again(v))(x), 7 * x)
        np.testing.assert_allclose(again(x), 7 * x)
        assert comp.cache_key(x) == k1
    finally:
        GLOBAL_SCALE = 2.0


# -- 11. debug info and error messages ---------------------------------------------------


def test_debug_info_follows_jax_conventions() -> None:
    def f(x: jax.Array, params: dict[str, jax.Array]) -> Any:
        return x, {"loss": jnp.sum(params["w"])}

    comp = jaxaot.component(f)
    x, params = jnp.ones(2), {"w": jnp.ones(3)}
    entry = comp.entry(x, params)
    assert entry.arg_names == ("x", "params['w']")
    assert entry.result_paths == ("result[0]", "result[1]['loss']")
    debug = comp.trace(x, params).jaxpr.debug_info
    assert tuple(debug.arg_names) == ("x", "params['w']")
    blob = _entry.encode(entry)
    assert _entry.decode(blob).arg_names == ("x", "params['w']")


def test_unknown_argument_names_are_empty_strings() -> None:
    comp = jaxaot.component(lambda *xs: sum(xs))
    names = comp.entry(jnp.ones(1), jnp.ones(1)).arg_names
    assert all(isinstance(n, str) for n in names)
    assert "None" not in names


def test_single_result_path_is_result() -> None:
    comp = jaxaot.component(lambda x: x)
    assert comp.entry(jnp.ones(1)).result_paths == ("result",)


# -- 12. threads -----------------------------------------------------------------------


def test_sixteen_threads_trace_each_signature_once() -> None:
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def make(k: int) -> jaxaot.Component[..., Any]:
        def body(x: jax.Array) -> jax.Array:
            with lock:
                counts[k] = counts.get(k, 0) + 1
            return jnp.cos(x) * (k + 1)

        return jaxaot.component(body, key=f"thread-{k}")

    comps = [make(k) for k in range(4)]
    shapes = [(2,), (3,)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for j in range(6):
                k = (i + j) % 4
                x = jnp.ones(shapes[(i + j) % 2])
                expected = np.cos(np.ones(x.shape)) * (k + 1)
                np.testing.assert_allclose(comps[k](x), expected, rtol=1e-6)
                np.testing.assert_allclose(
                    jax.jit(lambda v, c=comps[k]: c(v))(x), expected, rtol=1e-6
                )
        except BaseException as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for k, comp in enumerate(comps):
        assert comp.cache_info().traces <= len(shapes), (k, comp.cache_info())
        assert counts[k] <= len(shapes)


# -- 13. logging -----------------------------------------------------------------------------


def test_nothing_logged_or_printed_by_default(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO, logger="jaxaot")
    comp = jaxaot.component(lambda x: x + 1)
    comp(jnp.ones(2))
    jax.jit(comp)(jnp.ones(3))
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_explain_misses(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("JAXAOT_EXPLAIN_MISSES", "1")
    caplog.set_level(logging.WARNING, logger="jaxaot")
    comp = jaxaot.component(lambda x: x * 2, key="explained")
    comp(jnp.ones(3))
    caplog.clear()
    comp(jnp.ones(5))
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'<lambda>'" in m and "args[0]: float32[3] → float32[5]" in m for m in messages), (
        messages
    )


# -- 14. bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", [[1, 2], {"a": 1}, object(), 1j * np.ones(1)])
def test_unsupported_key_type(key: Any) -> None:
    with pytest.raises(TypeError, match="key must be"):
        jaxaot.component(lambda x: x, key=key)


def test_key_function_must_return_a_stable_value(fresh_cache: jaxaot.MemoryCache) -> None:
    comp = jaxaot.component(lambda x, mode: x, key=lambda x, mode: ("m", mode), static_argnums=1)
    np.testing.assert_allclose(comp(jnp.ones(2), "a"), jnp.ones(2))
    assert comp.cache_key(jnp.ones(2), "a").parts["component"] == "key:('m', 'a')"
    bad = jaxaot.component(lambda x: x, key=lambda x: object())
    with pytest.raises(TypeError, match="key function"):
        bad(jnp.ones(2))


def test_wrong_number_of_arguments(fresh_cache: jaxaot.MemoryCache) -> None:
    def f(x: jax.Array, y: jax.Array) -> jax.Array:
        return x + y

    comp = jaxaot.component(f)
    with pytest.raises(TypeError, match=r"component 'f'.*argument"):
        comp(jnp.ones(2))
    with pytest.raises(TypeError, match=r"component 'f'"):
        comp(jnp.ones(2), jnp.ones(2), jnp.ones(2))
    assert fresh_cache.keys() == []


def test_non_array_leaf_names_the_argument(fresh_cache: jaxaot.MemoryCache) -> None:
    def f(x: jax.Array, params: dict[str, Any]) -> jax.Array:
        return x

    comp = jaxaot.component(f)
    with pytest.raises(
        TypeError, match=r"component 'f': the argument at path params\['b'\] is a str"
    ):
        comp(jnp.ones(2), {"a": jnp.ones(1), "b": "text"})
    with pytest.raises(TypeError, match=r"the argument at path x is a str"):
        jax.jit(lambda p: comp("oops", p))({"a": jnp.ones(1)})
    assert fresh_cache.keys() == []


def test_non_callable_is_refused() -> None:
    with pytest.raises(TypeError, match="expected a callable"):
        jaxaot.component(3)  # type: ignore[call-overload]


# -- process-wide statistics ---------------------------------------------------------------


def test_process_stats_count_every_component() -> None:
    before = jaxaot.stats()
    comp = jaxaot.component(lambda x: x - 1)
    comp(jnp.ones(2))
    after = jaxaot.stats()
    assert after["traces"] == before["traces"] + 1
    assert after["compiles"] == before["compiles"] + 1
    assert after["misses"] >= before["misses"] + 1


def test_clear_cache_forgets_executables_of_a_dispatched_component() -> None:
    comp = jaxaot.component(lambda x: jnp.sin(x) * 2, key="clear-me")
    x = jnp.arange(3.0)
    np.testing.assert_allclose(comp(x), np.sin(np.arange(3.0)) * 2, rtol=1e-6)
    np.testing.assert_allclose(comp(x), np.sin(np.arange(3.0)) * 2, rtol=1e-6)
    hits = comp.cache_info().hits
    comp.clear_cache()
    # The next call goes back to the cache (in-process executables are gone) and
    # still gives the right result.
    np.testing.assert_allclose(comp(x), np.sin(np.arange(3.0)) * 2, rtol=1e-6)
    assert comp.cache_info().hits > hits


# -- configuration: one answer whichever way a component is called (issue 11) -------------


def _config_cases() -> list[tuple[str, Callable[[], Any]]]:
    return [
        ("rank_promotion", lambda: jax.numpy_rank_promotion("raise")),
        ("matmul_precision", lambda: jax.default_matmul_precision("highest")),
        ("dtype_promotion", lambda: jax.numpy_dtype_promotion("strict")),
    ]


def test_rank_promotion_change_is_seen_at_top_level_and_under_jit() -> None:
    comp = jaxaot.component(lambda x, y: x + y)
    x, y = jnp.ones((2, 3)), jnp.ones(3)
    np.testing.assert_allclose(comp(x, y), x + y)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank_promotion"):
            comp(x, y)
        with pytest.raises(ValueError, match="rank_promotion"):
            jax.jit(comp)(x, y)
    np.testing.assert_allclose(comp(x, y), x + y)


def test_dtype_promotion_change_is_seen_at_top_level() -> None:
    comp = jaxaot.component(lambda x, y: x + y)
    x, y = jnp.ones(3, jnp.float32), jnp.ones(3, jnp.bfloat16)
    assert comp(x, y).dtype == jnp.float32
    with jax.numpy_dtype_promotion("strict"):
        with pytest.raises(Exception, match="promot"):
            comp(x, y)


@pytest.mark.parametrize("name, make", _config_cases(), ids=[c[0] for c in _config_cases()])
def test_config_is_part_of_the_key(name: str, make: Callable[[], Any]) -> None:
    comp = jaxaot.component(lambda x: x @ x, key=f"config-{name}")
    x = jnp.ones((4, 4))
    before = comp.cache_key(x)
    with make():
        inside = comp.cache_key(x)
    assert before != inside
    assert any(name.split("_")[0] in line for line in inside.explain(before)), inside.explain(
        before
    )


X64_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, jaxaot
    jaxaot.set_cache(None)
    comp = jaxaot.component(lambda x: jnp.argmax(x))
    x = jnp.ones(3, jnp.float32)  # the same input type before and after
    before = comp(x).dtype
    jit_before = jax.jit(comp)(x).dtype
    jax.config.update("jax_enable_x64", True)
    after = comp(x).dtype
    jit_after = jax.jit(comp)(x).dtype
    plain = jax.jit(lambda x: jnp.argmax(x))(x).dtype
    print(before, jit_before, after, jit_after, plain)
    """
)


def test_x64_switched_mid_process(subprocess_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "x64.py"
    script.write_text(X64_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=subprocess_env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["int32", "int32", "int64", "int64", "int64"]


BIG_CLOSURE_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, jaxaot
    # 32x32 float32: over jax_embedded_constants_max_bytes (1 KiB), so that JAX
    # (0.12, or with simplified constants) hands it to the lowered program as an
    # argument of its own rather than as a constant in it.
    W = jax.random.normal(jax.random.key(0), (32, 32))

    def f(x):
        return jnp.tanh(x @ W)

    c = jaxaot.component(f)
    x = jnp.linspace(-1.0, 1.0, 64).reshape(2, 32)
    cases = {
        "direct": (c, f),
        "in jax.jit": (jax.jit(lambda x: c(x) * 2), jax.jit(lambda x: f(x) * 2)),
        "grad": (jax.grad(lambda x: c(x).sum()), jax.jit(jax.grad(lambda x: f(x).sum()))),
        "vmap": (jax.vmap(c), jax.jit(jax.vmap(f))),
        "jaxaot.jit": (jaxaot.jit(lambda x: c(c(x))), jax.jit(lambda x: f(f(x)))),
    }
    for name, (ours, plain) in cases.items():
        np.testing.assert_allclose(ours(x), plain(x), rtol=1e-6, atol=1e-6, err_msg=name)
    jaxaot.wait_for_writes()
    print("compiles", jaxaot.stats()["compiles"])
    """
)


def test_a_component_closing_over_a_large_array_runs_in_every_context(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """A constant JAX hoists out of the lowered program (an array over 1 KiB that
    the function closes over) stays in the component's module: linked into a
    caller, or loaded in the next process, it computes what jax.jit computes."""
    script = tmp_path / "big_closure.py"
    script.write_text(BIG_CLOSURE_SCRIPT)
    env = dict(subprocess_env, JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS="true")
    runs = [
        subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert int(runs[0].stdout.split()[-1]) > 0
    assert runs[1].stdout.split()[-1] == "0"  # the next process loads what the first made


def test_clear_cache_writes_entries_again(fresh_cache: jaxaot.MemoryCache) -> None:
    comp = jaxaot.component(lambda x: jnp.cos(x) * 5, key="clear-then-write")
    x = jnp.ones(3)
    comp(x)
    jaxaot.wait_for_writes()
    written = set(fresh_cache.keys())
    assert len(written) == 2  # the root entry and the executable
    fresh_cache.clear()
    comp.clear_cache()
    comp(x)
    jaxaot.wait_for_writes()
    assert set(fresh_cache.keys()) == written  # root and executable entries written again
    again = jaxaot.component(lambda x: jnp.cos(x) * 5, key="clear-then-write")
    np.testing.assert_allclose(again(x), jnp.cos(x) * 5)
    assert again.cache_info().compiles == 0


class _Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale: float) -> None:
        self.scale = scale


def test_closure_over_a_slots_object_has_no_address_in_the_key(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "slots.py"
    script.write_text(
        textwrap.dedent(
            """
            import jax.numpy as jnp, jaxaot
            class S:
                __slots__ = ("scale",)
                def __init__(self, s): self.scale = s
            s = S(3.0)
            comp = jaxaot.component(lambda x: x * s.scale)
            print(comp.cache_key(jnp.ones(3)).digest)
            """
        )
    )
    digests = {
        subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            env=subprocess_env,
            check=True,
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(digests) == 1
    s = _Slotted(2.0)
    comp = jaxaot.component(lambda x: x * s.scale)
    np.testing.assert_allclose(comp(jnp.ones(3)), 2.0)
    assert "0x" not in repr(comp.cache_key(jnp.ones(3)).to_json())


def test_explicit_key_served_to_other_code_warns_once(
    fresh_cache: jaxaot.MemoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    x = jnp.ones(3)
    np.testing.assert_allclose(jaxaot.component(lambda x: x * 2, key="promise")(x), 2 * x)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    other = jaxaot.component(lambda x: x * 3, key="promise")
    # The key is the user's promise: the first result is served, with a warning.
    np.testing.assert_allclose(other(x), 2 * x)
    np.testing.assert_allclose(jax.jit(other)(x), 2 * x)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'<lambda>'" in warnings[0], warnings
    caplog.clear()
    same = jaxaot.component(lambda x: x * 2, key="promise")
    same(x)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


_DEFAULT_W = jnp.ones(3)


def test_explicit_key_refuses_arrays_in_globals_and_defaults() -> None:
    def with_default(x: jax.Array, w: jax.Array = _DEFAULT_W) -> jax.Array:
        return x * w

    with pytest.raises(jaxaot.ClosureError, match=r"default argument 0.*shape \(3,\)"):
        jaxaot.component(with_default, key="default-array")(jnp.ones(3))
    with pytest.raises(jaxaot.ClosureError, match=r"global '_GLOBAL_PARAMS'\['w'\]"):
        jaxaot.component(_reads_global_params, key="global-array")(jnp.ones(3))


_GLOBAL_PARAMS = {"w": np.ones(3, np.float32)}


def _reads_global_params(x: jax.Array) -> jax.Array:
    return x * _GLOBAL_PARAMS["w"]


def test_layers_of_one_type_derive_their_keys_once() -> None:
    """Every layer of a deep network derives the same forward, linear and transposed
    keys: worked out once (memoized), and still told apart by input type."""
    from jaxaot._component import _parts

    @jaxaot.component
    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w)

    def loss(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = layer(w, x)
        return jnp.sum(x**2)

    def plain(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x**2)

    ws = [jnp.full((4, 4), 0.1 * (i + 1), jnp.float32) for i in range(12)]
    x = jnp.ones((2, 4), jnp.float32)
    _parts._derived_key.cache_clear()
    got = jaxaot.jit(jax.grad(loss))(ws, x)
    info = _parts._derived_key.cache_info()
    assert info.misses == 3 and info.hits == 3 * 11  # forward, linear, transposed
    want = jax.jit(jax.grad(plain))(ws, x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # Another input type (bf16, then another shape) derives other keys and results.
    for xb in (x.astype(jnp.bfloat16), jnp.ones((3, 4))):
        wsb = [w.astype(xb.dtype) for w in ws]
        got_b = jaxaot.jit(jax.grad(loss))(wsb, xb)
        want_b = jax.jit(jax.grad(plain))(wsb, xb)
        for g, w in zip(got_b, want_b, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=1e-2
            )
    assert _parts._derived_key.cache_info().misses == 9


def test_debug_nans_and_disable_jit_work_as_under_jax_jit() -> None:
    """``jax_debug_nans``: a NaN raises ``FloatingPointError`` (found op by op, as
    ``jax.jit`` does), not JAX's internal signal. ``jax.disable_jit``: the function
    runs as Python on concrete values (it raised "Disable jit is not supported in
    the AOT path")."""
    seen: list[Any] = []

    @jaxaot.component
    def f(x: jax.Array) -> jax.Array:
        seen.append(type(x))
        return jnp.log(x) * 2

    x = jnp.array([1.0, -1.0])
    f(jnp.ones(2))  # compiled first: the next calls take the C++ path
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError, match="invalid value"):
            f(x)
    seen.clear()
    with jax.disable_jit():
        out = f(x)
    assert seen and all(not issubclass(t, jax.core.Tracer) for t in seen), seen
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.log(x) * 2))


class _Slope:
    """A static config object: equal by value, printed without its value."""

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def __eq__(self, other: object) -> bool:
        return type(other) is _Slope and other.slope == self.slope

    def __hash__(self) -> int:
        return hash(self.slope)

    def __call__(self, x: Any) -> Any:
        return jnp.where(x > 0, x, self.slope * x)


@jax.tree_util.register_pytree_node_class
class _Layer:
    """A layer whose activation is static (tree node data, as an Equinox module's
    static field is)."""

    def __init__(self, w: Any, act: Callable[[Any], Any]) -> None:
        self.w, self.act = w, act

    def __call__(self, x: Any) -> Any:
        return self.act(x @ self.w)

    def tree_flatten(self) -> tuple[tuple[Any], Callable[[Any], Any]]:
        return (self.w,), self.act

    @classmethod
    def tree_unflatten(cls, act: Callable[[Any], Any], children: tuple[Any]) -> _Layer:
        return cls(children[0], act)


def test_static_values_passed_through_come_back_as_the_call_passed_them() -> None:
    """An update step passing a layer's static activation (a closure, or an object
    whose text does not show its value) through to its result: each call's result
    holds its own activation, as jax.jit's does, called directly or inside jax.jit.
    (The entry's tree is the first call's: the key tells static values apart only
    as far as their text does.)"""

    @dataclasses.dataclass
    class Config:  # (not frozen)
        slope: float

    def closure(slope: float) -> Callable[[Any], Any]:
        config = Config(slope)

        def act(x: Any) -> Any:
            return jnp.where(x > 0, x, config.slope * x)

        return act

    def update(m: _Layer, g: _Layer) -> _Layer:
        return jax.tree.map(lambda a, b: a - b, m, g)

    x = -jnp.ones((2, 4))
    for make in (closure, _Slope):
        direct = jaxaot.component(update)
        inside = jax.jit(jaxaot.component(update))
        for slope in (0.1, 0.2, 0.3):
            m = _Layer(jnp.ones((4, 4)), make(slope))
            g = jax.tree.map(jnp.zeros_like, m)
            want = jax.jit(update)(m, g)
            for fn in (direct, inside):
                got = fn(m, g)
                assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
                np.testing.assert_array_equal(got(x), want(x))


_REBOUND_W = jnp.full(2, 2.0)


def _reads_rebound_w(x: jax.Array) -> jax.Array:
    return x * _REBOUND_W


@pytest.mark.parametrize("first", ["top", "jit"])
def test_a_rebound_global_is_seen_as_jax_jit_sees_it_however_the_component_is_called(
    fresh_cache: jaxaot.MemoryCache, first: str
) -> None:
    """A component, like a ``jax.jit`` function, keeps what its first trace of a
    signature saw: a global rebound afterwards is not seen in this process, called
    at top level, inside ``jax.jit``, under ``vmap`` or inside ``jaxaot.jit`` alike
    (before, the traced paths traced again and saw it while the top level did not)."""
    global _REBOUND_W
    comp, plain = jaxaot.component(_reads_rebound_w), jax.jit(_reads_rebound_w)
    x = jnp.ones(2)
    if first == "top":
        comp(x)
    else:
        jax.jit(lambda v: comp(v))(x)
    plain(x)
    _REBOUND_W = jnp.full(2, 3.0)
    try:
        want = np.asarray(plain(x))
        got = {
            "top": comp(x),
            "jit": jax.jit(lambda v: comp(v))(x),
            "vmap": jax.vmap(comp)(x[None])[0],
            "jaxaot.jit": jaxaot.jit(lambda v: comp(v) * 1.0)(x),
        }
        for where, value in got.items():
            np.testing.assert_array_equal(value, want, err_msg=where)
        assert comp.cache_info().traces == 1
    finally:
        _REBOUND_W = jnp.full(2, 2.0)


def test_eval_shape_and_a_failing_key_function(fresh_cache: jaxaot.MemoryCache) -> None:
    """``Component.eval_shape`` gives what ``jax.eval_shape`` of the function gives,
    without compiling; a key function that fails names the component; a static
    ``range`` is keyed by its value, as jax.jit takes it."""

    def f(x: jax.Array, r: range) -> jax.Array:
        return jnp.concatenate([x] * len(r)).astype(jnp.bfloat16)

    comp = jaxaot.component(f, static_argnums=1)
    x = jnp.ones((2, 3))
    assert comp.eval_shape(x, range(3)) == jax.jit(f, static_argnums=1).eval_shape(x, range(3))
    assert comp.cache_info().compiles == 0
    np.testing.assert_array_equal(comp(x, range(2)), jax.jit(f, static_argnums=1)(x, range(2)))
    assert comp.cache_key(x, range(2)) != comp.cache_key(x, range(0, 4, 2))

    keyed = jaxaot.component(lambda x: x, key=lambda: "k")
    with pytest.raises(TypeError, match=r"^jaxaot.component '<lambda>': .*positional argument"):
        keyed(x)


def test_pmap_of_a_component_gives_pmaps_values_and_says_pmap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``jax.pmap`` of a component: pmap's values, and the one warning that its
    entry stays in the process names pmap (the user never wrote a shard_map)."""
    comp = jaxaot.component(lambda x: jnp.sin(x) * 2)
    x = jnp.linspace(0.0, 1.0, 4).reshape(1, 4)
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        got = jax.pmap(comp)(x)
        jax.pmap(comp)(x)
    np.testing.assert_array_equal(got, jax.pmap(lambda x: jnp.sin(x) * 2)(x))
    said = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
    assert len(said) == 1 and "pmap" in said[0], said


def test_a_component_calling_custom_partitioning_says_once_its_rule_is_not_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A component is lowered apart from its caller's shardings, so a
    ``custom_partitioning`` function in it runs its plain function: said once,
    naming the component (the values are the plain function's, as jax.jit's on
    one device)."""
    from jax.experimental.custom_partitioning import custom_partitioning

    @custom_partitioning
    def doubled(x: jax.Array) -> jax.Array:
        return x * 2.0

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        shardings = jax.tree.map(lambda s: s.sharding, arg_shapes)
        return mesh, lambda x: x * 2.0, result_shape.sharding, shardings

    doubled.def_partition(
        infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
        partition=partition,
        sharding_rule="i -> i",
    )

    @jaxaot.component
    def partitioned(x: jax.Array) -> jax.Array:
        return doubled(x) + 1.0

    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        for n in (3, 5):
            x = jnp.arange(float(n))
            np.testing.assert_array_equal(partitioned(x), x * 2.0 + 1.0)
    said = [r.getMessage() for r in caplog.records if "custom_partitioning" in r.getMessage()]
    assert len(said) == 1 and "'partitioned'" in said[0], said


def test_a_program_exported_with_symbolic_shapes_traces_its_components_inline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``jax.export`` with a symbolic batch dimension of a program calling a
    component (inside ``jax.jit``, the component itself, ``jaxaot.jit``): the
    component is traced inline, as ``jax.jit`` traces a function (its entries are
    for concrete shapes); the export runs at any batch with the plain program's
    values, and the component says so once."""
    from jax import export

    def f(x: jax.Array) -> jax.Array:
        return jnp.tanh(x) * 2.0

    comp = jaxaot.component(f)
    (b,) = export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, 3), jnp.float32)
    x = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
    want = export.export(jax.jit(lambda x: f(x) + 1.0))(spec).call(x)
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        for ours in (
            jax.jit(lambda x: comp(x) + 1.0),
            jaxaot.jit(lambda x: comp(x) + 1.0),
        ):
            exported = export.deserialize(export.export(ours)(spec).serialize())
            np.testing.assert_array_equal(np.asarray(exported.call(x)), np.asarray(want))
        assert jax.eval_shape(comp, spec).shape == spec.shape
    said = [m for m in caplog.messages if "symbolic dimension" in m]
    assert len(said) == 1 and repr(comp.name) in said[0], caplog.messages


def test_inputs_in_host_memory_run_as_jax_jit_runs_them_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Values in host memory (``memory_kind='pinned_host'``) keep their memory space
    through a component, directly and under jax.jit, and mixing them with device
    values raises jax.jit's error: such calls run as plain JAX (components are
    cached for device memory), said once."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
    x = jax.device_put(jnp.linspace(0.0, 1.0, 16).reshape(4, 4), host)
    w = jax.device_put(jnp.eye(4) * 0.5, host)

    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w)

    comp = jaxaot.component(f)
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        for ours, plain in (
            (comp, jax.jit(f)),
            (jax.jit(lambda x, w: comp(x, w) * 2), jax.jit(lambda x, w: f(x, w) * 2)),
        ):
            got, want = ours(x, w), plain(x, w)
            assert jax.typeof(got) == jax.typeof(want), (jax.typeof(got), jax.typeof(want))
            assert got.sharding.memory_kind == "pinned_host"
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        with pytest.raises(ValueError, match="memory_space"):
            jax.jit(f)(x, jnp.eye(4))
        with pytest.raises(ValueError, match="memory_space"):
            comp(x, jnp.eye(4))
    said = [m for m in caplog.messages if "host memory" in m]
    assert len(said) == 1 and repr(comp.name) in said[0], caplog.messages
