"""Round trips of a lock connection, counted by a relay in front of the real PostgreSQL.

The floor is the plain pattern: connect, ``pg_try_advisory_lock``, ``pg_advisory_unlock``,
close (5 client flights: SSL request, start-up, two statements, terminate). A guarded
execution makes exactly those: the server facts come from the handshake and from the lock
statement itself, which also says whether the key-name registry is installed; the
registry's write travels with the release. The counts
are exact, so a new round trip fails here, not in a timed benchmark.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest

from airflow_pglock.exceptions import LockBusyError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg.key_names import registered_names
from airflow_pglock.pg.schema import migrate
from airflow_pglock.policy import LockPolicy
from devtools.relay import Relay
from tests.helpers import relayed
from tests.ops_helpers import scratch_database

FLOOR = 5


@pytest.fixture
def relay(dsn: str) -> Iterator[tuple[Relay, str]]:
    with relayed(dsn) as (relay, relayed_dsn):
        yield relay, relayed_dsn


def _count(relay: Relay, operation: object) -> int:
    relay.reset()
    assert callable(operation)
    operation()
    return relay.settle()


def test_the_floor_is_five_flights(relay: tuple[Relay, str]) -> None:
    counter, dsn = relay
    key = LockKey.from_int(1301)

    def floor() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_try_advisory_lock(%s)", key.numbers).fetchone()
            conn.execute("SELECT pg_advisory_unlock(%s)", key.numbers).fetchone()

    assert _count(counter, floor) == FLOOR


@pytest.mark.parametrize("key", [LockKey.from_int(1302), LockKey.from_name("round-trips")], ids=["int64", "named"])
def test_a_guarded_execution_makes_the_floors_flights(relay: tuple[Relay, str], key: LockKey) -> None:
    counter, dsn = relay

    def guarded() -> None:
        with LockGuard(
            AdvisoryLockHook(dsn=dsn).database, key, LockPolicy(), logger=logging.getLogger("test")
        ) as handle:
            assert handle.backend_pid > 0

    assert _count(counter, guarded) == FLOOR
    assert counter.connections == 1  # nothing on the side: no second connection


def test_hook_forms_make_the_floors_flights(relay: tuple[Relay, str]) -> None:
    counter, dsn = relay
    hook = AdvisoryLockHook(dsn=dsn)

    def acquire() -> None:
        held = hook.acquire("round-trips-hook")
        assert held is not None and held.release()

    def hook_lock() -> None:
        with hook.lock("round-trips-hook") as handle:
            assert handle is not None

    for form in (acquire, hook_lock):
        assert _count(counter, form) == FLOOR, form.__name__


def test_busy_is_the_floors_try_and_one_holders_query(relay: tuple[Relay, str], dsn: str) -> None:
    """Busy: connect, the try (refused), close; then the holders for the message on a second connection."""
    counter, relayed = relay
    key = LockKey.from_name("round-trips-busy")
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", key.numbers)

        def busy() -> None:
            with pytest.raises(LockBusyError), LockGuard(AdvisoryLockHook(dsn=relayed).database, key, LockPolicy()):
                raise AssertionError("must not run")

        assert _count(counter, busy) == (FLOOR - 1) + 4  # the lock connection without its unlock; the holders
        assert counter.connections == 2


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_with_the_registry_installed_the_write_travels_with_the_release(
    relay: tuple[Relay, str], pg_server: str, mode: str
) -> None:
    counter, _ = relay
    with scratch_database(pg_server, prefix="pglock_rt") as scratch:
        with psycopg.connect(scratch, autocommit=True) as conn:
            migrate(conn)
        params = psycopg.conninfo.conninfo_to_dict(scratch)
        params.update(host="127.0.0.1", port=counter.port)
        relayed = psycopg.conninfo.make_conninfo(**params)
        key = LockKey.from_name(f"round-trips-registry-{mode}")
        policy = LockPolicy(mode="transaction") if mode == "transaction" else LockPolicy()

        def guarded() -> None:
            with LockGuard(AdvisoryLockHook(dsn=relayed).database, key, policy, logger=logging.getLogger("test")):
                pass

        assert _count(counter, guarded) == FLOOR
        with psycopg.connect(scratch, autocommit=True) as conn:
            assert [r.name for r in registered_names(conn) or []] == [key.name]


def test_liveness_settings_travel_in_the_start_up_packet_next_to_the_connections_own(dsn: str) -> None:
    """No statement sets them, and the connection's own ``options`` extra still applies."""
    hook = AdvisoryLockHook(dsn=f"{dsn} options='-c search_path=pglock_test_path'", liveness=Liveness(7))
    conn, info, _ = hook.database.open_lock_session("round-trips", "session", inspect=False)
    try:
        assert not info.behind_pooler
        shown = conn.execute(
            "SELECT current_setting('idle_session_timeout'), current_setting('tcp_user_timeout'),"
            " current_setting('search_path')"
        ).fetchone()
        assert shown == ("7s", "7000", "pglock_test_path")
    finally:
        conn.close()


def test_a_transaction_lock_opens_its_transaction_in_its_first_statement(relay: tuple[Relay, str]) -> None:
    """``BEGIN``, the liveness settings, the try and the transaction's id travel in one simple
    query; the release checks the key and commits in another: the floor's flights."""
    counter, dsn = relay
    key = LockKey.from_name("round-trips-transaction")

    def guarded() -> None:
        guard = LockGuard(
            AdvisoryLockHook(dsn=dsn).database, key, LockPolicy(mode="transaction"), logger=logging.getLogger("t")
        )
        with guard as handle:
            assert handle.connection is not None
            isolation = handle.connection.execute("SHOW transaction_isolation").fetchone()
            timeout = handle.connection.execute("SHOW idle_in_transaction_session_timeout").fetchone()
            assert (isolation, timeout) == (("read committed",), ("30s",))

    assert _count(counter, guarded) == FLOOR + 2  # + the two SHOWs above


def test_only_while_a_lock_scope_is_live_does_a_named_guard_read_its_scope_row(
    relay: tuple[Relay, str], pg_server: str
) -> None:
    """docs/scopes.md: the scope horizon spares the read while no scope is live in the database."""
    import uuid

    from airflow_pglock.scope_rules import ScopeRole

    counter, _ = relay
    with scratch_database(pg_server, prefix="pglock_rt") as scratch:
        with psycopg.connect(scratch, autocommit=True) as conn:
            migrate(conn)
        params = psycopg.conninfo.conninfo_to_dict(scratch)
        params.update(host="127.0.0.1", port=counter.port)
        database = AdvisoryLockHook(dsn=psycopg.conninfo.make_conninfo(**params)).database
        plain, scoped = LockKey.from_name("round-trips-plain"), LockKey.from_name("round-trips-scoped")
        quiet = logging.getLogger("test")

        def guarded() -> None:
            with LockGuard(database, plain, LockPolicy(), logger=quiet):
                pass

        assert _count(counter, guarded) == FLOOR
        holder = uuid.uuid4().hex
        role = ScopeRole(kind="enter", holder=holder, run="rt", lease=300)

        def enter() -> None:
            with LockGuard(database, scoped, LockPolicy(), logger=quiet, scope=role):
                pass

        _count(counter, enter)  # and its connection's end is counted there, not below
        assert _count(counter, guarded) == FLOOR + 1, "another key's live scope: this key's row is read"
        leave = ScopeRole(kind="leave", holder=holder, run="rt")

        def teardown() -> None:
            with LockGuard(database, scoped, LockPolicy(), logger=quiet, scope=leave):
                pass

        _count(counter, teardown)
        assert _count(counter, guarded) == FLOOR, "the teardown lowered the horizon"


def test_who_holds_a_free_key_is_read_in_one_statement(relay: tuple[Relay, str], dsn: str) -> None:
    """Nobody is an answer only from a primary: the standby check travels with the read of pg_locks.
    It was a second statement, and behind a pooler whose servers are a primary and a standby the two
    could reach different servers (the standby's empty pg_locks, the primary's 'not in recovery')."""
    import asyncio

    counter, relayed_dsn = relay
    hook = AdvisoryLockHook(dsn=relayed_dsn)
    connect_and_close = 3  # SSL request, start-up, terminate
    assert _count(counter, lambda: hook.holders("round-trips-free")) == connect_and_close + 1
    assert _count(counter, lambda: asyncio.run(hook.aholders("round-trips-free", slots=3))) == connect_and_close + 1
    held = AdvisoryLockHook(dsn=dsn).acquire("round-trips-held")  # not through the relay: it stays open
    assert held is not None
    assert _count(counter, lambda: hook.holders("round-trips-held")) == connect_and_close + 1
    assert held.release()
