"""Choosing the active cache: set_cache, using_cache, environment variables."""

from __future__ import annotations

import threading
from pathlib import Path

import jax.numpy as jnp
import pytest

import jaxaot
from jaxaot._store import _active


def test_set_cache_none_disables_caching() -> None:
    jaxaot.set_cache(None)
    assert jaxaot.get_cache() is None
    first = jaxaot.component(lambda x: x + 1, key="nocache")
    first(jnp.ones(2))
    second = jaxaot.component(lambda x: x + 2, key="nocache")
    assert float(second(jnp.ones(2))[0]) == 3.0  # nothing shared: its own body ran


def test_using_cache_is_scoped_and_thread_local(fresh_cache: jaxaot.MemoryCache) -> None:
    other = jaxaot.MemoryCache()
    seen: dict[str, object] = {}
    inside = threading.Event()
    release = threading.Event()

    def in_thread() -> None:
        inside.wait()
        seen["thread"] = jaxaot.get_cache()
        release.set()

    t = threading.Thread(target=in_thread)
    t.start()
    with jaxaot.using_cache(other):
        assert jaxaot.get_cache() is other
        jaxaot.component(lambda x: x * 5, key="scoped")(jnp.ones(2))
        inside.set()
        release.wait()
    t.join()
    assert seen["thread"] is fresh_cache
    assert jaxaot.get_cache() is fresh_cache
    assert len(other.keys()) == 2 and fresh_cache.keys() == []  # lowered + executable
    with jaxaot.using_cache(None):
        assert jaxaot.get_cache() is None


def test_non_caches_are_refused() -> None:
    with pytest.raises(TypeError, match="set_cache"):
        jaxaot.set_cache({})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="using_cache"):
        with jaxaot.using_cache("dir"):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize("value, expected", [("off", type(None)), ("memory", jaxaot.MemoryCache)])
def test_default_from_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: type
) -> None:
    monkeypatch.setenv("JAXAOT_CACHE", value)
    assert isinstance(_active._default_from_env(), expected)


def test_bad_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXAOT_CACHE", "floppy")
    with pytest.raises(ValueError, match="JAXAOT_CACHE"):
        _active._default_from_env()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("123", 123),
        ("2G", 2 << 30),
        ("2g", 2 << 30),
        ("500M", 500 << 20),
        ("1.5GiB", 3 << 29),
        ("64kb", 64 << 10),
        (" 7 T ", 7 << 40),
        ("1P", 1 << 50),
        ("10B", 10),
    ],
)
def test_size_syntax(text: str, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _active.parse_size(text) == expected
    monkeypatch.setenv("JAXAOT_CACHE_MAX_BYTES", text)
    assert _active.default_max_bytes() == expected


@pytest.mark.parametrize("text", ["", "lots", "-1", "2X", "1e9", "G", "1.5", "10.0B"])
def test_bad_sizes(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        _active.parse_size(text)
    if text:
        monkeypatch.setenv("JAXAOT_CACHE_MAX_BYTES", text)
        with pytest.raises(ValueError, match="JAXAOT_CACHE_MAX_BYTES"):
            _active.default_max_bytes()


def test_max_bytes_with_a_unit_reaches_the_default_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("JAXAOT_CACHE", "dir")
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("JAXAOT_CACHE_MAX_BYTES", "3M")
    cache = _active._default_from_env()
    assert isinstance(cache, jaxaot.DirectoryCache) and cache.max_bytes == 3 << 20


@pytest.mark.parametrize("spelled", ["absolute", "home", "relative"])
def test_a_directory_path_names_the_cache_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, spelled: str
) -> None:
    """``JAXAOT_CACHE=/path/to/cache`` (as ``JAX_COMPILATION_CACHE_DIR`` is set) is a
    cache directory there, ahead of ``JAXAOT_CACHE_DIR``; entries go there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    value, where = {
        "absolute": (str(tmp_path / "c"), tmp_path / "c"),
        "home": ("~/c", tmp_path / "home" / "c"),
        "relative": ("./c", tmp_path / "c"),
    }[spelled]
    monkeypatch.setenv("JAXAOT_CACHE", value)
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(tmp_path / "other"))
    assert _active.cache_setting() == _active.CacheSetting("dir", path=str(where))
    cache = _active._default_from_env()
    assert isinstance(cache, jaxaot.DirectoryCache)
    jaxaot.set_cache(cache)
    jaxaot.component(lambda x: x * 3)(jnp.ones(2))
    jaxaot.wait_for_writes()
    assert len(cache.keys()) == 2  # lowered + executable
    assert any(p.is_file() for p in where.rglob("*")) and not (tmp_path / "other").exists()


def test_bad_cache_choice_lists_every_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXAOT_CACHE", "bogus")
    with pytest.raises(ValueError) as info:
        _active._default_from_env()
    text = str(info.value)
    for form in ("'dir'", "'memory'", "'off'", "redis://", "rediss://", "file:///", "fsspec"):
        assert form in text, form
    assert "'bogus'" in text


@pytest.mark.parametrize("url", ["file://", "file://relative/path", "file:///", "local://"])
def test_file_url_without_an_absolute_path_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("JAXAOT_CACHE", url)
    with pytest.raises(ValueError, match="absolute"):
        _active._default_from_env()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written here


@pytest.mark.parametrize("value", ["", "   ", "\n"])
def test_empty_hmac_key_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", value)
    for choice in ("dir", "memory"):
        monkeypatch.setenv("JAXAOT_CACHE", choice)
        with pytest.raises(ValueError, match="JAXAOT_CACHE_HMAC_KEY is set but empty"):
            _active._default_from_env()
    with pytest.raises(ValueError, match="set but empty"):
        jaxaot.DirectoryCache(tmp_path / "d")


@pytest.mark.parametrize("name", ["JAXAOT_LEASE_WAIT", "JAXAOT_LEASE_TTL"])
def test_bad_lease_settings_fail_when_the_cache_is_made(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Lease settings are read at a process's first miss, which may come hours in:
    the default cache checks them when it is made (at the first call)."""
    monkeypatch.setenv("JAXAOT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(name, "abc")
    with pytest.raises(ValueError, match=f"{name} must be a non-negative number of seconds"):
        _active._default_from_env()
