"""A component's arguments: which are static, which are donated, their names, and
the flat array inputs of a call (errors name the component and the argument).

The errors for bad arguments are made here once, for ``jaxaot.component`` and
``jaxaot.jit`` alike: a leaf that is not an array (by its path, as
``jax.tree_util.keystr`` writes it: ``params['scale']``, ``m.activation``), a
static value that is not hashable (in ``jax.jit``'s words), and a static
value with no stable value form (components only: their keys outlive the
process)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._jax import Tracer, donates_negative_argnums
from .._keys._text import stable_repr, unstable_part
from ._types import ARRAY_SCALARS

__all__ = ["Arguments", "NonHashableStaticError", "as_ints", "note_module_flags"]


#: Static values whose key text an ``Arguments`` remembers (see ``_static_text``).
_MAX_TEXTS = 256


class NonHashableStaticError(ValueError, TypeError):
    """A static argument that cannot be hashed: a ``ValueError`` as ``jax.jit``
    raises, and a ``TypeError`` as for any other bad argument of a component."""


def _what(value: Any) -> str:
    """``value``'s type and a short repr, for messages (a function by its name,
    which says more than an address: ``jax.nn.relu`` is a ``custom_jvp``)."""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    module = getattr(value, "__module__", None)
    kind = type(value).__name__
    kind = ("an " if kind[:1].lower() in "aeiou" else "a ") + kind
    if callable(value) and isinstance(name, str):
        where = f"{module}.{name}" if isinstance(module, str) else name
        return f"{kind} {where}"
    text = " ".join(repr(value).split())  # a module's repr spans lines
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{kind} {text}"


def unhashable_static(who: str, name: str, value: Any, error: Exception) -> NonHashableStaticError:
    """The error for a static argument ``name`` that failed to hash with ``error``:
    ``jax.jit``'s words, after the function and the argument."""
    return NonHashableStaticError(
        f"{who}: static argument {name!r} is not hashable. Non-hashable static arguments "
        "are not supported. An error occurred while trying to hash an object of type "
        f"{type(value)}, {_what(value).split(' ', 2)[2]}. The error was:\n"
        f"{type(error).__name__}: {error}\n"
        "Pass a hashable value instead: a tuple for a list, a frozen dataclass or a "
        "NamedTuple for a dict or a mutable object."
    )


def in_equinox_module(tree: Any, path: Sequence[Any]) -> bool:
    """Whether the leaf at ``path`` (JAX's keys) in ``tree`` lies in an Equinox
    module (is a field of one, or of something one holds)."""
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return False
    node = tree
    for key in path:
        if isinstance(node, eqx.Module):
            return True
        if isinstance(key, jax.tree_util.GetAttrKey):
            node = getattr(node, key.name, None)
        elif isinstance(key, jax.tree_util.SequenceKey | jax.tree_util.DictKey):
            try:
                node = node[key.idx if isinstance(key, jax.tree_util.SequenceKey) else key.key]
            except (KeyError, IndexError, TypeError):
                return False
        else:  # a node of another kind: no way down
            return False
    return False


def note_module_flags(error: BaseException, who: str, args: Any, kwargs: Any) -> None:
    """Adds a note to ``error`` (a traced value used as a Python bool or number)
    where the arguments hold Python bools in Equinox modules (``eqx.nn.Dropout``'s
    ``inference``): traced, as ``jax.jit`` traces them, they cannot decide a
    branch; the note names them and says how to keep them Python values."""
    if not isinstance(error, jax.errors.ConcretizationTypeError) or "equinox" not in sys.modules:
        return
    try:
        leaves = jax.tree_util.tree_leaves_with_path((args, kwargs))
        tree = (args, kwargs)
        flags = [
            ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])
            for path, leaf in leaves
            if isinstance(leaf, bool) and in_equinox_module(tree, path)
        ]
    except Exception:  # (a tree that cannot be walked: no note)
        return
    if flags:
        more = f" (and {len(flags) - 3} more)" if len(flags) > 3 else ""
        error.add_note(
            f"{who}: {', '.join(flags[:3])}{more} are Python bools in Equinox modules, "
            "traced as arrays as jax.jit traces them: split the module, "
            "params, static = eqx.partition(model, eqx.is_array), pass static as a static "
            "argument (a tuple, not a list, of layers) or close over it, and call "
            "eqx.combine(params, static) inside (or mark such fields eqx.field(static=True))."
        )


def not_an_array(who: str, path: str, value: Any, in_module: bool = False) -> TypeError:
    """The error for an argument leaf at ``path`` that is not an array
    (``in_module``: it lies in an Equinox module, see :func:`in_equinox_module`)."""
    advice = " Pass arrays, or mark the argument static with static_argnums/static_argnames."
    hint = ""
    linen = getattr(sys.modules.get("flax.linen"), "Module", None)
    if isinstance(linen, type) and isinstance(value, linen):
        hint = (
            " A Flax linen module holds no arrays (its variables do): close over the "
            "module or pass it as a static argument (static_argnums/static_argnames), "
            "and pass its variables."
        )
    elif in_module:
        # A field of a module holding arrays: the module is neither all arrays nor
        # hashable (a static argument), whatever the field is (a name, a flag,
        # eqx.nn.MaxPool2d's operation); splitting it works for every module.
        advice = (
            " It is a field of a module: split the module into its arrays and the rest, "
            "params, static = eqx.partition(model, eqx.is_array), pass static as a static "
            "argument (static_argnums/static_argnames) and call eqx.combine(params, static) "
            "inside. (A field of a class of your own can instead be marked "
            "eqx.field(static=True).)"
        )
    elif callable(value):
        hint = (
            " A function inside an argument (a field of a module) is not an array: mark "
            "the field static (flax.struct.field(pytree_node=False)), or pass the function "
            "as a static argument."
        )
    if isinstance(value, jax.ShapeDtypeStruct):
        hint = (
            " A jax.ShapeDtypeStruct describes an argument: calls take arrays, and "
            "ShapeDtypeStructs go to .precompile(...) (or jax.jit(f).trace)."
        )
    return TypeError(
        f"{who}: the argument at path {path} is {_what(value)}, not an array.{advice}{hint}"
    )


#: NumPy dtype kinds JAX has no type for: objects, strings, dates. (Not ``V``:
#: ml_dtypes' bfloat16 and float8 types are of that kind.)
_NO_JAX_KIND = frozenset("OUSMm")


def unfit_value(who: str, path: str, value: Any) -> Exception | None:
    """The error for a leaf that is array-like but that JAX cannot take as it is
    (``None`` for any other): a NumPy array of a dtype JAX has no type for, or a
    Python int outside the range of the type JAX gives Python ints (jax.jit's
    ``OverflowError``)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in _NO_JAX_KIND:
        return TypeError(
            f"{who}: the argument at path {path} is a NumPy array of dtype {value.dtype}, "
            "which JAX has no type for. Pass arrays of numbers or booleans, or mark the "
            "argument static with static_argnums/static_argnames."
        )
    if type(value) is int:
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(np.int64))
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            return OverflowError(
                f"{who}: the argument at path {path} is the Python int {value}, outside "
                f"the range of {dtype.name}, the type JAX gives Python ints here. Pass an "
                "array of a wider type (with jax_enable_x64), or mark it static."
            )
    return None


def check_hashable(who: str, name: str, value: Any) -> None:
    """Raises :class:`NonHashableStaticError` where ``value`` cannot be hashed."""
    try:
        hash(value)
    except Exception as e:  # whatever __hash__ raises, as jax.jit reports it
        raise unhashable_static(who, name, value, e) from None


def as_ints(value: int | Sequence[int], what: str, who: str) -> tuple[int, ...]:
    """``value`` (an int or ints) as a tuple; TypeError naming ``what`` and ``who``
    (``jaxaot.component 'f'``)."""
    items = (value,) if isinstance(value, int) else tuple(value)
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{who}: {what} must be ints, got {v!r}")
    return items


class Arguments:
    """How the component ``name`` of ``fun`` takes its arguments.

    ``static_argnums`` and ``static_argnames`` are completed from each other
    through the signature (as ``jax.jit`` does); static values must be hashable
    and, for :meth:`split` (a component's: they are key parts), have a stable
    text. ``kind`` names the API in messages (``jaxaot.component``,
    ``jaxaot.jit``)."""

    def __init__(
        self,
        name: str,
        fun: Callable[..., Any],
        static_argnums: int | Sequence[int],
        static_argnames: str | Sequence[str],
        donate_argnums: int | Sequence[int],
        kind: str = "jaxaot.component",
    ) -> None:
        self.name = name
        self.who = f"{kind} {name!r}"
        try:
            self.signature: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            self.signature = None
        self.static_argnums, self.static_argnames = self._normalize_static(
            static_argnums, static_argnames
        )
        self.donate_argnums = as_ints(donate_argnums, "donate_argnums", self.who)
        if min(self.donate_argnums, default=0) < 0 and not donates_negative_argnums():
            # As this JAX's jax.jit: a negative number donates nothing.
            self.donate_argnums = tuple(i for i in self.donate_argnums if i >= 0)
        # The key text of static values seen before, by identity (the value is
        # held, so its id is not reused): spelling a config of functions walks
        # their code and closures on every call otherwise. Like jax.jit, which keys
        # a function by identity, a function whose closure cell is rebound later
        # keeps the key of its first call in this process.
        self._texts: dict[int, tuple[Any, str]] = {}

    def _normalize_static(
        self, argnums: int | Sequence[int], argnames: str | Sequence[str]
    ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        return self._completed(as_ints(argnums, "static_argnums", self.who), argnames, "static")

    def donated(self, argnames: str | Sequence[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``donate_argnums`` and ``donate_argnames`` completed from each other, as
        ``jax.jit`` completes them: a donated argument is donated whether it is
        passed by position or by name. A name that is no parameter is a
        ValueError."""
        nums, names = self._completed(self.donate_argnums, argnames, "donate")
        if self.signature is not None:
            params = self.signature.parameters
            unknown = [n for n in names if n not in params]
            if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                raise ValueError(f"{self.who}: donate_argnames {unknown} are not its parameters")
        return nums, names

    def donate_by_position(self, argnames: str | Sequence[str]) -> tuple[int, ...]:
        """``donate_argnums`` with the positions of ``argnames`` added (a
        component's executables donate by position): a name that is no
        positional parameter is a ValueError."""
        nums, names = self.donated(argnames)
        params = {} if self.signature is None else dict(self.signature.parameters)
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        loose = [n for n in names if n not in params or params[n].kind not in by_position]
        if loose:
            raise ValueError(
                f"{self.who}: donate_argnames {loose} are not positional parameters (a "
                "component donates by position)"
            )
        self.donate_argnums = tuple(sorted(set(nums)))
        return self.donate_argnums

    def _completed(
        self, nums: tuple[int, ...], argnames: str | Sequence[str], what: str
    ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``nums`` and ``argnames`` (of ``what``: static, donate) completed from
        each other through the signature's positional parameters."""
        names = (argnames,) if isinstance(argnames, str) else tuple(argnames)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"{self.who}: {what}_argnames must be strings, got {n!r}")
        if self.signature is None:
            return nums, names
        positional = [
            p.name
            for p in self.signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        extra_names = tuple(positional[i] for i in nums if -len(positional) <= i < len(positional))
        extra_nums = tuple(positional.index(n) for n in names if n in positional)
        return tuple(sorted(set(nums + extra_nums))), tuple(dict.fromkeys(names + extra_names))

    @property
    def simple(self) -> bool:
        """No static arguments."""
        return not self.static_argnums and not self.static_argnames

    def static_positions(self, n: int) -> set[int]:
        """The positions of static arguments among ``n`` positional ones."""
        return {i % n for i in self.static_argnums if -n <= i < n} if n else set()

    def _misfit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """What Python says of a call that does not fit the function (an
        unexpected keyword, too many positional arguments), where ``bind`` would
        first complain of a missing argument."""
        assert self.signature is not None
        params = list(self.signature.parameters.values())
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            for name in kwargs:
                if name not in named:
                    return f"got an unexpected keyword argument {name!r}"
        if not any(p.kind == p.VAR_POSITIONAL for p in params):
            positional = [
                p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            if len(args) > len(positional):
                return (
                    f"takes {len(positional)} positional argument"
                    f"{'s' * (len(positional) != 1)} but {len(args)} were given"
                )
        return None

    def names(self, args: tuple[Any, ...]) -> list[str]:
        """The parameter name of each positional argument (``args[2]`` for a
        ``*args`` parameter, ``""`` where there is none)."""
        params = list(self.signature.parameters.values()) if self.signature else []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        var = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
        names = []
        for i in range(len(args)):
            if i < len(positional):
                names.append(positional[i].name)
            elif var is not None:
                names.append(f"{var}[{i - len(positional)}]")
            else:
                names.append("")
        return names

    def split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[tuple[str, str], ...]]:
        """The dynamic positional and keyword arguments, and the static ones as
        ``(name, stable text)`` pairs.

        Raises:
          TypeError: the arguments do not fit the signature, or a static value has
            no stable text.
        """
        if self.signature is not None:
            try:
                self.signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{self.who}: {self._misfit(args, kwargs) or e}") from None
        names = self.names(args)
        statics: list[tuple[str, str]] = []
        dyn_args = []
        static_pos = self.static_positions(len(args))
        for i, a in enumerate(args):
            if i in static_pos:
                name = names[i] or f"args[{i}]"
                statics.append((name, self._static_text(a, name)))
            else:
                dyn_args.append(a)
        dyn_kwargs = {}
        for k in sorted(kwargs):
            if k in self.static_argnames:
                statics.append((k, self._static_text(kwargs[k], k)))
            else:
                dyn_kwargs[k] = kwargs[k]
        # By name: a static argument passed by position or by keyword is one key.
        return tuple(dyn_args), dyn_kwargs, tuple(sorted(statics))

    def static_values(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The static arguments themselves (hashable), positional then by name: with
        their key text, what tells calls apart in a process, as ``jax.jit`` compares
        static values (two values with one text, a class redefined in a notebook,
        are still two calls)."""
        positional = tuple(args[i] for i in sorted(self.static_positions(len(args))))
        named = tuple((k, kwargs[k]) for k in sorted(kwargs) if k in self.static_argnames)
        return positional + named

    def check_statics(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raises :class:`NonHashableStaticError` for a static argument that cannot
        be hashed (``jax.jit``'s error, naming the argument)."""
        names = self.names(args)
        for i in sorted(self.static_positions(len(args))):
            check_hashable(self.who, names[i] or f"args[{i}]", args[i])
        for k in sorted(kwargs):
            if k in self.static_argnames:
                check_hashable(self.who, k, kwargs[k])

    def _static_text(self, value: Any, name: str) -> str:
        """The key text of the static argument ``name``.

        Raises:
          NonHashableStaticError: it cannot be hashed (as ``jax.jit`` raises).
          TypeError: it has no stable value form (its text would differ between
            processes, or its only identity is its address), naming the part.
        """
        known = self._texts.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        check_hashable(self.who, name, value)
        text = stable_repr(value)
        if text is not None:
            if len(self._texts) >= _MAX_TEXTS:
                self._texts.clear()
            self._texts[id(value)] = (value, text)
            return text
        where, part, why = unstable_part(value) or ("", value, "it has no stable value form")
        inner = f"; {name}{where} is {_what(part)}" if where else ""
        raise TypeError(
            f"{self.who}: static argument {name!r} is {_what(value)}, which has no value "
            f"form that is the same in every process{inner} ({why}), so it cannot be part of "
            "a cache key. Static arguments of components are keyed by value: None, bool, "
            "int, float, complex, str, bytes, enum members, NumPy and JAX dtypes, classes "
            "and functions defined at module level (or closures over such values), "
            "functools.partial of those, and tuples, frozensets, NamedTuples and frozen "
            "dataclasses (flax.struct, Equinox modules) of those. Pass such a value, or let "
            "the function see this one by name (a closure or a global) instead: a default "
            "key is the traced program, which covers what the value does."
        )

    def flatten(
        self, dyn_args: tuple[Any, ...], dyn_kwargs: dict[str, Any], allow_sds: bool
    ) -> tuple[list[Any], Any]:
        """The flat inputs of the dynamic arguments, and their tree.

        Raises:
          TypeError: a leaf is not an array (nor a ``ShapeDtypeStruct`` where
            ``allow_sds``), naming the argument.
        """
        leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))
        leaves = []
        for path, leaf in leaves_with_paths:
            ok = isinstance(leaf, (jax.Array, np.ndarray, Tracer, *ARRAY_SCALARS)) or (
                allow_sds and isinstance(leaf, jax.ShapeDtypeStruct)
            )
            if not ok:
                where = self.path_name(path, len(dyn_args))
                in_module = in_equinox_module((dyn_args, dyn_kwargs), path)
                raise not_an_array(self.who, where, leaf, in_module)
            if type(leaf) is int or type(leaf) is np.ndarray:
                problem = unfit_value(self.who, self.path_name(path, len(dyn_args)), leaf)
                if problem is not None:
                    raise problem
            leaves.append(leaf)
        return leaves, in_tree

    def leaf_error(
        self, dyn_args: tuple[Any, ...], dyn_kwargs: dict[str, Any], index: int
    ) -> Exception:
        """The error for the flat input ``index`` of these dynamic arguments, which
        JAX cannot take (by its path)."""
        keys, leaf = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))[0][index]
        path = self.path_name(keys, len(dyn_args))
        problem = unfit_value(self.who, path, leaf)
        if problem is not None:
            return problem
        return not_an_array(self.who, path, leaf, in_equinox_module((dyn_args, dyn_kwargs), keys))

    def leaf_path(self, dyn_args: tuple[Any, ...], dyn_kwargs: dict[str, Any], index: int) -> str:
        """The name of the flat input ``index`` of these dynamic arguments, by its
        path (``params['w']``)."""
        path, _ = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))[0][index]
        return self.path_name(path, len(dyn_args))

    def path_name(self, path: tuple[Any, ...], n_dynamic: int) -> str:
        """The name of the leaf at ``path`` in ``(dynamic args, dynamic kwargs)`` with
        ``n_dynamic`` dynamic positional arguments: the parameter's name, then the
        path within it as ``jax.tree_util.keystr`` writes it (``params['scale']``,
        ``m.activation``)."""
        if len(path) < 2:
            return jax.tree_util.keystr(tuple(path))
        where, head, rest = path[0], path[1], tuple(path[2:])
        suffix = jax.tree_util.keystr(rest)
        if isinstance(where, jax.tree_util.SequenceKey) and where.idx == 0:
            idx = getattr(head, "idx", 0)
            # The positions of the dynamic arguments among all positional ones.
            for total in range(n_dynamic, n_dynamic + len(self.static_argnums) + 1):
                static = self.static_positions(total)
                if total - len(static) == n_dynamic:
                    break
            positions = [i for i in range(total) if i not in static]
            names = self.names((None,) * total)
            pos = positions[idx] if idx < len(positions) else idx
            base = (names[pos] if pos < len(names) else "") or f"args[{pos}]"
        else:
            base = str(getattr(head, "key", head))
        return base + suffix
