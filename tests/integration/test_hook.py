"""AdvisoryLockHook on a real PostgreSQL: exclusion, shared locks, bounded waits, release, holders."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockConfigurationError, LockConnectionError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import NAME_TO_KEY_SQL, LockKey
from tests.helpers import advisory_locks, held_lock

NAMES = ["refresh-forecasts", "daily-settlement", "tenant-export/Zürich", "北京/导出", "emoji 🚀 key", "it's"]


@pytest.mark.parametrize("name", NAMES)
def test_sql_expression_equals_python(admin: Any, name: str) -> None:
    key = LockKey.from_name(name)
    assert admin.execute(f"SELECT {NAME_TO_KEY_SQL}", [name]).fetchone()[0] == key.numbers[0]
    assert admin.execute(f"SELECT {key.sql}").fetchone()[0] == key.numbers[0]


@pytest.mark.parametrize("key", [LockKey.from_name("coords"), LockKey.from_int(-5), LockKey.from_pair(-1, 2)])
def test_pg_locks_coordinates_match_the_server(hook: AdvisoryLockHook, admin: Any, key: LockKey) -> None:
    with held_lock(hook, key) as held:
        assert held is not None
        [(pid, classid, objid, objsubid, granted)] = advisory_locks(admin)
        assert (classid, objid, objsubid) == key.pg_locks
        assert pid == held.server.backend_pid and granted


def test_two_sessions_classic(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_name("classic")
    first = hook.acquire(key, application_name="pglock test A")
    assert first is not None
    assert hook.acquire(key) is None  # B is refused while A holds it
    assert first.release() is True
    second = hook.acquire(key)
    assert second is not None
    assert second.release() is True
    assert advisory_locks(admin) == []


def test_transaction_lock_released_by_commit(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_pair(42, 1001)
    with held_lock(hook, key, mode="transaction") as held:
        assert held is not None
        assert hook.acquire(key) is None
    again = hook.acquire(key)
    assert again is not None and again.release()


def test_shared_and_exclusive(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_name("readers-writer")
    reader_a = hook.acquire(key, shared=True)
    reader_b = hook.acquire(key, shared=True)
    assert reader_a is not None and reader_b is not None
    assert hook.acquire(key) is None  # a writer waits for the readers
    assert reader_a.release() and reader_b.release()
    writer = hook.acquire(key)
    assert writer is not None
    assert hook.acquire(key, shared=True) is None  # readers wait for the writer
    assert writer.release()


def test_a_shared_try_behind_a_queued_writer_names_the_writer(hook: AdvisoryLockHook, admin: Any, dsn: str) -> None:
    """PostgreSQL serves a queued exclusive request before a new shared one: a reader's try fails
    while only readers hold the key (a writer waits, e.g. in its defer_after wait). The refusal
    must name that writer, not only the reader that holds the key."""
    from airflow_pglock.exceptions import LockBusyError
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy

    key = LockKey.from_name("readers-queued-writer")
    reader = hook.acquire(key, shared=True)
    assert reader is not None
    with psycopg.connect(dsn, autocommit=True, application_name="queued writer") as writer:
        waiting = threading.Thread(
            target=lambda: writer.execute("SELECT pg_advisory_lock(%s)", [key.int64]), daemon=True
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while not any(not granted for *_, granted in advisory_locks(admin)) and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(LockBusyError) as busy, LockGuard(hook.database, key, LockPolicy(shared=True)):
            pytest.fail("a shared try got ahead of a queued exclusive request")
        message = str(busy.value)
        assert "holding ShareLock" in message, message
        assert "queued ahead of this shared one" in message and "'queued writer'" in message, message
        assert "waiting ExclusiveLock" in message, message
        assert reader.release()
        waiting.join(10)
        writer.execute("SELECT pg_advisory_unlock(%s)", [key.int64])


def test_bounded_wait_times_out_and_leaves_nothing(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_name("bounded-wait")
    holder = hook.acquire(key)
    assert holder is not None
    started = time.monotonic()
    assert hook.acquire(key, timeout=0.3) is None
    assert 0.25 <= time.monotonic() - started < 5
    # Only the holder's lock remains: the timed-out waiter left no lock and no waiting entry.
    assert [(pid, granted) for pid, *_, granted in advisory_locks(admin)] == [(holder.server.backend_pid, True)]
    assert holder.release()


def test_bounded_wait_succeeds_when_released_in_time(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_name("wait-then-get")
    holder = hook.acquire(key)
    assert holder is not None
    timer = threading.Timer(0.3, holder.release)
    timer.start()
    waited = hook.acquire(key, timeout=10)
    timer.join()
    assert waited is not None
    assert waited.is_held()
    # lock_timeout was local to the acquiring transaction: the session keeps no timeout.
    assert waited.connection.execute("SHOW lock_timeout").fetchone()[0] == "0"
    assert waited.release()


def test_a_wait_timeout_may_be_a_timedelta(hook: AdvisoryLockHook, admin: Any) -> None:
    """As the decorator's wait_timeout: hook.acquire, hook.lock and a lock session's lock take one."""
    key = LockKey.from_name("timedelta-wait")
    holder = hook.acquire(key)
    assert holder is not None
    started = time.monotonic()
    assert hook.acquire(key, timeout=dt.timedelta(milliseconds=300)) is None
    with hook.lock(key, timeout=dt.timedelta(milliseconds=300)) as busy:
        assert busy is None
    with hook.lock_session() as session, session.lock(key, timeout=dt.timedelta(milliseconds=300)) as waited:
        assert waited is None
    assert time.monotonic() - started >= 0.85  # each of the three waited
    assert holder.release()
    with hook.lock(key, timeout=dt.timedelta(seconds=5)) as handle:
        assert handle is not None
    for bad in (dt.timedelta(0), dt.timedelta(seconds=-1)):
        with pytest.raises(LockConfigurationError, match=re.escape(f"got {bad!r} (a timedelta is also taken)")):
            hook.acquire(key, timeout=bad)
    assert advisory_locks(admin) == []


@pytest.mark.parametrize("bad", [0, -1, float("inf") * 0, True])
def test_wait_timeout_must_be_positive(hook: AdvisoryLockHook, admin: Any, bad: float) -> None:
    with pytest.raises(LockConfigurationError, match="timeout"):
        hook.acquire("x", timeout=bad)


@pytest.mark.parametrize("bad", [-1, 0, "5"])
def test_a_bad_wait_timeout_is_refused_before_connecting(bad: object) -> None:
    """With the database down, a bad timeout is still reported as the setting to fix, not as a connection error."""
    from devtools.pgcluster import free_port

    down = AdvisoryLockHook(dsn=f"postgresql://postgres@127.0.0.1:{free_port()}/postgres", connect_timeout=2)
    with pytest.raises(LockConfigurationError, match=f"wait timeout must be a positive number of seconds, got {bad!r}"):
        down.acquire("k", timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(LockConfigurationError, match="wait timeout"), held_lock(down, "k", timeout=bad):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_is_held_answers_false_once_the_lease_expired(dsn: str, admin: Any, mode: str) -> None:
    """An idle hook lock past its lease: the server ended the session; is_held() says so, no driver
    error (transaction mode: the idle-in-transaction timeout's 25P03, an InternalError, was raised)."""
    from airflow_pglock.liveness import Liveness

    held = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3)).acquire(f"expiring-{mode}", mode=mode)
    assert held is not None
    deadline = time.monotonic() + 30
    while held.server.backend_pid in [row[0] for row in advisory_locks(admin)]:  # the server's timer, not ours
        assert time.monotonic() < deadline, "the server did not end the idle lock session"
        time.sleep(0.2)
    assert held.is_held() is False
    assert held.is_held() is False  # asked again on the dead connection: the same answer
    if mode == "transaction":
        with pytest.raises(psycopg.OperationalError):  # nothing committed: the session is gone
            held.commit()
    assert held.release() is False


def test_is_held_answers_false_after_the_session_was_terminated(hook: AdvisoryLockHook, admin: Any) -> None:
    held = hook.acquire("terminated")
    assert held is not None and held.is_held() is True
    admin.execute("SELECT pg_terminate_backend(%s)", [held.server.backend_pid])
    assert held.is_held() is False
    assert held.release() is False


def test_release_is_idempotent_and_reports_whether_held(hook: AdvisoryLockHook, admin: Any) -> None:
    held = hook.acquire("idempotent")
    assert held is not None
    assert held.release() is True
    assert held.release() is False
    assert held.connection.closed


def test_release_after_the_connection_broke(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_name("broken")
    held = hook.acquire(key)
    assert held is not None
    admin.execute("SELECT pg_terminate_backend(%s)", [held.server.backend_pid])
    time.sleep(0.2)
    assert held.release() is False  # it was not held any more; no exception
    other = hook.acquire(key)
    assert other is not None and other.release()


def test_session_lock_context_releases_on_error(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_name("ctx-error")
    with pytest.raises(RuntimeError), held_lock(hook, key) as held:
        assert held is not None
        raise RuntimeError("work failed")
    assert advisory_locks(admin) == []
    with held_lock(hook, key) as busy_free:
        assert busy_free is not None
        with held_lock(hook, key) as busy:
            assert busy is None


def test_transaction_lock_commits_and_rolls_back(hook: AdvisoryLockHook, admin: Any) -> None:
    admin.execute("DROP TABLE IF EXISTS tx_work; CREATE TABLE tx_work (n int)")
    with held_lock(hook, "tx-work", mode="transaction") as held:
        assert held is not None
        held.connection.execute("INSERT INTO tx_work VALUES (1)")
    with pytest.raises(ValueError), held_lock(hook, "tx-work", mode="transaction") as held:
        assert held is not None
        held.connection.execute("INSERT INTO tx_work VALUES (2)")
        raise ValueError("boom")
    assert admin.execute("SELECT array_agg(n) FROM tx_work").fetchone()[0] == [1]
    assert advisory_locks(admin) == []
    admin.execute("DROP TABLE tx_work")


def test_transaction_lock_refuses_to_pretend_an_aborted_commit_worked(hook: AdvisoryLockHook, admin: Any) -> None:
    with (
        pytest.raises(psycopg.errors.InFailedSqlTransaction, match="nothing was committed"),
        held_lock(hook, "aborted", mode="transaction") as held,
    ):
        assert held is not None
        with pytest.raises(psycopg.errors.DivisionByZero):
            held.connection.execute("SELECT 1/0")


def test_a_manual_transaction_lock_aborted_by_an_error_is_not_reported_held(
    hook: AdvisoryLockHook, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An error the work caught outside a savepoint released the key at that error: the manual
    handle (no heartbeat, no side look) must neither call it held nor let a commit pass, and its
    release says it was not held to the end."""
    key = LockKey.from_name("aborted-manual")
    held = hook.acquire(key, mode="transaction")
    assert held is not None
    try:
        with pytest.raises(psycopg.errors.DivisionByZero):
            held.connection.execute("SELECT 1/0")
        assert admin.execute("SELECT pg_try_advisory_lock(%s)", [key.int64]).fetchone()[0], "freed at the error"
        admin.execute("SELECT pg_advisory_unlock(%s)", [key.int64])
        with caplog.at_level("WARNING", logger="airflow_pglock"):
            assert held.is_held() is False
        assert "another holder may have taken the key" in caplog.text
        with pytest.raises(psycopg.errors.InFailedSqlTransaction, match="released the lock at once"):
            held.commit()
    finally:
        assert held.release() is False
    assert advisory_locks(admin) == []


def test_a_manual_transaction_lock_in_a_failed_savepoint_is_held_again_once_rolled_back_to(
    hook: AdvisoryLockHook, admin: Any
) -> None:
    key = LockKey.from_name("savepoint-manual")
    held = hook.acquire(key, mode="transaction")
    assert held is not None
    try:
        held.connection.execute("SAVEPOINT a")
        with pytest.raises(psycopg.errors.DivisionByZero):
            held.connection.execute("SELECT 1/0")
        assert not admin.execute("SELECT pg_try_advisory_lock(%s)", [key.int64]).fetchone()[0], "still held"
        assert held.is_held() is False  # the session can tell nothing until rolled back to its savepoint
        held.connection.execute("ROLLBACK TO SAVEPOINT a")
        assert held.is_held() is True
        held.commit()
    finally:
        held.release()
    assert advisory_locks(admin) == []


def test_holders_names_pid_application_and_client(hook: AdvisoryLockHook, admin: Any) -> None:
    key = LockKey.from_name("who-holds")
    held = hook.acquire(key, application_name="pglock dag task run")
    assert held is not None
    before = advisory_locks(admin)
    [holder] = hook.holders(key)
    assert advisory_locks(admin) == before  # reading holders takes nothing
    assert holder.pid == held.server.backend_pid
    assert holder.application_name == "pglock dag task run"
    assert holder.granted and holder.mode == "ExclusiveLock"
    assert holder.client_addr == "127.0.0.1"
    assert holder.since is not None
    assert "pglock dag task run" in holder.describe()
    held.release()
    assert hook.holders(key) == []


def test_lock_connection_settings(hook: AdvisoryLockHook, admin: Any) -> None:
    held = hook.acquire("settings", application_name="pglock settings")
    assert held is not None
    conn = held.connection
    assert conn.autocommit
    assert conn.execute("SHOW application_name").fetchone()[0] == "pglock settings"
    assert conn.execute("SHOW idle_session_timeout").fetchone()[0] == "30s"
    assert conn.execute("SHOW tcp_user_timeout").fetchone()[0] == "30000"  # ms
    held.release()


def test_each_lock_has_its_own_connection(hook: AdvisoryLockHook, admin: Any) -> None:
    first = hook.acquire("one")
    second = hook.acquire("two")
    assert first is not None and second is not None
    assert first.server.backend_pid != second.server.backend_pid
    first.release()
    second.release()


def test_unreachable_server_is_an_error_with_the_cause(admin: Any) -> None:
    from devtools.pgcluster import free_port

    hook = AdvisoryLockHook(dsn=f"postgresql://postgres@127.0.0.1:{free_port()}/postgres", connect_timeout=2)
    with pytest.raises(LockConnectionError, match=r"cannot connect.*refused"):
        hook.acquire("nowhere")


def test_unknown_role_is_an_error(dsn: str, admin: Any) -> None:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["user"] = "no_such_role"
    hook = AdvisoryLockHook(dsn=psycopg.conninfo.make_conninfo(**info))
    with pytest.raises(LockConnectionError, match="no_such_role"):
        hook.acquire("nobody")


def test_dns_failure_is_an_error(admin: Any) -> None:
    hook = AdvisoryLockHook(dsn="postgresql://postgres@no-such-host.invalid:5432/postgres", connect_timeout=2)
    with pytest.raises(LockConnectionError, match=r"no-such-host\.invalid"):
        hook.acquire("dns")


def test_password_never_in_errors(dsn: str, admin: Any, capfd: Any, caplog: Any) -> None:
    from devtools.pgcluster import free_port

    hook = AdvisoryLockHook(dsn=f"postgresql://postgres:s3cret-pw@127.0.0.1:{free_port()}/postgres", connect_timeout=2)
    with pytest.raises(LockConnectionError) as error:
        hook.acquire("secret")
    assert "s3cret-pw" not in str(error.value)
    # An unencoded @ in a URI's password: libpq ends the user part at the first @ and reads the
    # rest as the host, the port or the database, which messages show (reviews -60, -61). Refused
    # before any connection, showing none of it.
    port = free_port()
    for tail in ("s3cret-pw@127.0.0.1", "s3cret/pw@127.0.0.1", "s3cret:pw@127.0.0.1", "s3,cret@127.0.0.1"):
        hook = AdvisoryLockHook(dsn=f"postgresql://postgres:pw@{tail}:{port}/postgres", connect_timeout=2)
        for attempt in (lambda h=hook: h.acquire("secret"), lambda h=hook: h.lock("secret").__enter__()):
            with pytest.raises(
                LockConfigurationError, match="percent-encode '@' in the user or password as %40"
            ) as refused:
                attempt()
            shown = f"{refused.value} {refused.value.__cause__!r}"
            assert "s3" not in shown and "cret" not in shown, shown
    log = "".join(capfd.readouterr()) + caplog.text  # the outcome lines
    assert "percent-encode" in log and "s3cret" not in log and "cret@" not in log, log
    encoded = AdvisoryLockHook(dsn=f"postgresql://postgres:pw%40s3cret@127.0.0.1:{port}/postgres", connect_timeout=2)
    with pytest.raises(LockConnectionError):  # percent-encoded: read as meant (and the server is not there)
        encoded.acquire("secret")


def test_a_second_guard_in_the_same_process_is_busy(hook: AdvisoryLockHook, admin: Any) -> None:
    """Invariant 1: a reused (pooled) session would answer true again; a dedicated one says busy."""
    from airflow_pglock.exceptions import LockBusyError
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy

    key = LockKey.from_name("no-session-reuse")
    with LockGuard(hook.database, key, LockPolicy()) as outer:
        with pytest.raises(LockBusyError) as busy, LockGuard(hook.database, key, LockPolicy()):
            pass
        assert f"pid {outer.backend_pid}" in str(busy.value)
    assert advisory_locks(admin) == []


def test_a_malformed_dsn_never_echoes_its_password(admin: Any) -> None:
    """Invariant 8: libpq repeats a malformed connection string in its error; we redact it."""
    with pytest.raises(LockConfigurationError) as error:
        AdvisoryLockHook(dsn="postgresql://pguser:s3cret-pw@[host/db").acquire("never")
    assert "s3cret-pw" not in str(error.value) and 'matching "]" in IPv6 host address' in str(error.value)
    with pytest.raises((LockConfigurationError, LockConnectionError)) as other:
        AdvisoryLockHook(dsn="host=x password='s3cret-pw port=5432").acquire("never")
    assert "s3cret-pw" not in str(other.value)
    # libpq and psycopg quote the piece they could not read, which may be the password or a part of it
    for dsn, secret in (
        ("host=x password=s3cret pw-tail", "pw-tail"),
        ("postgresql://pguser:s3cret pw@host/db", "s3cret"),
        ("postgresql://pguser:s3cret%zzpw@host/db", "s3cret"),
        ("postgresql://pguser:pw@host/db?password=s3cret pw", "s3cret"),
        # a quote in the password: the message's quotes cannot be paired
        ('postgresql://pguser:Xy"9%QQs3cret@host/db', "s3cret"),
        ('host=x password=a"b c"ds3cret', "s3cret"),
        ('postgresql://pguser:S3"cret pw"x@host/db', "cret"),
        # a user@server name (Azure's form), a percent-encoded keyword in the query
        ("postgresql://admin@myserver:S3cret pw@host/db", "S3cret"),
        ("postgresql://pguser@srv:S3c%ret@host/db", "S3c"),
        ("postgresql://pguser@host/db?passw%6Frd=S3cret pw", "S3cret"),
    ):
        with pytest.raises(LockConfigurationError) as quoted:
            AdvisoryLockHook(dsn=dsn).acquire("never")
        message = str(quoted.value)
        assert secret not in message and message.startswith("invalid DSN for the lock database: "), message
        assert message.endswith("(quoted parts hidden: the connection string may hold a password)"), message
    # ... and is left in the message when the string holds no password: it names the mistake
    with pytest.raises(LockConfigurationError) as plain:
        AdvisoryLockHook(dsn="host=x prot=5432").acquire("never")
    assert str(plain.value) == 'invalid DSN for the lock database: invalid connection option "prot"'


def test_the_lease_keepalives_win_over_connection_extras(dsn: str, admin: Any) -> None:
    loose = AdvisoryLockHook(dsn=f"{dsn} keepalives_idle=7200 tcp_user_timeout=0")
    held = loose.acquire("keepalive-bound")
    assert held is not None
    options = {opt.keyword.decode(): (opt.val or b"").decode() for opt in held.connection.pgconn.info}
    assert options["keepalives_idle"] == "10" and options["tcp_user_timeout"] == "30000"
    held.release()


def test_a_short_role_statement_timeout_does_not_turn_busy_into_an_error(dsn: str, admin: Any) -> None:
    strict = AdvisoryLockHook(dsn=f"{dsn} options='-c statement_timeout=100'")
    holder = strict.acquire("statement-timeout")
    assert holder is not None
    assert strict.acquire("statement-timeout", timeout=0.5) is None  # busy after the wait, not QueryCanceled
    with held_lock(strict, "statement-timeout-2", mode="transaction", timeout=0.5) as held:
        assert held is not None
        # the role's statement_timeout is back after the wait
        assert held.connection.execute("SHOW statement_timeout").fetchone()[0] == "100ms"
    holder.release()


def test_work_that_ends_the_lock_transaction_is_a_lost_lock(hook: AdvisoryLockHook, admin: Any) -> None:
    """Invariant 7: a COMMIT by the work ends a transaction lock; the guard must not report success."""
    from airflow_pglock.exceptions import LockLostError
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy

    with (
        pytest.raises(LockLostError, match="ended the lock's transaction"),
        LockGuard(hook.database, LockKey.from_name("self-commit"), LockPolicy(mode="transaction")) as lock,
    ):
        assert lock.connection is not None
        lock.connection.execute("COMMIT")
    with (
        pytest.raises(psycopg.errors.NoActiveSqlTransaction),
        held_lock(hook, "self-commit", mode="transaction") as held,
    ):
        assert held is not None
        held.connection.execute("ROLLBACK")
    assert advisory_locks(admin) == []


def test_work_that_commits_and_begins_anew_commits_nothing_after(hook: AdvisoryLockHook, admin: Any) -> None:
    """COMMIT then BEGIN on the lock's connection: the release's check (sent with its COMMIT, in
    one round trip) finds the key not held in the lock's transaction and commits nothing more."""
    from airflow_pglock.exceptions import LockLostError
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy

    admin.execute("DROP TABLE IF EXISTS commit_begin; CREATE TABLE commit_begin (note text)")
    try:
        with (
            pytest.raises(LockLostError, match="ended the lock's transaction"),
            LockGuard(hook.database, LockKey.from_name("commit-begin-anew"), LockPolicy(mode="transaction")) as lock,
        ):
            assert lock.connection is not None
            lock.connection.execute("INSERT INTO commit_begin VALUES ('under the lock')")
            lock.connection.execute("COMMIT")
            lock.connection.execute("BEGIN")
            lock.connection.execute("INSERT INTO commit_begin VALUES ('after the lock ended')")
        with (
            pytest.raises(psycopg.errors.NoActiveSqlTransaction, match="not committed"),
            held_lock(hook, "commit-begin-anew", mode="transaction") as held,
        ):
            assert held is not None
            held.connection.execute("COMMIT")
            held.connection.execute("BEGIN")
            held.connection.execute("INSERT INTO commit_begin VALUES ('after the lock ended, hook')")
        notes = admin.execute("SELECT note FROM commit_begin").fetchall()
        assert notes == [("under the lock",)]
        assert advisory_locks(admin) == []
    finally:
        admin.execute("DROP TABLE commit_begin")


def test_a_hook_reads_its_airflow_connection_once(dsn: str, admin: Any) -> None:
    """Reading an Airflow connection sets the secrets backends up again (about 1 ms): once per hook."""
    from tests.helpers import TEST_CONN_ID

    hook = AdvisoryLockHook(TEST_CONN_ID)
    reads: list[str] = []
    read = hook.get_connection

    def counted(conn_id: str) -> Any:
        reads.append(conn_id)
        return read(conn_id)

    hook.get_connection = counted  # type: ignore[method-assign]
    for _ in range(3):
        with hook.lock("read-once") as handle:
            assert handle is not None
    held = hook.acquire("read-once")  # a fourth lock, the manual form
    assert held is not None
    held.release()
    assert reads == [TEST_CONN_ID]
    assert advisory_locks(admin) == []


def test_expiring_settings_are_resolved_for_each_lock(dsn: str, admin: Any, monkeypatch: Any) -> None:
    """An IAM token expires: a connection with the ``iam`` extra is read anew for each lock connection."""
    from airflow_pglock.hooks import connection
    from airflow_pglock.pg.settings import from_dsn

    reads: list[str] = []

    def iam_like(conn_id: str, get_connection: Any) -> Any:
        reads.append(conn_id)
        return dataclasses.replace(from_dsn(dsn), reusable=False)

    monkeypatch.setattr(connection, "from_airflow", iam_like)
    hook = AdvisoryLockHook("iam_conn")
    for _ in range(2):
        with hook.lock("read-each-time") as handle:
            assert handle is not None
    assert reads == ["iam_conn", "iam_conn"]
    assert advisory_locks(admin) == []


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"mode": "Session"}, "mode must be one of 'session', 'transaction'; got 'Session'"),
        ({"shared": "false"}, "shared must be True or False, got 'false'"),
        ({"shared": 1}, "shared must be True or False, got 1"),
        ({"application_name": 5}, "application_name must be a string .* got 5"),
    ],
)
def test_a_bad_mode_shared_or_name_is_refused_before_connecting(options: dict[str, Any], named: str) -> None:
    """Review -57: acquire() took a lock with no lease for a mode it did not know (anything but
    "transaction" took a session lock, and only "session" got the lease), and shared="false" a
    shared lock; a non-str application_name failed hook.lock() only after its work had run."""
    from devtools.pgcluster import free_port

    down = AdvisoryLockHook(dsn=f"postgresql://postgres@127.0.0.1:{free_port()}/postgres", connect_timeout=2)
    with pytest.raises(LockConfigurationError, match=named):
        down.acquire("k", **options)
    ran = []
    with pytest.raises(LockConfigurationError, match=named), down.lock("k", **options):
        ran.append(True)
    assert ran == []
    if "application_name" in options:
        with pytest.raises(LockConfigurationError, match=named), down.lock_session(**options):
            ran.append(True)
        assert ran == []


def test_a_bad_timeout_of_hook_lock_is_named_as_its_timeout() -> None:
    """It named on_busy='wait' and wait_timeout, options of the decorator the caller never used."""
    hook = AdvisoryLockHook(dsn="host=nowhere.invalid")
    named = "wait timeout must be a positive number of seconds, got 0"
    with pytest.raises(LockConfigurationError, match=named), hook.lock("k", timeout=0):
        pass


def _is_held_cancelled_once(
    real: Callable[..., bool], admin: Any, then_terminated: bool = False
) -> Callable[..., bool]:
    """``real`` (the check is_held() sends), whose first call is held up on the server and meets a
    foreign ``pg_cancel_backend()`` (sent once the backend is active: an idle one ignores it);
    ``then_terminated``: the session is terminated before the second call."""
    calls: list[int] = []

    def cancel_once_active(pid: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if admin.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone() == ("active",):
                admin.execute("SELECT pg_cancel_backend(%s)", [pid])
                return
            time.sleep(0.01)

    def check(conn: Any, *args: Any) -> bool:
        calls.append(1)
        if len(calls) == 1:
            cancel = threading.Thread(target=cancel_once_active, args=(conn.info.backend_pid,))
            cancel.start()
            try:
                conn.execute("SELECT pg_sleep(30)")
            finally:
                cancel.join()
        elif then_terminated:
            admin.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
        return real(conn, *args)

    return check


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_cancel_that_lands_on_is_held_ends_no_session(
    hook: AdvisoryLockHook, admin: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any, mode: str
) -> None:
    """Review -61: is_held() took a cancelled check (QueryCanceled, an OperationalError) for an ended
    session, closed the connection and so freed the key it held. A session lock is asked once more;
    a transaction lock's check that was cancelled aborted its transaction: False, and why."""
    import airflow_pglock.pg.held as held_module

    held = hook.acquire(f"cancelled-check-{mode}", mode=mode)
    assert held is not None
    monkeypatch.setattr(held_module, "is_held", _is_held_cancelled_once(held_module.is_held, admin))
    try:
        if mode == "session":
            assert held.is_held() is True
            assert not held.connection.closed and held.server.backend_pid in [r[0] for r in advisory_locks(admin)]
        else:
            assert held.is_held() is False
            assert "an error aborted the lock's transaction" in caplog.text
            assert not held.connection.closed  # inside a savepoint the key would stay: the caller decides
    finally:
        held.release()


def test_a_session_ended_between_is_helds_two_asks_is_false_not_an_error(
    hook: AdvisoryLockHook, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review -62: a cancel, then pg_terminate_backend() (a DBA's usual sequence) raised AdminShutdown
    from the second ask."""
    import airflow_pglock.pg.held as held_module

    held = hook.acquire("cancelled-then-terminated")
    assert held is not None
    monkeypatch.setattr(held_module, "is_held", _is_held_cancelled_once(held_module.is_held, admin, True))
    assert held.is_held() is False
    assert held.release() is False


def test_is_held_raises_on_a_transaction_the_caller_left_aborted_and_keeps_the_key(
    hook: AdvisoryLockHook, admin: Any
) -> None:
    """The session lock outlives the caller's aborted transaction: neither False nor a rollback of it."""
    held = hook.acquire("left-aborted")
    assert held is not None
    held.connection.execute("BEGIN")
    with pytest.raises(psycopg.errors.DivisionByZero):
        held.connection.execute("SELECT 1/0")
    with pytest.raises(psycopg.errors.InFailedSqlTransaction):
        held.is_held()
    assert held.server.backend_pid in [r[0] for r in advisory_locks(admin)]
    held.connection.execute("ROLLBACK")
    assert held.is_held() is True
    assert held.release() is True
