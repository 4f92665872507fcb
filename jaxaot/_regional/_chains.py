"""The chains of layers in a split program: calls of one entry, or sequences of
equations, repeated so that each reads what the one before it made (the layers
of a network, forward or backward). The whole-program form (``_whole``) makes
each chain a loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._component._rules import component_p
from .._jax import DropVar, Literal, bind_equation
from .._keys._program import equation_digests

__all__ = ["Group", "Run", "bind", "periods", "runs"]


@dataclass
class Run:
    """Consecutive calls of one entry; output ``r`` of each call is input ``q`` of
    the next, for every ``(q, r)`` in ``carry``."""

    eqns: list[Any]
    carry: tuple[tuple[int, int], ...]


def _carry_pairs(prev: Any, eqn: Any) -> tuple[tuple[int, int], ...] | None:
    produced = {v: r for r, v in enumerate(prev.outvars) if not isinstance(v, DropVar)}
    pairs = tuple(
        (q, produced[v])
        for q, v in enumerate(eqn.invars)
        if not isinstance(v, Literal) and v in produced
    )
    return pairs or None


def runs(eqns: Sequence[Any], min_length: int = 2) -> list[Any]:
    """``eqns`` with each run of at least ``min_length`` chained calls of one entry
    replaced by a ``Run``.

    Equations between two members that read nothing the run makes (the zero
    cotangents autodiff builds for each backward layer, for outputs nothing
    reads) do not end it: they are moved before the run, whose loop then stacks
    their values like any other per-layer input."""
    items: list[Any] = []
    i = 0
    while i < len(eqns):
        first = eqns[i]
        members, moved = [first], []
        carry: tuple[tuple[int, int], ...] | None = None
        j = i + 1
        if first.primitive is component_p:
            earlier: set[Any] = set()  # outputs of members before the previous one
            made = set(first.outvars)  # outputs of the members
            between: list[Any] = []  # equations since the last member
            while j < len(eqns):
                eqn = eqns[j]
                if eqn.primitive is not component_p:
                    if eqn.effects or any(_made_by(v, made) for v in eqn.invars):
                        break
                    between.append(eqn)
                    j += 1
                    continue
                if eqn.params["call"] != first.params["call"]:
                    break
                link = _extend(members, carry, earlier, eqn)
                if link is None:
                    break
                carry = link
                made.update(eqn.outvars)
                moved += between
                between = []
                j += 1
            j -= len(between)  # those after the last member stay after the run
        if carry is not None and len(members) >= min_length:
            items += moved
            items.append(Run(members, carry))
            i = j
        else:
            items.append(first)
            i += 1
    return items


@dataclass(eq=False)
class Group:
    """One period of a repeated sequence of equations (a layer written as several
    calls and the glue between them: a linear layer, then a batch norm, then an
    activation), taken as one call. Its inputs are the values it reads that it
    does not make, in the order its equations read them; its outputs are all its
    equations' outputs, in order. ``wiring`` says, for each input of each
    equation, where it comes from: input ``k`` of the group (an ``int``), output
    ``r`` of its equation ``j`` (``(j, r)``) or the equation's own literal
    (``None``). Alike periods have the same wiring and equations of the same
    digests (``equation_digests``), so one period's equations compute any of them."""

    eqns: list[Any]
    invars: list[Any]
    outvars: list[Any]
    wiring: tuple[tuple[int | tuple[int, int] | None, ...], ...]

    @classmethod
    def of(cls, eqns: Sequence[Any]) -> Group:
        made: dict[Any, tuple[int, int]] = {}
        invars: list[Any] = []
        wiring = []
        for j, eqn in enumerate(eqns):
            wires: list[int | tuple[int, int] | None] = []
            for v in eqn.invars:
                if isinstance(v, Literal):
                    wires.append(None)
                elif v in made:
                    wires.append(made[v])
                else:
                    wires.append(len(invars))
                    invars.append(v)
            wiring.append(tuple(wires))
            made.update(
                (v, (j, r)) for r, v in enumerate(eqn.outvars) if not isinstance(v, DropVar)
            )
        outvars = [v for eqn in eqns for v in eqn.outvars]
        return cls(list(eqns), invars, outvars, tuple(wiring))

    @property
    def calls(self) -> int:
        return sum(eqn.primitive is component_p for eqn in self.eqns)

    def bind(self, invals: Sequence[Any]) -> list[Any]:
        outs: list[list[Any]] = []
        for eqn, wires in zip(self.eqns, self.wiring, strict=True):
            args = [
                v.val if w is None else invals[w] if isinstance(w, int) else outs[w[0]][w[1]]
                for v, w in zip(eqn.invars, wires, strict=True)
            ]
            outs.append(bind_equation(eqn, args))
        return [x for out in outs for x in out]


def bind(item: Any, invals: Sequence[Any]) -> list[Any]:
    return item.bind(invals) if isinstance(item, Group) else bind_equation(item, invals)


# The longest period searched for a repeated sequence: in equations, and in
# component calls (a layer of a linear layer, a norm and an attention is a few).
_MAX_PERIOD = 256
_MAX_PERIOD_CALLS = 16


def periods(items: Sequence[Any], min_length: int) -> list[Any]:
    """``items`` (equations and runs, as :func:`runs` leaves them) with each
    sequence of equations repeated at least ``min_length`` times in a chain (a
    layer of several calls and glue, each period reading what the one before it
    made) replaced by a ``Run`` of its periods (each a ``Group``).

    The same chain rules hold as for a run of one entry: each period reads the
    same outputs of the one before it, and nothing made by an earlier one. A
    period holds a component call, and no effect or host callback (a loop would
    call one period's callbacks for all). A period's length is the distance
    between two calls of the program, so few lengths are tried at each place."""
    eqns = [item for item in items if not isinstance(item, Run)]
    digests = dict(zip(map(id, eqns), equation_digests(eqns, "a whole program"), strict=True))
    # An equation's context (its compute type, PRNG mode, XLA metadata) is bound
    # with it: the loop binds the first period's, so periods' must be alike too.
    tokens = [
        None
        if isinstance(item, Run) or item.effects or digests[id(item)] is None
        else f"{digests[id(item)]}|{item.ctx!r}"
        for item in items
    ]
    calls = [
        k for k, item in enumerate(items) if tokens[k] is not None and item.primitive is component_p
    ]
    # How many equations that cannot be in a period come before each position.
    unfit = [0]
    for t in tokens:
        unfit.append(unfit[-1] + (t is None))
    out: list[Any] = []
    i = c = 0
    while i < len(items):
        while c < len(calls) and calls[c] < i:
            c += 1
        ahead = calls[c : c + _MAX_PERIOD_CALLS + 1]
        found = (
            None if tokens[i] is None else _period_at(items, tokens, ahead, unfit, i, min_length)
        )
        if found is None:
            out.append(items[i])
            i += 1
        else:
            out.append(found)
            i += sum(len(group.eqns) for group in found.eqns)
    return out


def _period_at(
    items: Sequence[Any],
    tokens: Sequence[str | None],
    ahead: Sequence[int],
    unfit: Sequence[int],
    i: int,
    n: int,
) -> Run | None:
    """The run of the shortest period (of two equations or more) that starts at
    ``items[i]`` and repeats ``n`` times or more; ``None`` if there is none.
    ``ahead``: the positions of the next component calls (the first is the
    period's first call; the next period starts as far from ``i`` as one of the
    others is from it)."""
    if not ahead:
        return None
    for later in ahead[1:]:
        p = later - ahead[0]
        if ahead[0] - i >= p or p < 2:
            continue  # the window holds no call, or is one equation
        if p > _MAX_PERIOD or i + n * p > len(items):
            return None
        if unfit[i + p] != unfit[i] or tokens[i + (n - 1) * p] != tokens[i]:
            continue
        window = tokens[i : i + p]
        if any(tokens[i + k * p : i + (k + 1) * p] != window for k in range(1, n)):
            continue
        run = _chain(items, tokens, i, p)
        if run is not None and len(run.eqns) >= n:
            return run
    return None


def _chain(items: Sequence[Any], tokens: Sequence[str | None], i: int, p: int) -> Run | None:
    """The longest chain of alike periods of ``p`` equations from ``items[i]``, as a
    run (``None`` below two); each period is made only once the one before it
    chains."""
    window = tokens[i : i + p]
    first = Group.of(items[i : i + p])
    carry: tuple[tuple[int, int], ...] | None = None
    earlier: set[Any] = set()
    members = [first]
    start = i + p
    while start + p <= len(items) and tokens[start : start + p] == window:
        group = Group.of(items[start : start + p])
        if group.wiring != first.wiring:
            break
        link = _extend(members, carry, earlier, group)
        if link is None:
            break
        carry = link
        start += p
    return None if carry is None else Run(members, carry)


def _extend(
    members: list[Any],
    carry: tuple[tuple[int, int], ...] | None,
    earlier: set[Any],
    nxt: Any,
) -> tuple[tuple[int, int], ...] | None:
    """Puts ``nxt`` on the chain ``members`` (carrying ``carry`` so far;
    ``earlier``: the outputs of all members but the last, kept so) where it goes
    there, and returns the carry: where it reads outputs of the last member, the
    same ones as every member before it, and nothing of the earlier ones.
    ``None`` (and nothing changed) where it does not."""
    pairs = _carry_pairs(members[-1], nxt)
    if pairs is None or (carry is not None and pairs != carry):
        return None
    if any(_made_by(v, earlier) for v in nxt.invars):
        return None
    earlier.update(members[-1].outvars)
    members.append(nxt)
    return pairs


def _made_by(v: Any, variables: set[Any]) -> bool:
    return not isinstance(v, Literal) and v in variables
