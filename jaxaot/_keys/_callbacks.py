"""Host callbacks in default keys: what names the Python a callback equation runs.

A callback equation's parameters print its function by name only (an address
stripped), so an edited callback body would keep its key. :func:`callback_text`
names each function the equation runs (through JAX's wrappers, partials and
closure cells) by its qualified name, a digest of its code (:func:`code_digest`:
project code only) and the plain values (numbers, strings) its closure holds.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

from .._jax import callback_arguments, callback_functions, register_program
from ._closure import _is_project_code, code_digest
from ._text import stable_text

__all__ = ["callback_text", "callback_witness", "register_callbacks"]

_ATOMS = (type(None), bool, int, float, complex, str, bytes)


def _name(fun: Any) -> str:
    if hasattr(fun, "__func__"):  # a bound method: its class and function
        return f"{type(fun.__self__).__qualname__}.{_name(fun.__func__)}"
    module = getattr(fun, "__module__", None) or ""
    qualname = getattr(fun, "__qualname__", None) or type(fun).__qualname__
    return f"{module}.{qualname}"


def _closure_atoms(fun: Any) -> list[str]:
    out = []
    for cell in getattr(fun, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _ATOMS):
            out.append(f"{type(value).__name__}:{value!r}"[:200])
    return out


def callback_text(eqn: Any) -> str:
    """Key text of the Python functions the callback equation ``eqn`` runs."""
    items = []
    for fun in callback_functions(eqn):
        atoms = ",".join(_closure_atoms(fun))
        items.append(f"{_name(fun)}:{code_digest(fun)}[{atoms}]")
    # What partials bind (``partial(np.multiply, 2.0)``): another value computes
    # something else.
    bound = ",".join(stable_text(v)[:200] for v in callback_arguments(eqn))
    return "callbacks(" + ";".join(sorted(items)) + f")[{bound}]"


def callback_witness(eqns: Sequence[Any]) -> tuple[int, ...]:
    """Ids of the objects the project's callback functions see through closure
    cells, defaults and bound ``self`` (plain values and functions left out: they
    are in the key, or made again by each trace)."""
    ids: list[int] = []
    for eqn in eqns:
        # Objects a partial binds, and callable objects (not functions): their
        # identity is what the callback sees.
        ids.extend(id(v) for v in callback_arguments(eqn) if not isinstance(v, _ATOMS))
        for fun in callback_functions(eqn):
            if not isinstance(fun, types.FunctionType | types.MethodType):
                ids.append(id(fun))
                continue
            if isinstance(fun, types.MethodType):
                ids.append(id(fun.__self__))
                continue
            code = getattr(fun, "__code__", None)
            if not isinstance(fun, types.FunctionType) or code is None:
                continue
            if not _is_project_code(code):
                continue
            values = []
            for cell in fun.__closure__ or ():
                try:
                    values.append(cell.cell_contents)
                except ValueError:
                    continue
            values.extend(fun.__defaults__ or ())
            ids.extend(id(v) for v in values if not isinstance(v, (*_ATOMS, types.FunctionType)))
    return tuple(ids)


def register_callbacks(component: str, program: str, eqns: Sequence[Any]) -> None:
    """Records ``program``'s callback equations for rebinding (``_jax._callbacks``)."""
    if eqns:
        register_program(component, program, eqns, callback_witness(eqns))
