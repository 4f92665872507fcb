"""The whole-program form of a split program, with repeated layers as a loop.

A split program runs one executable per component call. When the calls are
small, the cost of entering and leaving each executable (its inputs and,
above all, its outputs) dominates the step. The whole-program form is one
executable for the entire program, in which every run of consecutive calls of
the same entry that hand a value from one to the next (the layers of a
network, forward or backward) is a ``lax.scan`` over that entry: XLA compiles
one layer, not an unrolled copy per layer, so its compile time does not grow
with depth, and a step costs what a scan over stacked layers costs.

``jaxaot.jit`` compiles it in the background once the split program has run,
and keeps whichever of the two measures faster (see ``_plan``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ._jaxcompat import DropVar, Literal
from ._optimize import _bind
from ._rules import component_p

# Part of the whole program's cache key: bump when the rewrite below changes.
WHOLE_VERSION = 1


@dataclass
class _Run:
    """Consecutive calls of one entry; output ``r`` of each call is input ``q`` of
    the next, for every ``(q, r)`` in ``carry``."""

    eqns: list[Any]
    carry: tuple[tuple[int, int], ...]


def _carry(prev: Any, eqn: Any) -> tuple[tuple[int, int], ...] | None:
    produced = {v: r for r, v in enumerate(prev.outvars) if not isinstance(v, DropVar)}
    pairs = tuple(
        (q, produced[v])
        for q, v in enumerate(eqn.invars)
        if not isinstance(v, Literal) and v in produced
    )
    return pairs or None


def runs(eqns: Sequence[Any], min_length: int = 2) -> list[Any]:
    """``eqns`` with each run of at least ``min_length`` chained calls of one entry
    replaced by a ``_Run``."""
    items: list[Any] = []
    i = 0
    while i < len(eqns):
        first = eqns[i]
        j = i + 1
        carry: tuple[tuple[int, int], ...] | None = None
        if first.primitive is component_p:
            earlier: set[Any] = set()  # outputs of members before the previous one
            while j < len(eqns):
                eqn = eqns[j]
                if eqn.primitive is not component_p or eqn.params["call"] != first.params["call"]:
                    break
                pairs = _carry(eqns[j - 1], eqn)
                if pairs is None or (carry is not None and pairs != carry):
                    break
                if any(not isinstance(v, Literal) and v in earlier for v in eqn.invars):
                    break
                carry = pairs
                earlier.update(eqns[j - 1].outvars)
                j += 1
        if carry is not None and j - i >= min_length:
            items.append(_Run(list(eqns[i:j]), carry))
            i = j
        else:
            items.append(first)
            i += 1
    return items


def _used_outside(items: Sequence[Any], outvars: Sequence[Any]) -> set[Any]:
    """Variables read by something other than the next member of their own run."""
    used = {v for v in outvars if not isinstance(v, Literal)}
    for item in items:
        if isinstance(item, _Run):
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


def _scan(
    run: _Run, read: Callable[[Any], Any], write: Callable[[Any, Any], None], used: set[Any]
) -> None:
    first = run.eqns[0]
    n_in = len(first.invars)
    carried = dict(run.carry)  # input position -> output position
    invariant: dict[int, Any] = {}
    stacked: list[int] = []
    xs: list[Any] = []
    for q in range(n_in):
        if q in carried:
            continue
        column = [eqn.invars[q] for eqn in run.eqns]
        if _same(column):
            invariant[q] = read(column[0])
        else:
            stacked.append(q)
            xs.append(jnp.stack([read(v) for v in column]))
    carried_out = set(carried.values())
    members = run.eqns[:-1]
    ys_at = [  # outputs read outside the run; the last call's carried ones are the final carry
        r
        for r in range(len(first.outvars))
        if any(e.outvars[r] in used for e in (members if r in carried_out else run.eqns))
    ]
    carry_q = sorted(carried)

    def body(carry: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        ins = [invariant.get(q) for q in range(n_in)]
        for q, c in zip(carry_q, carry, strict=True):
            ins[q] = c
        for q, v in zip(stacked, x, strict=True):
            ins[q] = v
        outs = _bind(first, ins)
        return tuple(outs[carried[q]] for q in carry_q), tuple(outs[r] for r in ys_at)

    init = tuple(read(first.invars[q]) for q in carry_q)
    final, ys = jax.lax.scan(body, init, tuple(xs), length=len(run.eqns))
    for k, eqn in enumerate(run.eqns):
        for r, y in zip(ys_at, ys, strict=True):
            if not isinstance(eqn.outvars[r], DropVar) and eqn.outvars[r] in used:
                write(eqn.outvars[r], y[k])
    last = run.eqns[-1]
    for q, c in zip(carry_q, final, strict=True):
        if not isinstance(last.outvars[carried[q]], DropVar):
            write(last.outvars[carried[q]], c)


def program(jaxpr: Any) -> tuple[Callable[..., list[Any]], int]:
    """A function of (inputs..., consts...) computing ``jaxpr`` with its runs as
    scans, and how many component calls it binds once traced."""
    items = runs(jaxpr.eqns)
    used = _used_outside(items, jaxpr.outvars)

    def fun(*args: Any) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        def write(v: Any, x: Any) -> None:
            env[v] = x

        env.update(zip([*jaxpr.invars, *jaxpr.constvars], args, strict=True))
        for item in items:
            if isinstance(item, _Run):
                _scan(item, read, write, used)
            else:
                outs = _bind(item, [read(v) for v in item.invars])
                for v, x in zip(item.outvars, outs, strict=True):
                    if not isinstance(v, DropVar):
                        env[v] = x
        return [read(v) for v in jaxpr.outvars]

    calls = sum(1 if isinstance(item, _Run) else item.primitive is component_p for item in items)
    return fun, calls


def digest(jaxpr: Any) -> str:
    """What the whole program is, for its cache key: the split program's text and
    the full key of every entry it calls (the text names each by a short digest)."""
    digests = dict.fromkeys(
        eqn.params["call"].key.digest for eqn in jaxpr.eqns if eqn.primitive is component_p
    )
    body = f"whole program v{WHOLE_VERSION}\n{jaxpr}\n" + "\n".join(digests)
    return hashlib.sha256(body.encode()).hexdigest()
