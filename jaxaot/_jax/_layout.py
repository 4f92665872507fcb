"""Types made again by pickling or copying compare equal to the originals.

Newer JAX puts a layout on every type, ``AutoLayout`` by default: an instance
that compares by identity, of a class that pickling or copying instantiates
again. The outputs of an executable loaded from its serialization (a warm
process) then have types unequal to the same types of any other array, and
every signature built from them misses. :func:`one_auto_layout` keeps it one.
"""

from __future__ import annotations

__all__ = ["one_auto_layout"]


def one_auto_layout() -> None:
    """Makes JAX's ``AutoLayout`` one object however it is made (unpickled with
    an executable's metadata, copied), equal to and hashing as itself: the
    singleton JAX means it to be. Nothing to do where JAX has no such class."""
    try:
        from jax._src import layout as _layout
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
