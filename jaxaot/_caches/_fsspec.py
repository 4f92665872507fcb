"""A cache in any fsspec filesystem: object stores (``gs://``, ``s3://``, ...),
shared filesystems (``file://``), or fsspec's in-process ``memory://``.

Layout::

  <root>/<key[:2]>/<key>                  one object (file) per entry
  <root>/<key[:2]>/.tmp-<pid>-<hex>       a write in flight (filesystems with rename)

Guarantees:

* No partial entry is ever visible under its final name where the filesystem
  allows it. On object stores (``gs``, ``s3``, ``az``, ``memory``, ...) an
  entry is one ``pipe`` (a single upload is atomic per object). On a local or
  mounted filesystem (``file://``) a uniquely named temp file is written,
  fsynced and renamed over the final name. On other filesystems the entry is
  written under a temp name and then moved.
* ``put`` keeps an existing entry. Two writers racing on one key each write a
  complete value; one of them remains.
* Faults never raise from the protocol methods: any error other than "not
  found" makes ``get`` a miss, ``put`` a no-op, ``keys`` empty, with one
  WARNING per cause per cache instance on the ``jaxaot`` logger (later ones at
  DEBUG). After a connection error or timeout the cache skips the store for
  ``backoff`` seconds (1 s) instead of waiting on it again on every call.
* Remote calls have an overall deadline: a read or write of a remote store
  (not a local path, not ``memory://``) that has not finished after
  ``timeout`` seconds (default 30) is a miss or a skipped write, whatever the
  driver's own timeouts; the call it was waiting on is left to finish in the
  background.
* With ``max_bytes``, a ``put`` lists the store and removes the oldest entries
  (by the store's modification time) until the new one fits. That listing is a
  round trip per put: for large buckets prefer the store's own lifecycle rules.

Leases (``lease``): on a local path, a lock file beside the entry (as the
directory cache, ``_filelease``); elsewhere a small lease object with an expiry,
created with a conditional write where the store has one (``_objlease``).

fsspec is imported when a cache is made; cloud drivers (``gcsfs``, ``s3fs``,
``adlfs``) are the user's own installs.

Trust (see ``_trust``): anyone who can write to the store can plant an entry
that becomes code in the reader, so set ``$JAXAOT_CACHE_HMAC_KEY`` in every
process that shares it. Without a key, a local path (``file://``) is held to
the directory cache's rules: the root, each shard directory and each entry file
must be owned by this user (or root) and not group- or world-writable, else it
is refused (a miss or a skipped put, one warning per cause); a remote store
(not ``memory://``) logs one loud warning per process. On local paths nothing
is followed or opened unless it is a real directory or a regular file, and
deletions act only inside the root.
"""

from __future__ import annotations

import datetime
import logging
import os
import posixpath
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from . import _objlease
from ._faults import FaultTracking, errno_cause, lost_write
from ._fslocal import KEY_RE, TEMP_PREFIX, LocalRoot
from ._protocol import EntryCheck, Held, Lease, check_key, is_removable
from ._trust import Refused, signing, warn_unsigned_remote

__all__ = ["FsspecCache"]

T = TypeVar("T")
DEFAULT_TIMEOUT = 30.0

logger = logging.getLogger("jaxaot")

#: Protocols whose single-object writes are atomic: entries are written in one ``pipe``.
OBJECT_STORE_PROTOCOLS = frozenset(
    {"memory", "gs", "gcs", "s3", "s3a", "az", "abfs", "abfss", "adl", "oci", "oss", "r2"}
)
DEFAULT_BACKOFF = 1.0


_LOCAL_PREFIXES = ("file://", "local://", "file:", "local:")


_Refused = Refused


def _local_path(url: str) -> str:
    """The path a local fsspec URL names. Raises ValueError unless it is absolute
    (``file://`` alone, an unset variable, would otherwise mean the current directory)."""
    raw = url.split("::")[-1]
    for prefix in _LOCAL_PREFIXES:
        if raw.startswith(prefix):
            raw = raw[len(prefix) :]
            break
    if not raw.startswith("/") or not raw.strip("/"):
        raise ValueError(
            f"FsspecCache: {url!r:.80} names no absolute directory; a local store is "
            "file:///absolute/path (three slashes)"
        )
    return raw


_TIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


def _timestamp(info: dict[str, Any]) -> float | None:
    for name in _TIME_FIELDS:
        value = info.get(name)
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _redact(url: str) -> str:
    from ._redis import redact_url

    return redact_url(url)


def _secrets_of(url: str) -> list[str]:
    from ._redis import _url_secrets

    return _url_secrets(url)


class FsspecCache(FaultTracking):
    """A byte cache in an fsspec filesystem (object store or shared directory).

    Args:
      url: where the entries live: ``gs://bucket/prefix``, ``s3://bucket/prefix``,
        ``file:///shared/jaxaot``, ``memory://name`` or any fsspec URL.
      max_bytes: if given, the most bytes of entries kept: older entries are
        removed by ``put`` to make room, and a larger value is not stored.
      storage_options: passed to the fsspec filesystem (credentials, project...).

    Raises:
      ImportError: fsspec (``pip install 'jaxaot[fsspec]'``) or the protocol's
        driver (``gcsfs``, ``s3fs``...) is missing.
      ValueError: an unknown protocol or a bad argument.

    Example::

      cache = TieredCache(DirectoryCache("~/.cache/jaxaot"),
                          FsspecCache("gs://my-bucket/jaxaot"))
    """

    def __init__(
        self,
        url: str,
        *,
        max_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        backoff: float = DEFAULT_BACKOFF,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        try:
            import fsspec.core
        except ImportError as e:
            raise ImportError(
                "FsspecCache needs the 'fsspec' package: pip install 'jaxaot[fsspec]'"
            ) from e
        if not isinstance(url, str) or not url:
            raise ValueError(f"FsspecCache: url must be a non-empty string, got {url!r:.80}")
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0
        ):
            raise ValueError(
                f"FsspecCache: max_bytes must be a non-negative int or None, got {max_bytes!r}"
            )
        if isinstance(backoff, bool) or not isinstance(backoff, int | float) or backoff < 0:
            raise ValueError(f"FsspecCache: backoff must be a non-negative number, got {backoff!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise ValueError(
                f"FsspecCache: timeout must be a positive number or None, got {timeout!r}"
            )
        self.timeout = None if timeout is None else float(timeout)
        self.url = _redact(url)
        self._secrets = _secrets_of(url)
        self.max_bytes = max_bytes
        self.backoff = float(backoff)
        signing()  # an empty $JAXAOT_CACHE_HMAC_KEY is a configuration error: raise now
        self._address = url
        self._options = dict(storage_options or {})
        self._fs: Any = None
        unreachable: OSError | None = None
        try:
            self._fs, root = fsspec.core.url_to_fs(url, **self._options)
            kind = type(self._fs)
        except OSError as e:
            # A driver that connects as it is made (ftp, sftp) with its server
            # down: a fault like any other, said once; each use tries again.
            unreachable = e
            kind = fsspec.get_filesystem_class(fsspec.core.split_protocol(url)[0] or "file")
            root = kind._strip_protocol(url)
        protocols = kind.protocol if isinstance(kind.protocol, tuple | list) else (kind.protocol,)
        self.protocol = str(protocols[0])
        from fsspec.implementations.local import LocalFileSystem

        self._local = issubclass(kind, LocalFileSystem)
        if self._local:
            _local_path(url)
        self._direct = not self._local and bool(OBJECT_STORE_PROTOCOLS.intersection(protocols))
        root = str(root).rstrip("/")
        self._root = root
        self._files = LocalRoot(root)
        self._init_faults(
            {
                "hits": 0,
                "misses": 0,
                "puts": 0,
                "evictions": 0,
                "errors": 0,
                "skipped_offline": 0,
                "refused": 0,
            }
        )
        if not self._local and self.protocol != "memory":
            warn_unsigned_remote("fsspec", self.url)
        if unreachable is not None:
            self._fault("connecting", unreachable)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (made on first use where the store was down)."""
        if self._fs is None:
            import fsspec.core

            self._fs = fsspec.core.url_to_fs(self._address, **self._options)[0]
        return self._fs

    def _is_outage(self, e: BaseException) -> bool:
        return isinstance(e, ConnectionError | TimeoutError | socket.gaierror)

    def ping(self) -> None:
        """Raises ``ConnectionError`` where the store cannot be reached (a driver
        that connects as it is made: ftp, sftp)."""
        try:
            self._remote(lambda: self.fs)
        except Exception as e:
            raise ConnectionError(f"{type(e).__name__}: {self._describe(e)}") from e

    def __repr__(self) -> str:
        return f"FsspecCache({self.url!r})"

    def _remote(self, fn: Callable[[], T]) -> T:
        """``fn()`` (one call of the driver), within the overall deadline for remote
        stores: TimeoutError when it has not returned after ``timeout`` seconds."""
        if self._local or self.protocol == "memory" or self.timeout is None:
            return fn()
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e

        worker = threading.Thread(target=call, name="jaxaot-fsspec-call", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            raise TimeoutError(f"no answer from the store within {self.timeout:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]

    # -- paths and faults ----------------------------------------------------

    _kind = "fsspec"
    _peer = "store"

    def _cause(self, e: BaseException) -> str:
        return errno_cause(e)

    def _redact_text(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def path_of(self, key: str) -> str:
        """The object name (without protocol) that holds the entry for ``key``."""
        check_key(key)
        return f"{self._root}/{key[:2]}/{key}"

    def _is_entry(self, path: str) -> str | None:
        name = posixpath.basename(path)
        shard = posixpath.basename(posixpath.dirname(path))
        if KEY_RE.match(name) and shard == name[:2]:
            return name
        return None

    def _list(self) -> dict[str, dict[str, Any]]:
        """``{key: info}`` of the stored entries. Raises on faults."""
        if self._local:
            return self._files.entries()
        try:
            found = self.fs.find(self._root, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for path, info in dict(found).items():
            key = self._is_entry(str(path))
            if key is not None and info.get("type", "file") != "directory":
                out[key] = info
        return out

    # -- protocol ------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or ``None`` (also on any fault)."""
        path = self.path_of(key)
        if not self._available(f"get of {key[:16]}"):
            self._count("misses")
            return None
        try:
            data = (
                self._files.read(key)
                if self._local
                else self._remote(lambda: self.fs.cat_file(path))
            )
        except FileNotFoundError:
            self._count("misses")
            return None
        except _Refused as r:
            self._count("refused")
            self._warn_once(r.cause, f"{r} (entry {key[:16]}: a miss)")
            self._count("misses")
            return None
        except Exception as e:  # any driver's fault: a miss
            self._fault(f"get of {key[:16]}", e)
            self._count("misses")
            return None
        self._count("hits")
        return bytes(data)

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        """Stores ``value`` under ``key`` unless an entry is already there; faults skip it."""
        path = self.path_of(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"FsspecCache.put: value must be bytes, got {type(value).__name__}")
        value = bytes(value)
        if self.max_bytes is not None and len(value) > self.max_bytes:
            self._warn_once(
                "larger than max_bytes",
                f"put of {key[:16]} skipped: {len(value)} bytes is more than the whole "
                f"store may hold (max_bytes {self.max_bytes})",
            )
            lost_write()
            return
        if not self._available(f"put of {key[:16]}"):
            lost_write()
            return
        try:
            if self._local:
                if self._files.exists(key):
                    return
                if self.max_bytes is not None:
                    self._make_room(len(value))
                self._files.write(key, value)
            else:
                if self._remote(lambda: self.fs.exists(path)):
                    return
                if self.max_bytes is not None:
                    self._make_room(len(value))
                if self._direct:
                    self._remote(lambda: self.fs.pipe_file(path, value))
                else:
                    self._write_moved(path, value)
        except _Refused as r:
            self._warn_once(r.cause, f"{r} (put of {key[:16]} skipped)")
            lost_write()
            return
        except Exception as e:  # any driver's fault: the put is skipped
            self._fault(f"put of {key[:16]}", e)
            lost_write()
            return
        self._count("puts")

    def delete(self, key: str) -> bool:
        """Removes the entry under ``key``; returns whether one was removed."""
        path = self.path_of(key)
        if not self._available(f"delete of {key[:16]}"):
            return False
        try:
            if self._local:
                return self._files.unlink(key)
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        except _Refused as r:
            self._warn_once(r.cause, f"{r} (delete of {key[:16]} skipped)")
            return False
        except Exception as e:
            self._fault(f"delete of {key[:16]}", e)
            return False
        return True

    def keys(self) -> list[str]:
        """The keys of the stored entries (temp and foreign objects are ignored)."""
        if not self._available("keys"):
            return []
        try:
            return sorted(self._list())
        except Exception as e:
            self._fault("listing keys", e)
            return []

    def clear(self) -> None:
        """Removes every entry (objects that are not entries are left alone)."""
        if not self._available("clear"):
            return
        try:
            entries = self._list()
        except Exception as e:
            self._fault("clear", e)
            return
        for key in entries:
            try:
                self._remove(key)
            except FileNotFoundError:
                pass
            except _Refused:
                pass
            except Exception as e:
                self._fault("clear", e)
                return

    def stats(self) -> dict[str, Any]:
        """Backend, URL, protocol, entries, bytes (``None`` on faults) and counters."""
        entries: int | None = None
        total: int | None = None
        if self._available("stats"):
            try:
                listed = self._list()
                entries = len(listed)
                total = sum(int(info.get("size") or 0) for info in listed.values())
            except Exception as e:
                self._fault("stats", e)
        with self._state_lock:
            counters = dict(self._counters)
        return {
            "backend": "fsspec",
            "url": self.url,
            "protocol": self.protocol,
            "entries": entries,
            "bytes": total,
            "max_bytes": self.max_bytes,
            **counters,
        }

    # -- extras --------------------------------------------------------------

    def quarantine(self, key: str, *, force: bool = False, check: EntryCheck | None = None) -> None:
        """Removes a bad entry. Unless ``force``, a sound entry that this process cannot
        check (signed with another key...) is left alone."""
        if not force:
            blob = self.get(key)
            if blob is None:
                return
            if not is_removable(key, blob, check):
                logger.debug("jaxaot fsspec cache %s: left %s alone", self.url, key[:16])
                return
        if self.delete(key):
            logger.debug("jaxaot fsspec cache %s: deleted bad entry %s", self.url, key[:16])

    def lease(self, key: str, ttl: float) -> Lease | Held | None:
        """The lease on ``key`` (see ``_protocol.Leasing``): a lock file on a local
        path, else a lease object expiring ``ttl`` seconds after its last renewal;
        ``None`` (one warning per cause) where the store fails or refuses."""
        check_key(key)
        if self._local:
            got = self._files.lease(key, self._warn_once)
        else:
            got = self._object_lease(key, ttl)
        return got

    def _object_lease(self, key: str, ttl: float) -> Lease | Held | None:
        def run(what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
            if not self._available(what):
                return False, None
            try:
                return True, self._remote(fn)
            except Exception as e:  # any driver's fault: no lease
                self._fault(what, e)
                return False, None

        ok, fs = run(f"lease of {key[:16]}", lambda: self.fs)  # connects where it was down
        if not ok:
            return None
        return _objlease.take(run, fs, _objlease.lease_path(self._root, key), key, ttl)

    # -- internals -------------------------------------------------------------

    def _temp_name(self, path: str) -> str:
        return posixpath.join(
            posixpath.dirname(path), f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        )

    def _remove(self, key: str) -> bool:
        """Deletes an entry (for ``clear`` and eviction); raises on faults."""
        if self._local:
            return self._files.unlink(key)
        self.fs.rm_file(self.path_of(key))
        return True

    def _write_moved(self, path: str, value: bytes) -> None:
        """Temp object, then a move (a rename where the filesystem has one)."""
        tmp = self._temp_name(path)
        try:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        except Exception:  # stores without directories
            pass
        self._remote(lambda: self.fs.pipe_file(tmp, value))
        try:
            self.fs.mv(tmp, path)
        except BaseException:
            try:
                self.fs.rm_file(tmp)
            except Exception:
                pass
            raise

    def _make_room(self, incoming: int) -> None:
        """Removes the oldest entries until ``incoming`` more bytes fit under ``max_bytes``."""
        assert self.max_bytes is not None
        listed = self._list()
        total = sum(int(info.get("size") or 0) for info in listed.values())
        if total + incoming <= self.max_bytes:
            return
        order = sorted(listed, key=lambda k: (_timestamp(listed[k]) or 0.0, k))
        evicted = 0
        for key in order:
            if total + incoming <= self.max_bytes:
                break
            try:
                if self._remove(key):
                    evicted += 1
            except (FileNotFoundError, _Refused):
                pass
            total -= int(listed[key].get("size") or 0)
        if evicted:
            self._count("evictions", evicted)
