"""Bundles: cache entries packed into one file, to ship a warm cache to other
machines (a container image, a job's inputs) without a shared store.

Container format (all integers little-endian)::

    magic      8 bytes   b"JAXAOTBN"
    version    u16       BUNDLE_FORMAT_VERSION (1)
    count      u32       number of records
    records    count times:
                 key_len    u16
                 key        key_len bytes of ASCII (the cache key, lowercase hex)
                 value_len  u64
                 value      value_len bytes (one cache entry, exactly as stored)
    checksum   32 bytes: SHA-256 over everything above

The bundle checksum catches damage in transit; it is not a signature. Trust
comes from the entries themselves: :func:`import_bundle` verifies every entry
(its checksum, or its HMAC signature when ``$JAXAOT_CACHE_HMAC_KEY`` is set)
and that the key digest recorded in it names the key it is filed under, and
refuses the ones that fail. Entries are never parsed beyond their header.

Format changelog (bump BUNDLE_FORMAT_VERSION on every change):
  * 1: first version.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from collections.abc import Iterable, Iterator
from typing import IO, Any

from .._caches import check_key
from ._active import get_cache
from ._entry import EntryError, check_stored
from ._writer import wait_for_writes

__all__ = [
    "BUNDLE_FORMAT_VERSION",
    "BUNDLE_MAGIC",
    "BundleError",
    "export_bundle",
    "import_bundle",
]

BUNDLE_MAGIC = b"JAXAOTBN"
BUNDLE_FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHI")
_KEY_LEN = struct.Struct("<H")
_VALUE_LEN = struct.Struct("<Q")
_CHECKSUM_BYTES = 32
_CHUNK = 1 << 20


class BundleError(ValueError):
    """A bundle file is damaged, truncated, foreign or of another format version."""


def _resolve_cache(cache: Any, what: str) -> Any:
    if cache is None:
        cache = get_cache()
        if cache is None:
            raise ValueError(f"{what}: caching is off (JAXAOT_CACHE=off) and no cache was given")
    return cache


def _write_bundle(path: str | os.PathLike[str], records: Iterable[tuple[str, bytes]]) -> int:
    """Writes ``records`` (key, value) as a bundle at ``path`` atomically; returns the count.

    The records are streamed to a temp file next to ``path``; the count is
    patched in, the checksum computed over the finished file, and the temp file
    fsynced and renamed over ``path``.
    """
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    tmp = os.path.join(
        directory, f".{os.path.basename(target)}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
    )
    count = 0
    try:
        with open(tmp, "xb") as f:
            f.write(_HEADER.pack(BUNDLE_MAGIC, BUNDLE_FORMAT_VERSION, 0))
            for key, value in records:
                raw_key = key.encode("ascii")
                f.write(_KEY_LEN.pack(len(raw_key)))
                f.write(raw_key)
                f.write(_VALUE_LEN.pack(len(value)))
                f.write(value)
                count += 1
            f.seek(0)
            f.write(_HEADER.pack(BUNDLE_MAGIC, BUNDLE_FORMAT_VERSION, count))
            f.flush()
        with open(tmp, "rb") as f:
            digest = _sha256(f, os.fstat(f.fileno()).st_size)
        with open(tmp, "ab") as f:
            f.write(digest)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return count


def export_bundle(
    path: str | os.PathLike[str],
    *,
    cache: Any = None,
    components: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Writes the sound entries of ``cache`` into one bundle file at ``path``.

    Args:
      path: the bundle to write (replaced atomically if it exists).
      cache: the cache to read (default: ``jaxaot.get_cache()``).
      components: if given, only entries whose component name (the header's
        ``name``: the component's function name) is one of these.

    Returns:
      ``{"path", "entries", "bytes", "keys", "names", "bad", "unmatched"}``:
      the entries written, their total size, their keys, the component names
      they belong to, the keys of bad entries left out (damaged, unsigned,
      misfiled) and the requested component names that matched no entry.

    Bad entries are never exported. Entries are read with ``get``.
    """

    wait_for_writes()  # executables still being written belong in the bundle
    cache = _resolve_cache(cache, "export_bundle")
    wanted = None if components is None else set(components)
    exported: list[str] = []
    names: set[str] = set()
    bad: list[str] = []
    total = 0

    def records() -> Iterator[tuple[str, bytes]]:
        nonlocal total
        for key in sorted(cache.keys()):
            try:
                blob = _read_entry(cache, key)
            except _Refused:  # the backend would not read it (a planted file, a FIFO...)
                bad.append(key)
                continue
            if blob is None:
                continue  # removed meanwhile
            try:
                header, _ = check_stored(key, blob)
            except EntryError:
                bad.append(key)
                continue
            name = str(header.get("name", ""))
            if wanted is not None and name not in wanted:
                continue
            exported.append(key)
            names.add(name)
            total += len(blob)
            yield key, blob

    _write_bundle(path, records())
    return {
        "path": os.path.abspath(os.fspath(path)),
        "entries": len(exported),
        "bytes": total,
        "keys": exported,
        "names": sorted(names),
        "bad": bad,
        "unmatched": sorted(wanted - names) if wanted is not None else [],
    }


def _read_entry(cache: Any, key: str) -> bytes | None:
    """The stored bytes of ``key``: with the backend's ``peek`` where it has one (so
    exporting neither counts as a hit nor refreshes access times, and the backend's
    trust and no-symlink checks apply), else with ``get``. Raises for an
    entry the backend refuses to read (as :class:`_Refused`)."""
    peek = getattr(cache, "peek", None)
    if peek is not None:
        try:
            value = peek(key)
        except OSError as e:
            raise _Refused(str(e)) from e
    else:
        value = cache.get(key)
    return None if value is None else bytes(value)


class _Refused(Exception):
    """The backend refused to read an entry (internal)."""


def _read_exact(f: IO[bytes], n: int, end: int) -> bytes:
    if f.tell() + n > end:
        raise BundleError("truncated bundle (a record runs past the end)")
    data = f.read(n)
    if len(data) != n:
        raise BundleError("truncated bundle")
    return data


def _check_bundle(f: IO[bytes], size: int) -> int:
    """Verifies the header and the whole-file checksum; returns the record count."""
    if size < _HEADER.size + _CHECKSUM_BYTES:
        raise BundleError(f"not a jaxaot bundle (only {size} bytes)")
    magic, version, count = _HEADER.unpack(f.read(_HEADER.size))
    if magic != BUNDLE_MAGIC:
        raise BundleError("not a jaxaot bundle (bad magic bytes)")
    if version != BUNDLE_FORMAT_VERSION:
        raise BundleError(
            f"bundle format version {version}; this jaxaot reads version {BUNDLE_FORMAT_VERSION}"
        )
    f.seek(0)
    if _sha256(f, size - _CHECKSUM_BYTES) != f.read(_CHECKSUM_BYTES):
        raise BundleError("bundle checksum mismatch (the file is damaged or truncated)")
    return int(count)


def _sha256(f: IO[bytes], n: int) -> bytes:
    """The SHA-256 of the next ``n`` bytes of ``f``."""
    digest = hashlib.sha256()
    while n:
        chunk = f.read(min(_CHUNK, n))
        if not chunk:
            raise BundleError("truncated bundle")
        digest.update(chunk)
        n -= len(chunk)
    return digest.digest()


def _records(
    f: IO[bytes], count: int, end: int, values: bool = True
) -> Iterator[tuple[str | None, str, bytes]]:
    """Yields ``(key or None, printable key, value)``; without ``values``, only
    checks that ``count`` records end at ``end`` (skipping the values), yielding nothing."""
    f.seek(_HEADER.size)
    for _ in range(count):
        (key_len,) = _KEY_LEN.unpack(_read_exact(f, _KEY_LEN.size, end))
        raw_key = _read_exact(f, key_len, end)
        (value_len,) = _VALUE_LEN.unpack(_read_exact(f, _VALUE_LEN.size, end))
        if not values:
            if f.tell() + value_len > end:
                raise BundleError("truncated bundle (a record runs past the end)")
            f.seek(value_len, os.SEEK_CUR)
            continue
        value = _read_exact(f, value_len, end)
        text = raw_key.decode("ascii", "replace")
        try:
            yield check_key(text), text, value
        except ValueError:
            yield None, text, value
    if not values and f.tell() != end:
        raise BundleError("bundle has bytes after its last record")


def import_bundle(path: str | os.PathLike[str], *, cache: Any = None) -> dict[str, Any]:
    """Adds the sound entries of the bundle at ``path`` to ``cache``.

    The bundle's own checksum is verified first (a damaged bundle raises
    :class:`BundleError` and adds nothing). Then each entry is verified (its
    checksum, or its signature when ``$JAXAOT_CACHE_HMAC_KEY`` is set, and its
    recorded key digest against its record key) before it is put.

    Args:
      path: the bundle file.
      cache: the cache to fill (default: ``jaxaot.get_cache()``).

    Returns:
      ``{"path", "added", "skipped", "refused", "not_stored", "complete"}``: the
      keys put and held by the cache at the end, the keys the cache already held
      a sound entry for (and still holds), ``{"digest", "error"}`` for each entry
      refused, the keys of sound entries that the cache does not hold at the end
      (it skipped the put: too large for its cap, disk full, read-only... or
      evicted them to make room for later ones), and whether every entry of the
      bundle is now in the cache (``refused`` and ``not_stored`` both empty).

    Raises:
      BundleError: the bundle is damaged, truncated, foreign or of another
        format version.
      OSError: the file cannot be read.
    """

    cache = _resolve_cache(cache, "import_bundle")
    put_keys: list[str] = []
    replaced: set[str] = set()  # (keys whose damaged copy this import replaced)
    skipped: list[str] = []
    refused: list[dict[str, str]] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        count = _check_bundle(f, size)
        for _ in _records(f, count, size - _CHECKSUM_BYTES, values=False):
            pass  # (the layout, checked before anything is added)
        present = set(cache.keys())
        for key, text, value in _records(f, count, size - _CHECKSUM_BYTES):
            if key is None:
                refused.append({"digest": text[:128], "error": "invalid cache key"})
                continue
            try:
                check_stored(key, value)
            except EntryError as e:
                refused.append({"digest": key, "error": str(e)})
                continue
            if key in present:
                existing = cache.get(key)
                if existing is not None and _sound(key, bytes(existing)):
                    skipped.append(key)
                    continue
                cache.delete(key)  # a damaged copy: replace it
                replaced.add(key)
            cache.put(key, value)
            present.add(key)
            put_keys.append(key)
    held = set(cache.keys())  # what the cache really holds now, not what was asked
    for key in replaced & held:  # a damaged copy that could not be replaced is still there
        # (read without counting a use where the cache can: a file's ``peek``)
        peek = getattr(cache, "peek", None)
        try:
            stored = peek(key) if callable(peek) else cache.get(key)
        except Exception:  # unreadable: not known to be stored
            stored = None
        if stored is None or not _sound(key, bytes(stored)):
            held.discard(key)
    added = [k for k in put_keys if k in held]
    not_stored = [k for k in put_keys + skipped if k not in held]
    skipped = [k for k in skipped if k in held]
    return {
        "path": os.path.abspath(os.fspath(path)),
        "added": added,
        "skipped": skipped,
        "refused": refused,
        "not_stored": not_stored,
        "complete": not refused and not not_stored,
    }


def _sound(key: str, blob: bytes) -> bool:

    try:
        check_stored(key, blob)
    except EntryError:
        return False
    return True
