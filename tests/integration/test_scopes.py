"""Lock scopes on a real PostgreSQL: every guard of a named key honours another run's scope row,
and a scope's setup, tasks and teardown keep it (scope_rules through LockGuard)."""

from __future__ import annotations

import re
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockBusyError, LockConfigurationError, LockLostError, ScopeHorizonBusyError
from airflow_pglock.guard import LockGuard
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import schema, scopes
from airflow_pglock.policy import LockPolicy
from airflow_pglock.scope_rules import ScopeRole
from tests.helpers import advisory_locks_left

KEY = LockKey.from_name("scopes/integration")


def _role(kind: str, holder: str, lease: float = 300.0, **more: Any) -> ScopeRole:
    return ScopeRole(kind=kind, holder=holder, run=f"dep: dag {holder[:6]}", task="t", lease=lease, **more)  # type: ignore[arg-type]


def _enter(hook: Any, holder: str, lease: float = 300.0, fencing: bool = False) -> int | None:
    guard = LockGuard(hook.database, KEY, LockPolicy(), scope=_role("enter", holder, lease, fencing=fencing))
    with guard as handle:
        return handle.fencing_token


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_live_scope_refuses_every_other_guard_and_leaves_nothing_held(hook: Any, scopes_db: Any, mode: str) -> None:
    _enter(hook, uuid.uuid4().hex)
    with (
        pytest.raises(
            LockBusyError, match=r"is held by the lock scope of dep: dag \w+, between its tasks, lease until"
        ),
        LockGuard(hook.database, KEY, LockPolicy(mode=mode)),
    ):  # type: ignore[arg-type]
        pytest.fail("ran inside another run's scope")
    assert advisory_locks_left(scopes_db) == 0
    other = LockKey.from_name("scopes/another-key")
    with LockGuard(hook.database, other, LockPolicy(mode=mode)):  # type: ignore[arg-type]
        pass  # a key without a scope: no refusal


def test_a_pool_of_the_scopes_name_passes_over_slot_1_which_the_scope_holds(hook: Any, scopes_db: Any) -> None:
    """A plain key of a name is slot 1 of every pool of that name: a pool guard takes another slot."""
    _enter(hook, uuid.uuid4().hex)
    with LockGuard(hook.database, KEY, LockPolicy(slots=3)) as handle:
        assert handle.slot == 2
    with (
        pytest.raises(LockBusyError, match=r"all 1 slots|is held by the lock scope"),
        LockGuard(hook.database, KEY, LockPolicy()),
    ):
        pytest.fail("slot 1 ran inside another run's scope")


def test_a_waiting_guard_runs_once_the_scope_lease_runs_out(hook: Any, scopes_db: Any) -> None:
    _enter(hook, uuid.uuid4().hex, lease=1.5)
    ended_at = scopes_db.execute("SELECT lease_until FROM pglock.scopes").fetchone()[0]
    with LockGuard(hook.database, KEY, LockPolicy(on_busy="wait", wait_timeout=30)):
        started_at = scopes_db.execute("SELECT clock_timestamp()").fetchone()[0]
    assert started_at >= ended_at, "the guard ran before the scope's lease ended (database clock)"


def test_the_setup_takes_a_lapsed_scope_and_refuses_a_live_one_keeping_its_token(hook: Any, scopes_db: Any) -> None:
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    token = _enter(hook, first, fencing=True)
    assert token is not None
    assert _enter(hook, first, fencing=True) == token, "a setup that runs again for the same holder keeps the token"
    with pytest.raises(LockBusyError, match="is held by the lock scope"):
        _enter(hook, second, fencing=True)
    assert advisory_locks_left(scopes_db) == 0, "the refused guard took the key, then gave it back"
    scopes_db.execute("UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second'")
    newer = _enter(hook, second, fencing=True)
    assert newer is not None and newer > token, "a new acquisition gets a newer token"


def test_a_setup_run_again_takes_over_the_live_scope_its_earlier_try_left(hook: Any, scopes_db: Any) -> None:
    """Review -65: a task of a scope cleared while the scope was live (up for retry) runs the setup
    again, which found its own run's earlier row live and skipped the whole scope, the row then
    blocking the key until its lease ran out. A setup with the same lineage (the same setup of the
    same DAG run) takes it over with a new holder id and token; the earlier acquisition's tasks are
    lost; another setup (another lineage) is still refused."""
    lineage = uuid.uuid4().hex

    def enter(holder: str, lineage: str | None) -> int | None:
        role = _role("enter", holder, fencing=True, lineage=lineage)
        with LockGuard(hook.database, KEY, LockPolicy(), scope=role) as handle:
            return handle.fencing_token

    earlier = lineage + uuid.uuid4().hex
    token = enter(earlier, lineage)
    with pytest.raises(LockBusyError, match="is held by the lock scope"):
        other = uuid.uuid4().hex  # another setup, or another run's
        enter(other + uuid.uuid4().hex, other)
    with pytest.raises(LockBusyError, match="is held by the lock scope"):
        enter(uuid.uuid4().hex, None)
    again = lineage + uuid.uuid4().hex
    newer = enter(again, lineage)
    assert token is not None and newer is not None and newer > token, "a new acquisition gets a newer token"
    row = scopes_db.execute("SELECT holder, token FROM pglock.scopes").fetchall()
    assert row == [(again, newer)], row
    with pytest.raises(LockLostError), LockGuard(hook.database, KEY, LockPolicy(), scope=_role("member", earlier)):
        pytest.fail("a task of the earlier acquisition ran in the new one")
    with LockGuard(hook.database, KEY, LockPolicy(), scope=_role("member", again)) as handle:
        assert handle.fencing_token == newer
    with LockGuard(hook.database, KEY, LockPolicy(), scope=_role("leave", again)):
        pass
    assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone() == (0,)
    for bad in ("", lineage):  # empty, or the whole holder id: a lineage starts it and is shorter
        with pytest.raises(LockConfigurationError, match="lineage"):
            ScopeRole(kind="enter", holder=lineage if bad else earlier, lineage=bad)
    with pytest.raises(LockConfigurationError, match="lineage"):
        ScopeRole(kind="member", holder=earlier, lineage=lineage)


def test_a_setup_over_a_pool_run_again_takes_over_its_own_slot(hook: Any, scopes_db: Any) -> None:
    """Review -68: over a pool, the setup run again took whichever slot it reached first and left its
    earlier try's row live on another: one run held two slots until the lease, and another run was
    refused. It tries its own earlier slot first."""
    lineage, other = uuid.uuid4().hex, uuid.uuid4().hex

    def enter(holder: str, lineage: str | None) -> int | None:
        role = _role("enter", holder, lineage=lineage)
        with LockGuard(hook.database, KEY, LockPolicy(slots=2), scope=role) as handle:
            return handle.slot

    assert enter(other + uuid.uuid4().hex, other) == 1  # another run's scope takes slot 1
    ours = lineage + uuid.uuid4().hex
    assert enter(ours, lineage) == 2
    [(other_holder,)] = scopes_db.execute(
        "SELECT holder FROM pglock.scopes WHERE holder LIKE %s", [other + "%"]
    ).fetchall()
    with LockGuard(hook.database, KEY, LockPolicy(slots=2), scope=_role("leave", other_holder, slot=1)):
        pass  # its teardown frees slot 1
    again = lineage + uuid.uuid4().hex
    assert enter(again, lineage) == 2, "the setup run again took another slot than its own"
    rows = scopes_db.execute("SELECT holder FROM pglock.scopes").fetchall()
    assert rows == [(again,)], rows
    assert enter(uuid.uuid4().hex, None) == 1, "a third run finds slot 1 free"
    assert advisory_locks_left(scopes_db) == 0


def test_members_reenter_with_the_scopes_token_and_fail_as_lost_once_it_lapsed_or_went(
    hook: Any, scopes_db: Any
) -> None:
    holder = uuid.uuid4().hex
    token = _enter(hook, holder, fencing=True)
    with LockGuard(hook.database, KEY, LockPolicy(), scope=_role("member", holder)) as handle:
        assert handle.fencing_token == token
        assert scopes_db.execute("SELECT task_now FROM pglock.scopes").fetchone()[0] == "t"
    assert scopes_db.execute("SELECT task_now FROM pglock.scopes").fetchone()[0] is None
    stranger = uuid.uuid4().hex
    with (
        pytest.raises(LockLostError, match=r"dep: dag \w+ took the scope"),
        LockGuard(hook.database, KEY, LockPolicy(), scope=_role("member", stranger)),
    ):
        pytest.fail("a task of another acquisition re-entered")
    assert advisory_locks_left(scopes_db) == 0, "the refused guard took the key, then gave it back"
    scopes_db.execute("UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second'")
    with (
        pytest.raises(LockLostError, match=r"its lease ran out at .* another guard of the key may have run in the gap"),
        LockGuard(hook.database, KEY, LockPolicy(), scope=_role("member", holder)),
    ):
        pytest.fail("a task re-entered a lapsed scope")
    assert advisory_locks_left(scopes_db) == 0


def test_a_member_that_outlives_the_lease_keeps_and_renews_the_scope(hook: Any, scopes_db: Any) -> None:
    holder = uuid.uuid4().hex
    _enter(hook, holder, lease=300)
    with LockGuard(hook.database, KEY, LockPolicy(), scope=_role("member", holder, lease=300)):
        # The task runs past the lease: nobody can take the scope (this task holds the key).
        scopes_db.execute("UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second'")
        with (
            pytest.raises(LockBusyError),
            LockGuard(hook.database, KEY, LockPolicy()),
        ):
            pytest.fail("ran while a task of the scope held the key")
    live = scopes_db.execute("SELECT lease_until > clock_timestamp() FROM pglock.scopes").fetchone()[0]
    assert live, "the task's end renews the scope for the next task"


def test_the_teardown_frees_only_its_own_scope(hook: Any, scopes_db: Any, caplog: Any) -> None:
    """... and says when it found nothing of its own to free (it said "freed" all the same)."""
    import logging

    holder = uuid.uuid4().hex
    _enter(hook, holder)
    quiet = logging.getLogger("pglock-test-teardown")
    with (
        caplog.at_level(logging.WARNING, logger=quiet.name),
        LockGuard(hook.database, KEY, LockPolicy(), scope=_role("leave", uuid.uuid4().hex), logger=quiet) as _,
    ):
        pass
    assert "was already gone when it was to be freed" in caplog.text, caplog.text
    assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone()[0] == 1
    guard = LockGuard(hook.database, KEY, LockPolicy(), scope=_role("leave", holder))
    with guard:
        pass
    assert guard.scope_row is not None and guard.scope_row.holder == holder
    assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone()[0] == 0
    with (
        pytest.raises(LockLostError, match="the scope was freed"),
        LockGuard(hook.database, KEY, LockPolicy(), scope=_role("member", holder)),
    ):
        pytest.fail("a task re-entered a freed scope")
    assert advisory_locks_left(scopes_db) == 0, "the refused guard took the key, then gave it back"
    with LockGuard(hook.database, KEY, LockPolicy()):
        pass  # free for everyone again


def test_without_the_scopes_table_a_scope_fails_naming_init_db_and_guards_run(hook: Any, scopes_db: Any) -> None:
    schema_v4 = schema.MIGRATIONS[:4]
    scopes_db.execute("DROP SCHEMA pglock CASCADE")
    schema.migrate(scopes_db, schema_v4)
    with pytest.raises(LockConfigurationError, match="init-db"):
        _enter(hook, uuid.uuid4().hex)
    with LockGuard(hook.database, KEY, LockPolicy()):
        pass
    assert advisory_locks_left(scopes_db) == 0


def test_a_scope_refuses_shared_and_transaction_locks_before_connecting(hook: Any) -> None:
    for policy in (LockPolicy(mode="transaction"), LockPolicy(shared=True)):
        with pytest.raises(LockConfigurationError, match="a lock scope holds exclusive session locks"):
            LockGuard(hook.database, KEY, policy, scope=_role("enter", "h"))
    with pytest.raises(LockConfigurationError, match="needs the scope's holder id"):
        ScopeRole(kind="member", holder=None)


def test_setups_racing_for_one_scope_take_it_once(hook: Any, scopes_db: Any) -> None:
    """Many setups at once (each its own holder): exactly one takes the scope, the others are busy."""
    results: list[str] = []
    barrier = threading.Barrier(8)

    def setup() -> None:
        barrier.wait()
        try:
            _enter(hook, uuid.uuid4().hex)
            results.append("taken")
        except LockBusyError:
            results.append("busy")

    threads = [threading.Thread(target=setup) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results.count("taken") == 1 and results.count("busy") == 7, results
    assert scopes.read(scopes_db, KEY) is not None


def test_locks_shows_a_live_scope_in_its_table_and_json(hook: Any, scopes_db: Any, dsn: str, capsys: Any) -> None:
    from tests.ops_helpers import run_cli

    holder = uuid.uuid4().hex
    _enter(hook, holder, fencing=True)
    table = run_cli("locks", "--dsn", dsn, capsys=capsys)
    assert table.code == 0
    assert "1 lock scope(s) or deferred task(s), each held by a lease row between its tasks" in table.out
    assert "scopes/integration" in table.out and "- (between tasks)" in table.out and f"dag {holder[:6]}" in table.out
    data = run_cli("locks", "--dsn", dsn, "--output", "json", capsys=capsys).json()
    [scope] = data["scopes"]
    assert scope["key"]["name"] == "scopes/integration" and scope["run"] == f"dep: dag {holder[:6]}"
    assert scope["task_now"] is None and isinstance(scope["fencing_token"], int)
    other = run_cli("locks", "--dsn", dsn, "--key", "scopes/another", "--output", "json", capsys=capsys).json()
    assert other["scopes"] == []


def test_a_scope_rows_texts_are_shown_escaped_in_a_skip_and_in_locks(
    hook: Any, scopes_db: Any, dsn: str, capsys: Any
) -> None:
    """A row's run and task are text any writer of the table chose: an escape sequence or a
    newline in them must not reach a log or a terminal as such (a forged outcome line)."""
    from tests.ops_helpers import run_cli

    _enter(hook, uuid.uuid4().hex)
    forged = "prod: nightly\x1b[1G\x1b[2Kpglock outcome=completed key 'x'\nforged line\u202e"
    scopes_db.execute("UPDATE pglock.scopes SET run = %s, task_now = %s", [forged, "t\x07"])
    with pytest.raises(LockBusyError) as busy, LockGuard(hook.database, KEY, LockPolicy()):
        pytest.fail("ran inside another run's scope")
    message = str(busy.value)
    assert r"prod: nightly\x1b[1G\x1b[2Kpglock outcome=completed key 'x'\nforged line\u202e" in message, message
    assert r"task t\x07 running now" in message, message
    table = run_cli("locks", "--dsn", dsn, capsys=capsys)
    assert table.code == 0 and r"\x1b[2Kpglock" in table.out, table.out
    for unsafe in ("\x1b", "\x07", "\u202e"):
        assert unsafe not in message and unsafe not in table.out, repr(unsafe)
    assert not any(line.startswith("forged") for line in table.out.splitlines()), table.out


def test_locks_shows_a_live_scope_to_a_role_that_may_not_read_the_key_name_registry(
    hook: Any, scopes_db: Any, dsn: str, capsys: Any
) -> None:
    """Every role may read the scopes (init-db grants PUBLIC), not the registry: with another
    advisory lock held, `locks` asks the registry, is refused, and still lists the scope."""
    from tests.ops_helpers import run_cli, with_user

    role = "pglock_scope_noregistry"
    scopes_db.execute(f"DROP ROLE IF EXISTS {role}")
    scopes_db.execute(f"CREATE ROLE {role} LOGIN")
    _enter(hook, uuid.uuid4().hex)
    other = hook.acquire(LockKey.from_int(4242))
    assert other is not None
    try:
        data = run_cli("locks", "--dsn", with_user(dsn, role), "--output", "json", capsys=capsys).json()
        assert data["registry"] == "no access", data["registry"]
        assert [scope["key"]["name"] for scope in data["scopes"]] == ["scopes/integration"]
        only = run_cli("locks", "--dsn", with_user(dsn, role), "--key", "scopes/integration", capsys=capsys)
        assert only.code == 0 and "- (between tasks)" in only.out, only.out
    finally:
        other.release()
        scopes_db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role])
        scopes_db.execute(f"DROP ROLE {role}")


def test_a_busy_scope_says_when_to_try_again_by_the_database_clock(
    hook: Any, scopes_db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deferral behind a scope wakes at the lease's end (at most 30 s later). The time left was
    the row's lease_until minus this machine's clock: a worker 10 minutes ahead of the database
    read 0 s, and deferred again every 8 s instead. It is the database's own reckoning now."""
    import datetime as dt
    import types

    from airflow_pglock import scope_rules

    class TenMinutesAhead(dt.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:  # type: ignore[override]
            return dt.datetime.now(tz) + dt.timedelta(minutes=10)

    _enter(hook, uuid.uuid4().hex, lease=300.0)
    skewed = types.SimpleNamespace(datetime=TenMinutesAhead, timezone=dt.timezone, timedelta=dt.timedelta)
    monkeypatch.setattr(scope_rules, "dt", skewed, raising=False)
    with pytest.raises(LockBusyError) as busy, LockGuard(hook.database, KEY, LockPolicy()):
        pytest.fail("ran inside another run's scope")
    assert busy.value.retry_after is not None and 250 < busy.value.retry_after <= 300, busy.value.retry_after


def test_hook_acquire_finds_the_key_busy_while_another_runs_scope_is_live(hook: Any, scopes_db: Any) -> None:
    _enter(hook, uuid.uuid4().hex)
    assert hook.acquire(KEY) is None
    assert hook.acquire(KEY, timeout=1) is None
    assert advisory_locks_left(scopes_db) == 0
    held = hook.acquire(LockKey.from_name("scopes/another-key"))
    assert held is not None
    held.release()


def test_a_role_without_any_grant_still_sees_scopes_and_a_scope_needs_the_grant(
    hook: Any, scopes_db: Any, dsn: str
) -> None:
    """init-db lets every role read pglock.scopes: a guard that could not read it would have to fail."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from tests.ops_helpers import with_user

    role = "pglock_scope_reader"
    scopes_db.execute(f"DROP ROLE IF EXISTS {role}")
    scopes_db.execute(f"CREATE ROLE {role} LOGIN")
    try:
        reader = AdvisoryLockHook(dsn=with_user(dsn, role))
        with LockGuard(reader.database, KEY, LockPolicy()):
            pass  # no scope: it runs
        _enter(hook, uuid.uuid4().hex)
        with (
            pytest.raises(LockBusyError, match="is held by the lock scope"),
            LockGuard(reader.database, KEY, LockPolicy()),
        ):
            pytest.fail("ran inside another run's scope")
        scopes_db.execute("DELETE FROM pglock.scopes")
        with pytest.raises(LockConfigurationError, match=r"may not use pglock.scopes .* init-db --grant"):
            _enter(reader, uuid.uuid4().hex)
        assert advisory_locks_left(scopes_db) == 0
    finally:
        scopes_db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role])
        scopes_db.execute(f"DROP OWNED BY {role}")
        scopes_db.execute(f"DROP ROLE {role}")


def test_a_busy_scope_tells_how_long_until_its_lease_ends(hook: Any, scopes_db: Any) -> None:
    _enter(hook, uuid.uuid4().hex, lease=120)
    with pytest.raises(LockBusyError) as busy, LockGuard(hook.database, KEY, LockPolicy()):
        pytest.fail("ran inside another run's scope")
    assert busy.value.retry_after is not None and 60 < busy.value.retry_after <= 120


def test_a_guard_that_waited_for_the_key_reads_a_scope_begun_during_its_wait(hook: Any, scopes_db: Any) -> None:
    """Its lock statement read the horizon before the wait (no scope then): it reads the row after it."""
    scopes_db.execute("SELECT pg_advisory_lock(%s)", [KEY.int64])  # a setup holding the key
    outcome: list[BaseException | str] = []

    def waiter() -> None:
        try:
            with LockGuard(hook.database, KEY, LockPolicy(on_busy="wait", wait_timeout=4)):
                outcome.append("ran")
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=waiter)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        waiting = scopes_db.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        if waiting.fetchone()[0]:
            break
        time.sleep(0.02)
    taken, _ = scopes.enter(scopes_db, KEY, uuid.uuid4().hex, "dep: the setup", 300)
    assert taken
    scopes_db.execute("SELECT pg_advisory_unlock(%s)", [KEY.int64])
    thread.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], LockBusyError), outcome
    assert "is held by the lock scope of dep: the setup" in str(outcome[0])


def test_the_horizon_follows_the_latest_live_lease(hook: Any, scopes_db: Any) -> None:
    def horizon() -> int:
        return int(scopes_db.execute("SELECT pg_sequence_last_value('pglock.scope_horizon')").fetchone()[0] or 0)

    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    _enter(hook, first, lease=300)
    row = scopes.read(scopes_db, KEY)
    assert row is not None and horizon() >= row.lease_until.timestamp()
    other = LockKey.from_name("scopes/second")
    with LockGuard(hook.database, other, LockPolicy(), scope=_role("enter", second, lease=900)):
        pass
    later = horizon()
    with LockGuard(hook.database, KEY, LockPolicy(), scope=_role("leave", first)):
        pass
    assert horizon() == later, "the other scope is still live: the horizon stays at its lease"
    with LockGuard(hook.database, other, LockPolicy(), scope=_role("leave", second)):
        pass
    assert horizon() == 0


def test_lock_sessions_and_sub_keys_find_a_scopes_key_busy(hook: Any, scopes_db: Any) -> None:
    free = LockKey.from_name("scopes/free-key")
    with hook.lock_session() as session:
        with session.try_lock(KEY) as sub:
            assert sub is not None, "no scope yet: taken"
        _enter(hook, uuid.uuid4().hex)
        with session.try_lock(KEY) as sub:
            assert sub is None, "another run's scope holds it: busy"
        taken = session.try_lock_many([KEY, free])
        assert [sub.key for sub in taken] == [free]
        assert session.release(*taken)
        with session.lock(KEY, timeout=1) as waited:
            assert waited is None
        assert session.held() == []
    with LockGuard(hook.database, LockKey.from_name("scopes/owner"), LockPolicy()) as handle:
        with handle.try_lock(KEY) as sub:
            assert sub is None
        assert [sub.key for sub in handle.try_lock_many([free, KEY])] == [free]
    assert advisory_locks_left(scopes_db) == 0


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_batch_naming_a_scopes_key_also_by_its_number_finds_it_busy(hook: Any, scopes_db: Any, mode: str) -> None:
    """The same key twice in one batch, first by its number (which reads no scope row), then by its
    name: it is taken once, and as the named key, which another run's scope holds: busy."""
    _enter(hook, uuid.uuid4().hex)
    with LockGuard(hook.database, LockKey.from_name("scopes/owner"), LockPolicy(mode=mode)) as handle:
        assert handle.try_lock_many([LockKey.from_int(KEY.int64), KEY]) == []
        assert handle.held() == []
    assert advisory_locks_left(scopes_db) == 0


@pytest.mark.parametrize("timeout", ["lock_timeout", "statement_timeout"])
def test_a_renewal_whose_horizon_raise_fails_is_rolled_back(scopes_db: Any, dsn: str, timeout: str) -> None:
    """The row and the horizon it raises are one transaction: never a live lease beyond the horizon.

    The raise finds the horizon's lock busy (another scope being written) past the session's
    ``lock_timeout`` or ``statement_timeout``. It tries the lock and never waits for it on the
    server: a writer frozen in such a wait would keep its session, and its key, past
    the dead-holder bound."""
    holder = uuid.uuid4().hex
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", [KEY.int64])
        taken, row = scopes.enter(conn, KEY, holder, "dep: the setup", 5)
        assert taken and row is not None
        before = row.lease_until
        scopes_db.execute("SELECT pg_advisory_lock(%s)", [scopes.HORIZON_LOCK_KEY.int64])  # the raise will try in vain
        conn.execute(f"SET {timeout} = '700ms'")
        failed: list[BaseException] = []

        def renew() -> None:
            try:
                scopes.rejoin(conn, KEY, holder, "t", 300)
            except BaseException as error:
                failed.append(error)

        thread = threading.Thread(target=renew)
        thread.start()
        waits_seen = 0
        while thread.is_alive():
            waits_seen += scopes_db.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND pid = %s",
                [conn.pgconn.backend_pid],
            ).fetchone()[0]
            time.sleep(0.01)
        thread.join()
        scopes_db.execute("SELECT pg_advisory_unlock(%s)", [scopes.HORIZON_LOCK_KEY.int64])
        assert waits_seen == 0, "the raise waited for the horizon's lock on the server"
        assert failed and isinstance(failed[0], ScopeHorizonBusyError), failed
        assert "stayed busy for 700 ms, this session's lock_timeout or statement_timeout" in str(failed[0]), failed[0]
        after = scopes.read(scopes_db, KEY)
        assert after is not None and after.lease_until == before, "the renewal was rolled back with its raise"
        horizon = scopes_db.execute("SELECT pg_sequence_last_value('pglock.scope_horizon')").fetchone()[0]
        assert horizon >= before.timestamp()


def test_roles_without_usage_on_the_schema_lock_as_before_and_a_scope_needs_public_reads(
    hook: Any, scopes_db: Any, dsn: str
) -> None:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from tests.ops_helpers import with_user

    role = "pglock_scope_nousage"
    scopes_db.execute("DROP SCHEMA pglock CASCADE")
    schema.migrate(scopes_db, schema.MIGRATIONS[:4])  # before lock scopes: no grant to PUBLIC
    scopes_db.execute(f"DROP ROLE IF EXISTS {role}")
    scopes_db.execute(f"CREATE ROLE {role} LOGIN")
    try:
        plain = AdvisoryLockHook(dsn=with_user(dsn, role))
        with LockGuard(plain.database, KEY, LockPolicy()):
            pass  # as before version 5: the registry is out of its reach, the lock works
        schema.migrate(scopes_db)
        scopes_db.execute("REVOKE SELECT ON pglock.scopes FROM PUBLIC")
        with pytest.raises(LockConfigurationError, match="one of them was revoked"):
            _enter(hook, uuid.uuid4().hex)
        scopes_db.execute("GRANT SELECT ON pglock.scopes TO PUBLIC")
        _enter(hook, uuid.uuid4().hex)
        with (
            pytest.raises(LockBusyError, match="is held by the lock scope"),
            LockGuard(plain.database, KEY, LockPolicy()),
        ):
            pytest.fail("a role without any grant ran inside another run's scope")
    finally:
        scopes_db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role])
        scopes_db.execute(f"DROP OWNED BY {role}")
        scopes_db.execute(f"DROP ROLE {role}")


def test_doctor_reports_the_scopes_grants_and_live_scopes(hook: Any, scopes_db: Any, dsn: str, capsys: Any) -> None:
    from tests.ops_helpers import run_cli

    _enter(hook, uuid.uuid4().hex)
    checks = {c["name"]: c for c in run_cli("doctor", "--dsn", dsn, "--output", "json", capsys=capsys).json()["checks"]}
    assert checks["scopes"]["status"] == "ok" and "1 lock scope(s) live" in checks["scopes"]["summary"]
    scopes_db.execute("REVOKE SELECT ON pglock.scope_horizon FROM PUBLIC")
    try:
        doctor = run_cli("doctor", "--dsn", dsn, "--output", "json", capsys=capsys)
        scope_check = {c["name"]: c for c in doctor.json()["checks"]}["scopes"]
        assert scope_check["status"] == "problem" and "PUBLIC may not read the lock scopes" in scope_check["summary"]
        assert doctor.code == 1
    finally:
        scopes_db.execute("GRANT SELECT ON pglock.scope_horizon TO PUBLIC")


def _completions(admin: Any) -> list[tuple[Any, ...]]:
    return admin.execute("SELECT period, fencing_token FROM pglock.completions").fetchall()


def _leave_recording(hook: Any, holder: str, work: Any = None) -> LockGuard:
    """A scope's teardown with once_per, as the teardown of a scope whose every task succeeded runs it."""
    from airflow_pglock.run_rules import RunRules

    guard = LockGuard(
        hook.database, KEY, LockPolicy(), scope=_role("leave", holder), rules=RunRules(period="2026-12-01")
    )
    guard.run(work or (lambda handle: None))
    return guard


def test_a_recording_teardown_records_the_completion_with_the_scopes_token_then_frees_the_scope(
    hook: Any, scopes_db: Any
) -> None:
    holder = uuid.uuid4().hex
    token = _enter(hook, holder, fencing=True)
    guard = _leave_recording(hook, holder)
    assert guard.outcome == "completed"
    assert _completions(scopes_db) == [("2026-12-01", token)]
    assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone()[0] == 0
    assert advisory_locks_left(scopes_db) == 0


def test_a_recording_teardown_whose_session_ends_before_the_record_keeps_the_scope_and_records_nothing(
    hook: Any, scopes_db: Any
) -> None:
    """Freed only after the record: a teardown cut off before it leaves the row, so the next setup
    waits for the lease instead of finding neither the row nor the completion."""
    holder = uuid.uuid4().hex
    _enter(hook, holder)

    def end_session(handle: Any) -> None:
        scopes_db.execute("SELECT pg_terminate_backend(%s)", [handle.backend_pid])

    with pytest.raises(LockLostError):
        _leave_recording(hook, holder, end_session)
    assert _completions(scopes_db) == []
    rows = scopes_db.execute("SELECT holder, lease_until > clock_timestamp() FROM pglock.scopes").fetchall()
    assert rows == [(holder, True)], "the scope stays held until its lease ends"
    with pytest.raises(LockBusyError, match="is held by the lock scope"):
        _enter(hook, uuid.uuid4().hex)


@pytest.mark.parametrize("taken", [False, True], ids=["lapsed", "lapsed-and-taken"])
def test_a_recording_teardown_whose_scope_lapsed_records_nothing_and_fails_as_lost(
    hook: Any, scopes_db: Any, taken: bool
) -> None:
    holder = uuid.uuid4().hex
    _enter(hook, holder)
    scopes_db.execute("UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second'")
    other = uuid.uuid4().hex
    if taken:
        _enter(hook, other)
    with pytest.raises(LockLostError, match=r"before its teardown: .*; no completion recorded"):
        _leave_recording(hook, holder)
    assert _completions(scopes_db) == []
    left = scopes_db.execute("SELECT holder FROM pglock.scopes").fetchall()
    assert left == ([(other,)] if taken else []), "it deletes its own lapsed row only (nothing left behind)"
    assert advisory_locks_left(scopes_db) == 0


def test_a_recording_teardown_whose_delete_fails_records_nothing_and_its_retry_records_and_frees(
    hook: Any, scopes_db: Any
) -> None:
    """The record and the delete are one transaction: a failed delete rolls the record back, the
    row keeps the scope, and a retry of the teardown finds its own row, records and frees."""
    holder = uuid.uuid4().hex
    token = _enter(hook, holder, fencing=True)
    scopes_db.execute(
        "CREATE FUNCTION pglock.refuse_delete() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN RAISE EXCEPTION 'pglock test: delete refused'; END$$;"
        "CREATE TRIGGER refuse_delete BEFORE DELETE ON pglock.scopes FOR EACH ROW"
        " EXECUTE FUNCTION pglock.refuse_delete()"
    )
    with pytest.raises(Exception, match="delete refused"):
        _leave_recording(hook, holder)
    assert _completions(scopes_db) == [], "the failed delete rolled the record back"
    assert scopes_db.execute("SELECT holder FROM pglock.scopes").fetchall() == [(holder,)]
    scopes_db.execute("DROP TRIGGER refuse_delete ON pglock.scopes")
    assert _leave_recording(hook, holder).outcome == "completed"
    assert _completions(scopes_db) == [("2026-12-01", token)]
    assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone()[0] == 0
    assert advisory_locks_left(scopes_db) == 0


def test_a_session_that_keeps_the_horizons_lock_fails_a_setup_in_time_naming_it(
    hook: Any, scopes_db: Any, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any session of the database may take the horizon's key (an advisory key like any other)
    and keep it. A scope's sessions set no lock_timeout: the setup must still give up, fail (not
    skip, not hang holding its key) and name who keeps the lock."""
    # raising=False: the test also runs against the code before the bound (it must fail there).
    monkeypatch.setattr(scopes, "HORIZON_WAIT_SECONDS", 0.5, raising=False)
    ended: list[BaseException | None] = []

    def setup() -> None:
        try:
            _enter(hook, uuid.uuid4().hex)
            ended.append(None)
        except BaseException as error:
            ended.append(error)

    with psycopg.connect(dsn, autocommit=True, application_name="foreign nightly batch") as foreign:
        foreign.execute("SELECT pg_advisory_lock(%s)", [scopes.HORIZON_LOCK_KEY.int64])
        thread = threading.Thread(target=setup, daemon=True)
        thread.start()
        thread.join(20)
        still_trying = thread.is_alive()
    thread.join(20)
    assert not still_trying, "the setup still tried the horizon's lock after 20 s, holding its key"
    assert ended and ended[0] is not None, "the setup ran while the horizon's lock was kept"
    assert isinstance(ended[0], ScopeHorizonBusyError), ended[0]
    assert re.search(r"stayed busy for 500 ms.*'foreign nightly batch'", str(ended[0])), ended[0]
    assert scopes.read(scopes_db, KEY) is None, "the setup's row outlived its failure"
    assert advisory_locks_left(scopes_db) == 0


def test_a_member_that_finds_its_scope_taken_names_the_taker_escaped(hook: Any, scopes_db: Any) -> None:
    """The message of a member's lost scope quotes the row that took it: text any writer of the
    table chose, which reaches Airflow's task log with the exception."""
    holder = uuid.uuid4().hex
    _enter(hook, holder)
    forged = "prod: nightly\x1b[2K\rpglock outcome=completed key 'x'\nFORGED LINE"
    scopes_db.execute("UPDATE pglock.scopes SET holder = %s, run = %s", [uuid.uuid4().hex, forged])
    with (
        pytest.raises(LockLostError) as lost,
        LockGuard(hook.database, KEY, LockPolicy(), scope=_role("member", holder)),
    ):
        pytest.fail("a member ran in a scope another run took")
    message = str(lost.value)
    assert r"prod: nightly\x1b[2K\rpglock outcome=completed key 'x'\nFORGED LINE took the scope" in message, message
    assert "\x1b" not in message and "\n" not in message and "\r" not in message


def test_a_busy_horizon_fails_a_deferral_and_spares_a_teardown_that_freed_its_scope(
    hook: Any, scopes_db: Any, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The horizon's lock kept by another session past the bound: a hand-over to the triggerer
    (which raises the horizon) fails as an error, not as a lost lock nor a broken connection; a
    teardown whose row is deleted only lowers the horizon (best effort), so it completes."""
    from airflow_pglock.scope_rules import HandOver

    monkeypatch.setattr(scopes, "HORIZON_WAIT_SECONDS", 0.5, raising=False)
    holder = uuid.uuid4().hex
    _enter(hook, holder)
    ran: list[str] = []
    with psycopg.connect(dsn, autocommit=True, application_name="foreign batch") as foreign:
        foreign.execute("SELECT pg_advisory_lock(%s)", [scopes.HORIZON_LOCK_KEY.int64])
        LockGuard(hook.database, KEY, LockPolicy(), scope=_role("leave", holder)).run(lambda h: ran.append("teardown"))
        assert ran == ["teardown"] and scopes.read(scopes_db, KEY) is None
        deferring = ScopeRole(holder=uuid.uuid4().hex, run="dep: dag run", task="op", lease=30.0, hands_over=True)
        guard = LockGuard(hook.database, KEY, LockPolicy(), scope=deferring)
        with pytest.raises(ScopeHorizonBusyError, match="'foreign batch'"):
            guard.run(lambda handle: HandOver(None))
        assert guard.outcome == "failed", guard.outcome
    assert advisory_locks_left(scopes_db) == 0
