"""``jaxaot cache``: inspect and maintain a cache directory or shared store.

Commands::

  jaxaot cache ls      [--dir PATH] [--sort {name,size,hits,last-used}] [--wide] [--json]
  jaxaot cache info    KEY [--dir PATH] [--json]
  jaxaot cache stats   [--dir PATH] [--json]
  jaxaot cache verify  [--dir PATH] [--fix] [--json]
  jaxaot cache prune   [--dir PATH] (--max-bytes N | --older-than DURATION) [--dry-run] [--yes] [-v]
  jaxaot cache clear   [--dir PATH] [--yes]
  jaxaot cache export  BUNDLE [--component NAME ...] [--dir PATH] [--json]
  jaxaot cache import  BUNDLE [--dir PATH] [--json]

Every ``cache`` command takes ``--dir PATH`` (a cache directory) or ``--url URL``
(a shared store: ``redis://``, ``rediss://``, ``gs://``, ``s3://``, ``file://``,
any fsspec URL), not both. Without either, the commands work on the default
cache directory (``$JAXAOT_CACHE_DIR``, ``$XDG_CACHE_HOME/jaxaot`` or
``~/.cache/jaxaot``), also when ``$JAXAOT_CACHE`` names a remote store: a shared
store is only touched when named with ``--url``.

Layout: :mod:`._view` is the read model (which cache, a :class:`CacheView` of it
through the declared backend protocols, a :class:`Record` per entry);
:mod:`._text` how entries and values are shown; one module per command group
(:mod:`._ls`, :mod:`._info`, :mod:`._stats`, :mod:`._verify`, :mod:`._prune`,
:mod:`._clear`, :mod:`._bundles` for export and import), each with its
``_configure(parser)`` and ``_cmd_*(args, out)``. This module assembles the
:class:`Group`.
"""

from __future__ import annotations

from .._output import Command, Group
from . import _bundles, _clear, _info, _ls, _prune, _stats, _verify
from ._view import (
    CacheView,
    Record,
    add_location_arguments,
    load_record,
    load_records,
    open_cache,
    open_url,
    resolve_key,
    short_transform,
)

__all__ = [
    "CACHE",
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


CACHE = Group(
    "cache",
    help="inspect and maintain a jaxaot cache directory or shared store",
    description="Inspect and maintain a jaxaot cache: the default cache directory, "
    "the one given with --dir, or a shared store given with --url (redis://, gs://, s3://, "
    "file://...). Move entries between caches and machines with export/import.",
    commands=(
        Command("ls", "list the entries", _ls._configure, _ls._cmd_ls),
        Command(
            "info",
            "show everything about one entry",
            _info._configure,
            _info._cmd_info,
            epilog="Exit status: 0 ok, 1 the entry is damaged, 2 unknown or ambiguous KEY.",
        ),
        Command("stats", "entries, size, cap and counters", _stats._configure, _stats._cmd_stats),
        Command(
            "verify",
            "check every entry's checksum (signature when $JAXAOT_CACHE_HMAC_KEY is set)",
            _verify._configure,
            _verify._cmd_verify,
            epilog="Exit status: 0 when every entry is good, or when --fix removed every bad "
            "one; 1 when bad entries remain. Entries of another entry format version (written "
            "by another jaxaot release) are reported and skipped, never removed.",
        ),
        Command(
            "prune",
            "remove least recently used or long unused entries",
            _prune._configure,
            _prune._cmd_prune,
            epilog="Both options may be given: entries older than DURATION go first, then "
            "the least recently used until the rest fit in N bytes. DURATION needs a unit "
            "(a bare number is refused). On a terminal, prune says what it would remove and "
            "asks unless --yes; when stdin is not a terminal (cron, CI) it removes without "
            "asking and says what it removed.",
        ),
        Command(
            "clear",
            "remove every entry (asks first unless --yes)",
            _clear._configure,
            _clear._cmd_clear,
            epilog="Without --yes, clear asks on the terminal, and refuses (exit status 1) "
            "when stdin is not a terminal.",
        ),
        Command(
            "export",
            "write entries into one bundle file",
            _bundles._export_configure,
            _bundles._cmd_export,
            description="Write the cache's sound entries (all, or those of the named "
            "components) into one bundle file, to import on another machine.",
            epilog="Bad entries are left out and reported. Exit status: 0 ok; 1 when a "
            "--component NAME matched no entry or there is no good entry to export (then no "
            "file is written), or the bundle "
            "cannot be written.",
        ),
        Command(
            "import",
            "add the entries of a bundle file",
            _bundles._import_configure,
            _bundles._cmd_import,
            description="Add the entries of a bundle file to the cache (a --dir that does not "
            "exist yet is created). The bundle's checksum is verified first; then each entry's "
            "checksum (signature when $JAXAOT_CACHE_HMAC_KEY is set) and key; bad entries are "
            "refused, entries already present are skipped.",
            epilog="Exit status: 0 when every entry was added or already present; 1 when "
            "any entry was refused, or the bundle is damaged (then nothing is added).",
        ),
    ),
)
