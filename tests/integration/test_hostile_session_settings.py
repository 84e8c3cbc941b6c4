"""A role or database whose settings psycopg cannot read with, on a real PostgreSQL.

``ALTER ROLE/DATABASE ... SET`` reaches every session of the role or the database, the
provider's own connections included, unless the start-up packet says otherwise. Settings
that broke them before the provider sent its own (``DateStyle = ISO``,
``IntervalStyle = postgres``, ``exit_on_error = off`` in libpq ``options``, and libpq
``client_encoding = UTF8``):

- ``DateStyle = 'SQL, DMY'`` (``Postgres``, ``German``): psycopg cannot read a timestamp
  (``NotImplementedError``), so the holders read that explains a busy key failed the task,
  and ``hook.lock_session()`` (which reads the server's start) did not open;
- a ``SQL_ASCII`` database, or a role's ``client_encoding = SQL_ASCII``: text came back as
  bytes, and a busy key became a ``TypeError``, ``lock_session()`` too;
- a ``LATIN1`` database with the key-name registry installed (init-db): a key name LATIN1
  cannot hold (``'tenant-東京'``) failed the guarded task at its acquisition
  (``UnicodeEncodeError`` in the client), though the registry never fails a task;
- ``exit_on_error = on``: a wait for a busy key that runs out (a skip) ended the session
  ("the connection is closed").

Each test fails without the start-up settings. The last two also check the defences that do
not depend on them: a busy key stays busy when its holders cannot be read, and the registry's
write that cannot be bound leaves the task alone.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_pglock import registry
from airflow_pglock.exceptions import LockBusyError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg import schema
from airflow_pglock.pg.database import LockDatabase
from airflow_pglock.pg.key_names import registered_names
from airflow_pglock.policy import LockPolicy
from tests.helpers import advisory_locks_left


@contextlib.contextmanager
def hostile(
    server_dsn: str,
    *,
    role_settings: Sequence[tuple[str, str]] = (),
    database_settings: Sequence[tuple[str, str]] = (),
    encoding: str | None = None,
) -> Iterator[tuple[str, str]]:
    """A database of its own (``encoding``: created from template0, C locale) and a login role
    of its own (no superuser), each with its settings; yields (the role's DSN, an admin's DSN
    on that database). Dropped after."""
    suffix = uuid.uuid4().hex[:8]
    database, role = f"pglock_hostile_{suffix}", f"pglock_hostile_{suffix}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database))
        if encoding is not None:
            create += sql.SQL(" ENCODING {} TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'").format(
                sql.Literal(encoding)
            )
        conn.execute(create)
        for name, value in database_settings:
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(database), sql.Identifier(name), sql.Literal(value)
                )
            )
        for name, value in role_settings:
            conn.execute(
                sql.SQL("ALTER ROLE {} SET {} = {}").format(
                    sql.Identifier(role), sql.Identifier(name), sql.Literal(value)
                )
            )
    admin_dsn = psycopg.conninfo.make_conninfo(server_dsn, dbname=database)
    role_dsn = psycopg.conninfo.make_conninfo(server_dsn, dbname=database, user=role)
    try:
        yield role_dsn, admin_dsn
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            assert advisory_locks_left(conn) == 0, "a lock was left behind"
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@contextlib.contextmanager
def held_by_another_session(dsn: str, key: LockKey) -> Iterator[int]:
    """``key`` held by a plain session of ``dsn`` (the hostile role's own); yields its pid."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", key.numbers)
        yield conn.info.backend_pid


def assert_the_provider_works(dsn: str, key_name: str = "hostile") -> None:
    """A free key locks (both modes), a busy key is busy (None from ``hook.lock``, a
    ``LockBusyError`` naming its holder's pid from the guard, in both modes, and after a wait
    that runs out), its holders are read, and ``lock_session()`` opens and locks."""
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=60))
    key = LockKey.from_name(key_name)
    for mode in ("session", "transaction"):
        with hook.lock(key, mode=mode) as handle:  # type: ignore[arg-type]
            assert handle is not None, f"a free key must lock ({mode})"
    with held_by_another_session(dsn, key) as holder_pid:
        for mode in ("session", "transaction"):
            with hook.lock(key, mode=mode) as handle:  # type: ignore[arg-type]
                assert handle is None, f"a busy key is busy ({mode})"
            with pytest.raises(LockBusyError) as busy, LockGuard(hook.database, key, LockPolicy(mode=mode)):  # type: ignore[arg-type]
                raise AssertionError("must not run")
            # the holder is named: its holders were read, not only the refusal kept
            assert f"pid {holder_pid}" in str(busy.value), str(busy.value)
        with hook.lock(key, timeout=0.3) as handle:  # a wait that runs out
            assert handle is None
        holders = hook.holders(key)
        assert [holder.pid for holder in holders] == [holder_pid]
        assert isinstance(holders[0].since, dt.datetime)
        assert holders[0].application_name is None or isinstance(holders[0].application_name, str)
        with hook.lock_session() as session:
            with session.try_lock(key) as taken:
                assert taken is None, "busy in a lock session too"
            with session.try_lock(f"{key_name}-free") as taken:
                assert taken is not None
            with session.lock(key, timeout=0.3) as taken:
                assert taken is None
    with hook.lock_session() as session, session.try_lock(key) as taken:
        assert taken is not None


def _show(conn: psycopg.Connection[Any], setting: str) -> str:
    row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting))).fetchone()
    assert row is not None
    return str(row[0] if not isinstance(row[0], bytes) else row[0].decode())


# ----------------------------------------------------------------- F3: DateStyle


@pytest.mark.parametrize("datestyle", ["SQL, DMY", "Postgres, MDY", "German, DMY"])
@pytest.mark.parametrize("where", ["role", "database"])
def test_a_non_iso_datestyle_leaves_busy_a_busy_key(pg_server: str, datestyle: str, where: str) -> None:
    settings = [("DateStyle", datestyle)]
    with hostile(
        pg_server,
        role_settings=settings if where == "role" else (),
        database_settings=settings if where == "database" else (),
    ) as (dsn, _):
        with psycopg.connect(dsn) as plain:  # the set-up reaches a plain session: psycopg cannot read it
            assert _show(plain, "DateStyle") == datestyle
            with pytest.raises(NotImplementedError, match="DateStyle"):
                plain.execute("SELECT now()").fetchone()
        assert_the_provider_works(dsn)


def test_a_non_postgres_intervalstyle_leaves_the_provider_alone(pg_server: str) -> None:
    with hostile(pg_server, role_settings=[("IntervalStyle", "sql_standard"), ("DateStyle", "SQL, DMY")]) as (dsn, _):
        assert_the_provider_works(dsn)
        hook = AdvisoryLockHook(dsn=dsn)
        with hook.lock("hostile-interval", mode="transaction") as handle:
            assert handle is not None and handle.connection is not None
            assert _show(handle.connection, "IntervalStyle") == "postgres"
            assert handle.connection.execute("SELECT interval '1 day 2 hours'").fetchone() == (
                dt.timedelta(days=1, hours=2),
            )


# ----------------------------------------------------------------- F4: SQL_ASCII


def test_a_sql_ascii_database_leaves_busy_a_busy_key(pg_server: str) -> None:
    with hostile(pg_server, encoding="SQL_ASCII") as (dsn, _):
        with psycopg.connect(dsn) as plain:  # a plain session gets bytes
            assert plain.execute("SELECT 'text'::text").fetchone() == (b"text",)
        assert_the_provider_works(dsn)


def test_a_role_client_encoding_sql_ascii_leaves_busy_a_busy_key(pg_server: str) -> None:
    with hostile(pg_server, role_settings=[("client_encoding", "SQL_ASCII")]) as (dsn, _):
        with psycopg.connect(dsn) as plain:
            assert plain.execute("SELECT 'text'::text").fetchone() == (b"text",)
        assert_the_provider_works(dsn)


# ----------------------------------------------------------------- F5: LATIN1 and the registry


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_latin1_database_with_the_registry_never_fails_a_task_for_a_name(
    pg_server: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A name LATIN1 cannot hold is not recorded (a warning), and the task runs and commits; one it
    can hold is recorded. The write that could not be converted is not sent: the server converts a
    whole message before it runs any of it, so it would fail the unlock (session mode) or the
    COMMIT (transaction mode) that travels with it."""
    with hostile(pg_server, encoding="LATIN1") as (dsn, admin_dsn):
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            schema.migrate(admin)
            schema.grant_usage(admin, str(psycopg.conninfo.conninfo_to_dict(dsn)["user"]))
        hook = AdvisoryLockHook(dsn=dsn)
        policy = LockPolicy(mode=mode)  # type: ignore[arg-type]
        ran = []
        foreign, latin = LockKey.from_name(f"tenant-東京-{mode}"), LockKey.from_name(f"tâche-{mode}")
        with caplog.at_level(logging.INFO, logger="test"):
            for key in (foreign, latin):
                with LockGuard(hook.database, key, policy, logger=logging.getLogger("test")) as handle:
                    ran.append(handle.key)
        assert ran == [foreign, latin]
        assert f"does not record the name of {foreign.describe()}" in caplog.text, caplog.text
        assert "encoding (LATIN1) cannot hold it" in caplog.text
        assert caplog.text.count("outcome=completed") == 2 and "the unlock failed" not in caplog.text, caplog.text
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            names = registered_names(admin)
        assert names is not None and [row.name for row in names] == [latin.name]
        assert_the_provider_works(dsn, key_name="tenant-東京")


# ----------------------------------------------------------------- F7: exit_on_error


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_exit_on_error_leaves_a_wait_that_runs_out_a_busy_key(pg_server: str, mode: str) -> None:
    with hostile(pg_server, role_settings=[("exit_on_error", "on")]) as (dsn, _):
        hook = AdvisoryLockHook(dsn=dsn)
        key = LockKey.from_name("hostile-exit-on-error")
        with held_by_another_session(dsn, key) as holder_pid:
            with hook.lock(key, timeout=0.5, mode=mode) as handle:  # type: ignore[arg-type]
                assert handle is None, "a wait that runs out is busy: a skip"
            policy = LockPolicy(mode=mode, on_busy="wait", wait_timeout=0.5)  # type: ignore[arg-type]
            with pytest.raises(LockBusyError, match=f"pid {holder_pid}"), LockGuard(hook.database, key, policy):
                raise AssertionError("must not run")
        if mode == "session":
            assert_the_provider_works(dsn)


# ----------------------------------------------------------------- the connections' settings


def test_the_connections_own_options_are_kept_and_the_providers_win(pg_server: str) -> None:
    """``lock.connection`` (the work's, in transaction mode) gets the start-up settings; the
    connection's own ``options`` still apply, except where they name one of the provider's."""
    with hostile(pg_server, role_settings=[("DateStyle", "German, DMY"), ("exit_on_error", "on")]) as (dsn, _):
        own = f"{dsn} options='-c statement_timeout=12345 -c DateStyle=SQL'"
        hook = AdvisoryLockHook(dsn=own)
        with hook.lock("hostile-options", mode="transaction") as handle:
            assert handle is not None and handle.connection is not None
            conn = handle.connection
            assert _show(conn, "statement_timeout") == "12345ms"
            assert _show(conn, "DateStyle").startswith("ISO")
            assert _show(conn, "exit_on_error") == "off"
            assert _show(conn, "client_encoding") == "UTF8"
            assert isinstance(conn.execute("SELECT now()").fetchone()[0], dt.datetime)  # type: ignore[index]


# ----------------------------------------------------------------- the defences that need no setting


def test_holders_that_cannot_be_read_leave_busy_a_busy_key(
    dsn: str, admin: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever explaining the holders raises (here a TypeError, as bytes for text gave), the key is busy."""

    def unreadable(self: LockDatabase, pool: Sequence[LockKey]) -> list[Any]:
        raise TypeError("startswith first arg must be bytes or a tuple of bytes, not str")

    monkeypatch.setattr(LockDatabase, "holders", unreadable)
    hook = AdvisoryLockHook(dsn=dsn)
    key = LockKey.from_name("hostile-unreadable-holders")
    with held_by_another_session(dsn, key):
        with (
            caplog.at_level(logging.WARNING, logger="test"),
            pytest.raises(LockBusyError, match="an unknown holder") as busy,
            LockGuard(hook.database, key, LockPolicy(), logger=logging.getLogger("test")),
        ):
            raise AssertionError("must not run")
        assert busy.value.holders == ()
        assert "could not read the holders" in caplog.text and "TypeError" in caplog.text
        with hook.lock(key) as handle:
            assert handle is None


def test_a_registry_write_that_cannot_be_bound_never_fails_the_task(
    scopes_db: Any, dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The registry is optional: an error binding its write (an encoding that cannot hold the
    name, as LATIN1 for '東京' did) is a warning, the task runs and releases its lock."""

    def unbindable(conn: Any, statement: Any, params: Any) -> str:
        "東京".encode("latin-1")
        raise AssertionError("unreachable")

    monkeypatch.setattr(registry, "inline", unbindable)
    hook = AdvisoryLockHook(dsn=dsn)
    for mode in ("session", "transaction"):
        key = LockKey.from_name(f"tenant-東京-unbindable-{mode}")
        policy = LockPolicy(mode=mode)  # type: ignore[arg-type]
        with (
            caplog.at_level(logging.WARNING, logger="test"),
            LockGuard(hook.database, key, policy, logger=logging.getLogger("test")) as handle,
        ):
            assert handle.key == key
        assert "UnicodeEncodeError" in caplog.text
    assert advisory_locks_left(scopes_db) == 0
