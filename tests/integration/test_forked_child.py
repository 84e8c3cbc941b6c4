"""A process forked while a lock is held (``os.fork()`` in the work) shares the lock's socket:
whatever the child does with its copy of the lock must not reach the parent's session."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_pglock.exceptions import LockLostError
from airflow_pglock.handle import LockHandle
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.liveness import Liveness
from tests.helpers import advisory_locks

# The child's exit codes: what it saw when it left the block.
SAW_IT_WAS_FORKED, SAW_ANOTHER_LOSS, SAW_AN_ERROR, LEFT_AS_THE_HOLDER = 10, 11, 12, 13
RELEASE_SAID_NOT_HELD, RELEASE_SAID_HELD = 20, 21


def _what_the_child_saw(error: LockLostError, parent: int) -> int:
    return SAW_IT_WAS_FORKED if f"forked from the lock's holder (pid {parent})" in str(error) else SAW_ANOTHER_LOSS


@contextlib.contextmanager
def _the_child_exits_here(parent: int) -> Iterator[None]:
    """Around a block that forks inside: the child leaves through here with an exit code saying
    what it saw when it left the block; the parent goes on."""
    try:
        yield
    except LockLostError as error:
        if os.getpid() != parent:
            os._exit(_what_the_child_saw(error, parent))
        raise
    except BaseException:
        if os.getpid() != parent:
            os._exit(SAW_AN_ERROR)
        raise
    if os.getpid() != parent:
        os._exit(LEFT_AS_THE_HOLDER)


def _fork_a_child_that_tries_a_sub_key(handle: LockHandle, parent: int) -> int:
    """Fork; the child tries a sub-key of the parent's ``handle`` and exits with what it saw."""
    child = os.fork()
    if child == 0:
        code = SAW_AN_ERROR
        try:
            handle.try_lock("fork-other").__enter__()
        except LockLostError as error:
            code = _what_the_child_saw(error, parent)
        finally:
            os._exit(code)
    return child


def _exit_code(child: int, timeout: float = 30) -> int:
    """The child's exit code; a child that hangs is killed (and the test fails on its code)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    return -1


def _parent_still_holds(admin: Any, backend_pid: int) -> None:
    assert [row[0] for row in advisory_locks(admin)] == [backend_pid]
    assert admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [backend_pid]).fetchone()[0] == 1


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_child_forked_in_the_block_leaves_it_without_touching_the_parents_lock(
    dsn: str, admin: Any, mode: str
) -> None:
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    parent = os.getpid()
    with _the_child_exits_here(parent), hook.lock("fork-guard", mode=mode) as handle:  # type: ignore[arg-type]
        assert handle is not None
        child = os.fork()
        if child:
            code = _exit_code(child)
            assert code == SAW_IT_WAS_FORKED, f"the child's exit code: {code}"
            _parent_still_holds(admin, handle.backend_pid)
            time.sleep(1.5)  # the heartbeat probes the lock again (every lease / 3) on the same socket
            assert handle.lost is None
            _parent_still_holds(admin, handle.backend_pid)
    assert advisory_locks(admin) == []


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_forked_childs_release_of_a_manual_lock_leaves_the_parents_lock_held(
    hook: AdvisoryLockHook, admin: Any, mode: str
) -> None:
    held = hook.acquire("fork-manual", mode=mode)  # type: ignore[arg-type]
    assert held is not None
    child = os.fork()
    if child == 0:
        code = SAW_AN_ERROR
        try:
            code = RELEASE_SAID_HELD if held.release() else RELEASE_SAID_NOT_HELD  # and closes its copy
        finally:
            os._exit(code)
    assert _exit_code(child) == RELEASE_SAID_NOT_HELD
    _parent_still_holds(admin, held.server.backend_pid)
    assert held.is_held()
    assert held.release() is True
    assert advisory_locks(admin) == []


def test_a_child_forked_in_a_lock_session_leaves_it_without_touching_the_parents_keys(
    hook: AdvisoryLockHook, admin: Any
) -> None:
    parent = os.getpid()
    with _the_child_exits_here(parent), hook.lock_session() as session:
        assert len(session.try_lock_many(["fork-a", "fork-b"])) == 2
        child = os.fork()
        if child:
            assert _exit_code(child) == SAW_IT_WAS_FORKED
            assert [row[0] for row in advisory_locks(admin)] == [session.server.backend_pid] * 2
            assert session.lost is None and len(session.held()) == 2
    assert advisory_locks(admin) == []


def test_a_child_that_stops_reading_a_stream_does_not_cancel_the_parents_statement(
    hook: AdvisoryLockHook, admin: Any
) -> None:
    """psycopg cancels a stream left early, on a new socket with the backend's cancel key: the
    child's copy of the connection is closed at the fork, so it sends none."""
    parent = os.getpid()
    rows, child = 0, 0
    with _the_child_exits_here(parent), hook.lock("fork-stream", mode="transaction") as handle:
        assert handle is not None and handle.connection is not None
        query = "SELECT g, repeat('x', 20000), pg_sleep(0.005) FROM generate_series(1, 200) g"
        for _ in handle.connection.cursor().stream(query):
            rows += 1
            if rows == 5:
                child = os.fork()
                if child == 0:
                    break  # the child leaves the stream: psycopg's clean-up runs here
    assert _exit_code(child) == SAW_IT_WAS_FORKED
    assert rows == 200  # the parent read its statement to the end and left the block as the holder
    assert advisory_locks(admin) == []


def test_a_child_cannot_use_the_parents_sub_keys(dsn: str, admin: Any) -> None:
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    parent = os.getpid()
    with hook.lock("fork-task") as handle:
        assert handle is not None
        with handle.try_lock("fork-sub") as sub:
            assert sub is not None
            child = _fork_a_child_that_tries_a_sub_key(handle, parent)
            assert _exit_code(child) == SAW_IT_WAS_FORKED
            assert [row[0] for row in advisory_locks(admin)] == [handle.backend_pid] * 2
    assert advisory_locks(admin) == []


def test_a_child_forked_while_a_thread_waits_for_a_sub_key_is_not_stuck_behind_it(
    dsn: str, hook: AdvisoryLockHook, admin: Any
) -> None:
    """The parent's thread holds the sub-keys' lock (and psycopg's) while the server makes it wait:
    in the child, no thread will ever release them; the child's call must not wait for it."""
    guarded = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    contender = hook.acquire("fork-contended")
    assert contender is not None
    parent = os.getpid()
    with guarded.lock("fork-waiting-task") as handle:
        assert handle is not None

        def wait_for_the_sub_key() -> None:
            with handle.lock("fork-contended", timeout=4) as sub:
                assert sub is None

        waiter = threading.Thread(target=wait_for_the_sub_key)
        waiter.start()
        deadline = time.monotonic() + 10
        while len(advisory_locks(admin)) < 3:  # the task's key, the contender's, the waiter's request
            assert time.monotonic() < deadline
            time.sleep(0.02)
        child = _fork_a_child_that_tries_a_sub_key(handle, parent)
        assert _exit_code(child, timeout=10) == SAW_IT_WAS_FORKED
        waiter.join()
    assert contender.release() is True
    assert advisory_locks(admin) == []
