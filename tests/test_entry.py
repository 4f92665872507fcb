"""The entry format: round trips, tree structures, verification before parsing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import namedtuple
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot
from jaxaot._caches import is_removable
from jaxaot._store import _entry
from jaxaot._store._entry import EntryError, NotPersistable

Pair = namedtuple("Pair", ["first", "second"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Config:
    w: jax.Array
    n: int = dataclasses.field(default=3, metadata={"static": True})


def _entry_for(fun: Any, *args: Any) -> _entry.Entry:
    return jaxaot.component(fun).entry(*args)


def test_round_trip_keeps_everything_but_process_local_state() -> None:
    entry = _entry_for(lambda x, y: (x @ y, {"s": jnp.sum(x)}), jnp.ones((2, 3)), jnp.ones((3, 4)))
    blob = _entry.encode(entry)
    back = _entry.decode(blob, expected=entry.key)
    assert back.key == entry.key
    assert back.in_avals == entry.in_avals and back.out_avals == entry.out_avals
    assert back.out_tree == entry.out_tree
    assert back.arg_names == entry.arg_names and back.result_paths == entry.result_paths
    assert back.stablehlo == entry.stablehlo and back.extra == entry.extra
    assert back.jaxpr is None and entry.jaxpr is not None


@pytest.mark.parametrize(
    "tree",
    [
        0,
        (0,),
        [0],
        None,
        {"b": 0, "a": (0, None)},
        {1: 0, 2: 0},
        Pair(0, [0, 0]),
        Config(w=0, n=7),
        (Pair(Config(0), None), [{"k": 0}]),
    ],
)
def test_tree_structures_round_trip(tree: Any) -> None:
    treedef = jax.tree_util.tree_structure(tree)
    data = json.loads(json.dumps(_entry.tree_to_json(treedef)))
    assert _entry.tree_from_json(data) == treedef


def test_expected_key_mismatch_is_an_error() -> None:
    entry = _entry_for(lambda x: x + 1, jnp.ones(2))
    other = entry.key.replace(args=("float32[3]",))
    with pytest.raises(EntryError, match="another key"):
        _entry.decode(_entry.encode(entry), expected=other)


def test_host_callback_entries_are_not_persistable() -> None:
    def f(x: jax.Array) -> jax.Array:
        jax.debug.print("x={x}", x=x)
        return x

    entry = _entry_for(f, jnp.ones(2))
    assert entry.host_callbacks
    with pytest.raises(NotPersistable):
        _entry.encode(entry)


@pytest.mark.parametrize("cut", ["zero", "one", "half", "minus_one"])
def test_truncation_is_detected(cut: str) -> None:
    blob = _entry.encode(_entry_for(lambda x: x * 2, jnp.ones(2)))
    n = len(blob)
    size = {"zero": 0, "one": 1, "half": n // 2, "minus_one": n - 1}[cut]
    with pytest.raises(EntryError):
        _entry.decode(blob[:size])


def test_every_sampled_bit_flip_is_detected() -> None:
    blobs = [
        _entry.encode(_entry_for(lambda x: jnp.sin(x), jnp.ones(3))),
        _entry.encode(_entry_for(lambda x, y: (x, y["a"] * 2), jnp.ones(2), {"a": jnp.ones(4)})),
    ]
    rng = np.random.default_rng(0)
    for blob in blobs:
        positions = set(rng.integers(0, len(blob) * 8, size=600).tolist())
        positions |= {0, 8 * 8, 8 * 12, len(blob) * 8 - 1}  # magic, version, header, digest
        for bit in positions:
            damaged = bytearray(blob)
            damaged[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(EntryError):
                _entry.verify(bytes(damaged))


def test_hmac_signed_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _entry_for(lambda x: x - 1, jnp.ones(2))
    unsigned = _entry.encode(entry)
    monkeypatch.setenv(_entry.HMAC_ENV, "secret-one")
    signed = _entry.encode(entry)
    assert _entry.decode(signed).key == entry.key
    with pytest.raises(_entry.SignatureError, match="not signed") as info:
        _entry.decode(unsigned)
    assert not info.value.removable and info.value.cause == "unsigned entry"
    monkeypatch.setenv(_entry.HMAC_ENV, "secret-two")
    with pytest.raises(_entry.SignatureError, match="another key|other than") as info:
        _entry.decode(signed)
    assert not info.value.removable and info.value.cause == "signature mismatch"
    monkeypatch.delenv(_entry.HMAC_ENV)
    with pytest.raises(_entry.SignatureError, match="is signed") as info:
        _entry.decode(signed)
    assert not info.value.removable and info.value.cause == "signed entry, no key"


def test_damage_is_told_apart_from_a_foreign_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever key this process has, a damaged entry is removable and a sound entry
    signed with another key (or unsigned against the setting) is not."""
    entry = _entry_for(lambda x: x + 3, jnp.ones(2))
    unsigned = _entry.encode(entry)
    monkeypatch.setenv(_entry.HMAC_ENV, "writer-key")
    signed = _entry.encode(entry)
    for reader_key in (None, "writer-key", "other-key"):
        if reader_key is None:
            monkeypatch.delenv(_entry.HMAC_ENV)
        else:
            monkeypatch.setenv(_entry.HMAC_ENV, reader_key)
        for blob in (signed, unsigned):
            sound_here = (blob is unsigned and reader_key is None) or (
                blob is signed and reader_key == "writer-key"
            )
            if sound_here:
                _entry.verify(blob)
                assert is_removable(
                    entry.key.digest, blob, _entry.check_stored
                )  # sound: removable when the caller cannot use it
            else:
                with pytest.raises(_entry.SignatureError):
                    _entry.verify(blob)
                assert not is_removable(entry.key.digest, blob, _entry.check_stored)
            for pos in (20, len(blob) // 2, len(blob) - 40):
                damaged = bytearray(blob)
                damaged[pos] ^= 0x10
                with pytest.raises(EntryError) as info:
                    _entry.verify(bytes(damaged))
                assert not isinstance(info.value, _entry.SignatureError)
                assert info.value.removable and is_removable(
                    entry.key.digest, bytes(damaged), _entry.check_stored
                )


@pytest.mark.parametrize("value", ["", " ", "\t\n"])
def test_empty_hmac_key_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    entry = _entry_for(lambda x: x * 5, jnp.ones(2))
    blob = _entry.encode(entry)
    monkeypatch.setenv(_entry.HMAC_ENV, value)
    with pytest.raises(ValueError, match="set but empty"):
        _entry.encode(entry)
    with pytest.raises(ValueError, match="set but empty"):
        _entry.decode(blob)


def test_other_format_version_is_refused() -> None:
    blob = bytearray(_entry.encode(_entry_for(lambda x: x, jnp.ones(1))))
    blob[8] = (_entry.ENTRY_FORMAT_VERSION + 1) & 0xFF
    with pytest.raises(EntryError, match="version"):
        _entry.verify(bytes(blob))


def test_garbage_is_not_an_entry() -> None:
    with pytest.raises(EntryError, match="magic"):
        _entry.verify(b"\x80\x04" + b"x" * 100)


# -- verified but hostile headers -----------------------------------------------------------


def _forge(header: bytes, payload: bytes = b"") -> bytes:
    """An entry with a sound checksum around an arbitrary header (what anyone who can
    write an unsigned cache can plant)."""
    body = (
        _entry._PREFIX.pack(_entry.MAGIC, _entry.ENTRY_FORMAT_VERSION, 0, len(header))
        + header
        + payload
    )
    return body + hashlib.sha256(body).digest()


def _good_header() -> dict[str, Any]:
    blob = _entry.encode(_entry_for(lambda x: x * 7, jnp.ones(2)))
    header, _ = _entry.verify(blob)
    header["sections"] = [["stablehlo", 3]]
    return header


HOSTILE: dict[str, Any] = {
    "deep list": b"[" * 200_000 + b"]" * 200_000,
    "deep key parts": {"key": [["a", json.loads("[" * 500 + "]" * 500)]]},
    "deep out_tree": "deep-tree",
    "platforms true": {"platforms": True},
    "extra -1": {"extra": -1},
    "created 1e308": {"created": 1e308},
    "created inf": b'{"created": Infinity}',
    "created huge int": "huge-int",
    "negative section": {"sections": [["stablehlo", -5]]},
    "section past end": {"sections": [["stablehlo", 10**12]]},
    "name a list": {"name": ["x"]},
    "avals numbers": {"in_avals": [1, 2]},
    "key not pairs": {"key": {"a": 1}},
    "cost strings": {"extra": {"cost_analysis": {"flops": "many"}}},
    "not an object": b"[1, 2, 3]",
    "not utf-8": b"\xff\xfe{}",
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_verified_header_is_a_clean_entry_error(case: str) -> None:
    change = HOSTILE[case]
    if isinstance(change, bytes) and case != "created inf":
        raw = change
    else:
        header = _good_header()
        if change == "deep-tree":
            tree: Any = "*"
            for _ in range(300):
                tree = {"type": "tuple", "aux": None, "children": [tree]}
            header["out_tree"] = tree
        elif change == "huge-int":
            header["created"] = 0
        elif isinstance(change, dict):
            header.update(change)
        raw = json.dumps(header).encode()
        if change == "huge-int":
            raw = raw.replace(b'"created": 0', b'"created": ' + b"9" * 5000)
        if case == "created inf":
            raw = json.dumps(_good_header()).encode()
            raw = raw.replace(b'"created": ', b'"created": Infinity, "_": ')
    blob = _forge(raw, b"abc")
    with pytest.raises(EntryError) as info:
        _entry.verify(blob)
    assert info.value.removable  # verified but unusable everywhere: may be quarantined
    with pytest.raises(EntryError):
        _entry.decode(blob)


def test_a_forged_sound_header_still_decodes() -> None:
    """The forging helper itself is right: the unchanged header decodes."""
    header = _good_header()
    header["sections"] = []
    _entry.decode(_forge(json.dumps(header).encode()))


def test_another_programs_sound_entry_under_a_key_is_dropped_not_called(
    fresh_cache: jaxaot.MemoryCache, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry whose checksum holds but whose body is another signature's (written
    under this key by a faulty or hostile writer of an unsigned cache) is refused
    when read: the call recomputes and gives ``jax.jit``'s value, with a warning,
    rather than failing on an executable made for other inputs."""

    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 2

    a, b = jnp.ones(3), jnp.ones((5, 2))
    mine, other = jaxaot.component(f).entry(a), jaxaot.component(f).entry(b)
    jaxaot.wait_for_writes()
    header, sections = _entry.verify(fresh_cache.get(other.key.digest))
    header["key"], header["digest"] = mine.key.to_json(), mine.key.digest
    payload = b"".join(sections[name] for name, _ in header["sections"])
    forged = _forge(json.dumps(header).encode(), payload)
    fresh_cache.put(mine.key.digest, forged)
    with pytest.raises(EntryError, match="input types") as info:
        _entry.decode(forged, expected=mine.key)
    assert info.value.removable
    caplog.set_level("WARNING", logger="jaxaot")
    np.testing.assert_allclose(jaxaot.component(f)(a), jax.jit(f)(a))
    assert any("input types are not those its key names" in r.getMessage() for r in caplog.records)
    assert fresh_cache.get(mine.key.digest) != forged  # dropped (and made again)


def test_an_entry_whose_output_tree_is_not_its_keys_is_dropped_not_used(
    fresh_cache: jaxaot.MemoryCache,
) -> None:
    """A sound entry whose header names the results in another order (its dict
    keys swapped, re-checksummed) would hand each result to the other name:
    refused when read, so the call gives ``jax.jit``'s values."""

    def f(x: jax.Array) -> dict[str, jax.Array]:
        return {"a": jnp.sin(x), "b": jnp.cos(x) + 1}

    x = jnp.arange(3.0)
    entry = jaxaot.component(f).entry(x)
    jaxaot.wait_for_writes()
    header, sections = _entry.verify(fresh_cache.get(entry.key.digest))
    text = json.dumps(header["out_tree"])
    header["out_tree"] = json.loads(
        text.replace('"a"', '"@"').replace('"b"', '"a"').replace('"@"', '"b"')
    )
    payload = b"".join(sections[name] for name, _ in header["sections"])
    forged = _forge(json.dumps(header).encode(), payload)
    with pytest.raises(EntryError, match="output tree"):
        _entry.decode(forged, expected=entry.key)
    fresh_cache.put(entry.key.digest, forged)
    got, want = jaxaot.component(f)(x), jax.jit(f)(x)
    for name in ("a", "b"):
        np.testing.assert_allclose(got[name], want[name])


def test_tree_types_are_only_looked_up_in_imported_modules() -> None:
    header = _good_header()
    header["sections"] = []
    header["out_tree"] = {"type": "antigravity:Nothing", "aux": None, "children": []}
    blob = _forge(json.dumps(header).encode())
    import sys

    assert "antigravity" not in sys.modules
    with pytest.raises(EntryError, match="not imported") as raised:
        _entry.decode(blob)
    assert "antigravity" not in sys.modules  # the entry made this process import nothing
    # Sound for the processes that imported it: left in the cache, not quarantined.
    assert not raised.value.removable
    header["out_tree"] = {
        "type": "tuple",
        "aux": {"ref": "antigravity:fly"},
        "children": [],
    }
    with pytest.raises(EntryError, match="not imported"):
        _entry.decode(_forge(json.dumps(header).encode()))
    assert "antigravity" not in sys.modules
