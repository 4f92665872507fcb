"""The writer thread (``_store._writer``): background writes in order, waited for
by a read of the same entry and by ``jaxaot.wait_for_writes``."""

from __future__ import annotations

import logging
import threading

import pytest

import jaxaot
from jaxaot._store import _writer


def test_writes_run_in_order_on_one_thread_and_are_waited_for() -> None:
    gate = threading.Event()
    done: list[tuple[str, str]] = []

    def write(name: str, wait: bool = False) -> None:
        if wait:
            gate.wait(10)
        done.append((name, threading.current_thread().name))

    first = _writer.in_background("a" * 32, lambda: write("first", wait=True))
    second = _writer.in_background("b" * 32, lambda: write("second"))
    assert not first.done() and not second.done()  # (the first holds the thread)
    waiter = threading.Thread(target=_writer.written, args=("b" * 32,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # a read of the second waits for its write
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert [name for name, _ in done] == ["first", "second"]
    assert {thread for _, thread in done} == {done[0][1]}
    assert done[0][1].startswith("jaxaot-writer")
    jaxaot.wait_for_writes()
    assert not _writer._pending


def test_a_read_of_an_entry_not_being_written_does_not_wait() -> None:
    _writer.written("c" * 32)  # returns at once
    assert "c" * 32 not in _writer._pending


def test_a_write_that_fails_is_said_once_and_never_reaches_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A background write that raises (an executable XLA cannot serialize at
    times) ends there: said once per kind at WARNING, counted, and
    ``wait_for_writes`` returns; the writes after it still run."""
    done: list[str] = []

    def fails() -> None:
        raise RuntimeError("UNIMPLEMENTED: 'LessThan' is not serializable")

    before = jaxaot.stats()["cache_write_errors"]
    caplog.set_level(logging.WARNING, logger="jaxaot")
    for i in range(3):
        _writer.in_background(f"{i}" * 32, fails)
    _writer.in_background("d" * 32, lambda: done.append("after"))
    jaxaot.wait_for_writes()
    assert done == ["after"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "'LessThan' is not serializable" in said[0], said
    assert jaxaot.stats()["cache_write_errors"] == before + 3
