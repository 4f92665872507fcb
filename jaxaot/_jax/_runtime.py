"""JAX's runtime and configuration state, as jaxaot reads it: lowering platform
names, the tracing context ``jax.jit``'s caches key on, the concrete shardings
JAX's device assignment sees in a jaxpr, the distributed runtime's key-value
client, one ``AutoLayout`` (types made again by pickling compare equal),
serialized executables, JAX's C++ dispatcher over executables, and the
compiler flags that key an executable.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Sharding

from ._internals import config as _config
from ._internals import internal
from ._internals import xla_bridge as _xb
from ._target import target_platform

logger = logging.getLogger("jaxaot")

__all__ = [
    "EXCLUDED_FLAGS",
    "KNOWN_PLATFORMS",
    "canonical_platform",
    "compile_flags",
    "cpp_dispatcher",
    "default_platform",
    "api_boundary",
    "deserialize_executable",
    "executable_fields",
    "hide_internal_frames",
    "jit_disabled",
    "jax_explains_misses",
    "jax_explanations_off",
    "nan_found",
    "executable_devices",
    "distributed_client",
    "donates_negative_argnums",
    "explicit_mesh_axes_in_scope",
    "fastpath_miss",
    "named_shardings",
    "one_auto_layout",
    "serialize_executable",
    "trace_context",
    "trace_context_items",
]

# -- platform names --------------------------------------------------------------

KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def canonical_platform(platform: str) -> str:
    """Maps a backend or device platform name ("gpu", "cuda", "cpu") to its lowering name."""
    try:
        return str(_xb.canonicalize_platform(platform))
    except Exception:  # an unknown platform name: keep it as given
        return platform.lower()


def default_platform() -> str:
    """The lowering platform of the active compile target (``_target``), else of
    JAX's default backend on this machine."""
    return target_platform() or canonical_platform(jax.default_backend())


# -- what jax.jit's caches key on --------------------------------------------------


def trace_context() -> Any:
    """The configuration state ``jax.jit``'s caches key on (x64, matmul precision,
    dtype and rank promotion, PRNG implementation, the axis environment, ...):
    hashable, for in-process tables."""
    return _config.trace_context()


def thread_options() -> tuple[tuple[Any, Any], ...]:
    """The JAX options this thread set for itself (``with jax.enable_x64(True):``,
    ``jax.numpy_dtype_promotion("strict")``...), as ``(state, value)`` pairs: JAX
    keeps them per thread, so a job run on another thread would not see them."""
    unset = _config.config_ext.unset
    holders = getattr(_config.config, "_value_holders", {})
    found = []
    for holder in holders.values():
        if isinstance(holder, _config.State):
            value = holder.get_local()
            if value is not unset:
                found.append((holder, value))
    return tuple(found)


@contextlib.contextmanager
def options_set(options: Sequence[tuple[Any, Any]]) -> Iterator[None]:
    """Sets ``options`` (from :func:`thread_options`) for this thread, as JAX's
    own context managers set them, during the block."""
    unset = _config.config_ext.unset
    done: list[tuple[Any, Any]] = []
    try:
        for state, value in options:
            done.append((state, state.swap_local(value)))
            if state._update_thread_local_hook:
                state._update_thread_local_hook(value)
        yield
    finally:
        for state, previous in reversed(done):
            state.set_local(previous)
            if state._update_thread_local_hook:
                state._update_thread_local_hook(None if previous is unset else previous)


#: The x86 flags of ``/proc/cpuinfo`` that name instruction-set extensions (those
#: XLA:CPU compiles for), not the kernel's and hypervisor's own flags.
_X86_ISA = re.compile(
    r"(sse\w*|pni|ssse3|avx\w*|fma\w*|f16c|bmi\d|adx|v?aes|v?pclmulqdq|popcnt|abm|movbe|"
    r"sha_ni|gfni|amx\w*|cx16|prefetchw|rdrand|rdseed|clflushopt|clwb|movdir\w*|serialize)"
)


@functools.cache
def host_cpu_text() -> str:
    """This machine's CPU as its executables depend on it: the architecture and
    (a digest of) its instruction-set extensions. XLA:CPU compiles for the
    host's extensions, and its loader refuses an executable that uses one this
    CPU lacks (some jaxlib versions crash instead)."""
    import hashlib
    import platform

    machine = platform.machine()
    features: list[str] = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):  # (x86, Arm)
                    features = value.split()
                    break
    except OSError:
        pass
    if machine in ("x86_64", "AMD64", "i686"):
        features = [f for f in features if _X86_ISA.fullmatch(f)]
    if not features:
        # No flags to read (macOS, Windows, or a CPU /proc lists none of): the
        # processor's own name, which tells its generations apart.
        features = [_processor_name() or "unknown"]
    digest = hashlib.sha256(" ".join(sorted(set(features))).encode()).hexdigest()[:16]
    return f"{machine} {digest}"


def _processor_name() -> str:
    import platform
    import subprocess

    if sys.platform == "darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor()


def local_accelerator() -> str | None:
    """The platform of this machine's accelerator (``"cuda"``, ``"tpu"``), from its
    devices alone (JAX's own checks: nothing is started, no device is locked),
    or None."""
    hardware_utils = internal("hardware_utils")

    if hardware_utils.has_visible_nvidia_gpu():
        return "cuda"
    if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
        return "tpu"
    return None


def accelerator_left_out() -> str | None:
    """Why JAX runs on the CPU although this machine has an accelerator (its
    backend failed to start, which JAX only logs before falling back), or None.

    A process that fell back compiles for the CPU: its entries are keyed for the
    CPU, and none of them serves a deployment on the accelerator."""
    if jax.default_backend() != "cpu":
        return None
    platform = local_accelerator()
    error = getattr(_xb, "_backend_errors", {}).get(platform) if platform else None
    return None if error is None else f"its {platform} backend failed to start ({error.strip()})"


def trace_context_items() -> tuple[tuple[str, Any], ...]:
    """:func:`trace_context` option by option: ``(name, value)`` pairs, the values
    as JAX holds them (enums, meshes, the axis environment...)."""
    names = getattr(_config, "trace_context_names", ())
    names = tuple(names() if callable(names) else names)
    values = tuple(trace_context())
    return tuple(
        (str(names[i]) if i < len(names) else f"context[{i}]", v) for i, v in enumerate(values)
    )


def explicit_mesh_axes_in_scope() -> frozenset[Any]:
    """The explicit mesh axes a ``vmap`` in scope maps over (empty outside one)."""
    from ._internals import core as _core

    env = _core.get_axis_env()
    return frozenset(getattr(env, "explicit_mesh_axis_names", ()) or ())


# -- devices -------------------------------------------------------------------------


def named_shardings(closed: Any) -> list[Any]:
    """The shardings over concrete devices that ``jax.jit`` takes into account when
    it chooses the devices of a computation holding ``closed`` (a closed jaxpr or
    a jaxpr): those of sharding constraints, nested ``jit`` calls, ``shard_map``
    over a concrete mesh and ``device_put`` to a memory kind, nested jaxprs
    included; in the order JAX finds them."""
    from ._internals import dispatch

    jaxpr = getattr(closed, "jaxpr", closed)
    return [s for s, _ in dispatch.get_intermediate_shardings(jaxpr) if isinstance(s, Sharding)]


def distributed_client() -> Any | None:
    """The client of a multi-process job's key-value store, or ``None`` outside one
    (a single process, or a runtime without a client)."""
    try:
        if jax.process_count() <= 1:
            return None
        distributed = internal("distributed")  # the runtime client is not public API

        return distributed.global_state.client
    except Exception:  # not initialized, or an older runtime without a client
        return None


# -- layouts -------------------------------------------------------------------------


def one_auto_layout() -> None:
    """Makes JAX's ``AutoLayout`` one object however it is made (unpickled with
    an executable's metadata, copied), equal to and hashing as itself: the
    singleton JAX means it to be. Nothing to do where JAX has no such class.

    Newer JAX puts a layout on every type, ``AutoLayout`` by default: an instance
    that compares by identity, of a class that pickling or copying instantiates
    again. The outputs of an executable loaded from its serialization (a warm
    process) would then have types unequal to the same types of any other
    array, and every signature built from them would miss."""
    try:
        _layout = internal("layout")
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


# -- executables ------------------------------------------------------------------


def serialize_executable(compiled: Any) -> tuple[bytes, Any, Any]:
    """(payload, in_tree, out_tree) of a ``jax.stages.Compiled``."""
    from jax.experimental import serialize_executable as _se

    return _se.serialize(compiled)  # type: ignore[no-any-return]


def deserialize_executable(payload: bytes, in_tree: Any, out_tree: Any) -> Any:
    """A loaded ``jax.stages.Compiled`` from ``serialize_executable``'s payload (or
    ``serialize_with_callbacks``'), on the devices it was compiled for.

    The payload is JAX's own format (it includes a pickle of the executable's
    metadata): call this only on bytes whose checksum or signature verified."""
    from jax.experimental import serialize_executable as _se

    if any(marker in payload for marker in _lapack_kernels()):
        _lapack_ready()
    devices = executable_devices(payload)
    return _se.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)


_LAPACK = threading.Event()


@functools.cache
def _lapack_kernels() -> tuple[bytes, ...]:
    """How a serialized XLA:CPU executable names the LAPACK kernels it may call:
    the FFI targets jaxlib registers (stored as plain strings), most of them
    ``lapack_*``. Setting the kernels up imports SciPy, which costs a warm start
    about as much as loading its executables (``jaxaot bench precompile``'s load
    limit), so it is done only for a program that names one."""
    names: list[str] = []
    try:
        _lapack_lib = internal("lib.lapack")
        names = [str(name) for name in _lapack_lib._lapack.registrations()]
    except Exception:  # pragma: no cover - a jaxlib that lists them otherwise
        names = ["tridiagonal_solve_perturbed_ffi"]
    return (b"lapack_", *sorted({n.encode() for n in names if not n.startswith("lapack_")}))


def _lapack_ready() -> None:
    """XLA:CPU programs call LAPACK (``jnp.linalg``, a Newton solve's LU) through
    kernels JAX sets up when it first lowers such an op: an executable loaded in
    a process that lowered none called an unset kernel and crashed the process.
    They are set up before loading an executable that calls one (as JAX's own
    export sets them up before any load)."""
    if _LAPACK.is_set():
        return
    try:
        _linalg = internal("lax.linalg")
        _linalg.initialize_lapack()
    except Exception:  # pragma: no cover - a JAX without LAPACK kernels to set up
        logger.debug("jaxaot: LAPACK kernels not set up", exc_info=True)
    _LAPACK.set()


def executable_devices(payload: bytes) -> list[Any]:
    """The devices, in order, of the executable serialized in ``payload``.

    ``deserialize_and_load`` otherwise loads an executable onto all the devices of
    the backend, in their default order: one compiled for a few of them, another
    order of them, or one device other than the first then fails (or aborts the
    process) when it runs. Read from the pickled metadata, without loading the
    executable (nor rebinding callbacks)."""
    import io

    from jax.experimental import serialize_executable as _se

    backend = jax.devices()[0].client
    if len(backend.devices()) == 1:  # the one device: nothing to read
        return list(backend.devices())

    class Devices(_se._JaxPjrtUnpickler):  # type: ignore[misc,name-defined]
        def persistent_load(self, pid: Any) -> Any:
            return None if pid[0] == "exec" else super().persistent_load(pid)

        def find_class(self, module: str, name: str) -> Any:
            if module == f"{__package__}._callbacks" and name.startswith("_rebound_"):
                return _nothing
            return super().find_class(module, name)

    unloaded = unloaded_of(Devices(io.BytesIO(payload), backend).load())
    devices = list(getattr(unloaded, "device_list", None) or ())
    return devices or list(backend.devices())


#: The versions of JAX's executable format (``serialize_executable``'s pickled
#: tuple) that jaxaot reads and writes: JAX before it versioned the format
#: pickles ``(unloaded, args_info, no_kwargs)``; version 3 (jax 0.12.1) pickles
#: ``(3, unloaded, args_info, no_kwargs, const_args)``.
_FORMATS = (None, 3)


def executable_format() -> int | None:
    """The installed JAX's executable format: its version, or ``None`` before JAX
    versioned it.

    Raises:
      ValueError: a format jaxaot does not know (a newer JAX).
    """
    from jax.experimental import serialize_executable as _se

    version = getattr(_se, "_SERIALIZATION_VERSION", None)
    if version not in _FORMATS:
        raise ValueError(f"JAX's executable format {version} is not one jaxaot knows")
    return version


def executable_fields(unloaded: Any, args_info_flat: Any, no_kwargs: bool) -> tuple[Any, ...]:
    """The tuple JAX's ``deserialize_and_load`` reads, in the installed JAX's format,
    for an executable without constant arguments.

    Raises:
      ValueError: a format jaxaot does not know.
    """
    version = executable_format()
    if version is None:
        return (unloaded, args_info_flat, no_kwargs)
    return (version, unloaded, args_info_flat, no_kwargs, [])


def unloaded_of(fields: tuple[Any, ...]) -> Any:
    """The unloaded executable in a tuple of ``executable_fields``' (either format)."""
    return fields[1] if isinstance(fields[0], int) else fields[0]


def _nothing(*args: Any) -> None:
    return None


def device_zeros(shape: Sequence[int], dtype: Any) -> jax.Array:
    """Zeros of ``shape`` and ``dtype`` on the default device, made on the host and
    put there (no XLA compile); typed PRNG keys over zero key data."""
    import numpy as np

    from ._jaxpr import PRNGKeyArray

    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        impl = dtype._impl
        data = jax.device_put(np.zeros((*shape, *impl.key_shape), np.uint32))
        return PRNGKeyArray(impl, data)  # type: ignore[no-any-return]
    return jax.device_put(np.zeros(shape, dtype))


def with_trees(compiled: Any, in_tree: Any, out_tree: Any) -> Any:
    """``compiled`` (a ``jax.stages.Compiled`` of a function of flat arrays) as one
    taking arguments whose ``(args, kwargs)`` tree is ``in_tree`` and returning
    ``out_tree``: the same loaded executable, as ``deserialize_executable`` wraps
    one, neither serialized nor loaded again."""
    infos, _ = jax.tree_util.tree_flatten(compiled.args_info)
    return jax.stages.Compiled(
        compiled._executable,
        list(compiled._params.const_args),
        in_tree.unflatten(infos),
        out_tree,
        no_kwargs=compiled._no_kwargs,
    )


def run_on_zeros(compiled: Any) -> None:
    """Runs ``compiled`` (a ``jax.stages.Compiled``) once on zeros of its input
    types on the default device, and waits for it. (XLA:CPU
    readies an executable's code on its first run; a program must not call back
    into Python: its callbacks would see the zeros.)"""
    infos = jax.tree_util.tree_leaves(compiled.args_info)
    zeros = [device_zeros(i.shape, i.dtype) for i in infos]
    args, kwargs = jax.tree_util.tree_unflatten(compiled.in_tree, zeros)
    jax.block_until_ready(compiled(*args, **kwargs))


def cpp_dispatcher(
    name: str,
    cache_miss: Callable[..., Any],
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
    function: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """A C++ dispatcher (as ``jax.jit`` uses) over many executables: calls with a
    signature it has seen (static arguments at ``static_argnums`` and
    ``static_argnames`` included, by hash and equality) run in C++; the others go
    to ``cache_miss``, which returns ``(outputs, fastpath_data_or_None, False)``
    (see ``fastpath_miss``; the executable takes the dynamic arguments alone).
    Under ``jax.disable_jit`` it calls ``function`` (the user's), as ``jax.jit``
    does."""
    _tree_util = internal("tree_util")
    _pxla = internal("interpreters.pxla")
    _jax = internal("lib._jax")

    return _jax.pjit(  # type: ignore[no-any-return]
        name,
        function,
        cache_miss,
        list(static_argnums),
        list(static_argnames),
        _pxla.JitGlobalCppCacheKeys(),
        _tree_util.dispatch_registry,
        _pxla.cc_shard_arg,
    )


def api_boundary(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` as an entry point whose errors JAX reports as it reports ``jax.jit``'s:
    without JAX's frames, nor jaxaot's (see :func:`hide_internal_frames`)."""
    return internal("traceback_util").api_boundary(fun)


def hide_internal_frames() -> None:
    """Leaves jaxaot's own frames out, as JAX leaves out its own: from the
    tracebacks of errors raised through an entry point, and from the user frame
    JAX names for an equation (a leaked tracer "created on line ...")."""
    _source_info_util = internal("source_info_util")
    _traceback_util = internal("traceback_util")

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _traceback_util.register_exclusion(package + os.sep)
    _source_info_util.register_exclusion(package + os.sep)


def jax_explains_misses() -> bool:
    """Whether ``jax_explain_cache_misses`` is on (jaxaot.jit then says why it
    traces a program again, in the user's words)."""
    return bool(_config.explain_cache_misses.value)


@contextlib.contextmanager
def jax_explanations_off() -> Iterator[None]:
    """JAX's own cache-miss explanations off, for jaxaot's traces of a program:
    each plan traces with a jit of its own, which JAX would explain as a
    function "never seen" and "maybe re-defined repeatedly", located in jaxaot
    (jaxaot.jit says what changed instead)."""
    with _config.explain_cache_misses(False):
        yield


@functools.cache
def donates_negative_argnums() -> bool:
    """Whether this JAX's ``jax.jit`` donates an argument named by a negative
    ``donate_argnums`` (counted from the last): 0.10 ignores such numbers, later
    versions count them from the end, as ``static_argnums``. Asked of
    ``jax.jit`` itself, once."""
    s = jax.ShapeDtypeStruct((), "float32")
    info = jax.jit(lambda a, b: a, donate_argnums=-1).trace(s, s).args_info
    return bool(info[0][1].donated)


def jit_disabled() -> bool:
    """Whether ``jax.disable_jit`` is on: functions then run as plain Python."""
    return bool(_config.disable_jit.value)


def nan_found(error: BaseException) -> bool:
    """Whether ``error`` is JAX's signal (under ``jax_debug_nans`` or
    ``jax_debug_infs``) that an executable produced a NaN or an infinity: ``jax.jit``
    then runs the function again op by op to raise ``FloatingPointError`` where it
    happened, and so does jaxaot."""
    return isinstance(error, internal("api_util").InternalFloatingPointError)


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


# -- compiler flags that key an executable ----------------------------------------

# The flags JAX's persistent cache leaves out of its keys because they cannot
# change the compiled code (dump and debug output, the simulated device count,
# which the device count keys anyway): ``xla_flags_to_exclude_from_cache_key``
# in JAX's own ``cache_key`` module, read from the installed JAX so that jaxaot
# leaves out exactly what that JAX leaves out. The fallback is that list as of
# jax 0.10.2, for a JAX that moved it.
_FALLBACK_EXCLUDED = (
    "--xla_dump_compress_protos",
    "--xla_dump_module_metadata",
    "--xla_dump_max_hlo_modules",
    "--xla_dump_include_timestamp",
    "--xla_dump_hlo_pass_re",
    "--xla_dump_hlo_module_re",
    "--xla_dump_hlo_snapshots",
    "--xla_dump_fusion_visualization",
    "--xla_dump_hlo_as_url",
    "--xla_dump_hlo_as_proto",
    "--xla_dump_hlo_as_text",
    "--xla_dump_hlo_as_long_text",
    "--xla_dump_hlo_as_html",
    "--xla_dump_hlo_as_dot",
    "--xla_dump_to",
    "--xla_force_host_platform_device_count",
    "--xla_dump_disable_metadata",
    "--xla_dump_hlo_pipeline_re",
    "--xla_gpu_cuda_data_dir",
    "--xla_gpu_experimental_autotune_cache_mode",
)


def _excluded_flags() -> frozenset[str]:
    try:
        cache_key = internal("cache_key")

        return frozenset(cache_key.xla_flags_to_exclude_from_cache_key)
    except (ImportError, AttributeError):
        return frozenset(_FALLBACK_EXCLUDED)


EXCLUDED_FLAGS = _excluded_flags()


def _kept(flags: Sequence[str]) -> str:
    return " ".join(f for f in flags if f.split("=", 1)[0] not in EXCLUDED_FLAGS)


def compile_flags() -> tuple[tuple[str, str], ...]:
    """The compiler flags of this process that can change compiled code, as key
    parts: ``XLA_FLAGS`` (with the ``--xla`` arguments of the command line, which
    XLA also reads) and ``LIBTPU_INIT_ARGS``, in their order, less the flags JAX's
    own cache key leaves out."""
    xla = os.environ.get("XLA_FLAGS", "").split()
    xla += [a for a in sys.argv[1:] if a.startswith("--xla")]
    return (
        ("xla_flags", _kept(xla)),
        ("libtpu_init_args", _kept(os.environ.get("LIBTPU_INIT_ARGS", "").split())),
    )
