"""The entry format: round trips, tree structures, verification before parsing."""

from __future__ import annotations

import dataclasses
import json
from collections import namedtuple
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaot
from jaxaot import _entry
from jaxaot._entry import EntryError, NotPersistable

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
    with pytest.raises(EntryError, match="signature"):
        _entry.decode(unsigned)
    monkeypatch.setenv(_entry.HMAC_ENV, "secret-two")
    with pytest.raises(EntryError, match="signature"):
        _entry.decode(signed)
    monkeypatch.delenv(_entry.HMAC_ENV)
    with pytest.raises(EntryError, match="checksum"):
        _entry.decode(signed)


def test_other_format_version_is_refused() -> None:
    blob = bytearray(_entry.encode(_entry_for(lambda x: x, jnp.ones(1))))
    blob[8] = (_entry.ENTRY_FORMAT_VERSION + 1) & 0xFF
    with pytest.raises(EntryError, match="version"):
        _entry.verify(bytes(blob))


def test_garbage_is_not_an_entry() -> None:
    with pytest.raises(EntryError, match="magic"):
        _entry.verify(b"\x80\x04" + b"x" * 100)
