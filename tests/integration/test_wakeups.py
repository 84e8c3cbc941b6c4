"""Wake-ups on a real PostgreSQL: the unlock statement announces the release; the waiting
triggers of one event loop share one connection, are woken by an announcement and see a
foreign release at the next poll."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from airflow_pglock.hooks import wakeups
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.triggers.advisory_lock import FREE, AdvisoryLockTrigger
from tests.helpers import TEST_CONN_ID

WAITERS = 200


def test_the_unlock_statement_announces_the_release(dsn: str, holder_hook: AdvisoryLockHook, admin: Any) -> None:
    import psycopg

    key = LockKey.from_name("wakeups/announced")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {wakeups.RELEASED_CHANNEL}")
        held = holder_hook.try_acquire(key, application_name="announcer")
        assert held is not None
        assert held.release() is True  # the unlock still says whether the key was held
        notes = list(listener.notifies(timeout=5, stop_after=1))
    assert [(n.channel, wakeups.coordinates(n.payload)) for n in notes] == [(wakeups.RELEASED_CHANNEL, key.pg_locks)]


def test_two_hundred_waiting_triggers_share_one_connection(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any
) -> None:
    keys = [LockKey.from_name(f"wakeups/{n}") for n in range(WAITERS)]
    holder = holder_hook.connect("provider holder")  # one session holds the 200 keys, released by the hook's unlock
    assert all(holder_hook.try_lock(holder, key) for key in keys)
    foreign_key = LockKey.from_name("wakeups/foreign")
    admin.execute("SELECT pg_advisory_lock(%s)", [foreign_key.int64])  # a holder that announces nothing

    async def wait_all() -> tuple[list[str], int | None, float]:
        deadline = time.time() + 120
        triggers = [
            AdvisoryLockTrigger.for_key(key, postgres_conn_id=TEST_CONN_ID, poll_interval=1, deadline=deadline)
            for key in [*keys, foreign_key]
        ]
        tasks = [asyncio.create_task(_first_event(t)) for t in triggers]
        await asyncio.sleep(2)
        assert not any(task.done() for task in tasks)
        row = await asyncio.to_thread(
            lambda: admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'airflow-pglock wakeups'"
            ).fetchone()
        )
        released = time.monotonic()
        await asyncio.to_thread(lambda: [holder_hook.unlock(holder, key) for key in keys])
        await asyncio.to_thread(lambda: admin.execute("SELECT pg_advisory_unlock(%s)", [foreign_key.int64]))
        statuses = await asyncio.gather(*tasks)
        return statuses, row[0] if row else None, time.monotonic() - released

    try:
        statuses, connections, seconds = asyncio.run(wait_all())
    finally:
        holder.close()
    assert statuses == [FREE] * (WAITERS + 1)
    assert connections == 1  # two hundred and one waiting triggers, one connection
    print(f"wakeups: {WAITERS} announced and 1 foreign release all seen {seconds:.2f} s after the releases began")


async def _first_event(trigger: AdvisoryLockTrigger) -> str:
    async for event in trigger.run():
        return str(event.payload["status"])
    raise AssertionError("the trigger ended without an event")
