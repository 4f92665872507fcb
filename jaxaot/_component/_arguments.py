"""A component's arguments: which are static, which are donated, their names, and
the flat array inputs of a call (errors name the component and the argument)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._jax import Tracer
from .._keys._text import stable_repr
from ._types import ARRAY_SCALARS

__all__ = ["Arguments", "as_ints"]


def as_ints(value: int | Sequence[int], what: str, name: str) -> tuple[int, ...]:
    """``value`` (an int or ints) as a tuple; TypeError naming ``what`` and the component."""
    items = (value,) if isinstance(value, int) else tuple(value)
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"jaxaot.component {name!r}: {what} must be ints, got {v!r}")
    return items


class Arguments:
    """How the component ``name`` of ``fun`` takes its arguments.

    ``static_argnums`` and ``static_argnames`` are completed from each other
    through the signature (as ``jax.jit`` does); static values must have a
    stable text (they are key parts)."""

    def __init__(
        self,
        name: str,
        fun: Callable[..., Any],
        static_argnums: int | Sequence[int],
        static_argnames: str | Sequence[str],
        donate_argnums: int | Sequence[int],
    ) -> None:
        self.name = name
        try:
            self.signature: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            self.signature = None
        self.static_argnums, self.static_argnames = self._normalize_static(
            static_argnums, static_argnames
        )
        self.donate_argnums = as_ints(donate_argnums, "donate_argnums", name)

    def _normalize_static(
        self, argnums: int | Sequence[int], argnames: str | Sequence[str]
    ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        nums = as_ints(argnums, "static_argnums", self.name)
        names = (argnames,) if isinstance(argnames, str) else tuple(argnames)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(
                    f"jaxaot.component {self.name!r}: static_argnames must be strings, got {n!r}"
                )
        if self.signature is not None:
            params = list(self.signature.parameters.values())
            positional = [
                p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            extra_names = tuple(
                positional[i] for i in nums if -len(positional) <= i < len(positional)
            )
            extra_nums = tuple(positional.index(n) for n in names if n in positional)
            names = tuple(dict.fromkeys(names + extra_names))
            nums = tuple(sorted(set(nums + extra_nums)))
        return nums, names

    @property
    def simple(self) -> bool:
        """No static arguments."""
        return not self.static_argnums and not self.static_argnames

    def static_positions(self, n: int) -> set[int]:
        """The positions of static arguments among ``n`` positional ones."""
        return {i % n for i in self.static_argnums if -n <= i < n} if n else set()

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
                raise TypeError(f"jaxaot.component {self.name!r}: {e}") from None
        names = self.names(args)
        statics: list[tuple[str, str]] = []
        dyn_args = []
        static_pos = self.static_positions(len(args))
        for i, a in enumerate(args):
            if i in static_pos:
                statics.append((names[i] or f"args[{i}]", self._static_repr(a, names[i] or str(i))))
            else:
                dyn_args.append(a)
        dyn_kwargs = {}
        for k in sorted(kwargs):
            if k in self.static_argnames:
                statics.append((k, self._static_repr(kwargs[k], k)))
            else:
                dyn_kwargs[k] = kwargs[k]
        return tuple(dyn_args), dyn_kwargs, tuple(statics)

    def _static_repr(self, value: Any, name: str) -> str:
        text = stable_repr(value)
        if text is None:
            raise TypeError(
                f"jaxaot.component {self.name!r}: static argument {name!r} must be hashable "
                "with a stable repr (None, bool, int, float, complex, str, bytes, an enum member, "
                f"a dtype, or a tuple of those); got {type(value).__name__}"
            )
        return text

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
                raise TypeError(
                    f"jaxaot.component {self.name!r}: argument {self._path_name(path)!r} "
                    f"is a {type(leaf).__name__}, not an array; pass arrays (or mark the argument "
                    "static with static_argnums/static_argnames)"
                )
            leaves.append(leaf)
        return leaves, in_tree

    def _path_name(self, path: tuple[Any, ...]) -> str:
        head, *rest = path[1:] if path else ()
        suffix = jax.tree_util.keystr(tuple(rest))
        if path and isinstance(path[0], jax.tree_util.SequenceKey) and path[0].idx == 0:
            idx = head.idx
            params = list(self.signature.parameters) if self.signature else []
            dyn_names = [
                n
                for i, n in enumerate(params)
                if i not in self.static_argnums and n not in self.static_argnames
            ]
            base = dyn_names[idx] if idx < len(dyn_names) else f"args[{idx}]"
        else:
            base = str(getattr(head, "key", head))
        return base + suffix
