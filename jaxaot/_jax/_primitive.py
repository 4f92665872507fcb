"""Defining a primitive: its lowering, batching, JVP, linearization and transpose
rules; linking a serialized StableHLO module into the module being lowered; and
the jaxpr transformations (partial evaluation, batching) derived entries use."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ._internals import ad, batching, func_dialect, ir, mlir
from ._internals import checkify as _checkify
from ._internals import partial_eval as _pe
from ._jaxpr import JAX_VERSION, jaxpr_as_fun

__all__ = [
    "ad",
    "batch_jaxpr",
    "batching",
    "call_module_function",
    "inline_jaxpr_lowering",
    "lower_linkable",
    "lowering_rules",
    "lowering_platforms",
    "module_to_bytecode",
    "not_mapped",
    "prng_impl",
    "partial_eval_jaxpr",
    "register_checkify",
    "register_jet",
    "register_linearization",
    "register_lowering",
]

not_mapped = None  # batching.NotMapped is type(None): unmapped dims are None
module_to_bytecode = mlir.module_to_bytecode


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


# From 0.12 a checkify rule takes a context (the error codes handed out so far)
# first, and passes it on to ``checkify_jaxpr``.
_CHECKIFY_CONTEXT = next(iter(inspect.signature(_checkify.checkify_jaxpr).parameters)) == "ctx"


def register_checkify(prim: Any, body: Callable[..., Any]) -> None:
    """Makes ``checkify`` look into ``prim``'s equations: ``body(**params)`` is the
    closed jaxpr an equation computes, checked as ``checkify`` checks the body of
    a ``jit`` (the equation is evaluated inline, its checks discharged). Without
    a rule, ``checkify`` binds the equation unchecked and reports nothing."""

    def rule(*args: Any, **params: Any) -> Any:
        jaxpr = body(**params)
        if _CHECKIFY_CONTEXT:
            ctx, error, enabled, *vals = args
            return _checkify.checkify_jaxpr(ctx, jaxpr, enabled, error, *vals)
        error, enabled, *vals = args
        return _checkify.checkify_jaxpr(jaxpr, enabled, error, *vals)

    _checkify.error_checks[prim] = rule


def register_jet(prim: Any, body: Callable[..., Any]) -> None:
    """Makes ``jax.experimental.jet`` (Taylor series) see through ``prim``'s
    equations: ``body(**params)`` is the closed jaxpr an equation computes, whose
    series are taken as ``jet`` takes any function's."""
    from jax.experimental import jet

    def rule(primals_in: Sequence[Any], series_in: Sequence[Any], **params: Any) -> Any:
        fn = jaxpr_as_fun(body(**params))
        # (Rules see Taylor coefficients, not the factorial-scaled derivatives
        # ``jet`` takes by default.)
        primals_out, series_out = jet.jet(
            lambda *xs: tuple(fn(*xs)),
            tuple(primals_in),
            tuple(series_in),
            factorial_scaled=False,
        )
        return list(primals_out), list(series_out)

    jet.jet_rules[prim] = rule


def lowering_platforms(ctx: Any) -> tuple[str, ...]:
    """The platforms the enclosing lowering targets."""
    return tuple(ctx.module_context.platforms)


def lowering_rules(prim: Any) -> tuple[Callable[..., Any], ...]:
    """The lowering rules registered for ``prim``: its default rule, then those of
    each platform (a primitive of the user's own names its lowering only here)."""
    entries: list[Any] = [mlir._lowerings.get(prim)]
    entries += [table.get(prim) for _, table in sorted(mlir._platform_specific_lowerings.items())]
    # (Each an entry holding the rule; a bare rule in older JAX.)
    return tuple(getattr(e, "rule", e) for e in entries if e is not None)


def prng_impl(dtype: Any) -> Any | None:
    """The PRNG implementation of a typed key dtype (``key<fry>``), or ``None``."""
    if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return getattr(dtype, "_impl", None)


def lower_linkable(traced: Any, platform: str) -> Any:
    """``traced`` (a ``jax.stages.Traced``) lowered for ``platform`` into a module
    that holds its constants. By default JAX (0.12, or with
    ``jax_use_simplified_jaxpr_constants``) passes constants over
    ``jax_embedded_constants_max_bytes`` (an array a function closes over) to
    the module's main function as arguments, which a caller linking the module
    (:func:`call_module_function`) would not pass; ``jax.export`` keeps them in
    the module for the same reason."""
    return traced.lower(
        lowering_platforms=(platform,),
        _private_parameters=mlir.LoweringParameters(hoist_constants_as_args=False),
    )


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
    return rule(ctx, *args)  # type: ignore[no-any-return]


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


def partial_eval_jaxpr(
    closed_jaxpr: Any, unknowns: Sequence[bool], instantiate: Sequence[bool]
) -> tuple[Any, Any, list[bool], list[Any]]:
    """Splits a jaxpr into the part computable from the known inputs (which also
    returns residuals, last) and the part that needs the unknown ones (which
    takes the residuals first)."""
    return _pe.partial_eval_jaxpr_nounits(closed_jaxpr, list(unknowns), list(instantiate))  # type: ignore[no-any-return]
