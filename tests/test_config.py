"""Choosing the active cache: set_cache, using_cache, environment variables."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import pytest

import jaxaot
from jaxaot import _config


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
    assert isinstance(_config._default_from_env(), expected)


def test_bad_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXAOT_CACHE", "floppy")
    with pytest.raises(ValueError, match="JAXAOT_CACHE"):
        _config._default_from_env()
