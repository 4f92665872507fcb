"""TieredCache: verified promotion, bad entries refused and removed, writes to every
tier, a raising tier does not stop the others; JAXAOT_CACHE URLs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest
from _helpers import make_blob

import jaxaot
from jaxaot._caches._tiered import TieredCache
from jaxaot._store import _active, _entry
from jaxaot._store._entry import check_stored as verify_entry


def flip(blob: bytes, at: int | None = None) -> bytes:
    data = bytearray(blob)
    data[len(data) // 2 if at is None else at] ^= 0x01
    return bytes(data)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "jaxaot" and r.levelno >= logging.WARNING
    ]


class Exploding:
    """A protocol-complete cache whose every method raises."""

    def __init__(self) -> None:
        self.calls = 0

    def _boom(self, *args: Any) -> Any:
        self.calls += 1
        raise RuntimeError("tier on fire")

    get = put = delete = keys = clear = stats = _boom


def test_hit_in_slow_tier_is_verified_and_promoted() -> None:
    fast, slow = jaxaot.MemoryCache(), jaxaot.MemoryCache()
    tiered = TieredCache(fast, slow, check=verify_entry)
    key, blob = make_blob()
    slow.put(key, blob)
    assert tiered.get(key) == blob
    assert fast.get(key) == blob  # promoted
    assert tiered.get(key) == blob
    assert slow.hit_count(key) == 1  # the second hit came from the fast tier
    stats = tiered.stats()
    assert stats["backend"] == "tiered" and stats["entries"] == 1
    assert stats["promotions"] == 1 and stats["tier_hits"] == [1, 1]
    assert [t["backend"] for t in stats["tiers"]] == ["memory", "memory"]
    assert stats["bytes"] == 2 * len(blob)


def test_promotion_reaches_every_faster_tier() -> None:
    tiers = [jaxaot.MemoryCache() for _ in range(3)]
    key, blob = make_blob()
    tiers[2].put(key, blob)
    assert TieredCache(*tiers, check=verify_entry).get(key) == blob
    assert all(t.get(key) == blob for t in tiers)


def test_a_filling_view_writes_a_fast_hit_back_to_the_slower_tiers() -> None:
    """What ``jaxaot precompile`` fills: a hit in the local tier reaches the
    shared ones; a plain tiered cache leaves them alone; a damaged copy is
    written nowhere."""
    tiers = [jaxaot.MemoryCache() for _ in range(3)]
    key, blob = make_blob()
    tiers[0].put(key, blob)
    tiered = TieredCache(*tiers, check=verify_entry)
    assert tiered.get(key) == blob and tiers[2].get(key) is None
    assert tiered.filling().get(key) == blob
    assert all(t.get(key) == blob for t in tiers)
    bad_key, bad = make_blob(tag=1)
    tiers[0].put(bad_key, flip(bad))
    assert tiered.filling().get(bad_key) is None
    assert tiers[1].get(bad_key) is None and tiers[2].get(bad_key) is None


def test_a_filling_view_writes_the_notes_a_slower_tier_lacks_back_to_it() -> None:
    """The notes of what a signature used (``_store._prefetch``) reach the shared
    tier with the entries, in their order; a plain tiered cache reads them as
    they are."""
    fast, slow = jaxaot.MemoryCache(), jaxaot.MemoryCache()
    keys = []
    for i in range(3):
        key, blob = make_blob(tag=i)
        fast.put(key, blob)
        slow.put(key, blob)
        keys.append(key)
    tag = "ab" * 32
    for key in keys:
        fast.note(tag, key, b"")
    slow.note(tag, keys[0], b"")
    plain = TieredCache(fast, slow, check=verify_entry)
    assert [k for k, _ in plain.notes(tag)] == keys[::-1]
    assert [k for k, _ in slow.notes(tag)] == [keys[0]]
    assert [k for k, _ in plain.filling().notes(tag)] == keys[::-1]
    assert [k for k, _ in slow.notes(tag)] == keys[::-1]


@pytest.mark.parametrize("damage", ["flip", "misfiled", "garbage"])
def test_bad_entry_is_not_promoted_and_removed(
    damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    fast, slow = jaxaot.MemoryCache(), jaxaot.MemoryCache()
    key, blob = make_blob()
    if damage == "flip":
        bad = flip(blob)
    elif damage == "misfiled":
        bad = make_blob(tag=1)[1]  # a sound entry, but for another key
    else:
        bad = b"not an entry at all"
    slow.put(key, bad)
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    tiered = TieredCache(fast, slow, check=verify_entry)
    assert tiered.get(key) is None
    assert fast.keys() == [] and slow.keys() == []  # not promoted; removed from its tier
    assert tiered.stats()["refused"] == 1
    assert len(warnings_of(caplog)) == 1 and key[:16] in warnings_of(caplog)[0]


def test_bad_entry_falls_through_to_a_sound_copy_further_down() -> None:
    t0, t1, t2 = jaxaot.MemoryCache(), jaxaot.MemoryCache(), jaxaot.MemoryCache()
    key, blob = make_blob()
    t1.put(key, flip(blob))
    t2.put(key, blob)
    assert TieredCache(t0, t1, t2, check=verify_entry).get(key) == blob
    assert t0.get(key) == blob and t1.get(key) == blob  # the damaged copy was repaired


def test_quarantine_is_used_when_a_tier_has_it(tmp_path: Path) -> None:
    directory = jaxaot.DirectoryCache(tmp_path / "d")
    key, blob = make_blob()
    directory.put(key, flip(blob))
    tiered = TieredCache(jaxaot.MemoryCache(), directory, check=verify_entry)
    assert tiered.get(key) is None
    assert directory.keys() == []
    assert len(list((tmp_path / "d" / "quarantine").iterdir())) == 1


def test_every_tier_is_verified_and_a_damaged_fast_copy_gives_way() -> None:
    fast, slow = jaxaot.MemoryCache(), jaxaot.MemoryCache()
    key, blob = make_blob()
    fast.put(key, flip(blob))
    slow.put(key, blob)
    tiered = TieredCache(fast, slow, check=verify_entry)
    assert tiered.get(key) == blob  # the damaged fast copy is never returned
    assert fast.get(key) == blob  # replaced by the sound copy (promoted)
    assert slow.get(key) == blob  # the sound copy stays where it was


def test_bit_flipped_local_copy_is_quarantined_locally_only(tmp_path: Path) -> None:
    local = jaxaot.DirectoryCache(tmp_path / "local")
    remote = jaxaot.DirectoryCache(tmp_path / "remote")
    key, blob = make_blob()
    local.put(key, flip(blob))
    remote.put(key, blob)
    tiered = TieredCache(local, remote, check=verify_entry)
    assert tiered.get(key) == blob
    assert remote.get(key) == blob  # the sound remote copy was not quarantined
    assert local.get(key) == blob  # the local copy is the sound one again
    quarantined = list((tmp_path / "local" / "quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].read_bytes() == flip(blob)
    assert not (tmp_path / "remote" / "quarantine").exists()


def test_quarantine_acts_on_the_serving_tier_and_the_faster_ones() -> None:
    tiers = [jaxaot.MemoryCache() for _ in range(3)]
    key, blob = make_blob()
    tiers[1].put(key, blob)
    tiers[2].put(key, blob)
    tiered = TieredCache(*tiers, check=verify_entry)
    assert tiered.get(key) == blob  # served by tier 1, promoted to tier 0
    assert tiers[0].keys() == [key]
    tiered.quarantine(key)  # the reader could not use it
    assert tiers[0].keys() == [] and tiers[1].keys() == []
    assert tiers[2].keys() == [key]  # a tier that did not serve it keeps its copy


def test_an_entry_signed_with_another_key_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fast, slow = jaxaot.MemoryCache(), jaxaot.MemoryCache()
    monkeypatch.setenv(_entry.HMAC_ENV, "theirs")
    keys = []
    for i in range(3):
        key, theirs = make_blob(tag=i)
        fast.put(key, theirs)
        keys.append(key)
    monkeypatch.setenv(_entry.HMAC_ENV, "mine")
    key0, mine = make_blob(tag=0)
    slow.put(key0, mine)
    tiered = TieredCache(fast, slow, check=verify_entry)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    assert tiered.get(key0) == mine  # the sound copy this process can check
    assert tiered.get(keys[1]) is None and tiered.get(keys[2]) is None
    assert sorted(fast.keys()) == sorted(keys)  # nothing removed from the fast tier
    assert len(warnings_of(caplog)) == 1  # one per cause, not per entry
    assert "left alone" in warnings_of(caplog)[0]


def test_component_body_that_relies_on_the_cache_survives_a_damaged_local_copy(
    tmp_path: Path,
) -> None:
    shared = jaxaot.DirectoryCache(tmp_path / "shared")
    local = tmp_path / "local"
    x = jnp.arange(4.0)

    @jaxaot.component(key="tiered-damaged-local")
    def f1(x):
        return jnp.cos(x) * 3

    with jaxaot.using_cache(TieredCache(jaxaot.DirectoryCache(local), shared)):
        expected = f1(x)
        jaxaot.wait_for_writes()  # the executable entry is written in the background
    entries = [p for p in local.rglob("*") if p.is_file() and len(p.name) == 64]
    assert entries
    for p in entries:  # flip a bit in every local entry
        p.write_bytes(flip(p.read_bytes()))

    @jaxaot.component(key="tiered-damaged-local")
    def f2(x):
        raise NotImplementedError("this body relies on the cache")

    with jaxaot.using_cache(TieredCache(jaxaot.DirectoryCache(local), shared)):
        assert jnp.allclose(f2(x), expected)
        jaxaot.wait_for_writes()
    assert sorted(shared.keys()) == sorted(p.name for p in entries)  # shared copies all kept


def test_put_writes_every_tier_and_delete_keys_clear() -> None:
    tiers = [jaxaot.MemoryCache(), jaxaot.MemoryCache()]
    tiered = TieredCache(*tiers, check=verify_entry)
    k1, b1 = make_blob(tag=1)
    k2, b2 = make_blob(tag=2)
    tiered.put(k1, b1)
    tiers[1].put(k2, b2)
    assert all(t.get(k1) == b1 for t in tiers)
    assert tiered.keys() == sorted([k1, k2])
    assert tiered.delete(k1) is True and tiered.delete(k1) is False
    assert all(t.keys() in ([], [k2]) for t in tiers)
    tiered.clear()
    assert all(t.keys() == [] for t in tiers)


def test_a_raising_tier_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    bad, good = Exploding(), jaxaot.MemoryCache()
    tiered = TieredCache(bad, good, check=verify_entry)  # type: ignore[arg-type]
    key, blob = make_blob()
    for _ in range(3):
        tiered.put(key, blob)
    assert good.get(key) == blob
    assert tiered.get(key) == blob
    assert tiered.keys() == [key]
    assert tiered.delete(key) is True
    tiered.clear()
    stats = tiered.stats()
    assert "error" in stats["tiers"][0] and stats["tiers"][1]["backend"] == "memory"
    # One warning per cause (operation and tier), not per call.
    put_warnings = [m for m in warnings_of(caplog) if m.startswith("jaxaot tiered cache: put")]
    assert len(put_warnings) == 1


def test_components_through_a_tiered_cache() -> None:
    shared = jaxaot.MemoryCache()

    def make() -> Any:
        @jaxaot.component(key="tiered-e2e")
        def f(x):
            return jnp.sin(x) * 2

        return f

    x = jnp.arange(4.0)
    f1 = make()
    with jaxaot.using_cache(TieredCache(jaxaot.MemoryCache(), shared)):
        expected = f1(x)
    assert f1.cache_info().traces == 1 and len(shared.keys()) == 2  # entry + executable

    @jaxaot.component(key="tiered-e2e")
    def f2(x):
        raise AssertionError("traced although the shared tier holds the entry")

    local = jaxaot.MemoryCache()
    with jaxaot.using_cache(TieredCache(local, shared)):
        assert jnp.allclose(f2(x), expected)
    assert f2.cache_info().traces == 0
    assert local.keys() and set(local.keys()) <= set(shared.keys())  # what was read, promoted


def test_verify_entry_checks_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "one")
    key, signed = make_blob()
    verify_entry(key, signed)
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "two")
    with pytest.raises(_entry.EntryError, match="signature"):
        verify_entry(key, signed)


def test_constructor_checks() -> None:
    with pytest.raises(ValueError):
        TieredCache()
    with pytest.raises(TypeError, match="tier 1"):
        TieredCache(jaxaot.MemoryCache(), object())  # type: ignore[arg-type]
    assert isinstance(TieredCache(jaxaot.MemoryCache()), jaxaot.Cache)


# -- JAXAOT_CACHE URLs -------------------------------------------------------------


def test_env_url_gives_local_directory_in_front_of_the_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from jaxaot._caches._fsspec import FsspecCache
    from jaxaot._caches._redis import RedisCache

    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("JAXAOT_CACHE", "redis://127.0.0.1:1/0")  # never contacted here
    cache = _active._default_from_env()
    assert isinstance(cache, TieredCache)
    assert isinstance(cache.tiers[0], jaxaot.DirectoryCache)
    assert isinstance(cache.tiers[1], RedisCache)
    for url in (f"file://{tmp_path}/shared", "memory://jaxaot-env-test"):
        monkeypatch.setenv("JAXAOT_CACHE", url)
        cache = _active._default_from_env()
        assert isinstance(cache, TieredCache) and isinstance(cache.tiers[1], FsspecCache)
    monkeypatch.setenv("JAXAOT_CACHE", "nosuchprotocol://x")
    with pytest.raises(ValueError, match="JAXAOT_CACHE"):
        _active._default_from_env()


def test_env_url_with_unusable_directory_uses_memory_locally(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(tmp_path / "file" / "sub"))
    monkeypatch.setenv("JAXAOT_CACHE", "memory://jaxaot-env-test2")
    caplog.set_level(logging.WARNING, logger="jaxaot")
    cache = _active._default_from_env()
    assert isinstance(cache, TieredCache) and isinstance(cache.tiers[0], jaxaot.MemoryCache)
    assert len(warnings_of(caplog)) == 1


def test_a_tiered_cache_in_use_verifies_hits_without_being_given_a_check() -> None:
    """The store gives its entry check to the tiered cache it uses: a damaged copy
    in the fast tier gives way to the sound one, which is copied over it. Alone,
    without a check, a tiered cache returns the first copy it finds."""
    key, blob = make_blob()
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x02
    fast, slow = jaxaot.MemoryCache(), jaxaot.MemoryCache()
    fast.put(key, bytes(damaged))
    slow.put(key, blob)
    alone = TieredCache(fast, slow)
    assert alone.get(key) == bytes(damaged) and alone.check is None
    tiered = TieredCache(fast, slow)
    with jaxaot.using_cache(tiered):
        assert tiered.check is verify_entry
        assert tiered.get(key) == blob and fast.get(key) == blob
