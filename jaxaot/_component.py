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

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
import numpy as np

from . import _entry, _stats
from ._caches import Cache
from ._config import explain_misses, get_cache
from ._entry import Entry, EntryError, NotPersistable
from ._jaxcompat import (
    ShapedArray,
    Tracer,
    default_platform,
    has_host_callbacks,
    input_dependencies,
    is_ordered_effect,
    jaxpr_as_fun,
    module_to_bytecode,
    trace_state_clean,
)
from ._key import ClosureError, ComponentKey, aval_str, function_fingerprint, stable_repr
from ._rules import bind

logger = logging.getLogger("jaxaot")

P = ParamSpec("P")
R = TypeVar("R")

_ARRAY_SCALARS = (bool, int, float, complex, np.generic)
_ARRAY_TYPE = type(jax.numpy.zeros(()))
_tree_flatten = jax.tree_util.tree_flatten


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


def _base_parts(platform: str) -> dict[str, Any]:
    import jaxlib

    return {
        "format": _entry.ENTRY_FORMAT_VERSION,
        "jax": jax.__version__,
        "jaxlib": str(jaxlib.__version__),
        "x64": bool(jax.config.read("jax_enable_x64")),
        "config": _jax_config_parts(),
        "platforms": (platform,),
    }


class Call:
    """The parameter of one ``jaxaot_component`` equation: one cache entry and how to
    derive the entries of its transformations. Equal when the keys are equal."""

    __slots__ = ("component", "key", "entry", "_make_fn", "_trace")

    def __init__(
        self,
        component: Component[..., Any],
        key: ComponentKey,
        entry: Entry,
        make_fn: Callable[[], Callable[..., Sequence[Any]]],
        trace: Callable[[], Any],
    ) -> None:
        self.component = component
        self.key = key
        self.entry = entry
        self._make_fn = make_fn
        self._trace = trace

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

    def fn(self) -> Callable[..., Sequence[Any]]:
        """This computation as a flat Python callable (from the jaxpr when this
        process has it, else by re-deriving it from the body)."""
        if self.entry.jaxpr is not None:
            return jaxpr_as_fun(self.entry.jaxpr)  # type: ignore[no-any-return]
        return self._make_fn()

    def entry_for_platform(self, platform: str) -> Entry:
        if self.key.parts["platforms"] == (platform,):
            return self.entry
        key = self.key.replace(platforms=(platform,))
        entry = self.entry

        def build() -> Entry:
            return self.component._build_entry(key, self._trace, entry.name)

        return self.component._get_entry(key, build)

    def _derive(
        self,
        transform: tuple[Any, ...],
        args: Sequence[Any],
        make_fn: Callable[[], Callable[..., Sequence[Any]]],
        arg_names: Sequence[str],
    ) -> Call:
        in_avals = [_aval_of(a) for a in args]
        key = self.key.replace(
            args=_avals_text(in_avals),
            transform=(*self.key.parts["transform"], transform),
        )
        name = self.entry.name
        component = self.component

        def trace() -> Any:
            fn = make_fn()
            return jax.jit(fn, keep_unused=True).trace(*[_sds(a) for a in in_avals])

        def build() -> Entry:
            entry = component._build_entry(key, trace, name)
            if len(entry.arg_names) == len(arg_names):
                entry.arg_names = tuple(arg_names)
            return entry

        entry = component._get_entry(key, build)
        return Call(component, key, entry, make_fn, trace)

    def vmap(
        self,
        in_axes: tuple[int | None, ...],
        out_axes: tuple[int | None, ...],
        size: int,
        args: Sequence[Any],
    ) -> Call:
        parent = self

        def make_fn() -> Callable[..., Sequence[Any]]:
            pf = parent.fn()

            def batched(*xs: Any) -> tuple[Any, ...]:
                return tuple(
                    jax.vmap(
                        lambda *a: tuple(pf(*a)), in_axes=in_axes, out_axes=out_axes, axis_size=size
                    )(*xs)
                )

            return batched

        return self._derive(("vmap", in_axes, out_axes, size), args, make_fn, self.entry.arg_names)

    def jvp(self, mask: tuple[bool, ...], args: Sequence[Any]) -> Call:
        parent = self
        in_avals = self.entry.in_avals
        out_avals = self.entry.out_avals
        n = len(in_avals)

        def make_fn() -> Callable[..., Sequence[Any]]:
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

            return tangent_fn

        names = list(self.entry.arg_names) + [
            f"tangent of {nm}" if nm else "" for nm, m in zip(self._names(), mask, strict=True) if m
        ]
        return self._derive(("jvp", mask), args, make_fn, names)

    def transpose(self, undefined: tuple[bool, ...], args: Sequence[Any]) -> Call:
        parent = self
        in_avals = self.entry.in_avals
        lin_avals = [a for a, u in zip(in_avals, undefined, strict=True) if u]
        n_defined = len(in_avals) - len(lin_avals)

        def make_fn() -> Callable[..., Sequence[Any]]:
            pf = parent.fn()

            def transposed(*xs: Any) -> tuple[Any, ...]:
                defined, cts = xs[:n_defined], xs[n_defined:]

                def linear(*lin: Any) -> tuple[Any, ...]:
                    it_d, it_l = iter(defined), iter(lin)
                    merged = [next(it_l) if u else next(it_d) for u in undefined]
                    return tuple(pf(*merged))

                t = jax.linear_transpose(linear, *[_sds(a) for a in lin_avals])
                return tuple(t(tuple(cts)))

            return transposed

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
        self._fast: dict[Any, Any] = {}
        self._simple = not self._static_argnums and not self._static_argnames and not callable(key)

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
            else:
                self._counters.add("misses")
                self._explain_miss(key)
                entry = build()
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
            deps=input_dependencies(closed),
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

        def make_fn() -> Callable[..., Sequence[Any]]:
            traced = trace()
            return jaxpr_as_fun(traced.jaxpr)  # type: ignore[no-any-return]

        return Call(self, key, entry, make_fn, trace), leaves

    def _call_traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call, leaves = self._root_call(args, kwargs, allow_sds=False)
        outs = bind(call, leaves)
        return jax.tree_util.tree_unflatten(call.entry.out_tree, outs)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        fast: Any = None
        if self._simple and trace_state_clean():
            # Hot path: a signature of arrays seen before runs its executable
            # directly (C++ dispatch), as jax.jit's own fast path does. Avals
            # carry shape, dtype and weak type; only signatures made of
            # concrete jax.Arrays are ever stored.
            try:
                if kwargs:
                    raise AttributeError
                fast = tuple([x.aval for x in args])  # type: ignore[attr-defined]
            except AttributeError:
                leaves, treedef = _tree_flatten((args, kwargs))
                try:
                    fast = (treedef, *[x.aval for x in leaves])
                except AttributeError:
                    fast = None
            if fast is not None:
                run = self._fast.get(fast)
                if run is not None:
                    return run(*args, **kwargs)  # type: ignore[no-any-return]
        return self._call_slow(args, kwargs, fast)  # type: ignore[arg-type]

    def _call_slow(self, args: tuple[Any, ...], kwargs: dict[str, Any], fast: Any) -> Any:
        dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
        leaves, in_tree = self._flatten(dyn_args, dyn_kwargs, allow_sds=False)
        if not trace_state_clean() or any(isinstance(x, Tracer) for x in leaves):
            return self._call_traced(args, kwargs)
        sig: tuple[Any, ...] = (in_tree, tuple(_aval_of(x) for x in leaves), statics)
        if callable(self._key):
            sig = (*sig, self._identity(args, kwargs))
        exe = self._compiled.get(sig)
        if exe is None:
            with self._lock:
                exe = self._compiled.get(sig)
                if exe is None:
                    exe = self._jitted.trace(*args, **kwargs).lower().compile()
                    self._counters.add("compiles")
                    self._compiled[sig] = exe
        out = exe(*dyn_args, **dyn_kwargs)
        if fast is not None and all(type(x) is _ARRAY_TYPE for x in leaves):
            self._fast[fast] = getattr(exe, "_call", None) or exe
        return out

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
            self._fast.clear()


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
        quarantine = getattr(cache, "quarantine", None)
        try:
            if quarantine is not None:
                quarantine(key.digest)
            else:
                cache.delete(key.digest)
        except Exception:  # removing a bad entry is best effort
            logger.debug("jaxaot: could not remove bad entry %s", key.digest[:16], exc_info=True)
        return None


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
def component(fun: Callable[P, R], /) -> Component[P, R]: ...


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
