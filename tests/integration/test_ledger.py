"""Completions and fencing tokens on a real PostgreSQL (hook level)."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockConfigurationError, LockLostError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import ledger, schema
from tests.helpers import held_lock


@pytest.fixture
def installed(admin: Any) -> Any:
    schema.migrate(admin)
    yield admin
    admin.execute("DROP SCHEMA pglock CASCADE")


def test_missing_tables_name_the_command(hook: AdvisoryLockHook, admin: Any) -> None:
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")
    with held_lock(hook, "no-tables") as held:
        assert held is not None
        with pytest.raises(LockConfigurationError, match="airflow-pglock init-db"):
            ledger.completion_for_period(held.connection, held.key, "2026-11-30")
        with pytest.raises(LockConfigurationError, match="airflow-pglock init-db"):
            ledger.issue_fencing_token(held.connection, held.key, "me", shared=held.shared, xact_id=held.xact_id)
    with held_lock(hook, "no-tables", mode="transaction") as held:
        assert held is not None
        with pytest.raises(LockConfigurationError, match="init-db"):
            ledger.last_completion(held.connection, held.key)
        # the savepoint kept the lock's transaction usable
        assert held.connection.execute("SELECT 1").fetchone() == (1,)


def test_tokens_only_grow_per_key_and_across_keys(hook: AdvisoryLockHook, installed: Any) -> None:
    tokens = []
    for name in ["fenced", "fenced", "other", "fenced"]:
        with held_lock(hook, name) as held:
            assert held is not None
            tokens.append(
                ledger.issue_fencing_token(held.connection, held.key, "test", shared=held.shared, xact_id=held.xact_id)
            )
    assert tokens == sorted(tokens) and len(set(tokens)) == 4
    assert installed.execute("SELECT pglock.current_fencing_token('fenced')").fetchone()[0] == tokens[3]


def test_rolled_back_token_is_never_reissued(hook: AdvisoryLockHook, installed: Any) -> None:
    with pytest.raises(RuntimeError), held_lock(hook, "tx-fenced", mode="transaction") as held:
        assert held is not None
        rolled_back = ledger.issue_fencing_token(
            held.connection, held.key, "first", shared=held.shared, xact_id=held.xact_id
        )
        raise RuntimeError("work failed")
    with held_lock(hook, "tx-fenced", mode="transaction") as held:
        assert held is not None
        assert (
            ledger.issue_fencing_token(held.connection, held.key, "second", shared=held.shared, xact_id=held.xact_id)
            > rolled_back
        )


def test_stale_token_write_is_rejected_by_the_sql_helpers(hook: AdvisoryLockHook, installed: Any) -> None:
    installed.execute(
        "DROP TABLE IF EXISTS forecasts; CREATE TABLE forecasts (station int, value float8, fencing_token bigint);"
        " CREATE TRIGGER forecasts_fenced BEFORE INSERT OR UPDATE ON forecasts FOR EACH ROW"
        " EXECUTE FUNCTION pglock.reject_stale_fencing_token('refresh-forecasts')"
    )
    key = LockKey.from_name("refresh-forecasts")
    with held_lock(hook, key) as held:
        assert held is not None
        old = ledger.issue_fencing_token(
            held.connection, held.key, "old holder", shared=held.shared, xact_id=held.xact_id
        )
    with held_lock(hook, key) as held:
        assert held is not None
        new = ledger.issue_fencing_token(
            held.connection, held.key, "new holder", shared=held.shared, xact_id=held.xact_id
        )
    installed.execute("INSERT INTO forecasts VALUES (1, 20.5, %s)", [new])
    with pytest.raises(psycopg.errors.CheckViolation, match=f"stale fencing token {old}"):
        installed.execute("INSERT INTO forecasts VALUES (1, 19.0, %s)", [old])
    with pytest.raises(psycopg.errors.CheckViolation, match="no fencing token"):
        installed.execute("INSERT INTO forecasts (station, value) VALUES (2, 1.0)")
    assert installed.execute("SELECT pglock.assert_fencing_token('refresh-forecasts', %s)", [new]).fetchone() == (new,)
    with pytest.raises(psycopg.errors.CheckViolation):
        installed.execute("SELECT pglock.assert_fencing_token(%s::bigint, %s)", [key.numbers[0], old])
    assert installed.execute("SELECT count(*) FROM forecasts").fetchone()[0] == 1
    installed.execute("DROP TABLE forecasts")


def test_a_key_that_never_had_a_token_is_refused(hook: AdvisoryLockHook, installed: Any) -> None:
    """A token is valid only for a key that was issued one: a typo in the key name must not pass."""
    with held_lock(hook, "refresh-forecasts") as held:
        assert held is not None
        token = ledger.issue_fencing_token(
            held.connection, held.key, "holder", shared=held.shared, xact_id=held.xact_id
        )
    typo = "no fencing token was ever issued for lock key 'refresh-forecsts'"
    with pytest.raises(psycopg.errors.CheckViolation, match=typo):
        installed.execute("SELECT pglock.assert_fencing_token('refresh-forecsts', %s)", [token])
    never = LockKey.from_int(4242)
    with pytest.raises(psycopg.errors.CheckViolation, match=r"ever issued for lock key \(int64 4242\)"):
        installed.execute("SELECT pglock.assert_fencing_token(%s::bigint, %s)", [never.numbers[0], token])
    installed.execute(
        "CREATE TABLE typo_forecasts (station int, fencing_token bigint);"
        " CREATE TRIGGER typo_fenced BEFORE INSERT ON typo_forecasts FOR EACH ROW"
        " EXECUTE FUNCTION pglock.reject_stale_fencing_token('refresh-forecsts')"
    )
    try:
        with pytest.raises(psycopg.errors.CheckViolation, match="'refresh-forecsts'"):
            installed.execute("INSERT INTO typo_forecasts VALUES (1, %s)", [token])
        assert installed.execute("SELECT count(*) FROM typo_forecasts").fetchone() == (0,)
    finally:
        installed.execute("DROP TABLE typo_forecasts")
    assert installed.execute("SELECT pglock.assert_fencing_token('refresh-forecasts', %s)", [token]).fetchone() == (
        token,
    )


def test_completions_on_the_database_clock(hook: AdvisoryLockHook, installed: Any) -> None:
    key = LockKey.from_name("settle")
    identity = TaskIdentity("settlement", "settle", "scheduled__2026-11-30T02:00:00+00:00")
    with held_lock(hook, key) as held:
        assert held is not None
        assert ledger.completion_for_period(held.connection, key, "2026-11-30") is None
        ledger.record_completion(held.connection, key, "2026-11-30", identity, 7)
        done = ledger.completion_for_period(held.connection, key, "2026-11-30")
        assert done is not None and done.run_id == identity.run_id and done.fencing_token == 7
        assert 0 <= done.age_seconds < 60
        assert "by settlement/settle run scheduled__2026-11-30T02:00:00+00:00" in done.describe()
    installed.execute("UPDATE pglock.completions SET completed_at = now() - interval '2 hours'")
    with held_lock(hook, key) as held:
        assert held is not None
        latest = ledger.last_completion(held.connection, key)
        assert latest is not None and 7190 < latest.age_seconds < 7300


def test_concurrent_init_db_is_safe(dsn: str, admin: Any) -> None:
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")
    results: list[Any] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                start.wait()
                results.append(schema.migrate(conn))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sorted(len(r.applied) for r in results) == [0, 0, 0, schema.LATEST_VERSION]
    assert schema.schema_status(admin).installed == schema.LATEST_VERSION
    admin.execute("DROP SCHEMA pglock CASCADE")


@pytest.mark.parametrize("name", ["refresh-forecasts", "北京/导出", "it's", "emoji 🚀"])
def test_sql_name_key_function_follows_the_keys_rule(installed: Any, name: str) -> None:
    assert installed.execute("SELECT pglock.name_key(%s)", [name]).fetchone()[0] == LockKey.from_name(name).numbers[0]


def test_a_token_is_issued_only_while_the_lock_is_held(hook: AdvisoryLockHook, installed: Any) -> None:
    """The statement that records a token checks the lock itself: a session that no longer holds
    the key gets no token (None), and the key's newest token stays what it was."""
    with pytest.raises(LockLostError), held_lock(hook, "fenced-check") as held:
        assert held is not None
        first = ledger.issue_fencing_token(
            held.connection, held.key, "holder", shared=held.shared, xact_id=held.xact_id
        )
        assert first is not None
        held.connection.execute("SELECT pg_advisory_unlock_all()")  # session mode: the key is gone
        assert (
            ledger.issue_fencing_token(held.connection, held.key, "holder", shared=held.shared, xact_id=held.xact_id)
            is None
        )
    assert installed.execute("SELECT pglock.current_fencing_token('fenced-check')").fetchone()[0] == first
    with held_lock(hook, "fenced-check") as held:
        assert held is not None
        later = ledger.issue_fencing_token(
            held.connection, held.key, "next holder", shared=held.shared, xact_id=held.xact_id
        )
        assert later is not None and later > first


def test_a_transaction_lock_token_issued_aside_checks_the_lock_transaction(
    hook: AdvisoryLockHook, installed: Any
) -> None:
    """Transaction mode issues the token on a side connection: the statement checks that the
    lock's session still holds the key in the transaction that took it."""
    with (
        pytest.raises(psycopg.errors.NoActiveSqlTransaction),  # the lock ended with its transaction
        held_lock(hook, "fenced-aside", mode="transaction") as held,
    ):
        assert held is not None
        with hook.database.side_connection() as side:
            token = ledger.issue_fencing_token(
                side, held.key, "holder", holder_pid=held.server.backend_pid, shared=held.shared, xact_id=held.xact_id
            )
            assert token is not None
            # the same key again, but in a new transaction: not the lock that was taken
            held.connection.execute("COMMIT")
            held.connection.execute("BEGIN")
            held.connection.execute("SELECT pg_advisory_xact_lock(%s::bigint)", held.key.numbers)
            assert (
                ledger.issue_fencing_token(
                    side,
                    held.key,
                    "holder",
                    holder_pid=held.server.backend_pid,
                    shared=held.shared,
                    xact_id=held.xact_id,
                )
                is None
            )
        held.connection.execute("ROLLBACK")
    assert installed.execute("SELECT pglock.current_fencing_token('fenced-aside')").fetchone()[0] == token


def test_a_recorded_token_never_goes_down(hook: AdvisoryLockHook, installed: Any) -> None:
    """Should the sequence ever lag behind the newest recorded token (set back by hand), the
    record refuses the smaller number instead of reopening the door to older tokens, and the run
    fails saying so and what to run (not as a lost lock: every later try would fail the same way)."""
    installed.execute("SELECT setval('pglock.fencing_token_seq', 100)")
    with held_lock(hook, "fenced-down") as held:
        assert held is not None
        newest = ledger.issue_fencing_token(
            held.connection, held.key, "holder", shared=held.shared, xact_id=held.xact_id
        )
        assert newest is not None
        installed.execute("SELECT setval('pglock.fencing_token_seq', 1, false)")
        with pytest.raises(LockConfigurationError) as refused:
            ledger.issue_fencing_token(held.connection, held.key, "holder", shared=held.shared, xact_id=held.xact_id)
        message = str(refused.value)
        assert f"is {newest}, ahead of the sequence" in message and "this run drew 1" in message, message
        setval = _named_setval(message)
        assert setval is not None, message
    assert installed.execute("SELECT pglock.current_fencing_token('fenced-down')").fetchone()[0] == newest
    installed.execute(setval)
    with held_lock(hook, "fenced-down") as held:  # the remedy it names
        assert held is not None
        assert ledger.issue_fencing_token(held.connection, held.key, "holder", shared=held.shared) == newest + 1


def test_a_sequence_that_hands_numbers_out_of_order_is_named(hook: AdvisoryLockHook, installed: Any) -> None:
    """CACHE > 1: each session draws from a range of its own, so a later hold may draw a smaller
    number than an earlier one's; the record refuses it, and the run is told why (review of 04e59e8)."""
    installed.execute("ALTER SEQUENCE pglock.fencing_token_seq CACHE 10")
    with held_lock(hook, "fenced-cache") as held:
        assert held is not None
        early = ledger.issue_fencing_token(held.connection, held.key, "holder", shared=held.shared)
        assert early is not None
    installed.execute("SELECT setval('pglock.fencing_token_seq', (SELECT max(token) FROM pglock.fencing_tokens))")
    installed.execute("UPDATE pglock.fencing_tokens SET token = token + 50 WHERE key_name = 'fenced-cache'")
    with held_lock(hook, "fenced-cache") as held, pytest.raises(LockConfigurationError, match="has CACHE 10") as cached:
        assert held is not None
        ledger.issue_fencing_token(held.connection, held.key, "holder", shared=held.shared)
    # The setval it names leaves out a row at the sequence's maximum (review -85).
    assert f"WHERE token < {2**63 - 1}))" in (_named_setval(str(cached.value)) or ""), cached.value


def _refused_fenced_run(hook: AdvisoryLockHook, key: LockKey, mode: str) -> str:
    """The message of a fenced run refused as a configuration error; the work did not run."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.run_rules import RunRules

    worked = False
    with (
        pytest.raises(LockConfigurationError) as refused,
        LockGuard(hook.database, key, LockPolicy(mode=mode), rules=RunRules(fencing=True)),
    ):
        worked = True
    assert not worked
    return str(refused.value)


@pytest.mark.parametrize("mode", ["session", "transaction"])
@pytest.mark.parametrize("ahead", [10**9, None], ids=["far-ahead", "at-the-sequence-maximum"])
def test_a_token_row_set_ahead_by_hand_fails_the_run_naming_the_row_and_a_remedy_that_works(
    hook: AdvisoryLockHook, installed: Any, mode: str, ahead: int | None
) -> None:
    """A key's row in pglock.fencing_tokens set far ahead of the sequence by hand (an UPDATE; the
    trigger lets a token go up only): every fenced run of the key fails, as a configuration error
    (not as lost) naming the key, the row's token and the sequence's last value, and what to run.
    The remedy it names must work: at the sequence's maximum the setval it named before exhausted
    the sequence (every fenced run of every key then failed in nextval); deleting the row (never
    handed to a holder) does not (review -69)."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.run_rules import RunRules

    key = LockKey.from_name(f"fenced-ahead-{mode}")

    def fenced_run() -> int | None:
        with LockGuard(hook.database, key, LockPolicy(mode=mode), rules=RunRules(fencing=True)) as handle:
            return handle.fencing_token

    first = fenced_run()
    assert first is not None
    row = installed.execute(
        "UPDATE pglock.fencing_tokens SET token = %s WHERE key_name = %s RETURNING token",
        (first + ahead if ahead is not None else 2**63 - 1, key.name),
    ).fetchone()[0]
    message = _refused_fenced_run(hook, key, mode)
    last = installed.execute("SELECT last_value FROM pglock.fencing_token_seq").fetchone()[0]
    assert key.describe() in message and f"is {row}, ahead of the sequence" in message, message
    assert f"last value {last}" in message and "set ahead by hand" in message, message
    assert "lost" not in message, message
    delete = re.search(r"DELETE FROM pglock\.fencing_tokens WHERE [^;]*;", message)
    assert delete is not None, message
    setval = _named_setval(message)
    if ahead is None:  # no number is left past it: only the delete mends it
        assert setval is None, message
        installed.execute(delete.group(0))
        assert fenced_run() == last + 1
    else:
        assert setval is not None, message
        installed.execute(setval)
        assert fenced_run() == row + 1
    assert installed.execute("SELECT pglock.current_fencing_token(%s::text)", (key.name,)).fetchone()[0] > first


@pytest.mark.parametrize("restarted", [False, True], ids=["sequence-as-is", "sequence-restarted-meanwhile"])
def test_a_newer_token_recorded_after_this_draw_is_not_read_as_the_sequence_set_back(
    hook: AdvisoryLockHook, installed: Any, restarted: bool
) -> None:
    """A later holder (this one lost the key) that drew after this draw and recorded first: its token
    is at most the sequence's last value, so this holder records nothing and is not told to reset
    the sequence (the guard reports its lock lost). Nor when the sequence was restarted forward
    meanwhile, which leaves its last value unsaid (review of 04e59e8)."""
    with held_lock(hook, "fenced-race") as held:
        assert held is not None
        first = ledger.issue_fencing_token(held.connection, held.key, "holder", shared=held.shared)
        assert first is not None
        with psycopg.connect(installed.info.dsn) as later:  # a transaction: it keeps the row locked
            later.execute("SELECT token FROM pglock.fencing_tokens WHERE key_name = 'fenced-race' FOR UPDATE")
            issued: list[Any] = []
            waiting = threading.Thread(
                target=lambda: issued.append(
                    _outcome(lambda: ledger.issue_fencing_token(held.connection, held.key, "holder", shared=False))
                )
            )
            waiting.start()
            _wait_for_row_lock(installed, held.server.backend_pid)  # it drew, and waits for the row
            later.execute(
                "UPDATE pglock.fencing_tokens SET token = nextval('pglock.fencing_token_seq')"
                " WHERE key_name = 'fenced-race' RETURNING token"
            )
            newer = later.execute("SELECT token FROM pglock.fencing_tokens WHERE key_name = 'fenced-race'").fetchone()
            if restarted:
                later.execute("ALTER SEQUENCE pglock.fencing_token_seq RESTART WITH 1000000")
            later.commit()
            waiting.join(30)
        assert issued == [None], issued
    assert installed.execute("SELECT pglock.current_fencing_token('fenced-race')").fetchone()[0] == newer[0]


def _outcome(call: Any) -> Any:
    try:
        return call()
    except Exception as error:
        return error


def _wait_for_row_lock(admin: Any, backend_pid: int) -> None:
    deadline = time.monotonic() + 30
    while admin.execute(
        "SELECT wait_event_type IS DISTINCT FROM 'Lock' FROM pg_stat_activity WHERE pid = %s", (backend_pid,)
    ).fetchone()[0]:
        assert time.monotonic() < deadline, "the token's statement never waited for the row"
        time.sleep(0.02)


def test_min_interval_fails_on_a_completion_dated_in_the_future_instead_of_skipping_until_then(
    hook: AdvisoryLockHook, installed: Any
) -> None:
    """A completion is dated by the database: one far in its future (a clock set back, a row
    written by hand) would skip every run until that date. Past a moment's tolerance the run
    fails, saying why; within it, the key is simply too fresh."""
    from airflow_pglock.exceptions import AlreadyDoneError, PgLockError
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.run_rules import RunRules

    key = LockKey.from_name("fresh-forecasts")
    identity = TaskIdentity("forecasts", "refresh", "manual__1")
    with held_lock(hook, key) as held:
        assert held is not None
        ledger.record_completion(held.connection, key, "p", identity, None)
    ran: list[bool] = []
    installed.execute("UPDATE pglock.completions SET completed_at = now() + interval '10 seconds'")
    with pytest.raises(AlreadyDoneError, match="less than min_interval"):
        LockGuard(hook.database, key, LockPolicy(), rules=RunRules(min_interval=60)).run(lambda lock: ran.append(True))
    installed.execute("UPDATE pglock.completions SET completed_at = '2999-01-01'")
    with pytest.raises(PgLockError, match=r"dated \d+ s in the future of the database clock") as failed:
        LockGuard(hook.database, key, LockPolicy(), rules=RunRules(min_interval=60)).run(lambda lock: ran.append(True))
    assert not isinstance(failed.value, AlreadyDoneError)
    assert ran == []


def test_a_recorded_token_row_cannot_be_set_lower_or_moved_by_hand(hook: AdvisoryLockHook, installed: Any) -> None:
    """Every task role may UPDATE pglock.fencing_tokens (the provider's statement only raises a
    row): a row set lower, or moved to another key, would let a stale token pass the checks."""
    tokens = []
    for _ in range(2):
        with held_lock(hook, "fenced-by-hand") as held:
            assert held is not None
            tokens.append(
                ledger.issue_fencing_token(
                    held.connection, held.key, "holder", shared=held.shared, xact_id=held.xact_id
                )
            )
    older, newest = tokens
    assert older is not None and newest is not None and older < newest
    with pytest.raises(psycopg.errors.CheckViolation, match="cannot go down"):
        installed.execute("UPDATE pglock.fencing_tokens SET token = %s WHERE key_name = 'fenced-by-hand'", [older])
    other = LockKey.from_name("fenced-elsewhere")
    with pytest.raises(psycopg.errors.CheckViolation, match="cannot move to another key"):
        installed.execute(
            "UPDATE pglock.fencing_tokens SET classid = %s, objid = %s WHERE key_name = 'fenced-by-hand'",
            [other.pg_locks[0], other.pg_locks[1]],
        )
    with pytest.raises(psycopg.errors.CheckViolation, match="stale fencing token"):
        installed.execute("SELECT pglock.assert_fencing_token('fenced-by-hand', %s)", [older])
    installed.execute("UPDATE pglock.fencing_tokens SET issued_to = 'by hand' WHERE key_name = 'fenced-by-hand'")
    assert installed.execute("SELECT pglock.current_fencing_token('fenced-by-hand')").fetchone()[0] == newest


def test_a_role_that_may_not_record_a_completion_fails_before_the_work(
    hook: AdvisoryLockHook, installed: Any, dsn: str
) -> None:
    """The record after the work is an upsert (INSERT and UPDATE): a role that may only read the
    table must fail before the work, or each retry would do the work and then fail to record it."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.run_rules import RunRules
    from tests.ops_helpers import with_user

    role = "pglock_ledger_readonly"
    installed.execute(f"DROP ROLE IF EXISTS {role}")
    installed.execute(f"CREATE ROLE {role} LOGIN")
    installed.execute(f"GRANT USAGE ON SCHEMA pglock TO {role}")
    installed.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA pglock TO {role}")
    try:
        limited = AdvisoryLockHook(dsn=with_user(dsn, role))
        key = LockKey.from_name("read-only-ledger")
        ran: list[str] = []
        for grant in ("", "INSERT"):
            if grant:
                installed.execute(f"GRANT {grant} ON pglock.completions TO {role}")
            for rules in (RunRules(period="2026-12-07"), RunRules(min_interval=60)):
                with pytest.raises(
                    LockConfigurationError, match=r"may read pglock\.completions but not INSERT and UPDATE"
                ):
                    LockGuard(limited.database, key, LockPolicy(), rules=rules).run(lambda lock: ran.append("work"))
        assert ran == []
        # Column grants of what the upsert writes are enough (the table's INSERT is there already).
        installed.execute(
            f"GRANT UPDATE (completed_at, key_name, dag_id, task_id, run_id, map_index, fencing_token)"
            f" ON pglock.completions TO {role}"
        )
        LockGuard(limited.database, key, LockPolicy(), rules=RunRules(period="2026-12-07")).run(
            lambda lock: ran.append("work")
        )
        assert ran == ["work"]
        assert installed.execute("SELECT count(*) FROM pglock.completions").fetchone()[0] == 1
    finally:
        installed.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role])
        installed.execute(f"DROP OWNED BY {role}")
        installed.execute(f"DROP ROLE {role}")


def _named_setval(message: str) -> str | None:
    """The setval a refusal's message names, if any."""
    found = re.search(
        r"SELECT pg_catalog\.setval\('pglock\.fencing_token_seq', \(SELECT pg_catalog\.max\(token\) FROM [^;]*?\)\)",
        message,
    )
    return None if found is None else found.group(0)


def test_the_setval_a_refusal_names_leaves_numbers_when_another_keys_row_is_at_the_maximum(
    hook: AdvisoryLockHook, installed: Any
) -> None:
    """Key A's row set to the sequence's maximum by hand, key B's far ahead: the setval B's refusal
    names moves the sequence past B's row, not to A's maximum, which would leave no number for any
    key (review -84: every fenced run of every key then failed in nextval)."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.run_rules import RunRules

    def fenced_run(name: str) -> int | None:
        with LockGuard(hook.database, LockKey.from_name(name), LockPolicy(), rules=RunRules(fencing=True)) as handle:
            return handle.fencing_token

    assert fenced_run("fenced-max-a") is not None and fenced_run("fenced-max-b") is not None
    update = "UPDATE pglock.fencing_tokens SET token = %s WHERE key_name = %s"
    installed.execute(update, (2**63 - 1, "fenced-max-a"))
    installed.execute(update, (10**12, "fenced-max-b"))
    with pytest.raises(LockConfigurationError) as refused:
        fenced_run("fenced-max-b")
    setval = _named_setval(str(refused.value))
    assert setval is not None, refused.value
    installed.execute(setval)
    assert fenced_run("fenced-max-b") == 10**12 + 1
    assert fenced_run("fenced-max-c") == 10**12 + 2


@pytest.mark.parametrize("mode", ["session", "transaction"])
@pytest.mark.parametrize("recorded", [True, False], ids=["tokens-recorded", "no-token-recorded"])
def test_a_used_up_fencing_sequence_fails_the_run_naming_the_sequence_and_a_remedy_that_works(
    hook: AdvisoryLockHook, installed: Any, admin: Any, mode: str, recorded: bool
) -> None:
    """The sequence at its maximum (a setval to it by hand, as an older refusal's remedy named):
    nextval can give no number, so every fenced run of every key fails. It fails as a configuration
    error naming the sequence, its maximum and what mends it (a setval past the recorded tokens, or
    a restart when none is recorded), not as the driver's bare SequenceGeneratorLimitExceeded; the
    work does not run and nothing is left held."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.run_rules import RunRules

    key = LockKey.from_name(f"fenced-used-up-{mode}")

    def fenced_run() -> int | None:
        with LockGuard(hook.database, key, LockPolicy(mode=mode), rules=RunRules(fencing=True)) as handle:
            return handle.fencing_token

    first = fenced_run() if recorded else 0
    assert first is not None
    installed.execute("SELECT setval('pglock.fencing_token_seq', 9223372036854775807)")
    message = _refused_fenced_run(hook, key, mode)
    assert "pglock.fencing_token_seq" in message and "9223372036854775807" in message, message
    assert key.describe() in message and "lost" not in message, message
    assert admin.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0] == 0
    remedy = _named_setval(message) if recorded else "ALTER SEQUENCE pglock.fencing_token_seq RESTART"
    assert remedy is not None and remedy in message, message
    installed.execute(remedy)
    assert fenced_run() == first + 1


@pytest.mark.parametrize("mode", ["session", "transaction"])
@pytest.mark.parametrize("rule", ["once_per", "min_interval"])
def test_a_read_only_default_fails_before_the_work_not_after_it(dsn: str, installed: Any, mode: str, rule: str) -> None:
    """Transactions read-only by default (default_transaction_read_only, for the role or the database;
    set here through the connection's options, which rank above both): the record after the work
    would fail, and each retry would do the work again. The check before the work says so (review -86:
    it looked at the grants only, and the work ran on every try)."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.run_rules import RunRules

    read_only = AdvisoryLockHook(dsn=f"{dsn} options='-c default_transaction_read_only=on'")
    rules = RunRules(period="2026-12-07") if rule == "once_per" else RunRules(min_interval=60.0)
    worked = []
    with pytest.raises(LockConfigurationError, match="default_transaction_read_only") as refused:
        LockGuard(read_only.database, LockKey.from_name(f"read-only/{rule}"), LockPolicy(mode=mode), rules=rules).run(
            lambda handle: worked.append(True)
        )
    assert worked == [], "the work ran, and its record was then refused"
    assert rule in str(refused.value)
