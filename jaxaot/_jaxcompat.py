"""Every use of JAX internals (``jax._src``) in jaxaot lives in this module.

A JAX upgrade should only ever need changes here. The names re-exported below
are the small surface jaxaot depends on: defining a primitive with abstract
evaluation, lowering, batching, JVP and transpose rules; merging a StableHLO
module into the module being lowered; and a few facts about the backend.

Supported JAX: 0.10.2 through 0.12.x (``SUPPORTED_JAX``). The differences
between those versions are all handled here, keyed on the installed version
(``JAX_VERSION``):

* 0.11.1 changed the linearization-rule protocol: a rule returns five values
  (``out, nonzeros, residuals, structured_residuals, linearized``) and JAX calls
  ``linearized(residuals, structured_residuals, *tangents)``; jaxaot's rules use
  the four-value form, adapted by ``register_linearization``.
* 0.11.1 replaced the ``closed_call``/``core_call`` primitives by ``eval_jaxpr``
  (its body in the ``call_jaxpr`` parameter): see ``CALL_PRIMITIVES`` and
  ``call_body``.
* 0.11 merged ``ClosedJaxpr`` into ``Jaxpr`` (a ``Jaxpr`` carries its consts;
  ``Jaxpr(jaxpr, consts)`` still builds a closed one) and 0.12 removed the
  ``ClosedJaxpr`` name: ``ClosedJaxpr`` here is whichever class closes a jaxpr.
* 0.11.2 computes tanh's derivative with a ``one_minus_square`` primitive:
  ``ELEMENTWISE_ARITHMETIC`` lists it with the other cheap elementwise ops.
* Newer JAX puts a layout on every type, ``AutoLayout`` by default: an instance
  that compares by identity, of a class that pickling or copying instantiates
  again. The outputs of an executable loaded from its serialization (a warm
  process) then have types unequal to the same types of any other array, and
  every signature built from them misses. ``_one_auto_layout`` keeps it one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from ._versions import SUPPORTED_JAX, check_supported  # noqa: E402

JAX_VERSION = check_supported(jax.__version__)

from jax._src import core as _core  # noqa: E402
from jax._src import dispatch as _dispatch  # noqa: E402
from jax._src import effects as _effects  # noqa: E402
from jax._src import xla_bridge as _xb  # noqa: E402
from jax._src.ad_util import Zero  # noqa: E402
from jax._src.callback import io_callback_p, pure_callback_p  # noqa: E402
from jax._src.debugging import debug_callback_p  # noqa: E402
from jax._src.interpreters import ad, batching, mlir  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax._src.lib.mlir.dialects import func as func_dialect  # noqa: E402

__all__ = [
    "CALL_PRIMITIVES",
    "ELEMENTWISE_ARITHMETIC",
    "JAX_VERSION",
    "Primitive",
    "SUPPORTED_JAX",
    "ShapedArray",
    "Tracer",
    "Zero",
    "ad",
    "apply_primitive",
    "batching",
    "call_module_function",
    "call_body",
    "canonical_platform",
    "default_platform",
    "has_host_callbacks",
    "inline_jaxpr_lowering",
    "is_ordered_effect",
    "jaxpr_as_fun",
    "mlir",
    "module_to_bytecode",
    "not_mapped",
    "register_linearization",
    "register_lowering",
    "trace_state_clean",
]

Primitive = _core.Primitive
ShapedArray = _core.ShapedArray
Tracer = _core.Tracer
# 0.10: ClosedJaxpr(jaxpr, consts) wraps a Jaxpr; 0.11+: a Jaxpr carries its
# consts and Jaxpr(jaxpr, consts) builds the closed one (0.12 drops the name).
ClosedJaxpr: Any = getattr(_core, "ClosedJaxpr", _core.Jaxpr)
Jaxpr = _core.Jaxpr
Literal = _core.Literal
DropVar = _core.DropVar
join_effects = _core.join_effects
jaxprs_in_params = _core.jaxprs_in_params
jaxpr_as_fun = _core.jaxpr_as_fun
trace_state_clean = _core.trace_state_clean
not_mapped = None  # batching.NotMapped is type(None): unmapped dims are None
apply_primitive = _dispatch.apply_primitive
module_to_bytecode = mlir.module_to_bytecode
LoweringRuleContext = mlir.LoweringRuleContext


def _one_auto_layout() -> None:
    """Makes JAX's ``AutoLayout`` one object however it is made (unpickled with
    an executable's metadata, copied), equal to and hashing as itself: the
    singleton JAX means it to be. Nothing to do where JAX has no such class."""
    try:
        from jax._src import layout as _layout
    except ImportError:  # pragma: no cover - a JAX without layouts
        return
    cls = getattr(_layout, "AutoLayoutSingleton", None)
    one = getattr(_layout, "AutoLayout", None)
    if cls is None or not isinstance(one, cls):
        return
    # Unpickling and copying make it through ``__new__``; instances made before
    # this ran compare and hash as the one.
    cls.__new__ = lambda c, *args, **kwargs: one  # type: ignore[method-assign, assignment]
    cls.__eq__ = lambda self, other: isinstance(other, cls)  # type: ignore[method-assign, assignment]
    cls.__hash__ = lambda self: hash(cls)  # type: ignore[method-assign, assignment]


_one_auto_layout()

_CALLBACK_PRIMITIVES = frozenset([pure_callback_p, io_callback_p, debug_callback_p])
_CALLBACK_NAMES = frozenset(["debug_print", "debug_callback", "pure_callback", "io_callback"])


def _is_callback(primitive: Any) -> bool:
    name = getattr(primitive, "name", "")
    return primitive in _CALLBACK_PRIMITIVES or name in _CALLBACK_NAMES or name.endswith("callback")


# Platform names as lowering uses them ("cuda", not "gpu").
KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def canonical_platform(platform: str) -> str:
    """Maps a backend or device platform name ("gpu", "cuda", "cpu") to its lowering name."""
    try:
        return _xb.canonicalize_platform(platform)
    except Exception:  # an unknown platform name: keep it as given
        return platform.lower()


def default_platform() -> str:
    """The lowering platform of JAX's default backend on this machine."""
    return canonical_platform(jax.default_backend())


def _jaxprs(jaxpr: Any) -> Iterator[Any]:
    yield jaxpr
    for sub in _core.subjaxprs(jaxpr):
        yield from _jaxprs(sub)


def has_host_callbacks(closed_jaxpr: Any) -> bool:
    """Whether the jaxpr (or any jaxpr nested in it) calls back into Python."""
    for jaxpr in _jaxprs(closed_jaxpr.jaxpr):
        for eqn in jaxpr.eqns:
            if _is_callback(eqn.primitive):
                return True
    return False


def is_ordered_effect(effect: Any) -> bool:
    return _effects.ordered_effects.contains(effect)


def register_lowering(prim: Any, rule: Callable[..., Any], platform: str | None = None) -> None:
    mlir.register_lowering(prim, rule, platform=platform)


# From 0.11.1 a linearization rule returns structured residuals too.
_STRUCTURED_RESIDUALS = JAX_VERSION >= (0, 11, 1)


def register_linearization(prim: Any, rule: Callable[..., Any]) -> None:
    """Registers ``rule(is_vjp, nonzeros, *primals, **params)``, which returns
    ``(outs, out_nonzeros, residuals, linearized)`` with
    ``linearized(residuals, *tangents)``, in the protocol of the installed JAX."""
    if not _STRUCTURED_RESIDUALS:
        ad.primitive_linearizations[prim] = rule
        return

    def with_structured_residuals(is_vjp: bool, nonzeros: Any, *primals: Any, **params: Any) -> Any:
        outs, out_nonzeros, residuals, linearized = rule(is_vjp, nonzeros, *primals, **params)

        def call(residuals: Any, _structured: Any, *tangents: Any) -> Any:
            return linearized(residuals, *tangents)

        return outs, out_nonzeros, residuals, None, call

    ad.primitive_linearizations[prim] = with_structured_residuals


# Primitives that call a jaxpr (their body): inlined by jaxaot.jit and by the
# jaxpr rewrites. 0.11.1 replaced closed_call/core_call by eval_jaxpr.
CALL_PRIMITIVES = frozenset(
    ["jit", "pjit", "closed_call", "core_call", "eval_jaxpr", "checkpoint", "remat2"]
)


def call_body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of the body of a call-like equation (``CALL_PRIMITIVES``),
    or None for any other equation."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    inner = eqn.params.get("jaxpr")
    if inner is None:
        inner = eqn.params.get("call_jaxpr")
    if isinstance(inner, ClosedJaxpr):
        return inner.jaxpr, inner.consts
    if isinstance(inner, Jaxpr) and not inner.constvars:
        return inner, ()
    return None


# Elementwise arithmetic and shape-only operations: cheap to recompute, and
# fused by XLA into whatever consumes them. Transcendentals (exp, tanh, ...)
# are not listed: recomputing them costs more than reading them back.
# ``one_minus_square`` (0.11.2+: 1 - x**2, in tanh's derivative) is arithmetic.
ELEMENTWISE_ARITHMETIC = frozenset(
    [
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "integer_pow",
        "square",
        "one_minus_square",
        "max",
        "min",
        "select_n",
        "convert_element_type",
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "eq",
        "ne",
        "lt",
        "gt",
        "le",
        "ge",
        "and",
        "or",
        "not",
        "abs",
        "sign",
        "copy",
    ]
)


def lowering_platforms(ctx: Any) -> tuple[str, ...]:
    """The platforms the enclosing lowering targets."""
    return tuple(ctx.module_context.platforms)


def call_module_function(
    ctx: Any, cache_key: Any, bytecode: bytes, name_hint: str, args: Sequence[Any]
) -> Sequence[Any]:
    """Links a serialized StableHLO module into the module being lowered, once per
    ``cache_key``, and emits a ``func.call`` to its main function."""
    module_ctx = ctx.module_context
    cached = module_ctx.cached_primitive_lowerings
    symbol = cached.get(cache_key)
    if symbol is None:
        with module_ctx.context:
            submodule = ir.Module.parse(bytecode)
        symbol = mlir.merge_mlir_modules(
            module_ctx.module, name_hint, submodule, dst_symtab=module_ctx.symbol_table
        )
        cached[cache_key] = symbol
    func_op = module_ctx.symbol_table[symbol]
    result_types = list(func_op.type.results)
    call = func_dialect.CallOp(result_types, ir.FlatSymbolRefAttr.get(symbol), list(args))
    return list(call.results)


def inline_jaxpr_lowering(ctx: Any, closed_jaxpr: Any, args: Sequence[Any]) -> Sequence[Any]:
    """Lowers a jaxpr into the module being lowered (used for process-local entries,
    e.g. those holding host callbacks, which must register with the caller)."""
    rule = mlir.lower_fun(jaxpr_as_fun(closed_jaxpr), multiple_results=True)
    return rule(ctx, *args)


def serialize_executable(compiled: Any) -> tuple[bytes, Any, Any]:
    """(payload, in_tree, out_tree) of a ``jax.stages.Compiled``."""
    from jax.experimental import serialize_executable as _se

    return _se.serialize(compiled)  # type: ignore[no-any-return]


def deserialize_executable(payload: bytes, in_tree: Any, out_tree: Any) -> Any:
    """A loaded ``jax.stages.Compiled`` from ``serialize_executable``'s payload.

    The payload is JAX's own format (it includes a pickle of the executable's
    metadata): call this only on bytes whose checksum or signature verified."""
    from jax.experimental import serialize_executable as _se

    return _se.deserialize_and_load(payload, in_tree, out_tree)


def batch_jaxpr(
    closed_jaxpr: Any, axis_data: Any, in_axes: Sequence[int | None]
) -> tuple[Any, list[int | None]]:
    """The jaxpr batched along ``in_axes``, and each output's batch axis (0, or None
    for outputs that stay unbatched), exactly as ``jax.vmap`` would batch it."""
    batched, out_batched = batching.batch_jaxpr_axes(
        closed_jaxpr,
        axis_data,
        list(in_axes),
        [batching.zero_if_mapped] * len(closed_jaxpr.out_avals),
    )
    return batched, [0 if b else None for b in out_batched]


def component_calls_in(jaxpr: Any) -> int:
    """How many ``jaxaot_component`` equations ``jaxpr`` holds, nested jaxprs included."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return sum(
        1 for j in _jaxprs(jaxpr) for eqn in j.eqns if eqn.primitive.name == "jaxaot_component"
    )


def partial_eval_jaxpr(
    closed_jaxpr: Any, unknowns: Sequence[bool], instantiate: Sequence[bool]
) -> tuple[Any, Any, list[bool], list[Any]]:
    """Splits a jaxpr into the part computable from the known inputs (which also
    returns residuals, last) and the part that needs the unknown ones (which
    takes the residuals first)."""
    return _pe.partial_eval_jaxpr_nounits(closed_jaxpr, list(unknowns), list(instantiate))


def cpp_dispatcher(name: str, cache_miss: Callable[..., Any]) -> Callable[..., Any]:
    """A C++ dispatcher (as ``jax.jit`` uses) over many executables: calls with a
    signature it has seen run in C++; the others go to ``cache_miss``, which
    returns ``(outputs, fastpath_data_or_None, False)`` (see ``fastpath_miss``)."""
    from jax._src import tree_util as _tree_util
    from jax._src.interpreters import pxla as _pxla
    from jax._src.lib import _jax

    return _jax.pjit(  # type: ignore[no-any-return]
        name,
        None,
        cache_miss,
        [],
        [],
        _pxla.JitGlobalCppCacheKeys(),
        _tree_util.dispatch_registry,
        _pxla.cc_shard_arg,
    )


def fastpath_miss(
    compiled: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Any, Any, bool]:
    """Runs ``compiled`` and returns what a C++ dispatcher's cache miss returns, with
    the executable's fast-path data when it has some (so later calls stay in C++)."""
    call = getattr(compiled, "_call", None)
    if call is None and hasattr(compiled, "_executable") and hasattr(compiled, "_params"):
        call = compiled._executable.create_cpp_call(compiled._params)
        if call is not None:
            compiled._call = call
    miss = getattr(call, "_cache_miss", None)
    if miss is None:
        return compiled(*args, **kwargs), None, False
    return miss(*args, **kwargs)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------
# Tracing context (issue 11): what jax.jit's own caches key on.


def trace_context() -> Any:
    """The configuration state ``jax.jit``'s caches key on (x64, matmul precision,
    dtype and rank promotion, PRNG implementation, the axis environment, ...):
    hashable, for in-process tables."""
    from jax._src import config as _config

    return _config.trace_context()


def _context_part(value: Any) -> Any:
    import enum

    from ._key import strip_addresses

    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return tuple(_context_part(v) for v in value)
    from ._sharding import value_text

    mesh = value_text(value)
    if mesh is not None:  # the mesh in context (``jax.set_mesh``, ``use_abstract_mesh``)
        return mesh
    sizes = getattr(value, "axis_sizes", None)
    if sizes is not None:  # the axis environment: named axes in scope
        return (
            "axis_env",
            tuple(sorted((str(k), int(v)) for k, v in dict(sizes).items())),
            tuple(sorted(str(n) for n in getattr(value, "spmd_axis_names", ()) or ())),
            tuple(sorted(str(n) for n in getattr(value, "explicit_mesh_axis_names", ()) or ())),
        )
    return strip_addresses(f"{type(value).__name__}:{value!r}")


def trace_context_parts() -> tuple[tuple[str, Any], ...]:
    """:func:`trace_context` as a key part, option by option (``(name, value)``
    pairs): the same in every process."""
    from jax._src import config as _config

    names = getattr(_config, "trace_context_names", ())
    names = tuple(names() if callable(names) else names)
    values = tuple(trace_context())
    return tuple(
        (str(names[i]) if i < len(names) else f"context[{i}]", _context_part(v))
        for i, v in enumerate(values)
    )


def axis_data_parts(axis_data: Any) -> tuple[Any, ...]:
    """A vmap axis as a key part: its name (where it has one), size, ``spmd_axis_name``
    and explicit mesh axis."""

    def name(n: Any) -> Any:
        if n is None or isinstance(n, str | int):
            return n
        if isinstance(n, tuple):
            return tuple(name(x) for x in n)
        return f"<{type(n).__name__}>"  # an unnamed axis

    return (
        name(getattr(axis_data, "name", None)),
        int(axis_data.size),
        name(getattr(axis_data, "spmd_name", None)),
        name(getattr(axis_data, "explicit_mesh_axis", None)),
    )


def explicit_mesh_axes_in_scope() -> frozenset[Any]:
    """The explicit mesh axes a ``vmap`` in scope maps over (empty outside one)."""
    from jax._src import core as _core

    env = _core.get_axis_env()
    return frozenset(getattr(env, "explicit_mesh_axis_names", ()) or ())
