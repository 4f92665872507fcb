"""One maker per entry across processes (issue #27): each backend's leases, the
store's use of them (``_store._once``), and fleets of real processes sharing a
directory cache or a real ``redis-server``: each entry made once, values equal
to ``jax.jit``'s, a holder killed with SIGKILL taken over, a wait past its
deadline made locally, Redis stopped mid-run.

The fleets are 3 processes (8 with ``JAXAOT_STRESS=full``); the workload is
``tests/_fleet_worker.py``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import make_blob
from test_redis import RedisServer

import jaxaot
from jaxaot import _stats
from jaxaot._caches import Held, Leasing, _lease
from jaxaot._caches._directory import DirectoryCache
from jaxaot._caches._fsspec import FsspecCache
from jaxaot._caches._redis import RedisCache
from jaxaot._caches._tiered import TieredCache
from jaxaot._store import _once

FULL = os.environ.get("JAXAOT_STRESS") == "full"
FLEET = 8 if FULL else 3
WORKER = str(Path(__file__).with_name("_fleet_worker.py"))
GUARD_S = 120.0  # a hang guard for child processes, not a timing assertion
KEY = "ab" * 16


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def private_server() -> Iterator[RedisServer]:
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


def _until(what: str, ready: Any, guard: float = 20.0) -> Any:
    """Polls ``ready()`` until it returns something true (a hang guard, not a timing)."""
    deadline = time.monotonic() + guard
    while True:
        got = ready()
        if got:
            return got
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


# -- each backend's leases -------------------------------------------------------------


def _lifecycle(cache: Any) -> Any:
    """Taken, held by it, renewed, released as done. Returns the released lease."""
    assert isinstance(cache, Leasing)
    lease = cache.lease(KEY, 30.0)
    assert lease is not None and not isinstance(lease, Held)
    assert str(os.getpid()) in lease.holder
    other = cache.lease(KEY, 30.0)
    assert other == Held(lease.holder, done=False)
    assert lease.renew()
    lease.release()
    assert cache.lease(KEY, 30.0) == Held(lease.holder, done=True)
    assert not lease.renew()
    return lease


def test_directory_lease_lifecycle_and_done_mark_expiry(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c")
    _lifecycle(cache)
    lease_file = cache.path_for(KEY).with_name(KEY + ".lease")
    assert lease_file.stat().st_mode & 0o777 == 0o600
    old = time.time() - _lease.DONE_SECONDS - 5
    os.utime(lease_file, (old, old))  # the "done" mark is stale: leased afresh
    again = cache.lease(KEY, 30.0)
    assert again is not None and not isinstance(again, Held)
    again.release()
    assert cache.keys() == []  # lease files are not entries


HOLDER = """
import sys, time
from jaxaot._caches._directory import DirectoryCache
lease = DirectoryCache(sys.argv[1]).lease(sys.argv[2], 30.0)
print(type(lease).__name__, flush=True)
time.sleep(600)
"""


def test_directory_lease_of_a_killed_holder_is_free_at_once(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    root = tmp_path / "c"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), KEY],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "FileLease"
        cache = DirectoryCache(root)
        held = cache.lease(KEY, 30.0)
        assert isinstance(held, Held) and not held.done
        assert f"pid {holder.pid}" in held.holder
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=GUARD_S)
        lease = cache.lease(KEY, 30.0)  # the OS dropped the lock with its holder
        assert lease is not None and not isinstance(lease, Held)
        lease.release()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_directory_lease_never_follows_a_symlink(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DirectoryCache(tmp_path / "c")
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    shard = cache.path_for(KEY).parent
    shard.mkdir(mode=0o700)
    (shard / (KEY + ".lease")).symlink_to(target)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    assert cache.lease(KEY, 30.0) is None
    assert cache.lease(KEY, 30.0) is None
    assert target.read_text() == "untouched"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "not a regular file" in warnings[0], warnings


def test_a_lease_name_hard_linked_to_another_file_is_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In a group's signed store any member can make names in a shard: a lease
    name made a hard link to a file of this user's would have had that file
    overwritten with a lease record, and made group-writable. It is refused."""
    monkeypatch.setenv("JAXAOT_CACHE_HMAC_KEY", "team-secret")
    store = tmp_path / "team"
    store.mkdir()
    store.chmod(0o2770)
    cache = jaxaot.FsspecCache(f"file://{store}")
    key, blob = make_blob("ours")
    cache.put(key, blob)
    private = tmp_path / "private"
    private.write_text("mine alone")
    private.chmod(0o600)
    os.link(private, store / key[:2] / (key + ".lease"))
    caplog.set_level(logging.WARNING, logger="jaxaot")
    assert cache.lease(key, 30.0) is None
    assert private.read_text() == "mine alone" and private.stat().st_mode & 0o777 == 0o600
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "not a regular file" in warnings[0], warnings
    assert cache.get(key) == blob


def test_old_lease_files_are_cleaned_up_with_temp_files(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "c")
    stale_key, fresh_key = "cd" * 16, "ce" * 16
    for key in (stale_key, fresh_key):
        lease = cache.lease(key, 30.0)
        assert lease is not None and not isinstance(lease, Held)
        lease.release()
    stale = cache.path_for(stale_key).with_name(stale_key + ".lease")
    fresh = cache.path_for(fresh_key).with_name(fresh_key + ".lease")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    key, blob = make_blob()
    cache.put(key, blob)  # eviction's scan removes old temp and lease files
    assert not stale.exists() and fresh.exists()
    assert cache.get(key) == blob


def test_an_old_lease_file_still_locked_by_its_holder_is_not_cleaned_up(tmp_path: Path) -> None:
    # A file lease is never renewed (no heartbeat): clean-up must tell a held one
    # by its lock, not by its age.
    cache = DirectoryCache(tmp_path / "c")
    held_key = "cf" * 16
    lease = cache.lease(held_key, 30.0)
    assert lease is not None and not isinstance(lease, Held)
    assert getattr(lease, "expires", True) is False
    path = cache.path_for(held_key).with_name(held_key + ".lease")
    old = time.time() - 2 * 3600
    os.utime(path, (old, old))
    key, blob = make_blob()
    cache.put(key, blob)  # eviction's scan
    assert path.exists()
    assert isinstance(cache.lease(held_key, 30.0), Held)  # still ours
    lease.release()
    os.utime(path, (old, old))
    cache.put(*make_blob(tag=1))  # another entry: another scan
    assert not path.exists()


def test_making_entries_in_a_directory_cache_starts_no_lease_thread(tmp_path: Path) -> None:
    # A private cache's misses take lock-file leases, which need no renewal.
    code = """
import threading, sys
import jax.numpy as jnp
import jaxaot
jaxaot.set_cache(jaxaot.DirectoryCache(sys.argv[1]))
@jaxaot.component
def f(x):
    return jnp.tanh(x) * 2
f(jnp.ones(3)).block_until_ready()
s = jaxaot.stats()
assert s["made_here"] >= 2, s
names = [t.name for t in threading.enumerate()]
print("lease threads:", [n for n in names if "lease" in n])
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAXAOT_LEASE_WAIT": "300"},
    )
    assert out.returncode == 0, out.stderr
    assert "lease threads: []" in out.stdout, out.stdout
    assert list((tmp_path / "c").glob("*/*.lease")), "no lease was taken"


def test_redis_lease_lifecycle_expiry_and_stale_holders(server: RedisServer) -> None:
    cache = RedisCache(server.url, prefix=_prefix())
    _lifecycle(cache)
    assert cache.keys() == []  # lease names are not entries
    other = _prefix()
    first = RedisCache(server.url, prefix=other).lease(KEY, 0.2)
    assert first is not None and not isinstance(first, Held)
    second = RedisCache(server.url, prefix=other)
    assert isinstance(second.lease(KEY, 30.0), Held)
    # Not renewed: it expires, and another process takes it.
    taken = _until("the lease to expire", lambda: _leased(second))
    assert not first.renew()  # the first holder's token is no longer there
    first.release()  # and its release leaves the new holder's lease alone
    assert taken.renew()
    assert isinstance(second.lease(KEY, 30.0), Held)
    taken.release()


def _leased(cache: Any) -> Any:
    got = cache.lease(KEY, 30.0)
    return None if got is None or isinstance(got, Held) else got


def test_redis_lease_on_a_server_that_is_down_is_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from test_redis import _free_port

    cache = RedisCache(f"redis://127.0.0.1:{_free_port()}/0", timeout=0.5)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    assert cache.lease(KEY, 30.0) is None
    assert cache.lease(KEY, 30.0) is None
    faults = [r.getMessage() for r in caplog.records if "ConnectionError" in r.getMessage()]
    assert len(faults) == 1, faults


def test_fsspec_object_lease_lifecycle_and_expiry() -> None:
    pytest.importorskip("fsspec")
    url = f"memory://leases-{uuid.uuid4().hex}"
    cache = FsspecCache(url)
    _lifecycle(cache)
    assert cache.keys() == []
    assert cache.fs.exists(f"{cache._root}/.leases/{KEY}.lease")
    other = "ef" * 16
    first = cache.lease(other, 0.2)
    assert first is not None and not isinstance(first, Held)
    assert isinstance(cache.lease(other, 30.0), Held)
    taken = _until("the lease object to expire", lambda: _leased_key(cache, other))
    assert not first.renew()
    first.release()
    assert taken.renew()
    taken.release()
    assert cache.lease(other, 30.0) == Held(taken.holder, done=True)


def _leased_key(cache: Any, key: str) -> Any:
    got = cache.lease(key, 30.0)
    return None if got is None or isinstance(got, Held) else got


def test_fsspec_local_path_uses_lock_files(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    cache = FsspecCache(f"file://{tmp_path / 'store'}")
    lease = _lifecycle(cache)
    assert type(lease).__name__ == "FileLease"
    assert (tmp_path / "store" / KEY[:2] / (KEY + ".lease")).is_file()


def test_tiered_cache_leases_in_its_slowest_leasing_tier(tmp_path: Path) -> None:
    local, shared = DirectoryCache(tmp_path / "local"), DirectoryCache(tmp_path / "shared")
    tiered = TieredCache(jaxaot.MemoryCache(), local, shared)
    lease = tiered.lease(KEY, 30.0)
    assert lease is not None and not isinstance(lease, Held)
    assert isinstance(shared.lease(KEY, 30.0), Held)
    mine = local.lease(KEY, 30.0)  # the local tier was not asked
    assert mine is not None and not isinstance(mine, Held)
    mine.release()
    lease.release()
    assert TieredCache(jaxaot.MemoryCache()).lease(KEY, 30.0) is None
    assert not isinstance(jaxaot.MemoryCache(), Leasing)


def test_tiered_cache_leases_in_its_directory_while_its_server_is_down(
    tmp_path: Path,
) -> None:
    """With the shared server down (it lends no lease), the processes that share
    the local directory still make each entry once: the directory's lease, held
    by one of them, is Held for the others (before, none had a lease, and each
    made every entry)."""
    from test_redis import _free_port

    def tiered() -> TieredCache:
        down = RedisCache(f"redis://127.0.0.1:{_free_port()}/0", timeout=0.5)
        return TieredCache(DirectoryCache(tmp_path / "local"), down)

    first = tiered().lease(KEY, 30.0)
    assert first is not None and not isinstance(first, Held)
    assert isinstance(tiered().lease(KEY, 30.0), Held)
    first.release()


# -- the store's use of leases (make_once) ------------------------------------------


class FakeLease:
    def __init__(self) -> None:
        self.key, self.holder = KEY, "me"
        self.renewals = 0
        self.released = threading.Event()

    def renew(self) -> bool:
        self.renewals += 1
        return True

    def release(self) -> None:
        self.released.set()


class FakeLeasing(jaxaot.MemoryCache):
    """A cache whose leases are scripted: each ``lease`` returns the next answer."""

    def __init__(self, *answers: Any) -> None:
        super().__init__()
        self.answers = list(answers)
        self.asked = 0

    def lease(self, key: str, ttl: float) -> Any:
        self.asked += 1
        answer = self.answers[min(self.asked, len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in _stats.stats().items()}


def test_taken_lease_makes_writes_then_releases() -> None:
    lease = FakeLease()
    order: list[str] = []
    before = _stats.stats()

    def store(value: int) -> None:
        order.append("stored")
        assert not lease.released.is_set()

    out = _once.make_once(FakeLeasing(lease), KEY, "entry", lambda: None, lambda: 7, store)
    assert out == _once.Outcome(7, made=True, waited=False)
    assert order == ["stored"] and lease.released.is_set()
    assert _delta(before)["made_here"] == 1


def test_entry_left_by_a_holder_that_died_after_writing_is_loaded_not_made() -> None:
    lease = FakeLease()
    loads = iter([None, 5])  # missing at the poll; there when the lease is ours
    cache = FakeLeasing(Held("host pid 1"), lease)
    out = _once.make_once(cache, KEY, "entry", lambda: next(loads), lambda: pytest.fail("made"))
    assert out == _once.Outcome(5, made=False, waited=True) and lease.released.is_set()


def test_entry_written_between_the_miss_and_the_lease_is_loaded() -> None:
    # Its maker released its lease as done: loaded, not made again.
    cache = FakeLeasing(Held("host pid 1", done=True))
    out = _once.make_once(cache, KEY, "entry", lambda: 6, lambda: pytest.fail("made"))
    assert out == _once.Outcome(6, made=False) and cache.asked == 1


def test_waiter_loads_the_entry_once_it_lands() -> None:
    loads = iter([None, None, 9])
    before = _stats.stats()
    cache = FakeLeasing(Held("host pid 1"))
    out = _once.make_once(cache, KEY, "entry", lambda: next(loads), lambda: pytest.fail("made"))
    assert out == _once.Outcome(9, made=False, waited=True)
    delta = _delta(before)
    assert delta["loaded_after_wait"] == 1 and delta["made_here"] == 0
    assert delta["wait_seconds"] > 0
    assert cache.asked == 3  # the lease is asked for again at each poll


def test_dead_holder_is_taken_over() -> None:
    lease = FakeLease()
    before = _stats.stats()
    cache = FakeLeasing(Held("host pid 1"), Held("host pid 1"), lease)
    out = _once.make_once(cache, KEY, "entry", lambda: None, lambda: 3)
    assert out == _once.Outcome(3, made=True, waited=True)
    assert _delta(before)["lease_takeovers"] == 1 and lease.released.is_set()


def test_a_takeover_after_a_long_wait_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder that died with a lease that expires (Redis, object stores) costs
    its waiters the lease's time to live: the first takeover says so, once."""
    clock = iter(range(0, 1000, 2))  # each look at the clock: 2 s later
    fake_time = type(
        "FakeTime", (), {"monotonic": staticmethod(lambda: next(clock)), "sleep": lambda *a: None}
    )
    monkeypatch.setattr(_once, "time", fake_time)
    caplog.set_level(logging.WARNING, logger="jaxaot")
    _stats.reset_warnings()
    for key in (KEY, "cd" * 16):
        cache = FakeLeasing(Held("host pid 1"), Held("host pid 1"), FakeLease())
        out = _once.make_once(cache, key, "entry", lambda: None, lambda: 3)
        assert out == _once.Outcome(3, made=True, waited=True)
    said = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(said) == 1 and "host pid 1" in said[0] and "JAXAOT_LEASE_TTL" in said[0], said


def test_holder_done_without_an_entry_lets_everyone_make_it_at_once() -> None:
    before = _stats.stats()
    cache = FakeLeasing(Held("host pid 1", done=True))
    out = _once.make_once(cache, KEY, "entry", lambda: None, lambda: 4)
    assert out.made and out.value == 4 and cache.asked == 1
    assert _delta(before)["lease_wait_timeouts"] == 0


def test_wait_past_its_deadline_makes_it_here_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("JAXAOT_LEASE_WAIT", "0.05")
    caplog.set_level(logging.WARNING, logger="jaxaot")
    before = _stats.stats()
    for _ in range(2):
        out = _once.make_once(
            FakeLeasing(Held("host pid 1")), KEY, "entry", lambda: None, lambda: 1
        )
        assert out.made
    assert _delta(before)["lease_wait_timeouts"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "JAXAOT_LEASE_WAIT" in warnings[0], warnings


def test_a_holder_that_outlasted_a_wait_is_not_waited_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stalled process holds an entry's lease and the leases of what it is made
    from: the waiter waits once, not once per level; other holders in that cache,
    the same holder in other caches, and the holder once seen done are waited for."""
    monkeypatch.setenv("JAXAOT_LEASE_WAIT", "0.2")
    cache = FakeLeasing(Held("host pid 1"))
    before = _stats.stats()
    started = time.monotonic()
    assert _once.make_once(cache, KEY, "entry", lambda: None, lambda: 1).made
    assert time.monotonic() - started >= 0.2
    asked = cache.asked
    inner = _once.make_once(cache, "cd" * 16, "inner entry", lambda: None, lambda: 2)
    assert inner == _once.Outcome(2, made=True, waited=False) and cache.asked == asked + 1
    assert _delta(before)["lease_wait_timeouts"] == 1
    # Another holder in the same cache, and the same holder in another cache: waited for.
    loads = iter([None, 8])
    cache.answers, cache.asked = [Held("host pid 2")], 0
    other = _once.make_once(cache, "ef" * 16, "entry", lambda: next(loads), lambda: 0)
    assert other == _once.Outcome(8, made=False, waited=True)
    loads = iter([None, 9])
    elsewhere = FakeLeasing(Held("host pid 1"))
    got = _once.make_once(elsewhere, KEY, "entry", lambda: next(loads), lambda: 0)
    assert got == _once.Outcome(9, made=False, waited=True)
    # Seen done with an entry, the holder works again: waited for.
    cache.answers, cache.asked = [Held("host pid 1", done=True)], 0
    assert _once.make_once(cache, "12" * 16, "entry", lambda: 5, lambda: 0).value == 5
    loads = iter([None, 6])
    cache.answers, cache.asked = [Held("host pid 1")], 0
    again = _once.make_once(cache, "34" * 16, "entry", lambda: next(loads), lambda: 0)
    assert again == _once.Outcome(6, made=False, waited=True)


def test_faulty_leases_and_leases_off_make_it_here(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jaxaot")
    for _ in range(2):
        out = _once.make_once(FakeLeasing(OSError("boom")), KEY, "entry", lambda: None, lambda: 2)
        assert out.made
    assert len([r for r in caplog.records if "boom" in r.getMessage()]) == 1
    assert _once.make_once(FakeLeasing(None), KEY, "entry", lambda: None, lambda: 2).made
    monkeypatch.setenv("JAXAOT_LEASE_WAIT", "0")
    off = FakeLeasing(Held("host pid 1"))
    assert _once.make_once(off, KEY, "entry", lambda: None, lambda: 2).made and off.asked == 0
    monkeypatch.setenv("JAXAOT_LEASE_WAIT", "soon")
    with pytest.raises(ValueError, match="JAXAOT_LEASE_WAIT"):
        _once.make_once(off, KEY, "entry", lambda: None, lambda: 2)


def test_lease_is_released_when_making_fails() -> None:
    lease = FakeLease()

    def boom() -> int:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        _once.make_once(FakeLeasing(lease), KEY, "entry", lambda: None, boom)
    assert lease.released.is_set()


def test_background_write_holds_the_lease_until_written_and_is_renewed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("JAXAOT_LEASE_TTL", "0.15")  # renewed every 0.05 s
    lease = FakeLease()
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    out = _once.make_once(
        FakeLeasing(lease), KEY, "entry", lambda: None, lambda: 1, lambda v: future
    )
    assert out.made and not lease.released.is_set()
    _until("two renewals", lambda: lease.renewals >= 2)
    future.set_result(None)
    assert lease.released.is_set()
    renewed = lease.renewals
    time.sleep(0.2)  # released leases are no longer renewed (a count, not a timing)
    assert lease.renewals <= renewed + 1


# -- fleets of real processes ----------------------------------------------------------


def _start(config: dict[str, Any], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env=env,
    )


def _results(procs: list[subprocess.Popen[str]], logs: list[Path]) -> list[dict[str, Any]]:
    rows = []
    try:
        for proc, log in zip(procs, logs, strict=True):
            out, _ = proc.communicate(timeout=GUARD_S)
            assert proc.returncode == 0, log.read_text()[-3000:]
            assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
            rows.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(row["ok"] for row in rows), rows
    return rows


def _fleet(
    cache: dict[str, Any], n: int, env: dict[str, str], tmp: Path, **more: Any
) -> tuple[list[subprocess.Popen[str]], list[Path]]:
    procs, logs = [], []
    for i in range(n):
        logs.append(tmp / f"worker{i}-{uuid.uuid4().hex[:6]}.log")
        procs.append(_start({"cache": cache, **more}, env, logs[-1]))
    return procs, logs


def _wait_until_waiting(logs: list[Path]) -> None:
    for log in logs:
        _until(f"{log.name} to wait for the holder", functools.partial(_says, log, "waiting for"))


def _says(log: Path, text: str) -> bool:
    return text in log.read_text()


def _together(cache: dict[str, Any], env: dict[str, str], tmp: Path) -> list[dict[str, Any]]:
    go = tmp / f"go-{uuid.uuid4().hex[:6]}"
    procs, logs = _fleet(cache, FLEET, env, tmp, go=str(go))
    for proc in procs:  # every one imported and built its model: start them together
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    go.touch()
    return _results(procs, logs)


def test_fleet_on_a_directory_makes_each_entry_once(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    root = tmp_path / "shared"
    rows = _together({"dir": str(root)}, subprocess_env, tmp_path)
    entries = DirectoryCache(root).keys()
    assert len(entries) >= 6  # lowered, derived, region, glue and top-level executables
    assert sum(r["made_here"] for r in rows) == len(entries), rows
    assert sum(r["lowerings"] + r["compiles"] for r in rows) <= len(entries), rows


def test_fleet_on_redis_makes_each_entry_once(
    server: RedisServer, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    prefix = _prefix()
    rows = _together({"redis": server.url, "prefix": prefix}, subprocess_env, tmp_path)
    entries = RedisCache(server.url, prefix=prefix).keys()
    assert len(entries) >= 6
    assert sum(r["made_here"] for r in rows) == len(entries), rows


@pytest.mark.parametrize("backend", ["directory", "redis"])
def test_holder_killed_mid_make_is_taken_over(
    backend: str, server: RedisServer, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    if backend == "directory":
        cache: dict[str, Any] = {"dir": str(tmp_path / "shared")}
    else:
        cache = {"redis": server.url, "prefix": _prefix()}
        subprocess_env = {**subprocess_env, "JAXAOT_LEASE_TTL": "1"}
    hang = tmp_path / "never"
    holder, holder_logs = _fleet(cache, 1, subprocess_env, tmp_path, hang=str(hang))
    try:
        _until("the holder to hold a lease", Path(str(hang) + ".holding").exists)
        procs, logs = _fleet(cache, FLEET - 1, subprocess_env, tmp_path)
        _wait_until_waiting(logs)
        holder[0].send_signal(signal.SIGKILL)
        holder[0].wait(timeout=GUARD_S)
    finally:
        if holder[0].poll() is None:
            holder[0].kill()
    rows = _results(procs, logs)
    assert sum(r["lease_takeovers"] for r in rows) == 1, rows
    assert all(r["lease_wait_timeouts"] == 0 for r in rows), rows
    assert "waiting for" in logs[0].read_text() and f"pid {holder[0].pid}" in logs[0].read_text()


def test_wait_past_its_deadline_is_made_locally(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    cache = {"dir": str(tmp_path / "shared")}
    hang = tmp_path / "never"
    holder, _ = _fleet(cache, 1, subprocess_env, tmp_path, hang=str(hang))
    try:
        _until("the holder to hold a lease", Path(str(hang) + ".holding").exists)
        env = {**subprocess_env, "JAXAOT_LEASE_WAIT": "0.5"}
        procs, logs = _fleet(cache, FLEET - 1, env, tmp_path)
        rows = _results(procs, logs)  # the holder is still stuck: they made it themselves
    finally:
        holder[0].kill()
        holder[0].wait(timeout=GUARD_S)
    assert sum(r["lease_wait_timeouts"] for r in rows) >= 1, rows
    for log in logs:
        text = log.read_text()
        assert text.count("WARNING jaxaot: waited 0.5 s ($JAXAOT_LEASE_WAIT)") <= 1, text[-2000:]
    assert any("WARNING jaxaot: waited 0.5 s" in log.read_text() for log in logs)


def test_redis_stopped_mid_run_everyone_finishes(
    private_server: RedisServer, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    cache = {"redis": private_server.url, "prefix": _prefix()}
    hang = tmp_path / "release"
    holder, holder_logs = _fleet(cache, 1, subprocess_env, tmp_path, hang=str(hang))
    try:
        _until("the holder to hold a lease", Path(str(hang) + ".holding").exists)
        procs, logs = _fleet(cache, FLEET - 1, subprocess_env, tmp_path)
        _wait_until_waiting(logs)
        private_server.stop()
        rows = _results(procs, logs)
    finally:
        hang.touch()
    rows += _results(holder, holder_logs)
    assert all(r["made_here"] >= 1 for r in rows), rows
    for log in logs + holder_logs:
        warnings = [line for line in log.read_text().splitlines() if line.startswith("WARNING")]
        causes = [w for w in warnings if "ConnectionError" in w]
        assert len(causes) <= 1, warnings
