"""The whole-program form of a split program, with repeated layers as a loop.

A split program runs one executable per component call. When the calls are
small, the cost of entering and leaving each executable (its inputs and,
above all, its outputs) dominates the step. The whole-program form is one
executable for the entire program, in which every run of consecutive calls of
the same entry that hand a value from one to the next (the layers of a
network, forward or backward), from :data:`MIN_LOOP` layers on, is a
``lax.scan`` over that entry; so is every sequence of equations repeated
that often in a chain (a layer written as several calls and the glue between
them, :func:`periods`), over one period, where the program would otherwise
bind over :data:`MAX_WHOLE_CALLS` calls. XLA compiles
one layer, not an unrolled copy per layer, so its compile time does not grow
with depth, and a step costs what a scan over stacked layers costs. A run whose
layers each update a donated input of their own and hand it back (a decode
step's per-layer KV caches) stays unrolled: a loop would stack those inputs and
cut its outputs apart again, copying what the caller donated to be updated in
place.

Which form a program runs is decided from the program itself (:func:`form`),
when its plan is made, the same on every platform and in every process: a
program whose component calls each do little work runs as one program; one
whose calls are big runs split, each component compiled once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .._component._cost import entry_work
from .._component._rules import component_p
from .._jax import DropVar, Literal, bind_equation
from .._keys._program import program_digest
from ._chains import Group, Run, bind, periods, runs

# Part of the whole program's cache key: bump when the rewrite below changes.
WHOLE_VERSION = 9

# A program whose component calls each do less work than this (``_cost.work``:
# two per multiply-add, one per element written) runs as one program. Entering
# and leaving an executable has a fixed cost on every backend (its outputs above
# all), so a split program of such calls runs well behind one program of them,
# while for bigger calls the split program runs as fast and compiles each
# component once. Measured by ``jaxaot bench regional`` at the widths on either
# side of it (``--width 32``, ``--width 256``) against its scan contender; the
# benchmark's layers of width 64 to 128 are of about this work.
WHOLE_BELOW = 3e7
# Runs of fewer layers than this stay unrolled in the whole program: for a few
# layers, XLA compiles the unrolled program sooner than a loop over stacked
# layers (with their stacking and slicing), and it runs as fast; deeper runs are
# loops, so that compile time does not grow with depth. Measured by
# ``python benchmarks/real_models.py --layers 4 8`` (Haiku and linen blocks
# under grad, against jax.jit) and ``jaxaot bench regional --width 32``.
MIN_LOOP = 5
# A whole program binding more component calls than this once its runs are
# loops (calls that do not repeat in a chain) is not made: it would compile a
# program as big as the split program's regions together.
MAX_WHOLE_CALLS = 16


def _used_outside(items: Sequence[Any], outvars: Sequence[Any]) -> set[Any]:
    """Variables read by something other than the next member of their own run."""
    used = {v for v in outvars if not isinstance(v, Literal)}
    for item in items:
        if isinstance(item, Run):
            carried_in = {q for q, _ in item.carry}
            for k, eqn in enumerate(item.eqns):
                for q, v in enumerate(eqn.invars):
                    if not isinstance(v, Literal) and (k == 0 or q not in carried_in):
                        used.add(v)
        else:
            used.update(v for v in item.invars if not isinstance(v, Literal))
    return used


def _same(vs: Sequence[Any]) -> bool:
    first = vs[0]
    if isinstance(first, Literal):
        return all(isinstance(v, Literal) and v.val is first.val for v in vs)
    return all(v is first for v in vs)


@dataclass(frozen=True)
class _From:
    """A stacked column read from an earlier stack: ``stack[start:start + n]``,
    reversed along the layer axis if ``flip``."""

    stack: int
    start: int
    flip: bool


@dataclass
class _Loop:
    """How one run becomes a ``lax.scan``, worked out before tracing.

    ``reverse``: the scan runs from its last index to its first, so that member
    ``k`` of the run is index ``n - 1 - k`` (a backward pass, whose layers come
    in the reverse order of the forward pass that made its residuals, reads
    them in place). Each stacked input column is read from an earlier stack
    (``_From``) or stacked afresh from single values (then it is stack
    ``fresh[q]``); output ``r`` of every member is stack ``ys[r]``, in index
    order."""

    reverse: bool
    invariant: tuple[int, ...]
    columns: dict[int, _From | None]
    fresh: dict[int, int]
    ys: dict[int, int]


class _Stacks:
    """Where each variable lies in a stack (layer-axis position), as the runs are laid out."""

    def __init__(self) -> None:
        self.at: dict[Any, tuple[int, int]] = {}
        self.count = 0

    def add(self, column: Sequence[Any]) -> int:
        sid = self.count
        self.count += 1
        for pos, v in enumerate(column):
            if not isinstance(v, Literal | DropVar):
                self.at[v] = (sid, pos)
        return sid

    def in_place(self, column: Sequence[Any]) -> bool:
        """Whether ``column`` is a slice of one stack, in its order."""
        found = self.find(column)
        return found is not None and not found.flip

    def find(self, column: Sequence[Any]) -> _From | None:
        """``column`` as a slice of one stack, in order or reversed; ``None`` if it is not."""
        if any(isinstance(v, Literal) or v not in self.at for v in column):
            return None
        places = [self.at[v] for v in column]
        sid, first = places[0]
        if any(s != sid for s, _ in places):
            return None
        positions = [p for _, p in places]
        n = len(column)
        if positions == list(range(first, first + n)):
            return _From(sid, first, False)
        if positions == list(range(first, first - n, -1)):
            return _From(sid, first - n + 1, True)
        return None


def _layout(items: Sequence[Any], outvars: Sequence[Any]) -> tuple[dict[int, _Loop], set[Any]]:
    """Each run's loop (by item index), and the variables some equation or the
    program's outputs (``outvars``) read one by one (the others live only in stacks)."""
    used = _used_outside(items, outvars)
    stacks = _Stacks()
    single: set[Any] = {v for v in outvars if not isinstance(v, Literal)}
    loops: dict[int, _Loop] = {}
    for i, item in enumerate(items):
        if not isinstance(item, Run):
            single.update(v for v in item.invars if not isinstance(v, Literal))
            continue
        first = item.eqns[0]
        carried = dict(item.carry)
        single.update(first.invars[q] for q in carried if not isinstance(first.invars[q], Literal))
        invariant, stacked = [], []
        for q in range(len(first.invars)):
            if q in carried:
                continue
            column = [eqn.invars[q] for eqn in item.eqns]
            if _same(column):
                invariant.append(q)
                if not isinstance(column[0], Literal):
                    single.add(column[0])
            else:
                stacked.append((q, column))
        # Scanned forwards, how many columns lie in place in an earlier stack; and backwards.
        forward = sum(stacks.in_place(c) for _, c in stacked)
        backward = sum(stacks.in_place(c[::-1]) for _, c in stacked)
        reverse = backward > forward
        columns: dict[int, _From | None] = {}
        fresh: dict[int, int] = {}
        for q, column in stacked:
            in_order = column[::-1] if reverse else column
            columns[q] = stacks.find(in_order)
            if columns[q] is None:
                fresh[q] = stacks.add(in_order)
                single.update(v for v in in_order if not isinstance(v, Literal))
        order = item.eqns[::-1] if reverse else item.eqns
        carried_out = set(carried.values())
        ys: dict[int, int] = {}
        for r in range(len(first.outvars)):
            members = item.eqns[:-1] if r in carried_out else item.eqns
            if any(e.outvars[r] in used for e in members):  # the last one's carry is the result
                ys[r] = stacks.add([e.outvars[r] for e in order])
        loops[i] = _Loop(reverse, tuple(invariant), columns, fresh, ys)
    return loops, single


@dataclass(frozen=True)
class _Packed:
    """A stack kept as part of the rows of a packed array: layer ``k``'s value is
    ``rows[k, offset:offset + size]`` in ``shape``."""

    rows: Any
    offset: int
    shape: tuple[int, ...]


def _packable(values: Sequence[Any]) -> bool:
    """Whether a column's values can be packed: arrays of a numeric or boolean type
    of 8 bits or more (not PRNG keys, not ``int4`` or ``int2``, not Python scalars
    or NumPy constants)."""
    if not all(isinstance(v, jax.Array) for v in values):
        return False
    dtype = values[0].dtype
    # (XLA:CPU aborts on a concatenation of many values of fewer than 8 bits.)
    return (
        not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
        and jax.dtypes.itemsize_bits(dtype) >= 8
    )


#: The most values one concatenation of :func:`_pack` stacks (layers times
#: columns): a layer of very many small parameters is packed into several, as
#: one concatenation of thousands of operands is slower to build than a few.
#: Measured by ``python benchmarks/real_models.py --layers 8`` and layers of
#: hundreds of small parameters (the whole program's compile).
_MAX_PACKED = 128


def _pack(columns: dict[int, list[Any]]) -> dict[int, Any]:
    """The stacks of fresh ``columns`` (input position -> its values in loop order),
    the values of the columns of one type packed into the rows of one array (or
    of a few, :data:`_MAX_PACKED`).

    Why: XLA:CPU builds the code of a concatenation in LLVM slowly, and the
    slower the more dimensions and the smaller its operands: stacking each of a
    layer's parameters apart (a norm's scale, a bias, a weight matrix) took most
    of the compile time of a program of a few small layers. One concatenation of
    every value made flat, per type, compiles several times sooner; the loop's
    body cuts each layer's row into its values, which XLA fuses into their uses.
    Measured by ``python benchmarks/real_models.py --layers 8`` (the whole
    program's compile against the unrolled one's)."""
    stacks: dict[int, Any] = {}
    groups: dict[tuple[Any, bool], list[int]] = {}
    for q, values in columns.items():
        if _packable(values):
            groups.setdefault((values[0].dtype, jax.typeof(values[0]).weak_type), []).append(q)
        else:
            stacks[q] = jnp.stack(values)
    for group in groups.values():
        n = len(columns[group[0]])
        per = max(1, _MAX_PACKED // max(n, 1))
        for start in range(0, len(group), per):
            stacks.update(_packed(columns, group[start : start + per], n))
    return stacks


def _packed(columns: dict[int, list[Any]], members: list[int], n: int) -> dict[int, Any]:
    """The stacks of ``members`` (columns of one type) as parts of the rows of one
    concatenation."""
    flat = [
        jax.lax.reshape(columns[q][k], (columns[q][k].size,)) for k in range(n) for q in members
    ]
    rows = jax.lax.concatenate(flat, 0)
    rows = jax.lax.reshape(rows, (n, rows.size // n if n else 0))
    stacks: dict[int, Any] = {}
    offset = 0
    for q in members:
        first = columns[q][0]
        stacks[q] = _Packed(rows, offset, tuple(first.shape))
        offset += first.size
    return stacks


def _scan(
    run: Run,
    loop: _Loop,
    read: Callable[[Any], Any],
    write: Callable[[Any, Any], None],
    stacks: dict[int, Any],
    single: set[Any],
) -> None:
    first = run.eqns[0]
    n, n_in = len(run.eqns), len(first.invars)
    carried = dict(run.carry)  # input position -> output position
    invariant = {q: read(first.invars[q]) for q in loop.invariant}
    stacked = sorted(loop.columns)
    order = run.eqns[::-1] if loop.reverse else run.eqns
    fresh = _pack(
        {q: [read(eqn.invars[q]) for eqn in order] for q in stacked if loop.columns[q] is None}
    )
    # Each stacked column as (the array scanned over, where it lies in its rows);
    # columns that lie in one array, read alike, share it.
    xs: list[Any] = []
    scanned: dict[tuple[int, int, bool], int] = {}
    where: list[tuple[int, _Packed | None]] = []
    for q in stacked:
        source = loop.columns[q]
        if source is None:
            stacks[loop.fresh[q]] = stack = fresh[q]
            start, flip = 0, False
        else:
            stack, start, flip = stacks[source.stack], source.start, source.flip
        array = stack.rows if isinstance(stack, _Packed) else stack
        key = (id(array), start, flip)
        if key not in scanned:
            x = array
            if start != 0 or x.shape[0] != n:
                x = x[start : start + n]
            scanned[key] = len(xs)
            xs.append(jnp.flip(x, 0) if flip else x)
        where.append((scanned[key], stack if isinstance(stack, _Packed) else None))
    ys_at = sorted(loop.ys)
    carry_q = sorted(carried)

    def body(carry: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        ins = [invariant.get(q) for q in range(n_in)]
        for q, c in zip(carry_q, carry, strict=True):
            ins[q] = c
        for q, (i, packed) in zip(stacked, where, strict=True):
            if packed is None:
                ins[q] = x[i]
            else:
                size = math.prod(packed.shape)
                part = jax.lax.slice_in_dim(x[i], packed.offset, packed.offset + size)
                ins[q] = jax.lax.reshape(part, packed.shape)
        outs = bind(first, ins)
        return tuple(outs[carried[q]] for q in carry_q), tuple(outs[r] for r in ys_at)

    init = tuple(read(first.invars[q]) for q in carry_q)
    final, ys = jax.lax.scan(body, init, tuple(xs), length=n, reverse=loop.reverse)
    at: tuple[Any, ...] | None = None  # (made once a layer's result is cut out)
    for r, y in zip(ys_at, ys, strict=True):
        stacks[loop.ys[r]] = y
        for k, eqn in enumerate(run.eqns):
            v = eqn.outvars[r]
            if not isinstance(v, DropVar) and v in single:
                at = _positions(n, ys) if at is None else at
                i = at[n - 1 - k] if loop.reverse else at[k]
                write(v, jax.lax.dynamic_index_in_dim(y, i, keepdims=False))
    last = run.eqns[-1]
    for q, c in zip(carry_q, final, strict=True):
        if not isinstance(last.outvars[carried[q]], DropVar):
            write(last.outvars[carried[q]], c)


def _positions(n: int, stacks: Sequence[Any]) -> tuple[Any, ...]:
    """The positions ``0 .. n-1`` at which a loop's stacked results are cut into
    its layers' results, as values XLA cannot fold into constants.

    Why: XLA:CPU compiles each distinct fused computation once. A cut at a
    constant position, fused with what reads it (a layer's gradient and the
    update of that layer's parameter), is a distinct computation for every
    layer, so a looped program compiled more of them than the unrolled one,
    whose layers' computations are alike, and more the deeper it was. Cuts at
    positions it is given are one computation for every layer.

    The positions are set by a loop that runs once, which XLA cannot tell: its
    bound is a bit test that always holds, of an element of one of ``stacks``.
    Without such an element (empty stacks, or of other types), and on platforms
    other than XLA:CPU (where a loop of unknown length asks the host at each
    step), they are constants."""
    probe = next((y for y in stacks if y.size and y.dtype.name in _PROBES), None)
    if probe is None:
        return tuple(range(n))

    def unfolded(element: Any) -> tuple[Any, ...]:
        bits = jax.lax.bitcast_convert_type(
            jax.lax.convert_element_type(element, jnp.float32), jnp.uint32
        )
        once = ((bits | 1) != 0).astype(jnp.int32)
        done = jax.lax.while_loop(
            lambda c: c[0] < once,
            lambda c: (c[0] + 1, *(jnp.int32(k) for k in range(n))),
            (jnp.int32(0),) * (n + 1),
        )
        return tuple(done[1:])

    def constant(element: Any) -> tuple[Any, ...]:
        return tuple(jnp.int32(k) for k in range(n))

    element = probe[(0,) * probe.ndim]
    return tuple(jax.lax.platform_dependent(element, cpu=unfolded, default=constant))


#: The types of an element :func:`_positions` reads.
_PROBES = frozenset(
    ["bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64"]
    + ["uint8", "uint16", "uint32", "uint64"]
)


def _updates_in_place(run: Run, donated: frozenset[Any], results: frozenset[Any]) -> bool:
    """Whether some layer of ``run`` takes a donated input of its own (not one every
    layer shares, not the carry) and hands back a new value of its type as a
    result of the program (one that JAX's aliasing writes over the input)."""
    carried = {q for q, _ in run.carry}
    carried_out = {r for _, r in run.carry}
    first = run.eqns[0]
    for q in range(len(first.invars)):
        column = [eqn.invars[q] for eqn in run.eqns]
        if q in carried or _same(column):
            continue
        for eqn, v in zip(run.eqns, column, strict=True):
            if isinstance(v, Literal) or v not in donated:
                continue
            if any(
                r not in carried_out and out in results and out.aval == v.aval
                for r, out in enumerate(eqn.outvars)
                if not isinstance(out, DropVar)
            ):
                return True
    return False


def _loops(jaxpr: Any, donated: Sequence[int]) -> tuple[list[Any], bool]:
    """``jaxpr``'s equations with its runs as ``Run``s, less those that update a
    donated input in place (their calls stay one by one); and whether there were
    such runs."""
    return _find_loops(jaxpr, tuple(donated), MIN_LOOP, MAX_WHOLE_CALLS)


# A plan asks for the form, then the program, of one jaxpr: it is searched once
# (for the bounds in force). Few are kept: each holds its program's calls.
@functools.lru_cache(maxsize=4)
def _find_loops(
    jaxpr: Any, donated: tuple[int, ...], min_loop: int, most: int
) -> tuple[list[Any], bool]:
    pinned = frozenset(jaxpr.invars[i] for i in donated)
    results = frozenset(v for v in jaxpr.outvars if not isinstance(v, Literal))

    def kept(found: list[Any]) -> tuple[list[Any], bool]:
        items: list[Any] = []
        unrolled = False
        for item in found:
            if isinstance(item, Run) and pinned and _updates_in_place(item, pinned, results):
                for member in item.eqns:
                    items.extend(member.eqns if isinstance(member, Group) else [member])
                unrolled = True
            else:
                items.append(item)
        return items, unrolled

    items, unrolled = kept(runs(jaxpr.eqns, min_loop))
    if _calls(items) > most:
        # Layers of several calls are looped only where the program would
        # otherwise run split: one that runs whole with them unrolled stays so.
        items, more = kept(periods(items, min_loop))
        unrolled = unrolled or more
    return items, unrolled


def looped(jaxpr: Any, donated: Sequence[int] = ()) -> bool:
    """Whether the whole program of ``jaxpr`` has a loop (a run of at least
    :data:`MIN_LOOP` layers), or has its layers unrolled."""
    return any(isinstance(item, Run) for item in _loops(jaxpr, donated)[0])


def program(jaxpr: Any, donated: Sequence[int] = ()) -> tuple[Callable[..., list[Any]], int]:
    """A function of (inputs..., consts...) computing ``jaxpr`` with its runs as
    scans, and how many component calls it binds once traced.

    A value one run makes for every layer and a later run reads for every layer
    (the residuals a forward loop leaves for the backward loop, or the
    parameters both read) stays one stacked array between them: it is never cut
    into layers and stacked again. (A residual that is a layer's own input, its
    weights, is that input in the jaxpr: forward entries do not return it.)
    ``donated``: the positions of the donated inputs (see ``_updates_in_place``)."""
    items, _ = _loops(jaxpr, donated)
    return _program(jaxpr, items, list(jaxpr.outvars)), _calls(items)


def _calls(items: Sequence[Any]) -> int:
    """How many component calls ``items`` bind once traced (a loop binds one)."""
    return sum(
        _first_calls(item) if isinstance(item, Run) else item.primitive is component_p
        for item in items
    )


def _first_calls(run: Run) -> int:
    first = run.eqns[0]
    return first.calls if isinstance(first, Group) else 1


def _program(jaxpr: Any, items: list[Any], outvars: list[Any]) -> Callable[..., list[Any]]:
    loops, single = _layout(items, outvars)

    def fun(*args: Any) -> list[Any]:
        env: dict[Any, Any] = {}
        stacks: dict[int, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        def write(v: Any, x: Any) -> None:
            env[v] = x

        env.update(zip([*jaxpr.invars, *jaxpr.constvars], args, strict=True))
        for i, item in enumerate(items):
            if isinstance(item, Run):
                _scan(item, loops[i], read, write, stacks, single)
            else:
                outs = bind_equation(item, [read(v) for v in item.invars])
                for v, x in zip(item.outvars, outs, strict=True):
                    if not isinstance(v, DropVar):
                        env[v] = x
        return [read(v) for v in outvars]

    return fun


def digest(jaxpr: Any) -> str:
    """What the whole program is, for its cache key: the split program's canonical
    form (``program_digest``: each entry it calls by its full key)."""
    return f"v{WHOLE_VERSION}:{program_digest(jaxpr, 'a whole program')}"


def small(call: Any) -> bool:
    """Whether the component call ``call`` does work below :data:`WHOLE_BELOW`."""
    work = entry_work(call.entry)
    return work is not None and work < WHOLE_BELOW


def form(jaxpr: Any, donated: Sequence[int] = ()) -> tuple[bool, str]:
    """Whether ``jaxpr`` (a split program, its component calls at its top level,
    its inputs at ``donated`` donated) runs as one program, and why (``explain``
    says it)."""
    calls = list(
        dict.fromkeys(eqn.params["call"] for eqn in jaxpr.eqns if eqn.primitive is component_p)
    )
    if not calls:
        return False, "no component call"
    works = [entry_work(call.entry) for call in calls]
    unknown = [call.name for call, work in zip(calls, works, strict=True) if work is None]
    if unknown:
        return False, f"the work of {unknown[0]} is unknown (a while loop)"
    most = max(w for w in works if w is not None)
    if most >= WHOLE_BELOW:
        return False, f"component calls of work up to {most:.3g}, at least {WHOLE_BELOW:.3g}"
    items, unrolled = _loops(jaxpr, donated)
    n = _calls(items)
    if n > MAX_WHOLE_CALLS:
        return False, f"{n} component calls after loops, over {MAX_WHOLE_CALLS}"
    why = f"component calls of work up to {most:.3g}, below {WHOLE_BELOW:.3g}"
    if unrolled:
        why += "; layers updating a donated input in place are not looped"
    return True, why
