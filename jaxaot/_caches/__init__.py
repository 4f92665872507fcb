"""Byte-level cache backends. Every backend implements :class:`Cache`."""

from ._directory import DirectoryCache, UnsafeCacheDirError
from ._memory import MemoryCache
from ._protocol import Cache, check_key

__all__ = ["Cache", "DirectoryCache", "MemoryCache", "UnsafeCacheDirError", "check_key"]
