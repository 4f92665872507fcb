"""A cache in a Redis server, shared by every process and machine that reaches it.

Layout: one plain string value per entry, under ``<prefix><key>`` (the default
prefix is ``jaxaot:``). Nothing else is stored; several caches can share one
database under different prefixes.

Guarantees:

* ``put`` is ``SET <prefix><key> <value> NX [PX ttl]``: an existing entry is
  kept, so two processes writing the same key at once leave one complete value
  (Redis applies each ``SET`` atomically).
* ``keys``/``clear``/``stats`` walk the prefix with ``SCAN`` (never ``KEYS``)
  and only touch names under the prefix that are valid cache keys.
* Every socket operation is bounded by ``timeout`` (connect and read), and the
  client does not retry on its own, so no call blocks for much longer.
* Faults never raise from the protocol methods: a server that is down, slow,
  out of memory (``OOM``), read-only (a replica), refusing authentication, or
  any other ``redis.RedisError``/``OSError`` makes ``get`` a miss, ``put`` a
  no-op, ``keys`` empty, ``delete`` false. Each cause is logged once per cache
  instance as a WARNING on the ``jaxaot`` logger, later occurrences at DEBUG.
* After a connection failure or a timeout the cache *backs off*: for
  ``backoff`` seconds (default 1 s) calls do not contact the server at all
  (they miss or skip immediately), then the next call tries again; once the
  server answers, hits resume.

Entries become code in the reading process: anyone who can write to the Redis
database can plant one. Set ``$JAXAOT_CACHE_HMAC_KEY`` (the same secret in
every process) so that entries are signed and foreign ones are refused.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from typing import Any

from ._faults import FaultTracking
from ._protocol import check_key

__all__ = ["DEFAULT_BACKOFF", "RedisCache", "redact_url"]

logger = logging.getLogger("jaxaot")

#: Seconds during which a cache that lost its server does not try to reach it again.
DEFAULT_BACKOFF = 1.0

_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_SCAN_COUNT = 1000
_BATCH = 500


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{user}:***@{host}" + (f":{port}" if port is not None else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class RedisCache(FaultTracking):
    """A byte cache in a Redis database.

    Args:
      url: a ``redis://[[user]:password@]host[:port][/db]`` or ``rediss://``
        (TLS) URL, as understood by ``redis.Redis.from_url``.
      prefix: prepended to every key; caches with different prefixes in one
        database do not see each other's entries.
      ttl: if given, seconds after which an entry written by this cache
        expires (set once, at ``put``; reads do not extend it).
      timeout: seconds allowed to connect and for each reply.
      backoff: seconds during which, after a connection failure or timeout,
        calls skip the server instead of waiting on it again.

    Raises:
      ImportError: the ``redis`` package is missing (``pip install 'jaxaot[redis]'``).
      ValueError: a bad argument, or a URL that ``redis`` cannot parse.

    Construction does not contact the server; a server that is down shows as
    misses and one warning.

    Example::

      cache = TieredCache(DirectoryCache("~/.cache/jaxaot"),
                          RedisCache("redis://cache.internal:6379/0", ttl=7 * 86400))
      jaxaot.set_cache(cache)
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "jaxaot:",
        ttl: float | None = None,
        timeout: float = 2.0,
        backoff: float = DEFAULT_BACKOFF,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError(
                "RedisCache needs the 'redis' package: pip install 'jaxaot[redis]'"
            ) from e
        if not isinstance(url, str) or not url:
            raise ValueError(f"RedisCache: url must be a non-empty string, got {url!r:.80}")
        if not isinstance(prefix, str):
            raise ValueError(f"RedisCache: prefix must be a string, got {prefix!r:.80}")
        if ttl is not None and (
            isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0
        ):
            raise ValueError(f"RedisCache: ttl must be a positive number of seconds, got {ttl!r}")
        for name, value in (("timeout", timeout), ("backoff", backoff)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"RedisCache: {name} must be a non-negative number, got {value!r}")
        self.url = redact_url(url)
        self.prefix = prefix
        self.ttl = None if ttl is None else float(ttl)
        self.timeout = float(timeout)
        self.backoff = float(backoff)
        self._redis_error: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._outage: tuple[type[BaseException], ...] = (
            redis.ConnectionError,
            redis.TimeoutError,
            ConnectionError,
            TimeoutError,
        )
        options: dict[str, Any] = {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "retry": Retry(NoBackoff(), 0),  # no silent retries: one timeout per call at most
            "retry_on_error": [],
            "health_check_interval": 0,
        }
        try:  # redis>=7: no "maintenance notifications" (they relax the timeouts)
            from redis.maint_notifications import MaintNotificationsConfig

            options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
        except ImportError:
            pass
        try:
            self._client = redis.Redis.from_url(url, **options)
        except (ValueError, redis.RedisError) as e:
            raise ValueError(f"RedisCache: cannot use the URL {self.url}: {e}") from None
        self._prefix_bytes = prefix.encode("utf-8")
        self._match = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
        self._init_faults({"hits": 0, "misses": 0, "puts": 0, "errors": 0, "skipped_offline": 0})

    def __repr__(self) -> str:
        return f"RedisCache({self.url!r}, prefix={self.prefix!r})"

    # -- faults --------------------------------------------------------------

    _kind = "redis"
    _peer = "server"

    def _cause(self, e: BaseException) -> str:
        return _cause(e)

    def _is_outage(self, e: BaseException) -> bool:
        return isinstance(e, self._outage)

    def _is_key(self, name: bytes) -> str | None:
        if not name.startswith(self._prefix_bytes):
            return None
        rest = name[len(self._prefix_bytes) :].decode("ascii", "replace")
        return rest if _KEY_RE.match(rest) else None

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    # -- protocol ------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or ``None`` (also when the server fails)."""
        name = self._name(key)
        if not self._available(f"get of {key[:16]}"):
            self._count("misses")
            return None
        try:
            value = self._client.get(name)
        except self._redis_error as e:
            self._fault(f"get of {key[:16]}", e)
            self._count("misses")
            return None
        if value is None:
            self._count("misses")
            return None
        self._count("hits")
        return value if isinstance(value, bytes) else bytes(str(value), "utf-8")

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        """Stores ``value`` under ``key`` unless an entry is already there; faults skip it."""
        name = self._name(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"RedisCache.put: value must be bytes, got {type(value).__name__}")
        if not self._available(f"put of {key[:16]}"):
            return
        px = None if self.ttl is None else max(1, int(round(self.ttl * 1000)))
        try:
            stored = self._client.set(name, bytes(value), nx=True, px=px)
        except self._redis_error as e:
            self._fault(f"put of {key[:16]}", e)
            return
        if stored:
            self._count("puts")

    def delete(self, key: str) -> bool:
        """Removes the entry under ``key``; returns whether one was removed."""
        name = self._name(key)
        if not self._available(f"delete of {key[:16]}"):
            return False
        try:
            return bool(self._client.delete(name))
        except self._redis_error as e:
            self._fault(f"delete of {key[:16]}", e)
            return False

    def _scan(self) -> list[bytes]:
        names: list[bytes] = []
        for name in self._client.scan_iter(match=self._match, count=_SCAN_COUNT):
            if self._is_key(name) is not None:
                names.append(name)
        return names

    def keys(self) -> list[str]:
        """The keys under this cache's prefix (``SCAN``); empty when the server fails."""
        if not self._available("keys"):
            return []
        try:
            names = self._scan()
        except self._redis_error as e:
            self._fault("listing keys", e)
            return []
        return sorted({k for k in (self._is_key(n) for n in names) if k is not None})

    def clear(self) -> None:
        """Removes every entry under this cache's prefix (and nothing else)."""
        if not self._available("clear"):
            return
        try:
            names = self._scan()
            for i in range(0, len(names), _BATCH):
                self._client.delete(*names[i : i + _BATCH])
        except self._redis_error as e:
            self._fault("clear", e)

    def stats(self) -> dict[str, Any]:
        """Backend, URL (password hidden), prefix, entries, bytes and counters.

        ``entries``/``bytes`` are ``None`` when the server cannot be reached.
        """
        entries: int | None = None
        total: int | None = None
        if self._available("stats"):
            try:
                names = self._scan()
                total = 0
                for i in range(0, len(names), _BATCH):
                    pipe = self._client.pipeline(transaction=False)
                    for name in names[i : i + _BATCH]:
                        pipe.strlen(name)
                    total += sum(int(n) for n in pipe.execute())
                entries = len(names)
            except self._redis_error as e:
                self._fault("stats", e)
                entries = total = None
        with self._state_lock:
            counters = dict(self._counters)
        return {
            "backend": "redis",
            "url": self.url,
            "prefix": self.prefix,
            "ttl": self.ttl,
            "entries": entries,
            "bytes": total,
            **counters,
        }

    # -- extras --------------------------------------------------------------

    def quarantine(self, key: str) -> None:
        """Removes a bad entry (Redis has no place to keep it aside)."""
        if self.delete(key):
            logger.debug("jaxaot redis cache %s: deleted bad entry %s", self.url, key[:16])

    def ping(self) -> None:
        """Raises the client's exception if the server cannot be reached (for the CLI)."""
        self._client.ping()

    def close(self) -> None:
        """Closes the connections (the cache reconnects if used again)."""
        try:
            self._client.close()
        except self._redis_error:
            pass


def _cause(e: BaseException) -> str:
    name = type(e).__name__
    if name == "ResponseError":
        # Server refusals without a dedicated class: name them by their code word.
        word = str(e).split(" ", 1)[0]
        if word.isupper() and word.isalpha():
            return f"ResponseError {word}"
    return name
