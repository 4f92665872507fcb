"""Host callbacks in serialized executables: taking a compiled program that calls
back into Python into another process.

An XLA executable names its host callbacks by index (``xla_ffi_python_*_callback``
custom calls); the Python functions behind the indices are handed to jaxlib when
the executable is compiled or deserialized, and are never part of its bytes. An
executable with callbacks can therefore be loaded in another process when that
process supplies, for each index, a function that does what the compiling
process's did. jaxaot builds them from the traced program of the loading
process (whose default key traces the component anyway):

* :func:`register_program` records a program's callback equations, in the order
  its canonical form (``_keys._program``) visits them, under the component and
  the program's digest;
* :func:`serialize_with_callbacks` (in the compiling process) matches each host
  callback of a compiled program to its equation, and pickles the executable with
  ``(component, program, equation index)`` in place of each Python function;
* unpickling it (``jax.experimental.serialize_executable.deserialize_and_load``
  of the loading process) rebuilds each function from the equation registered
  at that index, with that process's Python objects, and deserializes the XLA
  executable with them bound.

Callbacks that no equation of the traced program makes (a library's primitive
adds them while it is lowered, as lineax's solves do; ordered callbacks, which
take a token) are bound otherwise: :func:`serialize_relowered` names each by its
place, and a loading process lowers the program again (:func:`relowering`,
without compiling it) and binds its lowering's callbacks, where they call the
same functions as the stored program's.

Rebinding needs a jaxlib whose ``deserialize_executable`` takes
``host_callbacks`` (0.10.2 through 0.12 do) and a backend whose callbacks are
FFI calls by index (CPU and GPU; TPU callbacks are send/receive channels baked
into the program). :func:`rebind_unsupported` says why not, where not.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import io
import sys
import threading
import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from ._jaxpr import component_callback_jaxpr, is_ordered_effect, walk_jaxprs
from ._runtime import executable_fields
from ._target import target_devices

__all__ = [
    "CallbacksNotRebindable",
    "binds_callbacks",
    "callback_arguments",
    "callback_functions",
    "callback_equations",
    "called_callbacks",
    "holds_host_callbacks",
    "is_callback_equation",
    "lowered_host_callbacks",
    "rebind_unsupported",
    "register_program",
    "relowering",
    "serialize_relowered",
    "serialize_with_callbacks",
]

from ._internals import callback as _callback  # noqa: E402
from ._internals import debugging as _debugging  # noqa: E402
from ._internals import dtypes as _dtypes  # noqa: E402
from ._internals import xla_client as _xc  # noqa: E402


class CallbacksNotRebindable(Exception):
    """A compiled program's host callbacks cannot be rebound in another process."""


# What the lowering rules of JAX's callback primitives run on the host for an
# equation (``pure_callback_lowering``, ``io_callback_lowering``,
# ``debug_callback_lowering``, ``debug_print_lowering_rule``): the primitive's
# implementation on the host arguments, with the equation's parameters. The
# primitives' own ``impl`` of pure and io callbacks dispatches a jit, so the
# module functions are named. A JAX without one of them rebinds the others.
_HOST_IMPLS: dict[str, Callable[..., Any]] = {
    name: impl
    for name, impl in (
        ("pure_callback", getattr(_callback, "pure_callback_impl", None)),
        ("io_callback", getattr(_callback, "io_callback_impl", None)),
        ("debug_callback", getattr(_debugging, "debug_callback_impl", None)),
        ("debug_print", getattr(_debugging, "debug_print_impl", None)),
    )
    if impl is not None
}


def is_callback_equation(eqn: Any) -> bool:
    """Whether ``eqn`` calls back into Python (see ``has_host_callbacks``)."""
    from ._jaxpr import _is_callback

    return _is_callback(eqn.primitive)


def callback_functions(eqn: Any) -> list[Any]:
    """The Python functions a callback equation runs: the callables in its
    parameters and, through partials, JAX's flattening wrappers and closure
    cells, the functions they call (the user's function among them)."""
    return _walk(eqn)[0]


def callback_arguments(eqn: Any) -> list[Any]:
    """The values partials in a callback equation bind (``partial(np.multiply,
    2.0)``'s ``2.0``): what the callback computes with besides its inputs."""
    return _walk(eqn)[1]


def _walk(eqn: Any) -> tuple[list[Any], list[Any]]:
    found: list[Any] = []
    bound: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(v, 0) for v in eqn.params.values()]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or depth > 4 or len(seen) > 200:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            found.append(obj)
            for cell in obj.__closure__ or ():
                try:
                    stack.append((cell.cell_contents, depth + 1))
                except ValueError:  # an empty cell
                    continue
        elif isinstance(obj, types.MethodType):
            found.append(obj)
        elif hasattr(obj, "func") and hasattr(obj, "args") and hasattr(obj, "keywords"):
            stack.append((obj.func, depth + 1))
            stack.extend((a, depth + 1) for a in obj.args)
            stack.extend((v, depth + 1) for v in obj.keywords.values())
            bound.extend(a for a in (*obj.args, *obj.keywords.values()) if not callable(a))
        elif hasattr(obj, "callback_func"):  # jax's _FlatCallback
            stack.append((obj.callback_func, depth + 1))
        elif callable(obj) and not isinstance(obj, type):
            found.append(obj)
    return found, bound


def rebind_unsupported() -> str | None:
    """Why executables with host callbacks cannot be loaded in another process with
    this JAX and backend (the active compile target's, if any), or ``None`` if they can."""
    device = target_devices()[0]
    backend = device.client
    doc = getattr(backend.deserialize_executable, "__doc__", "") or ""
    if "host_callbacks" not in doc:
        return f"jaxlib {jax.__version__} cannot bind host callbacks to a deserialized executable"
    platform = device.platform
    if platform not in ("cpu", "gpu", "cuda", "rocm"):
        return f"host callbacks on {platform} are channels compiled into the program"
    return None


# (component, program digest) -> the program's callback equations, in canonical
# order, and the witness of the objects their callbacks see; ``None`` equations
# for an ambiguous program. Bounded: a process that traces more programs forgets
# the oldest (a load of a forgotten one compiles instead).
_MAX_PROGRAMS = 4096
_programs: collections.OrderedDict[tuple[str, str], tuple[tuple[Any, ...] | None, Hashable]] = (
    collections.OrderedDict()
)
_programs_lock = threading.Lock()


def register_program(
    component: str, program: str, eqns: Sequence[Any], witness: Hashable = None
) -> None:
    """Records the callback equations of the program with digest ``program`` traced
    for ``component`` (this process's Python objects), in canonical order.
    ``witness`` names the objects the callbacks see (closure values): a new trace
    with the same witness replaces the old one (the same callbacks), one with
    another makes the program ambiguous (two components of one name and program
    whose callbacks see different objects): it is then never rebound here."""
    if not eqns:
        return
    slot = (component, program)
    with _programs_lock:
        old = _programs.get(slot)
        if old is not None and (old[0] is None or old[1] != witness):
            _programs[slot] = (None, old[1])
        else:
            _programs[slot] = (tuple(eqns), witness)
        _programs.move_to_end(slot)
        while len(_programs) > _MAX_PROGRAMS:
            _programs.popitem(last=False)


def _registered(component: str, program: str) -> tuple[Any, ...]:
    with _programs_lock:
        found = _programs.get((component, program))
    if found is None:
        raise CallbacksNotRebindable(
            f"component {component!r}: the program {program[:16]} was not traced in this process"
        )
    if found[0] is None:
        raise CallbacksNotRebindable(
            f"component {component!r}: the program {program[:16]} was traced with "
            "callbacks that see different objects"
        )
    return found[0]


def _host_function(eqn: Any) -> Callable[..., Any]:
    """What the lowering of ``eqn`` hands to XLA as its host callback (the checks of
    JAX's ``callback.emit_python_callback`` included)."""
    impl = _HOST_IMPLS.get(eqn.primitive.name)
    if impl is None:
        raise CallbacksNotRebindable(f"no host implementation of {eqn.primitive.name}")
    params = dict(eqn.params)
    result_avals = [v.aval for v in eqn.outvars]

    def host(*args: Any) -> tuple[Any, ...]:
        outs = impl(*args, **params)
        outs = () if outs is None else tuple(outs)
        if len(outs) != len(result_avals):
            raise RuntimeError(
                "Mismatched number of outputs from callback. "
                f"Expected: {len(result_avals)}, Actual: {len(outs)}"
            )
        values = tuple(_dtypes.canonicalize_value(np.asarray(a)) for a in outs)
        for i, (value, aval) in enumerate(zip(values, result_avals, strict=True)):
            if value.shape != aval.shape:
                raise RuntimeError(
                    f"Incorrect output shape for return value #{i}: "
                    f"Expected: {aval.shape}, Actual: {value.shape}"
                )
            if value.dtype != aval.dtype:
                raise RuntimeError(
                    f"Incorrect output dtype for return value #{i}: "
                    f"Expected: {aval.dtype}, Actual: {value.dtype}"
                )
        return values

    return host


def _rebound_callback(component: str, program: str, index: int) -> Callable[..., Any]:
    """Unpickling a host callback: the one built from this process's equation."""
    return _host_function(_registered(component, program)[index])


def _rebound_executable(
    payload: bytes,
    component: str,
    program: str,
    indices: tuple[int, ...],
    device_ids: tuple[int, ...] | None = None,
) -> Any:
    """Unpickling the XLA executable: deserialized with this process's callbacks
    bound, on the default backend's devices it was compiled for (all of them, in
    their order, for an entry that does not name them)."""
    eqns = _registered(component, program)
    return _deserialized(payload, [_host_function(eqns[i]) for i in indices], device_ids)


def _deserialized(
    payload: bytes, callbacks: Sequence[Any], device_ids: tuple[int, ...] | None
) -> Any:
    backend = jax.devices()[0].client
    by_id = {d.id: d for d in backend.devices()}
    chosen = backend.devices() if device_ids is None else [by_id[i] for i in device_ids]
    devices = _xc.DeviceList(tuple(chosen))
    return backend.deserialize_executable(payload, devices, None, list(callbacks))


_ATOMS = (type(None), bool, int, float, complex, str, bytes)


def _reachable(obj: Any, limit: int = 400) -> dict[int, Any]:
    """The objects a host callback reaches through closures and partials, by id,
    in the order they are reached."""
    seen: dict[int, Any] = {}
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack and len(seen) < limit:
        o, depth = stack.pop()
        if id(o) in seen or depth > 6:
            continue
        seen[id(o)] = o
        if isinstance(o, types.FunctionType):
            for cell in o.__closure__ or ():
                try:
                    stack.append((cell.cell_contents, depth + 1))
                except ValueError:
                    continue
            stack.extend((d, depth + 1) for d in o.__defaults__ or ())
        elif isinstance(o, types.MethodType):
            stack.append((o.__func__, depth + 1))
            stack.append((o.__self__, depth + 1))
        elif hasattr(o, "func") and hasattr(o, "args") and hasattr(o, "keywords"):
            stack.append((o.func, depth + 1))
            stack.extend((a, depth + 1) for a in o.args)
            stack.extend((v, depth + 1) for v in o.keywords.values())
        elif hasattr(o, "callback_func"):  # jax's _FlatCallback
            stack.append((o.callback_func, depth + 1))
        elif isinstance(o, dict):
            stack.extend((v, depth + 1) for v in o.values())
        elif isinstance(o, list | tuple):
            stack.extend((v, depth + 1) for v in o)
    return seen


def _match(host_callbacks: Sequence[Any], eqns: Sequence[Any]) -> tuple[int, ...]:
    """For each host callback of a compiled program, the index of the equation it
    was lowered from: the one whose parameter objects it reaches. Equations whose
    reached objects tie are interchangeable (they share them)."""
    keyed = [
        [id(v) for v in eqn.params.values() if not isinstance(v, _ATOMS) and v is not None]
        for eqn in eqns
    ]
    indices = []
    for host in host_callbacks:
        reach = _reachable(host)
        scores = [sum(i in reach for i in ids) for ids in keyed]
        best = max(scores, default=0)
        if best == 0:
            raise CallbacksNotRebindable(
                "one of its host callbacks comes from no callback of its traced program "
                "(JAX or a library added it while lowering, as lineax's solves do), so a "
                "new process could not bind it"
            )
        tied = [k for k, s in enumerate(scores) if s == best]
        first = tied[0]
        if any(
            keyed[k] != keyed[first] or eqns[k].primitive is not eqns[first].primitive for k in tied
        ):
            raise CallbacksNotRebindable(
                "two of its host callbacks reach the same Python objects, so a new process "
                "could not tell which is which"
            )
        if eqns[first].primitive.name not in _HOST_IMPLS:
            raise CallbacksNotRebindable(
                f"host callbacks of {eqns[first].primitive.name} cannot be rebound"
            )
        indices.append(first)
    return tuple(indices)


def serialize_with_callbacks(compiled: Any, component: str, program: str) -> bytes:
    """``compiled`` (a ``jax.stages.Compiled`` of the program with digest
    ``program``, registered for ``component``) serialized so that
    ``deserialize_and_load`` in another process that traced the same program binds
    its own callbacks (see the module docstring).

    Raises :class:`CallbacksNotRebindable` where that cannot be done."""
    unloaded = _unloaded(compiled)
    registered = _registered(component, program)
    if any(is_ordered_effect(e) for eqn in registered for e in eqn.effects):
        # An ordered callback is lowered with a token in and out, which the
        # function rebuilt from its equation does not take or give back.
        raise CallbacksNotRebindable("the program has an ordered callback")
    hosts = list(unloaded.host_callbacks)
    indices = _match(hosts, registered)
    by_id = {id(h): i for h, i in zip(hosts, indices, strict=True)}
    device_ids = tuple(d.id for d in unloaded.device_list)
    return _pickled(
        compiled,
        unloaded,
        lambda blob: (_rebound_executable, (blob, component, program, indices, device_ids)),
        lambda i: (_rebound_callback, (component, program, by_id[i])),
        {id(h) for h in hosts},
    )


def serialize_relowered(compiled: Any) -> bytes:
    """``compiled`` serialized so that a process loading it binds the host
    callbacks of its own lowering of the program (:func:`relowering`), each in
    its place: for callbacks that no equation of the traced program makes (a
    library's primitive adds them while it is lowered, as lineax's solves do).
    Where the callbacks of that lowering are not these, by number and by the
    functions they call, the load fails (and the program is compiled).

    Raises :class:`CallbacksNotRebindable` where that cannot be done."""
    unloaded = _unloaded(compiled)
    hosts = list(unloaded.host_callbacks)
    names = tuple(_callback_name(h) for h in hosts)
    device_ids = tuple(d.id for d in unloaded.device_list)
    index = {id(h): i for i, h in enumerate(hosts)}
    return _pickled(
        compiled,
        unloaded,
        lambda blob: (_relowered_executable, (blob, names, device_ids)),
        lambda i: (_relowered_callback, (index[i],)),
        set(index),
    )


def holds_host_callbacks(compiled: Any) -> bool:
    """Whether a ``jax.stages.Compiled`` calls back into Python: its traced
    program's callbacks, or callbacks its lowering added."""
    return bool(getattr(_unloaded_of(compiled), "host_callbacks", None))


def _unloaded_of(compiled: Any) -> Any:
    return getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)


def _unloaded(compiled: Any) -> Any:
    """The unloaded executable of ``compiled``, whose host callbacks can be bound
    again in another process; else :class:`CallbacksNotRebindable`."""
    reason = rebind_unsupported()
    if reason is not None:
        raise CallbacksNotRebindable(reason)
    if not holds_host_callbacks(compiled):
        raise CallbacksNotRebindable("the executable holds no host callbacks to rebind")
    unloaded = _unloaded_of(compiled)
    mut = getattr(unloaded, "mut", None)
    if mut is not None and getattr(mut, "in_mut", None):
        raise CallbacksNotRebindable("the executable closes over a mutable array")
    if getattr(unloaded, "keepalive", None):
        raise CallbacksNotRebindable("the executable keeps Python objects alive")
    if compiled._params.const_args:
        raise CallbacksNotRebindable("the executable has constant arguments")
    return unloaded


def _pickled(
    compiled: Any,
    unloaded: Any,
    executable: Callable[[bytes], tuple[Any, ...]],
    callback: Callable[[int], tuple[Any, ...]],
    hosts: set[int],
) -> bytes:
    """``compiled``'s fields (of its ``unloaded`` executable) pickled as JAX
    pickles them, but for its XLA executable (reduced by ``executable`` from its
    bytes) and its host callbacks (ids ``hosts``, each reduced by ``callback``
    from its id)."""
    from jax.experimental import serialize_executable as _se

    args_info_flat, _ = jax.tree_util.tree_flatten(compiled.args_info)

    class Pickler(_se._JaxPjrtPickler):  # type: ignore[misc,name-defined]
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, _xc.LoadedExecutable):
                return None  # pickled by reducer_override, with its callbacks
            return super().persistent_id(obj)

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, _xc.LoadedExecutable):
                return executable(obj.serialize())
            if id(obj) in hosts:
                return callback(id(obj))
            return NotImplemented

    try:
        fields = executable_fields(unloaded, args_info_flat, compiled._no_kwargs)
    except ValueError as e:
        raise CallbacksNotRebindable(str(e)) from None
    with io.BytesIO() as file:
        Pickler(file).dump(fields)
        return file.getvalue()


def _callback_name(host: Any) -> str:
    """The functions a host callback calls (JAX's wrappers left out), by module,
    name and the version of the package that holds them: what tells two
    lowerings' callbacks apart (a library's, after an upgrade, among them)."""
    return ",".join(
        f"{f.__module__}.{f.__qualname__}@{_version(f.__module__)}"
        for f in _reachable(host).values()
        if isinstance(f, types.FunctionType)
        and not (f.__module__ or "").startswith(("jax.", "jaxlib."))
    )


def _version(module: str | None) -> str:
    package = sys.modules.get((module or "").partition(".")[0])
    return str(getattr(package, "__version__", ""))


def lowered_host_callbacks(lowered: Any) -> list[Any]:
    """The host callbacks a ``jax.stages.Lowered`` hands XLA, in their order."""
    compile_args = getattr(getattr(lowered, "_lowering", None), "compile_args", None) or {}
    return list(compile_args.get("host_callbacks", ()))


class _Relowering:
    """The host callbacks of this process's lowering of a program being loaded:
    lowered once, when its executable asks for them."""

    def __init__(self, lower: Callable[[], Sequence[Any]]) -> None:
        self.lower = lower
        self.callbacks: list[Any] | None = None

    def take(self) -> list[Any]:
        if self.callbacks is None:
            try:
                self.callbacks = list(self.lower())
            except Exception as e:  # a miss here, never a damaged entry
                raise CallbacksNotRebindable(
                    f"lowering the program again failed ({type(e).__name__}: {e})"
                ) from e
        return self.callbacks


_RELOWERING: contextvars.ContextVar[_Relowering | None] = contextvars.ContextVar(
    "jaxaot_relowering", default=None
)


@contextlib.contextmanager
def relowering(lower: Callable[[], Sequence[Any]]) -> Iterator[None]:
    """While the block loads a program's executable stored by
    :func:`serialize_relowered`, ``lower`` gives the host callbacks of this
    process's lowering of that program (lowered, not compiled; only if the
    executable needs them)."""
    token = _RELOWERING.set(_Relowering(lower))
    try:
        yield
    finally:
        _RELOWERING.reset(token)


def _relowered(names: tuple[str, ...] | None = None) -> list[Any]:
    found = _RELOWERING.get()
    if found is None:
        raise CallbacksNotRebindable(
            "its host callbacks come from lowering the program, which this load does not do"
        )
    callbacks = found.take()
    if names is not None and tuple(_callback_name(c) for c in callbacks) != names:
        raise CallbacksNotRebindable(
            "the host callbacks of this process's lowering of the program are not those "
            "it was compiled with"
        )
    return callbacks


def _relowered_callback(index: int) -> Callable[..., Any]:
    """Unpickling a host callback: this process's lowering's, at its place."""
    return _relowered()[index]  # type: ignore[no-any-return]


def _relowered_executable(
    payload: bytes, names: tuple[str, ...], device_ids: tuple[int, ...]
) -> Any:
    """Unpickling the XLA executable: deserialized with the callbacks of this
    process's lowering bound, on the devices it was compiled for."""
    return _deserialized(payload, _relowered(names), device_ids)


def binds_callbacks(payload: bytes) -> bool:
    """Whether a serialized executable binds this process's host callbacks when it
    is loaded (``serialize_with_callbacks``'): those of a program this process
    must have traced first."""
    return any(f.__name__.encode() in payload for f in (_rebound_executable, _relowered_executable))


def called_callbacks(call: Any) -> list[Any]:
    """The callback equations of the entry a component call (the ``call`` parameter
    of a ``jaxaot_component`` equation) runs, where that entry is kept in its
    process for them (it is lowered inline into its caller, callbacks and all):
    in walk order, through the components it calls in turn."""
    entry: Any = getattr(call, "entry", None)
    jaxpr = getattr(entry, "jaxpr", None)
    if not getattr(entry, "host_callbacks", False) or jaxpr is None:
        return []
    found = []
    stack = [jaxpr]
    while stack:
        for j in walk_jaxprs(stack.pop()):
            for eqn in j.eqns:
                if is_callback_equation(eqn):
                    found.append(eqn)
                inner = component_callback_jaxpr(eqn)
                if inner is not None:
                    stack.append(inner)
    return found


def callback_equations(closed: Any) -> list[Any]:
    """The callback equations a program lowers: its own, at any depth, then those
    of the components it calls that are lowered inline with their callbacks (see
    :func:`called_callbacks`), as a compiled program holds them."""
    found = []
    for j in walk_jaxprs(closed):
        for eqn in j.eqns:
            if is_callback_equation(eqn):
                found.append(eqn)
            elif eqn.primitive.name == "jaxaot_component":
                found.extend(called_callbacks(eqn.params["call"]))
    return found
