"""A cache in a Redis server, shared by every process and machine that reaches it.

Layout: one plain string value per entry, under ``<prefix><key>`` (the default
prefix is ``jaxaot:``), plus leases and notes (below); several caches can share
one database under different prefixes.

Guarantees:

* ``put`` is ``SET <prefix><key> <value> NX [PX ttl]``: an existing entry is
  kept, so two processes writing the same key at once leave one complete value
  (Redis applies each ``SET`` atomically).
* ``keys``/``clear``/``stats`` walk the prefix with ``SCAN`` (never ``KEYS``)
  and only touch names under the prefix that are valid cache keys.
* Every call has an overall deadline: ``get``, ``put`` and ``delete`` end
  within about ``timeout`` seconds (``keys``, ``clear`` and ``stats``, which
  walk the database, within ``LIST_DEADLINE_FACTOR`` times that), however
  slowly the server trickles its reply: every socket read and write is given
  only the time left. The client does not retry on its own.
* Faults never raise from the protocol methods: a server that is down, slow,
  out of memory (``OOM``), read-only (a replica), refusing authentication,
  answering garbage or with the wrong type, or any other fault of the server
  or the client library makes ``get`` a miss, ``put`` a no-op, ``keys``
  empty, ``delete`` false. Each cause is logged once per cache instance as a
  WARNING on the ``jaxaot`` logger, later occurrences at DEBUG.
* Credentials never show: the password in the URL (``redis://:PASSWORD@...``,
  ``?password=...``) is replaced by ``***`` in ``url``, ``repr``, ``stats``,
  warnings and errors.
* After a connection failure or a timeout the cache *backs off*: for
  ``backoff`` seconds (default 1 s) calls do not contact the server at all
  (they miss or skip immediately), then the next call tries again; once the
  server answers, hits resume.

Notes (``note``/``notes``, see ``_protocol.Indexing``): a list under
``<prefix>index:<tag>`` of ``<key> <note>`` items, most recent first, trimmed to
``INDEX_ITEMS`` (``LPUSH``, ``LTRIM``); they are not entries, so ``keys``,
``clear`` and ``stats`` never see them.

Leases (``lease``, see ``_redislease``): ``SET <prefix>lease:<key> <record> NX
PX <ttl>``, renewed and released only by their holder; a server that is down
lends none, and the entry is made locally as without leases.

Entries become code in the reading process: anyone who can write to the Redis
database can plant one. Set ``$JAXAOT_CACHE_HMAC_KEY`` (the same secret in
every process) so that entries are signed and foreign ones are refused; without
it the first RedisCache of a process logs one loud warning.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from . import _redislease
from ._faults import FaultTracking, lost_write
from ._protocol import (
    INDEX_ITEM_BYTES,
    INDEX_ITEMS,
    EntryCheck,
    Held,
    Lease,
    check_key,
    is_removable,
)
from ._trust import warn_unsigned_remote

__all__ = ["DEFAULT_BACKOFF", "LIST_DEADLINE_FACTOR", "RedisCache", "redact_url"]

logger = logging.getLogger("jaxaot")

#: Seconds during which a cache that lost its server does not try to reach it again.
DEFAULT_BACKOFF = 1.0
#: ``keys``, ``clear`` and ``stats`` may take this many times ``timeout`` in all.
LIST_DEADLINE_FACTOR = 10.0
#: Query parameters of a URL that hold secrets.
_SECRET_PARAMS = frozenset(
    {"password", "pass", "passwd", "pwd", "secret", "token", "auth", "access_token", "key"}
)

_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_SCAN_COUNT = 1000
_BATCH = 500
_INDEX_PREFIX = "index:"


def _url_secrets(url: str) -> list[str]:
    """The secrets in ``url``: its password and secret-named query parameters."""
    try:
        parts = urllib.parse.urlsplit(url)
        found = [parts.password] if parts.password else []
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return []
    found += [v for k, v in query if k.lower() in _SECRET_PARAMS and v]
    for text in list(found):  # as they may appear in the URL itself
        quoted = urllib.parse.quote(text, safe="")
        if quoted != text:
            found.append(quoted)
    return sorted(set(found), key=len, reverse=True)


def redact_url(url: str) -> str:
    """``url`` with its password and secret query parameters replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return "<unparsable url>"
    if password is not None:
        user = parts.username or ""
        try:
            host = parts.hostname or ""
            port = parts.port
        except ValueError:
            host, port = "<host>", None
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{user}:***@{host}" + (f":{port}" if port is not None else "")
        parts = parts._replace(netloc=netloc)
    if any(k.lower() in _SECRET_PARAMS for k, _ in query):
        redacted = [(k, "***" if k.lower() in _SECRET_PARAMS else v) for k, v in query]
        parts = parts._replace(query=urllib.parse.urlencode(redacted, safe="*"))
    text = urllib.parse.urlunsplit(parts)
    for secret in _url_secrets(url):  # anywhere else (a malformed URL)
        text = text.replace(secret, "***")
    return text


class _Deadline(threading.local):
    """When the current call of this thread must be over (``time.monotonic``), or ``None``."""

    at: float | None = None


class _DeadlineSocket:
    """A socket whose blocking reads and writes get only the time left until the
    call's deadline: a server that trickles its reply cannot stretch a call."""

    def __init__(self, sock: Any, deadline: _Deadline) -> None:
        self._sock = sock
        self._deadline = deadline
        self._timeout = sock.gettimeout()

    def settimeout(self, value: float | None) -> None:
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._timeout

    @contextlib.contextmanager
    def _bounded(self) -> Iterator[None]:
        at = self._deadline.at
        if at is None or self._timeout == 0:  # no deadline, or a non-blocking poll
            yield
            return
        left = at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        self._sock.settimeout(left if self._timeout is None else min(self._timeout, left))
        try:
            yield
        finally:
            self._sock.settimeout(self._timeout)

    def recv(self, *args: Any) -> Any:
        with self._bounded():
            return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> Any:
        with self._bounded():
            return self._sock.recv_into(*args)

    def sendall(self, *args: Any) -> Any:
        with self._bounded():  # a timeout bounds the whole of sendall
            return self._sock.sendall(*args)

    def send(self, *args: Any) -> Any:
        with self._bounded():
            return self._sock.send(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _deadline_connection_class(base: type, deadline: _Deadline) -> type:
    """``base`` (the client's connection class) with its sockets under ``deadline``."""

    def _connect(self: Any) -> Any:
        return _DeadlineSocket(base._connect(self), deadline)  # type: ignore[attr-defined]

    return type(f"Deadline{base.__name__}", (base,), {"_connect": _connect})


class RedisCache(FaultTracking):
    """A byte cache in a Redis database.

    Args:
      url: a ``redis://[[user]:password@]host[:port][/db]`` or ``rediss://``
        (TLS) URL, as understood by ``redis.Redis.from_url``.
      prefix: prepended to every key; caches with different prefixes in one
        database do not see each other's entries.
      ttl: if given, seconds after which an entry written by this cache
        expires (set once, at ``put``; reads do not extend it).
      timeout: seconds one ``get``/``put``/``delete`` may take in all (connecting
        included); ``keys``/``clear``/``stats`` may take ``LIST_DEADLINE_FACTOR``
        times that.
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
        self._secrets = _url_secrets(url)
        self.prefix = prefix
        self.ttl = None if ttl is None else float(ttl)
        self.timeout = float(timeout)
        self.backoff = float(backoff)
        #: Well-formed refusals by a sound server: the connection stays usable.
        self._refusal: tuple[type[BaseException], ...] = (redis.ResponseError,)
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
            raise ValueError(
                f"RedisCache: cannot use the URL {self.url}: {self._scrub(str(e))}"
            ) from None
        self._deadline = _Deadline()
        pool = self._client.connection_pool
        pool.connection_class = _deadline_connection_class(pool.connection_class, self._deadline)
        self._prefix_bytes = prefix.encode("utf-8")
        self._match = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
        self._init_faults({"hits": 0, "misses": 0, "puts": 0, "errors": 0, "skipped_offline": 0})
        warn_unsigned_remote("redis", self.url)

    def __repr__(self) -> str:
        return f"RedisCache({self.url!r}, prefix={self.prefix!r})"

    # -- faults --------------------------------------------------------------

    _kind = "redis"
    _peer = "server"

    def _cause(self, e: BaseException) -> str:
        return _cause(e)

    def _is_outage(self, e: BaseException) -> bool:
        return isinstance(e, self._outage)

    def _scrub(self, text: str) -> str:
        for secret in getattr(self, "_secrets", ()):
            text = text.replace(secret, "***")
        return text

    def _redact_text(self, text: str) -> str:
        return self._scrub(text)

    def _describe(self, e: BaseException) -> str:
        text = super()._describe(e)
        if _cause(e) in ("AuthenticationError", "ResponseError NOAUTH", "ResponseError WRONGPASS"):
            # redis-py's words for a missing password name the protocol, not the fix.
            if self._secrets:
                return f"the server refused the user or password in the URL ({text})"
            return (
                "the server needs a password: give it in the URL, "
                "redis://:PASSWORD@host:port/db (or redis://USER:PASSWORD@...)"
            )
        return text

    def _fault(self, what: str, e: BaseException) -> None:
        super()._fault(what, e)
        if not isinstance(e, self._refusal):
            # A broken or half-done exchange (a garbled reply, a failed handshake):
            # the next call starts on a fresh connection, never mid-reply.
            try:
                self._client.connection_pool.disconnect()
            except Exception:
                pass

    @contextlib.contextmanager
    def _within(self, seconds: float) -> Iterator[None]:
        """Gives every socket read and write of the enclosed calls only the time left
        until ``seconds`` from now."""
        self._deadline.at = time.monotonic() + seconds
        try:
            yield
        finally:
            self._deadline.at = None

    def _call_deadline(self) -> float:
        return self.timeout if self.timeout > 0 else 1e9

    def _list_deadline(self) -> float:
        return self._call_deadline() * LIST_DEADLINE_FACTOR

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
            with self._within(self._call_deadline()):
                value = self._client.get(name)
            if value is not None and not isinstance(value, bytes):
                raise _ProtocolError(f"GET answered a {type(value).__name__}, not a string")
        except Exception as e:  # any server or client fault: a miss
            self._fault(f"get of {key[:16]}", e)
            if isinstance(e, self._refusal) and str(e).startswith("WRONGTYPE"):
                self._drop_foreign(name)
            self._count("misses")
            return None
        if value is None:
            self._count("misses")
            return None
        self._count("hits")
        return value

    def _drop_foreign(self, name: str) -> None:
        """Removes a value of another type (a list, a hash) under an entry's name:
        no entry, and while it stays no entry can be stored there (``SET NX``)."""
        try:
            with self._within(self._call_deadline()):
                self._client.delete(name)
        except Exception:  # best effort: the next get tries again
            logger.debug("jaxaot: could not remove %s from %s", name, self.url, exc_info=True)

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        """Stores ``value`` under ``key`` unless an entry is already there; faults skip it."""
        name = self._name(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"RedisCache.put: value must be bytes, got {type(value).__name__}")
        if not self._available(f"put of {key[:16]}"):
            lost_write()
            return
        px = None if self.ttl is None else max(1, int(round(self.ttl * 1000)))
        try:
            with self._within(self._call_deadline()):
                stored = self._client.set(name, bytes(value), nx=True, px=px)
        except Exception as e:  # any server or client fault: the put is skipped
            self._fault(f"put of {key[:16]}", e)
            lost_write()
            return
        if stored:
            self._count("puts")

    def delete(self, key: str) -> bool:
        """Removes the entry under ``key``; returns whether one was removed."""
        name = self._name(key)
        if not self._available(f"delete of {key[:16]}"):
            return False
        try:
            with self._within(self._call_deadline()):
                removed = self._client.delete(name)
            if isinstance(removed, bool) or not isinstance(removed, int):
                raise _ProtocolError(f"DEL answered a {type(removed).__name__}, not an integer")
            return removed > 0
        except Exception as e:
            self._fault(f"delete of {key[:16]}", e)
            return False

    def _scan(self) -> list[bytes]:
        names: list[bytes] = []
        for name in self._client.scan_iter(match=self._match, count=_SCAN_COUNT):
            if not isinstance(name, bytes):
                raise _ProtocolError(f"SCAN answered a {type(name).__name__} as a key name")
            if self._is_key(name) is not None:
                names.append(name)
        return names

    def keys(self) -> list[str]:
        """The keys under this cache's prefix (``SCAN``); empty when the server fails."""
        if not self._available("keys"):
            return []
        try:
            with self._within(self._list_deadline()):
                names = self._scan()
        except Exception as e:
            self._fault("listing keys", e)
            return []
        return sorted({k for k in (self._is_key(n) for n in names) if k is not None})

    def clear(self) -> None:
        """Removes every entry under this cache's prefix (and nothing else)."""
        if not self._available("clear"):
            return
        try:
            with self._within(self._list_deadline()):
                names = self._scan()
                for i in range(0, len(names), _BATCH):
                    self._client.delete(*names[i : i + _BATCH])
        except Exception as e:
            self._fault("clear", e)

    def stats(self) -> dict[str, Any]:
        """Backend, URL (password hidden), prefix, entries, bytes and counters.

        ``entries``/``bytes`` are ``None`` when the server cannot be reached.
        """
        entries: int | None = None
        total: int | None = None
        if self._available("stats"):
            try:
                with self._within(self._list_deadline()):
                    names = self._scan()
                    total = 0
                    for i in range(0, len(names), _BATCH):
                        pipe = self._client.pipeline(transaction=False)
                        for name in names[i : i + _BATCH]:
                            pipe.strlen(name)
                        total += sum(int(n) for n in pipe.execute())
                entries = len(names)
            except Exception as e:
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
            **self._server_memory(entries is not None),
            **counters,
        }

    def _server_memory(self, reachable: bool) -> dict[str, Any]:
        """The server's memory and what it drops to stay under its ``maxmemory``: a
        cache near that limit loses entries silently (``None`` where the server
        does not say, as managed servers that refuse ``INFO``)."""
        figures: dict[str, Any] = dict.fromkeys(
            ("server_used_bytes", "server_max_bytes", "eviction_policy", "evicted_keys")
        )
        if not reachable:
            return figures
        try:
            with self._within(self._call_deadline()):
                info = self._client.info()  # (its default sections: memory and stats)
        except Exception as e:  # (INFO refused: the figures stay unknown)
            logger.debug("Redis INFO refused: %s", e)
            return figures
        figures["server_used_bytes"] = info.get("used_memory")
        figures["server_max_bytes"] = info.get("maxmemory") or None  # 0: no limit
        figures["eviction_policy"] = info.get("maxmemory_policy")
        figures["evicted_keys"] = info.get("evicted_keys")
        return figures

    # -- extras --------------------------------------------------------------

    def lease(self, key: str, ttl: float) -> Lease | Held | None:
        """The lease on ``key`` (see ``_protocol.Leasing``), expiring ``ttl`` seconds
        after it was taken or last renewed; ``None`` while the server fails."""
        name = self.prefix + _redislease.LEASE_PREFIX + check_key(key)
        return _redislease.take(self._run, name, key, ttl)

    def note(self, tag: str, key: str, item: bytes) -> None:
        """Notes ``item`` about ``key`` under ``tag`` (see ``_protocol.Indexing``);
        a fault skips it."""
        name = self.prefix + _INDEX_PREFIX + check_key(tag)
        check_key(key)
        if len(item) > INDEX_ITEM_BYTES:
            return
        head = key.encode("ascii") + b" "

        def add(client: Any) -> None:
            noted = client.lrange(name, 0, INDEX_ITEMS - 1) or []
            if any(isinstance(n, bytes) and n.startswith(head) for n in noted):
                return
            pipe = client.pipeline(transaction=False)
            pipe.lpush(name, head + bytes(item))
            pipe.ltrim(name, 0, INDEX_ITEMS - 1)
            if self.ttl is not None:
                pipe.pexpire(name, max(1, int(round(self.ttl * 1000))))
            pipe.execute()

        self._run(f"note under {tag[:16]}", add)

    def notes(self, tag: str) -> list[tuple[str, bytes]]:
        """The notes under ``tag`` of stored entries, most recent first (``LRANGE``
        and ``EXISTS``: no entry is read)."""
        name = self.prefix + _INDEX_PREFIX + check_key(tag)

        def read(client: Any) -> list[tuple[str, bytes]]:
            found: list[tuple[str, bytes]] = []
            for n in client.lrange(name, 0, INDEX_ITEMS - 1) or []:
                key, _, item = bytes(n).partition(b" ")
                text = key.decode("ascii", "replace")
                if _KEY_RE.match(text) and text not in {k for k, _ in found}:
                    found.append((text, item))
            if not found:
                return []
            pipe = client.pipeline(transaction=False)
            for text, _ in found:
                pipe.exists(self.prefix + text)
            held = pipe.execute()
            return [f for f, h in zip(found, held, strict=True) if h]

        ok, got = self._run(f"notes under {tag[:16]}", read)
        return got if ok and isinstance(got, list) else []

    def _run(self, what: str, fn: Callable[[Any], Any]) -> tuple[bool, Any]:
        """``(True, fn(client))`` within the call deadline, or ``(False, None)`` on any
        fault (counted, one warning per cause, then the back-off)."""
        if not self._available(what):
            return False, None
        try:
            with self._within(self._call_deadline()):
                return True, fn(self._client)
        except Exception as e:
            self._fault(what, e)
            return False, None

    def quarantine(self, key: str, *, force: bool = False, check: EntryCheck | None = None) -> None:
        """Removes a bad entry (Redis has no place to keep it aside). Unless ``force``,
        a sound entry that this process cannot check (signed with another key...)
        is left alone."""
        if not force:
            blob = self.get(key)
            if blob is None:
                return
            if not is_removable(key, blob, check):
                logger.debug("jaxaot redis cache %s: left %s alone", self.url, key[:16])
                return
        if self.delete(key):
            logger.debug("jaxaot redis cache %s: deleted bad entry %s", self.url, key[:16])

    def ping(self) -> None:
        """Raises ``ConnectionError`` (with the password hidden) if the server cannot be
        reached or does not answer like Redis, within the call deadline (for the CLI)."""
        try:
            with self._within(self._call_deadline()):
                self._client.ping()
        except Exception as e:
            raise ConnectionError(f"{_cause(e)}: {self._describe(e)}") from None

    def close(self) -> None:
        """Closes the connections (the cache reconnects if used again)."""
        try:
            self._client.close()
        except Exception:
            pass


class _ProtocolError(Exception):
    """The server answered with something a Redis server would not send."""


def _cause(e: BaseException) -> str:
    name = type(e).__name__
    if name == "ResponseError":
        # Server refusals without a dedicated class: name them by their code word.
        word = str(e).split(" ", 1)[0]
        if word.isupper() and word.isalpha():
            return f"ResponseError {word}"
    return name
