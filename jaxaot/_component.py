"""``jaxaot.component``: a function whose trace, lowering and compilation are cached.

How a call is served:

* At top level (no tracing in progress), a call looks up an executable for its
  signature (keyed by what ``jax.jit`` keys on: the tree, the argument types,
  static values and the trace context, configuration included; compiled once
  per signature in this process) and runs it.
* Under tracing (``jax.jit``, ``vmap``, ``grad``, ``scan``, another
  component...), a call binds the ``jaxaot_component`` primitive with a
  :class:`Call` naming the cache entry for its signature (see ``_rules``).

This module turns a call into a key: with an explicit ``key=`` without
tracing; by default from the traced program (``_program``), traced once per
signature in this process. The component's :class:`~jaxaot._store.Store`
then serves the entry or executable for that key (in-process tables, the
active byte cache, the other processes of a job) or makes and writes it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np

from . import _entry, _stats
from ._entry import Entry
from ._inline import needs_plain_jax, sharded_type
from ._jaxcompat import (
    ShapedArray,
    Tracer,
    axis_data_parts,
    batch_jaxpr,
    cpp_dispatcher,
    default_platform,
    explicit_mesh_axes_in_scope,
    fastpath_miss,
    has_host_callbacks,
    is_ordered_effect,
    jaxpr_as_fun,
    module_to_bytecode,
    partial_eval_jaxpr,
    trace_context,
    trace_context_parts,
    trace_state_clean,
)
from ._key import (
    ClosureError,
    ComponentKey,
    aval_str,
    closed_tracer,
    code_digest,
    refuse_closed_arrays,
    same_values,
    seen_values,
    stable_repr,
    tree_text,
)
from ._optimize import forwarded_inputs, fuse_dot_transposes, prune_residuals
from ._program import program_parts, uses_primitive
from ._rules import bind, in_regional_trace, naming
from ._sharding import (
    concrete_mesh,
    context_mesh_parts,
    input_sharding_parts,
    input_sharding_sig,
    mesh_text,
    spec_text,
)
from ._store import (
    Store,
    executable_parts,
    load_executable,
    store_executable,
    wait_for_writes,
)

# Names other modules of jaxaot use (``_regional``, ``_bundle``).
_executable_parts = executable_parts
_load_executable = load_executable
_store_executable = store_executable
__all__ = ["Call", "Component", "component", "wait_for_writes"]

logger = logging.getLogger("jaxaot")

P = ParamSpec("P")
R = TypeVar("R")

_ARRAY_SCALARS = (bool, int, float, complex, np.generic)
_TraceAnnotation = jax.profiler.TraceAnnotation


def _aval_of(x: Any) -> Any:
    """A value's type: shape, dtype, weak type, and its sharding where the type
    carries one (explicit mesh axes); other shardings are placement, not type."""
    if isinstance(x, jax.ShapeDtypeStruct):
        weak = bool(getattr(x, "weak_type", False))
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
            sharding.mesh, jax.sharding.AbstractMesh
        ):
            typed = ShapedArray(x.shape, x.dtype, weak_type=weak, sharding=sharding)
            if sharded_type(typed):
                return typed
        return ShapedArray(x.shape, x.dtype, weak_type=weak)
    return _type_of(jax.typeof(x))


@functools.lru_cache(maxsize=4096)
def _type_of(aval: Any) -> Any:
    """``aval`` as a type (``_aval_of``): memoized, as a deep network passes the same
    few types to every layer (equal avals give equal types)."""
    if sharded_type(aval):
        return ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=aval.sharding)
    return ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _avals_text(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(
        aval_str(a.shape, a.dtype, a.weak_type)
        + (f"@{spec_text(a.sharding.spec)}" if sharded_type(a) else "")
        for a in avals
    )


def _sds(aval: Any) -> jax.ShapeDtypeStruct:
    if sharded_type(aval):
        return jax.ShapeDtypeStruct(
            aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=aval.sharding
        )
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _jax_config_parts() -> tuple[tuple[str, Any], ...]:
    """Everything ``jax.jit``'s own caches key on (its trace context), option by
    option, and the PRNG implementation."""
    return (
        *trace_context_parts(),
        ("jax_default_prng_impl", str(getattr(jax.config, "jax_default_prng_impl", None))),
    )


def is_differentiable(dtype: Any) -> bool:
    """Whether JAX differentiates values of ``dtype``: every inexact dtype, the
    bfloat16, float16, float8 and complex types included (JAX's own predicate;
    NumPy's does not know the ml_dtypes types)."""
    return bool(jnp.issubdtype(dtype, jnp.inexact))


# How jaxaot derives the entries of transformations (a key part, so entries
# derived the old way are missed, never mixed with new ones).
#   1: first version.
#   2: transposed entries compute transpose(dot_general(a, b)) as dot_general(b, a).
#   3: residuals that are elementwise arithmetic of other residuals are recomputed.
#   4: derived keys hold each parent's input types and the vmap axis's name and
#      spmd_axis_name; every dtype JAX differentiates gets tangents.
#   5: forward entries say which residuals are their own inputs
#      (``extra["forwards"]``, read by ``_whole``).
#   6: forward entries do not return the residuals that are their own inputs
#      (a layer's weights): ``extra["forwarded"]`` says where they go among the
#      residuals, and the caller passes the inputs themselves on.
DERIVE_VERSION = 6


def _base_parts(platform: str) -> dict[str, Any]:
    import jaxlib

    return {
        "format": _entry.ENTRY_FORMAT_VERSION,
        "derive": DERIVE_VERSION,
        "jax": jax.__version__,
        "jaxlib": str(jaxlib.__version__),
        "x64": bool(jax.config.read("jax_enable_x64")),
        "config": _jax_config_parts(),
        "platforms": (platform,),
        # The abstract mesh tracing sees (executable keys add the concrete one).
        "mesh": mesh_text(jax.sharding.get_abstract_mesh()),
    }


@functools.lru_cache(maxsize=4096)
def _derived_key(
    parent: ComponentKey, transform: tuple[Any, ...], in_avals: tuple[Any, ...]
) -> ComponentKey:
    """The key of a transformation of ``parent``'s computation taking ``in_avals``:
    the whole lineage, each transformation with the input types of the computation it
    transforms, so no two signatures share a derived entry. Memoized (a pure
    function of its arguments): every layer of a deep network derives the same keys."""
    return parent.replace(
        args=_avals_text(in_avals),
        transform=(*parent.parts["transform"], (*transform, parent.parts["args"])),
    )


class Call:
    """The parameter of one ``jaxaot_component`` equation: one cache entry and how to
    derive the entries of its transformations. Equal when the keys are equal."""

    __slots__ = ("component", "key", "entry", "_trace", "_linearized")

    def __init__(
        self,
        component: Component[..., Any],
        key: ComponentKey,
        entry: Entry,
        trace: Callable[[], Any],
    ) -> None:
        self.component = component
        self.key = key
        self.entry = entry
        self._trace = trace  # traces this computation afresh: a jax.stages.Traced
        self._linearized: dict[tuple[bool, ...], tuple[Any, Any]] = {}

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
            fn = self.fn()
            return jax.jit(fn, keep_unused=True).trace(*[_sds(a) for a in base.in_avals])

        def build() -> Entry:
            entry = self.component._build_entry(key, trace, base.name)
            entry.arg_names, entry.result_paths = base.arg_names, base.result_paths
            entry.out_tree, entry.extra = base.out_tree, dict(base.extra)
            return entry

        return self.component._store.entry(key, build)

    def _derive(
        self,
        transform: tuple[Any, ...],
        args: Sequence[Any],
        make_fn: Callable[[], tuple[Callable[..., Sequence[Any]], dict[str, Any]]],
        arg_names: Sequence[str],
    ) -> Call:
        """A call of a transformation of this computation. ``make_fn`` returns the
        transformed flat function and facts to keep in the entry's ``extra``."""
        in_avals = [_aval_of(a) for a in args]
        try:
            key = _derived_key(self.key, transform, tuple(in_avals))
        except TypeError:  # an unhashable part (a list): the same key, not memoized
            key = _derived_key.__wrapped__(self.key, transform, tuple(in_avals))
        name = self.entry.name
        component = self.component
        extra: dict[str, Any] = {}

        def trace() -> Any:
            fn, facts = make_fn()
            extra.update(facts)
            return jax.jit(fn, keep_unused=True).trace(*[_sds(a) for a in in_avals])

        def build() -> Entry:
            entry = component._build_entry(key, trace, name)
            entry.extra.update(extra)
            if len(entry.arg_names) == len(arg_names):
                entry.arg_names = tuple(arg_names)
            return entry

        entry = component._store.entry(key, build)
        return Call(component, key, entry, trace)

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
                primals, live = xs[:n], iter(xs[n:])
                tangents = [
                    next(live) if m else _zeros(a.to_tangent_aval())
                    for m, a in zip(mask, in_avals, strict=True)
                ]
                _, out_t = jax.jvp(lambda *p: tuple(pf(*p)), tuple(primals), tuple(tangents))
                return tuple(
                    t for t, a in zip(out_t, out_avals, strict=True) if is_differentiable(a.dtype)
                )

            return tangent_fn, {}

        names = list(self.entry.arg_names) + [
            f"tangent of {nm}" if nm else "" for nm, m in zip(self._names(), mask, strict=True) if m
        ]
        return self._derive(("jvp", mask), args, make_fn, names)

    def _linearized_jaxprs(self, mask: tuple[bool, ...]) -> tuple[Any, Any]:
        """The JVP of this computation split by partial evaluation: a forward
        jaxpr (primals -> primal outputs + residuals) and a linear jaxpr
        (residuals + live tangents -> differentiable output tangents). Made once
        per mask: the forward and linear entries both come from it."""
        done = self._linearized.get(mask)
        if done is not None:
            return done
        pf = self.fn()
        in_avals = self.entry.in_avals
        out_avals = self.entry.out_avals
        n = len(in_avals)
        diff = [is_differentiable(a.dtype) for a in out_avals]

        def jvp_fn(*xs: Any) -> tuple[Any, ...]:
            primals, live = xs[:n], iter(xs[n:])
            tangents = [
                next(live) if m else _zeros(a.to_tangent_aval())
                for m, a in zip(mask, in_avals, strict=True)
            ]
            outs, out_t = jax.jvp(lambda *p: tuple(pf(*p)), tuple(primals), tuple(tangents))
            return (*outs, *[t for t, d in zip(out_t, diff, strict=True) if d])

        live_avals = [a.to_tangent_aval() for a, m in zip(in_avals, mask, strict=True) if m]
        closed = jax.make_jaxpr(jvp_fn)(*[_sds(a) for a in (*in_avals, *live_avals)])
        n_diff = sum(diff)
        known, unknown, _, _ = partial_eval_jaxpr(
            closed,
            unknowns=[False] * n + [True] * len(live_avals),
            instantiate=[False] * len(out_avals) + [True] * n_diff,
        )
        known, unknown = prune_residuals(known, unknown, len(out_avals))
        self._linearized[mask] = (known, unknown)
        return known, unknown

    def linearize(
        self, mask: tuple[bool, ...], args: Sequence[Any]
    ) -> tuple[Call, Callable[[Sequence[Any]], Call]]:
        """The forward call (primal outputs and residuals), and a function giving the
        linear call (residuals and live tangents to output tangents) for its residuals."""
        parent = self

        def make_fwd() -> tuple[Callable[..., Sequence[Any]], dict[str, Any]]:
            # Residuals that are the entry's own inputs (a layer's weights) are not
            # returned, which would copy them: the caller has them at hand.
            known, _ = parent._linearized_jaxprs(mask)
            n_primal_out = len(parent.entry.out_avals)
            pairs = forwarded_inputs(known, n_primal_out)
            dropped = {r for r, _ in pairs}
            everything = jaxpr_as_fun(known)

            def forward(*xs: Any) -> list[Any]:
                return [o for r, o in enumerate(everything(*xs)) if r not in dropped]

            return forward, {"forwarded": [[r - n_primal_out, q] for r, q in pairs]}

        fwd = self._derive(("linearize", mask, "forward"), args, make_fwd, self.entry.arg_names)
        live_names = [
            f"tangent of {nm}" if nm else "" for nm, m in zip(self._names(), mask, strict=True) if m
        ]

        def make_lin(residuals: Sequence[Any]) -> Call:
            def make() -> tuple[Callable[..., Sequence[Any]], dict[str, Any]]:
                _, unknown = parent._linearized_jaxprs(mask)
                return jaxpr_as_fun(unknown), {"linear_from": len(residuals)}

            live = [
                a.to_tangent_aval() for a, m in zip(self.entry.in_avals, mask, strict=True) if m
            ]
            args = [*residuals, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in live]]
            names = ["residual"] * len(residuals) + live_names
            return parent._derive(("linearize", mask, "linear"), args, make, names)

        return fwd, make_lin

    def transpose(self, undefined: tuple[bool, ...], args: Sequence[Any]) -> Call:
        """Cotangents of the linear (undefined) inputs, given the others and output cotangents."""
        parent = self
        in_avals = self.entry.in_avals
        lin_avals = [a for a, u in zip(in_avals, undefined, strict=True) if u]
        n_defined = len(in_avals) - len(lin_avals)
        arg_avals = [_aval_of(a) for a in args]

        def make_fn() -> tuple[Callable[..., Sequence[Any]], dict[str, Any]]:
            pf = parent.fn()

            def transposed(*xs: Any) -> tuple[Any, ...]:
                defined, cts = xs[:n_defined], xs[n_defined:]

                def linear(*lin: Any) -> tuple[Any, ...]:
                    it_d, it_l = iter(defined), iter(lin)
                    merged = [next(it_l) if u else next(it_d) for u in undefined]
                    return tuple(pf(*merged))

                t = jax.linear_transpose(linear, *[_sds(a) for a in lin_avals])
                return tuple(t(tuple(cts)))

            return fuse_dot_transposes(transposed, arg_avals), {}

        names = [nm for nm, u in zip(self._names(), undefined, strict=True) if not u]
        names += [f"cotangent of {p}" for p in self.entry.result_paths]
        return self._derive(("transpose", undefined), args, make_fn, names)

    def _names(self) -> list[str]:
        names = list(self.entry.arg_names)
        return names + [""] * (len(self.entry.in_avals) - len(names))


def _zeros(aval: Any) -> Any:
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, dtype=jax.dtypes.float0)
    return jax.numpy.zeros(aval.shape, aval.dtype)


class Component(Generic[P, R]):
    """A function whose output shapes, StableHLO and executables are cached.

    Create with :func:`jaxaot.component`. Call it like the function: at top
    level it runs a compiled executable; inside ``jax.jit``, ``vmap``, ``grad``
    and friends it is linked as a call of its cached module.
    """

    def __init__(
        self,
        fun: Callable[P, R],
        *,
        key: Any = None,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (),
    ) -> None:
        if not callable(fun):
            raise TypeError(f"jaxaot.component: expected a callable, got {type(fun).__name__}")
        self.__wrapped__ = fun
        self.name = getattr(fun, "__name__", None) or type(fun).__name__
        functools.update_wrapper(self, fun)  # type: ignore[arg-type]
        if key is not None and not callable(key) and stable_repr(key) is None:
            raise TypeError(
                f"jaxaot.component {self.name!r}: key must be a str, int, bool, float, bytes, "
                f"None, a tuple of those, or a callable returning one; got "
                f"{type(key).__name__} {key!r:.60}"
            )
        self._key = key
        try:
            self._signature: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            self._signature = None
        self._static_argnums, self._static_argnames = self._normalize_static(
            static_argnums, static_argnames
        )
        self._donate_argnums = _as_tuple(donate_argnums, "donate_argnums", self.name)
        self._counters = _stats.Counters(parent=_stats.PROCESS)
        self._lock = threading.RLock()
        self._code = code_digest(fun) if key is not None else ""
        self._store = Store(self.name, self._counters, check=self._check_code)
        # signature -> (root key, the Traced it was found from (default keys), the
        # values the body saw by name, why the program is served as plain JAX)
        self._keys: dict[
            tuple[Any, ...], tuple[ComponentKey, Any, tuple[Any, ...], str | None]
        ] = {}
        self._annotation = f"jaxaot:{self.name}"
        simple = not self._static_argnums and not self._static_argnames and not callable(key)
        self._dispatch = cpp_dispatcher(self.name, self._dispatch_miss) if simple else None

        @functools.wraps(fun)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counters.add("traces")
            return fun(*args, **kwargs)

        self._counted = counted
        self._jitted = self._make_jitted()
        _stats.bump("components")

    def _make_jitted(self) -> Any:
        fun = self.__wrapped__

        @functools.wraps(fun)
        def staged(*args: Any, **kwargs: Any) -> Any:
            return self._call_traced(args, kwargs)

        return jax.jit(
            staged,
            static_argnums=self._static_argnums,
            static_argnames=self._static_argnames,
            donate_argnums=self._donate_argnums,
        )

    def __repr__(self) -> str:
        return f"<jaxaot.component {self.name}>"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    # -- arguments ------------------------------------------------------------

    def _normalize_static(
        self, argnums: int | Sequence[int], argnames: str | Sequence[str]
    ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        nums = _as_tuple(argnums, "static_argnums", self.name)
        names = (argnames,) if isinstance(argnames, str) else tuple(argnames)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(
                    f"jaxaot.component {self.name!r}: static_argnames must be strings, got {n!r}"
                )
        if self._signature is not None:
            params = list(self._signature.parameters.values())
            positional = [
                p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            extra_names = tuple(
                positional[i] for i in nums if -len(positional) <= i < len(positional)
            )
            extra_nums = tuple(positional.index(n) for n in names if n in positional)
            names = tuple(dict.fromkeys(names + extra_names))
            nums = tuple(sorted(set(nums + extra_nums)))
        return nums, names

    def _arg_names(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        params = list(self._signature.parameters.values()) if self._signature else []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        var = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
        names = []
        for i in range(len(args)):
            if i < len(positional):
                names.append(positional[i].name)
            elif var is not None:
                names.append(f"{var}[{i - len(positional)}]")
            else:
                names.append("")
        return names

    def _split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[tuple[str, str], ...]]:
        if self._signature is not None:
            try:
                self._signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"jaxaot.component {self.name!r}: {e}") from None
        names = self._arg_names(args, kwargs)
        statics: list[tuple[str, str]] = []
        dyn_args = []
        n = len(args)
        static_pos = {i % n for i in self._static_argnums if -n <= i < n} if n else set()
        for i, a in enumerate(args):
            if i in static_pos:
                statics.append((names[i] or f"args[{i}]", self._static_repr(a, names[i] or str(i))))
            else:
                dyn_args.append(a)
        dyn_kwargs = {}
        for k in sorted(kwargs):
            if k in self._static_argnames:
                statics.append((k, self._static_repr(kwargs[k], k)))
            else:
                dyn_kwargs[k] = kwargs[k]
        return tuple(dyn_args), dyn_kwargs, tuple(statics)

    def _static_repr(self, value: Any, name: str) -> str:
        text = stable_repr(value)
        if text is None:
            raise TypeError(
                f"jaxaot.component {self.name!r}: static argument {name!r} must be hashable "
                "with a stable repr (None, bool, int, float, complex, str, bytes, an enum member, "
                f"a dtype, or a tuple of those); got {type(value).__name__}"
            )
        return text

    def _flatten(
        self, dyn_args: tuple[Any, ...], dyn_kwargs: dict[str, Any], allow_sds: bool
    ) -> tuple[list[Any], Any]:
        leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))
        leaves = []
        for path, leaf in leaves_with_paths:
            ok = isinstance(leaf, (jax.Array, np.ndarray, Tracer, *_ARRAY_SCALARS)) or (
                allow_sds and isinstance(leaf, jax.ShapeDtypeStruct)
            )
            if not ok:
                raise TypeError(
                    f"jaxaot.component {self.name!r}: argument {self._path_name(path, dyn_args)!r} "
                    f"is a {type(leaf).__name__}, not an array; pass arrays (or mark the argument "
                    "static with static_argnums/static_argnames)"
                )
            leaves.append(leaf)
        return leaves, in_tree

    def _path_name(self, path: tuple[Any, ...], dyn_args: tuple[Any, ...]) -> str:
        head, *rest = path[1:] if path else ()
        suffix = jax.tree_util.keystr(tuple(rest))
        if path and isinstance(path[0], jax.tree_util.SequenceKey) and path[0].idx == 0:
            idx = head.idx
            params = list(self._signature.parameters) if self._signature else []
            dyn_names = [
                n
                for i, n in enumerate(params)
                if i not in self._static_argnums and n not in self._static_argnames
            ]
            base = dyn_names[idx] if idx < len(dyn_names) else f"args[{idx}]"
        else:
            base = str(getattr(head, "key", head))
        return base + suffix

    # -- keys and entries ------------------------------------------------------

    def _identity(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        key = self._key
        if key is None:
            module = getattr(self.__wrapped__, "__module__", "") or ""
            qualname = getattr(self.__wrapped__, "__qualname__", self.name)
            return f"fn:{module}.{qualname}"
        if callable(key):
            value = key(*args, **kwargs)
            text = stable_repr(value)
            if text is None:
                raise TypeError(
                    f"jaxaot.component {self.name!r}: the key function returned "
                    f"{type(value).__name__} {value!r:.60}, which has no stable repr"
                )
            return "key:" + text
        return "key:" + str(stable_repr(key))

    def _signature_of(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_tree: Any,
        avals: Sequence[Any],
        statics: tuple[tuple[str, str], ...],
    ) -> tuple[Any, ...]:
        """What tells calls apart in this process: what ``jax.jit``'s own caches key
        on (the tree, the types, static values and the trace context)."""
        sig: tuple[Any, ...] = (in_tree, tuple(avals), statics, trace_context())
        if callable(self._key):
            sig = (*sig, self._identity(args, kwargs))
        return sig

    def _resolve(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], allow_sds: bool
    ) -> tuple[ComponentKey, Any, list[Any], tuple[Any, ...]]:
        """The root key of a call, the ``Traced`` its key was found from (default
        keys) or ``None`` (explicit keys), the flat inputs and the signature.

        A default key is found by tracing the body (once per signature in this
        process); an explicit key without tracing."""
        dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
        leaves, in_tree = self._flatten(dyn_args, dyn_kwargs, allow_sds)
        avals = [_aval_of(x) for x in leaves]
        sig = self._signature_of(args, kwargs, in_tree, avals, statics)
        known = self._keys.get(sig)
        if known is None or not same_values(known[2], self.__wrapped__):
            with self._lock:
                known = self._keys.get(sig)
                if known is None or not same_values(known[2], self.__wrapped__):
                    # New, or the function now sees other objects by name (a
                    # rebound global): trace again, as a new jax.jit would.
                    seen = seen_values(self.__wrapped__)
                    key, traced = self._make_key(args, kwargs, in_tree, avals, statics)
                    plain = needs_plain_jax(traced.jaxpr) if traced is not None else None
                    known = (key, traced, seen, plain)
                    self._keys[sig] = known
        return known[0], known[1], leaves, sig

    def _make_key(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_tree: Any,
        avals: Sequence[Any],
        statics: tuple[tuple[str, str], ...],
    ) -> tuple[ComponentKey, Any]:
        parts = _base_parts(default_platform())
        parts["component"] = self._identity(args, kwargs)
        traced = None
        if self._key is None:
            traced = self._trace_root(args, kwargs)
            if len(traced.jaxpr.in_avals) != len(avals):
                # JAX passed a value the function closes over as an extra input:
                # a tracer of a transformation outside the component.
                where = closed_tracer(self.__wrapped__) or "a closed-over value"
                raise ClosureError(
                    f"jaxaot.component {self.name!r}: the function closes over a traced "
                    f"value ({where}) of a transformation outside the component. Its value "
                    "is not known when the component is made; pass it as an argument instead."
                )
            parts.update(program_parts(traced.jaxpr, self.name))
            parts["out_tree"] = tree_text(jax.tree_util.tree_structure(traced.out_info))
        else:
            refuse_closed_arrays(self.__wrapped__, self.name)
        parts.update(
            in_tree=tree_text(in_tree),
            static=statics,
            args=_avals_text(avals),
            transform=(),
        )
        return ComponentKey(parts), traced

    def cache_key(self, *args: Any, **kwargs: Any) -> ComponentKey:
        """The key of the entry this call would use (arrays or ShapeDtypeStructs).

        With a default key this traces the body (once per signature)."""
        key, _, _, _ = self._resolve(args, kwargs, allow_sds=True)
        return key

    def _check_code(self, entry: Entry) -> None:
        """An explicit-key entry read from a cache: warn (once) if other code made it."""
        made_by = entry.extra.get("code")
        if made_by is None or made_by == self._code:
            return
        _stats.warn_once(
            f"code:{self.name}:{id(self)}",
            f"jaxaot: component {self.name!r} (key {self._key!r:.60}) was served an entry "
            "made by code that differs from the code running now. An explicit key is a "
            "promise that the computation is the same; change the key when the "
            "computation changes.",
        )

    def _code_extra(self) -> dict[str, Any]:
        return {"code": self._code} if self._key is not None else {}

    def _build_entry(
        self, key: ComponentKey, trace: Callable[[], Any], name: str, lower: bool = True
    ) -> Entry:
        traced = trace()
        closed = traced.jaxpr
        for eff in closed.effects:
            if is_ordered_effect(eff):
                raise ValueError(
                    f"jaxaot.component {self.name!r}: ordered side effects ({eff}) are not "
                    "supported in components; use unordered callbacks (the default for "
                    "jax.debug.print and io_callback) or call it outside the component"
                )
        callbacks = has_host_callbacks(closed)
        stablehlo = None
        # A program with sharded types or named devices is served as plain JAX:
        # its entry is not lowered, and stays in this process.
        plain = needs_plain_jax(closed)
        local = callbacks or _needs_context(closed) or plain is not None
        if not local and lower:
            platform = key.parts["platforms"][0]
            lowered = traced.lower(lowering_platforms=(platform,))
            self._counters.add("lowerings")
            stablehlo = module_to_bytecode(lowered.compiler_ir("stablehlo"))
        debug = closed.jaxpr.debug_info
        arg_names = tuple("" if n is None else str(n) for n in (debug.arg_names or ()))
        if len(arg_names) != len(closed.in_avals):
            arg_names = ("",) * len(closed.in_avals)
        result_paths = tuple(str(p) for p in (debug.result_paths or ()))
        if len(result_paths) != len(closed.out_avals):
            result_paths = tuple(f"result[{i}]" for i in range(len(closed.out_avals)))
        return Entry(
            key=key,
            name=name,
            in_avals=tuple(closed.in_avals),
            out_avals=tuple(closed.out_avals),
            out_tree=jax.tree_util.tree_structure(traced.out_info),
            arg_names=arg_names,
            result_paths=result_paths,
            stablehlo=stablehlo,
            # Entries that cannot be lowered on their own (collectives over an
            # outer vmap axis, custom_vjp linear parts) stay in this process, like
            # those with host callbacks; they are only ever transformed.
            host_callbacks=local,
            jaxpr=closed,
            effects=frozenset(closed.effects),
            extra={"plain": plain} if plain else {},
        )

    # -- calling ---------------------------------------------------------------

    def _trace_root(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def to_sds(x: Any) -> Any:
            return _sds(_aval_of(x))

        n = len(args)
        static_pos = {i % n for i in self._static_argnums if -n <= i < n} if n else set()
        sds_args = [
            a if i in static_pos else jax.tree_util.tree_map(to_sds, a) for i, a in enumerate(args)
        ]
        sds_kwargs = {
            k: v if k in self._static_argnames else jax.tree_util.tree_map(to_sds, v)
            for k, v in kwargs.items()
        }
        jitted = jax.jit(
            self._fresh(),
            static_argnums=self._static_argnums,
            static_argnames=self._static_argnames,
            keep_unused=True,
        )
        try:
            return jitted.trace(*sds_args, **sds_kwargs)
        except ClosureError:
            raise
        except (NameError, AssertionError) as e:  # e.g. a collective over an unbound axis
            raise naming(e, self.name) from e

    def _fresh(self) -> Callable[..., Any]:
        """The body as a fresh function object, so JAX's own trace cache (keyed by
        function identity, blind to globals) never hands back a stale trace."""
        counted = self._counted

        @functools.wraps(self.__wrapped__)
        def fresh(*a: Any, **k: Any) -> Any:
            return counted(*a, **k)

        return fresh

    def _root_call(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        allow_sds: bool,
        resolved: tuple[ComponentKey, Any, list[Any], tuple[Any, ...]] | None = None,
    ) -> tuple[Call, list[Any]]:
        """The call of the root entry; ``resolved`` is this call's ``_resolve``
        when the caller has it already."""
        key, traced, leaves, _ = resolved or self._resolve(args, kwargs, allow_sds)

        def trace() -> Any:
            return self._trace_root(args, kwargs)

        made = trace if traced is None else (lambda: traced)
        extra = self._code_extra()

        def build() -> Entry:
            entry = self._build_entry(key, made, self.name)
            entry.extra.update(extra)
            return entry

        entry = self._store.entry(key, build)
        if traced is not None and entry.jaxpr is None:
            # Loaded from a cache: this process traced the same program to find the key.
            entry.jaxpr = traced.jaxpr
        return Call(self, key, entry, trace), leaves

    def _plain_reason(
        self,
        sig: tuple[Any, ...],
        traced: Any,
        leaves: Sequence[Any],
        root: Callable[[], Entry],
    ) -> str | None:
        """Why the call with signature ``sig`` (resolved) is served as plain JAX
        (see :func:`needs_plain_jax`), or ``None``. A default key found it when it
        traced the body; with an explicit key, inputs with sharded types, a mesh
        in context with explicit axes, or what the root entry (``root()``) found
        when it was made, count."""
        if explicit_mesh_axes_in_scope():
            return "vmap over an explicit mesh axis"
        if traced is not None:
            known = self._keys.get(sig)
            if known is not None and known[1] is traced:
                return known[3]
            return needs_plain_jax(traced.jaxpr)  # the table was cleared meanwhile
        if any(sharded_type(_aval_of(x)) for x in leaves) or _explicit_context():
            return "sharded types"
        plain = root().extra.get("plain")
        return str(plain) if plain else None

    def _call_traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        resolved = self._resolve(args, kwargs, allow_sds=False)
        _, traced, leaves, sig = resolved
        made: list[Call] = []

        def root() -> Entry:
            made.append(self._root_call(args, kwargs, False, resolved)[0])
            return made[-1].entry

        reason = self._plain_reason(sig, traced, leaves, root)
        if reason is not None and not (reason.endswith("names devices") and in_regional_trace()):
            # Inlined, as jax.jit would: an entry would hide its shardings (jaxaot.jit
            # compiles a component naming devices for the shardings it is called with).
            logger.debug("jaxaot: component %r is inlined (%s)", self.name, reason)
            if traced is None:
                return self._counted(*args, **kwargs)
            outs = jaxpr_as_fun(traced.jaxpr)(*leaves)
            return jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(traced.out_info), list(outs)
            )
        call = made[-1] if made else self._root_call(args, kwargs, False, resolved)[0]
        outs = bind(call, leaves)
        return jax.tree_util.tree_unflatten(call.entry.out_tree, outs)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._dispatch is not None and trace_state_clean() and not _TraceAnnotation.is_enabled():
            # Hot path: JAX's C++ dispatcher, over this component's executables
            # (one per signature, compiled here or loaded from the cache).
            return self._dispatch(*args, **kwargs)  # type: ignore[no-any-return]
        return self._call_slow(args, kwargs)  # type: ignore[arg-type]

    def _dispatch_miss(self, *args: Any, **kwargs: Any) -> tuple[Any, Any, bool]:
        """The C++ dispatcher met a new signature (or one without fast-path data yet)."""
        dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
        leaves, in_tree = self._flatten(dyn_args, dyn_kwargs, allow_sds=False)
        if not trace_state_clean() or any(isinstance(x, Tracer) for x in leaves):
            return self._call_traced(args, kwargs), None, False
        exe, _ = self._executable(args, kwargs, in_tree, leaves, statics)
        return fastpath_miss(exe, dyn_args, dyn_kwargs)

    def _call_slow(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
        leaves, in_tree = self._flatten(dyn_args, dyn_kwargs, allow_sds=False)
        if not trace_state_clean() or any(isinstance(x, Tracer) for x in leaves):
            return self._call_traced(args, kwargs)
        exe, _ = self._executable(args, kwargs, in_tree, leaves, statics)
        if _TraceAnnotation.is_enabled():
            with _TraceAnnotation(self._annotation):
                return exe(*dyn_args, **dyn_kwargs)
        return exe(*dyn_args, **dyn_kwargs)

    def _executable(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_tree: Any,
        leaves: Sequence[Any],
        statics: tuple[tuple[str, str], ...],
    ) -> tuple[Any, Any]:
        """The executable for a top-level call's signature, and its signature.

        Looked up in this process (by everything ``jax.jit`` keys on, the
        configuration included), then as a cache entry (deserialized: no
        lowering or compile; a default key traces the body to find the key),
        and only then compiled (and stored)."""
        sig = (
            *self._signature_of(args, kwargs, in_tree, [_aval_of(x) for x in leaves], statics),
            # Placement: each executable is compiled for its inputs' shardings.
            input_sharding_sig(leaves),
            concrete_mesh(),
        )
        exe = self._store.executables.get(sig)
        if exe is not None:
            return exe, sig

        def key() -> ComponentKey:
            root_key, _, _, _ = self._resolve(args, kwargs, allow_sds=True)
            return root_key.replace(
                executable=(
                    *executable_parts(self._donate_argnums),
                    ("inputs", input_sharding_parts(leaves)),
                    ("context_mesh", context_mesh_parts()),
                )
            )

        def compile() -> tuple[Any, Entry]:
            root_key, traced, _, root_sig = self._resolve(args, kwargs, allow_sds=True)

            def root_entry() -> Entry:
                return self._root_call(args, kwargs, allow_sds=True)[0].entry

            reason = self._plain_reason(root_sig, traced, leaves, root_entry)
            if reason is not None:
                # Compiled as jax.jit compiles the body, shardings and devices included.
                logger.debug("jaxaot: component %r compiled as plain JAX (%s)", self.name, reason)
                jitted = jax.jit(
                    self._fresh(),
                    static_argnums=self._static_argnums,
                    static_argnames=self._static_argnames,
                    donate_argnums=self._donate_argnums,
                )
                stage = jitted.trace(*args, **kwargs)
                root = self._build_entry(root_key, lambda: stage, self.name, lower=False)
                root.extra.update(self._code_extra())
                # Its executable is stored like any other (unless it calls the host).
                root.host_callbacks = has_host_callbacks(stage.jaxpr)
                return stage.lower().compile(), root
            call, _ = self._root_call(args, kwargs, allow_sds=True)
            return self._jitted.trace(*args, **kwargs).lower().compile(), call.entry

        return self._store.executable(sig, key, compile, self._code_extra, in_tree), sig

    def _call_executable(self, call: Call, shardings: tuple[Any, ...] | None = None) -> Any:
        """An executable running one entry on its own (for ``jaxaot.jit``), for
        inputs with ``shardings`` (``None`` for one that needs none): from this
        process, else loaded from the cache, else compiled and stored."""

        def compile() -> Any:
            sds = [_sds(a) for a in call.entry.in_avals]
            if shardings is not None:
                sds = [
                    s
                    if sharding is None
                    else jax.ShapeDtypeStruct(
                        s.shape, s.dtype, weak_type=s.weak_type, sharding=sharding
                    )
                    for s, sharding in zip(sds, shardings, strict=True)
                ]
            return jax.jit(lambda *a: bind(call, a), keep_unused=True).trace(*sds).lower().compile()

        return self._store.region_executable(call.key, call.entry, compile, shardings)

    def precompile(self, *args: Any, **kwargs: Any) -> Any:
        """Loads (from the cache) or compiles the top-level executable for this
        signature without running it, and returns it (a ``jax.stages.Compiled``).

        Accepts arrays or ``jax.ShapeDtypeStruct``s. Later calls with this
        signature use the same executable."""
        dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
        leaves, in_tree = self._flatten(dyn_args, dyn_kwargs, allow_sds=True)
        exe, _ = self._executable(args, kwargs, in_tree, leaves, statics)
        return exe

    def cost_analysis(self, *args: Any, **kwargs: Any) -> dict[str, float] | None:
        """The compiled program's cost analysis for this signature as a plain dict
        (``flops``, ``bytes accessed``, ...), or ``None`` where the backend gives none.

        Loads or compiles the executable if needed; does not run it."""
        dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
        leaves, in_tree = self._flatten(dyn_args, dyn_kwargs, allow_sds=True)
        _, sig = self._executable(args, kwargs, in_tree, leaves, statics)
        costs = self._store.costs.get(sig)
        return dict(costs) if costs is not None else None

    # -- stages and introspection ---------------------------------------------

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """JAX's ``Traced`` stage for a top-level call (arrays or ShapeDtypeStructs)."""
        return self._jitted.trace(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """JAX's ``Lowered`` stage for a top-level call (arrays or ShapeDtypeStructs)."""
        return self._jitted.trace(*args, **kwargs).lower()

    def entry(self, *args: Any, **kwargs: Any) -> Entry:
        """The cache entry for this signature (made if needed)."""
        call, _ = self._root_call(args, kwargs, allow_sds=True)
        return call.entry

    def cache_info(self) -> _stats.CacheInfo:
        """Counts for this component in this process."""
        return self._counters.info()

    def clear_cache(self) -> None:
        """Forgets this component's in-process keys, entries and executables; later
        calls find them in the cache again, or make (and write) them anew."""
        with self._lock:
            self._store.clear()
            self._keys.clear()
            if self._dispatch is not None:  # a fresh dispatcher: it knows no executable
                self._dispatch = cpp_dispatcher(self.name, self._dispatch_miss)
            # A fresh jax.jit too: its own trace cache would otherwise skip the body
            # that makes (and writes) the root entry.
            self._jitted = self._make_jitted()


def _explicit_context() -> bool:
    """Whether the mesh in context has explicit axes (types may then carry shardings)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)


def _needs_context(closed: Any) -> bool:
    """Whether a jaxpr can only be lowered inside a context it does not have: it uses
    a named axis bound outside it (``psum`` over an outer ``vmap`` axis), or a
    ``custom_vjp`` linear part (only transposable)."""
    if any(type(e).__name__ == "NamedAxisEffect" for e in closed.effects):
        return True
    return uses_primitive(closed, ("custom_lin",))


def _as_tuple(value: int | Sequence[int], what: str, name: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else tuple(value)
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"jaxaot.component {name!r}: {what} must be ints, got {v!r}")
    return items


@overload
def component(
    fun: Callable[P, R],
    /,
    *,
    key: Hashable | Callable[..., Hashable] | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
) -> Component[P, R]: ...


@overload
def component(
    fun: None = None,
    /,
    *,
    key: Hashable | Callable[..., Hashable] | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
) -> Callable[[Callable[P, R]], Component[P, R]]: ...


def component(
    fun: Callable[P, R] | None = None,
    /,
    *,
    key: Hashable | Callable[..., Hashable] | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
) -> Component[P, R] | Callable[[Callable[P, R]], Component[P, R]]:
    """Marks ``fun`` as a component: traced, lowered and compiled once per signature.

    Args:
      fun: the function. Its arguments and results may be any pytrees of arrays.
      key: the component's identity in caches. ``None`` derives it from the
        function (module, qualified name and a fingerprint of its code, the
        project functions it calls, and the values it closes over); a str,
        int or tuple of those names it explicitly (two functions with one key
        are taken to compute the same thing); a callable receives the call's
        arguments and returns such a value.
      static_argnums, static_argnames: arguments passed as Python values
        (hashable, with a stable repr), part of the key, as in ``jax.jit``.
      donate_argnums: arguments whose buffers top-level calls may reuse.

    Host callbacks (``jax.debug.print``, ``jax.pure_callback``,
    ``io_callback``) work in components, but their entries stay in this
    process, and a callback must never call back into JAX.

    Example::

      @jaxaot.component
      def block(params, x):
          return jnp.tanh(x @ params["w"] + params["b"])
    """

    def wrap(f: Callable[P, R]) -> Component[P, R]:
        return Component(
            f,
            key=key,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
        )

    if fun is None:
        return wrap
    return wrap(fun)
