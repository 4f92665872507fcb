"""``jaxaot.component``: a function whose trace, lowering and compilation are cached.

How a call is served:

* At top level (no tracing in progress), a call looks up an executable for its
  signature (keyed by what ``jax.jit`` keys on: the tree, the argument types,
  static values and the trace context, configuration included; compiled once
  per signature in this process) and runs it.
* Under tracing (``jax.jit``, ``vmap``, ``grad``, ``scan``, another
  component...), a call binds the ``jaxaot_component`` primitive with a
  :class:`~jaxaot._component._call.Call` naming the cache entry for its
  signature (see ``_rules``).

A call becomes a key: with an explicit ``key=`` without tracing; by default
from the traced program (``_keys._program``), traced once per signature in
this process. The component's :class:`~jaxaot._store._lookup.Store` then
serves the entry or executable for that key (in-process tables, the active
byte cache, the other processes of a job) or makes and writes it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

import jax

from .. import _stats
from .._jax import (
    Tracer,
    active_target,
    api_boundary,
    cpp_dispatcher,
    default_platform,
    fastpath_miss,
    has_host_callbacks,
    jaxpr_as_fun,
    jit_disabled,
    nan_found,
    on_target,
    refuse_call,
    trace_context,
    trace_state_clean,
)
from .._keys._closure import (
    ClosureError,
    closed_tracer,
    code_digest,
    refuse_closed_arrays,
)
from .._keys._key import ComponentKey
from .._keys._program import program_parts
from .._keys._sharding import (
    concrete_mesh,
    context_mesh_parts,
    input_sharding_parts,
    input_sharding_sig,
)
from .._keys._text import stable_repr, tree_text
from .._store._entry import Entry
from .._store._executables import executable_key
from .._store._lookup import Store
from ._arguments import Arguments, note_module_flags
from ._call import Call
from ._entries import build_entry
from ._parts import base_parts, types_text
from ._plain import Devices, devices_from_json, devices_of, needs_plain_jax, off_device, symbolic
from ._rules import OWN_LOWERING, bind, naming
from ._types import aval_of, sds

__all__ = ["Component"]

logger = logging.getLogger("jaxaot")

P = ParamSpec("P")
R = TypeVar("R")

_TraceAnnotation = jax.profiler.TraceAnnotation


def _key_text(entry: Entry, key: Any) -> str:
    """An explicit key as a warning names it: the value it gave for the entry
    (a callable key's, not the callable)."""
    part = str(entry.key.parts.get("component", ""))
    return part.removeprefix("key:") if part.startswith("key:") else repr(key)


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
        donate_argnames: str | Sequence[str] = (),
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
        self._args = Arguments(self.name, fun, static_argnums, static_argnames, donate_argnums)
        self._static_argnums = self._args.static_argnums
        self._static_argnames = self._args.static_argnames
        self._donate_argnums = self._args.donate_by_position(donate_argnames)
        self._counters = _stats.Counters(parent=_stats.PROCESS)
        self._lock = threading.RLock()
        # (The values it reads too: a changed constant is other code for this check.)
        self._code = code_digest(fun, with_values=True) if key is not None else ""
        self.store = Store(self.name, self._counters, check=self._check_code)
        # signature -> (root key, the Traced it was found from (default keys), the
        # devices the program names)
        self._keys: dict[tuple[Any, ...], tuple[ComponentKey, Any, Devices]] = {}
        self._annotation = f"jaxaot:{self.name}"
        simple = self._args.simple and not callable(key)
        self._dispatch = (
            cpp_dispatcher(self.name, self._dispatch_miss, function=self.__wrapped__)
            if simple
            else None
        )

        @functools.wraps(fun)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counters.add("traces")
            return fun(*args, **kwargs)

        self._counted = counted
        try:
            self._jitted = self._make_jitted()
        except (TypeError, ValueError) as e:  # jax.jit's, of static_argnames...
            raise naming(e, self.name) from None
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

    # -- keys and entries ------------------------------------------------------

    def _identity(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        key = self._key
        if key is None:
            module = getattr(self.__wrapped__, "__module__", "") or ""
            qualname = getattr(self.__wrapped__, "__qualname__", self.name)
            return f"fn:{module}.{qualname}"
        if callable(key):
            try:
                value = key(*args, **kwargs)
            except Exception as e:
                raise naming(e, self.name) from e
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
        sig: tuple[Any, ...] = (
            in_tree,
            tuple(avals),
            statics,
            self._args.static_values(args, kwargs),
            trace_context(),
            # The compile target: its keys are another platform's (in-process only).
            active_target(),
        )
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
        dyn_args, dyn_kwargs, statics = self._args.split(args, kwargs)
        leaves, in_tree = self._args.flatten(dyn_args, dyn_kwargs, allow_sds)
        avals = [aval_of(x) for x in leaves]
        sig = self._signature_of(args, kwargs, in_tree, avals, statics)
        known = self._keys.get(sig)
        if known is None:
            with self._lock:
                known = self._keys.get(sig)
                if known is None:
                    # Traced once per signature, as jax.jit traces a function: a
                    # global rebound later is not seen in this process, however the
                    # component is called (its top-level executable is not traced
                    # again either); a new process traces, and keys, it afresh.
                    key, traced = self._make_key(args, kwargs, in_tree, avals, statics)
                    devices = devices_of(traced.jaxpr) if traced is not None else ()
                    known = (key, traced, devices)
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
        parts = base_parts(default_platform())
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
            args=types_text(avals),
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
            f"jaxaot: component {self.name!r} (key {_key_text(entry, self._key):.60}) was served "
            "an entry "
            "made by code that differs from the code running now (its code, a default, or a number or "
            "string it reads by name). An explicit key is a "
            "promise that the computation is the same; change the key when the "
            "computation changes.",
        )

    def _code_extra(self) -> dict[str, Any]:
        return {"code": self._code} if self._key is not None else {}

    def make_entry(
        self, key: ComponentKey, trace: Callable[[], Any], name: str, lower: bool = True
    ) -> Entry:
        """The entry for ``key`` from ``trace()``, named ``name`` (see ``build_entry``)."""
        return build_entry(key, trace(), name, self._counters, owner=self.name, lower=lower)

    # -- calling ---------------------------------------------------------------

    def _trace_root(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def to_sds(x: Any) -> Any:
            return sds(aval_of(x))

        static_pos = self._args.static_positions(len(args))
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
        except jax.errors.ConcretizationTypeError as e:  # a Python `if` on a traced value
            raise naming(e, self.name) from None
        except TypeError as e:
            if "not a valid JAX type" not in str(e) or "output" not in str(e):
                raise
            # A result that is not an array (a function field of a returned module):
            # JAX's words, after the component's name and what to do.
            raise TypeError(
                f"jaxaot.component {self.name!r} returns a value that is not an array: {e}\n"
                "Return arrays only: mark such a field static (eqx.field(static=True)), "
                "or return eqx.filter(model, eqx.is_array) and eqx.combine it outside."
            ) from e

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
        key, traced, leaves, sig = resolved or self._resolve(args, kwargs, allow_sds)

        def trace() -> Any:
            return self._trace_root(args, kwargs)

        made = trace if traced is None else (lambda: traced)
        extra = self._code_extra()

        def build() -> Entry:
            entry = self.make_entry(key, made, self.name)
            entry.extra.update(extra)
            return entry

        entry = self.store.entry(key, build)
        if traced is not None and entry.jaxpr is None:
            # Loaded from a cache: this process traced the same program to find the key.
            entry.jaxpr = traced.jaxpr
        return Call(self, key, entry, trace, self._devices(sig, traced, entry)), leaves

    def _devices(self, sig: tuple[Any, ...], traced: Any, entry: Entry) -> Devices:
        """The devices the program of signature ``sig`` names: found when a default
        key traced it, else recorded in its entry when it was made."""
        if traced is not None:
            known = self._keys.get(sig)
            return (
                known[2] if known is not None and known[1] is traced else devices_of(traced.jaxpr)
            )
        try:
            return devices_from_json(entry.extra.get("devices") or [])
        except (TypeError, ValueError):  # a malformed record: link no devices, never fail
            return ()

    def _plain_reason(
        self,
        sig: tuple[Any, ...],
        traced: Any,
        leaves: Sequence[Any],
        root: Callable[[], Entry],
    ) -> str | None:
        """Why the call with signature ``sig`` (resolved) is served as plain JAX
        (see ``_plain``), or ``None``. A default key found it when it traced the
        body; with an explicit key, what the root entry (``root()``) found when
        it was made counts."""
        if traced is not None:
            known = self._keys.get(sig)
            devices = known[2] if known is not None and known[1] is traced else None
            return needs_plain_jax(devices_of(traced.jaxpr) if devices is None else devices)
        entry = root()
        plain = entry.extra.get("plain")
        if plain:
            return str(plain)
        # An entry made elsewhere may name devices this process lacks.
        return needs_plain_jax(self._devices(sig, None, entry))

    def _call_traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dyn_args, dyn_kwargs, _ = self._args.split(args, kwargs)
        leaves = jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))
        if off_device(self.name, leaves) or symbolic(self.name, leaves):
            return self.__wrapped__(*args, **kwargs)  # inline, as jax.jit would trace it
        resolved = self._resolve(args, kwargs, allow_sds=False)
        _, traced, leaves, sig = resolved
        made: list[Call] = []

        def root() -> Entry:
            made.append(self._root_call(args, kwargs, False, resolved)[0])
            return made[-1].entry

        reason = self._plain_reason(sig, traced, leaves, root)
        if reason is not None:
            # Inlined, as jax.jit would.
            logger.debug("jaxaot: component %r is inlined (%s)", self.name, reason)
            if traced is None:
                return self._counted(*args, **kwargs)
            outs = jaxpr_as_fun(traced.jaxpr)(*leaves)
            return jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(traced.out_info), list(outs)
            )
        call = made[-1] if made else self._root_call(args, kwargs, False, resolved)[0]
        outs = bind(call, leaves)
        return jax.tree_util.tree_unflatten(_out_tree(traced, call.entry), outs)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            if (
                self._dispatch is not None
                and trace_state_clean()
                and not _TraceAnnotation.is_enabled()
            ):
                # Hot path: JAX's C++ dispatcher, over this component's executables
                # (one per signature, compiled here or loaded from the cache).
                return self._dispatch(*args, **kwargs)  # type: ignore[no-any-return]
            return self._call_slow(args, kwargs)  # type: ignore[arg-type]
        except Exception as error:
            if not nan_found(error):
                note_module_flags(error, f"jaxaot.component {self.name!r}", args, kwargs)
                raise
        # A NaN under jax_debug_nans: jax.jit of the function finds where, op by op.
        return self._as_jax_jit(args, kwargs)  # type: ignore[no-any-return]

    def _as_jax_jit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call as ``jax.jit`` of the function makes it (uncached)."""
        return jax.jit(
            self.__wrapped__,
            static_argnums=self._static_argnums,
            static_argnames=self._static_argnames,
        )(*args, **kwargs)

    # Errors are reported as jax.jit's are: without JAX's frames, nor jaxaot's.
    __call__ = api_boundary(__call__)  # type: ignore[assignment]

    def _refuse_under_target(self) -> None:
        refuse_call(f"jaxaot.component {self.name!r}", "Component.precompile")

    def _dispatch_miss(self, *args: Any, **kwargs: Any) -> tuple[Any, Any, bool]:
        """The C++ dispatcher met a new signature (or one without fast-path data yet)."""
        dyn_args, dyn_kwargs, statics = self._args.split(args, kwargs)
        leaves, in_tree = self._args.flatten(dyn_args, dyn_kwargs, allow_sds=False)
        if not trace_state_clean() or any(isinstance(x, Tracer) for x in leaves):
            return self._call_traced(args, kwargs), None, False
        if off_device(self.name, leaves):
            return self._as_jax_jit(args, kwargs), None, False
        self._refuse_under_target()
        exe, _ = self._executable(args, kwargs, in_tree, leaves, statics)
        return fastpath_miss(exe, dyn_args, dyn_kwargs)

    def _call_slow(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if jit_disabled():  # as jax.jit does: the function runs as plain Python
            return self.__wrapped__(*args, **kwargs)
        dyn_args, dyn_kwargs, statics = self._args.split(args, kwargs)
        leaves, in_tree = self._args.flatten(dyn_args, dyn_kwargs, allow_sds=False)
        if not trace_state_clean() or any(isinstance(x, Tracer) for x in leaves):
            return self._call_traced(args, kwargs)
        if off_device(self.name, leaves):
            return self._as_jax_jit(args, kwargs)
        self._refuse_under_target()
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
            *self._signature_of(args, kwargs, in_tree, [aval_of(x) for x in leaves], statics),
            # Placement: each executable is compiled for its inputs' shardings.
            input_sharding_sig(leaves),
            concrete_mesh(),
        )
        exe = self.store.known_executable(sig)
        if exe is not None:
            return exe, sig

        def key() -> ComponentKey:
            root_key, _, _, _ = self._resolve(args, kwargs, allow_sds=True)
            placement = (
                ("inputs", input_sharding_parts(leaves)),
                ("context_mesh", context_mesh_parts()),
            )
            return executable_key(root_key, self._donate_argnums, placement)

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
                root = self.make_entry(root_key, lambda: stage, self.name, lower=False)
                root.extra.update(self._code_extra())
                # Its executable is stored like any other (unless it calls the host).
                root.host_callbacks = has_host_callbacks(stage.jaxpr)
                return stage.lower().compile(), root
            call, _ = self._root_call(args, kwargs, allow_sds=True)
            token = OWN_LOWERING.set(self.name)
            try:
                lowered = self._jitted.trace(*args, **kwargs).lower()
            finally:
                OWN_LOWERING.reset(token)
            return lowered.compile(), call.entry

        return self.store.executable(sig, key, compile, self._code_extra, in_tree), sig

    def precompile(self, *args: Any, **kwargs: Any) -> Any:
        """Loads (from the cache) or compiles the top-level executable for this
        signature without running it, and returns it (a ``jax.stages.Compiled``).

        Accepts arrays or ``jax.ShapeDtypeStruct``s. Later calls with this
        signature use the same executable. Under a compile target
        (``jaxaot precompile --target``), it compiles for the target's devices:
        where no argument is sharded over them, on its first device."""
        dyn_args, dyn_kwargs, statics = self._args.split(args, kwargs)
        leaves, in_tree = self._args.flatten(dyn_args, dyn_kwargs, allow_sds=True)
        # Keyed by the arguments as given (a process on the target keys its own
        # calls so: "placed by the call"), compiled for where the target places them.
        placed_args, placed_kwargs = self._on_target(args, kwargs)
        exe, _ = self._executable(placed_args, placed_kwargs, in_tree, leaves, statics)
        return exe

    def _on_target(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments as the active compile target compiles them (``on_target``);
        themselves without one."""
        if active_target() is None:
            return args, kwargs
        static = self._args.static_positions(len(args))
        positions = [i for i in range(len(args)) if i not in static]
        names = [k for k in kwargs if k not in self._static_argnames]
        dynamic = ([args[i] for i in positions], {k: kwargs[k] for k in names})
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        placed = on_target(leaves, f"jaxaot.component {self.name!r}")
        placed_args, placed_kwargs = jax.tree_util.tree_unflatten(tree, placed)
        new_args = list(args)
        for i, a in zip(positions, placed_args, strict=True):
            new_args[i] = a
        return tuple(new_args), {**kwargs, **placed_kwargs}

    def cost_analysis(self, *args: Any, **kwargs: Any) -> dict[str, float] | None:
        """The compiled program's cost analysis for this signature as a plain dict
        (``flops``, ``bytes accessed``, ...), or ``None`` where the backend gives none.

        Loads or compiles the executable if needed; does not run it."""
        dyn_args, dyn_kwargs, statics = self._args.split(args, kwargs)
        leaves, in_tree = self._args.flatten(dyn_args, dyn_kwargs, allow_sds=True)
        _, sig = self._executable(args, kwargs, in_tree, leaves, statics)
        costs = self.store.costs(sig)
        return dict(costs) if costs is not None else None

    # -- stages and introspection ---------------------------------------------

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """JAX's ``Traced`` stage for a top-level call (arrays or ShapeDtypeStructs)."""
        return self._jitted.trace(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """JAX's ``Lowered`` stage for a top-level call (arrays or ShapeDtypeStructs)."""
        return self._jitted.trace(*args, **kwargs).lower()

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The results' shapes and dtypes (``jax.ShapeDtypeStruct``s), as
        ``jax.eval_shape`` gives them: from the entry's types, without compiling."""
        return self._jitted.trace(*args, **kwargs).out_info

    def entry(self, *args: Any, **kwargs: Any) -> Entry:
        """The cache entry for this signature (made if needed)."""
        call, _ = self._root_call(args, kwargs, allow_sds=True)
        return call.entry

    # Errors are reported as jax.jit's are: without JAX's frames, nor jaxaot's.
    precompile = api_boundary(precompile)  # type: ignore[assignment]
    cost_analysis = api_boundary(cost_analysis)  # type: ignore[assignment]
    cache_key = api_boundary(cache_key)  # type: ignore[assignment]
    trace = api_boundary(trace)  # type: ignore[assignment]
    lower = api_boundary(lower)  # type: ignore[assignment]
    eval_shape = api_boundary(eval_shape)  # type: ignore[assignment]
    entry = api_boundary(entry)  # type: ignore[assignment]

    def cache_info(self) -> _stats.CacheInfo:
        """Counts for this component in this process."""
        return self._counters.info()

    def clear_cache(self) -> None:
        """Forgets this component's in-process keys, entries and executables; later
        calls find them in the cache again, or make (and write) them anew."""
        with self._lock:
            self.store.clear()
            self._keys.clear()
            if self._dispatch is not None:  # a fresh dispatcher: it knows no executable
                self._dispatch = cpp_dispatcher(
                    self.name, self._dispatch_miss, function=self.__wrapped__
                )
            # A fresh jax.jit too: its own trace cache would otherwise skip the body
            # that makes (and writes) the root entry.
            self._jitted = self._make_jitted()


def _out_tree(traced: Any, entry: Entry) -> Any:
    """The tree of a call's results: its own trace's, where a default key traced
    it. An entry's is the first call's with its key, and its static parts (an
    Equinox module's static field, passed through) are only as distinct in its
    key as their text: two closures of one function print alike. (Such an entry is
    kept in its process: a tree is stored only where its text tells it apart.)"""
    if traced is None:
        return entry.out_tree
    return jax.tree_util.tree_structure(traced.out_info)
