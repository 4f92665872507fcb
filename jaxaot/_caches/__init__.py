"""Byte-level cache backends. Every backend implements :class:`Cache`."""

from ._memory import MemoryCache
from ._protocol import Cache, check_key

__all__ = ["Cache", "MemoryCache", "check_key"]
