"""The read model of a cache for the ``jaxaot cache`` commands: which cache a
command works on (``--dir``, ``--url`` or the default directory), a
:class:`CacheView` of it, and a :class:`Record` per entry.

Caches are read through the byte-level protocol (``keys``, ``get``, ``delete``,
``clear``, ``stats``) plus the optional features a backend declares by
implementing the protocols of :mod:`jaxaot._caches` (:class:`LocalFiles`:
``path_for``, ``peek``, ``access_time``; :class:`HitCounting`;
:class:`Quarantining`; :class:`Pingable`), so any backend that implements the
protocol can be inspected.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._output import CLIError

if TYPE_CHECKING:
    from ..._caches import Cache, HitCounting, LocalFiles, Quarantining

__all__ = [
    "CacheView",
    "Record",
    "add_location_arguments",
    "load_record",
    "load_records",
    "open_cache",
    "open_url",
    "resolve_key",
    "short_transform",
]


class CacheView:
    """A cache for inspection: protocol methods plus the optional features the
    backend declares (:mod:`jaxaot._caches` protocols).

    ``read`` does not count as a use: a backend whose entries are local files
    (:class:`~jaxaot._caches.LocalFiles`) is read with ``peek``, so listing a
    cache neither bumps hit counts nor refreshes access times. Other backends
    are read with ``get``.
    """

    def __init__(self, cache: Cache, location: str) -> None:
        from ..._caches import HitCounting, LocalFiles, Quarantining

        self.cache = cache
        self.location = location
        self._files: LocalFiles | None = cache if isinstance(cache, LocalFiles) else None
        self._hits: HitCounting | None = cache if isinstance(cache, HitCounting) else None
        self._quarantine: Quarantining | None = cache if isinstance(cache, Quarantining) else None

    @property
    def has_access_times(self) -> bool:
        return self._files is not None

    @property
    def has_hit_counts(self) -> bool:
        return self._hits is not None

    def keys(self) -> list[str]:
        return sorted(self.cache.keys())

    def path(self, key: str) -> str | None:
        return os.fspath(self._files.path_for(key)) if self._files is not None else None

    def read(self, key: str) -> bytes | None:
        """The stored bytes, or ``None`` if the entry is gone. Raises ``OSError``
        (also for an entry the backend's trust policy refuses to read)."""
        if self._files is not None:  # no hit counted, nothing followed or blocked on
            return self._files.peek(key)
        value = self.cache.get(key)
        return bytes(value) if value is not None else None

    def size(self, key: str) -> int | None:
        path = self.path(key)
        if path is not None:
            try:
                return os.stat(path, follow_symlinks=False).st_size
            except FileNotFoundError:
                return None
        blob = self.read(key)
        return None if blob is None else len(blob)

    def hits(self, key: str) -> int | None:
        return self._hits.hit_count(key) if self._hits is not None else None

    def last_used(self, key: str) -> float | None:
        return self._files.access_time(key) if self._files is not None else None

    def exists(self, key: str) -> bool:
        path = self.path(key)
        if path is not None:
            return os.path.lexists(path)
        return key in self.cache.keys()

    def remove_bad(self, key: str, *, force: bool = False) -> str:
        """Quarantines (else deletes) a bad entry; returns what was done. Without
        ``force`` the backend leaves entries it cannot check with this process's
        key alone."""
        if self._quarantine is not None:
            from ..._store import _entry

            self._quarantine.quarantine(key, force=force, check=_entry.check_stored)
            return "quarantined"
        self.cache.delete(key)
        return "deleted"


@dataclass
class Record:
    """One entry as listed: its header if it verified, else the reason it did not."""

    key: str
    size: int
    header: dict[str, Any] | None = None
    sections: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    hits: int | None = None
    last_used: float | None = None
    #: The entry is another entry format version's (a newer or older jaxaot's):
    #: unreadable here, but not damaged, so ``verify`` neither counts nor removes it.
    other_format: int | None = None
    #: Whether the problem makes the entry bad for every process (damage, a
    #: hostile header), so ``verify --fix`` may remove it; False for entries this
    #: process cannot check (signed with another key, or unsigned while it has one).
    removable: bool = True

    @property
    def name(self) -> str:
        return str(self.header.get("name", "?")) if self.header is not None else "<bad entry>"

    @property
    def parts(self) -> dict[str, Any]:
        if self.header is None:
            return {}
        try:
            return {str(k): v for k, v in self.header.get("key", [])}
        except (TypeError, ValueError):
            return {}

    @property
    def created(self) -> float | None:
        value = self.header.get("created") if self.header is not None else None
        return float(value) if isinstance(value, int | float) else None

    @property
    def when(self) -> float | None:
        """Last use, else creation time: the recency used for sorting and pruning."""
        return self.last_used if self.last_used is not None else self.created

    @property
    def transform(self) -> str:
        return short_transform(self.parts.get("transform"))

    @property
    def flops(self) -> float | None:
        extra = self.header.get("extra") if self.header is not None else None
        cost = extra.get("cost_analysis") if isinstance(extra, dict) else None
        if isinstance(cost, list) and cost and isinstance(cost[0], dict):
            cost = cost[0]
        value = cost.get("flops") if isinstance(cost, dict) else None
        return float(value) if isinstance(value, int | float) else None

    @property
    def executable(self) -> bool:
        return "executable" in self.sections


def short_transform(transform: Any) -> str:
    """The transformations in application order, e.g. ``vmap(0,-)``,
    ``linearize:forward``, ``linearize:linear+transpose``; ``-`` when untransformed.

    Each step names what tells its entries apart: a vmap's input axes (``-`` for
    an unbatched input), and which half of a linearization an entry is.
    """
    if not transform:
        return "-"
    names = []
    for t in transform if isinstance(transform, list | tuple) else [transform]:
        if not (isinstance(t, list | tuple) and t):
            names.append(str(t))
            continue
        name, params = str(t[0]), list(t[1:])
        if name == "vmap" and params and isinstance(params[0], list | tuple):
            axes = ",".join("-" if a is None else str(a) for a in params[0])
            name = f"vmap({axes})"
        elif name == "linearize" and len(params) >= 2 and isinstance(params[1], str):
            name = f"linearize:{params[1]}"
        names.append(name)
    return "+".join(names)


def load_record(view: CacheView, key: str, *, with_header: bool = True) -> Record | None:
    """The record for ``key``, or ``None`` if the entry vanished meanwhile."""
    from ..._store import _entry

    try:
        blob = view.read(key) if with_header else None
        size = len(blob) if blob is not None else view.size(key)
    except OSError as e:
        return Record(key, 0, error=f"cannot read: {e.strerror or e}")
    if size is None:
        return None
    record = Record(key, size, hits=view.hits(key), last_used=view.last_used(key))
    if blob is not None:
        try:
            header, sections = _entry.check_stored(key, blob)
        except _entry.EntryError as e:
            record.error = str(e)
            record.removable = e.removable
            if isinstance(e, _entry.FormatVersionError):
                record.other_format = e.version
        else:
            record.header = header
            record.sections = {name: len(data) for name, data in sections.items()}
    return record


def load_records(view: CacheView) -> list[Record]:
    return [r for r in (load_record(view, k) for k in view.keys()) if r is not None]


def open_url(url: str, *, create: bool = False) -> CacheView:
    """The shared store at ``url`` (Redis or any fsspec URL); a Redis server must answer,
    and a ``file://`` directory must exist (as for ``--dir``) unless ``create``."""
    from ..._caches import Pingable
    from ..._caches._redis import redact_url
    from ..._store._active import remote_cache_from_url, url_scheme

    shown = redact_url(url)
    if url_scheme(url) == "file":
        path = url[len("file://") :] or "/"
        if not os.path.lexists(path) and not create:
            raise CLIError(f"no such directory: {path} (from {shown})")
        if os.path.lexists(path) and not os.path.isdir(path):
            raise CLIError(f"not a directory: {path} (from {shown})")
    try:
        cache = remote_cache_from_url(url)
    except (ImportError, ValueError) as e:
        raise CLIError(f"cannot open {shown}: {str(e).replace(url, shown)}") from None
    except Exception as e:  # the backend's own (a host name that does not resolve)
        why = f"{type(e).__name__}: {e}".replace(url, shown)
        raise CLIError(f"cannot open {shown}: {why}") from None
    # The backend's own (redacted) spelling of its URL, where it keeps one: no
    # protocol declares it, and the URL given is as good a name.
    location = redact_url(str(getattr(cache, "url", url)))
    if isinstance(cache, Pingable):
        try:
            cache.ping()
        except Exception as e:  # the client's connection, timeout or auth errors
            # A Pingable's ConnectionError names its cause; other errors, by their type.
            why = (
                str(e) if isinstance(e, ConnectionError) and str(e) else f"{type(e).__name__}: {e}"
            )
            raise CLIError(f"cannot reach {location}: {why}") from None
    return CacheView(cache, location)


def open_cache(args: argparse.Namespace, *, create: bool = False) -> CacheView:
    """The cache a command works on: ``--url URL``, ``--dir PATH``, else the default
    cache directory. With ``create``, a missing directory is created (``import``)."""
    from ..._caches import DirectoryCache, UnsafeCacheDirError
    from ..._store._active import cache_setting, default_cache_dir, default_max_bytes

    spec = getattr(args, "cache", None)
    if spec is not None:
        if "://" in spec:
            args.url = spec
        else:
            args.dir = spec
    if getattr(args, "url", None) is not None:
        return open_url(args.url, create=create)
    try:
        max_bytes = default_max_bytes()
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.dir is not None:
        path = os.path.abspath(os.path.expanduser(args.dir))
        if not os.path.lexists(path) and not create:
            raise CLIError(f"no such directory: {path}")
    else:
        raw = os.environ.get("JAXAOT_CACHE", "dir").strip()
        try:
            setting = cache_setting(raw)
        except ValueError as e:
            raise CLIError(str(e)) from None
        if setting.kind == "off":
            raise CLIError(
                f"JAXAOT_CACHE={raw.lower()}: caching is off, there is no persistent cache "
                "(use --dir PATH to inspect a cache directory)"
            )
        if setting.kind == "memory":
            raise CLIError(
                f"JAXAOT_CACHE={raw.lower()}: the cache lives in each process's memory, there is "
                "no persistent cache (use --dir PATH to inspect a cache directory)"
            )
        path = default_cache_dir()
        if not os.path.lexists(path) and not create:
            raise CLIError(f"no such directory: {path} (the default cache; nothing cached yet)")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CLIError(f"not a directory: {path}")
    try:
        cache = DirectoryCache(path, max_bytes=max_bytes)
    except UnsafeCacheDirError as e:
        raise CLIError(str(e)) from None
    except OSError as e:
        raise CLIError(f"cannot open the cache directory {path}: {e.strerror or e}") from None
    unlisted = cache.unlisted()
    if unlisted:  # a listing, check or removal would pass over its entries, and say it did
        import errno

        from ..._caches._faults import owner_text

        denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        more = f" (and {len(unlisted) - 1} more directories)" if len(unlisted) > 1 else ""
        raise CLIError(
            f"cannot list {unlisted[0]}{more}: it {owner_text(unlisted[0], denied)}; its "
            "entries cannot be read, checked or removed from here: run as the cache's owner, "
            "or make it this user's (chown -R)"
        )
    return CacheView(cache, path)


def resolve_key(view: CacheView, prefix: str) -> str:
    """The one key that is ``prefix`` or starts with it: exit status 2 for a prefix
    that is no key's (a usage error), 1 where no entry or several match."""
    text = prefix.strip().lower()
    if len(text) < 4 or not re.fullmatch(r"[0-9a-f]+", text):
        raise CLIError(
            f"invalid key {prefix!r}: give a digest or a prefix of 4+ hex digits "
            "(see 'jaxaot cache info --help')",
            2,
        )
    keys = view.keys()
    if text in keys:
        return text
    matches = [k for k in keys if k.startswith(text)]
    if not matches:
        raise CLIError(f"no entry matches {text!r} in {view.location}")
    if len(matches) > 1:
        shown = ", ".join(k[:16] for k in matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise CLIError(
            f"ambiguous key prefix {text!r}: {len(matches)} entries match ({shown}); "
            "give more digits"
        )
    return matches[0]


_DIR_HELP = (
    "the cache directory (default: $JAXAOT_CACHE_DIR, $XDG_CACHE_HOME/jaxaot or ~/.cache/jaxaot)"
)
_URL_HELP = (
    "a shared store instead of a directory: redis://[:password@]host[:port][/db], rediss://..., "
    "gs://bucket/path, s3://bucket/path, file:///path or another fsspec URL "
    "(needs jaxaot[redis] or jaxaot[fsspec]); not with --dir"
)


def add_location_arguments(p: argparse.ArgumentParser) -> None:
    """``--dir PATH``, ``--url URL`` or ``--cache SPEC`` (either), one of them: every
    ``cache`` command takes them."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--dir", metavar="PATH", default=None, help=_DIR_HELP)
    where.add_argument("--url", metavar="URL", default=None, help=_URL_HELP)
    # What ``jaxaot precompile --cache`` took: the next command a user types after it.
    where.add_argument(
        "--cache",
        metavar="SPEC",
        default=None,
        help="a cache directory or a URL, as `jaxaot precompile --cache` takes them",
    )
