"""Wake-ups on a real PostgreSQL: the unlock statement announces the release; the waiting
triggers of one event loop share one connection, are woken by an announcement and see a
foreign release at the next poll."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import statements, wakeups
from airflow_pglock.pg.release import unlock
from airflow_pglock.triggers.advisory_lock import FREE, AdvisoryLockTrigger
from devtools.relay import Relay
from tests.helpers import TEST_CONN_ID, allow_connections, relayed

WAITERS = 200


def test_the_unlock_statement_announces_the_release(dsn: str, holder_hook: AdvisoryLockHook, admin: Any) -> None:
    import psycopg

    key = LockKey.from_name("wakeups/announced")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {wakeups.RELEASED_CHANNEL}")
        held = holder_hook.acquire(key, application_name="announcer")
        assert held is not None
        assert held.release() is True  # the unlock still says whether the key was held
        notes = list(listener.notifies(timeout=5, stop_after=1))
    assert [(n.channel, wakeups.coordinates(n.payload)) for n in notes] == [(wakeups.RELEASED_CHANNEL, key.pg_locks)]


def test_two_hundred_waiting_triggers_share_one_connection(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any
) -> None:
    keys = [LockKey.from_name(f"wakeups/{n}") for n in range(WAITERS)]
    holder = holder_hook.database.connect(
        "provider holder"
    )  # one session holds the 200 keys, released by the hook's unlock
    assert all(statements.try_lock(holder, key) for key in keys)
    foreign_key = LockKey.from_name("wakeups/foreign")
    admin.execute("SELECT pg_advisory_lock(%s)", [foreign_key.int64])  # a holder that announces nothing

    async def wait_all() -> tuple[list[str], int | None, float]:
        deadline = time.time() + 120
        triggers = [
            AdvisoryLockTrigger.for_key(
                key, postgres_conn_id=TEST_CONN_ID, poll_interval=1, deadline=deadline, resume_hold=0
            )
            for key in [*keys, foreign_key]
        ]
        tasks = [asyncio.create_task(_first_event(t)) for t in triggers]
        await asyncio.sleep(2)
        assert not any(task.done() for task in tasks)
        listening = time.monotonic() + 30  # on a loaded machine the hub may connect after the 2 s
        while True:
            row = await asyncio.to_thread(
                lambda: admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'airflow-pglock wakeups'"
                    " AND datname = current_database()"
                ).fetchone()
            )
            if (row and row[0]) or time.monotonic() > listening:
                break
            await asyncio.sleep(0.1)
        released = time.monotonic()
        await asyncio.to_thread(lambda: [unlock(holder, key) for key in keys])
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


# ------------------------------------------------------------------ foreign input, hub faults
# Anyone who may connect can NOTIFY the channel. Each scenario waits with a long deadline
# and poll interval (LONG), so only a wake-up or the hub's own re-check can fire the
# trigger before them; FIRE_WITHIN bounds the wait for its event, well before LONG.

LONG = 120.0
FIRE_WITHIN = 60.0
HUB = "airflow-pglock wakeups"


def _trigger(key: LockKey, conn_id: str = TEST_CONN_ID, deadline: float | None = LONG) -> AdvisoryLockTrigger:
    return AdvisoryLockTrigger.for_key(  # resume_hold=0: these tests time the trigger's own wake-up
        key,
        postgres_conn_id=conn_id,
        poll_interval=LONG,
        deadline=None if deadline is None else time.time() + deadline,
        resume_hold=0,
    )


def _hub_ready(conn: Any) -> int:
    """The pid of the hub's connection once it is listening and has read pg_locks (idle after that read)."""
    limit = time.monotonic() + FIRE_WITHIN
    while time.monotonic() < limit:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND state = 'idle'"
            " AND query LIKE %s AND datname = current_database()",
            [HUB, "%pg_locks%"],
        ).fetchone()
        if row:
            return int(row[0])
        time.sleep(0.02)
    raise AssertionError("the wake-up hub never listened and read pg_locks")


def _notify(conn: Any, *payloads: str) -> None:
    """A foreign client's NOTIFYs (one transaction: identical payloads in it are sent once)."""
    conn.execute("SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p", [wakeups.RELEASED_CHANNEL, list(payloads)])


async def _fires_after(trigger: AdvisoryLockTrigger, conn: Any, *steps: Any) -> dict[str, Any]:
    """Start the trigger, run ``steps`` (in a thread, in order) once its hub is ready, return its first event."""
    fired = asyncio.create_task(_first_payload(trigger))
    await asyncio.to_thread(_hub_ready, conn)
    for step in steps:
        await asyncio.to_thread(step)
    return await asyncio.wait_for(fired, FIRE_WITHIN)


async def _first_payload(trigger: AdvisoryLockTrigger) -> dict[str, Any]:
    async for event in trigger.run():
        return dict(event.payload)
    raise AssertionError("the trigger ended without an event")


BAD_PAYLOADS = ["²/0/1", "0/0/²", "/".join(["9" * 5000, "0", "1"]), "9" * 4301 + "/0/1"]


@pytest.mark.parametrize("bad", BAD_PAYLOADS, ids=lambda text: f"{text[:6]!a}_len{len(text)}")
def test_a_foreign_payload_int_cannot_read_does_not_stop_the_wakeups(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any, bad: str
) -> None:
    key = LockKey.from_name("wakeups/bad-payload")
    held = holder_hook.acquire(key, application_name="announcer")
    assert held is not None
    event = asyncio.run(_fires_after(_trigger(key), admin, lambda: _notify(admin, bad), held.release))
    assert event["status"] == FREE, event


def test_a_flood_of_foreign_payloads_does_not_stop_the_wakeups(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any
) -> None:
    from tests.unit.test_wakeup_payload import FOREIGN

    sendable = [text for text in FOREIGN if "\x00" not in text and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)]
    key = LockKey.from_name("wakeups/flood")
    held = holder_hook.acquire(key, application_name="announcer")
    assert held is not None
    other = LockKey.from_name("wakeups/flood-not-waited-for")  # well-formed, for a key nobody waits on

    def flood() -> None:
        for _ in range(50):
            _notify(admin, *sendable, wakeups.payload(other))

    event = asyncio.run(_fires_after(_trigger(key, deadline=None), admin, flood, held.release))
    assert event["status"] == FREE, event


def test_a_payload_not_in_the_databases_encoding_does_not_stop_the_wakeups(
    airflow_db: Any, pg_server: str, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a SQL_ASCII lock database the server passes any byte on: psycopg cannot decode it."""
    import psycopg
    from psycopg import sql

    from airflow_pglock.liveness import Liveness

    name = "pglock_tests_sql_ascii"
    info = psycopg.conninfo.conninfo_to_dict(pg_server)
    with psycopg.connect(pg_server, autocommit=True) as server:
        server.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        server.execute(
            sql.SQL("CREATE DATABASE {} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0").format(
                sql.Identifier(name)
            )
        )
    ascii_dsn = psycopg.conninfo.make_conninfo(**{**info, "dbname": name})
    uri = f"postgresql://{info.get('user', 'postgres')}@{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}/{name}"
    monkeypatch.setenv("AIRFLOW_CONN_PGLOCK_TEST_ASCII", uri)
    key = LockKey.from_name("wakeups/undecodable")
    try:
        with psycopg.connect(ascii_dsn, autocommit=True) as foreign:
            held = AdvisoryLockHook(dsn=ascii_dsn, liveness=Liveness(lease=600)).acquire(key)
            assert held is not None
            undecodable = "SELECT pg_notify(%s, convert_from('\\xff2f302f31'::bytea, 'SQL_ASCII'))"
            event = asyncio.run(
                _fires_after(
                    _trigger(key, "pglock_test_ascii"),
                    foreign,
                    lambda: foreign.execute(undecodable, [wakeups.RELEASED_CHANNEL]),
                    held.release,
                )
            )
    finally:
        with psycopg.connect(pg_server, autocommit=True) as server:
            server.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    assert event["status"] == FREE, event


def test_an_unforeseen_error_in_the_hub_restarts_it_and_every_key_is_checked_again(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug (here: the release's own announcement breaks the hub) loses that wake-up, not the wait."""
    reads = []
    real = wakeups.coordinates

    def breaks_once(text: str) -> Any:
        reads.append(text)
        if len(reads) == 1:
            raise RuntimeError("a bug in the hub")
        return real(text)

    monkeypatch.setattr(wakeups, "coordinates", breaks_once)
    key = LockKey.from_name("wakeups/hub-bug")
    held = holder_hook.acquire(key, application_name="announcer")
    assert held is not None
    event = asyncio.run(_fires_after(_trigger(key, deadline=None), admin, held.release))
    assert event["status"] == FREE, event
    assert reads[:1] == [wakeups.payload(key)]


def test_a_hub_that_keeps_failing_makes_its_waiters_report_the_error(
    airflow_db: Any, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the hub checked the key, it fails at every read: the trigger reports it, not waits forever."""
    real = wakeups.aheld
    calls = []

    async def fails_after_the_first(conn: Any, keys: Any) -> Any:
        calls.append(keys)
        if len(calls) == 1:
            return await real(conn, keys)
        raise RuntimeError("a bug in the hub's read")

    monkeypatch.setattr(wakeups, "aheld", fails_after_the_first)
    key = LockKey.from_name("wakeups/hub-keeps-failing")
    admin.execute("SELECT pg_advisory_lock(%s)", [key.int64])
    try:
        event = asyncio.run(
            _fires_after(_trigger(key, deadline=None), admin, lambda: _notify(admin, wakeups.payload(key)))
        )
    finally:
        admin.execute("SELECT pg_advisory_unlock(%s)", [key.int64])
    assert event["status"] == "error" and event["error_type"] == "RuntimeError", event
    assert "a bug in the hub's read" in event["message"]


# ------------------------------------------------------------------ cases that held up (regressions)


def test_the_hub_reconnects_after_its_connection_is_terminated_and_checks_every_key(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any
) -> None:
    """The key is released while the hub is away (its announcement is lost): the reconnect's check sees it."""
    key = LockKey.from_name("wakeups/hub-drop")
    held = holder_hook.acquire(key, application_name="announcer")
    assert held is not None
    pids: list[int] = []  # the hub's connection

    def terminate_the_hub() -> None:
        pids.append(_hub_ready(admin))
        admin.execute("SELECT pg_terminate_backend(%s)", [pids[0]])

    def release_while_it_is_away() -> None:
        limit = time.monotonic() + FIRE_WITHIN
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pids[0]]).fetchone():
            assert time.monotonic() < limit
            time.sleep(0.01)
        held.release()

    event = asyncio.run(_fires_after(_trigger(key), admin, terminate_the_hub, release_while_it_is_away))
    assert event["status"] == FREE, event


def test_a_deadline_while_the_lock_database_is_gone_is_reported_as_an_error_not_as_held(
    airflow_db: Any, admin: Any, pg_server: str
) -> None:
    """The hub read the first key held; then its connection went and the database refuses every
    connection. At the first trigger's deadline nobody can say the key is still held (a stopped
    server holds nothing): it reported "timeout", which a sensor with soft_fail turned into a
    skip. A trigger that started during the outage waited for the database to come back,
    past its deadline. Once it is back, the outage the last waiters left says nothing: a
    trigger that starts then is read as usual."""
    import psycopg

    read_before, started_during = LockKey.from_name("wakeups/outage-read"), LockKey.from_name("wakeups/outage-new")
    server = psycopg.connect(pg_server, autocommit=True)
    database = admin.info.dbname
    admin.execute("SELECT pg_advisory_lock(%s), pg_advisory_lock(%s)", [read_before.int64, started_during.int64])

    async def outage() -> list[dict[str, Any]]:
        first = asyncio.create_task(_first_payload(_trigger(read_before, deadline=8)))
        hub = await asyncio.to_thread(_hub_ready, admin)
        await asyncio.to_thread(allow_connections, server, database, False)
        await asyncio.to_thread(admin.execute, "SELECT pg_terminate_backend(%s)", [hub])
        second = asyncio.create_task(_first_payload(_trigger(started_during, deadline=2)))
        events = list(await asyncio.wait_for(asyncio.gather(first, second), 30))
        await asyncio.to_thread(allow_connections, server, database, True)
        free_key = LockKey.from_name("wakeups/after-the-outage")
        events.append(await asyncio.wait_for(_first_payload(_trigger(free_key, deadline=-1)), 30))
        return events

    try:
        *during, after = asyncio.run(outage())
    finally:
        allow_connections(server, database, True)
        server.close()
        admin.execute("SELECT pg_advisory_unlock_all()")
    for event in during:
        assert event["status"] == "error" and event["error_type"] == "LockConnectionError", event
        assert "wake-up connection to the lock database was lost" in event["message"], event
    assert after["status"] == FREE, after


def test_a_trigger_that_starts_while_the_lock_database_refuses_connections_waits_for_it(
    airflow_db: Any, admin: Any, pg_server: str
) -> None:
    """No hub yet (no other trigger keeps a connection), and the database refuses connections
    for a moment, as a triggerer restarting during a failover finds it: the trigger keeps trying
    and sees the key once the database is back. It reported the connection error at once, which
    failed the deferred task."""
    import psycopg

    key = LockKey.from_name("wakeups/starts-during-an-outage")
    server = psycopg.connect(pg_server, autocommit=True)
    database = admin.info.dbname

    async def outage() -> dict[str, Any]:
        allow_connections(server, database, False)
        fired = asyncio.create_task(_first_payload(_trigger(key, deadline=FIRE_WITHIN)))
        await asyncio.sleep(3)
        refused_meanwhile = fired.done()
        allow_connections(server, database, True)
        event = await asyncio.wait_for(fired, FIRE_WITHIN)
        assert not refused_meanwhile, f"it gave up while the database refused connections: {event}"
        return event

    try:
        event = asyncio.run(outage())
    finally:
        allow_connections(server, database, True)
        server.close()
    assert event["status"] == FREE, event


def test_a_deadline_before_the_first_connection_opens_says_it_could_not_connect(
    airflow_db: Any, admin: Any, pg_server: str
) -> None:
    """A trigger whose deadline passes while the hub is still trying its first connection reports
    that it could not connect (with the database's answer), not that a connection "was lost"."""
    import psycopg

    key = LockKey.from_name("wakeups/never-connected")
    server = psycopg.connect(pg_server, autocommit=True)
    database = admin.info.dbname
    trigger = _trigger(key, deadline=1)
    trigger.connect_timeout = 2  # a hub of its own, and a short read grace (connect timeout + 1 s)
    allow_connections(server, database, False)
    try:
        event = asyncio.run(asyncio.wait_for(_first_payload(trigger), FIRE_WITHIN))
    finally:
        allow_connections(server, database, True)
        server.close()
    assert event["status"] == "error" and event["error_type"] == "LockConnectionError", event
    assert "could not connect to the lock database" in event["message"], event
    assert "not currently accepting connections" in event["message"] and "was lost" not in event["message"], event


def test_a_deadline_the_hub_reads_as_held_is_told_only_by_a_server_that_answers(
    airflow_db: Any, admin: Any, pg_server: str
) -> None:
    """At the deadline the hub's last read said "held", but the server no longer takes a new
    connection (the hub's own is still up, as a partition it has not noticed yet leaves it): the
    deadline's look at the holders fails, and the trigger reports that error. It reported
    "timeout" with "a holder that could not be named", which a soft_fail sensor skipped on."""
    import psycopg

    key = LockKey.from_name("wakeups/deadline-unanswered")
    server = psycopg.connect(pg_server, autocommit=True)
    database = admin.info.dbname
    admin.execute("SELECT pg_advisory_lock(%s)", [key.int64])
    try:
        event = asyncio.run(
            _fires_after(_trigger(key, deadline=3), admin, lambda: allow_connections(server, database, False))
        )
    finally:
        allow_connections(server, database, True)
        server.close()
        admin.execute("SELECT pg_advisory_unlock_all()")
    assert event["status"] == "error" and event["error_type"] == "LockConnectionError", event
    assert "could not read who holds" in event["message"], event


@pytest.mark.parametrize("slots", [1, 2], ids=["key", "pool"])
def test_a_release_the_hub_has_not_read_by_the_deadline_is_free_not_held_by_nobody(
    airflow_db: Any, admin: Any, slots: int
) -> None:
    """A foreign client's release announces nothing; the hub reads pg_locks again only at its poll.
    At the deadline the fresh look at the holders finds the key free: the event is "free". It was
    "timeout ... still held by nobody", which fails a sensor without a retry."""
    from airflow_pglock.keys import slot_keys

    pool = slot_keys(LockKey.from_name("wakeups/released-unannounced"), slots)
    admin.execute("SELECT pg_advisory_lock(k) FROM unnest(%s::bigint[]) AS k", [[key.int64 for key in pool]])
    trigger = AdvisoryLockTrigger.for_key(
        pool[0],
        postgres_conn_id=TEST_CONN_ID,
        poll_interval=LONG,
        deadline=time.time() + 4,
        slots=slots,
        resume_hold=0,
    )
    try:
        event = asyncio.run(
            _fires_after(trigger, admin, lambda: admin.execute("SELECT pg_advisory_unlock(%s)", [pool[-1].int64]))
        )
    finally:
        admin.execute("SELECT pg_advisory_unlock_all()")
    assert event["status"] == FREE, event


def test_a_waiter_that_polls_often_is_not_held_back_by_one_that_came_first_and_polls_rarely(
    airflow_db: Any, admin: Any
) -> None:
    """One hub serves every trigger of a connection id. A sensor with a long poke_interval came
    first; a trigger that polls every second joins later. Its foreign release (no announcement)
    is seen at its own poll, long before its deadline; the hub kept the first waiter's interval."""
    rare, often = LockKey.from_name("wakeups/polls-rarely"), LockKey.from_name("wakeups/polls-often")
    admin.execute("SELECT pg_advisory_lock(%s), pg_advisory_lock(%s)", [rare.int64, often.int64])

    async def scenario() -> tuple[dict[str, Any], float]:
        first = asyncio.create_task(_first_payload(_trigger(rare)))  # polls every LONG seconds
        await asyncio.to_thread(_hub_ready, admin)
        deadline = time.time() + FIRE_WITHIN
        second = AdvisoryLockTrigger.for_key(
            often, postgres_conn_id=TEST_CONN_ID, poll_interval=1, deadline=deadline, resume_hold=0
        )
        fired = asyncio.create_task(_first_payload(second))
        await asyncio.sleep(2)  # its first read (at once) found it held
        await asyncio.to_thread(admin.execute, "SELECT pg_advisory_unlock(%s)", [often.int64])
        event = await asyncio.wait_for(fired, FIRE_WITHIN + 10)
        first.cancel()
        return event, deadline - time.time()

    try:
        event, left = asyncio.run(scenario())
    finally:
        admin.execute("SELECT pg_advisory_unlock_all()")
    assert event["status"] == FREE, event
    assert left > FIRE_WITHIN / 2, f"seen {FIRE_WITHIN - left:.0f} s after the release, at the deadline's read"


def test_the_hub_listens_before_every_check(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release between a check and a LISTEN would be lost: every read runs on a listening connection."""
    real = wakeups.aheld
    listening: list[list[str]] = []

    async def spy(conn: Any, keys: Any) -> Any:
        cursor = await conn.execute("SELECT pg_listening_channels()")
        listening.append([row[0] for row in await cursor.fetchall()])
        return await real(conn, keys)

    monkeypatch.setattr(wakeups, "aheld", spy)
    key = LockKey.from_name("wakeups/listen-first")
    held = holder_hook.acquire(key, application_name="announcer")
    assert held is not None
    event = asyncio.run(_fires_after(_trigger(key), admin, held.release))
    assert event["status"] == FREE, event
    assert len(listening) >= 2 and all(channels == [wakeups.RELEASED_CHANNEL] for channels in listening), listening


def test_a_well_formed_foreign_payload_only_makes_the_hub_read_again(
    airflow_db: Any, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A foreign NOTIFY naming a held key is a re-read, never a wake-up by itself."""
    real = wakeups.aheld
    reads: list[Any] = []

    async def counting(conn: Any, keys: Any) -> Any:
        held = await real(conn, keys)
        reads.append(held)
        return held

    monkeypatch.setattr(wakeups, "aheld", counting)
    key = LockKey.from_name("wakeups/foreign-announcement")
    admin.execute("SELECT pg_advisory_lock(%s)", [key.int64])  # a holder that announces nothing

    def announce_while_held() -> None:
        _notify(admin, wakeups.payload(key))
        limit = time.monotonic() + FIRE_WITHIN
        while len(reads) < 2:  # the first check, then the re-read the announcement asked for
            assert time.monotonic() < limit
            time.sleep(0.01)

    def release_and_announce() -> None:
        admin.execute("SELECT pg_advisory_unlock(%s)", [key.int64])
        _notify(admin, wakeups.payload(key))

    async def scenario() -> tuple[bool, dict[str, Any]]:
        fired = asyncio.create_task(_first_payload(_trigger(key)))
        await asyncio.to_thread(_hub_ready, admin)
        await asyncio.to_thread(announce_while_held)
        await asyncio.sleep(0.5)  # the trigger would have run by now if the re-read had woken it
        early = fired.done()
        await asyncio.to_thread(release_and_announce)
        return early, await asyncio.wait_for(fired, FIRE_WITHIN)

    try:
        early, event = asyncio.run(scenario())
    finally:
        admin.execute("SELECT pg_advisory_unlock_all()")
    assert not early
    assert reads[1] == {key.pg_locks: True}  # the re-read saw it held
    assert event["status"] == FREE, event


def test_a_release_right_after_the_deferral_wakes_the_task_only_once_the_hold_has_passed(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any, caplog: Any, capfd: Any
) -> None:
    """apache/airflow#72716: a task resumed a moment after it deferred may be failed by the executor's
    late report of the deferring process. A key freed sooner than RESUME_HOLD_SECONDS after the trigger
    started (it starts after the deferral) fires that long after the start, never before. A hold of 10 s
    here (RESUME_HOLD_SECONDS by default): the release lands inside it even on a slow machine."""
    hold = 10.0
    key = LockKey.from_name("wakeups/held-back")
    held = holder_hook.acquire(key, application_name="announcer")
    assert held is not None
    trigger = AdvisoryLockTrigger.for_key(
        key, postgres_conn_id=TEST_CONN_ID, poll_interval=LONG, deadline=None, resume_hold=hold
    )

    async def run() -> tuple[dict[str, Any], float]:
        started = time.monotonic()
        event = await _fires_after(trigger, admin, held.release)
        return event, time.monotonic() - started

    with caplog.at_level("INFO"):
        event, after = asyncio.run(run())
    assert event["status"] == FREE, event
    assert after >= hold  # a lower bound: slowness cannot break it
    log = "".join(capfd.readouterr()) + caplog.text
    assert "the wake-up waits" in log and "72716" in log


@pytest.mark.parametrize("look", ["answered", "refused"])
def test_a_key_taken_again_during_the_wake_ups_hold_is_waited_for_again(
    airflow_db: Any,
    holder_hook: AdvisoryLockHook,
    admin: Any,
    pg_server: str,
    monkeypatch: pytest.MonkeyPatch,
    look: str,
) -> None:
    """The hold delays the wake-up by seconds; a key another run took meanwhile is held again when
    the hold ends: the trigger looks once more and waits on, instead of reporting it free. A look
    the database refuses (no new connection) says nothing: it waits on too, and the hub's own
    connection reads the key."""
    import psycopg

    hold = 4.0
    key = LockKey.from_name(f"wakeups/taken-during-the-hold/{look}")
    server = psycopg.connect(pg_server, autocommit=True)
    database = admin.info.dbname
    real = wakeups.aheld
    reads: list[bool] = []

    async def spy(conn: Any, keys: Any) -> Any:
        held = await real(conn, keys)
        reads.append(key.pg_locks in held)
        return held

    monkeypatch.setattr(wakeups, "aheld", spy)
    first = holder_hook.acquire(key, application_name="announcer")
    assert first is not None
    trigger = AdvisoryLockTrigger.for_key(
        key, postgres_conn_id=TEST_CONN_ID, poll_interval=LONG, deadline=None, resume_hold=hold
    )

    def seen_free() -> None:
        limit = time.monotonic() + FIRE_WITHIN
        while False not in reads:
            assert time.monotonic() < limit, "the hub never read the release"
            time.sleep(0.01)

    async def scenario() -> tuple[bool, dict[str, Any]]:
        fired = asyncio.create_task(_first_payload(trigger))
        await asyncio.to_thread(_hub_ready, admin)
        await asyncio.to_thread(first.release)
        await asyncio.to_thread(seen_free)  # the wake-up's hold has begun
        second = await asyncio.to_thread(holder_hook.acquire, key, application_name="announcer 2")
        assert second is not None
        if look == "refused":
            await asyncio.to_thread(allow_connections, server, database, False)
        await asyncio.sleep(hold + 1)
        fired_while_held = fired.done()
        await asyncio.to_thread(allow_connections, server, database, True)
        await asyncio.to_thread(second.release)
        return fired_while_held, await asyncio.wait_for(fired, FIRE_WITHIN)

    try:
        fired_while_held, event = asyncio.run(scenario())
    finally:
        allow_connections(server, database, True)
        server.close()
    assert not fired_while_held, f"it reported the key free while another run held it: {event}"
    assert event["status"] == FREE, event


RELAYED_CONN_ID = "pglock_relayed"


@contextlib.contextmanager
def _through_a_relay(dsn: str) -> Iterator[Relay]:
    """A relay in front of the test database (it counts the connections through it, and can hold
    each chunk a while: :attr:`Relay.delay`), and the Airflow connection RELAYED_CONN_ID through it."""
    import psycopg

    with relayed(dsn) as (relay, through):
        params = psycopg.conninfo.conninfo_to_dict(through)
        variable = f"AIRFLOW_CONN_{RELAYED_CONN_ID.upper()}"
        os.environ[variable] = (
            f"postgresql://{params.get('user') or 'postgres'}@127.0.0.1:{relay.port}/{params['dbname']}"
        )
        try:
            yield relay
        finally:
            os.environ.pop(variable, None)


def test_many_wake_ups_held_back_look_again_through_the_hubs_connection(
    dsn: str, airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any
) -> None:
    """Keys freed during their triggers' holds (a batch of tasks deferred a moment before their keys
    were released): at the end of each hold the trigger looks again whether its key was taken, and
    that look goes through the hub's one connection, not a connection of its own each (before: 20
    connects at once, a burst that can take the lock database's last connection slots)."""
    keys = [LockKey.from_name(f"wakeups/held-back-burst/{n}") for n in range(20)]
    held = [holder_hook.acquire(key, application_name="announcer") for key in keys]
    assert all(lock is not None for lock in held)

    async def run(relay: Relay) -> tuple[list[dict[str, Any]], int]:
        triggers = [
            AdvisoryLockTrigger.for_key(
                key, postgres_conn_id=RELAYED_CONN_ID, poll_interval=LONG, deadline=None, resume_hold=2
            )
            for key in keys
        ]
        waiting = [asyncio.create_task(_first_payload(trigger)) for trigger in triggers]
        await asyncio.to_thread(_hub_ready, admin)
        relay.reset()
        for lock in held:
            await asyncio.to_thread(lock.release)  # type: ignore[union-attr]
        events = list(await asyncio.wait_for(asyncio.gather(*waiting), FIRE_WITHIN))
        return events, relay.connections

    with _through_a_relay(dsn) as relay:
        events, opened = asyncio.run(run(relay))
    assert [event["status"] for event in events] == [FREE] * len(keys), events
    # The hub's connection may close while every trigger sits in its hold, and open again for their
    # looks (more than once only if the holds end further apart than a read takes).
    assert opened <= 3, f"{opened} connections opened to look again after 20 holds"


def test_a_trigger_that_registers_while_its_key_is_read_waits_for_a_read_of_its_own(
    dsn: str, airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any
) -> None:
    """A read of the key began while it was free; a foreign session took it and another trigger
    registered before the read's answer came (a slow link): that answer is the earlier trigger's,
    and the later one waits for a read made after it registered (before: both fired "free" while
    the key was held; review -85). The wake-up hold's look again after its end registers the same way."""
    import psycopg

    key = LockKey.from_name("wakeups/registered-mid-read")
    held = holder_hook.acquire(key, application_name="announcer")
    assert held is not None
    foreign = psycopg.connect(dsn, autocommit=True)

    def trigger() -> AdvisoryLockTrigger:
        return AdvisoryLockTrigger.for_key(
            key, postgres_conn_id=RELAYED_CONN_ID, poll_interval=LONG, deadline=None, resume_hold=0
        )

    async def scenario(relay: Relay) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        first = asyncio.create_task(_first_payload(trigger()))
        hub = await asyncio.to_thread(_hub_ready, admin)
        relay.delay = SLOW_LINK  # each chunk to and from the hub now waits this long on its way
        released = admin.execute("SELECT clock_timestamp()").fetchone()[0]
        await asyncio.to_thread(held.release)  # announced: the hub hears it, and reads the key
        await asyncio.to_thread(_read_by_the_server, admin, hub, released)  # free; its answer on its way
        await asyncio.to_thread(foreign.execute, "SELECT pg_advisory_lock(%s)", [key.int64])  # not announced
        second = asyncio.create_task(_first_payload(trigger()))
        first_event = await asyncio.wait_for(first, FIRE_WITHIN)  # registered before the read: free was true
        relay.delay = 0.0
        await asyncio.sleep(1.0)  # the second trigger's own read: the key is held
        fired_while_held = second.done()
        await asyncio.to_thread(foreign.execute, "SELECT pg_advisory_unlock(%s)", [key.int64])
        await asyncio.to_thread(_notify, admin, wakeups.payload(key))
        return first_event, fired_while_held, await asyncio.wait_for(second, FIRE_WITHIN)

    try:
        with _through_a_relay(dsn) as relay:
            first_event, fired_while_held, second_event = asyncio.run(scenario(relay))
    finally:
        foreign.close()
    assert first_event["status"] == FREE, first_event
    assert not fired_while_held, "a trigger fired free on a read made before it registered, while the key was held"
    assert second_event["status"] == FREE, second_event


#: Seconds each chunk between the hub and the server waits in the relay: the window in which the
#: server has answered a read and the hub has not yet received the answer.
SLOW_LINK = 2.0


def _read_by_the_server(conn: Any, pid: int, since: Any) -> None:
    """Wait until session ``pid`` has run a read of pg_locks that ended after ``since`` (server clock)."""
    limit = time.monotonic() + FIRE_WITHIN
    while time.monotonic() < limit:
        row = conn.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND state = 'idle' AND query LIKE %s AND state_change > %s",
            [pid, "%pg_locks%", since],
        ).fetchone()
        if row:
            return
        time.sleep(0.01)
    raise AssertionError("the hub never read the released key")


def test_the_resume_hold_outlasts_the_late_report_of_a_deferring_process() -> None:
    """apache/airflow#72716: the executor reports the process that deferred once the task's supervisor
    noticed its exit, which may take ``[workers] min_heartbeat_interval`` (the supervisor's longest wait),
    then the executor's hand-over and a scheduler loop: up to 6.4 s after the deferral with the default
    5 s, measured with 200 tasks woken at once (docs/benchmarks.md, section 10), where a 5 s hold let 6
    of 600 resumed attempts fail and an 8 s hold none. The hold leaves at least 2 s beyond the interval."""
    from airflow.configuration import conf

    from airflow_pglock.triggers.advisory_lock import RESUME_HOLD_SECONDS

    interval = conf.get_default_value("workers", "min_heartbeat_interval")
    if interval is None:  # Airflow 2: no task supervisor
        pytest.skip("this Airflow has no [workers] min_heartbeat_interval (no task supervisor)")
    assert float(interval) + 2.0 <= RESUME_HOLD_SECONDS, (RESUME_HOLD_SECONDS, interval)


def test_the_resume_hold_travels_with_the_trigger_only_when_it_is_not_the_default() -> None:
    from airflow_pglock.triggers.advisory_lock import RESUME_HOLD_SECONDS

    key = LockKey.from_name("wakeups/serialized")
    default = AdvisoryLockTrigger.for_key(key, postgres_conn_id=TEST_CONN_ID, poll_interval=5, deadline=None)
    assert "resume_hold" not in default.serialize()[1]  # a triggerer on an older version runs it
    assert default.resume_hold == RESUME_HOLD_SECONDS
    none = AdvisoryLockTrigger.for_key(
        key, postgres_conn_id=TEST_CONN_ID, poll_interval=5, deadline=None, resume_hold=0
    )
    assert AdvisoryLockTrigger(**none.serialize()[1]).resume_hold == 0
    with pytest.raises(LockConfigurationError, match="resume_hold must be from 0 to 3600 seconds, got -1"):
        AdvisoryLockTrigger.for_key(key, postgres_conn_id=TEST_CONN_ID, poll_interval=5, deadline=None, resume_hold=-1)


@pytest.fixture
def supervisor_wait(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set this worker's ``[workers] min_heartbeat_interval`` (Airflow 3: its task supervisor's longest wait)."""
    from airflow_pglock.compat import AIRFLOW_V_3_PLUS

    if not AIRFLOW_V_3_PLUS:
        pytest.skip("Airflow 2 has no task supervisor: the hold stays RESUME_HOLD_SECONDS")

    def set_wait(seconds: float) -> None:
        monkeypatch.setenv("AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL", str(seconds))

    return set_wait


def test_the_resume_hold_covers_a_longer_supervisor_wait_by_the_same_margin() -> None:
    from airflow_pglock.triggers.advisory_lock import MAX_RESUME_HOLD, RESUME_HOLD_SECONDS, resume_hold_for

    assert resume_hold_for(None) == RESUME_HOLD_SECONDS
    assert resume_hold_for(1) == RESUME_HOLD_SECONDS  # never shorter than the measured one
    assert resume_hold_for(5) == RESUME_HOLD_SECONDS
    assert resume_hold_for(20) == 23.0
    assert resume_hold_for(float("nan")) == RESUME_HOLD_SECONDS
    assert resume_hold_for(10 * MAX_RESUME_HOLD) == MAX_RESUME_HOLD


def test_a_deferral_holds_the_wake_up_for_the_workers_own_supervisor_wait(supervisor_wait: Any) -> None:
    """A worker whose ``[workers] min_heartbeat_interval`` is 20 s may report the deferring process
    that much later (apache/airflow#72716): its deferrals hold a prompt wake-up 23 s, not 8 s, and
    the hold travels to the triggerer with the trigger. Before, every deferral held 8 s."""
    from airflow_pglock.compat import TaskDeferred
    from airflow_pglock.exceptions import LockBusyError
    from airflow_pglock.options import LockOptions, LockSpec
    from airflow_pglock.task_guard import defer_until_released

    supervisor_wait(20)
    key = LockKey.from_name("wakeups/supervisor-wait")
    trigger = AdvisoryLockTrigger.for_key(key, postgres_conn_id=TEST_CONN_ID, poll_interval=5, deadline=None)
    assert trigger.resume_hold == 23.0
    assert AdvisoryLockTrigger(**trigger.serialize()[1]).resume_hold == 23.0

    spec = LockSpec.from_options(
        {"postgres_conn_id": TEST_CONN_ID, "on_busy": "defer", "wait_timeout": 60},
        declaration=LockOptions,
        caller="test",
    )
    deferrals = []
    for retry_after in (None, 5.0, 25.0):  # a plain holder; another run's lock scope, its lease ending sooner or later
        busy = LockBusyError("busy", key, retry_after=retry_after)
        with pytest.raises(TaskDeferred) as deferred:
            defer_until_released(spec, key, busy, time.time() + 60, _NullLog())
        deferrals.append(deferred.value.trigger.resume_hold)
    assert deferrals == [23.0, 23.0, 25.0]


def test_a_deferred_operators_hold_waits_for_the_workers_own_supervisor_wait(supervisor_wait: Any) -> None:
    from airflow_pglock.triggers.advisory_lock import RESUME_HOLD_SECONDS, worker_resume_hold
    from airflow_pglock.triggers.guarded import GuardedTrigger, resume_held_back

    supervisor_wait(20)
    kwargs: dict[str, Any] = {
        "trigger_classpath": "airflow.triggers.testing.SuccessTrigger",
        "trigger_kwargs": {},
        "key_name": "wakeups/guarded-hold",
        "key_numbers": [1, 2],
        "postgres_conn_id": TEST_CONN_ID,
        "holder": "h",
        "task": "d.t r",
        "lease": 30.0,
        "deferred_at": 1_000_000.0,
    }
    held = GuardedTrigger(**kwargs, resume_hold=worker_resume_hold())
    assert GuardedTrigger(**held.serialize()[1]).resume_hold == 23.0
    assert resume_held_back(1_000_000.0, 1_000_001.0, held.resume_hold) == pytest.approx(22.0)
    default = GuardedTrigger(**kwargs)
    assert "resume_hold" not in default.serialize()[1]  # a triggerer on an older version runs it
    assert default.resume_hold == RESUME_HOLD_SECONDS
    with pytest.raises(LockConfigurationError, match="resume_hold must be from 0 to 3600 seconds, got 'x'"):
        GuardedTrigger(**kwargs, resume_hold="x")


class _NullLog:
    def info(self, *args: Any) -> None:
        pass


def test_one_release_wakes_every_trigger_waiting_on_the_key(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any
) -> None:
    """No queue: every deferred task waiting on a key is woken by its release (docs/concepts.md,
    on_busy="defer"); one of them takes it, the others try, wait defer_after and defer again."""
    key = LockKey.from_name("wakeups/herd")
    held = holder_hook.acquire(key, application_name="announcer")
    assert held is not None

    async def run() -> list[dict[str, Any]]:
        waiting = [asyncio.create_task(_first_payload(_trigger(key))) for _ in range(5)]
        await asyncio.to_thread(_hub_ready, admin)
        await asyncio.sleep(0.5)
        assert not any(task.done() for task in waiting), "a trigger fired while the key was held"
        await asyncio.to_thread(held.release)
        return list(await asyncio.wait_for(asyncio.gather(*waiting), FIRE_WITHIN))

    events = asyncio.run(run())
    assert [event["status"] for event in events] == [FREE] * 5, events
