"""The byte-level protocol shared by every jaxaot cache backend.

A cache maps *keys* to *values*. Keys are lowercase hexadecimal strings (the
digest of a :class:`jaxaot.ComponentKey`, sometimes with a short hex suffix),
so they are safe to use as file names, object names or Redis keys. Values are
opaque ``bytes``: encoding, checksums and signatures live in ``jaxaot._entry``,
never in a backend. A backend only stores and returns bytes; extra behaviour
(tiers, read-only wrappers, verification) is layered by wrapping.
"""

from __future__ import annotations

import re
from typing import Any, Protocol, runtime_checkable

_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")


def check_key(key: object) -> str:
    """Returns ``key`` if it is a valid cache key, else raises ``ValueError``."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"jaxaot cache keys are 16-128 lowercase hex characters, got {key!r:.80}")
    return key


@runtime_checkable
class Cache(Protocol):
    """What every cache backend implements.

    ``get`` returns the stored bytes or ``None``; ``put`` stores bytes (a
    backend may keep an existing value under the same key instead);
    ``delete`` returns whether something was removed; ``keys`` lists the stored
    keys; ``clear`` removes everything; ``stats`` returns a JSON-able dict with
    at least ``entries`` and ``bytes``.
    """

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def clear(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...
