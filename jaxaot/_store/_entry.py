"""The cache entry: what one component signature compiles to, and its byte format.

Byte format (all integers little-endian)::

    magic      8 bytes   b"JAXAOT\\x00\\x01"
    version    u16       ENTRY_FORMAT_VERSION
    flags      u16       bit 0: signed (a signature follows the checksum)
    header_len u32
    header     header_len bytes of UTF-8 JSON (see ``_header``)
    sections   the payload sections, back to back, sizes listed in the header
    checksum   32 bytes: SHA-256 over everything above
    signature  32 bytes, only when signed: HMAC-SHA256 over everything above the
               checksum, with the key in $JAXAOT_CACHE_HMAC_KEY

``verify`` checks the length, magic, version and checksum before it parses a
single byte of the header or payload, then the signature: an entry is accepted
only if it is signed with this process's key, or unsigned when this process has
none. The checksum tells damage apart from a sound entry that this process
cannot check (:class:`SignatureError`: signed with another key, unsigned while
a key is set, signed while none is): damaged entries may be quarantined, the
others are good for the processes that wrote them and are left alone. The
header is then validated (bounded nesting, sizes, types and numbers) before
anything uses it, so a hostile header is a clean :class:`EntryError`.

Nothing in the header or the ``stablehlo`` section is ever unpickled. The
``executable`` section is in ``jax.experimental.serialize_executable``'s
format, which unpickles: it is deserialized only after the checksum and the
signature verified, so it is only as trustworthy as whoever could write the
cache (see the README's trust model).

Format changelog (bump ENTRY_FORMAT_VERSION on every change; the version is a
key part, so entries of another version are never read, only missed):
  * 1 (2026-11-29): first version. Sections: ``stablehlo`` (MLIR bytecode of
    the component lowered for the key's platforms) and ``executable`` (a
    top-level compiled executable in ``jax.experimental.serialize_executable``'s
    format; only ever deserialized after the digest verified). Executable
    entries carry ``extra.cost_analysis`` and ``extra.executable_in_tree``.
  * 2 (2026-12-01): a flags field; a SHA-256 checksum on every entry and, for
    signed entries, an HMAC signature after it (version 1 had one digest that
    was either), so that damage and a foreign key can be told apart.
    Later additions within version 2, read as absent by earlier readers (whose
    keys never name such entries): ``in_shardings``/``out_shardings``, the
    sharding each type carries (explicit mesh axes), for entries with sharded
    types; their ``in_avals``/``out_avals`` texts end in ``@`` and that sharding.
    ``extra.work`` (a number): the estimate of what the entry computes, by
    which its linearization may recompute its forward pass (``_component._cost``).
  * 3: ``extra.work`` on every entry whose work is known, checkpoint regions or
    not, and ``extra.checkpoints`` where it holds one: ``jaxaot.jit`` chooses a
    program's form from its entries' work, and a process that loads them must
    choose as the one that made them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jaxlib
import numpy as np

from .._caches import BadEntry
from .._caches._trust import HMAC_ENV, hmac_secret
from .._keys._key import ComponentKey
from .._keys._sharding import sharded_type, type_sharding_from_json, type_sharding_to_json
from .._keys._text import parse_aval_str, tree_text, type_text
from ._trees import LEAF, NotPersistable, TreeError, tree_from_json, tree_to_json

__all__ = [
    "ENTRY_FORMAT_VERSION",
    "HMAC_ENV",
    "MAGIC",
    "Entry",
    "EntryError",
    "FormatVersionError",
    "HeaderError",
    "NotPersistable",
    "SignatureError",
    "UnknownTreeNode",
    "check_stored",
    "decode",
    "encode",
    "verify",
]

ENTRY_FORMAT_VERSION = 3
MAGIC = b"JAXAOT\x00\x01"
_PREFIX = struct.Struct("<8sHHI")
_DIGEST_BYTES = 32
_FLAG_SIGNED = 1
#: Limits on a header (all far above what jaxaot writes): beyond them a verified
#: entry is refused rather than parsed or rebuilt.
MAX_HEADER_BYTES = 32 << 20
MAX_HEADER_DEPTH = 64
MAX_TEXT = 1 << 20
#: ``created`` must be a time between 1970 and about the year 5000.
_MAX_TIME = 1e11


class EntryError(BadEntry):
    """An entry's bytes are damaged, foreign, hostile, unsigned or of another format
    version. ``cause`` names the kind of problem, for one warning per cause;
    ``removable`` whether the entry may be quarantined (it is bad for every process)."""


class SignatureError(EntryError):
    """A sound entry (its checksum holds) whose signature this process cannot accept:
    signed with another key, unsigned while this process has a key, or signed while
    it has none. Good for the processes that wrote it, so never quarantined."""

    removable = False

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class FormatVersionError(EntryError):
    """An entry of another format version (a newer or older jaxaot's): unreadable
    here, but not damaged, so never quarantined."""

    cause = "other format version"
    removable = False

    def __init__(self, version: int) -> None:
        super().__init__(
            f"entry format version {version}; this jaxaot reads version {ENTRY_FORMAT_VERSION}"
        )
        self.version = version


class UnknownTreeNode(EntryError):
    """A sound entry whose tree names a node type (or a name in its node data) that
    this process has not imported: good for the processes that have, so never
    quarantined."""

    cause = "tree node type not imported"
    removable = False


class HeaderError(EntryError):
    """A verified entry whose header is malformed or hostile (nesting, types, sizes,
    numbers)."""

    cause = "bad header"


@dataclass
class Entry:
    """One cache entry, decoded.

    ``jaxpr`` and ``effects`` exist only in the process that traced the entry;
    everything else round-trips through ``encode``/``decode``.
    """

    key: ComponentKey
    name: str
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    out_tree: Any
    arg_names: tuple[str, ...]
    result_paths: tuple[str, ...]
    stablehlo: bytes | None = None
    executable: bytes | None = None
    host_callbacks: bool = False
    jaxpr: Any = None
    effects: frozenset[Any] = frozenset()
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(self.key.parts.get("platforms", ()))

    def signature(self) -> str:
        return "(" + ", ".join(type_text(a) for a in self.in_avals) + ")"


def _signature(data: bytes, secret: bytes) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()


# ----------------------------------------------------------------------------
# Encoding and decoding.


def _header(entry: Entry, sections: list[tuple[str, bytes]]) -> dict[str, Any]:
    return {
        "format": ENTRY_FORMAT_VERSION,
        "key": entry.key.to_json(),
        "digest": entry.key.digest,
        "name": entry.name,
        "signature": entry.signature(),
        "in_avals": [type_text(a) for a in entry.in_avals],
        "out_avals": [type_text(a) for a in entry.out_avals],
        "out_tree": tree_to_json(entry.out_tree),
        "arg_names": list(entry.arg_names),
        "result_paths": list(entry.result_paths),
        "platforms": list(entry.platforms),
        "jax": jax.__version__,
        "jaxlib": str(jaxlib.__version__),
        "created": entry.created,
        "host_callbacks": entry.host_callbacks,
        "sections": [[name, len(blob)] for name, blob in sections],
        "extra": entry.extra,
        **_type_shardings(entry),
    }


def _type_shardings(entry: Entry) -> dict[str, Any]:
    """``in_shardings``/``out_shardings``: for each input and output, the sharding
    its type carries (explicit mesh axes), or the mesh it names (a body that
    constrains its result to a mesh's devices: its type is of that mesh, as the
    caller's values are), or ``None``; absent when no type carries one (so
    entries without them are as they always were). A process that loads the
    entry then types its results as the process that made it did, and its glue
    (autodiff's casts between types included) is the same program."""
    if not any(_mesh_typed(a) for a in (*entry.in_avals, *entry.out_avals)):
        return {}
    return {
        f"{what}_shardings": [
            type_sharding_to_json(a.sharding) if _mesh_typed(a) else None for a in avals
        ]
        for what, avals in (("in", entry.in_avals), ("out", entry.out_avals))
    }


def _mesh_typed(aval: Any) -> bool:
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return sharded_type(aval) or (mesh is not None and not mesh.empty)


#: ``Entry.extra`` field of an entry kept in this process: why (said where it is
#: not written to a cache).
LOCAL = "local"


def encode(entry: Entry) -> bytes:
    """The bytes of ``entry``. Raises :class:`NotPersistable` for process-local entries."""
    if entry.host_callbacks:
        raise NotPersistable(
            entry.extra.get(LOCAL)
            or "the entry holds host callbacks (process-local Python objects)"
        )
    for aval in (*entry.in_avals, *entry.out_avals):
        try:
            np.dtype(aval.dtype)
        except TypeError as e:
            # Typed PRNG keys are written by name (key<fry>) and rebuilt on read.
            if not str(aval.dtype).startswith("key<"):
                raise NotPersistable(f"extended dtype {aval.dtype}") from e
    sections: list[tuple[str, bytes]] = []
    if entry.stablehlo is not None:
        sections.append(("stablehlo", entry.stablehlo))
    if entry.executable is not None:
        sections.append(("executable", entry.executable))
    header = json.dumps(_header(entry, sections), separators=(",", ":")).encode("utf-8")
    secret = hmac_secret()
    flags = _FLAG_SIGNED if secret is not None else 0
    body = b"".join(
        [_PREFIX.pack(MAGIC, ENTRY_FORMAT_VERSION, flags, len(header)), header]
        + [blob for _, blob in sections]
    )
    tail = hashlib.sha256(body).digest()
    if secret is not None:
        tail += _signature(body, secret)
    return body + tail


def _split(blob: bytes) -> tuple[bytes, int, int, bytes | None]:
    """``(body, flags, header_len, signature)`` of an entry whose checksum holds.

    Raises:
      FormatVersionError: an entry of another format version.
      EntryError: damaged (or not an entry at all).
    """
    if len(blob) < _PREFIX.size + _DIGEST_BYTES:
        raise EntryError(f"entry too short ({len(blob)} bytes)")
    magic, version, flags, header_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise EntryError("not a jaxaot entry (bad magic bytes)")
    if version != ENTRY_FORMAT_VERSION:
        raise FormatVersionError(int(version))
    tail = 2 * _DIGEST_BYTES if flags & _FLAG_SIGNED else _DIGEST_BYTES
    if len(blob) < _PREFIX.size + tail:
        raise EntryError(f"entry too short ({len(blob)} bytes)")
    body = blob[:-tail]
    checksum = blob[len(body) : len(body) + _DIGEST_BYTES]
    if not hmac.compare_digest(checksum, hashlib.sha256(body).digest()):
        raise EntryError("checksum mismatch (the entry is damaged)")
    if flags & ~_FLAG_SIGNED:
        raise EntryError(f"unknown entry flags {flags:#x}")
    signature = blob[len(body) + _DIGEST_BYTES :] if flags & _FLAG_SIGNED else None
    return body, flags, header_len, signature


def _check_signature(body: bytes, signature: bytes | None) -> None:
    secret = hmac_secret()
    if secret is None:
        if signature is not None:
            raise SignatureError(
                "signed entry, no key",
                f"signature not checked: the entry is signed, and ${HMAC_ENV} is not set "
                "in this process",
            )
        return
    if signature is None:
        raise SignatureError(
            "unsigned entry",
            f"signature mismatch: the entry is not signed, and ${HMAC_ENV} is set in this process",
        )
    if not hmac.compare_digest(signature, _signature(body, secret)):
        raise SignatureError(
            "signature mismatch",
            f"signature mismatch: the entry is signed with a key other than ${HMAC_ENV}",
        )


def _parse_header(raw: bytes) -> Any:
    if len(raw) > MAX_HEADER_BYTES:
        raise HeaderError(f"header of {len(raw)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise HeaderError("header nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # also ints past Python's digit limit
        raise HeaderError(f"malformed header: {e}") from None


def _check_depth(obj: Any, limit: int = MAX_HEADER_DEPTH) -> None:
    """Raises :class:`HeaderError` if ``obj`` (parsed JSON) nests deeper than ``limit``."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                raise HeaderError(f"header nested deeper than {limit} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def _text(value: Any, field: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise HeaderError(f"header field {field!r} is not a string of at most {limit} characters")
    return value


def _texts(value: Any, field: str) -> list[str]:
    if not isinstance(value, list):
        raise HeaderError(f"header field {field!r} is not a list of strings")
    return [_text(v, field) for v in value]


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise HeaderError(f"header field {field!r} is not a finite number")
    return float(value)


def _check_tree(data: Any, field: str) -> None:
    stack = [data]
    while stack:
        node = stack.pop()
        if node == LEAF:
            continue
        if (
            not isinstance(node, dict)
            or set(node) != {"type", "aux", "children"}
            or not isinstance(node["children"], list)
        ):
            raise HeaderError(f"header field {field!r} is not a tree structure")
        _text(node["type"], field, 1024)
        stack.extend(node["children"])


def _check_header(header: Any, body_len: int) -> None:
    """Raises :class:`HeaderError` unless ``header`` has the fields, types, sizes and
    numbers that jaxaot writes (so nothing downstream meets a surprise)."""
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    _check_depth(header)
    required = ("format", "key", "digest", "name", "in_avals", "out_avals", "out_tree")
    for name in required + ("arg_names", "result_paths", "created", "sections"):
        if name not in header:
            raise HeaderError(f"header has no {name!r} field")
    if header["format"] != ENTRY_FORMAT_VERSION or isinstance(header["format"], bool):
        raise HeaderError(f"header field 'format' is {header['format']!r:.40}")
    key = header["key"]
    if not isinstance(key, list) or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in key
    ):
        raise HeaderError("header field 'key' is not a list of [name, value] pairs")
    digest = _text(header["digest"], "digest", 128)
    if not digest or not all(c in "0123456789abcdef" for c in digest):
        raise HeaderError("header field 'digest' is not a hex digest")
    _text(header["name"], "name", 4096)
    for name in ("signature", "jax", "jaxlib"):
        if name in header:
            _text(header[name], name)
    for name in ("in_avals", "out_avals", "arg_names", "result_paths", "platforms"):
        if name in header:
            _texts(header[name], name)
    for what in ("in", "out"):
        shardings = header.get(f"{what}_shardings")
        if shardings is not None and (
            not isinstance(shardings, list)
            or len(shardings) != len(header[f"{what}_avals"])
            or not all(s is None or isinstance(s, dict) for s in shardings)
        ):
            raise HeaderError(f"header field '{what}_shardings' is not a list of shardings")
    _check_tree(header["out_tree"], "out_tree")
    created = _number(header["created"], "created")
    if not 0 <= created <= _MAX_TIME:
        raise HeaderError(f"header field 'created' is not a plausible time ({created:.3g})")
    if "host_callbacks" in header and not isinstance(header["host_callbacks"], bool):
        raise HeaderError("header field 'host_callbacks' is not a boolean")
    sections = header["sections"]
    if not isinstance(sections, list):
        raise HeaderError("header field 'sections' is not a list")
    seen: set[str] = set()
    total = 0
    for item in sections:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or isinstance(item[1], bool)
            or not isinstance(item[1], int)
            or item[1] < 0
            or item[0] in seen
        ):
            raise HeaderError("header field 'sections' is not a list of [name, size] pairs")
        seen.add(_text(item[0], "sections", 64))
        total += item[1]
        if total > body_len:
            raise HeaderError("section sizes run past the end of the entry")
    extra = header.get("extra", {})
    if not isinstance(extra, dict):
        raise HeaderError("header field 'extra' is not an object")
    costs = extra.get("cost_analysis")
    if costs is not None and (
        not isinstance(costs, dict)
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in costs.values())
    ):
        raise HeaderError("header field 'extra.cost_analysis' is not an object of numbers")
    if "executable_in_tree" in extra:
        _check_tree(extra["executable_in_tree"], "extra.executable_in_tree")


def verify(blob: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Checks ``blob`` and returns its header and sections.

    The checksum (and the signature) are checked before any of the header or
    payload is parsed; the header is then validated (see ``_check_header``).

    Raises:
      SignatureError: a sound entry this process cannot check (another key, or
        signed/unsigned against this process's setting).
      FormatVersionError: an entry of another format version.
      EntryError: damaged, not an entry, or a hostile header.
      ValueError: ``$JAXAOT_CACHE_HMAC_KEY`` is set but empty.
    """
    body, _, header_len, signature = _split(blob)
    _check_signature(body, signature)
    if _PREFIX.size + header_len > len(body):
        raise HeaderError("header length past the end of the entry")
    header = _parse_header(body[_PREFIX.size : _PREFIX.size + header_len])
    _check_header(header, len(body))
    offset = _PREFIX.size + header_len
    sections: dict[str, bytes] = {}
    for name, size in header["sections"]:
        sections[name] = body[offset : offset + size]
        offset += size
    if offset != len(body):
        raise HeaderError("section sizes do not match the entry size")
    return header, sections


def check_stored(key: str, blob: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Checks that ``blob`` is a sound entry stored under cache key ``key``; returns
    its header and sections. The entry check the cache backends are given.

    Verifies the checksum (the HMAC signature when ``$JAXAOT_CACHE_HMAC_KEY`` is
    set), the format and the header (:func:`verify`), and that the digest
    recorded in the header, and the digest of the key parts recorded in it, both
    name ``key``.

    Raises:
      EntryError: the entry is damaged, unsigned, foreign, of another format
        version, or stored under another key.
    """
    header, sections = verify(blob)
    try:
        digest = ComponentKey.from_json(header["key"]).digest
    except (KeyError, TypeError, ValueError) as e:
        raise EntryError(f"malformed key parts: {e}") from e
    if header.get("digest") != digest or not key.startswith(digest):
        raise EntryError(f"stored under the wrong key (its key digest is {digest[:12]})")
    return header, sections


def _check_named(key: ComponentKey, header: dict[str, Any], out_tree: Any) -> None:
    """Raises where the entry is not what its key names: sound bytes of another
    entry under this key (a faulty or hostile writer's; a signature, not a
    checksum, rules that out) would be called with inputs of other types, or
    give their results in another tree.

    Raises:
      HeaderError: its input types or output tree are not its key's, or its
        output types do not fill its tree.
    """
    if out_tree.num_leaves != len(header["out_avals"]):
        raise HeaderError("its output types do not fill its output tree")
    if key.parts.get("transform") != ():
        return  # (a derived entry's key names its parent's types)
    named = key.parts.get("args")
    if isinstance(named, tuple) and list(named) != list(header["in_avals"]):
        raise HeaderError("its input types are not those its key names")
    tree = key.parts.get("out_tree")
    # (A block's entry returns its results as a flat list, whatever tree its key names.)
    flat = out_tree == jax.tree_util.tree_structure([0] * out_tree.num_leaves)
    if isinstance(tree, str) and not flat and tree != tree_text(out_tree):
        raise HeaderError("its output tree is not the one its key names")


def decode(blob: bytes, expected: ComponentKey | None = None) -> Entry:
    """Verifies and decodes ``blob``; if ``expected`` is given, its parts must match."""
    header, sections = verify(blob)
    try:
        key = ComponentKey.from_json(header["key"])
        if expected is not None and key != expected:
            raise EntryError("entry belongs to another key: " + "; ".join(expected.explain(key)))
        from .._jax import ShapedArray

        context = jax.sharding.get_abstract_mesh()

        def avals(what: str) -> tuple[Any, ...]:
            texts = header[f"{what}_avals"]
            shardings = header.get(f"{what}_shardings") or [None] * len(texts)
            out = []
            for t, sharding in zip(texts, shardings, strict=True):
                shape, dtype, weak = parse_aval_str(t.split("@", 1)[0])
                if sharding is None:
                    out.append(ShapedArray(shape, dtype, weak_type=weak))
                else:
                    typed = type_sharding_from_json(sharding, context)
                    out.append(ShapedArray(shape, dtype, weak_type=weak, sharding=typed))
            return tuple(out)

        out_tree = tree_from_json(header["out_tree"])
        _check_named(key, header, out_tree)
        return Entry(
            key=key,
            name=str(header["name"]),
            in_avals=avals("in"),
            out_avals=avals("out"),
            out_tree=out_tree,
            arg_names=tuple(header["arg_names"]),
            result_paths=tuple(header["result_paths"]),
            stablehlo=sections.get("stablehlo"),
            executable=sections.get("executable"),
            host_callbacks=bool(header["host_callbacks"]),
            created=float(header["created"]),
            extra=dict(header.get("extra") or {}),
        )
    except EntryError:
        raise
    except TreeError as e:
        raise UnknownTreeNode(f"cannot rebuild its tree here: {e}") from e
    except Exception as e:  # a verified entry that this process cannot rebuild
        raise EntryError(f"cannot decode entry: {type(e).__name__}: {e}") from e
