"""RedisCache against real ``redis-server`` processes: the byte protocol, SCAN and
prefixes, TTL, racing writers, a server that stops, restarts, stalls or refuses
writes, tampered entries, the CLI and components end to end. Misbehaving servers
(a reply trickled a byte at a time, garbage, wrong reply types) are small socket
servers on loopback that the tests start and stop.

``redis-server`` must be installed (CI installs it); without it these tests fail.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import redis
from _helpers import make_blob

import jaxaot
from jaxaot import cli as _cli
from jaxaot._caches._redis import RedisCache
from jaxaot._caches._tiered import TieredCache
from jaxaot._store import _entry
from jaxaot._store._entry import check_stored as verify_entry

SIZES = [1, 1000, 1 << 20, 5 << 20]
HANG_GUARD_S = 10.0  # "returns within the timeout": a hang guard, not a performance test


# -- servers ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A private redis-server on 127.0.0.1: no persistence, KEYS disabled."""

    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: the Redis tests need a real server "
                "(apt-get install redis-server, or brew install redis)",
                pytrace=False,
            )
        self.binary = binary
        self.port = port or _free_port()
        self.workdir = tempfile.mkdtemp(prefix="jaxaot-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> Any:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10, **kwargs)

    def start(self) -> None:
        # --rename-command KEYS "": any use of KEYS by the cache fails loudly.
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
                "--rename-command",
                "KEYS",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited with status {self.proc.returncode}")
            try:
                if self.client(socket_connect_timeout=0.2).ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server on port {self.port} did not answer PING in 15 s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """One redis-server for the module; tests keep apart with unique prefixes."""
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def redis_url(server: RedisServer) -> str:
    return server.url


@pytest.fixture
def private_server() -> Iterator[RedisServer]:
    """A server of the test's own, to stop, restart, pause or make read-only."""
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


# -- entries ---------------------------------------------------------------------


UNSIGNED_WARNING = "is not set, so entries are only checksummed"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The fault warnings (the one-time "entries are not signed" warning left out)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "jaxaot"
        and r.levelno >= logging.WARNING
        and UNSIGNED_WARNING not in r.getMessage()
    ]


def make_component(key: str, *, raising: bool = False) -> Any:
    if raising:

        def body(x):
            raise AssertionError(f"{key}: traced although the cache holds the entry")
    else:

        def body(x):
            return jnp.tanh(x) * 3 + 1

    return jaxaot.component(body, key=key)


# -- the byte protocol -----------------------------------------------------------


def test_round_trip_identical_bytes(redis_url: str) -> None:
    cache = RedisCache(redis_url, prefix=unique_prefix())
    stored = {}
    for i, size in enumerate(SIZES):
        key = f"{i:02x}" * 16
        value = os.urandom(size)
        cache.put(key, value)
        stored[key] = value
    for key, value in stored.items():
        assert cache.get(key) == value
    assert cache.get("ee" * 16) is None
    cache.put(sorted(stored)[0], b"another value")  # SET NX: the first value stays
    assert cache.get(sorted(stored)[0]) == stored[sorted(stored)[0]]
    stats = cache.stats()
    assert stats["backend"] == "redis" and stats["entries"] == len(SIZES)
    assert stats["bytes"] == sum(SIZES)
    assert stats["hits"] == len(SIZES) + 1 and stats["misses"] == 1 and stats["puts"] == len(SIZES)
    with pytest.raises(ValueError):
        cache.get("NOT-A-KEY")
    assert isinstance(cache, jaxaot.Cache)


def test_scan_prefix_isolation_delete_clear(server: RedisServer) -> None:
    base = unique_prefix()
    a = RedisCache(server.url, prefix=base)
    b = RedisCache(server.url, prefix=base + "nested:")  # B's names start with A's prefix
    admin = server.client()
    n = 2500  # several SCAN rounds
    pipe = admin.pipeline(transaction=False)
    a_keys = []
    for i in range(n):
        key = f"{i:032x}"
        a_keys.append(key)
        pipe.set(base + key, b"v" * (i % 7 + 1))
    pipe.execute()
    b.put("ab" * 20, b"bee")
    admin.set(base + "README", b"not an entry")  # a foreign name under A's prefix
    admin.set("unrelated:" + "cd" * 16, b"x")
    with pytest.raises(redis.ResponseError):
        admin.execute_command("KEYS", "*")  # disabled on this server: the cache must SCAN
    assert a.keys() == sorted(a_keys)
    assert b.keys() == ["ab" * 20]
    assert a.stats()["entries"] == n
    assert a.stats()["bytes"] == sum(i % 7 + 1 for i in range(n))
    assert a.delete(a_keys[0]) is True and a.delete(a_keys[0]) is False
    assert b.delete(a_keys[1]) is False and a.get(a_keys[1]) == b"vv"
    a.clear()
    assert a.keys() == []
    assert b.get("ab" * 20) == b"bee"
    assert admin.get(base + "README") == b"not an entry"
    assert admin.get("unrelated:" + "cd" * 16) == b"x"
    b.clear()
    assert b.keys() == []
    admin.delete(base + "README", "unrelated:" + "cd" * 16)


def test_ttl_expiry(server: RedisServer) -> None:
    cache = RedisCache(server.url, prefix=unique_prefix(), ttl=0.4)
    key, blob = make_blob()
    cache.put(key, blob)
    ttl_ms = server.client().pttl(cache.prefix + key)
    assert 0 < ttl_ms <= 400
    assert cache.get(key) == blob
    time.sleep(0.6)
    assert cache.get(key) is None and cache.keys() == []
    forever = RedisCache(server.url, prefix=cache.prefix)
    forever.put(key, blob)
    assert server.client().pttl(cache.prefix + key) == -1
    forever.clear()
    with pytest.raises(ValueError):
        RedisCache(server.url, ttl=0)


WRITER = textwrap.dedent(
    """
    import sys
    from jaxaot._caches._redis import RedisCache

    url, prefix, blob_file, keys = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    blob = open(blob_file, "rb").read()
    cache = RedisCache(url, prefix=prefix, timeout=10)
    cache._client.ping()
    print("ready", flush=True)
    sys.stdin.readline()
    for key in keys:
        cache.put(key, blob)
    print(cache.stats()["puts"], flush=True)
    """
)


def test_two_processes_writing_one_key_leave_one_complete_entry(
    server: RedisServer, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    prefix = unique_prefix()
    key, _ = make_blob(name="race")
    # Two different sound entries for the same key (2 MiB each).
    blobs = []
    for writer in range(2):
        entry = _entry.decode(make_blob(name="race")[1])
        entry.stablehlo = os.urandom(2 << 20)
        entry.extra = {"writer": writer}
        blobs.append(_entry.encode(entry))
    keys = [key] + [f"{i:02x}" * 16 for i in range(15)]  # plain keys race too
    procs = []
    for i, blob in enumerate(blobs):
        (tmp_path / f"blob{i}").write_bytes(blob)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WRITER,
                    server.url,
                    prefix,
                    str(tmp_path / f"blob{i}"),
                    ",".join(keys),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=subprocess_env,
                text=True,
            )
        )
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]
    puts = [int(out.split()[-1]) for out, _ in results]
    assert sum(puts) == len(keys)  # every key was written by exactly one of them
    cache = RedisCache(server.url, prefix=prefix)
    for k in keys:
        assert cache.get(k) in blobs
    verify_entry(key, cache.get(key) or b"")
    cache.clear()


# -- faults ----------------------------------------------------------------------


def test_server_stopped_mid_run_then_restarted(
    private_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = private_server.url
    prefix = unique_prefix()
    remote = RedisCache(url, prefix=prefix, timeout=1.0)
    x = jnp.arange(6.0)
    f = make_component("redis-stop")
    with jaxaot.using_cache(TieredCache(jaxaot.MemoryCache(), remote)):
        expected = f(x)
    assert remote.keys()

    private_server.stop()
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    for shape in (7, 8, 9):  # misses everywhere: computed locally, each call
        g = make_component("redis-stop")
        start = time.monotonic()
        with jaxaot.using_cache(TieredCache(jaxaot.MemoryCache(), remote)):
            y = g(jnp.arange(float(shape)))
        assert time.monotonic() - start < HANG_GUARD_S
        assert jnp.allclose(y, jnp.tanh(jnp.arange(float(shape))) * 3 + 1)
        assert g.cache_info().traces == 1
    warnings = warnings_of(caplog)
    assert len(warnings) == 1, warnings
    assert "ConnectionError" in warnings[0] and "127.0.0.1" in warnings[0]
    assert remote.get(make_blob()[0]) is None and remote.keys() == []

    private_server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + HANG_GUARD_S
    probe, probe_blob = make_blob(name="probe")
    while remote.get(probe) is None:  # the back-off (1 s) ends, then puts and hits resume
        remote.put(probe, probe_blob)
        assert time.monotonic() < deadline, "hits did not resume after the restart"
        time.sleep(0.1)
    h = make_component("redis-stop")
    with jaxaot.using_cache(TieredCache(jaxaot.MemoryCache(), remote)):
        h(x)  # stores the entries again
    served = make_component("redis-stop", raising=True)
    with jaxaot.using_cache(TieredCache(jaxaot.MemoryCache(), remote)):
        assert jnp.allclose(served(x), expected)
    assert served.cache_info().traces == 0
    # The one connection warning; the raising body is other code than the one that
    # made the entry under its explicit key, which jaxaot also warns about (once).
    others = [w for w in warnings_of(caplog) if "made by code that differs" not in w]
    assert len(others) == 1, others


def test_slow_server_times_out(
    private_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    remote = RedisCache(private_server.url, prefix=unique_prefix(), timeout=0.5)
    key, blob = make_blob()
    remote.put(key, blob)
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    # The server answers nothing for 3 s (redis 7.0 cannot be unpaused early).
    paused_at = time.monotonic()
    private_server.client().execute_command("CLIENT", "PAUSE", 3000, "ALL")
    start = time.monotonic()
    assert remote.get(key) is None
    assert time.monotonic() - start < 2.0  # the 0.5 s timeout, not the 3 s stall
    f = make_component("redis-slow")
    start = time.monotonic()
    with jaxaot.using_cache(TieredCache(jaxaot.MemoryCache(), remote)):
        y = f(jnp.arange(5.0))
    assert time.monotonic() - start < HANG_GUARD_S
    assert f.cache_info().traces == 1 and y.shape == (5,)
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and "TimeoutError" in warnings[0], warnings
    time.sleep(max(0.0, paused_at + 3.0 + remote.backoff - time.monotonic()) + 0.1)
    assert remote.get(key) == blob  # the server answers again: hits resume
    # Then it goes: refused connections are the same outage, not a second warning.
    private_server.stop()
    assert remote.get(key) is None
    assert warnings_of(caplog) == warnings


def test_refused_writes_warn_once_and_the_program_goes_on(
    private_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    remote = RedisCache(private_server.url, prefix=unique_prefix())
    admin = private_server.client()
    key, blob = make_blob()
    remote.put(key, blob)
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        for tag in range(3):
            k, b = make_blob(tag=tag + 1)
            remote.put(k, b)  # OOM: skipped
            assert remote.get(k) is None
        assert remote.get(key) == blob  # reads still work: no back-off for refusals
        f = make_component("redis-oom")
        with jaxaot.using_cache(TieredCache(jaxaot.MemoryCache(), remote)):
            assert f(jnp.arange(3.0)).shape == (3,)
    finally:
        admin.config_set("maxmemory", 0)
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and "OutOfMemoryError" in warnings[0], warnings
    # Said once, by whichever call met it first: what it means for all of them.
    assert "every later call that fails so" in warnings[0] and "not shared" in warnings[0]

    admin.execute_command("REPLICAOF", "127.0.0.1", "1")  # a replica: read-only
    try:
        for tag in range(3):
            remote.put(*make_blob(tag=10 + tag))
        assert remote.get(key) == blob
    finally:
        admin.execute_command("REPLICAOF", "NO", "ONE")
    warnings = warnings_of(caplog)
    assert len(warnings) == 2 and "ReadOnlyError" in warnings[1], warnings
    k, b = make_blob(tag=99)
    remote.put(k, b)
    assert remote.get(k) == b


def test_a_value_of_another_type_under_an_entry_name_is_replaced(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A list where an entry belongs (``WRONGTYPE`` to a GET) is no entry: a miss,
    said once, and removed, so that the entry made next is stored (``SET NX``
    would skip it forever) and read back."""
    prefix = unique_prefix()
    remote = RedisCache(server.url, prefix=prefix)
    key, blob = make_blob(tag=7)
    server.client().rpush(prefix + key, b"not an entry")
    caplog.set_level(logging.WARNING, logger="jaxaot")
    assert remote.get(key) is None
    remote.put(key, blob)
    assert remote.get(key) == blob
    said = warnings_of(caplog)
    assert len(said) == 1 and "WRONGTYPE" in said[0], said


def test_unreachable_server_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    cache = RedisCache(f"redis://127.0.0.1:{_free_port()}/0", timeout=0.5, backoff=0)
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    key, blob = make_blob()
    lost = jaxaot.stats()["cache_write_errors"]
    cache.put(key, blob)
    assert cache.get(key) is None and cache.keys() == [] and cache.delete(key) is False
    cache.clear()
    stats = cache.stats()
    assert stats["entries"] is None and stats["errors"] == 6
    assert len(warnings_of(caplog)) == 1
    # Counted for the process too (jaxaot precompile fails on it).
    assert jaxaot.stats()["cache_write_errors"] - lost == 1  # the put: its value is not stored


def test_an_outage_is_said_once_for_every_cache_of_one_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One warning per cause for a store, not per cache object: a program that makes
    several caches of one URL (a tiered cache per component, a script run twice in
    a notebook) hears of its outage once; another server is another cause."""
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    url, other = (f"redis://127.0.0.1:{_free_port()}/0" for _ in range(2))
    key, _ = make_blob()
    for _ in range(3):
        assert RedisCache(url, timeout=0.5, backoff=0).get(key) is None
    assert len(warnings_of(caplog)) == 1
    assert RedisCache(other, timeout=0.5, backoff=0).get(key) is None
    assert len(warnings_of(caplog)) == 2


# -- trust -----------------------------------------------------------------------


def test_tampered_remote_entry_is_refused_and_not_promoted(server: RedisServer) -> None:
    remote = RedisCache(server.url, prefix=unique_prefix())
    admin = server.client()
    key, blob = make_blob()
    remote.put(key, blob)
    at = len(blob) // 2
    admin.setrange(remote.prefix + key, at, bytes([blob[at] ^ 0x01]))
    local = jaxaot.MemoryCache()
    assert TieredCache(local, remote, check=verify_entry).get(key) is None
    assert local.keys() == []
    assert admin.exists(remote.prefix + key) == 0  # removed from the remote tier
    remote.put(key, blob)
    assert (
        TieredCache(local, remote, check=verify_entry).get(key) == blob and local.get(key) == blob
    )


def test_entry_signed_with_another_key_is_refused(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = RedisCache(server.url, prefix=unique_prefix())
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "someone-else")
    key, foreign = make_blob()
    remote.put(key, foreign)
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "our-secret")
    local = jaxaot.MemoryCache()
    assert TieredCache(local, remote, check=verify_entry).get(key) is None
    # A miss for this process, left alone: it is sound for the processes with that key.
    assert local.keys() == [] and remote.keys() == [key]
    TieredCache(local, remote, check=verify_entry).quarantine(key)
    assert remote.keys() == [key]
    remote.delete(key)
    _, ours = make_blob()
    remote.put(key, ours)
    assert TieredCache(local, remote, check=verify_entry).get(key) == ours


def test_damaged_local_copy_leaves_the_redis_copy(server: RedisServer, tmp_path: Path) -> None:
    remote = RedisCache(server.url, prefix=unique_prefix())
    local = jaxaot.DirectoryCache(tmp_path / "local")
    key, blob = make_blob()
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x04
    local.put(key, bytes(damaged))
    remote.put(key, blob)
    tiered = TieredCache(local, remote, check=verify_entry)
    assert tiered.get(key) == blob
    assert remote.get(key) == blob and local.get(key) == blob


# -- end to end ------------------------------------------------------------------


def test_components_served_from_redis(redis_url: str) -> None:
    prefix = unique_prefix()
    x = {"a": jnp.arange(4.0)}

    @jaxaot.component(key="redis-e2e")
    def f(tree):
        return jnp.sum(jnp.sin(tree["a"])) * 2

    with jaxaot.using_cache(
        TieredCache(jaxaot.MemoryCache(), RedisCache(redis_url, prefix=prefix))
    ):
        expected = f(x)
        grad = jax.grad(f)(x)
    assert f.cache_info().traces >= 1

    @jaxaot.component(key="redis-e2e")
    def g(tree):
        raise AssertionError("traced although Redis holds the entries")

    local = jaxaot.MemoryCache()
    with jaxaot.using_cache(TieredCache(local, RedisCache(redis_url, prefix=prefix))):
        assert jnp.allclose(g(x), expected)
        assert jnp.allclose(jax.grad(g)(x)["a"], grad["a"])
    assert g.cache_info().traces == 0 and g.cache_info().hits > 0
    assert local.keys()  # promoted into the fresh local tier
    RedisCache(redis_url, prefix=prefix).clear()


def test_cli_on_a_redis_url(server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{server.port}/5"  # the CLI uses the default prefix
    cache = RedisCache(url)
    cache.clear()
    key, blob = make_blob(name="cli_listed")
    bad_key, bad_blob = make_blob(name="cli_bad", tag=1)
    cache.put(key, blob)
    cache.put(bad_key, bad_blob[:-1] + bytes([bad_blob[-1] ^ 1]))
    assert _cli.main(["cache", "ls", "--url", url, "--json"]) == 0
    rows = {r["digest"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[key]["name"] == "cli_listed" and rows[key]["ok"]
    assert rows[key]["last_used"] is None and not rows[bad_key]["ok"]
    assert _cli.main(["cache", "ls", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "cli_listed" in out and key[:12] in out
    assert _cli.main(["cache", "stats", "--url", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 2 and stats["backend"] == "redis" and stats["ttl"] is None
    assert _cli.main(["cache", "stats", "--url", url]) == 0
    fields = {line[:14].strip(): line[14:].strip() for line in capsys.readouterr().out.splitlines()}
    assert fields["ttl"] == "none (entries never expire)" and fields["entries"] == "2", fields
    assert "null" not in fields.values(), fields
    assert _cli.main(["cache", "info", key[:10], "--url", url]) == 0
    assert "cli_listed" in capsys.readouterr().out
    assert _cli.main(["cache", "verify", "--url", url, "--fix"]) == 0
    assert "1 ok, 1 bad, 1 removed" in capsys.readouterr().out
    assert cache.keys() == [key]
    assert _cli.main(["cache", "clear", "--yes", "--url", url]) == 0
    capsys.readouterr()
    assert cache.keys() == []
    dead = f"redis://:hunter2@127.0.0.1:{_free_port()}/0"
    assert _cli.main(["cache", "ls", "--url", dead]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxaot: error: cannot reach") and "hunter2" not in err


def test_a_server_that_wants_a_password_says_how_to_give_it(
    server: RedisServer, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A server with a password, reached without one or with the wrong one: the
    program computes locally with one warning that says what to put in the URL (not
    the protocol's words), and the CLI says it in one line; the password never shows."""
    server.client().config_set("requirepass", "s3cret-pw")
    try:
        caplog.set_level(logging.WARNING, logger="jaxaot")
        for url, said in [
            (f"redis://127.0.0.1:{server.port}/0", "needs a password: give it in the URL"),
            (f"redis://:wrong-pw@127.0.0.1:{server.port}/0", "refused the user or password"),
        ]:
            caplog.clear()
            cache = RedisCache(url)
            assert cache.get("ab" * 16) is None
            warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            warnings = [w for w in warnings if "HMAC_KEY" not in w]
            assert len(warnings) == 1 and said in warnings[0], warnings
            assert "HELLO" not in warnings[0] and "wrong-pw" not in warnings[0]
            assert _cli.main(["cache", "ls", "--url", url]) == 1
            err = capsys.readouterr().err
            assert err.startswith("jaxaot: error: cannot reach") and said in err, err
            assert len(err.splitlines()) == 1 and "wrong-pw" not in err
        good = RedisCache(f"redis://:s3cret-pw@127.0.0.1:{server.port}/0")
        key, blob = make_blob(name="behind_a_password")
        good.put(key, blob)
        assert good.get(key) == blob
        good.delete(key)
    finally:
        server.client(password="s3cret-pw").config_set("requirepass", "")


def test_password_is_redacted_and_missing_package_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = RedisCache("redis://user:s3cret@127.0.0.1:1/2")
    assert "s3cret" not in repr(cache) and "s3cret" not in cache.url
    assert cache.url == "redis://user:***@127.0.0.1:1/2"
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxaot\[redis\]'"):
        RedisCache("redis://127.0.0.1:1/0")


# -- misbehaving servers -------------------------------------------------------------


def _complete_commands(buf: bytes) -> tuple[int, bytes]:
    """How many whole RESP commands ``buf`` starts with, and what follows them."""
    count = 0
    while buf.startswith(b"*"):
        end = buf.find(b"\r\n")
        if end < 0:
            break
        pos, argc, whole = end + 2, int(buf[1:end]), True
        for _ in range(argc):
            e = buf.find(b"\r\n", pos)
            if e < 0:
                whole = False
                break
            pos = e + 2 + int(buf[pos + 1 : e]) + 2
            if pos > len(buf):
                whole = False
                break
        if not whole:
            break
        buf, count = buf[pos:], count + 1
    return count, buf


class FakeServer:
    """A TCP server on 127.0.0.1 that answers every command with ``reply``, one byte
    every ``delay`` seconds when ``delay`` is set."""

    def __init__(self, reply: bytes, delay: float = 0.0) -> None:
        self.reply, self.delay = reply, delay
        self.stopped = threading.Event()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.port = int(self.sock.getsockname()[1])
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def url(self, query: str = "") -> str:
        return f"redis://127.0.0.1:{self.port}/0{query}"

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        buf = b""
        with conn:
            while not self.stopped.is_set():
                try:
                    data = conn.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                n, buf = _complete_commands(buf + data)
                try:
                    for _ in range(n):
                        if not self.delay:
                            conn.sendall(self.reply)
                            continue
                        for i in range(len(self.reply)):
                            if self.stopped.wait(self.delay):
                                return
                            conn.sendall(self.reply[i : i + 1])
                except OSError:
                    return

    def close(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=5)
        self.sock.close()


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeServer]:
    reply, delay = request.param
    srv = FakeServer(reply, delay)
    try:
        yield srv
    finally:
        srv.close()


@pytest.mark.parametrize("fake_server", [(b"$20\r\n" + b"x" * 20 + b"\r\n", 0.1)], indirect=True)
def test_a_trickled_reply_is_cut_off_at_the_deadline(
    fake_server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Each byte comes well within the socket timeout, the whole reply (about 2.6 s)
    does not come within the call's 1 s: the get is a miss, not the trickled value."""
    cache = RedisCache(fake_server.url(), prefix=unique_prefix(), timeout=1.0, backoff=0)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    key, _ = make_blob()
    start = time.monotonic()
    assert cache.get(key) is None
    assert time.monotonic() - start < HANG_GUARD_S
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and "TimeoutError" in warnings[0], warnings
    assert cache.stats()["misses"] == 1


def _causes(warnings: list[str]) -> list[str]:
    return [w.split(" failed (", 1)[1].split(":", 1)[0] for w in warnings]


@pytest.mark.parametrize(
    "fake_server, query",
    [
        ((b"$abc\r\n", 0.0), ""),  # an unparsable length: ValueError in the client
        ((b"+OK\r\n", 0.0), "?protocol=3"),  # +OK to HELLO: AttributeError in the client
        ((b":5\r\n", 0.0), ""),  # an integer where a string (or a list) is due
        ((b"*1\r\n$3\r\nabc\r\n", 0.0), ""),  # a list where a string is due
    ],
    indirect=["fake_server"],
    ids=["garbage", "ok-to-hello", "integer", "list"],
)
def test_broken_replies_are_misses_and_skipped_writes(
    fake_server: FakeServer, query: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = RedisCache(fake_server.url(query), prefix=unique_prefix(), timeout=2.0, backoff=0)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    key, blob = make_blob()
    for _ in range(3):
        assert cache.get(key) is None
        cache.put(key, blob)
        assert cache.delete(key) in (False, True)
        assert cache.keys() == []
        cache.clear()
        stats = cache.stats()
        assert stats["entries"] is None and stats["bytes"] is None
        cache.quarantine(key)
    assert cache.stats()["hits"] == 0
    warnings = warnings_of(caplog)
    causes = _causes(warnings)
    assert warnings and len(causes) == len(set(causes)), warnings  # one warning per cause


def test_credentials_never_show(caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://:hunter2@127.0.0.1:{_free_port()}/0?password=hunter3&socket_timeout=1"
    cache = RedisCache(url, prefix=unique_prefix(), timeout=0.5)
    caplog.set_level(logging.DEBUG, logger="jaxaot")
    cache.get(make_blob()[0])
    cache.put(*make_blob())
    shown = [repr(cache), cache.url, json.dumps(cache.stats())]
    shown += [r.getMessage() for r in caplog.records]
    with pytest.raises(ConnectionError) as info:
        cache.ping()
    shown.append(str(info.value))
    bad_urls = ["redis://:hunter2@127.0.0.1:notaport/0", "redis://:hunter2@[::1/0"]
    bad_urls.append("redis://:hunter2@127.0.0.1:1/0?socket_timeout=hunter2")
    for bad in bad_urls:
        with pytest.raises(ValueError) as bad_info:
            RedisCache(bad)
        shown.append(str(bad_info.value))
    assert all("hunter2" not in text and "hunter3" not in text for text in shown), shown
    assert "***" in cache.url


def test_unsigned_remote_store_warns_once_per_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jaxaot")
    url = f"redis://127.0.0.1:{_free_port()}/0"
    for _ in range(3):
        RedisCache(url)
    loud = [r for r in caplog.records if UNSIGNED_WARNING in r.getMessage()]
    assert len(loud) == 1 and "JAXAOT_CACHE_HMAC_KEY" in loud[0].getMessage()
    caplog.clear()
    monkeypatch.setenv(_entry.HMAC_ENV, "a-secret")
    RedisCache(f"redis://127.0.0.1:{_free_port()}/0")
    assert not [r for r in caplog.records if UNSIGNED_WARNING in r.getMessage()]
    monkeypatch.setenv(_entry.HMAC_ENV, "  ")
    with pytest.raises(ValueError, match="set but empty"):
        RedisCache(url)


def test_stats_say_when_the_server_evicts_entries_near_its_maxmemory(
    private_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server at its ``maxmemory`` drops entries silently (LRU): ``cache stats``
    gives its memory and evictions, and says what that does to the cache."""
    url = f"{private_server.url.rsplit('/', 1)[0]}/0"
    client = private_server.client()
    assert _cli.main(["cache", "stats", "--url", url, "--json"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["server_max_bytes"] is None and roomy["server_used_bytes"] > 0
    assert _cli.main(["cache", "stats", "--url", url]) == 0
    assert "warning" not in capsys.readouterr().out
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + 400_000))
    cache = RedisCache(url)
    for i in range(40):  # 40 entries of 64 KB into about 400 KB
        cache.put(*make_blob(name=f"big{i}", payload=os.urandom(65536)))
    assert _cli.main(["cache", "stats", "--url", url, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["evicted_keys"] > 0 and full["eviction_policy"] == "allkeys-lru", full
    assert full["entries"] < 40
    assert _cli.main(["cache", "stats", "--url", url]) == 0
    fields = {line[:14].strip(): line[14:].strip() for line in capsys.readouterr().out.splitlines()}
    assert "evicts keys (allkeys-lru" in fields["warning"], fields
    assert "raise maxmemory" in fields["warning"], fields
