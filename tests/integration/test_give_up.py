"""A guard that gives up after it took the key (a skip, a refusal, a check that failed before
the work) frees the key before it closes its connection.

A close alone frees the key only once the server has read it and the backend has exited, a
moment later: a run that tried the key right after a skip could still find it busy, and be
told it is held by a run that had already given up (the suite met it twice: tests that checked
``pg_locks`` right after such a close). Through a session pooler that does not reset its server
sessions, the key was not freed at all.

Every lock here is taken on real PostgreSQL. ``closed_holding`` only looks: when a connection is
closed, it reads ``pg_locks`` from another session first (a close frees the key a moment later,
so what stays held after it cannot be told apart from what is freed late); the PgBouncer test
needs no such look.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
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


@pytest.fixture
def closed_holding(admin: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The advisory locks each connection still held when it was closed (none: not listed)."""
    found: list[Any] = []
    close = psycopg.Connection.close

    def looking_close(self: psycopg.Connection[Any]) -> None:
        if self is not admin and not self.closed:
            pid = self.info.backend_pid
            held = [row for row in advisory_locks(admin) if row[0] == pid and row[4]]
            if held:
                found.append(held)
        close(self)

    monkeypatch.setattr(psycopg.Connection, "close", looking_close)
    yield found


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_skip_for_a_period_already_done_frees_the_key_before_the_close(
    hook: Any, scopes_db: Any, closed_holding: list[Any], mode: str
) -> None:
    rules = RunRules(period="2026-12-05")
    with LockGuard(hook.database, KEY, LockPolicy(mode=mode), rules=rules):  # type: ignore[arg-type]
        pass
    assert closed_holding == []
    with (
        pytest.raises(AlreadyDoneError),
        LockGuard(hook.database, KEY, LockPolicy(mode=mode), rules=rules),  # type: ignore[arg-type]
    ):
        pytest.fail("ran twice in one period")
    assert closed_holding == []


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_refusal_by_a_live_scope_frees_the_key_before_the_close(
    hook: Any, scopes_db: Any, closed_holding: list[Any], mode: str
) -> None:
    role = ScopeRole(kind="enter", holder=uuid.uuid4().hex, run="dep: dag run", task="setup", lease=300.0)
    with LockGuard(hook.database, KEY, LockPolicy(), scope=role):
        pass
    with (
        pytest.raises(LockBusyError, match="is held by the lock scope"),
        LockGuard(hook.database, KEY, LockPolicy(mode=mode)),  # type: ignore[arg-type]
    ):
        pytest.fail("ran inside another run's scope")
    assert closed_holding == []


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_check_that_fails_before_the_work_frees_the_key_before_the_close(
    hook: Any, admin: Any, closed_holding: list[Any], mode: str
) -> None:
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")  # fencing needs init-db: refused once the key is held
    with (
        pytest.raises(LockConfigurationError, match="init-db"),
        LockGuard(hook.database, KEY, LockPolicy(mode=mode), rules=RunRules(fencing=True)),  # type: ignore[arg-type]
    ):
        pytest.fail("fenced without a ledger")
    assert closed_holding == []


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_pool_refused_for_its_size_gives_back_its_markers_before_the_close(
    hook: Any, admin: Any, closed_holding: list[Any], mode: str
) -> None:
    with LockGuard(hook.database, KEY, LockPolicy(mode=mode, slots=2)):  # type: ignore[arg-type]
        with (
            pytest.raises(LockConfigurationError, match="refused a pool of slots=3"),
            LockGuard(hook.database, KEY, LockPolicy(mode=mode, slots=3)),  # type: ignore[arg-type]
        ):
            pytest.fail("two sizes of one pool")
        with (
            pytest.raises(LockConfigurationError, match="refused a plain key"),
            LockGuard(hook.database, KEY, LockPolicy(mode=mode)),  # type: ignore[arg-type]
        ):
            pytest.fail("a plain key inside a pool of its name")
    assert closed_holding == []


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_plain_key_refused_after_its_wait_gives_it_back_before_the_close(
    hook: Any, dsn: str, admin: Any, closed_holding: list[Any], mode: str
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
                LockGuard(hook.database, KEY, LockPolicy(mode=mode, on_busy="wait", wait_timeout=10)),  # type: ignore[arg-type]
            ):
                pytest.fail("a plain key inside a pool of its name")
        finally:
            helper.join()
            pool.execute("SELECT pg_advisory_unlock_all()")
    assert closed_holding == []


def test_through_a_session_pooler_that_keeps_its_sessions_a_skip_leaves_the_key_free(
    pg_server: str, dsn: str, scopes_db: Any
) -> None:
    """PgBouncer in session pooling with no reset query: a client's close hands its server session,
    with whatever it holds, back to the pool. A skip that closed without an unlock left the key held
    there for good."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from devtools.pgbouncer import PgBouncer, PgBouncerUnavailableError

    port = psycopg.conninfo.conninfo_to_dict(pg_server).get("port") or 5432
    try:
        bouncer = PgBouncer(int(port), pool_mode="session", server_reset_query="").start()
    except PgBouncerUnavailableError as error:
        pytest.skip(f"PgBouncer is not available here: {error}")
    try:
        pooled = AdvisoryLockHook(
            dsn=bouncer.dsn_for(str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])), pool_mode="session"
        )
        rules = RunRules(period="2026-12-05")
        with LockGuard(pooled.database, KEY, LockPolicy(), rules=rules):
            pass
        with pytest.raises(AlreadyDoneError), LockGuard(pooled.database, KEY, LockPolicy(), rules=rules):
            pytest.fail("ran twice in one period")
        assert [row for row in advisory_locks(scopes_db) if row[4]] == []
    finally:
        bouncer.stop()
