"""Byte-level cache backends. Every backend implements :class:`Cache`."""

from ._directory import DirectoryCache, UnsafeCacheDirError, UntrustedEntryError
from ._fsspec import FsspecCache
from ._memory import MemoryCache
from ._protocol import Cache, check_key
from ._redis import RedisCache
from ._tiered import TieredCache

__all__ = [
    "Cache",
    "DirectoryCache",
    "FsspecCache",
    "MemoryCache",
    "RedisCache",
    "TieredCache",
    "UnsafeCacheDirError",
    "UntrustedEntryError",
    "check_key",
]
