"""Byte-level cache backends, one a module, behind one small protocol (``_protocol``).

Backends store and return opaque bytes: they know nothing of entries. Where a
backend must tell a sound entry from a damaged one, it asks the entry check it
was given (the store's: with each quarantine, and to a tiered cache it uses).

* ``_memory``, ``_directory`` (with ``_dirlayout`` and ``_safefs``), ``_fsspec``,
  ``_redis``: the stores; ``_tiered``: several stores, fastest first;
* leases, one maker per entry across processes: ``_lease`` (the record),
  ``_filelease`` (lock files: directories, ``file://``), ``_redislease``
  (``SET NX PX``), ``_objlease`` (lease objects in other fsspec stores);
  ``_fslocal``: an fsspec cache's files on a local path;
* ``_trust``: when bytes from a store may become code in this process;
* ``_faults``: one warning per cause, and a back-off after an outage.
"""

from ._directory import DirectoryCache, UnsafeCacheDirError, UntrustedEntryError
from ._fsspec import FsspecCache
from ._memory import MemoryCache
from ._protocol import (
    BadEntry,
    Cache,
    EntryCheck,
    Held,
    HitCounting,
    Indexing,
    Lease,
    Leasing,
    LocalFiles,
    Pingable,
    Quarantining,
    check_key,
    is_removable,
)
from ._redis import RedisCache
from ._tiered import TieredCache

__all__ = [
    "BadEntry",
    "Cache",
    "DirectoryCache",
    "EntryCheck",
    "FsspecCache",
    "Held",
    "HitCounting",
    "Indexing",
    "Lease",
    "Leasing",
    "LocalFiles",
    "MemoryCache",
    "Pingable",
    "Quarantining",
    "RedisCache",
    "TieredCache",
    "UnsafeCacheDirError",
    "UntrustedEntryError",
    "check_key",
    "is_removable",
]
