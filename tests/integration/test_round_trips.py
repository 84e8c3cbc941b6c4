"""Round trips of a lock connection, counted by a relay in front of the real PostgreSQL.

The floor is the plain pattern: connect, ``pg_try_advisory_lock``, ``pg_advisory_unlock``,
close (5 client flights: SSL request, start-up, two statements, terminate). A guarded
execution makes exactly those: the server facts come from the handshake and from the lock
statement itself, which also says whether the key-name registry is installed. The counts
are exact, so a new round trip fails here, not in a timed benchmark.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import psycopg
import pytest

from airflow_pglock.exceptions import LockBusyError
from airflow_pglock.guard import LockGuard, LockHandle
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.hooks.schema import migrate, registered_names
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.policy import LockPolicy
from airflow_pglock.registry import PendingName
from devtools.relay import Relay
from tests.ops_helpers import scratch_database

FLOOR = 5


@pytest.fixture
def relay(dsn: str) -> Iterator[tuple[Relay, str]]:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    with Relay(int(params.get("port") or 5432), str(params.get("host") or "127.0.0.1")) as relay:
        params.update(host="127.0.0.1", port=relay.port)
        yield relay, psycopg.conninfo.make_conninfo(**params)


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
        with LockGuard(AdvisoryLockHook(dsn=dsn), key, LockPolicy(), logger=logging.getLogger("test")) as handle:
            assert handle.backend_pid > 0

    assert _count(counter, guarded) == FLOOR
    assert counter.connections == 1  # nothing on the side: no second connection


def test_hook_forms_make_the_floors_flights(relay: tuple[Relay, str]) -> None:
    counter, dsn = relay
    hook = AdvisoryLockHook(dsn=dsn)

    def lock_without_heartbeat() -> None:
        with hook.lock_without_heartbeat(LockKey.from_name("round-trips-hook")) as held:
            assert held is not None

    def try_acquire() -> None:
        held = hook.try_acquire("round-trips-hook")
        assert held is not None and held.release()

    def hook_lock() -> None:
        with hook.lock("round-trips-hook") as handle:
            assert handle is not None

    for form in (lock_without_heartbeat, try_acquire, hook_lock):
        assert _count(counter, form) == FLOOR, form.__name__


def test_busy_is_the_floors_try_and_one_holders_query(relay: tuple[Relay, str], dsn: str) -> None:
    """Busy: connect, the try (refused), close; then the holders for the message on a second connection."""
    counter, relayed = relay
    key = LockKey.from_name("round-trips-busy")
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", key.numbers)

        def busy() -> None:
            with pytest.raises(LockBusyError), LockGuard(AdvisoryLockHook(dsn=relayed), key, LockPolicy()):
                raise AssertionError("must not run")

        assert _count(counter, busy) == (FLOOR - 1) + 4  # the lock connection without its unlock; the holders
        assert counter.connections == 2


#: Flights of a guarded execution before its work starts: SSL request, start-up, the lock statement.
BEFORE_WORK = FLOOR - 2


@pytest.fixture
def registry_db(relay: tuple[Relay, str], pg_server: str) -> Iterator[tuple[Relay, str, str]]:
    """A scratch database with the key-name registry installed: (relay, relayed dsn, direct dsn)."""
    counter, _ = relay
    with scratch_database(pg_server, prefix="pglock_rt") as scratch:
        with psycopg.connect(scratch, autocommit=True) as conn:
            migrate(conn)
        params = psycopg.conninfo.conninfo_to_dict(scratch)
        params.update(host="127.0.0.1", port=counter.port)
        yield counter, psycopg.conninfo.make_conninfo(**params), scratch


def _names(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r.name for r in registered_names(conn) or []]


def _guarded(
    dsn: str, key: LockKey, work: Callable[[LockGuard, LockHandle], None], logger: logging.Logger
) -> LockGuard:
    guard = LockGuard(AdvisoryLockHook(dsn=dsn), key, LockPolicy(), logger=logger)
    with guard as handle:
        work(guard, handle)
    assert guard.outcome == "completed"
    return guard


def _pending(guard: LockGuard) -> PendingName:
    assert guard._pending is not None  # an installed, usable registry and a named key: a write to do
    return guard._pending


def test_with_the_registry_installed_the_work_starts_after_the_floors_flights(
    registry_db: tuple[Relay, str, str],
) -> None:
    """The write is not on the work's path: the work starts after the lock statement; the
    write goes with the unlock (the floor's 5 in all) or overlaps the work (one more)."""
    counter, relayed, direct = registry_db
    seen: dict[str, object] = {}

    def work(guard: LockGuard, handle: LockHandle) -> None:
        seen["claimed"] = _pending(guard).done_by  # first: a write claimed after this was not sent before
        seen["flights"] = counter.flights

    counter.reset()
    guard = _guarded(relayed, LockKey.from_name("round-trips-registry"), work, logging.getLogger("test"))
    total = counter.settle()
    if seen["claimed"] is None:
        assert seen["flights"] == BEFORE_WORK
    else:  # the heartbeat had claimed the write already: it may have been sent before the count
        assert seen["flights"] in (BEFORE_WORK, BEFORE_WORK + 1)
    assert total == FLOOR + (1 if _pending(guard).done_by == "heartbeat" else 0)
    assert _pending(guard).done_by in ("heartbeat", "unlock")
    assert _names(direct) == ["round-trips-registry"]


def test_with_the_work_using_the_connection_the_write_goes_with_the_unlock(
    registry_db: tuple[Relay, str, str],
) -> None:
    """While the work holds the connection the heartbeat leaves it alone: the release sends
    the write and the unlock in one flight (the floor's 5 in all), and the name is recorded."""
    counter, relayed, direct = registry_db

    def work(guard: LockGuard, handle: LockHandle) -> None:
        assert guard.held is not None
        with guard.held.connection.lock:  # as a statement of the work would (e.g. a sub-key on it)
            assert _pending(guard).tried_aside.wait(10)

    counter.reset()
    guard = _guarded(relayed, LockKey.from_name("round-trips-registry-release"), work, logging.getLogger("test"))
    assert counter.settle() == FLOOR
    assert _pending(guard).done_by == "unlock"
    assert _names(direct) == ["round-trips-registry-release"]


def test_with_a_long_work_the_heartbeat_writes_the_name_while_it_runs(registry_db: tuple[Relay, str, str]) -> None:
    counter, relayed, direct = registry_db

    def work(guard: LockGuard, handle: LockHandle) -> None:
        assert _pending(guard).written.wait(10)  # bounded: recorded while the lock is held
        assert _names(direct) == ["round-trips-registry-long"]

    counter.reset()
    guard = _guarded(relayed, LockKey.from_name("round-trips-registry-long"), work, logging.getLogger("test"))
    assert counter.settle() == FLOOR + 1
    assert _pending(guard).done_by == "heartbeat"


@pytest.mark.parametrize("path", ["heartbeat", "unlock"])
def test_a_failing_registry_write_fails_neither_the_task_nor_the_lock(
    registry_db: tuple[Relay, str, str], caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """The lock statement found the registry usable; the write itself then fails (a trigger
    refuses it, as a revoked privilege would): a warning, the task completes, the lock is released."""
    _, relayed, direct = registry_db
    with psycopg.connect(direct, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION pglock.refuse() RETURNS trigger LANGUAGE plpgsql AS"
            " $$BEGIN RAISE EXCEPTION 'registry refused'; END$$"
        )
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON pglock.key_names FOR EACH ROW EXECUTE FUNCTION pglock.refuse()"
        )
    key = LockKey.from_name(f"round-trips-registry-fails-{path}")

    def work(guard: LockGuard, handle: LockHandle) -> None:
        if path == "heartbeat":
            assert _pending(guard).written.wait(10)
        else:
            assert guard.held is not None
            with guard.held.connection.lock:
                assert _pending(guard).tried_aside.wait(10)

    logger = logging.getLogger("test.registry")
    with caplog.at_level(logging.WARNING, logger="test.registry"):
        guard = _guarded(relayed, key, work, logger)
    assert _pending(guard).done_by == path
    assert any(
        "could not record the name" in r.getMessage() and "registry refused" in r.getMessage() for r in caplog.records
    )
    assert _names(direct) == []
    with psycopg.connect(direct, autocommit=True) as conn:  # released: free for anyone
        assert conn.execute("SELECT pg_try_advisory_lock(%s)", key.numbers).fetchone() == (True,)


def test_liveness_settings_travel_in_the_start_up_packet_next_to_the_connections_own(dsn: str) -> None:
    """No statement sets them, and the connection's own ``options`` extra still applies."""
    hook = AdvisoryLockHook(dsn=f"{dsn} options='-c search_path=pglock_test_path'", liveness=Liveness(7))
    conn, info = hook.open_lock_session("round-trips", "session", inspect=False)
    try:
        assert not info.behind_pooler
        shown = conn.execute(
            "SELECT current_setting('idle_session_timeout'), current_setting('tcp_user_timeout'),"
            " current_setting('search_path')"
        ).fetchone()
        assert shown == ("7s", "7000", "pglock_test_path")
    finally:
        conn.close()
