"""Round trips of a lock connection, counted by a relay in front of the real PostgreSQL.

The floor is the plain pattern: connect, ``pg_try_advisory_lock``, ``pg_advisory_unlock``,
close (5 client flights: SSL request, start-up, two statements, terminate). Each extra
flight of a guarded execution is named below; the counts are exact, so a new round trip
(or one taken away without updating the docs) fails here, not in a timed benchmark.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest

from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.policy import LockPolicy
from devtools.relay import Relay

FLOOR = 5
#: Flights beyond the floor, and why: the server inspection (one statement: server facts,
#: pooler and standby checks) for every lock; the key-name registry check for a named key.
EXTRA_NUMBERED_KEY = 1
EXTRA_NAMED_KEY = 2


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


@pytest.mark.parametrize(
    ("key", "extra"),
    [(LockKey.from_int(1302), EXTRA_NUMBERED_KEY), (LockKey.from_name("round-trips"), EXTRA_NAMED_KEY)],
)
def test_a_guarded_execution_makes_the_floor_plus_the_named_extras(
    relay: tuple[Relay, str], key: LockKey, extra: int
) -> None:
    counter, dsn = relay

    def guarded() -> None:
        with LockGuard(AdvisoryLockHook(dsn=dsn), key, LockPolicy(), logger=logging.getLogger("test")):
            pass

    assert _count(counter, guarded) == FLOOR + extra
    assert counter.connections == 1  # nothing on the side: no second connection


def test_hook_session_lock_makes_the_same_flights(relay: tuple[Relay, str]) -> None:
    counter, dsn = relay

    def session_lock() -> None:
        with AdvisoryLockHook(dsn=dsn).session_lock(LockKey.from_name("round-trips-hook")) as held:
            assert held is not None

    assert _count(counter, session_lock) == FLOOR + EXTRA_NAMED_KEY


def test_liveness_settings_travel_in_the_start_up_packet_next_to_the_connections_own(dsn: str) -> None:
    """No statement sets them, and the connection's own ``options`` extra still applies."""
    hook = AdvisoryLockHook(dsn=f"{dsn} options='-c search_path=pglock_test_path'", liveness=Liveness(7))
    conn, info = hook.open_lock_session("round-trips", "session")
    try:
        assert not info.behind_pooler
        shown = conn.execute(
            "SELECT current_setting('idle_session_timeout'), current_setting('tcp_user_timeout'),"
            " current_setting('search_path')"
        ).fetchone()
        assert shown == ("7s", "7000", "pglock_test_path")
    finally:
        conn.close()
