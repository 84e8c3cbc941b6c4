"""hook.lock_session(): many keys on one dedicated connection, on a real PostgreSQL (issue 15)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError, LockLostError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.policy import LockPolicy
from tests.helpers import advisory_locks, other_sessions


def _pids(admin: Any) -> list[int]:
    return sorted({row[0] for row in advisory_locks(admin)})


def _count(admin: Any, pid: int) -> int:
    return sum(1 for row in advisory_locks(admin) if row[0] == pid)


def _terminate(admin: Any, pid: int) -> None:
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    deadline = time.monotonic() + 10
    while pid in [row[0] for row in other_sessions(admin)]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_busy_and_free_keys(hook: AdvisoryLockHook, admin: Any) -> None:
    admin.execute("SELECT pg_advisory_lock(%s)", [LockKey.from_name("tenant/busy").numbers[0]])
    try:
        with hook.lock_session(application_name="pglock-tests session") as session:
            with session.try_lock("tenant/busy") as busy:
                assert busy is None
            with session.try_lock("tenant/free") as free:
                assert free is not None and free.key.name == "tenant/free" and free.lost is None
                assert session.held() == [LockKey.from_name("tenant/free")]
                assert _count(admin, session.server.backend_pid) == 1
            assert session.held() == [] and _count(admin, session.server.backend_pid) == 0
            assert "pglock-tests session" in [name for _, name in other_sessions(admin)]
    finally:
        admin.execute("SELECT pg_advisory_unlock_all()")


def test_a_with_block_takes_its_key_as_it_begins_and_only_once(hook: AdvisoryLockHook, admin: Any) -> None:
    """try_lock/lock return the block's hold: nothing is taken before the block, and the same
    hold cannot start a second block (as a generator-based context manager could not)."""
    with hook.lock_session() as session:
        hold = session.try_lock("tenant/once")
        assert session.held() == [] and _count(admin, session.server.backend_pid) == 0
        with hold as sub:
            assert sub is not None and _count(admin, session.server.backend_pid) == 1
        assert _count(admin, session.server.backend_pid) == 0
        with pytest.raises(LockConfigurationError, match="entered already"), hold:
            pytest.fail("a second block of one hold ran")
        waiting = session.lock("tenant/once", timeout=1)
        with waiting as sub:
            assert sub is not None
        with pytest.raises(LockConfigurationError, match="entered already"), waiting:
            pytest.fail("a second block of one hold ran")
        assert session.held() == [] and _count(admin, session.server.backend_pid) == 0


def test_a_set_made_on_a_connection_closed_already_reports_a_lost_session(dsn: str, admin: Any) -> None:
    """A guarded task builds its ``lock`` handle after its heartbeat started: the heartbeat may have
    closed the connection by then (the server ended the session). Building the set must not fail
    with the driver's error (a "failed" task): its first operation reports the lost session."""
    from airflow_pglock.lock_set import LockSet

    conn = psycopg.connect(dsn, autocommit=True)
    conn.close()
    keys = LockSet(conn, lambda: None)
    with pytest.raises(LockLostError, match="the lock session was lost"), keys.try_lock("tenant/closed"):
        pytest.fail("a block ran on a closed connection")
    assert keys.held() == [] and advisory_locks(admin) == []


def test_a_block_whose_session_a_statement_found_ended_fails_at_its_end(dsn: str, admin: Any) -> None:
    """A statement that finds the session ended (here the block's own; in a lock session often
    another thread's, which holds the connection while the heartbeat cannot read it) drops every
    key: the with block of each must still fail at its end, and a release must raise, not say False."""
    from airflow_pglock.lock_set import LockSet

    conn = psycopg.connect(dsn, autocommit=True)
    keys = LockSet(conn, lambda: None)  # no heartbeat: only the statement finds the loss
    try:
        with pytest.raises(LockLostError, match="lost key 'tenant/a'") as ended, keys.try_lock("tenant/a") as sub:
            assert sub is not None
            _terminate(admin, conn.info.backend_pid)
            with pytest.raises(LockLostError, match="the lock session was lost"):
                keys.try_lock_many(["tenant/b"])
            with pytest.raises(LockLostError, match="the lock session was lost"):
                sub.release()
        assert "the session ended" in ended.value.cause
        assert keys.held() == []
    finally:
        conn.close()


def test_a_key_given_back_early_leaves_its_block_alone_after_a_loss(dsn: str, admin: Any) -> None:
    """Released inside the block, then the session is lost: the block's key was given back while
    held, so its end does not report a loss (the next operation does)."""
    from airflow_pglock.lock_set import LockSet

    conn = psycopg.connect(dsn, autocommit=True)
    keys = LockSet(conn, lambda: None)
    try:
        with keys.try_lock("tenant/early") as sub:
            assert sub is not None and sub.release() is True
            _terminate(admin, conn.info.backend_pid)
        with pytest.raises(LockLostError, match="the lock session was lost"):
            keys.try_lock_many(["tenant/next"])
    finally:
        conn.close()


def test_a_key_this_session_holds_is_busy(hook: AdvisoryLockHook, admin: Any) -> None:
    """PostgreSQL would take it again (re-entrant counting): the session says busy instead."""
    with hook.lock_session() as session:
        with session.try_lock("again") as first:
            assert first is not None
            with session.try_lock("again") as second:
                assert second is None
            with session.lock(LockKey.from_name("again"), timeout=0.2) as waited:
                assert waited is None
            taken = session.try_lock_many(["again", "other", "other", LockKey.from_name("other")])
            assert [sub.key.name for sub in taken] == ["other"]
            assert _count(admin, session.server.backend_pid) == 2  # each key once, never counted twice
        assert session.release("other") is True
        assert session.release("other") is False  # released already
        assert _count(admin, session.server.backend_pid) == 0


def test_many_keys_with_some_held_elsewhere(hook: AdvisoryLockHook, admin: Any) -> None:
    keys = [LockKey.from_name(f"tenant/{n}") for n in range(700)]
    keys += [LockKey.from_int(10_000 + n) for n in range(200)] + [LockKey.from_pair(7, n) for n in range(100)]
    elsewhere = keys[::10]
    for key in elsewhere:
        admin.execute(f"SELECT pg_advisory_lock({', '.join(['%s'] * len(key.numbers))})", list(key.numbers))
    try:
        with hook.lock_session() as session:
            taken = session.try_lock_many(keys)
            assert [sub.key for sub in taken] == [key for key in keys if key not in elsewhere]
            assert session.held() == [sub.key for sub in taken]
            assert _count(admin, session.server.backend_pid) == 900
            assert session.release(*taken[:450]) is True
            assert _count(admin, session.server.backend_pid) == 450
            with hook.lock_session() as second:  # another session sees the rest busy
                assert [sub.key for sub in second.try_lock_many(keys)] == [sub.key for sub in taken[:450]]
        assert _pids(admin) == [admin.info.backend_pid]  # only the admin's keys are left
    finally:
        admin.execute("SELECT pg_advisory_unlock_all()")


def test_bad_key_refuses_the_whole_batch_before_anything_is_taken(hook: AdvisoryLockHook, admin: Any) -> None:
    with hook.lock_session() as session:
        for bad in (2**63, (1, 2**31), None, True, 1.5):
            with pytest.raises(InvalidLockKeyError, match=r"lock key|must be"):
                session.try_lock_many(["a", 1, bad, "b"])  # type: ignore[list-item]
            assert session.held() == [] and advisory_locks(admin) == []
        with pytest.raises(LockConfigurationError, match="wait timeout"), session.lock("a", timeout=-1):
            pass
        assert advisory_locks(admin) == []


@pytest.mark.parametrize("shared", [1, "false", None])
def test_a_shared_that_is_not_a_bool_is_refused_before_anything_is_taken(
    hook: AdvisoryLockHook, admin: Any, shared: object
) -> None:
    """Review -57: shared=1 took both keys shared, and release() then freed neither (its groups are
    True and False) yet answered True: the session forgot keys the server still held."""
    with hook.lock_session() as session:
        named = f"shared must be True or False, got {shared!r}"
        with pytest.raises(LockConfigurationError, match=named):
            session.try_lock_many(["a", "b"], shared=shared)  # type: ignore[arg-type]
        with pytest.raises(LockConfigurationError, match=named):
            session.try_lock("a", shared=shared)  # type: ignore[arg-type]
        with pytest.raises(LockConfigurationError, match=named):
            session.lock("a", timeout=1, shared=shared)  # type: ignore[arg-type]
        assert session.held() == []
        assert _count(admin, session.server.backend_pid) == 0


def test_a_wait_is_bounded_by_the_server(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_name("waited")
    admin.execute("SELECT pg_advisory_lock(%s)", [key.numbers[0]])
    with hook.lock_session() as session:
        with session.lock(key, timeout=0.3) as timed_out:
            assert timed_out is None
        threading.Timer(0.5, lambda: admin.execute("SELECT pg_advisory_unlock(%s)", [key.numbers[0]])).start()
        with session.lock(key, timeout=20) as got:
            assert got is not None and session.held() == [key]


def test_termination_mid_loop_loses_every_key(hook: AdvisoryLockHook, admin: Any) -> None:
    done: list[int] = []
    with pytest.raises(LockLostError, match="lock session was lost"), hook.lock_session() as session:
        kept = session.try_lock_many(range(50))
        for n in range(100, 200):
            with session.try_lock(n) as sub:
                assert sub is not None
                done.append(n)
                if n == 120:
                    _terminate(admin, session.server.backend_pid)
    assert done[-1] == 120 and all(sub.lost is not None for sub in kept)
    assert session.held() == [] and advisory_locks(admin) == []


def test_the_heartbeat_notices_a_lost_session_and_the_block_fails(dsn: str, admin: Any) -> None:
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    with pytest.raises(LockLostError, match="lock session was lost"), hook.lock_session() as session:
        [sub] = session.try_lock_many(["beat"])
        _terminate(admin, session.server.backend_pid)
        deadline = time.monotonic() + 30
        while session.lost is None:
            assert time.monotonic() < deadline, "the heartbeat did not notice"
            time.sleep(0.05)
        assert sub.lost is not None and session.held() == []
    assert advisory_locks(admin) == []


def test_an_idle_session_is_kept_alive_past_its_lease(dsn: str, admin: Any) -> None:
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    with hook.lock_session() as session:
        session.try_lock_many(["idle"])
        time.sleep(4.5)  # longer than the lease: only the heartbeat keeps the session from idle_session_timeout
        assert session.lost is None and session.held() == [LockKey.from_name("idle")]
        assert _count(admin, session.server.backend_pid) == 1


def test_cleanup_leaves_no_lock_and_no_connection(hook: AdvisoryLockHook, admin: Any) -> None:
    with pytest.raises(RuntimeError), hook.lock_session(application_name="pglock-tests cleanup") as session:
        session.try_lock_many(range(10))
        raise RuntimeError("work failed")
    deadline = time.monotonic() + 5
    while other_sessions(admin) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert advisory_locks(admin) == [] and other_sessions(admin) == []
    assert session.connection.closed


def test_threads_sharing_a_session_never_hold_one_key_together(hook: AdvisoryLockHook, admin: Any) -> None:
    holders: dict[int, int] = {}
    overlaps: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)
    guard = threading.Lock()

    def work(session: Any) -> None:
        try:
            start.wait()
            for round_ in range(200):
                key = round_ % 3
                with session.try_lock(key) as sub:
                    if sub is None:
                        continue
                    with guard:
                        holders[key] = holders.get(key, 0) + 1
                        if holders[key] > 1:
                            overlaps.append(key)
                    time.sleep(0.0005)
                    with guard:
                        holders[key] -= 1
        except BaseException as error:
            errors.append(error)

    with hook.lock_session() as session:
        threads = [threading.Thread(target=work, args=(session,)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == [] and overlaps == []
        assert session.held() == [] and _count(admin, session.server.backend_pid) == 0


def test_a_stale_sub_lock_never_frees_the_key_taken_again(hook: AdvisoryLockHook, admin: Any) -> None:
    """A SubLock released once is spent: the same key taken again is another SubLock's hold, and the
    first one's release (again) must not free it (it did: a foreign session then took the key)."""
    key = LockKey.from_name("tenant/stale")
    with hook.lock_session() as session:
        [first] = session.try_lock_many([key])
        assert first.release() is True
        [second] = session.try_lock_many([key])
        assert first.release() is False  # spent
        assert session.release(first) is False
        assert session.held() == [key]
        assert admin.execute("SELECT pg_try_advisory_lock(%s)", [key.int64]).fetchone() == (False,)
        assert second.release() is True
    assert advisory_locks(admin) == []


def test_a_block_that_released_its_key_early_leaves_the_next_holder_alone(hook: AdvisoryLockHook, admin: Any) -> None:
    """Thread A releases its key inside its block; thread B takes the key; A's block ends: B keeps it,
    and no other session can take it until B's block ends."""
    key = LockKey.from_name("tenant/early")
    a_released, b_holds, a_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def a(session: Any) -> None:
        with session.try_lock(key) as sub:
            assert sub is not None
            sub.release()
            a_released.set()
            assert b_holds.wait(30)
        a_done.set()

    def b(session: Any) -> None:
        assert a_released.wait(30)
        with session.try_lock(key) as sub:
            seen["taken"] = sub is not None
            b_holds.set()
            assert a_done.wait(30)
            seen["foreign"] = admin.execute("SELECT pg_try_advisory_lock(%s)", [key.int64]).fetchone()
            seen["held"] = session.held()

    with hook.lock_session() as session:
        threads = [threading.Thread(target=f, args=(session,)) for f in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert seen == {"taken": True, "foreign": (False,), "held": [key]}
    assert advisory_locks(admin) == []


def test_a_guarded_task_handle_locks_sub_keys_on_its_own_connection(hook: AdvisoryLockHook, admin: Any) -> None:
    other = hook.acquire("tenant-export/2")
    assert other is not None
    try:
        with LockGuard(hook.database, LockKey.from_name("export-all"), LockPolicy()) as lock:
            assert lock.try_lock_many(["export-all"]) == []  # the task's own key: busy, never released here
            taken = lock.try_lock_many([f"tenant-export/{n}" for n in range(5)])
            assert [sub.key.name for sub in taken] == [
                "tenant-export/0",
                "tenant-export/1",
                "tenant-export/3",
                "tenant-export/4",
            ]
            assert _count(admin, lock.backend_pid) == 5  # own key + 4 tenants, one connection
            assert lock.release("export-all") is False and lock.release(taken[0]) is True
            with lock.try_lock("tenant-export/0") as sub:
                assert sub is not None
        assert _pids(admin) == [other.server.backend_pid]
    finally:
        other.release()
    with LockGuard(hook.database, LockKey.from_name("tx-all"), LockPolicy(mode="transaction")) as lock:
        with lock.try_lock("tenant-tx/1") as sub:
            assert sub is not None
        with pytest.raises(LockConfigurationError, match="transaction"), lock.lock("tenant-tx/1", timeout=1):
            pass
    assert advisory_locks(admin) == []


# ------------------------------------ a lost session is never a success (issue: lock lifetime, round two)


@pytest.mark.parametrize("how", ["release by key", "release_all"])
def test_a_key_an_open_with_block_holds_is_given_back_only_by_that_block(
    hook: AdvisoryLockHook, admin: Any, how: str
) -> None:
    """Another thread's release by key or release_all() freed the key of a block still running,
    which then ended as a success (a second holder could get in meanwhile). The key is the block's:
    a release by key is refused and release_all() leaves it; the block's own sub-lock still may."""
    key, other = LockKey.from_name("tenant/acme"), LockKey.from_name("tenant/other")
    in_block, released, seen = threading.Event(), threading.Event(), {}

    def coordinator(session: Any) -> None:
        assert in_block.wait(30)
        try:
            seen["released"] = session.release("tenant/acme") if how == "release by key" else session.release_all()
        except BaseException as error:
            seen["released"] = error
        seen["foreign"] = _other_process_takes(admin, "tenant/acme")
        released.set()

    with hook.lock_session() as session:
        session.try_lock_many([other])
        thread = threading.Thread(target=coordinator, args=(session,))
        thread.start()
        with session.try_lock(key) as sub:
            assert sub is not None
            in_block.set()
            assert released.wait(30)
            assert session.held() == ([key] if how == "release_all" else [other, key])
        thread.join(30)
        if how == "release by key":
            assert isinstance(seen["released"], LockConfigurationError), seen
            assert "held by an open with block" in str(seen["released"]) and "tenant/acme" in str(seen["released"])
        else:
            assert seen["released"] is True  # the other key, free of any block, was released
        assert seen["foreign"] is False, "another session took the key while its with block ran"
        assert session.held() == ([other] if how == "release by key" else [])
        with session.try_lock(key) as sub:  # the block's own sub-lock may give it back early
            assert sub is not None and sub.release() is True
            assert _other_process_takes(admin, "tenant/acme")
    assert advisory_locks(admin) == []


def test_a_release_by_key_racing_with_blocks_never_frees_one_nor_fails_one(hook: AdvisoryLockHook) -> None:
    """A block's key became the block's only after its take had let the session go, and stopped
    being so before its end took it again: a release by key in between freed a running block's
    key (the block ended as a success without it) or made a block that held its key end lost."""
    import sys

    counts = {"blocks": 0, "ran_without_its_key": 0, "ended_lost": 0}
    key = LockKey.from_int(424242)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches as often as possible: the gaps were a few bytecodes
    try:
        with hook.lock_session() as session:
            stop = time.monotonic() + 3

            def release_by_key() -> None:
                while time.monotonic() < stop:
                    with contextlib.suppress(LockConfigurationError):
                        session.release(key)

            releaser = threading.Thread(target=release_by_key)
            releaser.start()
            while time.monotonic() < stop:
                try:
                    with session.try_lock(key) as sub:
                        if sub is None:
                            continue
                        counts["blocks"] += 1
                        time.sleep(0)
                        counts["ran_without_its_key"] += sub.given_back
                except LockLostError:
                    counts["ended_lost"] += 1
            releaser.join(30)
    finally:
        sys.setswitchinterval(switch)
    assert counts["blocks"] > 100 and counts["ran_without_its_key"] == counts["ended_lost"] == 0, counts


def test_a_lock_session_refuses_a_call_that_reads_as_something_else(hook: AdvisoryLockHook, admin: Any) -> None:
    """`if try_lock(k):` was always true (nothing taken); try_lock_many("name") took one key per
    letter; release([a, b]) read the list as one (int32, int32) pair and freed nothing."""
    with hook.lock_session() as session:
        with pytest.raises(LockConfigurationError, match=r"returns a context manager.*sub is None"):
            if session.try_lock("tenant/acme"):
                pytest.fail("the work ran with nothing taken")
        for one_key in ("tenant/acme", 5, LockKey.from_name("tenant/acme"), (5, 7), b"acme"):
            with pytest.raises(InvalidLockKeyError, match=r"takes an iterable of keys, got one key"):
                session.try_lock_many(one_key)  # type: ignore[arg-type]
        assert session.held() == [] and advisory_locks(admin) == []
        taken = session.try_lock_many([5, 7])
        with pytest.raises(InvalidLockKeyError, match=r"release\(\) takes each key .* got the list \[5, 7\]"):
            session.release([5, 7])  # type: ignore[arg-type]
        assert session.held() == [sub.key for sub in taken] and _count(admin, session.server.backend_pid) == 2
        assert session.release(*taken) is True
    assert advisory_locks(admin) == []


def _other_process_takes(admin: Any, key: str) -> bool:
    """Whether a session of its own (as another process would) takes ``key``; it lets it go again."""
    number = LockKey.from_name(key).int64
    with psycopg.connect(admin.info.dsn, autocommit=True) as other:
        row = other.execute("SELECT pg_try_advisory_lock(%s)", [number]).fetchone()
        taken = bool(row and row[0])
        if taken:  # now: a closed session's backend exits (and frees it) only a moment later
            other.execute("SELECT pg_advisory_unlock(%s)", [number])
        return taken


@pytest.mark.parametrize("form", ["block-ends", "explicit-release"])
def test_a_batch_whose_session_was_terminated_fails_at_its_end(hook: AdvisoryLockHook, admin: Any, form: str) -> None:
    """The how-to's pattern: keys from try_lock_many, the session is terminated, another process
    takes one of them. Nothing more is asked of the session: its block must still fail (the
    default lease's heartbeat probes only every 10 s, so the end is what finds it)."""
    with pytest.raises(LockLostError, match="lock session was lost"), hook.lock_session() as session:
        subs = session.try_lock_many(["tenant-1", "tenant-2"])
        assert len(subs) == 2
        _terminate(admin, session.server.backend_pid)
        assert _other_process_takes(admin, "tenant-1")  # two holders, if the batch went on
        if form == "explicit-release":
            session.release(*subs)
    assert advisory_locks(admin) == []


def test_the_socket_watch_notices_a_terminated_session_long_before_a_probe(dsn: str, admin: Any) -> None:
    """A 600 s lease: the next probe would come 200 s after the session opened. The server says
    on the socket that it ended the session; the session knows it within moments."""
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=600))
    with pytest.raises(LockLostError, match="terminated"), hook.lock_session() as session:
        [sub] = session.try_lock_many(["watched"])
        _terminate(admin, session.server.backend_pid)
        deadline = time.monotonic() + 60  # generous; a probe would take 200 s
        while session.lost is None:
            assert time.monotonic() < deadline, "the loss was not noticed before the next probe"
            time.sleep(0.05)
        assert sub.lost is not None and session.held() == []
        with pytest.raises(LockLostError), session.try_lock("after"):
            pass
    assert advisory_locks(admin) == []


def test_keys_unlocked_behind_the_sessions_back_fail_the_block(hook: AdvisoryLockHook, admin: Any) -> None:
    """The session lives, but the final release finds its keys gone (something ran
    pg_advisory_unlock_all() on its connection) and another process took one: no success."""
    with pytest.raises(LockLostError, match="found at release"), hook.lock_session() as session:
        session.try_lock_many(["behind-1", "behind-2"])
        session.connection.execute("SELECT pg_advisory_unlock_all()")
        assert _other_process_takes(admin, "behind-1")
    assert advisory_locks(admin) == []


def test_a_key_unlocked_behind_its_with_block_fails_that_block(hook: AdvisoryLockHook, admin: Any) -> None:
    """``with session.try_lock(k)``: the session lives, but the key was unlocked on its connection
    during the block (another process took it): the block ends with LockLostError, not silently."""
    with hook.lock_session() as session:
        with pytest.raises(LockLostError, match="no longer held"), session.try_lock("behind-block") as sub:
            assert sub is not None
            session.connection.execute("SELECT pg_advisory_unlock_all()")
            assert _other_process_takes(admin, "behind-block")
        with session.try_lock("released-inside") as sub:  # released by the block itself: no error
            assert sub is not None and sub.release()
    assert advisory_locks(admin) == []


def test_a_guarded_task_whose_session_ends_under_its_sub_keys_fails(dsn: str, admin: Any) -> None:
    """The guard's handle keeps behaving: sub-keys on the task's connection, the session
    terminated, the run fails as lost and nothing is left."""
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    guard = LockGuard(hook.database, LockKey.from_name("guarded-batch"), LockPolicy())

    def work(lock: Any) -> None:
        assert len(lock.try_lock_many(["guarded-1", "guarded-2"])) == 2
        with psycopg.connect(admin.info.dsn, autocommit=True) as killer:  # the interrupt may land in it
            killer.execute("SELECT pg_terminate_backend(%s)", [lock.backend_pid])
        time.sleep(60)  # interrupted by the heartbeat

    with pytest.raises(LockLostError, match="guarded-batch"):
        guard.run(work)
    assert guard.outcome == "lost"
    deadline = time.monotonic() + 10
    while advisory_locks(admin):
        assert time.monotonic() < deadline, advisory_locks(admin)
        time.sleep(0.05)


def test_key_forms_stay_distinct_or_deduplicated_as_postgresql_counts_them(hook: AdvisoryLockHook, admin: Any) -> None:
    """int64 5 and the pair (0, 5) are different locks; a name and its own int64 are one; a
    pool's slot ``P#slot2`` is not ``P``."""
    name_as_int = LockKey.from_int(LockKey.from_name("P").int64)
    with hook.lock_session() as session:
        taken = session.try_lock_many([5, (0, 5), "P", "P#slot2", name_as_int])
        assert [sub.key for sub in taken] == [
            LockKey.from_int(5),
            LockKey.from_pair(0, 5),
            LockKey.from_name("P"),
            LockKey.from_name("P#slot2"),
        ]
        assert _count(admin, session.server.backend_pid) == 4
        with session.try_lock(name_as_int.int64) as again:
            assert again is None  # held already, as "P"
        with session.try_lock("P", shared=True) as shared:
            assert shared is None
        assert session.release(name_as_int) is True  # the same lock as "P"
        assert session.held() == [LockKey.from_int(5), LockKey.from_pair(0, 5), LockKey.from_name("P#slot2")]
        assert _count(admin, session.server.backend_pid) == 3
    assert advisory_locks(admin) == []


def test_a_wait_longer_than_the_lease_is_not_a_loss(dsn: str, admin: Any) -> None:
    """A 3 s lease and a 6 s wait: the heartbeat cannot probe the busy connection, asks from a
    side connection whether the session lives, and keeps it (the server sees it active)."""
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    key = LockKey.from_name("waited-long")
    admin.execute("SELECT pg_advisory_lock(%s)", [key.int64])
    threading.Timer(6, lambda: admin.execute("SELECT pg_advisory_unlock(%s)", [key.int64])).start()
    with hook.lock_session() as session:
        with session.lock(key, timeout=60) as got:
            assert got is not None and session.lost is None
        assert session.lost is None
    assert advisory_locks(admin) == []


def test_a_key_named_twice_in_one_release_was_held_to_the_end(hook: AdvisoryLockHook, admin: Any) -> None:
    """Review -64: release(sub, sub) and release(name, its int64) answered False ("not every one was
    held until now") for a key held to the end: a caller would have thrown finished work away."""
    with hook.lock_session() as session:
        (sub,) = session.try_lock_many(["twice"])
        assert session.release(sub, sub) is True
        session.try_lock_many(["twice-2"])
        number = LockKey.from_name("twice-2").int64
        assert session.release("twice-2", number) is True
        assert advisory_locks(admin) == []
        (sub,) = session.try_lock_many(["twice-3"])
        assert session.release(sub, "never-taken") is False  # one of them was not held
        assert session.release(sub) is False  # a stale sub-lock: released already


@pytest.mark.parametrize("ending", ["skip", "error"])
def test_a_lost_session_whose_block_raised_fails_with_the_loss(hook: AdvisoryLockHook, admin: Any, ending: str) -> None:
    """Review rev87 F8: the session is terminated, then the block ends by raising (a skip the work
    decided after the loss, or any error). As hook.lock(): LockLostError from the block's error,
    never the skip (the loss unreported) nor the bare error."""
    from airflow_pglock.compat import AirflowSkipException

    raised: BaseException = AirflowSkipException("nothing new") if ending == "skip" else RuntimeError("work failed")
    with pytest.raises(LockLostError, match="lock session was lost") as failed, hook.lock_session() as session:
        subs = session.try_lock_many(["lost-then-raised-1", "lost-then-raised-2"])
        assert len(subs) == 2
        _terminate(admin, session.server.backend_pid)
        deadline = time.monotonic() + 30  # the watch on its socket notices within moments
        while session.lost is None:
            assert time.monotonic() < deadline, "the loss was not noticed"
            time.sleep(0.05)
        raise raised
    assert failed.value.__cause__ is raised and "terminated" in failed.value.cause
    assert advisory_locks(admin) == []


def test_a_live_session_whose_block_raised_passes_the_error_on(hook: AdvisoryLockHook, admin: Any) -> None:
    """The other side of F8: a session that was not lost lets the block's own skip or error go on."""
    from airflow_pglock.compat import AirflowSkipException

    with pytest.raises(AirflowSkipException, match="nothing new"), hook.lock_session() as session:
        session.try_lock_many(["live-then-skipped"])
        raise AirflowSkipException("nothing new")
    assert advisory_locks(admin) == []
