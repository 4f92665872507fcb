"""What a function sees by name: the values its closure, defaults and globals
hold, and a digest of its code.

* :func:`refuse_closed_arrays`: an explicit key does not cover arrays the
  function sees by name, so such a function is refused (:class:`ClosureError`);
* :func:`code_digest`: the code of a function and the project functions it
  names, to tell that an explicit-key entry was made by other code;
* :func:`closed_tracer`: where a function sees a traced value by name.
"""

from __future__ import annotations

import dis
import enum
import functools
import hashlib
import inspect
import sys
import sysconfig
import types
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._sharding import is_sharding_value

__all__ = [
    "ClosureError",
    "closed_tracer",
    "code_digest",
    "users_code_digest",
    "refuse_closed_arrays",
    "values_reached",
]


class ClosureError(ValueError):
    """A component's function closes over a value that cannot be part of its key."""


def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    prefixes = {paths.get(n, "") for n in ("stdlib", "platstdlib", "purelib", "platlib")}
    for p in sys.path:
        if p.endswith(("site-packages", "dist-packages")):
            prefixes.add(p)
    return tuple(sorted(p for p in prefixes if p))


_LIBRARY_PREFIXES = _library_prefixes()


def _is_project_code(code: types.CodeType) -> bool:
    filename = code.co_filename
    if filename.startswith("<"):
        return filename.startswith(("<stdin>", "<string>"))
    return not filename.startswith(_LIBRARY_PREFIXES)


_Attributes = tuple[tuple[str, str], ...]
_CODE_CACHE: dict[types.CodeType, tuple[str, tuple[str, ...], _Attributes, _Attributes]] = {}


def _code_digest(
    code: types.CodeType,
) -> tuple[str, tuple[str, ...], _Attributes, _Attributes]:
    """A digest of a code object and its nested code, the global names it loads,
    the attributes it reads of them (``H.h``: ``("H", "h")``), and those it reads
    of its free variables (``cfg.w``: ``("cfg", "w")``)."""
    cached = _CODE_CACHE.get(code)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    names: list[str] = []
    attributes: list[tuple[str, str]] = []
    cell_attributes: list[tuple[str, str]] = []

    def visit(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                visit(const)
            else:
                h.update(repr(const).encode())
        loaded = None  # the global the previous instruction loaded
        cell = None  # the free variable the previous instruction loaded
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(ins.argval, str):
                if loaded is not None:
                    attributes.append((loaded, ins.argval))
                elif cell is not None:
                    cell_attributes.append((cell, ins.argval))
            loaded = cell = None
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str):
                names.append(ins.argval)
                loaded = ins.argval
            elif ins.opname == "LOAD_DEREF" and isinstance(ins.argval, str):
                cell = ins.argval

    visit(code)
    result = (
        h.hexdigest(),
        tuple(dict.fromkeys(names)),
        tuple(dict.fromkeys(attributes)),
        tuple(dict.fromkeys(cell_attributes)),
    )
    if len(_CODE_CACHE) < 100_000:
        _CODE_CACHE[code] = result
    return result


def _is_project_module(value: Any) -> bool:
    """Whether ``value`` is a module of the user's project (not a library's)."""
    if not isinstance(value, types.ModuleType):
        return False
    path = getattr(value, "__file__", None)
    return isinstance(path, str) and not path.startswith(_LIBRARY_PREFIXES)


def _globals_read(f: types.FunctionType) -> Iterable[tuple[str, Any]]:
    """The globals the project function ``f`` names, and the attributes it reads
    of the project modules among them (``import helpers as H``; ``H.h(x)``), by name."""
    _, global_names, attributes, _ = _code_digest(f.__code__)
    for name in global_names:
        if name in f.__globals__:
            yield name, f.__globals__[name]
    for name, attribute in attributes:
        module = f.__globals__.get(name)
        if _is_project_module(module) and hasattr(module, attribute):
            yield f"{name}.{attribute}", getattr(module, attribute)


def _is_tracer(value: Any) -> bool:
    from .._jax import Tracer

    return isinstance(value, Tracer)


def _is_array(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return True
    import jax

    return isinstance(value, jax.Array) or _is_tracer(value)


def _named_values(fun: Any) -> Iterable[tuple[str, Any]]:
    """The values ``fun`` can see without an argument: closure cells, defaults and
    the globals it names (through partials, bound methods and wrappers)."""
    seen: set[int] = set()
    stack: list[Any] = [fun]
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, types.MethodType):
            yield "self", f.__self__
            stack.append(f.__func__)
            continue
        if hasattr(f, "func") and hasattr(f, "args") and hasattr(f, "keywords"):
            for i, a in enumerate(f.args):
                yield f"partial argument {i}", a
            for k, v in f.keywords.items():
                yield f"partial keyword {k!r}", v
            stack.append(f.func)
            continue
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None and wrapped is not f:
            stack.append(wrapped)
        elif callable(f) and not isinstance(
            f, type | types.FunctionType | types.BuiltinFunctionType
        ):
            # A callable object (an Equinox module, a class with ``__call__``): it
            # computes with what it holds, and its ``__call__``'s own closure.
            yield "self", f
            call = getattr(type(f), "__call__", None)  # noqa: B004 (the class's function)
            if isinstance(call, types.FunctionType):
                stack.append(call)
            continue
        code = getattr(f, "__code__", None)
        if not isinstance(f, types.FunctionType) or code is None:
            continue
        for name, cell in zip(code.co_freevars, f.__closure__ or (), strict=False):
            try:
                yield f"free variable {name!r}", cell.cell_contents
            except ValueError:
                continue
        for i, d in enumerate(f.__defaults__ or ()):
            yield f"default argument {i}", d
        for k, d in (f.__kwdefaults__ or {}).items():
            yield f"default argument {k!r}", d
        if _is_project_code(code):
            for name, value in _globals_read(f):
                yield f"global {name!r}", value


def values_reached(fun: Any, most: int = 64) -> list[Any]:
    """What ``fun`` sees without an argument (see ``_named_values``), and what the
    project functions among those see in turn (``step`` calling ``loss`` calling
    ``forward``, which reads a global), up to ``most`` functions."""
    found: list[Any] = []
    functions: list[Any] = [fun]
    seen: set[int] = set()
    while functions and len(seen) < most:
        f = functions.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for _, value in _named_values(f):
            found.append(value)
            code = getattr(value, "__code__", None)
            if isinstance(value, types.FunctionType) and code and _is_project_code(code):
                functions.append(value)
    return found


def refuse_closed_arrays(fun: Any, component: str) -> None:
    """Raises :class:`ClosureError` if ``fun`` sees an array (or a tracer) through a
    closure cell, a default or a global it names, directly or inside a pytree: an
    explicit key would not cover its value."""
    import jax

    for where, value in _held_reached(fun):
        try:
            leaves = jax.tree_util.tree_leaves_with_path(value)
        except Exception:  # not a pytree we can walk
            continue
        for path, leaf in leaves:
            if _is_array(leaf) and not is_sharding_value(leaf):
                shape = tuple(getattr(leaf, "shape", ()))
                kind = "a traced value" if _is_tracer(leaf) else "an array"
                raise ClosureError(
                    f"jaxaot.component {component!r}: the function closes over {kind} "
                    f"({where}{jax.tree_util.keystr(path)}, shape {shape}, dtype "
                    f"{getattr(leaf, 'dtype', '?')}). Its explicit key does not cover the "
                    "array's value, so a cached result could belong to another array. Pass "
                    "it to the component as an argument instead."
                )


def _held(named: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """The values a function computes with that an explicit key does not cover,
    among those it sees by name (``named``, see ``_named_values``): modules,
    classes and functions left out, and the attributes of the object a method or
    callable object is bound to, where that object is no pytree (a pytree is
    walked whole)."""
    for where, value in named:
        if isinstance(value, types.ModuleType | type):
            continue
        if _is_pytree_node(value):
            yield where, value
            continue
        if where == "self":
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict):
                for name, attribute in attributes.items():
                    if not callable(attribute) or _is_pytree_node(attribute):
                        yield f"{where}.{name}", attribute
            continue
        if not callable(value):
            yield where, value


def _held_reached(fun: Any, most: int = 64) -> Iterable[tuple[str, Any]]:
    """What ``_held`` gives for ``fun``'s named values, for the attributes its code reads of the
    objects it names (``NS.w``, a class's ``K.w``, a closure's ``cfg.w``), and so
    for the project functions it reaches through them (a helper it calls, a
    closure it holds, a method it calls of an object, with the attributes of
    the object that method reads), up to ``most`` functions."""
    functions: list[tuple[Any, str]] = [(fun, "")]
    seen: set[int] = set()
    while functions and len(seen) < most:
        f, via = functions.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        named = list(_named_values(f))
        for where, value in _held(named):
            yield via + where, value
        for where, value in [*named, *_attributes_read(f)]:
            if _is_project_function(value):
                functions.append((value, f"{via}{where}, which reads "))
            elif where.startswith("attribute "):
                yield via + where, value


def _is_project_function(value: Any) -> bool:
    code = _safe_getattr(value, "__code__")
    return (
        isinstance(value, types.FunctionType)
        and isinstance(code, types.CodeType)
        and _is_project_code(code)
    )


def _safe_getattr(value: Any, name: str) -> Any:
    """``getattr(value, name, None)``, ``None`` also where the lookup raises
    something else (a dict whose ``__getattr__`` is ``__getitem__``)."""
    try:
        return getattr(value, name, None)
    except Exception:
        return None


def _attributes_read(fun: Any) -> Iterable[tuple[str, Any]]:
    """The attributes the code of ``fun`` (a project function, or one a method,
    partial or wrapper holds) reads of the globals and free variables it names
    that are not modules, as they are now. A method of an object's class (or a
    classmethod) is given as its function, with the attributes of the object
    (or class) its code names: ``self.scale``, not all the object holds."""
    f = fun
    for _ in range(16):  # (through methods, partials and wrappers)
        if isinstance(f, types.FunctionType) or f is None:
            break
        inner = _safe_getattr(f, "__func__") or _safe_getattr(f, "func")
        f = inner or _safe_getattr(f, "__wrapped__")
    if not _is_project_function(f):
        return
    _, _, attributes, cell_attributes = _code_digest(f.__code__)
    cells = dict(zip(f.__code__.co_freevars, f.__closure__ or (), strict=False))
    for name, attribute in (*attributes, *cell_attributes):
        if (name, attribute) in attributes:
            if name not in f.__globals__:
                continue
            owner = f.__globals__[name]
        else:
            try:
                owner = cells[name].cell_contents
            except (KeyError, ValueError):  # not this function's, or an empty cell
                continue
        if isinstance(owner, types.ModuleType):  # (a project module's: ``_globals_read``)
            continue
        value = _static_attribute(owner, attribute)
        if value is _MISSING:
            continue
        where = f"attribute {name}.{attribute}"
        static = isinstance(value, staticmethod)
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        data = not isinstance(owner, type) and attribute in (_safe_getattr(owner, "__dict__") or {})
        if _is_project_function(value) and not data and not static:
            # A method (or a classmethod): what it reads of its object (or class)
            # is named in its code, or in the properties and methods it reads.
            yield from _object_reads(owner, value, f"{where}, which reads {name}")
        yield where, value


_MISSING = object()


def _static_attribute(owner: Any, name: str) -> Any:
    """``owner``'s attribute ``name`` as stored (no property or ``__getattr__``
    runs), a ``__slots__`` value by its value; ``_MISSING`` where there is none."""
    try:
        value = inspect.getattr_static(owner, name)
        if isinstance(value, types.MemberDescriptorType):  # a __slots__ value
            value = getattr(owner, name)
    except Exception:  # no such attribute, or a slot not set
        return _MISSING
    return value


def _object_reads(
    owner: Any, method: Any, where: str, seen: set[int] | None = None
) -> Iterable[tuple[str, Any]]:
    """The attributes of ``owner`` (an object, or a class) that ``method`` names in
    its code, by their values (a ``__slots__`` value read), and through the
    properties and methods of ``owner`` it names, theirs (``self.w`` read by a
    property, by ``self._scale()``), up to 32 functions."""
    seen = set() if seen is None else seen
    if id(method) in seen or len(seen) >= 32:
        return
    seen.add(id(method))
    for read in sorted(set(method.__code__.co_names)):
        held = _static_attribute(owner, read)
        if held is _MISSING:
            continue
        inner = held.fget if isinstance(held, property) else held
        if isinstance(inner, staticmethod | classmethod):
            inner = inner.__func__
        if _is_project_function(inner):
            yield from _object_reads(owner, inner, where, seen)
        elif not callable(held) or _is_pytree_node(held):
            yield f"{where}.{read}", held


def _is_pytree_node(value: Any) -> bool:
    import jax

    treedef: Any = jax.tree_util.tree_structure(value)
    return bool(treedef.num_nodes > 1)


#: Values that a digest ``with_values`` covers: those a function's computation
#: reads as Python constants (an explicit key skips the trace that would see them).
_PLAIN = (bool, int, float, complex, str, bytes, type(None), np.generic)


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is a plain constant (a number, a string, a NumPy scalar, an
    enum member), or a small tuple, list or dict of them, whose text is the same
    in every process."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, enum.Enum):  # (printed with its value)
        return depth <= 2 and _plain(value.value, depth + 1)
    if depth > 2 or not isinstance(value, tuple | list | dict | frozenset) or len(value) > 64:
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return all(_plain(v, depth + 1) for v in items)


def code_digest(fun: Any, with_values: bool = False, wrapped: bool = False) -> str:
    """A digest of the code of ``fun`` (through partials, methods and wrappers) and of
    the project functions it names: to tell that an explicit-key entry was made by
    other code. ``with_values``: the plain values (numbers, strings) of the
    globals and closure cells that code reads, and of its defaults, as well.
    ``wrapped``: and the functions of the wrappers it names (components,
    ``jaxaot.jit`` and ``jax.jit`` functions)."""
    h = hashlib.sha256()
    seen: set[int] = set()
    stack: list[Any] = [fun]
    while stack and len(seen) < 1000:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, types.MethodType):
            stack.append(f.__func__)
            code = getattr(f.__func__, "__code__", None)
            if with_values and code is not None:  # the attributes of its object it may read
                for name in sorted(set(code.co_names)):
                    value = inspect.getattr_static(f.__self__, name, None)
                    if _plain(value):
                        h.update(f"self.{name}={value!r}".encode())
            continue
        # Through partials, decorators and JAX's own wrapped functions (``.f``).
        if with_values and isinstance(f, functools.partial):  # (its bound arguments)
            for i, value in enumerate(f.args):
                h.update(f"partial {i}={value!r}".encode() if _plain(value) else b"-")
            for name, value in sorted(f.keywords.items()):
                if _plain(value):
                    h.update(f"partial {name}={value!r}".encode())
        inner = getattr(f, "func", None) or getattr(f, "__wrapped__", None)
        if inner is None and hasattr(f, "transforms"):
            inner = getattr(f, "f", None)
        if inner is not None and inner is not f:
            stack.append(inner)
        stack.extend(_custom_rules(f))
        code = getattr(f, "__code__", None)
        project = isinstance(f, types.FunctionType) and code is not None and _is_project_code(code)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value) and not isinstance(value, type):  # (a wrapper's own function)
                stack.append(value)
            elif with_values and project and _plain(value):
                h.update(f"cell={value!r}".encode())
        if not project or code is None:
            continue
        h.update(_code_digest(code)[0].encode())
        if with_values:  # (defaults are not in the code: a changed default is a change)
            for value in getattr(f, "__defaults__", None) or ():
                h.update(f"default={value!r}".encode() if _plain(value) else b"-")
            for name, value in sorted((getattr(f, "__kwdefaults__", None) or {}).items()):
                if _plain(value):
                    h.update(f"default {name}={value!r}".encode())
        for name, value in _globals_read(f):
            if (
                isinstance(value, types.FunctionType)
                or _custom_rules(value)
                or (wrapped and isinstance(getattr(value, "__wrapped__", None), types.FunctionType))
            ):
                stack.append(value)
            elif with_values and _plain(value):
                h.update(f"{name}={value!r}".encode())
    return h.hexdigest()[:32]


def _custom_rules(value: Any) -> list[Any]:
    """The rules of a ``jax.custom_jvp`` or ``jax.custom_vjp`` function (its
    ``jvp``, or its ``fwd`` and ``bwd``): code the computation runs that its
    function does not name."""
    if not (getattr(type(value), "__module__", None) or "").startswith("jax."):
        return []
    rules = (getattr(value, attr, None) for attr in ("jvp", "fwd", "bwd"))
    return [rule for rule in rules if callable(rule)]


_NO_CODE = hashlib.sha256().hexdigest()[:32]


def users_code_digest(funs: Iterable[Any]) -> str | None:
    """A digest of the user's code among ``funs`` and of the plain values it reads
    (``code_digest`` with values), or ``None`` when none of it is the user's (a
    library's own functions are keyed by its version)."""
    digests = [code_digest(f, with_values=True) for f in funs]
    if all(d == _NO_CODE for d in digests):
        return None
    return hashlib.sha256("|".join(digests).encode()).hexdigest()[:32]


def closed_tracer(fun: Any) -> str | None:
    """Where ``fun`` sees a traced value by name (``free variable 'w'``), if it does."""
    import jax

    for where, value in _named_values(fun):
        if _is_tracer(value):
            return where
        if isinstance(value, list | tuple | dict):
            for path, leaf in jax.tree_util.tree_leaves_with_path(value):
                if _is_tracer(leaf):
                    return where + jax.tree_util.keystr(path)
    return None
