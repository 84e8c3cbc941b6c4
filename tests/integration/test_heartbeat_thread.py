"""The heartbeat's thread: started without waiting for it to run, joined or cancelled at stop,
nothing left behind (a real PostgreSQL session holds the lock)."""

from __future__ import annotations

import _thread
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from airflow_pglock.guard import LockGuard
from airflow_pglock.heartbeat import Heartbeat
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.held import HeldLock
from airflow_pglock.policy import LockPolicy
from tests.helpers import advisory_locks, advisory_locks_left


def _held(hook: AdvisoryLockHook, name: str) -> HeldLock:
    held = hook.database.acquire_lock(
        [LockKey.from_name(name)],
        shared=False,
        scope="session",
        timeout=None,
        application_name="pglock-tests heartbeat",
    )
    assert held is not None
    return held


def _heartbeat(hook: AdvisoryLockHook, held: HeldLock, losses: list[str]) -> Heartbeat:
    """A heartbeat of ``held`` that notes every loss (and alarm) in ``losses``."""
    return Heartbeat(hook.database, held, lambda reason, ask: losses.append(reason), losses.append, threading.Event())


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def test_stopped_before_its_thread_runs_it_touches_nothing(
    hook: AdvisoryLockHook, monkeypatch: pytest.MonkeyPatch
) -> None:
    go = threading.Event()
    real_start = _thread.start_new_thread

    def delayed(function: Callable[..., None], args: tuple[Any, ...]) -> int:
        def late() -> None:
            go.wait(10)
            function(*args)

        started: int = real_start(late, ())
        return started

    monkeypatch.setattr(_thread, "start_new_thread", delayed)  # the heartbeat's thread starts late
    held = _held(hook, "heartbeat-cancelled")
    losses: list[str] = []
    try:
        beat = _heartbeat(hook, held, losses)
        beat.start()
        beat.stop()  # returns at once: the thread has not run yet
        assert beat._state == "cancelled" and beat._wake_read == -1 and not beat.alive
        held.close()  # what a guard does next; the thread must not look at the closed session
        go.set()
        _wait_until(lambda: not beat._ended.locked(), "the cancelled thread returned")
        assert beat._state == "cancelled" and losses == []
    finally:
        go.set()
        held.close()


def test_stop_joins_a_running_heartbeat(hook: AdvisoryLockHook, admin: Any) -> None:
    held = _held(hook, "heartbeat-joined")
    losses: list[str] = []
    try:
        beat = _heartbeat(hook, held, losses)
        beat.start()
        _wait_until(lambda: beat._state == "running", "the heartbeat runs")
        assert beat.alive
        beat.stop()
        assert beat._state == "ended" and not beat._ended.locked() and not beat.alive
        assert beat._wake_read == -1 and losses == []
        beat.stop()  # twice: nothing more
        pid = held.server.backend_pid
        assert any(row[0] == pid for row in advisory_locks(admin))  # the heartbeat never touched the lock
    finally:
        held.close()


def test_many_short_guards_leave_no_thread_descriptor_or_lock(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_name("heartbeat-many")
    quiet = logging.getLogger("pglock-tests.heartbeat-many")
    quiet.disabled = True
    tasks = _tasks()
    for _ in range(5):  # warm: psycopg's and the interpreter's own descriptors
        LockGuard(hook.database, key, LockPolicy(), logger=quiet).run(lambda lock: None)
    _wait_until(lambda: _tasks() <= tasks, "the warm-up heartbeats ended")
    fds = len(os.listdir("/proc/self/fd"))
    for index in range(200):
        guard = LockGuard(hook.database, key, LockPolicy(), logger=quiet)
        if index % 2:
            guard.run(lambda lock: None)
        else:
            guard.run(lambda lock: time.sleep(0.002))  # the thread runs before the stop
        assert guard.outcome == "completed" and guard._heartbeat is not None and not guard._heartbeat.alive
    _wait_until(lambda: _tasks() <= tasks, "every heartbeat thread ended")
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert advisory_locks_left(admin) == 0


def test_a_heartbeat_that_fails_unexpectedly_reports_a_loss(
    hook: AdvisoryLockHook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error the loop does not expect must not end the thread unheard: the work would run unwatched."""

    def broken_watch(self: Heartbeat, seconds: float) -> bool:
        raise ValueError("a bug in the socket watch")

    monkeypatch.setattr(Heartbeat, "_watch", broken_watch)
    held = _held(hook, "heartbeat-broken")
    losses: list[str] = []
    try:
        beat = _heartbeat(hook, held, losses)
        beat.start()
        _wait_until(lambda: not beat._ended.locked(), "the heartbeat thread ended")
        assert losses == ["the heartbeat failed (ValueError: a bug in the socket watch)"]
        assert beat._state == "ended" and beat._wake_read == -1
        beat.stop()
    finally:
        held.close()


def test_an_interrupt_as_its_thread_is_made_cancels_the_thread(
    hook: AdvisoryLockHook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Airflow's timeout (or Ctrl-C) can land in start() after the thread was made: the thread,
    when it runs, touches nothing and frees what it holds once."""
    go = threading.Event()
    real_start = _thread.start_new_thread
    unraisable: list[Any] = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)

    def made_then_interrupted(function: Callable[..., None], args: tuple[Any, ...]) -> int:
        def late() -> None:
            go.wait(10)
            function(*args)

        real_start(late, ())
        raise KeyboardInterrupt

    monkeypatch.setattr(_thread, "start_new_thread", made_then_interrupted)
    held = _held(hook, "heartbeat-interrupted")
    losses: list[str] = []
    try:
        beat = _heartbeat(hook, held, losses)
        with pytest.raises(KeyboardInterrupt):
            beat.start()
        assert beat._state == "cancelled" and beat._wake_read == -1 and not beat.alive
        held.close()
        go.set()
        _wait_until(lambda: not beat._ended.locked(), "the cancelled thread returned")
        time.sleep(0.05)  # its last line ran
        assert losses == [] and unraisable == []
        beat.stop()  # what a guard's clean-up does next: nothing to join
    finally:
        go.set()
        held.close()


def test_a_guard_that_fails_after_its_heartbeat_started_stops_it_first(
    hook: AdvisoryLockHook, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock connection is closed only once the heartbeat is stopped: a heartbeat still running
    would take the close for a loss."""

    def failing_handle(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("after the heartbeat started")

    monkeypatch.setattr("airflow_pglock.guard.LockHandle", failing_handle)
    guard = LockGuard(hook.database, LockKey.from_name("heartbeat-abandoned"), LockPolicy())
    with pytest.raises(RuntimeError, match="after the heartbeat started"):
        guard.__enter__()
    beat = guard._heartbeat
    assert beat is not None and beat._state in ("ended", "cancelled") and beat._wake_read == -1
    assert guard.lost is None and guard.outcome == "failed"
    assert advisory_locks_left(admin) == 0
