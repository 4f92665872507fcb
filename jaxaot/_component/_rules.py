"""The ``jaxaot_component`` primitive and how it behaves under every transformation.

One equation ``jaxaot_component[call=...]`` stands for a call of one cache
entry. Its parameter ``call`` (a ``_component.Call``) carries the entry's key,
its output avals and a way to derive the entries of transformed versions:

* abstract evaluation reads the output avals from the entry (no tracing);
* lowering links the entry's cached StableHLO into the module being lowered,
  once per module, and emits ``func.call``; the platform is the enclosing
  lowering's (one entry per platform, and a ``case`` over platforms when the
  caller lowers for several);
* batching binds a derived *vmap* entry; JVP binds the entry itself for the
  primal outputs and a derived *JVP* entry, linear in the tangents, for the
  tangent outputs; transposing that binds a derived *transpose* entry. Derived
  entries are cached like any other, so transformations of a cached component
  do not trace its body.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _stats
from .._jax import (
    KNOWN_PLATFORMS,
    Primitive,
    Zero,
    ad,
    apply_primitive,
    batching,
    call_module_function,
    has_host_callbacks,
    inline_jaxpr_lowering,
    lowering_platforms,
    not_mapped,
    register_checkify,
    register_jet,
    register_linearization,
    register_lowering,
)
from .._keys._program import sees_masks
from ._flat import flat_executable, runs_flat
from ._plain import device_witness

__all__ = ["PREFETCH", "bind", "component_p", "in_regional_trace", "naming"]

component_p = Primitive("jaxaot_component")
component_p.multiple_results = True


# Set by jaxaot.jit while it traces a program: called with the forward and
# transposed calls that autodiff binds, so that their executables start
# compiling while the rest of the program is still being traced.
PREFETCH: contextvars.ContextVar[Callable[[Any], None] | None] = contextvars.ContextVar(
    "jaxaot_prefetch", default=None
)

# The component whose own top-level executable is being lowered now: its body
# inlined there is the executable itself (cached, callbacks rebound), not a
# caller's program.
OWN_LOWERING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxaot_own_lowering", default=None
)


def in_regional_trace() -> bool:
    """Whether ``jaxaot.jit`` is tracing the program now (its split compiles each
    component for the shardings its inputs have)."""
    return PREFETCH.get() is not None


def _prefetch(call: Any) -> None:
    prefetch = PREFETCH.get()
    if prefetch is not None:
        prefetch(call)


def bind(call: Any, args: Sequence[Any]) -> list[Any]:
    """Binds a call of ``call``'s entry; where the computation names devices, the
    equation carries their witness (``devices``, see ``_plain``), which JAX's
    device assignment reads as it would read the computation itself."""
    if call.devices:
        return list(component_p.bind(*args, call=call, devices=device_witness(call.devices)))
    return list(component_p.bind(*args, call=call))


_RENAMEABLE = (
    TypeError,
    ValueError,
    NameError,
    AssertionError,
    RuntimeError,
    NotImplementedError,
    ZeroDivisionError,
)


def naming(error: Exception, name: str, kind: str = "jaxaot.component") -> Exception:
    """``error`` with the component's (or ``kind``'s: ``jaxaot.jit``) name in its
    message: a new exception of the same type for the common built-in types,
    else ``error`` with a note."""
    prefix = f"{kind} {name!r}"
    if str(error).startswith(prefix):
        return error
    if type(error) in _RENAMEABLE or (
        isinstance(error, _RENAMEABLE) and type(error).__module__.startswith("jax")
    ):
        try:
            return type(error)(f"{prefix}: {error}")
        except Exception:  # an exception type that takes other arguments
            pass
    error.add_note(f"(in {prefix})")
    return error


def _impl(*args: Any, call: Any, devices: Any = None) -> Any:
    # A transformed call run eagerly (``jax.grad(component)(x)`` outside jax.jit):
    # its entry's flat executable, from this process or the cache (as a jaxaot.jit
    # region runs it); placed otherwise, JAX compiles it op by op, not from
    # jaxaot's cache (counted as a compile).
    if devices is None:
        args = _placed(args, call.entry.in_avals)
        if runs_flat(call, args):
            return flat_executable(call, lambda *a: bind(call, a), call.key)(*args)
    with _stats.eager():
        if devices is None:
            return apply_primitive(component_p, *args, call=call)
        return apply_primitive(component_p, *args, call=call, devices=devices)


def _placed(args: tuple[Any, ...], avals: Sequence[Any]) -> tuple[Any, ...]:
    """``args`` with the Python scalars and NumPy values among them (a number an
    eager ``vmap`` or ``grad`` passes on as it is) put on the default device as
    arrays of the entry's input types, weak types included, so that the call
    runs the entry's cached executable; each other value as it is."""
    if all(isinstance(a, jax.Array) for a in args):
        return args
    placed = []
    for a, aval in zip(args, avals, strict=True):
        if not isinstance(a, jax.Array) and isinstance(
            a, bool | int | float | complex | np.ndarray | np.generic
        ):
            array = jax.device_put(a)
            got = jax.typeof(array)
            if (got.shape, got.dtype, got.weak_type) == (aval.shape, aval.dtype, aval.weak_type):
                a = array
        placed.append(a)
    return tuple(placed)


def _abstract_eval(*avals: Any, call: Any, devices: Any = None) -> tuple[list[Any], Any]:
    entry = call.entry
    for i, (got, want) in enumerate(zip(avals, entry.in_avals, strict=True)):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise TypeError(
                f"jaxaot.component {call.name!r}: input {i} "
                f"({call.arg_name(i)}) has type {got.str_short()}, "
                f"but the entry was made for {want.str_short()}"
            )
    return list(entry.out_avals), entry.effects


component_p.def_impl(_impl)
component_p.def_effectful_abstract_eval(_abstract_eval)


def _lower(
    ctx: Any, *args: Any, call: Any, devices: Any = None, platform: str | None = None
) -> Sequence[Any]:
    if platform is None:
        platforms = lowering_platforms(ctx)
        if len(platforms) != 1:
            raise NotImplementedError(
                f"jaxaot.component {call.name!r}: no lowering for platforms {platforms}"
            )
        platform = platforms[0]
    entry = call.entry_for_platform(platform)
    if entry.stablehlo is None:
        if entry.jaxpr is None:
            raise RuntimeError(f"jaxaot.component {call.name!r}: entry has no lowering")
        if (
            entry.host_callbacks
            and OWN_LOWERING.get() != call.name
            and hasattr(call.component, "__wrapped__")  # a user's component, not a block
            and not in_regional_trace()
            and has_host_callbacks(entry.jaxpr)
        ):
            # Its StableHLO would hold this process's callbacks: linked into a
            # caller, it is lowered with the caller's program in every process.
            _stats.warn_once(
                f"callbacks-inlined:{call.name}",
                f"jaxaot: component {call.name!r} calls the host (jax.debug.print, "
                "pure_callback, io_callback, Equinox checks): inside jax.jit it is "
                "lowered and compiled with its caller in each process, not loaded from "
                "the cache; its top-level calls, and jaxaot.jit programs that call it, "
                "are cached",
            )
        try:
            return inline_jaxpr_lowering(ctx, entry.jaxpr, args)
        except Exception as e:
            raise naming(e, call.name) from e
    name = "jaxaot_" + "".join(c if c.isalnum() else "_" for c in call.name)[:48]
    return call_module_function(ctx, ("jaxaot", entry.key), entry.stablehlo, name, args)


register_lowering(component_p, _lower)
for _platform in KNOWN_PLATFORMS:
    try:
        register_lowering(component_p, functools.partial(_lower, platform=_platform), _platform)
    except NotImplementedError:  # a platform this jaxlib does not know
        pass


def _body(call: Any, devices: Any = None) -> Any:
    return call.jaxpr()


# Under ``checkify`` and ``jax.experimental.jet`` a call is its body, evaluated
# inline (not from the cache), so that checks inside it (NaNs, indices,
# ``checkify.check``) are reported, and series taken, as in a ``jax.jit``.
register_checkify(component_p, _body)
register_jet(component_p, _body)


def _batch(
    axis_data: Any, vals: Sequence[Any], dims: Sequence[Any], *, call: Any, devices: Any = None
) -> Any:
    in_axes = tuple(None if d is not_mapped else int(d) for d in dims)
    if all(d is None for d in in_axes):
        outs = bind(call, vals)
        return outs, [not_mapped] * len(outs)
    derived = call.vmap(axis_data, in_axes, vals)
    outs = bind(derived, vals)
    out_axes = derived.entry.extra["out_axes"]
    return outs, [not_mapped if d is None else int(d) for d in out_axes]


batching.fancy_primitive_batchers[component_p] = _batch


def _is_differentiable(aval: Any) -> bool:
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, call: Any, devices: Any = None) -> Any:
    outs = bind(call, primals)
    out_avals = call.entry.out_avals
    zeros = [Zero(a.to_tangent_aval()) for a in out_avals]
    mask = tuple(type(t) is not Zero for t in tangents)
    if not any(mask) or not any(_is_differentiable(a) for a in out_avals):
        return outs, zeros
    live = [t for t, m in zip(tangents, mask, strict=True) if m]
    derived = call.jvp(mask, [*primals, *live])
    it = iter(bind(derived, [*primals, *live]))
    out_tangents = [
        next(it) if _is_differentiable(a) else z for a, z in zip(out_avals, zeros, strict=True)
    ]
    return outs, out_tangents


ad.primitive_jvps[component_p] = _jvp


def _linearize(
    is_vjp: bool, nonzeros: Sequence[bool], *primals: Any, call: Any, devices: Any = None
) -> Any:
    """Direct linearization (grad, vjp, linearize): a derived *forward* entry gives
    the primal outputs and the residuals, and a derived *linear* entry maps
    residuals and tangents to output tangents. Reverse mode then transposes the
    linear entry alone, so the backward pass never recomputes the forward one."""
    in_avals = call.entry.in_avals
    out_avals = call.entry.out_avals
    live_any = any(
        bool(nz) and _is_differentiable(a.to_tangent_aval())
        for nz, a in zip(nonzeros, in_avals, strict=True)
    )
    # Every differentiable input gets a tangent slot, whether or not this call
    # differentiates it (zeros are passed): calls that differ only in which
    # inputs they differentiate (the first layer of a network, say) share one
    # forward, one linear and one transposed entry, compiled once.
    mask = tuple(_is_differentiable(a.to_tangent_aval()) for a in in_avals)
    if sees_masks(call.key):
        # A custom rule of the program sees which inputs are differentiated: only
        # those JAX differentiates are (their entries are keyed by what they compute).
        mask = tuple(m and bool(nz) for m, nz in zip(mask, nonzeros, strict=True))
    diff = [_is_differentiable(a) for a in out_avals]
    zeros = [Zero(a.to_tangent_aval()) for a in out_avals]
    if not live_any or not any(diff):
        outs = bind(call, primals)

        def no_tangents(residuals: Sequence[Any], *tangents: Any) -> list[Any]:
            return list(zeros)

        return outs, [False] * len(outs), [], no_tangents
    fwd, make_lin = call.linearize(mask, primals)
    _prefetch(fwd)
    results = bind(fwd, primals)
    outs = results[: len(out_avals)]
    residuals = _residuals(results[len(out_avals) :], primals, fwd.entry.extra.get("forwarded"))
    lin = make_lin(residuals)

    def linearized(residuals: Sequence[Any], *tangents: Any) -> list[Any]:
        live = [t for t, m in zip(tangents, mask, strict=True) if m]
        live = [ad.instantiate_zeros(t) for t in live]
        it = iter(bind(lin, [*residuals, *live]))
        return [next(it) if d else z for d, z in zip(diff, zeros, strict=True)]

    return outs, diff, residuals, linearized


register_linearization(component_p, _linearize)


def _residuals(
    returned: Sequence[Any], primals: Sequence[Any], forwarded: Sequence[Sequence[int]] | None
) -> list[Any]:
    """The linear entry's residuals: those the forward entry returned, with the
    forward entry's inputs that are residuals too (``[position, input]`` pairs of
    ``forwarded``) put in their places."""
    taken = {int(i): primals[int(q)] for i, q in forwarded or ()}
    rest = iter(returned)
    return [taken[i] if i in taken else next(rest) for i in range(len(returned) + len(taken))]


def _transpose(cts: Sequence[Any], *args: Any, call: Any, devices: Any = None) -> list[Any]:
    undefined = tuple(ad.is_undefined_primal(a) for a in args)
    if all(type(ct) is Zero for ct in cts):
        return [Zero(a.aval) if u else None for a, u in zip(args, undefined, strict=True)]
    # A linear entry is linear in all its tangent slots: transpose with respect to
    # all of them (a slot given zeros just has its cotangent dropped), so that
    # every use shares one transposed entry.
    linear_from = call.entry.extra.get("linear_from")
    wrt = tuple(
        u or (linear_from is not None and i >= linear_from) for i, u in enumerate(undefined)
    )
    defined = [a for a, w in zip(args, wrt, strict=True) if not w]
    live = None
    if sees_masks(call.key):
        # A custom rule of the program sees which cotangents are zero: the zero
        # ones are left out, as JAX leaves them symbolic.
        live = tuple(type(ct) is not Zero for ct in cts)
        cts = [ct for ct in cts if type(ct) is not Zero]
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    derived = call.transpose(wrt, [*defined, *cts], live)
    _prefetch(derived)
    it = iter(bind(derived, [*defined, *cts]))
    out = []
    for u, w in zip(undefined, wrt, strict=True):
        ct = next(it) if w else None
        out.append(ct if u else None)
    return out


ad.primitive_transposes[component_p] = _transpose
