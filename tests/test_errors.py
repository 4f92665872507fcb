"""Errors for bad arguments of ``jaxaot.jit``: as good as ``jax.jit``'s (the
argument's path, what it is, what to do), in the words components use."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot


class Model(eqx.Module):
    w: jax.Array
    activation: Any


def loss(params: Any, x: jax.Array) -> jax.Array:
    return jnp.sum(params["scale"] * x)


def apply(m: Model, x: jax.Array) -> jax.Array:
    return m.activation(m.w * x)  # type: ignore[no-any-return]


def _message(fun: Any, *args: Any) -> str:
    with pytest.raises(TypeError) as e:
        fun(*args)
    return str(e.value)


@pytest.mark.parametrize(
    ("fun", "args", "path"),
    [
        (loss, ({"scale": "a"}, jnp.ones(3)), "params['scale']"),
        (apply, (Model(jnp.ones(3), jax.nn.gelu), jnp.ones(3)), "m.activation"),
    ],
    ids=["string-leaf", "equinox-function-leaf"],
)
def test_a_leaf_that_is_not_an_array_is_named_by_its_path(
    fun: Any, args: tuple[Any, ...], path: str
) -> None:
    assert f"at path {path}." in _message(jax.jit(fun), *args)  # what jax.jit says
    text = _message(jaxaot.jit(fun), *args)
    assert text.startswith(f"jaxaot.jit '{fun.__name__}': the argument at path {path} is a ")
    assert "not an array" in text and "static_argnums/static_argnames" in text
    # The same words as a component's, but for the name of the function.
    comp = _message(jaxaot.component(fun), *args)
    assert comp.replace(f"jaxaot.component '{fun.__name__}'", "") == text.replace(
        f"jaxaot.jit '{fun.__name__}'", ""
    )


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (2**70, OverflowError, "is the Python int 1180591620717411303424, outside the range"),
        (np.array([1, "a"], dtype=object), TypeError, "is a NumPy array of dtype object"),
        (np.array(["a", "b"]), TypeError, "is a NumPy array of dtype <U1"),
    ],
    ids=["int-too-large", "object-array", "string-array"],
)
def test_a_value_jax_cannot_type_is_named_by_its_path(
    value: Any, error: type[Exception], words: str
) -> None:
    """A Python int too large for JAX's int type, or a NumPy array of a dtype JAX
    has none for: jax.jit's error type, naming the function and the path (as
    jax.jit's does), in a component and under jaxaot.jit."""

    def f(x: jax.Array, y: Any) -> jax.Array:
        return x * 2 + y["k"]

    args = (jnp.ones(3), {"k": value})
    with pytest.raises(error) as e:
        jax.jit(f)(*args)
    assert "y['k']" in str(e.value)
    for who, fun in (("jaxaot.jit", jaxaot.jit(f)), ("jaxaot.component", jaxaot.component(f))):
        with pytest.raises(error) as e:
            fun(*args)
        assert str(e.value).startswith(f"{who} 'f': the argument at path y['k'] {words}"), e.value


def test_a_function_leaf_says_to_mark_the_field_static() -> None:
    text = _message(jaxaot.jit(apply), Model(jnp.ones(3), jax.nn.gelu), jnp.ones(3))
    assert "eqx.field(static=True)" in text


def test_a_modules_non_array_field_says_how_to_pass_the_module() -> None:
    """An Equinox model passed as it is, holding a batch norm (its ``axis_name`` is
    a string): the message says to split it into its arrays and the rest, as for
    a function field (it named only the path)."""
    bn = eqx.nn.BatchNorm(3, "batch", mode="batch")

    def forward(m: Any, x: jax.Array) -> jax.Array:
        return x

    text = _message(jaxaot.jit(forward), bn, jnp.ones(3))
    assert "at path m.axis_name is a str 'batch', not an array" in text, text
    assert "eqx.partition(model, eqx.is_array)" in text and "\n" not in text, text


def test_a_linen_module_argument_says_to_pass_its_variables() -> None:
    """A Flax linen module passed as an argument holds no arrays: the message says
    to close over it or make it static and pass its variables (not Equinox's
    advice), on one line."""
    import flax.linen as nn

    module = nn.Dense(4)
    variables = module.init(jax.random.key(0), jnp.ones((2, 3)))

    def forward(m: Any, v: Any, x: jax.Array) -> jax.Array:
        return m.apply(v, x)  # type: ignore[no-any-return]

    for fun in (jaxaot.jit(forward), jaxaot.component(forward)):
        text = _message(fun, module, variables, jnp.ones((2, 3)))
        assert "at path m is a Dense Dense(" in text and "\n" not in text, text
        assert "A Flax linen module holds no arrays" in text and "pass its variables" in text
        assert "eqx.partition" not in text, text
    got = jaxaot.jit(forward, static_argnums=0)(module, variables, jnp.ones((2, 3)))
    want = jax.jit(forward, static_argnums=0)(module, variables, jnp.ones((2, 3)))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_function_leaf_is_named_by_its_name_not_its_address() -> None:
    text = _message(jaxaot.jit(apply), Model(jnp.ones(3), jax.nn.relu), jnp.ones(3))
    assert "relu" in text and " at 0x" not in text, text
    assert "eqx.partition" in text


def test_a_component_returning_a_function_field_names_itself() -> None:
    @jaxaot.component
    def make(key: jax.Array) -> Any:
        return eqx.nn.MLP(2, 3, 4, 1, key=key)

    text = _message(make, jax.random.key(0))
    assert text.startswith("jaxaot.component 'make' returns a value that is not an array")
    assert ".activation" in text and "eqx.filter(model, eqx.is_array)" in text


def test_a_leaf_inside_a_keyword_and_after_statics_is_named() -> None:
    def f(n: int, x: jax.Array, *, extra: Any) -> jax.Array:
        return x * n

    jitted = jaxaot.jit(f, static_argnums=0)
    text = _message(lambda: jitted(2, jnp.ones(2), extra={"a": ["s"]}))
    assert "at path extra['a'][0] is a str 's'" in text
    text = _message(lambda: jitted(2, {"b": "s"}, extra=jnp.ones(1)))
    assert "at path x['b'] is a str 's'" in text


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("value", [{"a": 1}, [1], _Unhashable()], ids=["dict", "list", "object"])
def test_an_unhashable_static_gets_jax_jits_error(value: Any) -> None:
    def f(x: jax.Array, d: Any) -> jax.Array:
        return x * 2

    with pytest.raises(ValueError) as ref:
        jax.jit(f, static_argnums=1)(jnp.ones(2), value)
    for fun, after in (
        (jaxaot.jit(f, static_argnums=1), False),
        (jaxaot.jit(f, static_argnames="d"), True),
    ):
        if after:  # after a call JAX's C++ dispatcher runs first: the same error
            fun(jnp.ones(2), d=0)
            fun(jnp.ones(2), d=0)
        with pytest.raises(ValueError) as e:
            fun(jnp.ones(2), value)
        text = str(e.value)
        assert text.startswith("jaxaot.jit 'f': static argument 'd' is not hashable. ")
        assert str(ref.value).split(" An error")[0] in text  # jax.jit's sentence
        assert f"TypeError: unhashable type: '{type(value).__name__}'" in text
        with pytest.raises(ValueError, match="^jaxaot.jit 'f': static argument 'd'"):
            fun(jnp.ones(2), d=value)


@dataclasses.dataclass(frozen=True)
class Cfg:
    n: int = 2


def test_static_argnames_passed_by_position_is_static() -> None:
    def f(x: jax.Array, cfg: Cfg) -> jax.Array:
        return x * cfg.n

    x = jnp.ones(3)
    jitted = jaxaot.jit(f, static_argnames="cfg")
    for cfg in (Cfg(), Cfg(3)):
        expected = jax.jit(f, static_argnames="cfg")(x, cfg)
        np.testing.assert_allclose(jitted(x, cfg), expected)
        np.testing.assert_allclose(jitted(x, cfg=cfg), expected)


@pytest.mark.parametrize("wrap", [jaxaot.jit, jaxaot.component], ids=["jit", "component"])
def test_errors_show_the_users_frames_not_jaxaots(wrap: Any) -> None:
    """As under ``jax.jit``: an error in the function is shown from the caller's
    line to the function's, without jaxaot's frames (2 to 11 of them were shown),
    from a call and from the stage methods alike, and a leaked tracer names the
    user's lines, not jaxaot's."""
    import os
    import traceback

    package = os.path.dirname(jaxaot.__file__) + os.sep

    def bad(x: jax.Array) -> jax.Array:
        return x @ jnp.ones((4, 2))

    wrapped = wrap(bad)
    stages = ["__call__", "lower", "trace", "eval_shape", "precompile"]
    for stage in stages + (["explain"] if wrap is jaxaot.jit else []):  # (JAX's stages too)
        with pytest.raises(TypeError, match="dot_general") as info:
            getattr(wrapped, stage)(jnp.ones((2, 3)))
        frames = traceback.extract_tb(info.value.__traceback__)
        assert not [f for f in frames if f.filename.startswith(package)], (stage, frames)
        assert any(f.name == "bad" for f in frames), (stage, frames)

    leaked: list[Any] = []

    def leak(x: jax.Array) -> jax.Array:
        y = x * 2
        leaked.append(y)
        return y

    wrap(leak)(jnp.ones(3))
    with pytest.raises(jax.errors.UnexpectedTracerError) as error:
        leaked[0] + 1
    said = str(error.value)
    assert package not in said and f"{__file__}:" in said, said


@pytest.mark.parametrize("wrap", [jaxaot.jit, jaxaot.component], ids=["jit", "component"])
def test_python_flags_in_equinox_modules_that_decide_a_branch_are_named(wrap: Any) -> None:
    """An Equinox model holding ``eqx.nn.Dropout`` layers (their ``inference``
    flag a Python bool leaf) passed as ``jax.jit`` takes it: the flag is traced
    and cannot decide the branch, as under ``jax.jit`` (the same error), and a
    note names the flags and says how to keep them Python values."""
    import equinox as eqx

    class Block(eqx.Module):
        linear: eqx.nn.Linear
        drop: eqx.nn.Dropout

        def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
            return self.drop(self.linear(x), key=key)

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    model = [Block(eqx.nn.Linear(4, 4, key=k), eqx.nn.Dropout(0.1)) for k in keys]

    def loss(model: list[Any], x: jax.Array, key: jax.Array) -> jax.Array:
        for block in model:
            x = block(x, key)
        return x.sum()

    args = (model, jnp.ones(4), jax.random.PRNGKey(1))
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(loss)(*args)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        wrap(loss)(*args)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "args[0][0].drop.inference" in notes and "eqx.partition" in notes, notes


@pytest.mark.parametrize("static", [False, True])
def test_a_shape_dtype_struct_argument_is_refused_by_its_path(static: bool) -> None:
    """A ``jax.ShapeDtypeStruct`` in a call (meant for ``precompile``): one
    ``TypeError`` naming the argument, before anything is compiled (it compiled,
    then failed inside JAX's argument handling)."""
    f = jaxaot.jit(lambda x, n=2: x * n, static_argnums=(1,) if static else ())
    args = (
        (jax.ShapeDtypeStruct((3,), jnp.float32), 2)
        if static
        else (jax.ShapeDtypeStruct((3,), jnp.float32),)
    )
    before = jaxaot.stats()["compiles"]
    with pytest.raises(TypeError, match=r"path x is a ShapeDtypeStruct.*precompile"):
        f(*args)
    assert jaxaot.stats()["compiles"] == before
    # Where they belong, they are welcome.
    f.precompile(*args)
    assert "jaxaot.jit" in f.explain(*args)


def test_a_python_branch_on_a_traced_value_names_the_component() -> None:
    """A Python ``if`` on a traced value in a component's body: JAX's own error
    (which names the function and the argument it depends on), and which
    component it is in."""

    def branchy(x: jax.Array) -> jax.Array:
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(jax.errors.TracerBoolConversionError) as raised:
        jaxaot.component(branchy)(jnp.ones(3))
    assert "depends on the value of the argument x" in str(raised.value)
    assert "(in jaxaot.component 'branchy')" in getattr(raised.value, "__notes__", [])


def test_a_leaked_tracer_gets_jax_jits_error() -> None:
    """A program that closes over a tracer of a trace that has ended raises
    ``jax.jit``'s UnexpectedTracerError, which says where it leaked (before,
    jaxaot.jit compiled the program with the tracer as one more input, then
    failed to call it with a pytree mismatch)."""
    leaked: list[jax.Array] = []

    def leaky(x: jax.Array) -> jax.Array:
        leaked.append(x)
        return x * 2

    x = jnp.ones(2)
    jax.jit(leaky)(x)
    errors = []
    for wrap in (jax.jit, jaxaot.jit):
        with jaxaot.using_cache(jaxaot.MemoryCache()), pytest.raises(Exception) as info:
            wrap(lambda y: y + leaked[-1])(x)
        errors.append(info.value)
    assert type(errors[1]) is type(errors[0]) is jax.errors.UnexpectedTracerError
    assert "leaky" in str(errors[1])


@pytest.mark.parametrize(
    "options",
    [{"static_argnames": "nn"}, {"static_argnums": 5}],
    ids=["static_argnames", "static_argnums"],
)
def test_bad_options_name_the_function_at_decoration(options: dict[str, Any]) -> None:
    """jax.jit's own error for options that do not fit the function, with the
    component or jaxaot.jit function named."""

    def scaled(x: jax.Array, n: int) -> jax.Array:
        return x * n

    with pytest.raises(ValueError) as want:
        jax.jit(scaled, **options)
    for wrap, who in ((jaxaot.jit, "jaxaot.jit"), (jaxaot.component, "jaxaot.component")):
        with pytest.raises(ValueError) as got:
            wrap(scaled, **options)
        assert str(got.value) == f"{who} 'scaled': {want.value}"


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"blocks": [dict]}, TypeError, "built-in type dict"),
        ({"whole_program": "yes"}, TypeError, "whole_program must be a bool"),
        ({"auto_regions": None}, TypeError, "auto_regions must be a bool"),
        ({"keep_unused": True}, ValueError, "keep_unused=True is not supported"),
        ({"compiler_options": {"xla_cpu_enable_fast_math": True}}, ValueError, "XLA_FLAGS"),
    ],
)
def test_options_jaxaot_jit_cannot_honour_are_refused_when_decorating(
    options: dict[str, Any], error: type[Exception], words: str
) -> None:
    """Refused where the function is decorated, saying why (before, ``blocks=[dict]``
    fell back to plain jax.jit at its first call and a non-bool was taken as one;
    jax.jit's ``keep_unused`` and ``compiler_options`` were unknown keywords)."""
    with pytest.raises(error, match=words):
        jaxaot.jit(lambda x: x * 2, **options)


def test_inline_is_taken_as_jax_jit_takes_it() -> None:
    """Inside another trace, a jaxaot.jit function with ``inline=True`` is what
    ``jax.jit`` makes of it (inlined where the installed JAX inlines it)."""

    def double(x: jax.Array) -> jax.Array:
        return x * 2

    x = jnp.arange(3.0)
    inner, plain = jaxaot.jit(double, inline=True), jax.jit(double, inline=True)
    with jaxaot.using_cache(jaxaot.MemoryCache()):
        np.testing.assert_array_equal(inner(x), x * 2)
        got = str(jax.make_jaxpr(lambda v: inner(v) + 1)(x))
    assert got == str(jax.make_jaxpr(lambda v: plain(v) + 1)(x))
    assert got != str(jax.make_jaxpr(lambda v: jax.jit(double)(v) + 1)(x)) or "jit[" in got


def test_a_library_modules_function_field_leads_with_the_advice_that_works() -> None:
    """An Equinox model passed whole, holding an ``eqx.nn.MaxPool2d`` (whose
    ``operation`` is a function, in Equinox's own class): neither marking the
    field static (not the user's class) nor making the model static (it holds
    arrays) works, so the message leads with splitting the model, and that
    advice, followed, gives eqx.filter_jit's value."""
    model = eqx.nn.Sequential(
        [eqx.nn.Conv2d(3, 4, 3, key=jax.random.key(0)), eqx.nn.MaxPool2d(2, 2)]
    )
    x = jnp.ones((3, 8, 8))

    def f(m: Any, x: jax.Array) -> jax.Array:
        return m(x).sum()  # type: ignore[no-any-return]

    text = _message(jaxaot.jit(f), model, x)
    assert "at path m.layers[1].operation is a function" in text, text
    assert "not an array. It is a field of a module: split the module" in text, text
    assert "Pass arrays, or mark the argument static" not in text, text
    params, static = eqx.partition(model, eqx.is_array)
    split = jaxaot.jit(lambda p, s, x: f(eqx.combine(p, s), x), static_argnums=1)
    np.testing.assert_allclose(split(params, static, x), eqx.filter_jit(f)(model, x), rtol=1e-6)


def test_a_function_field_outside_equinox_gets_no_equinox_advice() -> None:
    """A function in a ``flax.struct`` dataclass, with Equinox imported too: the
    message says to mark the field static as Flax does, not to split an Equinox
    module."""
    import flax.struct

    @flax.struct.dataclass
    class Params:
        w: jax.Array
        act: Any

    def f(p: Any, x: jax.Array) -> jax.Array:
        return p.act(x * p.w)  # type: ignore[no-any-return]

    text = _message(jaxaot.jit(f), Params(jnp.ones(3), jax.nn.gelu), jnp.ones(3))
    assert "at path p.act is a function" in text, text
    assert "flax.struct.field(pytree_node=False)" in text and "eqx.partition" not in text, text
