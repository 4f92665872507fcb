"""One call of a cache entry, and the entries of its transformations.

A :class:`Call` is the parameter of one ``jaxaot_component`` equation: the
entry's key and the entry, and how to derive the entries of its vmap, JVP,
linearization (a forward entry returning residuals and a linear entry) and
transpose, each cached like any other entry under a key that holds the whole
lineage (``_parts.derived_key``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from .._jax import (
    CUSTOM_VJP_PRIMITIVES,
    batch_jaxpr,
    jaxpr_as_fun,
    named,
    partial_eval_jaxpr,
    uses_primitive,
)
from .._keys._context import axis_data_parts
from .._keys._key import ComponentKey
from .._keys._program import program_digest, sees_masks
from .._store._entry import Entry
from .._store._lookup import Store
from ._cost import recomputes
from ._parts import derived_key
from ._plain import Devices
from ._rewrites import forwarded_inputs, fuse_dot_transposes, prune_residuals, residual_layout
from ._types import aval_of, is_differentiable, sds, traced_under

__all__ = ["Call", "EntryMaker"]

#: A component's derived programs keyed by what they compute (see
#: ``Call._derive``): their digests by parent key, transformation and input
#: types; past the bound the oldest are forgotten (traced again when derived).
_MAX_DERIVED_PROGRAMS = 4096
_DERIVED_LOCK = threading.Lock()


def _derived_programs(component: Any) -> dict[tuple[Any, ...], str]:
    """``component``'s digests of derived programs (a new table where it cannot
    hold one: traced each time)."""
    with _DERIVED_LOCK:
        try:
            found: dict[tuple[Any, ...], str] = vars(component).setdefault(
                "_jaxaot_derived_programs", {}
            )
        except TypeError:  # no __dict__
            found = {}
    return found


class EntryMaker(Protocol):
    """What made a call's entry, and makes its derived entries: a component."""

    name: str
    store: Store

    def make_entry(self, key: ComponentKey, trace: Callable[[], Any], name: str) -> Entry:
        """The entry for ``key`` from ``trace()`` (a ``jax.stages.Traced``), named ``name``."""
        ...


class Call:
    """The parameter of one ``jaxaot_component`` equation: one cache entry and how to
    derive the entries of its transformations. Equal when the keys are equal."""

    __slots__ = ("component", "key", "entry", "devices", "_trace", "_linearized")

    def __init__(
        self,
        component: EntryMaker,
        key: ComponentKey,
        entry: Entry,
        trace: Callable[[], Any],
        devices: Devices = (),
    ) -> None:
        self.component = component
        self.key = key
        self.entry = entry
        # The devices the computation names (its derived computations name the same).
        self.devices = devices
        self._trace = trace  # traces this computation afresh: a jax.stages.Traced
        self._linearized: dict[tuple[tuple[bool, ...], bool], tuple[Any, Any]] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Call) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"{self.name}@{self.key.digest[:12]}"

    @property
    def name(self) -> str:
        return self.entry.name

    def arg_name(self, i: int) -> str:
        names = self.entry.arg_names
        return f"argument {names[i]!r}" if i < len(names) and names[i] else f"flat input {i}"

    def jaxpr(self) -> Any:
        """This computation's closed jaxpr: kept from this process's trace, else
        traced again (for a root entry loaded from a cache, that runs the body)."""
        if self.entry.jaxpr is not None:
            return self.entry.jaxpr
        closed = self._trace().jaxpr
        self.entry.jaxpr = closed
        return closed

    def fn(self) -> Callable[..., Sequence[Any]]:
        """This computation as a flat callable."""
        return jaxpr_as_fun(self.jaxpr())  # type: ignore[no-any-return]

    def entry_for_platform(self, platform: str) -> Entry:
        if self.key.parts["platforms"] == (platform,):
            return self.entry
        key = self.key.replace(platforms=(platform,))
        base = self.entry

        def trace() -> Any:
            # From the jaxpr this process already has: the body is not run again.
            fn = named(self.fn(), base.name)
            with traced_under(base.in_avals):
                return jax.jit(fn, keep_unused=True).trace(*[sds(a) for a in base.in_avals])

        def build() -> Entry:
            entry = self.component.make_entry(key, trace, base.name)
            entry.arg_names, entry.result_paths = base.arg_names, base.result_paths
            entry.out_tree, entry.extra = base.out_tree, dict(base.extra)
            return entry

        return self.component.store.entry(key, build)

    def _derive(
        self,
        transform: tuple[Any, ...],
        args: Sequence[Any],
        make_fn: Callable[[], tuple[Callable[..., Sequence[Any]], dict[str, Any]]],
        arg_names: Sequence[str],
    ) -> Call:
        """A call of a transformation of this computation. ``make_fn`` returns the
        transformed flat function and facts to keep in the entry's ``extra``."""
        in_avals = [aval_of(a) for a in args]
        name = self.entry.name
        component = self.component
        extra: dict[str, Any] = {}

        def trace() -> Any:
            with traced_under(in_avals):
                fn, facts = make_fn()
                extra.update(facts)
                # Named as the component: ``jit(layer)`` in logs, profiles and HLO names.
                fn = named(fn, name)
                return jax.jit(fn, keep_unused=True).trace(*[sds(a) for a in in_avals])

        if sees_masks(self.key):
            # A rule of the program sees which inputs this transformation
            # differentiates or batches, and its key traced it for another choice:
            # this transformation is keyed by the program it computes, traced here
            # (once for each component, as jax.jit traces a function once: its
            # key is the same for another function whose rule differs).
            derived = _derived_programs(component)
            memo = (self.key, transform, tuple(in_avals))
            digest = derived.get(memo)
            if digest is None:
                traced = trace()
                digest = program_digest(traced.jaxpr, name)
                with _DERIVED_LOCK:
                    derived[memo] = digest
                    while len(derived) > _MAX_DERIVED_PROGRAMS:
                        del derived[next(iter(derived))]

                def trace() -> Any:
                    return traced

            transform = (*transform, ("program", digest))

        key = derived_key(self.key, transform, tuple(in_avals))

        def build() -> Entry:
            entry = component.make_entry(key, trace, name)
            entry.extra.update(extra)
            if len(entry.arg_names) == len(arg_names):
                entry.arg_names = tuple(arg_names)
            return entry

        entry = component.store.entry(key, build)
        return Call(component, key, entry, trace, self.devices)

    def vmap(self, axis_data: Any, in_axes: tuple[int | None, ...], args: Sequence[Any]) -> Call:
        """Batched along ``in_axes``; the entry's ``extra["out_axes"]`` says which
        outputs come out batched (at axis 0) and which stay unbatched (None)."""
        parent = self

        def make_fn() -> tuple[Callable[..., Sequence[Any]], dict[str, Any]]:
            batched, out_axes = batch_jaxpr(parent.jaxpr(), axis_data, in_axes)
            return jaxpr_as_fun(batched), {"out_axes": list(out_axes)}

        transform = ("vmap", in_axes, axis_data_parts(axis_data))
        return self._derive(transform, args, make_fn, self.entry.arg_names)

    def jvp(self, mask: tuple[bool, ...], args: Sequence[Any]) -> Call:
        """Tangents of the differentiable outputs, given primals and the nonzero tangents."""
        parent = self
        in_avals = self.entry.in_avals
        out_avals = self.entry.out_avals
        n = len(in_avals)

        def make_fn() -> tuple[Callable[..., Sequence[Any]], dict[str, Any]]:
            pf = parent.fn()

            def tangent_fn(*xs: Any) -> tuple[Any, ...]:
                _, out_t = _jvp(pf, mask, xs[:n], xs[n:])
                return tuple(
                    t for t, a in zip(out_t, out_avals, strict=True) if is_differentiable(a.dtype)
                )

            return tangent_fn, {}

        names = list(self.entry.arg_names) + [
            f"tangent of {nm}" if nm else "" for nm, m in zip(self._names(), mask, strict=True) if m
        ]
        return self._derive(("jvp", mask), args, make_fn, names)

    def _linearized_jaxprs(self, mask: tuple[bool, ...], recompute: bool) -> tuple[Any, Any]:
        """The JVP of this computation split by partial evaluation: a forward
        jaxpr (primals -> primal outputs + residuals) and a linear jaxpr
        (residuals + live tangents -> differentiable output tangents). Made once
        per mask: the forward and linear entries both come from it. With
        ``recompute``, the residuals are the primals themselves and the linear
        jaxpr computes the forward pass again (see ``recomputes``)."""
        done = self._linearized.get((mask, recompute))
        if done is not None:
            return done
        pf = self.fn()
        in_avals = self.entry.in_avals
        out_avals = self.entry.out_avals
        n = len(in_avals)
        diff = [is_differentiable(a.dtype) for a in out_avals]

        def jvp_fn(*xs: Any) -> tuple[Any, ...]:
            outs, out_t = _jvp(pf, mask, xs[:n], xs[n:])
            return (*outs, *[t for t, d in zip(out_t, diff, strict=True) if d])

        live_avals = [a.to_tangent_aval() for a, m in zip(in_avals, mask, strict=True) if m]
        structs = [sds(a) for a in (*in_avals, *live_avals)]
        if recompute:
            forward = pf
            if uses_primitive(self.jaxpr(), CUSTOM_VJP_PRIMITIVES):
                # The forward pass as JAX's linearize runs it: a custom_vjp function
                # by its fwd rule, so that forward mode over it (``jax.hessian``)
                # differentiates the rule, as it does under jax.jit, rather than
                # the custom_vjp function, which JAX refuses to.
                # (The forward jaxpr of the linearization that keeps residuals.)
                everything = jaxpr_as_fun(self._linearized_jaxprs(mask, False)[0])

                def forward(*primals: Any) -> Sequence[Any]:
                    return list(everything(*primals))[: len(out_avals)]

            def primal_fn(*primals: Any) -> tuple[Any, ...]:
                return (*forward(*primals), *primals)

            def tangent_fn(*xs: Any) -> tuple[Any, ...]:
                return jvp_fn(*xs)[len(out_avals) :]

            done = (jax.make_jaxpr(primal_fn)(*structs[:n]), jax.make_jaxpr(tangent_fn)(*structs))
            self._linearized[(mask, recompute)] = done
            return done
        closed = jax.make_jaxpr(jvp_fn)(*structs)
        n_diff = sum(diff)
        known, unknown, _, _ = partial_eval_jaxpr(
            closed,
            unknowns=[False] * n + [True] * len(live_avals),
            instantiate=[False] * len(out_avals) + [True] * n_diff,
        )
        known, unknown = prune_residuals(known, unknown, len(out_avals))
        self._linearized[(mask, recompute)] = (known, unknown)
        return known, unknown

    def linearize(
        self, mask: tuple[bool, ...], args: Sequence[Any]
    ) -> tuple[Call, Callable[[Sequence[Any]], Call]]:
        """The forward call (primal outputs and residuals), and a function giving the
        linear call (residuals and live tangents to output tangents) for its residuals."""
        parent = self
        recompute = recomputes(self.entry)
        how = ("recompute",) if recompute else ()

        def make_fwd() -> tuple[Callable[..., Sequence[Any]], dict[str, Any]]:
            # Residuals that are the entry's own inputs (a layer's weights) are not
            # returned, which would copy them: the caller has them at hand.
            known, _ = parent._linearized_jaxprs(mask, recompute)
            n_primal_out = len(parent.entry.out_avals)
            pairs = forwarded_inputs(known, n_primal_out)
            dropped = {r for r, _ in pairs}
            everything = jaxpr_as_fun(known)

            def forward(*xs: Any) -> list[Any]:
                return [o for r, o in enumerate(everything(*xs)) if r not in dropped]

            return forward, {
                "forwarded": [[r - n_primal_out, q] for r, q in pairs],
                "layout": residual_layout(known, n_primal_out),
            }

        fwd = self._derive(
            ("linearize", mask, "forward", *how), args, make_fwd, self.entry.arg_names
        )
        live_names = [
            f"tangent of {nm}" if nm else "" for nm, m in zip(self._names(), mask, strict=True) if m
        ]

        def make_lin(residuals: Sequence[Any]) -> Call:
            def make() -> tuple[Callable[..., Sequence[Any]], dict[str, Any]]:
                known, unknown = parent._linearized_jaxprs(mask, recompute)
                saved = fwd.entry.extra.get("layout")
                if saved is not None and saved != residual_layout(
                    known, len(parent.entry.out_avals)
                ):
                    # A forward entry made by another process that saves its residuals
                    # otherwise than this one derives them: a linear entry derived here
                    # would read them in the wrong places. Refused, never guessed.
                    raise RuntimeError(
                        f"jaxaot.component {parent.name!r}: its forward entry from the cache "
                        "saves the residuals in another layout than this process derives; "
                        "clear the cache (jaxaot cache clear) if this persists"
                    )
                return jaxpr_as_fun(unknown), {"linear_from": len(residuals)}

            live = [
                a.to_tangent_aval() for a, m in zip(self.entry.in_avals, mask, strict=True) if m
            ]
            args = [*residuals, *[sds(a) for a in live]]
            # Recomputing, the residuals are the inputs themselves: their names.
            names = self._names() if recompute else ["residual"] * len(residuals)
            names = names + live_names
            return parent._derive(("linearize", mask, "linear", *how), args, make, names)

        return fwd, make_lin

    def transpose(
        self,
        undefined: tuple[bool, ...],
        args: Sequence[Any],
        live: tuple[bool, ...] | None = None,
    ) -> Call:
        """Cotangents of the linear (undefined) inputs, given the others and output
        cotangents: of every output, or of those ``live`` marks (the others zero)."""
        parent = self
        outputs = range(len(self.entry.out_avals))
        kept = [i for i in outputs if live is None or live[i]]
        in_avals = self.entry.in_avals
        lin_avals = [a for a, u in zip(in_avals, undefined, strict=True) if u]
        n_defined = len(in_avals) - len(lin_avals)
        arg_avals = [aval_of(a) for a in args]

        def make_fn() -> tuple[Callable[..., Sequence[Any]], dict[str, Any]]:
            pf = parent.fn()

            def transposed(*xs: Any) -> tuple[Any, ...]:
                defined, cts = xs[:n_defined], xs[n_defined:]

                def linear(*lin: Any) -> tuple[Any, ...]:
                    it_d, it_l = iter(defined), iter(lin)
                    merged = [next(it_l) if u else next(it_d) for u in undefined]
                    out = pf(*merged)
                    return tuple(out[i] for i in kept)

                t = jax.linear_transpose(linear, *[sds(a) for a in lin_avals])
                return tuple(t(tuple(cts)))

            return fuse_dot_transposes(transposed, arg_avals), {}

        names = [nm for nm, u in zip(self._names(), undefined, strict=True) if not u]
        paths = self.entry.result_paths
        names += [f"cotangent of {paths[i]}" for i in kept if i < len(paths)]
        transform = ("transpose", undefined) if live is None else ("transpose", undefined, live)
        return self._derive(transform, args, make_fn, names)

    def _names(self) -> list[str]:
        names = list(self.entry.arg_names)
        return names + [""] * (len(self.entry.in_avals) - len(names))


def _jvp(
    fn: Callable[..., Sequence[Any]],
    mask: tuple[bool, ...],
    primals: Sequence[Any],
    live: Sequence[Any],
) -> tuple[Any, Any]:
    """``jax.jvp`` of ``fn`` at ``primals``, the inputs of ``mask`` moved by the
    ``live`` tangents. The others are held fixed, not given zero tangents: their
    tangents are then symbolic zeros, as under a JVP of the program itself, and a
    custom rule with ``symbolic_zeros`` sees them as such."""

    def of_live(*moved: Any) -> tuple[Any, ...]:
        it = iter(moved)
        return tuple(fn(*[next(it) if m else p for m, p in zip(mask, primals, strict=True)]))

    moved = tuple(p for m, p in zip(mask, primals, strict=True) if m)
    return jax.jvp(of_live, moved, tuple(live))
