"""A guard that gives up after it took the key (a skip, a refusal, a check that failed before
the work) frees the key before it closes its connection.

A close alone frees the key only once the server has read it and the backend has exited, a
moment later: a run that tried the key right after a skip could still find it busy, and be
told it is held by a run that had already given up (the suite met it twice: tests that checked
``pg_locks`` right after such a close). Through a session pooler that does not reset its server
sessions, the key was not freed at all.

Each guard here reaches real PostgreSQL through a real PgBouncer in session pooling with a fixed
set of server sessions and no reset query, so what a client leaves behind can be looked at after its
close, with no race against a backend's exit: a session lock not given back stays held by that
server session, and a client that closes inside its transaction (a transaction lock not given
back) makes PgBouncer drop that server session for a new one, which is looked for first (the
dropped session's locks stay in ``pg_locks`` until its backend has exited: CI met that once).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import AlreadyDoneError, LockBusyError, LockConfigurationError
from airflow_pglock.guard import LockGuard
from airflow_pglock.keys import LockKey, pool_presence_marker
from airflow_pglock.policy import LockPolicy
from airflow_pglock.run_rules import RunRules
from airflow_pglock.scope_rules import ScopeRole
from tests.helpers import advisory_locks

KEY = LockKey.from_name("give-up/integration")


@dataclass
class ServerSessions:
    """Clients of a session pooler with a fixed set of server sessions to hand out (two: a fenced
    transaction lock's token is committed on a side connection) that resets nothing."""

    dsn: str
    admin: Any
    size: int = 2
    pids: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.pids = self.serving_pids()
        assert len(self.pids) == self.size

    def serving_pids(self) -> set[int]:
        """The server sessions that serve as many clients at once as the pool has."""
        clients = [psycopg.connect(self.dsn, autocommit=True) for _ in range(self.size)]
        try:
            return {int(client.execute("SELECT pg_backend_pid()").fetchall()[0][0]) for client in clients}
        finally:
            for client in clients:
                client.close()

    @property
    def database(self) -> Any:
        from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

        return AdvisoryLockHook(dsn=self.dsn, pool_mode="session").database

    def assert_left_clean(self) -> None:
        """Every client so far closed outside a transaction and left no advisory lock held.

        The pooler's sessions are looked at first: a server session PgBouncer dropped still shows
        its transaction's locks in ``pg_locks`` until its backend has exited, a moment later."""
        assert self.serving_pids() == self.pids, (
            "PgBouncer replaced a server session: a client closed inside a transaction"
        )
        held = [row for row in advisory_locks(self.admin) if row[0] in self.pids and row[4]]
        assert held == [], f"the server sessions still hold {held} after their clients closed"


@pytest.fixture
def pooler(pg_server: str, dsn: str, admin: Any) -> Iterator[ServerSessions]:
    from devtools.pgbouncer import PgBouncer, PgBouncerUnavailableError

    port = psycopg.conninfo.conninfo_to_dict(pg_server).get("port") or 5432
    try:
        bouncer = PgBouncer(
            int(port), pool_mode="session", pool_size=ServerSessions.size, server_reset_query=""
        ).start()
    except PgBouncerUnavailableError as error:
        pytest.skip(f"PgBouncer is not available here: {error}")
    try:
        yield ServerSessions(bouncer.dsn_for(str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])), admin)
    finally:
        bouncer.stop()


def test_the_pooler_shows_what_a_client_left_behind(pooler: ServerSessions) -> None:
    """What the tests below rely on: a session lock not given back stays held by the server
    session, a transaction left open at the close costs the pooler its server session."""
    with psycopg.connect(pooler.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", [KEY.int64])
    with pytest.raises(AssertionError, match="still hold"):
        pooler.assert_left_clean()
    clients = [psycopg.connect(pooler.dsn, autocommit=True) for _ in range(pooler.size)]
    # PgBouncer links a client to a server session at its first statement, not at its login: all
    # run before any closes, so each runs on its own server session and the holder's is among them.
    for client in clients:
        client.execute("SELECT pg_advisory_unlock_all()")
    for client in clients:
        client.close()
    pooler.assert_left_clean()

    with psycopg.connect(pooler.dsn) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [KEY.int64])
        conn.close()  # inside the transaction, as a guard that did not give back its key would
    with pytest.raises(AssertionError, match="replaced a server session"):
        pooler.assert_left_clean()


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_skip_for_a_period_already_done_frees_the_key_before_the_close(
    scopes_db: Any, pooler: ServerSessions, mode: str
) -> None:
    rules = RunRules(period="2026-12-05")
    with LockGuard(pooler.database, KEY, LockPolicy(mode=mode), rules=rules):  # type: ignore[arg-type]
        pass
    pooler.assert_left_clean()
    with (
        pytest.raises(AlreadyDoneError),
        LockGuard(pooler.database, KEY, LockPolicy(mode=mode), rules=rules),  # type: ignore[arg-type]
    ):
        pytest.fail("ran twice in one period")
    pooler.assert_left_clean()


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_refusal_by_a_live_scope_frees_the_key_before_the_close(
    hook: Any, scopes_db: Any, pooler: ServerSessions, mode: str
) -> None:
    role = ScopeRole(kind="enter", holder=uuid.uuid4().hex, run="dep: dag run", task="setup", lease=300.0)
    with LockGuard(hook.database, KEY, LockPolicy(), scope=role):
        pass
    with (
        pytest.raises(LockBusyError, match="is held by the lock scope"),
        LockGuard(pooler.database, KEY, LockPolicy(mode=mode)),  # type: ignore[arg-type]
    ):
        pytest.fail("ran inside another run's scope")
    pooler.assert_left_clean()


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_check_that_fails_before_the_work_frees_the_key_before_the_close(
    admin: Any, pooler: ServerSessions, mode: str
) -> None:
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")  # fencing needs init-db: refused once the key is held
    with (
        pytest.raises(LockConfigurationError, match="init-db"),
        LockGuard(pooler.database, KEY, LockPolicy(mode=mode), rules=RunRules(fencing=True)),  # type: ignore[arg-type]
    ):
        pytest.fail("fenced without a ledger")
    pooler.assert_left_clean()


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_pool_refused_for_its_size_gives_back_its_markers_before_the_close(
    hook: Any, pooler: ServerSessions, mode: str
) -> None:
    with LockGuard(hook.database, KEY, LockPolicy(mode=mode, slots=2)):  # type: ignore[arg-type]
        with (
            pytest.raises(LockConfigurationError, match="refused a pool of slots=3"),
            LockGuard(pooler.database, KEY, LockPolicy(mode=mode, slots=3)),  # type: ignore[arg-type]
        ):
            pytest.fail("two sizes of one pool")
        with (
            pytest.raises(LockConfigurationError, match="refused a plain key"),
            LockGuard(pooler.database, KEY, LockPolicy(mode=mode)),  # type: ignore[arg-type]
        ):
            pytest.fail("a plain key inside a pool of its name")
    pooler.assert_left_clean()


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_plain_key_refused_after_its_wait_gives_it_back_before_the_close(
    dsn: str, pooler: ServerSessions, mode: str
) -> None:
    """The plain key was busy; a pool of its name began while the guard waited (its presence
    marker, held in shared mode, is what a pool's holder shows); the wait took the key, then found
    the pool: refused, holding the key it waited for."""
    presence = pool_presence_marker(KEY)
    with psycopg.connect(dsn, autocommit=True) as plain, psycopg.connect(dsn, autocommit=True) as pool:
        plain.execute("SELECT pg_advisory_lock(%s)", [KEY.int64])

        def pool_begins_then_plain_frees() -> None:
            time.sleep(0.5)  # the guard is waiting for the plain key
            pool.execute("SELECT pg_advisory_lock_shared(%s)", [presence.int64])
            plain.execute("SELECT pg_advisory_unlock(%s)", [KEY.int64])

        helper = threading.Thread(target=pool_begins_then_plain_frees)
        helper.start()
        try:
            with (
                pytest.raises(LockConfigurationError, match="refused a plain key"),
                LockGuard(pooler.database, KEY, LockPolicy(mode=mode, on_busy="wait", wait_timeout=10)),  # type: ignore[arg-type]
            ):
                pytest.fail("a plain key inside a pool of its name")
        finally:
            helper.join()
            pool.execute("SELECT pg_advisory_unlock_all()")
    pooler.assert_left_clean()


@pytest.mark.parametrize("mode", ["session", "transaction"])
@pytest.mark.parametrize("wait", [False, True], ids=["try", "wait"])
def test_a_pool_found_full_gives_back_its_markers_before_the_close(
    hook: Any, pooler: ServerSessions, mode: str, wait: bool
) -> None:
    """Review -64: every slot busy (or still busy when the wait ran out), the guard and
    hook.acquire returned busy with the pool's presence and size markers still held by the server
    session: every plain key and every other size of the name was then refused for good."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    policy = LockPolicy(mode=mode, slots=2, on_busy="wait" if wait else "skip", wait_timeout=0.3 if wait else None)  # type: ignore[arg-type]
    with LockGuard(hook.database, KEY, LockPolicy(slots=2)), LockGuard(hook.database, KEY, LockPolicy(slots=2)):
        with pytest.raises(LockBusyError), LockGuard(pooler.database, KEY, policy):
            pytest.fail("a third holder of a pool of two")
        pooled = AdvisoryLockHook(dsn=pooler.dsn, pool_mode="session")
        assert pooled.acquire(KEY, slots=2, mode=mode, timeout=0.3 if wait else None) is None  # type: ignore[arg-type]
        pooler.assert_left_clean()
    with LockGuard(pooler.database, KEY, LockPolicy(mode=mode)):  # type: ignore[arg-type]
        pass  # the plain key of the name, now that no pool of it is in use
    pooler.assert_left_clean()


def _cancelled_on_the_server(conn: psycopg.Connection[Any]) -> None:
    """A statement that the server cancels (a foreign pg_cancel_backend), as a cancelled clean-up would meet."""
    timer = threading.Timer(0.3, conn.cancel_safe)
    timer.start()
    try:
        conn.execute("SELECT pg_sleep(30)")
    finally:
        timer.cancel()


@pytest.mark.parametrize("cancels", [1, 2], ids=["cleanup-cancelled-once", "cleanup-cancelled-twice"])
def test_a_failed_batch_whose_cleanup_is_cancelled_is_released_by_the_end(
    pooler: ServerSessions, monkeypatch: pytest.MonkeyPatch, cancels: int
) -> None:
    """Review -64: a try_lock_many that failed after it took keys, whose clean-up was cancelled too,
    left the keys held, untracked, by the session: its block's end did not release them, and
    through a session pooler that resets nothing they stayed held for good. The clean-up is now
    sent once more after a cancel; failing that, the block's end releases them."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.pg import statements

    real_try, real_cleanup = statements.try_lock_many, statements.unlock_held_among
    left = {"cleanup": cancels}

    def took_then_cancelled(conn: psycopg.Connection[Any], keys: list[LockKey], **options: Any) -> list[bool]:
        real_try(conn, keys, **options)  # the batch took its keys, then its statement was cancelled
        _cancelled_on_the_server(conn)
        raise AssertionError("not reached")

    def cleanup(conn: psycopg.Connection[Any], keys: list[LockKey], **options: Any) -> int:
        if left["cleanup"]:
            left["cleanup"] -= 1
            _cancelled_on_the_server(conn)
        return real_cleanup(conn, keys, **options)

    monkeypatch.setattr(statements, "try_lock_many", took_then_cancelled)
    monkeypatch.setattr(statements, "unlock_held_among", cleanup)
    keys = [LockKey.from_name(f"give-up/batch/{i}") for i in range(3)]
    with AdvisoryLockHook(dsn=pooler.dsn, pool_mode="session").lock_session() as session:
        with pytest.raises(psycopg.errors.QueryCanceled):
            session.try_lock_many(keys)
        assert session.held() == []
        server_pid = session.connection.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        still = [row for row in advisory_locks(pooler.admin) if row[0] == server_pid]
        assert len(still) == (0 if cancels == 1 else len(keys))  # sent once more: released at once
    pooler.assert_left_clean()
