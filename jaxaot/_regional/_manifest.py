"""A manifest of what a deployment will call, and precompiling it.

A :class:`Manifest` lists signatures: a component or ``jaxaot.jit`` function with
its arguments (``jax.ShapeDtypeStruct``s, shardings included, or arrays; static
arguments as the function takes them), added one by one (:meth:`Manifest.add`)
or as serving buckets (:meth:`Manifest.buckets`). :meth:`Manifest.precompile`
loads or compiles every executable each signature needs through the function's
own ``precompile`` (the same keys a call computes), runs nothing, and returns
when every entry is written to the active cache.

**Sharing the work.** Processes that precompile one manifest into one shared
cache in one *run* (the workers of one ``jaxaot precompile``, or processes given
the same ``run`` name) (a directory, Redis, an object store) split it by *claiming* signatures
through the cache's per-entry leases (``_caches.Leasing``, one lease per
signature, named by a digest of the run's name, the manifest's name and the
signature): a
process precompiles the signatures whose lease it takes, skips those another
one finished, and comes back to those another one holds until that one is done
or its lease is free (its holder died: a lock file unlocks at once, a Redis or
object-store lease expires after ``$JAXAOT_LEASE_TTL``), then takes it over.
Entries shared by signatures are made once all the same: every entry is made
under its own lease (``_store._once``). Worker ``w`` of ``n`` starts with the
signatures ``i`` with ``i % n == w``, so that workers rarely meet. Without
leases (a cache that lends none, ``JAXAOT_LEASE_WAIT=0``) each worker
precompiles only those.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import sysconfig
import time
import traceback
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any, NamedTuple, cast

import jax
import numpy as np

from .. import _stats
from .._caches import Held, Lease, Leasing, TieredCache
from .._component import Component
from .._keys._closure import code_digest
from .._keys._sharding import concrete_mesh, mesh_axes, mesh_text
from .._precompiled import ItemResult, PrecompileReport
from .._store._active import get_cache, using_cache
from .._store._once import drop, keep, lease_ttl, lease_wait
from .._store._writer import wait_for_writes
from ._jit import RegionalFunction

__all__ = ["Manifest", "Signature", "manifest", "raised_at"]

logger = logging.getLogger("jaxaot")

#: Seconds between looks at signatures another process holds (growing to the last).
_POLLS = (0.05, 0.1, 0.2, 0.5, 1.0)
#: The longest label a signature gets in progress lines.
_LABEL_CHARS = 100


class Signature(NamedTuple):
    """One call a deployment will make: ``function(*args, **kwargs)``, inside
    ``jax.set_mesh(mesh)`` where ``mesh`` is set (the mesh in context when the
    call was added)."""

    function: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    label: str
    mesh: Any = None


def _on_concrete_meshes(tree: Any, context: Any) -> Any:
    """``tree`` with each ShapeDtypeStruct whose sharding names an abstract mesh
    (as ``jax.eval_shape`` gives them under ``jax.set_mesh``) placed on the
    concrete mesh of the same axes: the mesh in ``context``, or one another
    argument names. A deployment's arrays are on a concrete mesh, and their
    placement is part of the keys."""
    leaves = jax.tree_util.tree_leaves(tree)
    meshes = [context] if context is not None else []
    for leaf in leaves:
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty:
            meshes.append(mesh)

    def placed(leaf: Any) -> Any:
        sharding = getattr(leaf, "sharding", None)
        if not (
            isinstance(leaf, jax.ShapeDtypeStruct)
            and isinstance(sharding, jax.sharding.NamedSharding)
            and isinstance(sharding.mesh, jax.sharding.AbstractMesh)
            and not sharding.mesh.empty
        ):
            return leaf
        for mesh in meshes:
            if mesh_axes(mesh) == mesh_axes(sharding.mesh):
                concrete = jax.sharding.NamedSharding(mesh, sharding.spec)
                return jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=concrete, weak_type=leaf.weak_type
                )
        return leaf

    return jax.tree_util.tree_map(placed, tree)


def _leaf_text(leaf: Any, width: int = 40) -> str:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        try:
            name = jax.numpy.dtype(dtype).name
        except TypeError:
            name = str(dtype)
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32"}
        return f"{short.get(name, name)}[{','.join(map(str, shape))}]"
    text = (repr(leaf).strip().splitlines() or [""])[0]
    return text if len(text) <= width else text[: width - 1] + "…"


def _arg_text(arg: Any, width: int = 40) -> str:
    """An argument in a progress line: an array's type, a static value's text (cut
    to ``width`` characters), or a tree's type and how many leaves it holds."""
    leaves = jax.tree_util.tree_leaves(arg)
    if (len(leaves) == 1 and leaves[0] is arg) or not leaves:
        return _leaf_text(arg, width)
    return f"<{type(arg).__name__} of {len(leaves)} {'leaf' if len(leaves) == 1 else 'leaves'}>"


def _leaf_identity(leaf: Any) -> str:
    """A leaf as the claims name it: shape, dtype and sharding of arrays, the
    value of anything else (static arguments)."""
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{tuple(shape)}:{dtype}:{getattr(leaf, 'sharding', None)!r}"
    return repr(leaf)


def _difference(a: Signature, b: Signature) -> str:
    """What tells the call ``b`` from ``a`` when their labels read the same: its
    mesh, or its first leaf (by path) of another type, sharding or value."""
    if a.mesh != b.mesh:
        return "no mesh" if b.mesh is None else f"mesh {mesh_axes(b.mesh)}"
    leaves_a, tree_a = jax.tree_util.tree_flatten((a.args, a.kwargs))
    with_paths, tree_b = jax.tree_util.tree_flatten_with_path((b.args, b.kwargs))
    if tree_a != cast(Any, tree_b):
        return f"another tree: {len(with_paths)} leaves"
    for x, (path, y) in zip(leaves_a, with_paths, strict=True):
        if _leaf_identity(x) == _leaf_identity(y) and getattr(x, "weak_type", False) == getattr(
            y, "weak_type", False
        ):
            continue
        text = _leaf_text(y)
        spec = getattr(getattr(y, "sharding", None), "spec", None)
        if text == _leaf_text(x) and spec is not None:
            text += f" sharded {spec}"
        return f"{_path_words(path)}: {text}"
    return "another call"


def _path_words(path: tuple[Any, ...]) -> str:
    """A leaf's path in ``(args, kwargs)`` as a call names it: ``args[1]['k']``,
    ``cache[0]``."""
    where, rest = path[0], tuple(path[1:])
    if getattr(where, "idx", None) == 0 or not rest:
        return "args" + jax.tree_util.keystr(rest)
    head = rest[0]
    return str(getattr(head, "key", head)) + jax.tree_util.keystr(rest[1:])


def _same_call(a: Signature, b: Signature) -> bool:
    """Whether two signatures are one call: one function and mesh, one tree, arrays
    of one type and sharding, and equal static values."""
    if a.function is not b.function or a.mesh != b.mesh:
        return False
    leaves_a, tree_a = jax.tree_util.tree_flatten((a.args, a.kwargs))
    leaves_b, tree_b = jax.tree_util.tree_flatten((b.args, b.kwargs))
    if tree_a != cast(Any, tree_b):
        return False
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if isinstance(x, jax.ShapeDtypeStruct | jax.Array | np.ndarray):
            if type(x) is not type(y) or (
                _leaf_identity(x),
                getattr(x, "weak_type", False),
            ) != (_leaf_identity(y), getattr(y, "weak_type", False)):
                return False
            continue
        try:
            if type(x) is not type(y) or not bool(x == y):
                return False
        except Exception:  # (no equality to trust: kept as two)
            return False
    return True


def _function_name(function: Any) -> str:
    return str(getattr(function, "name", None) or getattr(function, "__name__", None) or function)


def _check_function(function: Any, where: str) -> None:
    if isinstance(function, Component | RegionalFunction):
        return
    name = getattr(function, "__name__", None) or type(function).__name__
    raise TypeError(
        f"jaxaot.Manifest.{where}: {name!r} is a {type(function).__name__}, not a jaxaot "
        "component or jaxaot.jit function: precompile caches only what jaxaot serves; wrap "
        "it with @jaxaot.component or jaxaot.jit (a plain jax.jit function is not cached)"
    )


class Manifest:
    """The signatures a deployment will call, to precompile into a cache before
    it starts (``jaxaot precompile module:manifest``, or :meth:`precompile`).

    ``name`` names the manifest in the leases that split its signatures between
    processes: processes that precompile the same manifest into one cache give
    it the same name (``jaxaot precompile`` names it by its ``module:attr``).
    """

    def __init__(self, name: str = "manifest") -> None:
        self.name = name
        self._items: list[Signature] = []

    def __repr__(self) -> str:
        return f"<jaxaot.Manifest {self.name!r}: {len(self._items)} signatures>"

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Signature]:
        return iter(self._items)

    def __getitem__(self, index: int) -> Signature:
        return self._items[index]

    def add(self, function: Any, /, *args: Any, **kwargs: Any) -> Manifest:
        """Adds the call ``function(*args, **kwargs)``: ``function`` is a component or
        a ``jaxaot.jit`` function; array arguments are ``jax.ShapeDtypeStruct``s
        (with the shardings the deployment's arrays will have) or arrays; static
        arguments are their values. Returns the manifest. A call it holds already
        (the same function, types, shardings and static values) is not added again.

        Added inside ``with jax.set_mesh(mesh):``, the call is precompiled inside
        it too, as a deployment that calls it there (the mesh in context is part
        of the keys); ``ShapeDtypeStruct``s over an abstract mesh of that mesh's
        axes (``jax.eval_shape``'s under it) are placed on it.

        Raises:
          TypeError: ``function`` is neither a component nor a ``jaxaot.jit`` function.
        """
        _check_function(function, "add")
        return self._add(function, args, kwargs, "")

    def _add(
        self, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], note: str
    ) -> Manifest:
        """``add``, its label followed by ``note`` (a bucket's sizes) where given."""
        mesh = concrete_mesh()
        args, kwargs = _on_concrete_meshes((tuple(args), dict(kwargs)), mesh)
        for width in (40, 20, 10):  # long static values cut shorter, so every argument shows
            text = [_arg_text(a, width) for a in args]
            text += [f"{k}={_arg_text(v, width)}" for k, v in kwargs.items()]
            label = f"{_function_name(function)}({', '.join(text)})"
            if len(label) <= _LABEL_CHARS:
                break
        if len(label) > _LABEL_CHARS:
            label = label[: _LABEL_CHARS - 2] + "…)"
        base = label
        if note:
            label += f" [{note}]"
        item = Signature(function, tuple(args), dict(kwargs), label, mesh)
        # (A call added twice, buckets that repeat one: once. Only calls whose labels
        # read alike but for a note can be one call: the others are not compared.)
        if any(o.label.startswith(base) and _same_call(o, item) for o in self._items):
            return self
        alike = [o for o in self._items if o.label == label or o.label.startswith(f"{label} [")]
        if alike:  # another call that reads the same (in its trees, its mesh): told apart
            taken = {other.label for other in self._items}
            told = (f"{label} [{_difference(other, item)}]" for other in alike)
            label = next((t for t in told if t not in taken), f"{label} [call {len(alike) + 1}]")
            item = item._replace(label=label)
        self._items.append(item)
        return self

    def buckets(
        self,
        function: Any,
        make_args: Callable[[int, int], Any],
        *,
        batch: Sequence[int] = (1, 2, 4, 8),
        seq: Sequence[int] = (128, 256),
        kwargs: dict[str, Any] | None = None,
    ) -> Manifest:
        """Adds one call of ``function`` per serving bucket: for each batch size
        ``b`` in ``batch`` and sequence length ``s`` in ``seq``, the call
        ``function(*make_args(b, s), **kwargs)`` (``make_args`` returns the
        positional arguments as a tuple; anything else is the one argument).
        Returns the manifest.

        Raises:
          TypeError: ``function`` is neither a component nor a ``jaxaot.jit``
            function, or ``batch``/``seq`` hold anything but positive integers.
          Exception: what ``make_args`` raises, with a note naming the bucket.
        """
        _check_function(function, "buckets")
        for what, sizes in (("batch", batch), ("seq", seq)):
            if not isinstance(sizes, Sequence) or isinstance(sizes, str):
                raise TypeError(
                    f"jaxaot.Manifest.buckets({_function_name(function)}): {what} must be "
                    f"a sequence of positive integers (batch=(1, 2, 4)), got {sizes!r:.60}"
                )
            bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
            if bad or not len(sizes):
                raise TypeError(
                    f"jaxaot.Manifest.buckets({_function_name(function)}): {what} must be "
                    f"positive integers, got {list(sizes)!r}"
                )
        for b in batch:
            for s in seq:
                try:
                    args = make_args(b, s)
                except Exception as e:
                    e.add_note(
                        f"jaxaot.Manifest.buckets({_function_name(function)}): in make_args "
                        f"for the bucket batch {b}, seq {s}"
                    )
                    raise
                args = args if isinstance(args, tuple) else (args,)
                self._add(function, args, dict(kwargs or {}), f"batch {b}, seq {s}")
        return self

    def digest(self, index: int, run: str = "") -> str:
        """The name of signature ``index``'s claim in the precompile ``run``: the
        same in every process of that run that builds this manifest (its name, its
        size, the signature's place, function, code and arguments), a valid cache
        key. (The code: a run again under the same name after an edit is another
        claim, not one a process of the first run marked done.)"""
        item = self._items[index]
        leaves, tree = jax.tree_util.tree_flatten((item.args, item.kwargs))
        try:
            code = code_digest(item.function, with_values=True, wrapped=True)
        except Exception:  # (a function whose code cannot be read: named alone)
            code = ""
        text = "\n".join(
            [
                "jaxaot precompile claim",
                run,
                self.name,
                str(len(self._items)),
                str(index),
                _function_name(item.function),
                code,
                mesh_text(item.mesh),
                str(tree),
                *map(_leaf_identity, leaves),
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()

    # -- precompiling -----------------------------------------------------------

    def precompile(
        self,
        *,
        worker: int = 0,
        workers: int = 1,
        run: str | None = None,
        on_item: Callable[[str, ItemResult], None] | None = None,
        finished: Container[int] = (),
        raise_errors: bool = True,
    ) -> PrecompileReport:
        """Loads or compiles every executable the signatures need into the active
        cache, without running anything; returns when every entry is written.
        With a tiered cache (``JAXAOT_CACHE=redis://...`` puts the local cache
        directory before the shared store), an entry found in a faster tier is
        written to the slower ones too: the shared store ends up holding every
        entry, whatever this machine held before.

        Processes sharing one cache split the signatures between them (see the
        module's docstring) when they share one ``run`` name: give each its
        ``worker`` index of ``workers``. Without a ``run``, this call is a run of
        its own: processes still make each entry once, through the entries' own
        leases, but each of them visits every signature. A run's claims are its
        own: a later run never skips a signature because an earlier one did it
        (the code may have changed since).
        ``on_item(event, result)`` is called with ``"start"`` before a signature
        is precompiled here and ``"done"`` after (or ``"elsewhere"`` when another
        process did it), and once with ``"waiting"`` where signatures other
        processes claimed are waited for (``result.note`` says how many, and how
        long a process that stopped holds them up). Signatures whose index is in
        ``finished`` (which may grow meanwhile: ``jaxaot precompile`` adds what the
        other workers report) are skipped: a claim says "done" for a minute only,
        and this process would otherwise load what another finished before that.

        A signature that cannot be precompiled (its arguments are wrong for its
        function) does not stop the others: it is recorded as ``"failed"``, with
        its error, and the others are precompiled. Then, with ``raise_errors``
        (the default), the first such error is raised; without, the report
        lists them (``jaxaot precompile``'s workers report each one).

        Raises:
          ValueError: ``worker`` is not in ``range(workers)``.
          Exception: with ``raise_errors``, the first error a function's
            ``precompile`` raised for its arguments (a ``TypeError`` naming the
            argument's path), once every other signature is done.
        """
        if workers < 1 or not 0 <= worker < workers:
            raise ValueError(
                f"jaxaot.Manifest.precompile: worker must be in range(workers), got worker="
                f"{worker}, workers={workers}"
            )
        cache = get_cache()
        if isinstance(cache, TieredCache) and not cache.write_back:
            # (``JAXAOT_CACHE=redis://...``: a local directory before the shared
            # store.) What the local tier holds is written to the shared store too.
            with using_cache(cache.filling()):
                return self.precompile(
                    worker=worker,
                    workers=workers,
                    run=run,
                    on_item=on_item,
                    finished=finished,
                    raise_errors=raise_errors,
                )
        started = time.perf_counter()
        report = PrecompileReport(len(self._items))
        n = len(self._items)
        # Its own share first, then the others' (each worker's in turn).
        order = sorted(range(n), key=lambda i: ((i % workers - worker) % workers, i))
        run = secrets.token_hex(8) if run is None else run
        claims = isinstance(cache, Leasing) and lease_wait() > 0
        ttl = lease_ttl()

        def notify(event: str, result: ItemResult) -> None:
            if on_item is not None:
                on_item(event, result)

        def build(index: int, lease: Lease | None) -> None:
            item = self._items[index]
            notify("start", ItemResult(index, item.label, "start"))
            if lease is not None:
                keep(lease, ttl)
            try:
                result = _precompile_one(index, item)
            except Exception as e:
                # This signature fails (its arguments are wrong for its function, or
                # its compile fails here); the others go on.
                logger.debug("jaxaot precompile: %s failed", item.label, exc_info=True)
                errors.append(e)
                result = ItemResult(index, item.label, "failed", note=_error_text(e))
            except BaseException:
                # Not released: "done" would tell the others to skip it. The lease
                # unlocks when this process ends (or expires), and is taken over.
                if lease is not None:
                    drop(lease)
                raise
            report.items.append(result)
            notify("done", result)  # before the others can see it done
            if lease is not None:
                drop(lease)
                if result.state == "failed":
                    # Not released as done either: another machine of the run takes
                    # it over once this process ends, and fails (or succeeds) itself.
                    return
                try:
                    lease.release()
                except Exception as e:  # it expires, or unlocks, by itself
                    logger.debug("jaxaot: releasing %r failed: %s", lease, e)

        def elsewhere(index: int, holder: str) -> None:
            result = ItemResult(index, self._items[index].label, "elsewhere", note=holder)
            report.items.append(result)
            notify("elsewhere", result)

        errors: list[Exception] = []
        waiting: list[int] = []
        for index in order:
            if index in finished:
                continue
            mine = index % workers == worker
            if not claims:
                if mine:
                    build(index, None)
                continue
            assert isinstance(cache, Leasing)
            got = _claim(cache, self.digest(index, run), ttl)
            if isinstance(got, Held):
                if got.done:
                    elsewhere(index, got.holder)
                else:
                    waiting.append(index)
            elif got is not None or mine:
                build(index, got)
        polls = iter(_POLLS)
        pause = 0.0
        since = time.monotonic()
        bound = lease_wait()
        if waiting:  # (said: a claim of a process that died holds this one up to ``bound``)
            said = (
                f"waiting for {len(waiting)} signature(s) other processes claimed (a claim "
                f"of one that stopped is taken over after {bound:g} s)"
            )
            notify(
                "waiting",
                ItemResult(waiting[0], self._items[waiting[0]].label, "waiting", note=said),
            )
        while waiting:
            time.sleep(pause)
            pause = next(polls, _POLLS[-1])
            assert isinstance(cache, Leasing)
            still: list[int] = []
            for index in waiting:
                if index in finished:
                    continue
                got = _claim(cache, self.digest(index, run), ttl)
                if isinstance(got, Held):
                    if got.done:
                        elsewhere(index, got.holder)
                    elif time.monotonic() - since >= bound:
                        _stats.warn_once(
                            "precompile-wait",
                            f"jaxaot precompile: waited {bound:g} s ($JAXAOT_LEASE_WAIT) for "
                            f"{got.holder} to precompile {self._items[index].label}; "
                            "precompiling it here",
                        )
                        build(index, None)
                    else:
                        still.append(index)
                    continue
                if got is not None:
                    logger.debug(
                        "jaxaot precompile: took over %s from a process that stopped",
                        self._items[index].label,
                    )
                build(index, got)  # its holder stopped (or leases failed): done here
                pause = 0.0
            waiting = still
        report.seconds = time.perf_counter() - started
        if errors and raise_errors:
            if n > 1:
                errors[0].add_note(
                    f"jaxaot.Manifest.precompile: {len(report.failed)} of {n} signatures failed; "
                    "the others were precompiled"
                )
            raise errors[0]
        return report


#: The longest message of a failed signature's line (``jaxaot precompile``).
_ERROR_CHARS = 400


def _error_text(error: Exception) -> str:
    """An error as one line: its type and its message, lines joined (a message
    whose cause comes on its next line, as ``jax.jit``'s for an unhashable static
    argument, keeps it), cut at :data:`_ERROR_CHARS` characters."""
    text = " ".join(str(error).split())
    if len(text) > _ERROR_CHARS:
        text = text[: _ERROR_CHARS - 1] + "…"
    where = raised_at(error)
    return (
        type(error).__name__ + (f": {text}" if text else "") + (f" (at {where})" if where else "")
    )


def raised_at(error: BaseException) -> str | None:
    """The innermost ``file:line`` of the traceback in the user's code: not JAX's,
    jaxaot's or Python's own, and where there is one, not an installed package's
    (the user's line that called a library rather than the library's)."""
    skip = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (jax, np)) + (
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    )
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(skip + (stdlib,)) and not f.filename.startswith("<frozen")
    ]
    own = [
        f for f in frames if not any(p in f.filename for p in ("site-packages", "dist-packages"))
    ]
    if not (own or frames):
        return None
    frame = (own or frames)[-1]
    return f"{frame.filename}:{frame.lineno}"


def _claim(cache: Leasing, digest: str, ttl: float) -> Lease | Held | None:
    try:
        return cache.lease(digest, ttl)
    except Exception as e:  # no claim: this process precompiles it
        logger.debug("jaxaot precompile: no lease from %r (%s: %s)", cache, type(e).__name__, e)
        return None


def _precompile_one(index: int, item: Signature) -> ItemResult:
    """Precompiles one signature and waits for everything it started (background
    compiles and writes); what it did, from the process's fleet counters."""
    before = _stats.stats()
    start = time.perf_counter()
    # A jaxaot.jit plan's form is decided by its program: precompile makes
    # what the deployment's calls will run, the whole-program form included.
    with jax.set_mesh(item.mesh) if item.mesh is not None else contextlib.nullcontext():
        item.function.precompile(*item.args, **item.kwargs)
    wait_for_writes()
    seconds = time.perf_counter() - start
    after = _stats.stats()
    made = int(after["made_here"] - before["made_here"])
    loaded = int(after["loaded_after_wait"] - before["loaded_after_wait"])
    note = ""
    if isinstance(item.function, RegionalFunction):
        # (Under the signature's mesh, as it was precompiled.)
        with jax.set_mesh(item.mesh) if item.mesh is not None else contextlib.nullcontext():
            said = item.function.explain(*item.args, **item.kwargs)
        if said.startswith(f"jaxaot.jit {item.function.__name__}: jax.jit"):
            note = "runs under plain jax.jit: nothing of it is cached"
            _stats.warn_once(
                f"precompile-plain:{item.function.__name__}",
                f"jaxaot precompile: {item.label} {note} ({said.split(': ', 1)[1]})",
            )
    state = "made" if made else "loaded" if loaded else "plain" if note else "present"
    return ItemResult(index, item.label, state, made, loaded, seconds, note)


def manifest(name: str = "manifest") -> Manifest:
    """An empty :class:`Manifest` named ``name``."""
    return Manifest(name)
