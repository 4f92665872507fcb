"""The cache entry: what one component signature compiles to, and its byte format.

Byte format (all integers little-endian)::

    magic      8 bytes   b"JAXAOT\\x00\\x01"
    version    u16       ENTRY_FORMAT_VERSION
    header_len u32
    header     header_len bytes of UTF-8 JSON (see ``_header``)
    sections   the payload sections, back to back, sizes listed in the header
    digest     32 bytes: SHA-256 over everything above, or HMAC-SHA256 with the
               key in $JAXAOT_CACHE_HMAC_KEY when that is set

``decode`` verifies the length, magic, version and digest before it parses a
single byte of the header or payload; nothing in an entry is ever unpickled.

Format changelog (bump ENTRY_FORMAT_VERSION on every change; the version is a
key part, so entries of another version are never read, only missed):
  * 1 (2026-11-29): first version. Sections: ``stablehlo`` (MLIR bytecode of
    the component lowered for the key's platforms) and ``executable`` (a
    top-level compiled executable in ``jax.experimental.serialize_executable``'s
    format; only ever deserialized after the digest verified). Executable
    entries carry ``extra.cost_analysis`` and ``extra.executable_in_tree``.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ._key import ComponentKey, aval_str, parse_aval_str

ENTRY_FORMAT_VERSION = 1
MAGIC = b"JAXAOT\x00\x01"
_PREFIX = struct.Struct("<8sHI")
_DIGEST_BYTES = 32
HMAC_ENV = "JAXAOT_CACHE_HMAC_KEY"


class EntryError(ValueError):
    """An entry's bytes are damaged, foreign, unsigned or of another format version."""


class NotPersistable(Exception):
    """An entry holds something that cannot leave this process."""


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
        return "(" + ", ".join(_aval_text(a) for a in self.in_avals) + ")"


def _aval_text(aval: Any) -> str:
    return aval_str(aval.shape, aval.dtype, aval.weak_type)


def _hmac_key() -> bytes | None:
    secret = os.environ.get(HMAC_ENV)
    return secret.encode("utf-8") if secret else None


def _digest(data: bytes, secret: bytes | None) -> bytes:
    if secret is None:
        return hashlib.sha256(data).digest()
    return hmac.new(secret, data, hashlib.sha256).digest()


# ----------------------------------------------------------------------------
# Tree structures as JSON: node type by import path, auxiliary data tagged.

_LEAF = "*"


_BUILTIN_NODES: dict[str, type] = {
    "tuple": tuple,
    "list": list,
    "dict": dict,
    "None": type(None),
    "OrderedDict": __import__("collections").OrderedDict,
    "defaultdict": __import__("collections").defaultdict,
}
_BUILTIN_NAMES = {cls: name for name, cls in _BUILTIN_NODES.items()}


def _import_path(cls: type) -> str:
    if cls in _BUILTIN_NAMES:
        return _BUILTIN_NAMES[cls]
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(path: str) -> type:
    if path in _BUILTIN_NODES:
        return _BUILTIN_NODES[path]
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise EntryError(f"{path} is not a type")
    return obj


def _aux_to_json(aux: Any) -> Any:
    if aux is None or isinstance(aux, bool | int | float | str):
        return aux
    if isinstance(aux, tuple):
        return {"tuple": [_aux_to_json(a) for a in aux]}
    if isinstance(aux, list):
        return [_aux_to_json(a) for a in aux]
    raise NotPersistable(f"tree node data of type {type(aux).__name__}")


def _aux_from_json(data: Any) -> Any:
    if isinstance(data, dict):
        return tuple(_aux_from_json(a) for a in data["tuple"])
    if isinstance(data, list):
        return [_aux_from_json(a) for a in data]
    return data


def tree_to_json(treedef: Any) -> Any:
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return _LEAF
    node_type, aux = treedef.node_data()
    return {
        "type": _import_path(node_type),
        "aux": _aux_to_json(aux),
        "children": [tree_to_json(c) for c in treedef.children()],
    }


_LEAF_DEF = jax.tree_util.tree_structure(0)


def tree_from_json(data: Any) -> Any:
    if data == _LEAF:
        return _LEAF_DEF
    node_type = _resolve(data["type"])
    children = [tree_from_json(c) for c in data["children"]]
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, (node_type, _aux_from_json(data["aux"])), children
    )


# ----------------------------------------------------------------------------
# Encoding and decoding.


def _header(entry: Entry, sections: list[tuple[str, bytes]]) -> dict[str, Any]:
    return {
        "format": ENTRY_FORMAT_VERSION,
        "key": entry.key.to_json(),
        "digest": entry.key.digest,
        "name": entry.name,
        "signature": entry.signature(),
        "in_avals": [_aval_text(a) for a in entry.in_avals],
        "out_avals": [_aval_text(a) for a in entry.out_avals],
        "out_tree": tree_to_json(entry.out_tree),
        "arg_names": list(entry.arg_names),
        "result_paths": list(entry.result_paths),
        "platforms": list(entry.platforms),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "created": entry.created,
        "host_callbacks": entry.host_callbacks,
        "sections": [[name, len(blob)] for name, blob in sections],
        "extra": entry.extra,
    }


def _jaxlib_version() -> str:
    import jaxlib

    return str(jaxlib.__version__)


def encode(entry: Entry) -> bytes:
    """The bytes of ``entry``. Raises :class:`NotPersistable` for process-local entries."""
    if entry.host_callbacks:
        raise NotPersistable("the entry holds host callbacks (process-local Python objects)")
    for aval in (*entry.in_avals, *entry.out_avals):
        try:
            np.dtype(aval.dtype)
        except TypeError as e:
            raise NotPersistable(f"extended dtype {aval.dtype}") from e
    sections: list[tuple[str, bytes]] = []
    if entry.stablehlo is not None:
        sections.append(("stablehlo", entry.stablehlo))
    if entry.executable is not None:
        sections.append(("executable", entry.executable))
    header = json.dumps(_header(entry, sections), separators=(",", ":")).encode("utf-8")
    body = b"".join(
        [_PREFIX.pack(MAGIC, ENTRY_FORMAT_VERSION, len(header)), header]
        + [blob for _, blob in sections]
    )
    return body + _digest(body, _hmac_key())


def verify(blob: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Checks ``blob`` and returns its header and sections; raises :class:`EntryError`.

    The digest is checked before any of the header or payload is parsed.
    """
    if len(blob) < _PREFIX.size + _DIGEST_BYTES:
        raise EntryError(f"entry too short ({len(blob)} bytes)")
    body, digest = blob[:-_DIGEST_BYTES], blob[-_DIGEST_BYTES:]
    magic, version, header_len = _PREFIX.unpack_from(body)
    if magic != MAGIC:
        raise EntryError("not a jaxaot entry (bad magic bytes)")
    if version != ENTRY_FORMAT_VERSION:
        raise EntryError(
            f"entry format version {version}; this jaxaot reads version {ENTRY_FORMAT_VERSION}"
        )
    secret = _hmac_key()
    if not hmac.compare_digest(digest, _digest(body, secret)):
        what = "signature" if secret is not None else "checksum"
        raise EntryError(f"{what} mismatch")
    if _PREFIX.size + header_len > len(body):
        raise EntryError("header length past the end of the entry")
    try:
        header = json.loads(body[_PREFIX.size : _PREFIX.size + header_len])
        offset = _PREFIX.size + header_len
        sections: dict[str, bytes] = {}
        for name, size in header["sections"]:
            sections[name] = body[offset : offset + size]
            offset += size
    except (ValueError, KeyError, TypeError) as e:
        raise EntryError(f"malformed header: {e}") from e
    if offset != len(body):
        raise EntryError("section sizes do not match the entry size")
    return header, sections


def decode(blob: bytes, expected: ComponentKey | None = None) -> Entry:
    """Verifies and decodes ``blob``; if ``expected`` is given, its parts must match."""
    header, sections = verify(blob)
    try:
        key = ComponentKey.from_json(header["key"])
        if expected is not None and key != expected:
            raise EntryError("entry belongs to another key: " + "; ".join(expected.explain(key)))
        from ._jaxcompat import ShapedArray

        def avals(texts: list[str]) -> tuple[Any, ...]:
            out = []
            for t in texts:
                shape, dtype, weak = parse_aval_str(t)
                out.append(ShapedArray(shape, dtype, weak_type=weak))
            return tuple(out)

        return Entry(
            key=key,
            name=str(header["name"]),
            in_avals=avals(header["in_avals"]),
            out_avals=avals(header["out_avals"]),
            out_tree=tree_from_json(header["out_tree"]),
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
    except Exception as e:  # a verified entry that this process cannot rebuild
        raise EntryError(f"cannot decode entry: {type(e).__name__}: {e}") from e
