"""``jaxaot cache``: inspect and maintain a cache directory or shared store.

Commands::

  jaxaot cache ls      [--dir PATH] [--sort {name,size,hits,last-used}] [--wide] [--json]
  jaxaot cache info    KEY [--dir PATH] [--json]
  jaxaot cache stats   [--dir PATH] [--json]
  jaxaot cache verify  [--dir PATH] [--fix] [--json]
  jaxaot cache prune   [--dir PATH] (--max-bytes N | --older-than DURATION) [--dry-run] [-v]
  jaxaot cache clear   [--dir PATH] [--yes]
  jaxaot cache export  BUNDLE [--component NAME ...] [--dir PATH] [--json]
  jaxaot cache import  BUNDLE [--dir PATH] [--json]

Every ``cache`` command takes ``--dir PATH`` (a cache directory) or ``--url URL``
(a shared store: ``redis://``, ``rediss://``, ``gs://``, ``s3://``, ``file://``,
any fsspec URL), not both. Without either, the commands work on the default
cache directory (``$JAXAOT_CACHE_DIR``, ``$XDG_CACHE_HOME/jaxaot`` or
``~/.cache/jaxaot``), also when ``$JAXAOT_CACHE`` names a remote store: a shared
store is only touched when named with ``--url``.

Caches are read through the byte-level protocol (``keys``, ``get``, ``delete``,
``clear``, ``stats``) plus optional extras looked up with ``getattr``
(``path_for``, ``access_time``, ``hit_count``, ``quarantine``), so any backend
that implements the protocol can be inspected.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._output import (
    CLIError,
    Command,
    Group,
    Output,
    clip,
    entries_text,
    human_bytes,
    human_count,
    human_time,
    is_terminal,
    iso_time,
    parse_duration,
    parse_size,
    terminal_width,
)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

# ----------------------------------------------------------------------------
# Cache access through the protocol, with optional backend extras.


class CacheView:
    """A cache for inspection: protocol methods plus the extras the backend has.

    ``read`` does not count as a use: when the backend names a file for a key
    (``path_for``) the file is read directly, so listing a cache neither bumps
    hit counts nor refreshes access times. Other backends are read with ``get``.
    """

    def __init__(self, cache: Any, location: str) -> None:
        self.cache = cache
        self.location = location
        self._path_for: Callable[[str], Any] | None = getattr(cache, "path_for", None)
        self._access_time: Callable[[str], float | None] | None = getattr(
            cache, "access_time", None
        )
        self._hit_count: Callable[[str], int] | None = getattr(cache, "hit_count", None)
        self._quarantine: Callable[..., None] | None = getattr(cache, "quarantine", None)
        self._peek: Callable[[str], bytes | None] | None = getattr(cache, "peek", None)

    @property
    def has_access_times(self) -> bool:
        return self._access_time is not None

    def keys(self) -> list[str]:
        return sorted(self.cache.keys())

    def path(self, key: str) -> str | None:
        return os.fspath(self._path_for(key)) if self._path_for is not None else None

    def read(self, key: str) -> bytes | None:
        """The stored bytes, or ``None`` if the entry is gone. Raises ``OSError``
        (also for an entry the backend's trust policy refuses to read)."""
        if self._peek is not None:  # no hit counted, nothing followed or blocked on
            return self._peek(key)
        path = self.path(key)
        if path is None:
            value = self.cache.get(key)
            return bytes(value) if value is not None else None
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

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
        return self._hit_count(key) if self._hit_count is not None else None

    def last_used(self, key: str) -> float | None:
        return self._access_time(key) if self._access_time is not None else None

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
            self._quarantine(key, force=force)
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


#: Configuration options ``cache info`` shows by name; the others are counted.
_CONFIG_SHOWN = frozenset(
    [
        "config.jax_enable_x64",
        "config.jax_default_matmul_precision",
        "config.jax_numpy_rank_promotion",
        "config.jax_numpy_dtype_promotion",
        "config.jax_default_prng_impl",
    ]
)


def load_record(view: CacheView, key: str, *, with_header: bool = True) -> Record | None:
    """The record for ``key``, or ``None`` if the entry vanished meanwhile."""
    from .._store import _entry

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
    from .._caches._redis import redact_url
    from .._store._active import remote_cache_from_url, url_scheme

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
    location = redact_url(str(getattr(cache, "url", url)))
    ping = getattr(cache, "ping", None)
    if ping is not None:
        try:
            ping()
        except Exception as e:  # the client's connection, timeout or auth errors
            raise CLIError(f"cannot reach {location}: {type(e).__name__}: {e}") from None
    return CacheView(cache, location)


def open_cache(args: argparse.Namespace, *, create: bool = False) -> CacheView:
    """The cache a command works on: ``--url URL``, ``--dir PATH``, else the default
    cache directory. With ``create``, a missing directory is created (``import``)."""
    from .._caches import DirectoryCache, UnsafeCacheDirError
    from .._store._active import cache_setting, default_cache_dir, default_max_bytes

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
    return CacheView(cache, path)


def resolve_key(view: CacheView, prefix: str) -> str:
    """The one key that is ``prefix`` or starts with it (exit status 2 otherwise)."""
    text = prefix.strip().lower()
    if len(text) < 4 or not re.fullmatch(r"[0-9a-f]+", text):
        raise CLIError(f"invalid key {prefix!r}: give a digest or a prefix of 4+ hex digits", 2)
    keys = view.keys()
    if text in keys:
        return text
    matches = [k for k in keys if k.startswith(text)]
    if not matches:
        raise CLIError(f"no entry matches {text!r} in {view.location}", 2)
    if len(matches) > 1:
        shown = ", ".join(k[:16] for k in matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise CLIError(f"ambiguous key prefix {text!r}: {len(matches)} entries match ({shown})", 2)
    return matches[0]


# ----------------------------------------------------------------------------
# Commands.


# -- ls ------------------------------------------------------------------------

_SORTS: dict[str, Callable[[Record], Any]] = {
    "name": lambda r: (r.name.lower(), r.key),
    "size": lambda r: (-r.size, r.key),
    "hits": lambda r: (-(r.hits if r.hits is not None else -1), r.key),
    "last-used": lambda r: (-(r.when if r.when is not None else -math.inf), r.key),
}


def _ls_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sort",
        choices=list(_SORTS),
        default="last-used",
        help="order: name (A-Z), size, hits (largest first) or last-used (newest first; default)",
    )
    p.add_argument(
        "--wide",
        action="store_true",
        help="full signatures and names (otherwise cut to fit the terminal, or to "
        f"{_LS_LIMITS[3]} characters when piped)",
    )
    p.add_argument("--json", action="store_true", help="a JSON list of entries, for scripts")


def _kind(r: Record) -> str:
    """What an entry holds: a compiled ``executable`` or lowered ``stablehlo``."""
    if r.executable:
        return "executable"
    return "stablehlo" if "stablehlo" in r.sections else "-"


def _record_json(r: Record) -> dict[str, Any]:
    h = r.header or {}
    return {
        "digest": r.key,
        "name": r.name,
        "ok": r.error is None,
        "error": r.error,
        "transform": r.transform if r.header is not None else None,
        "kind": _kind(r) if r.header is not None else None,
        "signature": h.get("signature"),
        "platforms": h.get("platforms"),
        "size": r.size,
        "hits": r.hits,
        "last_used": r.last_used,
        "last_used_iso": iso_time(r.last_used),
        "created": r.created,
        "executable": r.executable,
        "flops": r.flops,
        "sections": r.sections,
    }


_LS_COLUMNS = [
    ("NAME", "left"),
    ("TRANSFORM", "left"),
    ("KIND", "left"),
    ("SIGNATURE", "left"),
    ("PLATFORMS", "left"),
    ("SIZE", "right"),
    ("HITS", "right"),
    ("LAST USED", "left"),
    ("FLOPS", "right"),
    ("DIGEST", "left"),
]
#: Widest NAME, TRANSFORM and SIGNATURE cells without --wide (a piped line stays
#: under about 170 characters; a terminal cuts the signature further to fit).
_LS_LIMITS = {0: 24, 1: 32, 3: 48}


def _cmd_ls(args: argparse.Namespace, out: Output) -> int:
    view = open_cache(args)
    records = sorted(load_records(view), key=_SORTS[args.sort])
    if args.json:
        out.json([_record_json(r) for r in records])
        return 0
    if not records:
        out.line(f"no entries in {view.location}")
        return 0
    now = time.time()
    rows = []
    for r in records:
        if r.header is None:
            rows.append(
                [r.name, "-", "-", r.error or "", "-", human_bytes(r.size), _opt(r.hits)]
                + [human_time(r.last_used, now), "-", r.key[:12]]
            )
            continue
        flops = r.flops
        rows.append(
            [
                r.name,
                r.transform,
                _kind(r),
                str(r.header.get("signature", "?")),
                ",".join(str(p) for p in r.header.get("platforms") or []) or "-",
                human_bytes(r.size),
                _opt(r.hits),
                human_time(r.when, now),
                human_count(flops) if flops is not None else "-",
                r.key[:12],
            ]
        )
    limits: dict[int, int] | None = None
    if args.wide:  # every cell in full, longer than the terminal if need be
        out = Output(out.stream, plain=True)
    else:
        limits = dict(_LS_LIMITS)
        if out.rich:  # the signature takes what the other columns leave of the terminal
            others = sum(
                max(len(h), *(len(clip(row[i], limits.get(i))) for row in rows))
                for i, (h, _) in enumerate(_LS_COLUMNS)
                if i != 3
            )
            limits[3] = max(12, terminal_width() - others - 3 * len(_LS_COLUMNS) - 1)
    total = sum(r.size for r in records)
    out.table(
        _LS_COLUMNS,
        rows,
        title=f"jaxaot cache {view.location}",
        caption=f"{entries_text(len(records))}, {human_bytes(total)}",
        limits=limits,
        middle=(3,),  # signatures differ at either end: keep both
    )
    return 0


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


# -- info ----------------------------------------------------------------------


def _info_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", metavar="KEY", help="a full digest or a unique prefix (4+ hex digits)")
    p.add_argument("--json", action="store_true", help="print the entry's details as JSON")


def _value_text(value: Any) -> str:
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value, separators=(", ", ": "))


def _is_pairs(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in value)
    )


def _flatten(name: str, value: Any) -> list[tuple[str, str]]:
    """``name  value`` rows; name/value-pair lists and flat dicts become dotted rows."""
    if _is_pairs(value):
        return [(f"{name}.{k}", _value_text(v)) for k, v in value]
    if isinstance(value, dict) and value:
        return [(f"{name}.{k}", _value_text(v)) for k, v in value.items()]
    return [(name, _value_text(value))]


def _labelled(names: Sequence[Any], avals: Sequence[Any], default: str) -> list[tuple[str, str]]:
    rows = []
    for i in range(max(len(names), len(avals))):
        name = str(names[i]) if i < len(names) and names[i] else f"{default} {i}"
        rows.append((name, str(avals[i]) if i < len(avals) else "?"))
    return rows


def _cmd_info(args: argparse.Namespace, out: Output) -> int:
    view = open_cache(args)
    key = resolve_key(view, args.key)
    record = load_record(view, key)
    if record is None:
        raise CLIError(f"entry {key[:16]} vanished while it was read", 2)
    path = view.path(key)
    if args.json:
        data = _record_json(record)
        data["path"] = path
        if record.header is not None:
            h = record.header
            data.update(
                {
                    "key_parts": record.parts,
                    "versions": {"jax": h.get("jax"), "jaxlib": h.get("jaxlib")},
                    "format": h.get("format"),
                    "created_iso": iso_time(record.created),
                    "host_callbacks": h.get("host_callbacks"),
                    "arg_names": h.get("arg_names"),
                    "result_paths": h.get("result_paths"),
                    "in_avals": h.get("in_avals"),
                    "out_avals": h.get("out_avals"),
                    "out_tree": h.get("out_tree"),
                    "deps": h.get("deps"),
                    "extra": h.get("extra"),
                }
            )
        out.json(data)
        return 0 if record.error is None else 1
    overview = [
        ("digest", key),
        ("name", record.name),
        ("size", f"{human_bytes(record.size)} ({record.size} bytes)"),
    ]
    if path is not None:
        overview.append(("file", path))
    overview += [
        ("hits", _opt(record.hits)),
        ("last used", _when_text(record.last_used)),
    ]
    if record.header is None:
        overview.append(("error", record.error or "?"))
        out.fields(overview, title="entry")
        return 1
    h = record.header
    overview += [
        ("created", _when_text(record.created)),
        ("transform", record.transform),
        ("kind", _kind(record)),
        ("signature", clip(str(h.get("signature", "?")), _INFO_WIDTH)),
        ("platforms", ", ".join(str(p) for p in h.get("platforms") or []) or "-"),
        ("host callbacks", "yes" if h.get("host_callbacks") else "no"),
    ]
    out.fields(overview, title="entry")
    out.fields(
        [
            ("format", _value_text(h.get("format"))),
            ("jax", _value_text(h.get("jax"))),
            ("jaxlib", _value_text(h.get("jaxlib"))),
        ],
        title="versions",
    )
    parts: list[tuple[str, str]] = []
    config: list[tuple[str, str]] = []
    for name, value in record.parts.items():
        for n, v in _flatten(name, value):
            (config if n.startswith("config.") else parts).append((n, v))
    # The tracing context is dozens of options (more in newer JAX): the ones
    # people change, then a count of the rest.
    shown = [(n, v) for n, v in config if n in _CONFIG_SHOWN]
    if config:
        rest = len(config) - len(shown)
        at = next((i for i, (n, _) in enumerate(parts) if n == "platforms"), len(parts))
        summary = [*shown, ("config.…", f"{rest} more options (--json lists them all)")]
        parts[at:at] = summary if rest else shown
    out.fields([(n, clip(v, _INFO_WIDTH)) for n, v in parts], title="key parts")
    out.fields(
        [(n, f"{human_bytes(s)} ({s} bytes)") for n, s in record.sections.items()]
        or [("(none)", "")],
        title="sections",
    )
    for title, names, avals, default in (
        ("arguments", h.get("arg_names") or [], h.get("in_avals") or [], "input"),
        ("results", h.get("result_paths") or [], h.get("out_avals") or [], "output"),
    ):
        rows = _labelled(names, avals, default)
        if len(rows) > _INFO_ROWS:
            more = len(rows) - _INFO_ROWS + 1
            rows = [*rows[: _INFO_ROWS - 1], (f"… {more} more", "(--json lists them all)")]
        out.fields(rows or [("(none)", "")], title=f"{title} ({len(names) or len(avals)})")
    extra = dict(h.get("extra") or {})
    cost = extra.pop("cost_analysis", None)
    extra.pop("executable_in_tree", None)  # the executable's calling convention: --json
    if isinstance(cost, list) and cost and isinstance(cost[0], dict):
        cost = cost[0]
    if isinstance(cost, dict) and cost:
        out.fields(_cost_rows(cost), title="cost analysis (XLA's estimate)")
    extra_rows: list[tuple[str, str]] = []
    for name, value in extra.items():
        extra_rows += [(n, clip(v, _INFO_WIDTH)) for n, v in _flatten(str(name), value)]
    if extra_rows:
        out.fields(extra_rows, title="extra")
    return 0


#: Widest value ``cache info`` prints (``--json`` has them whole), and the most
#: argument or result rows.
_INFO_WIDTH = 100
_INFO_ROWS = 12

#: The cost-analysis figures people read, in this order, and how to show them.
_COSTS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("flops", "flops", human_count),
    ("transcendentals", "transcendentals", human_count),
    ("bytes accessed", "bytes accessed", lambda v: human_bytes(int(v))),
    ("optimal_seconds", "optimal seconds", lambda v: f"{v:.3g} s"),
)


def _cost_rows(cost: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, label, fmt in _COSTS:
        value = cost.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            rows.append((label, fmt(float(value))))
    others = len([k for k in cost if k not in {c[0] for c in _COSTS}])
    if others:
        rows.append(("…", f"{others} more figures (per operand and output): --json"))
    return rows


def _when_text(ts: float | None) -> str:
    if ts is None:
        return "-"
    return f"{iso_time(ts)} ({human_time(ts)})"


# -- stats ---------------------------------------------------------------------


def _stats_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")


#: A backend instance's counters of its own calls: always 0 in a fresh CLI
#: process, so ``stats`` leaves them out (``recorded hits`` is the persistent count).
_PROCESS_COUNTERS = frozenset(
    {
        "hits",
        "misses",
        "puts",
        "evictions",
        "errors",
        "skipped_offline",
        "promotions",
        "refused",
        "tier_errors",
        "tier_hits",
        "writes",
        "write_errors",
        "corrupt",
    }
)


def _is_process_counter(name: str) -> bool:
    return name in _PROCESS_COUNTERS or name.endswith(
        ("_errors", "_timeouts", "_hits", "_misses", "_puts", "_failures")
    )


def _cmd_stats(args: argparse.Namespace, out: Output) -> int:
    view = open_cache(args)
    stats = {k: v for k, v in view.cache.stats().items() if not _is_process_counter(k)}
    stats.setdefault("path", view.location)
    recorded = None
    if getattr(view.cache, "hit_count", None) is not None:
        recorded = sum(view.hits(k) or 0 for k in view.keys())
    stats["recorded_hits"] = recorded
    if args.json:
        out.json(stats)
        return 0
    entries, total, cap = stats.get("entries"), stats.get("bytes"), stats.get("max_bytes")
    rows = [
        ("path", str(stats["path"])),
        ("backend", str(stats.get("backend", type(view.cache).__name__))),
        ("entries", _opt(entries)),
        ("total", f"{human_bytes(total)} ({total} bytes)" if total is not None else "-"),
    ]
    if cap is not None:
        used = f", {100.0 * total / cap:.1f}% used" if total is not None and cap else ""
        rows.append(("cap", f"{human_bytes(cap)} ({cap} bytes{used})"))
    rows.append(("recorded hits", _opt(recorded)))
    shown = {"path", "backend", "entries", "bytes", "max_bytes", "recorded_hits"}
    # Whatever else the backend reports about the store itself (temp files, TTL, ...).
    rows += [(n.replace("_", " "), _value_text(v)) for n, v in stats.items() if n not in shown]
    out.fields(rows)
    return 0


# -- verify --------------------------------------------------------------------


def _verify_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fix",
        action="store_true",
        help="remove bad entries (moved to the cache's quarantine when it has one, else "
        "deleted); entries this process cannot check with its key are left alone",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --fix: also remove entries this process cannot check (signed with "
        "another key, or unsigned while $JAXAOT_CACHE_HMAC_KEY is set)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _cmd_verify(args: argparse.Namespace, out: Output) -> int:
    from .._caches._trust import HMAC_ENV, signing

    if args.force and not args.fix:
        raise CLIError("--force only goes with --fix")
    view = open_cache(args)
    records = load_records(view)
    others = [r for r in records if r.other_format is not None]
    records = [r for r in records if r.other_format is None]
    bad = [r for r in records if r.error is not None]
    removed: dict[str, str] = {}
    if args.fix:
        for r in bad:
            if not r.removable and not args.force:
                continue  # sound for the processes that hold the key: left alone
            try:
                how = view.remove_bad(r.key, force=args.force)
            except OSError:
                continue
            if not view.exists(r.key):
                removed[r.key] = how
    signed = signing()
    status = 0 if not bad or (args.fix and len(removed) == len(bad)) else 1
    if args.json:
        out.json(
            {
                "path": view.location,
                "checked": len(records),
                "ok": len(records) - len(bad),
                "signatures": signed,
                "other_format": [{"digest": r.key, "format": r.other_format} for r in others],
                "bad": [
                    {
                        "digest": r.key,
                        "error": r.error,
                        "removable": r.removable,
                        "removed": removed.get(r.key),
                    }
                    for r in bad
                ],
            }
        )
        return status
    check = f"signatures (${HMAC_ENV})" if signed else "checksums"
    out.line(f"checked {entries_text(len(records))} in {view.location} ({check})")
    if bad:
        rows = []
        for r in bad:
            row = [r.key[:12], human_bytes(r.size), r.error or "?"]
            if args.fix:
                kept = "NOT REMOVED" if r.removable or args.force else "left alone (--force)"
                row.append(removed.get(r.key, kept))
            rows.append(row)
        columns = [("DIGEST", "left"), ("SIZE", "right"), ("PROBLEM", "left")]
        if args.fix:
            columns.append(("ACTION", "left"))
        out.table(columns, rows)
    summary = f"{len(records) - len(bad)} ok, {len(bad)} bad"
    if others:
        versions = ", ".join(sorted({str(r.other_format) for r in others}))
        summary += f", {len(others)} of another entry format ({versions}; skipped)"
    if args.fix and bad:
        summary += f", {len(removed)} removed"
        if len(removed) < len(bad):
            summary += f", {len(bad) - len(removed)} could not be removed"
    out.line(summary)
    return status


# -- prune ---------------------------------------------------------------------


def _prune_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        metavar="N",
        help="remove least recently used entries until the entries total at most N bytes "
        "(suffixes K, M, G, T are powers of 1024: 500M, 2G)",
    )
    p.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="DURATION",
        help="remove entries not used for longer than DURATION (30s, 15m, 12h, 7d, 2w)",
    )
    p.add_argument("--dry-run", action="store_true", help="show what would be removed")
    p.add_argument("-v", "--verbose", action="store_true", help="list each removed entry")


def _cmd_prune(args: argparse.Namespace, out: Output) -> int:
    if args.max_bytes is None and args.older_than is None:
        raise CLIError(
            "prune needs --max-bytes N or --older-than DURATION (see 'jaxaot cache prune --help')",
            2,
        )
    view = open_cache(args)
    records = [
        r
        for r in (load_record(view, k, with_header=view.has_access_times) for k in view.keys())
        if r is not None
    ]
    if not view.has_access_times:
        # No access times from the backend: fall back to creation times in the headers.
        records = [r for r in (load_record(view, r.key) for r in records) if r is not None]
    # Least recently used first; entries with no time at all go first.
    records.sort(key=lambda r: (r.when if r.when is not None else -math.inf, r.key))
    victims: list[Record] = []
    keep = list(records)
    if args.older_than is not None:
        cutoff = time.time() - args.older_than
        victims = [r for r in keep if r.when is None or r.when < cutoff]
        keep = [r for r in keep if not (r.when is None or r.when < cutoff)]
    if args.max_bytes is not None:
        total = sum(r.size for r in keep)
        while keep and total > args.max_bytes:
            r = keep.pop(0)
            victims.append(r)
            total -= r.size
    removed: list[Record] = []
    for r in victims:
        if args.dry_run or view.cache.delete(r.key):
            removed.append(r)
    verb = "would remove" if args.dry_run else "removed"
    if args.verbose:
        for r in removed:
            out.line(f"{verb} {r.key[:12]}  {human_bytes(r.size)}  {r.name}")
    gone = {r.key for r in removed}
    left = [r for r in records if r.key not in gone]
    out.line(
        f"{verb} {entries_text(len(removed))} ({human_bytes(sum(r.size for r in removed))}) "
        f"from {view.location}; {entries_text(len(left))} "
        f"({human_bytes(sum(r.size for r in left))}) left"
    )
    return 0


# -- clear ---------------------------------------------------------------------


def _clear_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")


def _cmd_clear(args: argparse.Namespace, out: Output) -> int:
    view = open_cache(args)
    stats = view.cache.stats()
    n, size = int(stats.get("entries") or 0), int(stats.get("bytes") or 0)
    what = f"{entries_text(n)} ({human_bytes(size)})"
    if n == 0:
        out.line(f"no entries in {view.location}")
        return 0
    if not args.yes:
        if not is_terminal(sys.stdin):
            raise CLIError(
                f"not clearing {what} from {view.location}: stdin is not a terminal to "
                "confirm on; pass --yes"
            )
        try:
            answer = input(f"Remove {what} from {view.location}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            out.line("nothing removed")
            return 1
    view.cache.clear()
    out.line(f"removed {what} from {view.location}")
    return 0


# -- export / import -------------------------------------------------------------


def _export_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", metavar="BUNDLE", help="the bundle file to write")
    p.add_argument(
        "--component",
        action="append",
        metavar="NAME",
        default=None,
        help="only this component's entries (its function name, as 'cache ls' shows); "
        "repeat for several",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _cmd_export(args: argparse.Namespace, out: Output) -> int:
    from .._store._bundle import export_bundle

    view = open_cache(args)
    target = os.path.abspath(os.path.expanduser(args.bundle))
    # Written next to the target and moved into place only when every --component
    # matched: a failed export leaves no file (and never half a bundle).
    fd, tmp = tempfile.mkstemp(
        prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=os.path.dirname(target)
    )
    os.close(fd)
    try:
        report = export_bundle(tmp, cache=view.cache, components=args.component)
        if not report["unmatched"]:
            os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    report["path"] = target
    report["source"] = view.location
    if report["unmatched"]:
        report["written"] = False
        held = sorted({r.name for r in load_records(view) if r.header is not None})
        if args.json:
            out.json(report)
            return 1
        raise CLIError(
            "no entries for component(s): "
            + ", ".join(report["unmatched"])
            + f" (in {view.location}, whose components are "
            + (", ".join(held) or "none")
            + f"); nothing written to {target}"
        )
    report["written"] = True
    if args.json:
        out.json(report)
        return 0
    names = ", ".join(report["names"]) or "-"
    out.line(
        f"exported {entries_text(report['entries'])} ({human_bytes(report['bytes'])}) from "
        f"{view.location} to {report['path']} (components: {names})"
    )
    if report["bad"]:
        out.line(
            f"left out {entries_text(len(report['bad']))} that failed verification: "
            + ", ".join(k[:12] for k in report["bad"])
        )
    return 0


def _import_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", metavar="BUNDLE", help="the bundle file to read")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _cmd_import(args: argparse.Namespace, out: Output) -> int:
    from .._store._bundle import BundleError, import_bundle

    if not os.path.isfile(args.bundle):
        raise CLIError(f"no such bundle file: {args.bundle}")
    view = open_cache(args, create=True)
    try:
        report = import_bundle(args.bundle, cache=view.cache)
    except BundleError as e:
        raise CLIError(f"refused the bundle {args.bundle}: {e}; nothing imported") from None
    report["target"] = view.location
    not_stored = report.get("not_stored", [])
    status = 1 if report["refused"] or not report.get("complete", True) else 0
    if args.json:
        out.json(report)
        return status
    added, skipped, refused = report["added"], report["skipped"], report["refused"]
    out.line(
        f"imported {report['path']} into {view.location}: {len(added)} added, "
        f"{len(skipped)} skipped (already present), {len(refused)} refused"
    )
    if refused:
        out.table(
            [("DIGEST", "left"), ("PROBLEM", "left")],
            [[r["digest"][:12], r["error"]] for r in refused],
        )
    if not_stored:
        out.line(
            f"{len(not_stored)} of the added entries are not in {view.location} "
            "(a size cap smaller than the entries, or a failing store): "
            + ", ".join(str(d)[:12] for d in not_stored)
        )
    return status


# ----------------------------------------------------------------------------
# The group.

_DIR_HELP = (
    "the cache directory (default: $JAXAOT_CACHE_DIR, $XDG_CACHE_HOME/jaxaot or ~/.cache/jaxaot)"
)
_URL_HELP = (
    "a shared store instead of a directory: redis://[:password@]host[:port][/db], rediss://..., "
    "gs://bucket/path, s3://bucket/path, file:///path or another fsspec URL "
    "(needs jaxaot[redis] or jaxaot[fsspec]); not with --dir"
)


def add_location_arguments(p: argparse.ArgumentParser) -> None:
    """``--dir PATH`` or ``--url URL``, not both: every ``cache`` command takes them."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--dir", metavar="PATH", default=None, help=_DIR_HELP)
    where.add_argument("--url", metavar="URL", default=None, help=_URL_HELP)


CACHE = Group(
    "cache",
    help="inspect and maintain a jaxaot cache directory or shared store",
    description="Inspect and maintain a jaxaot cache: the default cache directory, "
    "the one given with --dir, or a shared store given with --url (redis://, gs://, s3://, "
    "file://...). Move entries between caches and machines with export/import.",
    commands=(
        Command("ls", "list the entries", _ls_configure, _cmd_ls),
        Command(
            "info",
            "show everything about one entry",
            _info_configure,
            _cmd_info,
            epilog="Exit status: 0 ok, 1 the entry is damaged, 2 unknown or ambiguous KEY.",
        ),
        Command("stats", "entries, size, cap and counters", _stats_configure, _cmd_stats),
        Command(
            "verify",
            "check every entry's checksum (signature when $JAXAOT_CACHE_HMAC_KEY is set)",
            _verify_configure,
            _cmd_verify,
            epilog="Exit status: 0 when every entry is good, or when --fix removed every bad "
            "one; 1 when bad entries remain. Entries of another entry format version (written "
            "by another jaxaot release) are reported and skipped, never removed.",
        ),
        Command(
            "prune",
            "remove least recently used or long unused entries",
            _prune_configure,
            _cmd_prune,
            epilog="Both options may be given: entries older than DURATION go first, then "
            "the least recently used until the rest fit in N bytes.",
        ),
        Command(
            "clear",
            "remove every entry (asks first unless --yes)",
            _clear_configure,
            _cmd_clear,
            epilog="Without --yes, clear asks on the terminal, and refuses (exit status 1) "
            "when stdin is not a terminal.",
        ),
        Command(
            "export",
            "write entries into one bundle file",
            _export_configure,
            _cmd_export,
            description="Write the cache's sound entries (all, or those of the named "
            "components) into one bundle file, to import on another machine.",
            epilog="Bad entries are left out and reported. Exit status: 0 ok; 1 when a "
            "--component NAME matched no entry (then no file is written), or the bundle "
            "cannot be written.",
        ),
        Command(
            "import",
            "add the entries of a bundle file",
            _import_configure,
            _cmd_import,
            description="Add the entries of a bundle file to the cache (a --dir that does not "
            "exist yet is created). The bundle's checksum is verified first; then each entry's "
            "checksum (signature when $JAXAOT_CACHE_HMAC_KEY is set) and key; bad entries are "
            "refused, entries already present are skipped.",
            epilog="Exit status: 0 when every entry was added or already present; 1 when "
            "any entry was refused, or the bundle is damaged (then nothing is added).",
        ),
    ),
)
