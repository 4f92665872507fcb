"""The executables of a split program's regions: each component entry's, each
glue program's and the whole-program form's, keyed by their content and the
shardings they are compiled for; from this process, else the cache, else
compiled (and stored)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _stats
from .._caches import Cache
from .._component import Call
from .._component._flat import flat_executable, lowered
from .._component._parts import base_parts, types_text
from .._component._rules import bind
from .._jax import (
    CallbacksNotRebindable,
    callback_equations,
    default_platform,
    has_host_callbacks,
    holds_host_callbacks,
    jaxpr_program,
    lowered_host_callbacks,
    named,
    relowering,
    serialize_relowered,
    serialize_with_callbacks,
    trace_context,
)
from .._keys._callbacks import callback_witness, register_callbacks
from .._keys._key import ComponentKey, Described
from .._keys._program import program_digest
from .._keys._sharding import region_sharding_parts
from .._store import _explain
from .._store._entry import Entry
from .._store._executables import (
    executable_key,
    load_executable,
    not_serializable,
    store_executable,
)
from .._store._lookup import Codec, get_or_make
from .._store._readwrite import read_blob
from .._store._writer import in_background
from ._placement import MeshContext

__all__ = ["GLUE", "WHOLE", "ProgramCache", "program_key", "region_executable"]

logger = logging.getLogger("jaxaot")


def program_key(
    kind: str,
    digest: str,
    avals: Sequence[Any],
    donate: tuple[int, ...],
    shardings: tuple[Any, ...] | None = None,
    names: Sequence[str] | None = None,
) -> ComponentKey:
    """The key of a program (``kind``: glue, whole program) whose content ``digest``
    names, compiled for ``avals`` with ``donate``d inputs and (where given) for
    input ``shardings`` under the mesh in context. ``names``: the inputs' paths,
    for a miss's explanation (never a part of the key)."""
    parts = base_parts(default_platform())
    component = f"{kind}:{digest}"
    parts.update(
        component=Described(component, {"args": list(names)}) if names else component,
        in_tree="",
        static=(),
        args=types_text(avals),
        transform=((kind, donate),),
    )
    return executable_key(ComponentKey(parts), donate, _placement(shardings, avals))


def _placement(
    shardings: tuple[Any, ...] | None, avals: Sequence[Any]
) -> tuple[tuple[str, Any], ...]:
    """An executable's key parts for the input ``shardings`` it is compiled for,
    under the mesh in context (none when it needs none)."""
    if shardings is None:
        return ()
    texts, mesh = region_sharding_parts(shardings, [len(a.shape) for a in avals])
    return (("input_shardings", texts), ("context_mesh", mesh))


class ProgramCache:
    """Compiled programs of this process (glue programs, whole programs), by
    content; shared by all jaxaot.jit functions and kept in the cache."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._locks = _stats.KeyedLocks()
        self._exes: dict[tuple[Any, ...], Any] = {}
        # Executables loaded from a cache, by id: the cache and key they came from.
        self._loaded: dict[int, tuple[Any, ComponentKey]] = {}
        self.counters = _stats.Counters(parent=_stats.PROCESS)

    @property
    def label(self) -> str:
        """What it holds, in words: ``glue program``, ``whole program``."""
        return self.kind if self.kind.endswith("program") else f"{self.kind} program"

    def payload(self, exe: Any) -> bytes | None:
        """The serialized executable ``exe`` was loaded from (read from its cache
        again), or ``None`` if it was compiled here. A loaded executable cannot be
        serialized again on XLA:CPU (its kernels are not kept)."""
        source = self._loaded.get(id(exe))
        if source is None:
            return None
        entry = read_blob(*source)[0]
        return None if entry is None else entry.executable

    def get(
        self,
        closed: Any,
        donate: tuple[int, ...],
        shardings: tuple[Any, ...] | None = None,
        content: str | None = None,
        what: str | None = None,
        name: str | None = None,
        names: Sequence[str] | None = None,
    ) -> Any:
        """The executable of a glue program (a closed jaxpr, whose
        :func:`~jaxaot._keys._program.program_digest` is ``content``) for inputs with
        ``shardings`` (see ``program``; ``what`` and ``names``: what a miss's
        explanation calls it and its inputs; ``name``: the function it is compiled as).

        A glue program's host callbacks (diffrax's and Equinox's error checks)
        are named by their Python functions in its digest and are recorded for
        rebinding, so that it is stored and a new process loads it with its own
        callbacks bound. In this process, an executable runs the callbacks it was
        compiled with: a program whose callbacks see other objects (a closure over
        another array) is another executable here."""
        digest = program_digest(closed, what or self.kind) if content is None else content
        eqns = callback_equations(closed.jaxpr)
        if eqns:
            register_callbacks(self.kind, digest, eqns)
        return self.program(
            digest,
            tuple(closed.in_avals),
            tuple(closed.out_avals),
            donate,
            jaxpr_program(closed, name or closed.jaxpr.debug_info.func_name),
            lambda: has_host_callbacks(closed),
            shardings,
            what,
            names,
            callback_witness(eqns) if eqns else None,
        )

    def program(
        self,
        digest: str,
        avals: tuple[Any, ...],
        out_avals: tuple[Any, ...],
        donate: tuple[int, ...],
        fn: Callable[..., Any],
        callbacks: Callable[[], bool],
        shardings: tuple[Any, ...] | None = None,
        what: str | None = None,
        names: Sequence[str] | None = None,
        witness: Any = None,
    ) -> Any:
        """The executable of ``fn`` (flat arrays to a flat list) at ``avals``, whose
        content ``digest`` names: from this process, else the cache, else compiled
        (and stored unless it calls back into Python). ``shardings``: the sharding
        each input is compiled for (``None``: none needed); all ``None`` outside a
        mesh, or no ``shardings``, is the unsharded executable. ``what``: what a
        miss's explanation calls it (``jaxaot.jit step's glue program``), and
        ``names`` its inputs (their paths in the call). ``witness``: the objects its
        host callbacks see (``callback_witness``), told apart in this process only."""
        # The configuration lowering reads (the PRNG's partitioning, matmul
        # precision...) as the key's parts hold it: one jaxpr, other programs.
        memo = (digest, avals, donate, witness, trace_context())
        shardings, memo_key = _placed(shardings, memo)

        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]

        def load(cache: Cache, key: ComponentKey) -> Any:
            # (An executable whose callbacks its lowering added binds those of
            # this process's lowering: ``serialize_relowered``.)
            with relowering(
                lambda: lowered_host_callbacks(
                    lowered(fn, structs, donate, shardings, "jaxaot.jit")
                )
            ):
                loaded = load_executable(cache, key)
            if loaded is None:
                return None
            self._loaded[id(loaded[0])] = (cache, key)
            return loaded[0]

        def make() -> Any:
            self.counters.add("compiles")
            return lowered(fn, structs, donate, shardings, "jaxaot.jit").compile()

        def save(cache: Cache, key: ComponentKey, exe: Any) -> concurrent.futures.Future[None]:
            # Serialized and written while the program runs its first call.
            # Listed (``jaxaot cache ls``) under the function it was compiled as.
            name = getattr(fn, "__name__", self.kind)
            return in_background(
                key.digest,
                lambda: self._store(cache, key, exe, avals, out_avals, callbacks, name),
            )

        if what is None:
            what = f"jaxaot.jit's {self.label}"
        return get_or_make(
            self._exes,
            memo_key,
            self._locks(memo_key),
            lambda: program_key(self.kind, digest, avals, donate, shardings, names),
            Codec(f"{self.kind} executable", load, save, executable=True),
            make,
            self.counters,
            # Noted under what it is of (``jaxaot.jit step's whole program``): its
            # closest entry is one of the same function's, never another's.
            lambda key, cache: _explain.miss(what, key, cache, label=what),
        )

    def _store(
        self,
        cache: Any,
        key: ComponentKey,
        exe: Any,
        avals: tuple[Any, ...],
        out_avals: tuple[Any, ...],
        callbacks: Callable[[], bool],
        name: str,
    ) -> None:
        """Writes a compiled program; one that calls back into Python only where its
        callbacks can be bound again in another process."""
        if cache is None:
            return
        payload = self.payload(exe)
        traced = callbacks()
        if traced or holds_host_callbacks(exe):
            try:
                payload = self._with_callbacks(exe, key, traced)
            except CallbacksNotRebindable as e:
                # Said once: silence would read as a warm start to come.
                _stats.warn_once(
                    f"program-not-stored:{self.kind}:{e}",
                    f"jaxaot: the jaxaot.jit {self.label} of {name!r} calls back into "
                    f"Python and is not written to the cache ({e}); it stays in this "
                    "process, so a new process compiles it again",
                )
                return
            except Exception as e:  # XLA could not serialize it
                not_serializable(name, e)
                return
        record = Entry(
            key=key,
            name=name,
            in_avals=avals,
            out_avals=out_avals,
            out_tree=jax.tree_util.tree_structure([0] * len(out_avals)),
            arg_names=("",) * len(avals),
            result_paths=tuple(f"result[{i}]" for i in range(len(out_avals))),
        )
        store_executable(cache, key, record, exe, None, serialized=payload)

    def _with_callbacks(self, exe: Any, key: ComponentKey, traced: bool) -> bytes:
        """``exe`` serialized with its host callbacks named so that a new process
        binds its own: by the equations of its traced program where they all come
        from one (``traced``), else by that process's lowering of the program (a
        library's primitive added some while it was lowered)."""
        if traced:
            try:
                digest = str(key.parts["component"]).partition(":")[2]
                return serialize_with_callbacks(exe, self.kind, digest)
            except CallbacksNotRebindable as e:
                logger.debug("jaxaot: %s: callbacks bound by lowering again: %s", key.digest, e)
        return serialize_relowered(exe)


GLUE = ProgramCache("glue")
# Whole-program forms of split programs (see ``_whole``).
WHOLE = ProgramCache("whole program")


def region_executable(
    call: Call, shardings: tuple[Any, ...] | None = None, donate: tuple[int, ...] = ()
) -> Any:
    """An executable running one entry (``call``'s) on flat arrays, compiled for the
    input ``shardings`` (``None`` for each input that needs none; all ``None``, or
    no ``shardings``, outside a mesh: the unsharded executable, the one a
    transformed call run eagerly runs), with the inputs at ``donate`` donated
    (``_component._flat``). One compiled for some shardings is never loaded for
    others."""
    memo: Any
    shardings, memo = _placed(shardings, call.key)
    if donate:
        memo = (memo, "donate", donate)
    placement = _placement(shardings, call.entry.in_avals)
    # Named after its entry (``block``, ``checkpoint(layer) forward``), as jax.jit
    # names a program after its function: in compile logs, the profiler and HLO.
    run = named(lambda *a: bind(call, a), call.entry.name or call.component.name)
    return flat_executable(call, run, memo, shardings, placement, donate)


def _placed(shardings: tuple[Any, ...] | None, memo: Any) -> tuple[Any, Any]:
    """``shardings`` (``None`` where there are none, or all are ``None`` outside a
    mesh: the unsharded executable) and the memo key ``memo`` becomes for them
    (with the mesh in context)."""
    if shardings is None:
        return None, memo
    context = MeshContext()
    if context.empty and all(s is None for s in shardings):
        return None, memo
    return shardings, (memo, shardings, context.key())
