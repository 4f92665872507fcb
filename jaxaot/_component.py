"""``jaxaot.component``: a function whose trace, lowering and compilation are cached.

How a call is served:

* At top level (no tracing in progress), a call looks up an executable for its
  signature (a dict keyed by argument types; compiled once per signature in
  this process) and runs it.
* Under tracing (``jax.jit``, ``vmap``, ``grad``, ``scan``, another
  component...), a call binds the ``jaxaot_component`` primitive with a
  :class:`Call` naming the cache entry for its signature (see ``_rules``).

Entries are looked up in this component's in-process table, then in the active
byte cache (``jaxaot.set_cache``/``using_cache``), and only then made by
tracing and lowering the body. Made entries are written to the active cache.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
import numpy as np

from . import _distributed, _entry, _stats
from ._caches import Cache
from ._config import explain_misses, get_cache
from ._entry import Entry, EntryError, NotPersistable
from ._jaxcompat import (
    ShapedArray,
    Tracer,
    batch_jaxpr,
    cpp_dispatcher,
    default_platform,
    deserialize_executable,
    fastpath_miss,
    has_host_callbacks,
    is_ordered_effect,
    jaxpr_as_fun,
    module_to_bytecode,
    partial_eval_jaxpr,
    serialize_executable,
    trace_state_clean,
)
from ._key import ClosureError, ComponentKey, aval_str, function_fingerprint, stable_repr
from ._optimize import fuse_dot_transposes, prune_residuals
from ._rules import bind

logger = logging.getLogger("jaxaot")

P = ParamSpec("P")
R = TypeVar("R")

_ARRAY_SCALARS = (bool, int, float, complex, np.generic)
_TraceAnnotation = jax.profiler.TraceAnnotation


def _aval_of(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return ShapedArray(x.shape, x.dtype, weak_type=bool(getattr(x, "weak_type", False)))
    aval = jax.typeof(x)
    return ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _avals_text(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(aval_str(a.shape, a.dtype, a.weak_type) for a in avals)


def _sds(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _jax_config_parts() -> tuple[tuple[str, str], ...]:
    cfg = jax.config
    names = (
        "jax_default_matmul_precision",
        "jax_numpy_rank_promotion",
        "jax_numpy_dtype_promotion",
        "jax_default_prng_impl",
        "jax_threefry_partitionable",
    )
    return tuple((n, str(getattr(cfg, n, None))) for n in names)


# How jaxaot derives the entries of transformations (a key part, so entries
# derived the old way are missed, never mixed with new ones).
#   1: first version.
#   2: transposed entries compute transpose(dot_general(a, b)) as dot_general(b, a).
#   3: residuals that are elementwise arithmetic of other residuals are recomputed.
DERIVE_VERSION = 3


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
    }


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

        return self.component._get_entry(key, build)

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
        key = self.key.replace(
            args=_avals_text(in_avals),
            transform=(*self.key.parts["transform"], transform),
        )
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

        entry = component._get_entry(key, build)
        return Call(component, key, entry, trace)

    def vmap(self, axis_data: Any, in_axes: tuple[int | None, ...], args: Sequence[Any]) -> Call:
        """Batched along ``in_axes``; the entry's ``extra["out_axes"]`` says which
        outputs come out batched (at axis 0) and which stay unbatched (None)."""
        parent = self

        def make_fn() -> tuple[Callable[..., Sequence[Any]], dict[str, Any]]:
            batched, out_axes = batch_jaxpr(parent.jaxpr(), axis_data, in_axes)
            return jaxpr_as_fun(batched), {"out_axes": list(out_axes)}

        transform = ("vmap", in_axes, int(axis_data.size))
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
                    t
                    for t, a in zip(out_t, out_avals, strict=True)
                    if np.issubdtype(a.dtype, np.inexact)
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
        diff = [bool(np.issubdtype(a.dtype, np.inexact)) for a in out_avals]

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
            known, _ = parent._linearized_jaxprs(mask)
            return jaxpr_as_fun(known), {}

        fwd = self._derive(("linearize", mask, "forward"), args, make_fwd, self.entry.arg_names)
        n_out = len(self.entry.out_avals)
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
            names = ["residual"] * (len(fwd.entry.out_avals) - n_out) + live_names
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
        self._entries: dict[ComponentKey, Entry] = {}
        self._compiled: dict[Any, Any] = {}
        self._costs: dict[Any, dict[str, float] | None] = {}
        self._region_exes: dict[ComponentKey, Any] = {}
        self._region_locks = _stats.KeyedLocks()
        self._annotation = f"jaxaot:{self.name}"
        simple = not self._static_argnums and not self._static_argnames and not callable(key)
        self._dispatch = cpp_dispatcher(self.name, self._dispatch_miss) if simple else None

        @functools.wraps(fun)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counters.add("traces")
            return fun(*args, **kwargs)

        self._counted = counted

        @functools.wraps(fun)
        def staged(*args: Any, **kwargs: Any) -> Any:
            return self._call_traced(args, kwargs)

        self._jitted = jax.jit(
            staged,
            static_argnums=self._static_argnums,
            static_argnames=self._static_argnames,
            donate_argnums=self._donate_argnums,
        )
        _stats.bump("components")

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
            return f"fn:{module}.{qualname}:{function_fingerprint(self.__wrapped__, self.name)}"
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

    def _root_key(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_tree: Any,
        avals: Sequence[Any],
        statics: tuple[tuple[str, str], ...],
    ) -> ComponentKey:
        parts = _base_parts(default_platform())
        parts.update(
            component=self._identity(args, kwargs),
            in_tree=str(in_tree),
            static=statics,
            args=_avals_text(avals),
            transform=(),
        )
        return ComponentKey(parts)

    def cache_key(self, *args: Any, **kwargs: Any) -> ComponentKey:
        """The key of the entry this call would use (arrays or ShapeDtypeStructs)."""
        dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
        leaves, in_tree = self._flatten(dyn_args, dyn_kwargs, allow_sds=True)
        return self._root_key(args, kwargs, in_tree, [_aval_of(x) for x in leaves], statics)

    def _get_entry(self, key: ComponentKey, build: Callable[[], Entry]) -> Entry:
        entry = self._entries.get(key)
        if entry is not None:
            self._counters.add("hits")
            return entry
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._counters.add("hits")
                return entry
            cache = get_cache()
            entry = _read(cache, key) if cache is not None else None
            if entry is not None:
                self._counters.add("hits")
                logger.debug("jaxaot: %s hit %s", self.name, key.digest[:16])
                hit = entry
                _distributed.publish_hit(key.digest, lambda: _entry.encode(hit))
            else:
                self._counters.add("misses")
                self._explain_miss(key)
                entry = _distributed.share(key.digest, build, _entry.encode, _decoder(key))
                if cache is not None:
                    _write(cache, entry)
            self._entries[key] = entry
            return entry

    def _explain_miss(self, key: ComponentKey) -> None:
        if not explain_misses():
            logger.debug("jaxaot: %s miss %s", self.name, key.digest[:16])
            return
        known = list(self._entries)
        if not known:
            logger.warning(
                "jaxaot: component %r missed the cache (key %s); it holds no other entry "
                "for this component in this process",
                self.name,
                key.digest[:16],
            )
            return
        closest = min(known, key=lambda k: len(key.explain(k)))
        logger.warning(
            "jaxaot: component %r missed the cache (key %s); the closest entry it holds "
            "(%s) differs in: %s",
            self.name,
            key.digest[:16],
            closest.digest[:16],
            "; ".join(key.explain(closest)),
        )

    def _build_entry(self, key: ComponentKey, trace: Callable[[], Any], name: str) -> Entry:
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
        if not callbacks:
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
            host_callbacks=callbacks,
            jaxpr=closed,
            effects=frozenset(closed.effects),
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
        counted = self._counted

        # A fresh function object each time, so JAX's own trace cache (keyed by
        # function identity, blind to globals) never hands back a stale trace.
        @functools.wraps(self.__wrapped__)
        def fresh(*a: Any, **k: Any) -> Any:
            return counted(*a, **k)

        jitted = jax.jit(
            fresh,
            static_argnums=self._static_argnums,
            static_argnames=self._static_argnames,
            keep_unused=True,
        )
        return jitted.trace(*sds_args, **sds_kwargs)

    def _root_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], allow_sds: bool
    ) -> tuple[Call, list[Any]]:
        dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
        leaves, in_tree = self._flatten(dyn_args, dyn_kwargs, allow_sds)
        avals = [_aval_of(x) for x in leaves]
        try:
            key = self._root_key(args, kwargs, in_tree, avals, statics)
        except ClosureError:
            raise
        sds_args = args
        sds_kwargs = kwargs

        def trace() -> Any:
            return self._trace_root(sds_args, sds_kwargs)

        entry = self._get_entry(key, lambda: self._build_entry(key, trace, self.name))
        return Call(self, key, entry, trace), leaves

    def _call_traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call, leaves = self._root_call(args, kwargs, allow_sds=False)
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

        Looked up in this process, then as a cache entry (deserialized, no
        trace, lowering or compile), and only then compiled (and stored)."""
        sig: tuple[Any, ...] = (in_tree, tuple(_aval_of(x) for x in leaves), statics)
        if callable(self._key):
            sig = (*sig, self._identity(args, kwargs))
        exe = self._compiled.get(sig)
        if exe is not None:
            return exe, sig
        with self._lock:
            exe = self._compiled.get(sig)
            if exe is not None:
                return exe, sig
            root_key = self._root_key(args, kwargs, in_tree, [_aval_of(x) for x in leaves], statics)
            exe_key = root_key.replace(executable=_executable_parts(self._donate_argnums))
            cache = get_cache()
            loaded = _load_executable(cache, exe_key) if cache is not None else None
            if loaded is not None:
                exe, costs = loaded
                self._counters.add("hits")
            else:
                self._counters.add("misses")

                start = time.perf_counter()
                exe = self._jitted.trace(*args, **kwargs).lower().compile()
                seconds = time.perf_counter() - start
                self._counters.add("compiles")
                costs = _cost_dict(exe)
                root = self._entries.get(root_key)
                # Executables are compiled by each process of a multi-process job
                # (they are bound to that process's devices); lowered entries are shared.
                if cache is not None and root is not None and not root.host_callbacks:
                    if seconds >= _BACKGROUND_AFTER_SECONDS:
                        # A big executable: serialize and write it while the first
                        # step runs, off the path to the first result.
                        _store_in_background(cache, exe_key, root, exe, costs)
                    else:
                        _store_executable(cache, exe_key, root, exe, costs)
            self._costs[sig] = costs
            self._compiled[sig] = exe
            return exe, sig

    def _call_executable(self, call: Call) -> Any:
        """An executable running one entry on its own (for ``jaxaot.jit``):
        from this process, else loaded from the cache, else compiled and stored."""
        exe = self._region_exes.get(call.key)
        if exe is not None:
            return exe
        # One lock per entry, so that jaxaot.jit compiles different entries of one
        # component (its forward and its backward) at the same time.
        with self._region_locks(call.key):
            exe = self._region_exes.get(call.key)
            if exe is not None:
                return exe
            # Not the top-level executable of the same entry: that one takes the
            # call's pytrees, this one flat arrays.
            parts = (*_executable_parts(()), ("calling_convention", "flat"))
            exe_key = call.key.replace(executable=parts)
            cache = get_cache()
            loaded = _load_executable(cache, exe_key) if cache is not None else None
            if loaded is not None:
                exe = loaded[0]
                self._counters.add("hits")
            else:
                self._counters.add("misses")
                sds = [_sds(a) for a in call.entry.in_avals]
                exe = (
                    jax.jit(lambda *a: bind(call, a), keep_unused=True)
                    .trace(*sds)
                    .lower()
                    .compile()
                )
                self._counters.add("compiles")
                if cache is not None and not call.entry.host_callbacks:
                    _store_executable(cache, exe_key, call.entry, exe, _cost_dict(exe))
            self._region_exes[call.key] = exe
            return exe

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
        costs = self._costs.get(sig)
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
        """Forgets this component's in-process entries and executables."""
        with self._lock:
            self._entries.clear()
            self._compiled.clear()
            if self._dispatch is not None:  # a fresh dispatcher: it knows no executable
                self._dispatch = cpp_dispatcher(self.name, self._dispatch_miss)
            self._costs.clear()
            self._region_exes.clear()


def _read(cache: Cache, key: ComponentKey) -> Entry | None:
    try:
        blob = cache.get(key.digest)
    except Exception as e:
        _stats.bump("cache_errors")
        _stats.warn_once(
            f"get:{type(cache).__name__}:{type(e).__name__}",
            f"jaxaot: reading from {cache!r} failed ({type(e).__name__}: {e}); computing locally",
        )
        return None
    if blob is None:
        return None
    try:
        return _entry.decode(blob, expected=key)
    except EntryError as e:
        _stats.bump("corrupt_entries")
        logger.warning(
            "jaxaot: dropped a bad cache entry %s from %r (%s); recomputing",
            key.digest[:16],
            cache,
            e,
        )
        _discard(cache, key.digest)
        return None


def _executable_parts(donate_argnums: tuple[int, ...]) -> tuple[tuple[str, Any], ...]:
    """Key parts that make a foreign or stale executable impossible to load."""
    device = jax.devices()[0]
    client = device.client
    return (
        ("backend", str(client.platform)),
        ("platform_version", str(client.platform_version)),
        ("device_kind", str(device.device_kind)),
        ("device_count", jax.device_count()),
        ("process_count", jax.process_count()),
        ("donate_argnums", tuple(donate_argnums)),
        ("xla_flags", os.environ.get("XLA_FLAGS", "")),
        ("libtpu_init_args", os.environ.get("LIBTPU_INIT_ARGS", "")),
    )


def _cost_dict(compiled: Any) -> dict[str, float] | None:
    try:
        costs = compiled.cost_analysis()
    except Exception:  # a backend without cost analysis
        return None
    if isinstance(costs, list | tuple):
        costs = costs[0] if costs else None
    if not costs:
        return None
    out: dict[str, float] = {}
    for name, value in dict(costs).items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


_BACKGROUND_AFTER_SECONDS = 0.25
_writer: concurrent.futures.ThreadPoolExecutor | None = None
_pending: dict[str, concurrent.futures.Future[None]] = {}
_pending_lock = threading.Lock()


def _store_in_background(
    cache: Cache, key: ComponentKey, root: Entry, exe: Any, costs: dict[str, float] | None
) -> None:
    """Stores an executable entry from a worker thread. The interpreter waits for
    the worker at exit; ``wait_for_writes`` and reads of the same key wait too."""
    global _writer
    with _pending_lock:
        if _writer is None:
            _writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxaot-writer")
        future = _writer.submit(_store_executable, cache, key, root, exe, costs)
        _pending[key.digest] = future

    def done(_: Any) -> None:
        with _pending_lock:
            if _pending.get(key.digest) is future:
                del _pending[key.digest]

    future.add_done_callback(done)


def wait_for_writes() -> None:
    """Blocks until every entry being written in the background is written."""
    with _pending_lock:
        futures = list(_pending.values())
    for future in futures:
        future.result()


def _load_executable(cache: Cache, key: ComponentKey) -> tuple[Any, dict[str, float] | None] | None:
    pending = _pending.get(key.digest)
    if pending is not None:
        pending.result()
    entry = _read(cache, key)
    if entry is None:
        return None
    try:
        if entry.executable is None:
            raise EntryError("entry has no executable section")
        in_tree = _entry.tree_from_json(entry.extra["executable_in_tree"])
        exe = deserialize_executable(entry.executable, in_tree, entry.out_tree)
    except Exception as e:  # damaged, foreign or unloadable: a miss, never a crash
        _stats.bump("corrupt_entries")
        logger.warning(
            "jaxaot: could not load the cached executable %s (%s: %s); compiling instead",
            key.digest[:16],
            type(e).__name__,
            e,
        )
        _discard(cache, key.digest)
        return None
    costs = entry.extra.get("cost_analysis")
    return exe, dict(costs) if isinstance(costs, dict) else None


def _executable_entry(
    key: ComponentKey, root: Entry, exe: Any, costs: dict[str, float] | None
) -> Entry | None:
    """An entry holding ``exe`` serialized, or ``None`` if it cannot be serialized."""
    try:
        payload, in_tree, out_tree = serialize_executable(exe)
        return Entry(
            key=key,
            name=root.name,
            in_avals=root.in_avals,
            out_avals=root.out_avals,
            out_tree=out_tree,
            arg_names=root.arg_names,
            result_paths=root.result_paths,
            executable=payload,
            extra={"cost_analysis": costs, "executable_in_tree": _entry.tree_to_json(in_tree)},
        )
    except Exception as e:
        logger.debug("jaxaot: not caching the executable of %s: %s", root.name, e)
        return None


def _store_executable(
    cache: Cache, key: ComponentKey, root: Entry, exe: Any, costs: dict[str, float] | None
) -> None:
    entry = _executable_entry(key, root, exe, costs)
    if entry is not None:
        _write(cache, entry)


def _decoder(key: ComponentKey) -> Callable[[bytes], Entry | None]:
    def decode(blob: bytes) -> Entry | None:
        try:
            return _entry.decode(blob, expected=key)
        except EntryError as e:
            logger.warning("jaxaot: entry %s from another process is bad (%s)", key.digest[:16], e)
            return None

    return decode


def _discard(cache: Cache, digest: str) -> None:
    quarantine = getattr(cache, "quarantine", None)
    try:
        if quarantine is not None:
            quarantine(digest)
        else:
            cache.delete(digest)
    except Exception:  # removing a bad entry is best effort
        logger.debug("jaxaot: could not remove bad entry %s", digest[:16], exc_info=True)


def _write(cache: Cache, entry: Entry) -> None:
    try:
        blob = _entry.encode(entry)
    except NotPersistable as e:
        logger.debug("jaxaot: not caching %s (%s): %s", entry.name, entry.key.digest[:16], e)
        return
    try:
        cache.put(entry.key.digest, blob)
    except Exception as e:
        _stats.bump("cache_errors")
        _stats.warn_once(
            f"put:{type(cache).__name__}:{type(e).__name__}",
            f"jaxaot: writing to {cache!r} failed ({type(e).__name__}: {e}); continuing without it",
        )


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
