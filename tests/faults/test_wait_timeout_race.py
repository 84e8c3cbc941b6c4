"""A wait whose ``lock_timeout`` fires just as the key is granted.

PostgreSQL can grant the lock and still raise the timeout: when the holder's release wakes the
waiter at the moment its timer fires, the error cleanup keeps the lock it was granted
(``LockErrorCleanup`` -> ``GrantAwaitedLock``). A session-level advisory lock outlives the
aborted statement, so a wait that answers "timed out" may hold the key. Found by the randomized
race (a lock session held a key it did not track after ``lock(key, timeout=...)``): 30 of 300
attempts answered "timed out" while holding the key before the fix. In transaction scope the wait
runs in a savepoint whose rollback releases what it was granted: the same test shows it.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock.keys import LockKey
from airflow_pglock.pg import statements
from airflow_pglock.pg.release import unlock
from tests.helpers import advisory_locks

pytestmark = [pytest.mark.faults, pytest.mark.slow]

ATTEMPTS = 300
TIMEOUT = 0.05


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_a_wait_that_times_out_as_the_key_is_released_holds_nothing_or_says_it_holds_it(
    scope: str, dsn: str, admin: Any
) -> None:
    key = LockKey.from_name(f"wait-timeout-race-{scope}")
    rng = random.Random(20261201)
    mismatches: list[tuple[int, bool, bool]] = []
    answers = {True: 0, False: 0}
    with (
        psycopg.connect(dsn, autocommit=True) as holder,
        psycopg.connect(dsn, autocommit=True) as waiter,
    ):
        for attempt in range(ATTEMPTS):
            assert statements.try_lock(holder, key)
            release_after = TIMEOUT + rng.uniform(-0.004, 0.004)
            started = threading.Event()

            def release(delay: float = release_after, ready: threading.Event = started) -> None:
                ready.wait()
                time.sleep(delay)
                unlock(holder, key)

            releaser = threading.Thread(target=release, daemon=True)
            releaser.start()
            started.set()
            if scope == "transaction":
                waiter.execute("BEGIN")
            taken = statements.wait_lock(waiter, key, TIMEOUT, scope=scope)  # type: ignore[arg-type]
            releaser.join(timeout=10)
            held = statements.is_held(waiter, key)
            answers[taken] += 1
            if taken != held:
                mismatches.append((attempt, taken, held))
            if scope == "transaction":
                waiter.execute("ROLLBACK")
            elif held:
                unlock(waiter, key)
    assert mismatches == [], f"wait_lock's answer disagreed with pg_locks (attempt, answered, held): {mismatches}"
    assert answers[True] and answers[False], f"the race was not exercised: {answers}"
    assert advisory_locks(admin) == []
