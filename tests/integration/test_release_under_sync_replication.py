"""Releases under synchronous replication whose standby does not answer.

The cluster here (started by the test) requires a synchronous standby that never connects:
every commit of a transaction that wrote to the WAL waits for it for ever, as on a primary
whose standby is down (PostgreSQL does not wait for a transaction whose only record is its
commit, such as the unlock's: its ``pg_notify`` gives it an id but writes nothing). A release
must never wait there: not its unlock and announcement, not the key-name registry's row
that travels with a session lock's release. What is written to last waits, as every other
write does: the records that are the point of a synchronous standby (once_per, fencing, lock
scopes) and a transaction lock's commit when its transaction wrote something.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import wakeups
from airflow_pglock.pg.key_names import record_key_name, registered_names
from airflow_pglock.pg.schema import migrate
from airflow_pglock.policy import LockPolicy
from airflow_pglock.run_rules import RunRules
from airflow_pglock.server_rules import Scope
from devtools.pgcluster import Cluster

#: Long enough for any release on a loaded machine; a release stuck on the standby never ends.
HANG = 30.0


@pytest.fixture(scope="module")
def standby_down() -> Iterator[Cluster]:
    cluster = Cluster(
        {
            "synchronous_commit": "on",
            "synchronous_standby_names": "'pglock_never_connects'",
            "track_activity_query_size": "8192",  # the waiting statements are read by their text
        }
    )
    try:
        cluster.init().start()
        yield cluster
    finally:
        cluster.destroy()


@dataclass
class Ran:
    #: whether the work ended by itself (before any wait for the standby was cancelled)
    finished: bool
    #: the sessions that waited for the standby meanwhile: pid -> the statement that waited
    waits: dict[int, str] = field(default_factory=dict)


def _sync_rep_waits(admin: psycopg.Connection[Any]) -> dict[int, str]:
    rows = admin.execute("SELECT pid, query FROM pg_stat_activity WHERE wait_event = 'SyncRep'").fetchall()
    return {pid: query for pid, query in rows}


def _run(cluster: Cluster, work: Callable[[], Any], *, until_a_wait: bool = False) -> Ran:
    """Run ``work`` in a thread until it ends or :data:`HANG` passed (``until_a_wait``: or until a
    session waits for the standby); then cancel every wait until the work has ended (a
    cancelled wait commits locally, with a warning)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # re-raised below, in the test's thread
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True)
    with psycopg.connect(cluster.dsn, autocommit=True) as admin:
        left = _sync_rep_waits(admin)
        assert not left, f"sessions left waiting for the standby by an earlier test: {left}"
        ran = Ran(finished=False)
        thread.start()
        deadline = time.monotonic() + HANG
        while thread.is_alive() and time.monotonic() < deadline and not (until_a_wait and ran.waits):
            ran.waits.update(_sync_rep_waits(admin))
            thread.join(0.05)
        ran.finished = not thread.is_alive()
        deadline = time.monotonic() + HANG
        while thread.is_alive() and time.monotonic() < deadline:
            for pid, query in _sync_rep_waits(admin).items():
                ran.waits.setdefault(pid, query)
                admin.execute("SELECT pg_cancel_backend(%s)", [pid])
            thread.join(0.05)
        assert not thread.is_alive(), "the work did not end once its waits for the standby were cancelled"
    if failure:
        raise failure[0]
    return ran


def _install_registry(cluster: Cluster, *names: str) -> None:
    """init-db, and ``names`` recorded in the registry, without waiting for the standby (here only)."""
    with psycopg.connect(cluster.dsn, autocommit=True, options="-c synchronous_commit=local") as conn:
        migrate(conn)
        for name in names:
            record_key_name(conn, LockKey.from_name(name), "sync-rep test")


def test_the_cluster_makes_a_write_wait_for_the_standby(standby_down: Cluster) -> None:
    """The control: without it the other tests could pass on a cluster that waits for nothing."""

    def write() -> None:
        with psycopg.connect(standby_down.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS sync_rep_control ()")

    ran = _run(standby_down, write, until_a_wait=True)
    assert not ran.finished and list(ran.waits.values()) == ["CREATE TABLE IF NOT EXISTS sync_rep_control ()"]


def _guarded(cluster: Cluster, name: str, mode: Scope = "session", work: str | None = None) -> Callable[[], None]:
    hook = AdvisoryLockHook(dsn=cluster.dsn)

    def guarded() -> None:
        with hook.lock(name, mode=mode, application_name="sync-rep test") as handle:
            assert handle is not None
            if work is not None:
                assert handle.connection is not None
                handle.connection.execute(work)  # type: ignore[arg-type]  # the test's own statement

    return guarded


def test_a_guarded_execution_releases_without_waiting_for_the_standby(standby_down: Cluster) -> None:
    key = LockKey.from_name("sync-rep/guarded")
    with psycopg.connect(standby_down.dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {wakeups.RELEASED_CHANNEL}")
        ran = _run(standby_down, _guarded(standby_down, "sync-rep/guarded"))
        notes = list(listener.notifies(timeout=5, stop_after=1))
    assert ran.finished and not ran.waits, f"the release waited for the synchronous standby: {ran.waits}"
    assert [wakeups.coordinates(note.payload) for note in notes] == [key.pg_locks]


def test_a_lock_session_releases_its_keys_without_waiting_for_the_standby(standby_down: Cluster) -> None:
    hook = AdvisoryLockHook(dsn=standby_down.dsn)

    def keys_one_by_one() -> None:
        with hook.lock_session(application_name="sync-rep test") as session:
            for n in range(3):
                with session.try_lock(f"sync-rep/session/{n}") as sub:
                    assert sub is not None

    ran = _run(standby_down, keys_one_by_one)
    assert ran.finished and not ran.waits, f"a release waited for the synchronous standby: {ran.waits}"


def test_the_registry_write_at_release_does_not_wait_for_the_standby(standby_down: Cluster) -> None:
    _install_registry(standby_down)
    key = LockKey.from_name("sync-rep/registry")
    ran = _run(standby_down, _guarded(standby_down, "sync-rep/registry"))
    assert ran.finished and not ran.waits, f"the release waited for the synchronous standby: {ran.waits}"
    with psycopg.connect(standby_down.dsn, autocommit=True) as conn:
        assert [row.name for row in registered_names(conn, [key.pg_locks]) or []] == ["sync-rep/registry"]


def test_a_name_recorded_on_its_own_does_not_wait_for_the_standby(standby_down: Cluster) -> None:
    """The registry's write outside a release (a pool's slot on a registry before init-db 4)."""
    _install_registry(standby_down)
    key = LockKey.from_name("sync-rep/recorded-alone")

    def record() -> None:
        with psycopg.connect(standby_down.dsn, autocommit=True) as conn:
            assert record_key_name(conn, key, "sync-rep test") == []

    ran = _run(standby_down, record)
    assert ran.finished and not ran.waits, f"the write waited for the synchronous standby: {ran.waits}"


def test_a_transaction_lock_that_wrote_nothing_ends_without_waiting(standby_down: Cluster) -> None:
    _install_registry(standby_down, "sync-rep/transaction-idle")
    ran = _run(standby_down, _guarded(standby_down, "sync-rep/transaction-idle", "transaction"))
    assert ran.finished and not ran.waits, f"the commit waited for the synchronous standby: {ran.waits}"


def test_what_is_written_to_last_waits_for_the_standby(standby_down: Cluster) -> None:
    """The other side of the promise: writes meant to last wait for the standby, as every other
    write on that server: a transaction-mode lock's work, a once_per record, and the first name
    a transaction-mode lock records (part of the work's commit)."""
    _install_registry(standby_down, "sync-rep/transaction-work")
    hook = AdvisoryLockHook(dsn=standby_down.dsn)

    def once_per_record() -> None:
        key = LockKey.from_int(1234)  # no name: the registry writes nothing
        with LockGuard(hook.database, key, LockPolicy(), rules=RunRules(period="p")):
            pass

    cases: dict[str, tuple[Callable[[], None], str]] = {
        "the work": (
            _guarded(standby_down, "sync-rep/transaction-work", "transaction", "CREATE TABLE sync_rep_work ()"),
            "COMMIT",
        ),
        "the once_per record": (once_per_record, "pglock.completions"),
        "a first name, transaction mode": (
            _guarded(standby_down, "sync-rep/transaction-first-name", "transaction"),
            '"key_names"',
        ),
    }
    for case, (work, statement) in cases.items():
        ran = _run(standby_down, work, until_a_wait=True)
        assert not ran.finished and ran.waits, case
        assert all(statement in query for query in ran.waits.values()), (case, ran.waits)


def test_a_commit_whose_answer_is_lost_is_never_reported_as_not_committed(standby_down: Cluster) -> None:
    """A transaction lock's work wrote; its COMMIT waits for the standby, and an operator ends the
    session there (``pg_terminate_backend``): PostgreSQL has committed locally, and the client
    never gets the COMMIT's answer. The block fails (the client cannot know the outcome), but says
    that whether it committed is unknown, and what the server says now: it used to say that nothing
    written on the lock's connection was committed, inviting a retry that writes it twice."""
    from airflow_pglock.exceptions import LockLostError

    local = "-c synchronous_commit=local"
    with psycopg.connect(standby_down.dsn, autocommit=True, options=local) as admin:
        admin.execute("DROP TABLE IF EXISTS sync_rep_lost_answer; CREATE TABLE sync_rep_lost_answer (v text)")
    hook = AdvisoryLockHook(dsn=standby_down.dsn)
    failure: list[BaseException] = []

    def guarded() -> None:
        try:
            with hook.lock("sync-rep/lost-answer", mode="transaction", application_name="sync-rep test") as handle:
                assert handle is not None and handle.connection is not None
                handle.connection.execute("INSERT INTO sync_rep_lost_answer VALUES ('the work')")
        except BaseException as error:  # checked below, in the test's thread
            failure.append(error)

    thread = threading.Thread(target=guarded, daemon=True)
    with psycopg.connect(standby_down.dsn, autocommit=True, options=local) as admin:
        assert not _sync_rep_waits(admin)
        thread.start()
        deadline = time.monotonic() + HANG
        while not (waits := _sync_rep_waits(admin)):
            assert time.monotonic() < deadline and thread.is_alive(), "the work's commit did not wait"
            time.sleep(0.05)
        assert len(waits) == 1 and "COMMIT" in next(iter(waits.values()))
        admin.execute("SELECT pg_terminate_backend(%s)", [next(iter(waits))])
        thread.join(HANG)
        assert not thread.is_alive()
        committed = admin.execute("SELECT v FROM sync_rep_lost_answer").fetchall()
        admin.execute("DROP TABLE sync_rep_lost_answer")
    assert committed == [("the work",)]  # locally, as PostgreSQL warns when it ends such a wait
    assert len(failure) == 1 and isinstance(failure[0], LockLostError), failure
    message = str(failure[0])
    assert "whether it committed is unknown" in message, message
    assert "that transaction is 'committed'" in message, message
    assert "the guard committed nothing" not in message, message


def _fenced(cluster: Cluster, name: str, mode: Scope, dsn: str | None = None) -> tuple[Callable[[], None], list[Any]]:
    """A fenced guard's run, and what it came to: the token its work got, or the error."""
    from airflow_pglock.exceptions import LockConnectionError

    hook = AdvisoryLockHook(dsn=dsn or cluster.dsn)
    came_to: list[Any] = []

    def fenced() -> None:
        try:
            with LockGuard(
                hook.database, LockKey.from_name(name), LockPolicy(mode=mode), rules=RunRules(fencing=True)
            ) as handle:
                came_to.append(handle.fencing_token)
        except LockConnectionError as error:
            came_to.append(error)

    return fenced, came_to


@pytest.mark.parametrize("client_min_messages", [None, "error"])
@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_fencing_token_whose_wait_for_the_standby_was_cancelled_never_reaches_the_work(
    standby_down: Cluster, mode: Scope, client_min_messages: str | None
) -> None:
    """Review -59: a cancelled wait for the synchronous standby commits the token locally, with only
    a WARNING; the work got the token, and after a failover to a standby without it the next
    holder was issued the same number. Review -62: a role or connection with client_min_messages
    = error is sent no WARNING at all."""
    _install_registry(standby_down)
    dsn = None
    if client_min_messages is not None:
        dsn = psycopg.conninfo.make_conninfo(standby_down.dsn, options=f"-c client_min_messages={client_min_messages}")
    fenced, came_to = _fenced(standby_down, f"sync-rep/fenced-{mode}-{client_min_messages}", mode, dsn=dsn)
    _run(standby_down, fenced, until_a_wait=True)  # then it cancels every wait (the provider's bound is 30 s)
    assert len(came_to) == 1 and isinstance(came_to[0], Exception), f"the work ran with token {came_to}"
    message = str(came_to[0])
    assert "was committed on the primary, but the commit warned: canceling wait for synchronous replication" in message
    assert "not handed to the work" in message
    with psycopg.connect(standby_down.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone() == (0,)


def test_a_fencing_token_waits_for_the_standby_whatever_synchronous_commit_the_session_has(
    standby_down: Cluster,
) -> None:
    """With synchronous_commit=local (or off) for the role or the database, the token's commit did not
    wait for the standby, and doctor still said the tokens survive a failover (review -59)."""
    _install_registry(standby_down)
    local = psycopg.conninfo.make_conninfo(standby_down.dsn, options="-c synchronous_commit=local")
    fenced, came_to = _fenced(standby_down, "sync-rep/fenced-local", "session", dsn=local)
    ran = _run(standby_down, fenced, until_a_wait=True)
    assert not ran.finished, f"the token was issued without waiting for the standby: {came_to}"
    assert any("pglock.fencing_tokens" in query for query in ran.waits.values()), ran.waits


def test_a_token_whose_commit_waited_past_the_lease_is_no_loss(standby_down: Cluster) -> None:
    """Review -59: the heartbeat counted from the lock statement; a fencing token's commit that waited
    longer than the lease for the synchronous standby (which then answered) left it no time, and the
    run was failed as lost ("no answer for 4.8 s") while its session had held the key throughout
    (busy, never idle). It counts from the token's answer now."""
    from airflow_pglock.liveness import Liveness

    _install_registry(standby_down)
    hook = AdvisoryLockHook(dsn=standby_down.dsn, liveness=Liveness(lease=3))
    came_to: list[Any] = []

    def fenced() -> None:
        try:
            with LockGuard(
                hook.database, LockKey.from_name("sync-rep/fenced-slow"), LockPolicy(), rules=RunRules(fencing=True)
            ) as handle:
                time.sleep(2.5)  # the heartbeat probes meanwhile
                came_to.append(handle.fencing_token)
        except BaseException as error:  # checked below
            came_to.append(error)

    thread = threading.Thread(target=fenced, daemon=True)
    local = "-c synchronous_commit=local"
    with psycopg.connect(standby_down.dsn, autocommit=True, options=local) as admin:
        thread.start()
        deadline = time.monotonic() + HANG
        while not _sync_rep_waits(admin):
            assert time.monotonic() < deadline and thread.is_alive(), f"the token did not wait: {came_to}"
            time.sleep(0.05)
        time.sleep(4.0)  # past the lease (3 s) while the token's commit waits
        try:
            admin.execute("ALTER SYSTEM SET synchronous_standby_names = ''")  # the waits end, committed
            admin.execute("SELECT pg_reload_conf()")
            thread.join(HANG)
        finally:
            admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
            admin.execute("SELECT pg_reload_conf()")
    assert not thread.is_alive()
    assert len(came_to) == 1 and isinstance(came_to[0], int), came_to


def test_a_fencing_tokens_wait_for_an_absent_standby_is_bounded(
    standby_down: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review -62: statement_timeout does not end a commit's wait for the synchronous standby, and
    the key is held meanwhile: with the standby down a fenced run hung for ever, every other run
    skipping. The provider cancels the wait after TOKEN_COMMIT_WAIT_SECONDS; the run fails."""
    from airflow_pglock.pg import ledger

    _install_registry(standby_down)
    monkeypatch.setattr(ledger, "TOKEN_COMMIT_WAIT_SECONDS", 2.0)
    with psycopg.connect(standby_down.dsn, autocommit=True, options="-c synchronous_commit=local") as admin:
        # The first draw after a checkpoint writes the sequence to the WAL: its commit waited for
        # the standby too, before the bound (review -63)
        admin.execute("CHECKPOINT")
    fenced, came_to = _fenced(standby_down, "sync-rep/fenced-bounded", "session")
    thread = threading.Thread(target=fenced, daemon=True)
    thread.start()
    thread.join(HANG)
    if thread.is_alive():  # leave the module's cluster usable for the next test
        with psycopg.connect(standby_down.dsn, autocommit=True) as admin:
            for pid in _sync_rep_waits(admin):
                admin.execute("SELECT pg_cancel_backend(%s)", [pid])
        thread.join(HANG)
        raise AssertionError("the token's commit waited for the absent standby without a bound")
    assert len(came_to) == 1 and isinstance(came_to[0], Exception), came_to
    assert "was not recorded and committed within 2 s (a synchronous standby that does not answer?)" in str(came_to[0])
    with psycopg.connect(standby_down.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone() == (0,)
