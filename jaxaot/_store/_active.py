"""Which cache is active: the process default, per-context overrides, and the
environment variables that choose the default (the one parser of ``JAXAOT_CACHE``).

Environment variables (read when the default cache is first needed):
  JAXAOT_CACHE            ``dir`` (the default): a DirectoryCache at the default
                          location; ``memory``: this process only; ``off``: no cache;
                          or the URL of a shared store, used behind the local directory
                          as ``TieredCache(DirectoryCache(<default dir>), <remote>)``
                          (a MemoryCache stands in for the directory if that is
                          unusable; remote hits are verified before they are copied
                          to the local tier):
                            ``redis://[:password@]host[:port][/db]``, ``rediss://...``
                                → RedisCache(url)   (needs ``jaxaot[redis]``)
                            ``gs://bucket/path``, ``s3://bucket/path``,
                            ``file:///shared/path``, ``memory://name``, or another
                            fsspec protocol → FsspecCache(url)   (needs
                            ``jaxaot[fsspec]``, plus gcsfs/s3fs for the clouds)
                          The backend's package is imported only when such a URL is
                          used; a missing one raises ImportError naming the extra.
                          A remote store that is down costs misses and one warning,
                          never a failure.
  JAXAOT_CACHE_DIR        the default cache directory; else ``$XDG_CACHE_HOME/jaxaot``,
                          else ``~/.cache/jaxaot``.
  JAXAOT_CACHE_MAX_BYTES  the default cache's size cap (default 10 GiB): bytes, or a
                          number with K, M, G, T or P (powers of 1024: ``2G``,
                          ``500M``, ``1.5GiB``), as ``jaxaot cache prune --max-bytes``.
  JAXAOT_CACHE_HMAC_KEY   if set, entries are signed and verified with this key (and
                          only entries signed with it are read); set but empty or
                          blank is a configuration error (ValueError).
  JAXAOT_EXPLAIN_MISSES   ``1`` to log, at WARNING, why each cache miss happened.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import threading
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

from .._caches import Cache, MemoryCache
from .._caches._directory import DEFAULT_DIRECTORY_BYTES, DirectoryCache, UnsafeCacheDirError
from .._env import SettingError, flag
from .._stats import set_during, warn_once

__all__ = [
    "CacheSetting",
    "cache_setting",
    "default_cache_dir",
    "default_max_bytes",
    "explain_misses",
    "get_cache",
    "parse_size",
    "remote_cache_from_url",
    "set_cache",
    "url_scheme",
    "using_cache",
]

_UNSET: Any = object()
_default: Any = _UNSET
_default_lock = threading.Lock()
_override: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxaot_cache", default=_UNSET)


def explain_misses() -> bool:
    return flag("JAXAOT_EXPLAIN_MISSES")


def default_cache_dir() -> str:
    """Where the default cache lives: $JAXAOT_CACHE where it is a path, else
    $JAXAOT_CACHE_DIR, $XDG_CACHE_HOME/jaxaot or ~/.cache/jaxaot."""
    named = os.environ.get("JAXAOT_CACHE", "").strip()
    if url_scheme(named) is None and _as_path(named) is not None:
        return _as_path(named)  # type: ignore[return-value]
    explicit = os.environ.get("JAXAOT_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec: a relative path is invalid and ignored (not one under the
    # working directory, which changes between runs).
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "jaxaot"))


def _as_path(text: str) -> str | None:
    """``text`` as an absolute directory path, where it reads as a path (it starts
    with ``~`` or ``.``, or holds a separator), as users set a cache directory."""
    if text.startswith(("~", ".")) or os.sep in text:
        return os.path.abspath(os.path.expanduser(text))
    return None


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``500M``, ``2G``, ``1.5GiB``, ``64kb``...: K, M, G, T and P
    are powers of 1024, a trailing ``B``/``iB`` is optional, case does not matter.
    The one size syntax of jaxaot (``JAXAOT_CACHE_MAX_BYTES``, ``prune --max-bytes``).

    Raises:
      ValueError: not such a size.
    """
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(
            f"invalid size {text!r:.40}: use bytes or a number with K, M, G, T or P "
            "(powers of 1024), e.g. 500M or 2G"
        )
    if not m.group(2) and "." in m.group(1):  # a fraction of a byte: a typo, not a size
        raise ValueError(f"invalid size {text!r:.40}: a number of bytes is a whole number")
    return int(float(m.group(1)) * 1024 ** _SIZE_UNITS[m.group(2).lower()])


def default_max_bytes() -> int:
    text = os.environ.get("JAXAOT_CACHE_MAX_BYTES", "").strip()
    if not text:
        return DEFAULT_DIRECTORY_BYTES
    try:
        return parse_size(text)
    except ValueError as e:
        raise SettingError(f"JAXAOT_CACHE_MAX_BYTES: {e}") from None


#: URL schemes of JAXAOT_CACHE served by RedisCache; any other ``scheme://`` is fsspec's.
REDIS_SCHEMES = ("redis", "rediss")


def url_scheme(text: str) -> str | None:
    """The lowercased scheme of ``text`` if it looks like a URL (``scheme://...``), else None."""
    head, sep, _ = text.partition("://")
    if not sep or not head or not head.replace("+", "").replace("-", "").isalnum():
        return None
    return head.lower()


def remote_cache_from_url(url: str) -> Cache:
    """The backend for a store URL: RedisCache for ``redis://``/``rediss://``, else
    FsspecCache (``gs://``, ``s3://``, ``file://``, ``memory://``, any fsspec protocol).

    Raises:
      ValueError: not a URL, or an unknown protocol.
      ImportError: the backend's package (or the protocol's fsspec driver) is missing.
    """
    scheme = url_scheme(url)
    if scheme is None:
        raise ValueError(f"not a cache URL (scheme://...): {url!r:.80}")
    if scheme in REDIS_SCHEMES:
        from .._caches._redis import RedisCache

        return RedisCache(url)
    from .._caches._fsspec import FsspecCache

    return FsspecCache(url)


def _local_tier() -> Cache:
    path = default_cache_dir()
    try:
        return DirectoryCache(path, max_bytes=default_max_bytes())
    except (UnsafeCacheDirError, OSError) as e:
        warn_once(
            "default-cache-dir",
            f"jaxaot: not using the cache directory {path} ({e}); "
            "caching in memory for this process instead",
        )
        return MemoryCache()


_CACHE_CHOICES = (
    "JAXAOT_CACHE must be one of: 'dir' (a cache directory, the default), a "
    "directory's path (/path/to/cache), 'memory' "
    "(this process only), 'off' (no cache), or the URL of a shared store: "
    "redis://[:password@]host[:port][/db] or rediss://... (Redis), "
    "file:///absolute/path (a shared directory), or any fsspec URL such as "
    "gs://bucket/path, s3://bucket/path or memory://name"
)


class CacheSetting(NamedTuple):
    """What ``JAXAOT_CACHE`` asks for: ``dir`` (at ``path`` where it names one),
    ``memory``, ``off``, or a store ``url``."""

    kind: Literal["dir", "memory", "off", "url"]
    url: str | None = None
    path: str | None = None


def cache_setting(raw: str | None = None) -> CacheSetting:
    """``JAXAOT_CACHE`` (or ``raw``) parsed.

    Raises:
      ValueError: not one of the settings (the message lists them).
    """
    text = (os.environ.get("JAXAOT_CACHE", "dir") if raw is None else raw).strip()
    if url_scheme(text) is not None:
        return CacheSetting("url", text)
    path = _as_path(text)
    if path is not None:
        return CacheSetting("dir", path=path)
    choice = text.lower()
    if choice in ("off", "none", "0", "false"):
        return CacheSetting("off")
    if choice in ("memory", "mem"):
        return CacheSetting("memory")
    if choice in ("dir", "directory", "disk", ""):
        return CacheSetting("dir")
    raise SettingError(f"{_CACHE_CHOICES}; got {text!r:.80}")


def _default_from_env() -> Cache | None:
    from .._caches._trust import signing

    signing()  # an empty $JAXAOT_CACHE_HMAC_KEY is a configuration error: raise now
    from ._once import lease_ttl, lease_wait

    # Read at a process's first miss, which may come hours in: checked now.
    lease_wait()
    lease_ttl()
    setting = cache_setting()
    if setting.kind == "url":
        from .._caches._tiered import TieredCache

        assert setting.url is not None
        try:
            remote = remote_cache_from_url(setting.url)
        except ValueError as e:
            raise SettingError(f"JAXAOT_CACHE: {e}") from None
        return _checked(TieredCache(_local_tier(), remote))
    if setting.kind == "off":
        return None
    if setting.kind == "memory":
        return MemoryCache()
    return _local_tier()


def _check_cache(cache: Any, what: str) -> None:
    if cache is not None and not isinstance(cache, Cache):
        raise TypeError(
            f"{what}: expected a jaxaot cache (get/put/delete/keys/clear/stats) or None, "
            f"got {type(cache).__name__}"
        )
    _checked(cache)


def _checked(cache: Any) -> Any:
    """``cache``, a tiered cache given the entry format's verification if it has no
    check of its own: it verifies each hit before copying it into a faster tier."""
    from .._caches._tiered import TieredCache

    if isinstance(cache, TieredCache) and cache.check is None:
        from ._entry import check_stored

        cache.check = check_stored
    return cache


def set_cache(cache: Cache | None) -> None:
    """Sets the process-wide default cache; ``None`` disables caching."""
    global _default
    _check_cache(cache, "jaxaot.set_cache")
    with _default_lock:
        _default = cache


@contextlib.contextmanager
def using_cache(cache: Cache | None) -> Iterator[Cache | None]:
    """Uses ``cache`` (or no cache, for ``None``) in this thread/context only."""
    _check_cache(cache, "jaxaot.using_cache")
    with set_during(_override, cache):
        yield cache


def get_cache() -> Cache | None:
    """The cache in effect here: a ``using_cache`` override, else the process default."""
    global _default
    override = _override.get()
    if override is not _UNSET:
        return override  # type: ignore[no-any-return]
    if _default is _UNSET:
        with _default_lock:
            if _default is _UNSET:
                _default = _default_from_env()
    return _default  # type: ignore[no-any-return]
