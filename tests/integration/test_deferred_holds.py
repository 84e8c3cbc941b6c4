"""The triggerer's holds of deferred guarded operators (triggers/holds.py) on a real PostgreSQL.

The hub runs here on an event loop of the test, as in a triggerer process: one lock session
for every hold, the row renewed under the key, keys taken back after the session was lost,
and a hold lost when its row lapsed or was taken. What the other guards, ``locks`` and the
sensor see of a deferred holder is checked here too. The whole path through Airflow is in
tests/airflow/test_deferrable_guard.py (dag.test) and tests/e2e/test_deferrable_deployments.py
(real scheduler and triggerer).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockBusyError
from airflow_pglock.guard import LockGuard
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import scopes
from airflow_pglock.policy import LockPolicy
from airflow_pglock.scope_rules import HandOver, ScopeRole
from airflow_pglock.triggers.holds import DeferredHold, HoldHub
from tests.helpers import advisory_locks_left, once_exited

pytestmark = pytest.mark.airflow  # the hub reads its connection through the Airflow hook

HUB = "pglock test holds"
KEYS = [LockKey.from_name(f"deferred/{n}") for n in range(2)]


def _hand_over(hook: Any, key: LockKey, lease: float = 30.0) -> str:
    """What a guarded operator's deferral leaves: the row written under the key, the key released."""
    holder = uuid.uuid4().hex
    role = ScopeRole(holder=holder, run="dep: dag run", task="op", lease=lease, hands_over=True)
    LockGuard(hook.database, key, LockPolicy(), scope=role).run(lambda handle: HandOver(None))
    return holder


def _hub(hook: Any) -> HoldHub:
    return HoldHub(lambda: hook.open_lock_session(application_name=HUB))


@contextlib.asynccontextmanager
async def _one_held(hook: Any, holder: str) -> AsyncIterator[tuple[HoldHub, DeferredHold]]:
    """A hub of its own holding ``holder``'s hold of the first key, once it is held."""
    hub = _hub(hook)
    hold = DeferredHold(KEYS[0], holder, "dag.op run", 30.0)
    async with hub.holding(hold):
        await asyncio.wait_for(hold.settled.wait(), 15)
        assert hold.state == "held"
        yield hub, hold


@contextlib.asynccontextmanager
async def _both_held(hook: Any, holders: list[str], lease: float) -> AsyncIterator[tuple[HoldHub, list[DeferredHold]]]:
    """A hub of its own holding the holds of both keys (``holders``' hand-overs), once both are held."""
    hub = _hub(hook)
    holds = [
        DeferredHold(key, holder, f"dag.op{n} run", lease)
        for n, (key, holder) in enumerate(zip(KEYS, holders, strict=True))
    ]
    async with hub.holding(holds[0]), hub.holding(holds[1]):
        for hold in holds:
            await asyncio.wait_for(hold.settled.wait(), 15)
            assert hold.state == "held", hold.reason
        yield hub, holds


def _holders(admin: Any, key: LockKey) -> list[str]:
    classid, objid, objsubid = key.pg_locks
    rows = admin.execute(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype ="
        " 'advisory' AND l.granted AND l.classid::bigint = %s AND l.objid::bigint = %s AND l.objsubid = %s",
        [classid, objid, objsubid],
    ).fetchall()
    return [row[0] for row in rows]


def _sessions(admin: Any) -> int:
    return int(admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [HUB]).fetchone()[0])


def _sessions_left(admin: Any) -> int:
    """Hub sessions still listed once closed ones' backends have exited: a backend stays in
    ``pg_stat_activity`` for a moment after its client closed (and after its locks went)."""
    return once_exited(lambda: _sessions(admin), 10.0)


def _guarded_trigger(hook: Any, dsn: str, monkeypatch: pytest.MonkeyPatch, classpath: str, **more: Any) -> Any:
    """A GuardedTrigger of the operator's trigger ``classpath`` over a hold handed over on KEYS[0],
    reaching the test database through the Airflow connection ``pglock_test_guarded``."""
    import json

    from psycopg.conninfo import conninfo_to_dict

    from airflow_pglock.triggers.guarded import GuardedTrigger

    parts = conninfo_to_dict(dsn)
    connection = {"conn_type": "postgres", "host": parts.get("host"), "port": int(parts.get("port") or 5432)}
    connection |= {"login": parts.get("user"), "schema": parts.get("dbname")}
    monkeypatch.setenv("AIRFLOW_CONN_PGLOCK_TEST_GUARDED", json.dumps(connection))
    options: dict[str, Any] = {"trigger_kwargs": {}, "deferred_at": time.time(), **more}
    return GuardedTrigger(
        trigger_classpath=classpath,
        key_name=str(KEYS[0].name),
        key_numbers=list(KEYS[0].numbers),
        postgres_conn_id="pglock_test_guarded",
        holder=_hand_over(hook, KEYS[0]),
        task="dag.op run",
        lease=30.0,
        **options,
    )


async def _until(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = await asyncio.to_thread(check)
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)


def _run(coroutine: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coroutine())


def test_one_session_holds_every_deferred_key_renews_the_rows_and_hands_them_back(hook: Any, scopes_db: Any) -> None:
    holders = [_hand_over(hook, key, lease=3.0) for key in KEYS]
    before = {key: scopes.read(scopes_db, key) for key in KEYS}

    async def body() -> None:
        async with _both_held(hook, holders, 3.0) as (hub, holds):
            assert await asyncio.to_thread(_sessions, scopes_db) == 1, "one session for every hold"
            for key in KEYS:
                assert await asyncio.to_thread(_holders, scopes_db, key) == [HUB]
            await asyncio.sleep(2.5)  # past a renewal (every lease / 3 = 1 s)
            for key in KEYS:
                row = await asyncio.to_thread(scopes.read, scopes_db, key)
                assert row is not None and row.live and row.lease_until > before[key].lease_until  # type: ignore[union-attr]
                assert row.task_now is not None and row.task_now.endswith("(deferred, held by the triggerer)")
            assert await hub.hand_back(holds[0])
            assert await asyncio.to_thread(_holders, scopes_db, KEYS[0]) == [], "handed back: released"
            row = await asyncio.to_thread(scopes.read, scopes_db, KEYS[0])
            assert row is not None and row.live and row.task_now == "dag.op0 run (deferred, resuming on a worker)"
            # The other one's trigger is cancelled (its task cleared): its key goes, its row stays.
        assert _holders(scopes_db, KEYS[1]) == []
        row = scopes.read(scopes_db, KEYS[1])
        assert row is not None and row.live
        assert await _until(lambda: _sessions(scopes_db) == 0), "the session closes with the last hold"

    _run(body)
    assert advisory_locks_left(scopes_db) == 0


def test_a_killed_session_takes_every_key_back_while_the_rows_are_live(hook: Any, scopes_db: Any) -> None:
    holders = [_hand_over(hook, key) for key in KEYS]

    async def body() -> None:
        hub = _hub(hook)
        holds = [DeferredHold(key, holder, "dag.op run", 30.0) for key, holder in zip(KEYS, holders, strict=True)]
        async with hub.holding(holds[0]), hub.holding(holds[1]):
            for hold in holds:
                await asyncio.wait_for(hold.settled.wait(), 15)
            first = scopes_db.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [HUB]).fetchone()
            scopes_db.execute("SELECT pg_terminate_backend(%s)", [first[0]])

            def taken_back() -> bool:
                pids = scopes_db.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s", [HUB]
                ).fetchall()
                return pids not in ([], [first]) and all(_holders(scopes_db, key) == [HUB] for key in KEYS)

            assert await _until(taken_back), "a new session holds both keys again"
            assert await _until(lambda: all(hold.state == "held" for hold in holds)), [h.state for h in holds]
            assert not any(hold.lost.is_set() for hold in holds)

    _run(body)
    assert advisory_locks_left(scopes_db) == 0


def test_a_hold_is_lost_when_its_row_lapsed_or_another_holds_the_key_past_the_lease(
    hook: Any, scopes_db: Any, dsn: str
) -> None:
    import psycopg

    lapsing, busy = _hand_over(hook, KEYS[0]), _hand_over(hook, KEYS[1], lease=2.0)

    async def body() -> None:
        hub = _hub(hook)
        lapsed = DeferredHold(KEYS[0], lapsing, "dag.lapsed run", 30.0)
        blocked = DeferredHold(KEYS[1], busy, "dag.blocked run", 2.0)
        # A client that takes the key by its numbers, knowing nothing of rows.
        with psycopg.connect(dsn, autocommit=True) as foreign:
            foreign.execute("SELECT pg_advisory_lock(%s)", [KEYS[1].int64])
            async with hub.holding(lapsed), hub.holding(blocked):
                await asyncio.wait_for(lapsed.settled.wait(), 15)
                assert lapsed.state == "held"
                # The triggerer gone longer than the lease: the row lapsed when its session ends.
                scopes_db.execute(
                    "UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second'"
                    " WHERE key_name = %s",
                    [KEYS[0].name],
                )
                scopes_db.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", [HUB]
                )
                await asyncio.wait_for(lapsed.lost.wait(), 15)
                await asyncio.wait_for(blocked.lost.wait(), 15)
        assert lapsed.reason is not None and "its lease ran out at" in lapsed.reason
        # Whichever comes first: the row found lapsed while the key is busy, or the lease counted here.
        assert blocked.reason is not None
        assert "another session holds the key" in blocked.reason or "back within the lease (2 s)" in blocked.reason

    _run(body)
    assert advisory_locks_left(scopes_db) == 0


def test_other_guards_locks_and_the_sensor_see_a_deferred_holder(
    hook: Any, scopes_db: Any, dsn: str, capsys: Any
) -> None:
    from tests.ops_helpers import run_cli

    holder = _hand_over(hook, KEYS[0])
    # Between the hand-over and the triggerer: only the row holds the key.
    with pytest.raises(LockBusyError, match=r"is held by the deferred task op of dep: dag run \(held by the triggerer"):
        LockGuard(hook.database, KEYS[0], LockPolicy()).run(lambda handle: None)
    assert hook.scope(KEYS[0]) is not None, "the sensor's view: a live row holds the key"

    async def body() -> None:
        from airflow_pglock.triggers.holds import HOLDS_APPLICATION_NAME

        hub = HoldHub(lambda: hook.open_lock_session(application_name=HOLDS_APPLICATION_NAME))  # a triggerer's
        hold = DeferredHold(KEYS[0], holder, "dag.op run", 30.0)
        async with hub.holding(hold):
            await asyncio.wait_for(hold.settled.wait(), 15)
            # The triggerer's session holds the key: its row names the task.
            held_by = r"is held by the deferred task dag.op run of dep: dag run \(held by the triggerer, lease until "
            with pytest.raises(LockBusyError, match=held_by + r".*\): the triggerer's session pid"):
                await asyncio.to_thread(LockGuard(hook.database, KEYS[0], LockPolicy()).run, lambda handle: None)
            holders = await asyncio.to_thread(hook.holders, KEYS[0])
            assert [h.application_name for h in holders] == [HOLDS_APPLICATION_NAME]
            data = (await asyncio.to_thread(run_cli, "locks", "--dsn", dsn, "--output", "json", capsys=capsys)).json()
            [scope] = data["scopes"]
            assert scope["deferred"] is True and scope["task_now"].startswith("dag.op run (deferred")
            await hub.hand_back(hold)

    _run(body)
    assert advisory_locks_left(scopes_db) == 0


def test_a_hub_retires_with_its_last_hold_leaving_no_thread_loop_or_session(hook: Any, scopes_db: Any) -> None:
    import threading

    from airflow_pglock.triggers import holds

    def hub_threads() -> int:
        return sum(1 for thread in threading.enumerate() if thread.name.startswith("pglock-holds"))

    before = hub_threads()
    for _ in range(3):  # dag.test() runs each deferral's trigger on an event loop of its own
        holder = _hand_over(hook, KEYS[0])

        async def body(holder: str = holder) -> None:
            hub = holds.hub_for("pglock_test_unused", 5)  # registered as a triggerer's hub is
            hub._open_session = lambda: hook.open_lock_session(application_name=HUB)  # the test's database
            hold = DeferredHold(KEYS[0], holder, "dag.op run", 30.0)
            async with hub.holding(hold):
                await asyncio.wait_for(hold.settled.wait(), 15)
                assert await hub.hand_back(hold)
            await _until(lambda: hub._task is not None and hub._task.done())

        _run(body)
        scopes_db.execute("DELETE FROM pglock.scopes WHERE holder = %s", [holder])
    assert not any(holds._HUBS.values()), "every hub retired (none kept for its loop)"
    deadline = time.monotonic() + 10
    while hub_threads() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hub_threads() == before
    assert _sessions_left(scopes_db) == 0


def test_a_retry_of_the_task_takes_over_the_hold_its_earlier_try_left_and_another_task_skips(
    hook: Any, scopes_db: Any
) -> None:
    holder = _hand_over(hook, KEYS[0])  # an earlier try's hold, left live (a deferral timeout, a cleared trigger)
    other = ScopeRole(holder=uuid.uuid4().hex, run="dep-b: dag run", task="op", lease=30.0, hands_over=True)
    with pytest.raises(LockBusyError, match="is held by the deferred task op of dep: dag run"):
        LockGuard(hook.database, KEYS[0], LockPolicy(), scope=other).run(lambda handle: None)
    assert advisory_locks_left(scopes_db) == 0, "the refused guard took the key, then gave it back"
    retry = ScopeRole(holder=holder, run="dep: dag run", task="op", lease=30.0, hands_over=True)
    assert LockGuard(hook.database, KEYS[0], LockPolicy(), scope=retry).run(lambda handle: "ran") == "ran"
    assert scopes.read(scopes_db, KEYS[0]) is None, "the earlier try's row is gone with it"
    assert advisory_locks_left(scopes_db) == 0


def test_a_trigger_that_fires_after_its_hub_stopped_is_lost_at_once(hook: Any, scopes_db: Any) -> None:
    """The hub's task ended (its loop stopping, or a bug) with the hold being taken back: no pass
    will take it. A trigger that fires then is told its hold is lost, instead of waiting forever
    for a pass; its key went with the hub's session."""
    holder = _hand_over(hook, KEYS[0])

    async def body() -> None:
        async with _one_held(hook, holder) as (hub, hold):
            assert hub._task is not None
            hub._task.cancel()  # it closes its session and retires
            with pytest.raises(asyncio.CancelledError):
                await hub._task
            assert await _until(lambda: _holders(scopes_db, KEYS[0]) == []), "the key went with the session"
            assert not await asyncio.wait_for(hub.hand_back(hold), 10)
            assert hold.state == "lost" and "hold hub stopped" in str(hold.reason)

    _run(body)
    scopes_db.execute("DELETE FROM pglock.scopes WHERE holder = %s", [holder])
    assert _sessions_left(scopes_db) == 0
    assert advisory_locks_left(scopes_db) == 0


def test_a_task_that_ends_in_the_triggerer_frees_its_hold_at_once(hook: Any, scopes_db: Any) -> None:
    """An operator's trigger that ends the task in the triggerer (a task-end event): no worker
    resumes to free the hold, so the hub deletes its row under the key and releases the key; a
    hand-back would renew the row for a resume that never comes, keeping the key busy for the
    whole deferral lease."""
    holder = _hand_over(hook, KEYS[0])

    async def body() -> None:
        async with _one_held(hook, holder) as (hub, hold):
            assert await hub.end(hold)
            assert hold.state == "ended"

    _run(body)
    assert scopes.read(scopes_db, KEYS[0]) is None
    LockGuard(hook.database, KEYS[0], LockPolicy()).run(lambda handle: None)  # free for anyone at once
    assert advisory_locks_left(scopes_db) == 0


def test_the_resume_is_held_back_from_the_deferral_never_longer_than_the_hold_however_the_clocks_differ() -> None:
    from airflow_pglock.triggers.advisory_lock import RESUME_HOLD_SECONDS
    from airflow_pglock.triggers.guarded import resume_held_back

    now = 1_000_000.0
    assert resume_held_back(now - 1.0, now) == pytest.approx(RESUME_HOLD_SECONDS - 1.0)
    assert resume_held_back(now - 60.0, now) < 0  # an old deferral: at once
    # The worker's clock an hour ahead of the triggerer's: the hold, not an hour.
    assert resume_held_back(now + 3600.0, now) == RESUME_HOLD_SECONDS


class EndsTheTaskHere:
    """An operator's trigger that ends its task in the triggerer (imported by its class path)."""

    def __new__(cls, **kwargs: Any) -> Any:
        from airflow.triggers.base import BaseTrigger, TaskSuccessEvent

        class _EndsTheTaskHere(BaseTrigger):
            def serialize(self) -> tuple[str, dict[str, Any]]:
                return f"{__name__}.EndsTheTaskHere", {}

            async def run(self) -> Any:
                yield TaskSuccessEvent()

        return _EndsTheTaskHere()


def test_a_guarded_trigger_whose_task_ends_in_the_triggerer_frees_the_hold(
    hook: Any, scopes_db: Any, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.triggers.base import TaskSuccessEvent

    trigger = _guarded_trigger(hook, dsn, monkeypatch, f"{__name__}.EndsTheTaskHere")

    async def body() -> list[Any]:
        return [event async for event in trigger.run()]

    events = asyncio.run(body())
    assert len(events) == 1 and isinstance(events[0], TaskSuccessEvent), events
    assert scopes.read(scopes_db, KEYS[0]) is None, "the hold's row was left for a resume that never comes"
    LockGuard(hook.database, KEYS[0], LockPolicy()).run(lambda handle: None)
    assert advisory_locks_left(scopes_db) == 0


class FiresAtOnce:
    """An operator's trigger whose event comes at once (imported by its class path)."""

    def __new__(cls, **kwargs: Any) -> Any:
        from airflow.triggers.base import BaseTrigger, TriggerEvent

        class _FiresAtOnce(BaseTrigger):
            def serialize(self) -> tuple[str, dict[str, Any]]:
                return f"{__name__}.FiresAtOnce", {}

            async def run(self) -> Any:
                yield TriggerEvent({"fired": True})

        return _FiresAtOnce()


def test_a_worker_clock_behind_the_triggerers_does_not_shorten_the_resume_hold(
    hook: Any, scopes_db: Any, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review -65: the hold against apache/airflow#72716 counted only from the deferral on the
    worker's clock: a worker 1,000 s behind the triggerer had its task resumed at once. It also
    counts from the trigger's own start in the triggerer now (never longer than the hold)."""
    far_behind = time.time() - 1000.0  # the worker's clock
    trigger = _guarded_trigger(
        hook, dsn, monkeypatch, f"{__name__}.FiresAtOnce", deferred_at=far_behind, resume_hold=2.0
    )

    async def body() -> tuple[list[Any], float]:
        started = time.monotonic()
        events = [event async for event in trigger.run()]
        return events, time.monotonic() - started

    events, took = asyncio.run(body())
    assert len(events) == 1 and events[0].payload["pglock"] == "held", events
    assert took >= 1.9, f"resumed {took:.2f} s after the trigger started, before the 2 s hold"
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


#: What WaitsForever's on_kill() saw: the applications holding its key then (filled by the test's trigger).
KILLED_WHILE: list[list[str]] = []


class WaitsForever:
    """An operator's trigger that never fires; its ``on_kill()`` notes who holds the key then."""

    def __new__(cls, dsn: str = "", key_name: str = "") -> Any:
        from airflow.triggers.base import BaseTrigger

        class _WaitsForever(BaseTrigger):
            def serialize(self) -> tuple[str, dict[str, Any]]:
                return f"{__name__}.WaitsForever", {"dsn": dsn, "key_name": key_name}

            async def run(self) -> Any:
                await asyncio.Event().wait()
                yield None  # pragma: no cover - never reached

            async def on_kill(self) -> None:
                def look() -> list[str]:
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        return _holders(conn, LockKey.from_name(key_name))

                KILLED_WHILE.append(await asyncio.to_thread(look))

        return _WaitsForever()


@pytest.mark.parametrize("cancel", ["__airflow_user_action__", None], ids=["cleared", "triggerer-stops"])
def test_a_trigger_cancelled_for_a_cleared_task_kills_the_external_job_before_letting_the_key_go(
    hook: Any, scopes_db: Any, dsn: str, monkeypatch: pytest.MonkeyPatch, cancel: str | None
) -> None:
    """Review -68: the triggerer cancels the trigger of a task cleared while deferred, then calls its
    on_kill() (Airflow 3.3+): the hold let the key go first, and the task's next try, which now waits
    for its own earlier hold, started its external job while the first one still ran. The operator's
    trigger's on_kill() now runs under the hold, once; a triggerer that stops calls none."""
    from airflow_pglock.compat import KILLS_CLEARED_TRIGGERS

    if not KILLS_CLEARED_TRIGGERS:
        pytest.skip("before Airflow 3.3 the triggerer calls no on_kill() for a cleared task's trigger")
    KILLED_WHILE.clear()
    trigger = _guarded_trigger(
        hook, dsn, monkeypatch, f"{__name__}.WaitsForever", trigger_kwargs={"dsn": dsn, "key_name": str(KEYS[0].name)}
    )

    async def body() -> None:
        async def consume() -> None:
            async for _ in trigger.run():
                raise AssertionError("it never fires")

        running = asyncio.ensure_future(consume())
        assert await _until(lambda: _holders(scopes_db, KEYS[0]) == ["airflow-pglock deferred holds"]), "not held"
        await asyncio.sleep(0.2)  # the operator's trigger runs
        running.cancel(cancel)
        with pytest.raises(asyncio.CancelledError):
            await running
        await trigger.on_kill()  # what the triggerer calls next: once is enough

    asyncio.run(body())
    if cancel is None:
        assert KILLED_WHILE == [[]], "a stopping triggerer calls no on_kill(): only the test's own call ran"
    else:
        assert KILLED_WHILE == [["airflow-pglock deferred holds"]], KILLED_WHILE
    assert _holders(scopes_db, KEYS[0]) == []
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


def test_a_hold_lost_while_the_operators_trigger_runs_kills_its_job_at_once(
    hook: Any, scopes_db: Any, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hold is lost while the operator's trigger waits (its row deleted: another may take the
    key): the operator's trigger's on_kill() stops the external job at once, before the lost event
    goes out; the worker's on_kill() would come only once the task has resumed, seconds later."""
    from airflow_pglock.triggers.guarded import LOST

    KILLED_WHILE.clear()
    trigger = _guarded_trigger(
        hook,
        dsn,
        monkeypatch,
        f"{__name__}.WaitsForever",
        trigger_kwargs={"dsn": dsn, "key_name": str(KEYS[0].name)},
        resume_hold=0.0,
    )

    async def body() -> None:
        events: list[Any] = []

        async def consume() -> None:
            async for event in trigger.run():
                events.append(event)
                return

        running = asyncio.ensure_future(consume())
        assert await _until(lambda: _holders(scopes_db, KEYS[0]) == ["airflow-pglock deferred holds"]), "not held"
        await asyncio.sleep(0.2)  # the operator's trigger runs
        await asyncio.to_thread(scopes_db.execute, "DELETE FROM pglock.scopes")  # the next renewal finds it gone
        await asyncio.wait_for(running, 30)
        assert events and events[0].payload["pglock"] == LOST, events
        assert len(KILLED_WHILE) == 1, "the operator's trigger was not told to stop its job"

    asyncio.run(body())
    assert _holders(scopes_db, KEYS[0]) == []
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


def test_a_trigger_that_fires_as_the_hubs_session_ends_is_handed_back_on_a_new_session(
    hook: Any, scopes_db: Any
) -> None:
    """The hub's session ends (the lock database restarted, a failover, the connection broke) just
    before the trigger fires: the hand-back's write failed and the hold was declared lost (on_kill,
    a failed task, the row left live behind it), where a pass takes the key back under the lease."""
    holder = _hand_over(hook, KEYS[0])

    async def body() -> None:
        async with _one_held(hook, holder) as (hub, hold):
            pid = scopes_db.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [HUB]).fetchone()
            scopes_db.execute("SELECT pg_terminate_backend(%s)", [pid[0]])
            assert await hub.hand_back(hold), hold.reason
            assert hold.state == "ended" and not hold.lost.is_set()
            row = await asyncio.to_thread(scopes.read, scopes_db, KEYS[0])
            assert row is not None and row.live and row.holder == holder
            assert row.task_now == "dag.op run (deferred, resuming on a worker)"
            assert await _until(lambda: _holders(scopes_db, KEYS[0]) == []), "handed back: released"

    _run(body)
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


def test_a_second_copy_of_a_trigger_waits_while_the_first_renews_the_row_and_takes_over_when_it_stops(
    hook: Any, scopes_db: Any
) -> None:
    """Two triggerers run one trigger (an HA hand-over, a triggerer cut off from Airflow's database):
    the copy that found the key busy lost its hold once its own lease timer ran out, although the
    other copy held the key and renewed the row all along; its LOST event failed the task."""
    holder = _hand_over(hook, KEYS[0], lease=3.0)

    async def body() -> None:
        first, second = _hub(hook), _hub(hook)
        held = DeferredHold(KEYS[0], holder, "dag.op run", 3.0)
        waiting = DeferredHold(KEYS[0], holder, "dag.op run", 3.0)
        async with contextlib.AsyncExitStack() as second_copy:
            async with first.holding(held):
                await asyncio.wait_for(held.settled.wait(), 15)
                assert held.state == "held", held.reason
                await second_copy.enter_async_context(second.holding(waiting))
                await asyncio.sleep(3 * 3.0)  # three leases: the first copy renews the row, the second waits
                assert held.state == "held", held.reason
                assert waiting.state == "taking" and not waiting.lost.is_set(), waiting.reason
            # The first copy is cancelled (its key given back, its row left live): the second takes over.
            await asyncio.wait_for(waiting.settled.wait(), 15)
            assert waiting.state == "held", waiting.reason
            assert await asyncio.to_thread(_holders, scopes_db, KEYS[0]) == [HUB]

    _run(body)
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


def _impatient_hub(hook: Any) -> HoldHub:
    """A hub whose session waits at most 0.5 s for a lock (``lock_timeout``), as a role may set."""

    def open_session() -> Any:
        session = hook.open_lock_session(application_name=HUB)
        session.connection.execute("SET lock_timeout = '500ms'")
        return session

    return HoldHub(open_session)


@contextlib.contextmanager
def _horizon_locked(dsn: str) -> Iterator[None]:
    """Another writer holds the scope horizon's lock (a scope being written elsewhere)."""
    with psycopg.connect(dsn, autocommit=True) as writer:
        writer.execute("BEGIN")
        writer.execute("SELECT pg_advisory_xact_lock(%s)", [scopes.HORIZON_LOCK_KEY.int64])
        yield
        writer.execute("ROLLBACK")


@pytest.mark.parametrize("last_write", ["end", "hand_back"])
def test_a_hold_whose_last_write_fails_gives_its_key_back_while_the_hub_lives_on(
    last_write: str, hook: Any, scopes_db: Any, dsn: str
) -> None:
    """The hub's last write for a hold (the row's deletion when the task ended in the triggerer,
    its renewal for the resume) fails: the key is given back at once, not kept by the hub's session
    for as long as other holds keep the hub alive. A deletion that was made ends the task even
    when the horizon could not be lowered (a horizon left high only makes guards read the rows)."""
    holders = [_hand_over(hook, key) for key in KEYS]

    async def body() -> None:
        hub = _impatient_hub(hook)
        holds = [DeferredHold(key, holder, "dag.op run", 30.0) for key, holder in zip(KEYS, holders, strict=True)]
        async with hub.holding(holds[1]):  # keeps the hub and its session alive
            await asyncio.wait_for(holds[1].settled.wait(), 15)
            async with hub.holding(holds[0]):
                await asyncio.wait_for(holds[0].settled.wait(), 15)
                with _horizon_locked(dsn):
                    done = await (hub.end(holds[0]) if last_write == "end" else hub.hand_back(holds[0]))
                if last_write == "end":
                    assert done and holds[0].state == "ended", holds[0].reason
                    assert scopes.read(scopes_db, KEYS[0]) is None
                else:
                    assert not done and holds[0].state == "lost"
                    assert "could not be written" in str(holds[0].reason)
                assert await _until(lambda: _holders(scopes_db, KEYS[0]) == []), "the hub's session kept the key"
            assert holds[1].state == "held"

    _run(body)
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


def test_the_horizon_is_lowered_under_its_lock_whatever_the_default_isolation_and_a_probe_in_flight(
    hook: Any, scopes_db: Any, dsn: str
) -> None:
    """``lower_horizon`` on a lock session whose heartbeat probe is running a statement (the
    connection reads ACTIVE), with REPEATABLE READ as the session's default: its transaction must
    still read committed rows after the horizon's lock, or it lowers the horizon below a scope
    that another run committed meanwhile, and a plain guard of that key runs inside the scope."""
    other = LockKey.from_name("deferred/other-runs-scope")
    session = hook.open_lock_session(application_name=HUB)
    try:
        session.connection.execute("SET default_transaction_isolation = 'repeatable read'")
        with psycopg.connect(dsn, autocommit=True) as writer:
            writer.execute("SELECT pg_advisory_lock(%s)", [other.int64])
            with writer.transaction():
                taken, _ = scopes.enter(writer, other, uuid.uuid4().hex, "dep: the other run", 60)
                assert taken  # its row and the raised horizon, not committed yet
                probe = threading.Thread(target=lambda: session.connection.execute("SELECT pg_sleep(0.3)"))
                probe.start()
                time.sleep(0.05)
                lowering = threading.Thread(target=lambda: scopes.lower_horizon(session.connection))
                lowering.start()
                time.sleep(0.6)  # lower_horizon tries the horizon's lock until the writer commits
            writer.execute("SELECT pg_advisory_unlock(%s)", [other.int64])
        lowering.join(10)
        probe.join(10)
    finally:
        session.close()
    with pytest.raises(LockBusyError):  # the other run's scope holds the key
        LockGuard(hook.database, other, LockPolicy()).run(lambda handle: None)
    assert advisory_locks_left(scopes_db) == 0


def test_a_busy_horizon_delays_the_renewals_and_the_hub_keeps_every_key(
    hook: Any, scopes_db: Any, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session keeps the horizon's lock past the writers' bound (a foreign client on its
    advisory key, a writer waiting for a synchronous standby): a renewal fails with it, but the
    hub's session and every key it holds are fine. The hub must keep them (a try by another
    client finds them busy) and renew once the lock is free, not drop its session and so free
    every deferred key while their rows still say they are held."""
    monkeypatch.setattr(scopes, "HORIZON_WAIT_SECONDS", 0.5)
    holders = [_hand_over(hook, key, lease=3.0) for key in KEYS]

    def taken_by_another(key: LockKey) -> bool:
        with psycopg.connect(dsn, autocommit=True) as other:
            taken = bool(other.execute("SELECT pg_try_advisory_lock(%s)", [key.int64]).fetchone()[0])
            if taken:
                other.execute("SELECT pg_advisory_unlock(%s)", [key.int64])
            return taken

    async def body() -> None:
        async with _both_held(hook, holders, 3.0) as (_, holds):
            with _horizon_locked(dsn):
                deadline = time.monotonic() + 2.5  # past two renewals (every lease / 3 = 1 s)
                while time.monotonic() < deadline:
                    for key in KEYS:
                        assert not await asyncio.to_thread(taken_by_another, key), f"{key.describe()} was free"
                    await asyncio.sleep(0.2)
            for hold in holds:
                assert hold.state == "held", hold.reason
            before = {key: await asyncio.to_thread(scopes.read, scopes_db, key) for key in KEYS}
            await asyncio.sleep(1.5)  # a renewal with the lock free again
            for key in KEYS:
                row = await asyncio.to_thread(scopes.read, scopes_db, key)
                assert row is not None and row.lease_until > before[key].lease_until, "not renewed after"  # type: ignore[union-attr]
                assert await asyncio.to_thread(_holders, scopes_db, key) == [HUB]
            assert all(hold.state == "held" for hold in holds)

    _run(body)
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


class _StallingReconnects:
    """A hub's ``open_session`` whose connects, once :attr:`stalled` is set, wait until
    :attr:`released` is (as a connect to a host cut off waits out its timeout)."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        self.stalled = threading.Event()
        self.released = threading.Event()

    def __call__(self) -> Any:
        if self.stalled.is_set():
            self.released.wait(30)
        return self.hook.open_lock_session(application_name=HUB)


def _end_the_hubs_session(admin: Any) -> None:
    admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", [HUB])


def test_a_hold_is_lost_at_its_lease_even_while_the_hub_waits_in_a_reconnect(
    hook: Any, scopes_db: Any, dsn: str
) -> None:
    """The hub's session ends (the lock database cut off, its backend terminated): the keys are
    free on the server, the rows hold them until their lease. The hold must be lost by then,
    also while the hub's pass waits in a connect (a network cut: the connect waits out its
    timeout): the operator's job runs while the hold counts as kept."""
    holder = _hand_over(hook, KEYS[0], lease=2.0)
    connects = _StallingReconnects(hook)

    async def body() -> None:
        hub = HoldHub(connects)
        hold = DeferredHold(KEYS[0], holder, "dag.op run", 2.0)
        async with hub.holding(hold):
            await asyncio.wait_for(hold.settled.wait(), 15)
            assert hold.state == "held"
            connects.stalled.set()
            await asyncio.to_thread(_end_the_hubs_session, scopes_db)
            try:
                # The lease runs from the last renewal (at most 2 s ago): lost well within 5 s.
                await asyncio.wait_for(hold.lost.wait(), 5)
                assert not connects.released.is_set(), "lost only once the reconnect returned"
            finally:
                connects.released.set()
            assert hold.state == "lost" and "within the lease" in str(hold.reason), hold.reason
        assert await _until(lambda: hub._task is not None and hub._task.done()), "the hub did not retire"
        assert await _until(lambda: _sessions(scopes_db) == 0), "the hub kept the session its reconnect opened"

    _run(body)
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


def test_a_hub_stopped_while_it_reconnects_closes_the_session_it_was_opening(hook: Any, scopes_db: Any) -> None:
    """The loop ends (a triggerer stopping) while the hub's pass waits in a reconnect: the session
    that connect opens afterwards must be closed, not left open with nobody tracking it."""
    holder = _hand_over(hook, KEYS[0])
    connects = _StallingReconnects(hook)

    async def body() -> None:
        hub = HoldHub(connects)
        hold = DeferredHold(KEYS[0], holder, "dag.op run", 30.0)
        async with hub.holding(hold):
            await asyncio.wait_for(hold.settled.wait(), 15)
            connects.stalled.set()
            await asyncio.to_thread(_end_the_hubs_session, scopes_db)
            assert await _until(lambda: hold.state == "taking"), hold.state
            await asyncio.sleep(0.5)  # the pass is in its reconnect

    timer = threading.Timer(2.0, connects.released.set)  # the connect returns after the loop began to end
    timer.start()
    try:
        _run(body)
    finally:
        timer.join()
    assert _sessions_left(scopes_db) == 0, "the session the reconnect opened was left open"
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


def test_a_held_hold_whose_renewal_hangs_is_lost_at_its_lease_and_its_key_given_back(
    hook: Any, scopes_db: Any, dsn: str
) -> None:
    """A renewal that gets no answer (a session cut off without a word: its statement waits for
    TCP to give up, a lease or more) leaves the row unrenewed: past its lease another guard may
    hold the key while the operator's job goes on. The hold must be lost by then, though the hub's
    thread still waits, and the key it held given back once that thread is free. Here the
    renewal waits on a row lock another transaction keeps."""
    holder = _hand_over(hook, KEYS[0], lease=2.0)

    async def body() -> None:
        hub = _hub(hook)
        hold = DeferredHold(KEYS[0], holder, "dag.op run", 2.0)
        async with hub.holding(hold):
            await asyncio.wait_for(hold.settled.wait(), 15)
            with psycopg.connect(dsn, autocommit=True) as blocker:
                blocker.execute("BEGIN")
                blocker.execute("SELECT 1 FROM pglock.scopes FOR UPDATE")  # the next renewal waits for it
                try:
                    await asyncio.wait_for(hold.lost.wait(), 5)  # the lease runs from the last renewal
                    assert "could not renew the row" in str(hold.reason), hold.reason
                finally:
                    blocker.execute("ROLLBACK")
            assert await _until(lambda: _holders(scopes_db, KEYS[0]) == []), "the hub kept the lost hold's key"

    _run(body)
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0


def test_a_hold_found_busy_under_its_own_row_is_lost_by_the_rows_end_not_a_lease_later(
    hook: Any, scopes_db: Any, dsn: str
) -> None:
    """The hub's session ended and another session holds the key while the row is still the
    hold's (a guard reading it, a foreign client): nobody renews the row, so the hold counts as
    kept only as long as the row said, not a whole lease from the busy try, also when the passes
    then stop (the hub's next session cut off: its reconnect waits out its timeout)."""
    lease = 6.0
    holder = _hand_over(hook, KEYS[0], lease=lease)
    connects = _StallingReconnects(hook)

    async def body() -> None:
        hub = HoldHub(connects)
        hold = DeferredHold(KEYS[0], holder, "dag.op run", lease)
        async with hub.holding(hold):
            await asyncio.wait_for(hold.settled.wait(), 15)
            await asyncio.sleep(1.5)  # most of the way to the next renewal (every lease / 3 = 2 s)
            with psycopg.connect(dsn, autocommit=True) as other:
                await asyncio.to_thread(_end_the_hubs_session, scopes_db)
                other.execute("SELECT pg_advisory_lock(%s)", [KEYS[0].int64])  # before the hub takes it back
                [left] = other.execute(
                    "SELECT extract(epoch FROM lease_until - clock_timestamp())::float8 FROM pglock.scopes"
                ).fetchone()
                row_end = time.monotonic() + left
                await asyncio.sleep(1.5)  # the hub reconnects and finds the key busy under its own row
                assert hold.state == "taking", hold.state
                connects.stalled.set()
                await asyncio.to_thread(_end_the_hubs_session, scopes_db)
                try:
                    await asyncio.wait_for(hold.lost.wait(), lease + 5)
                    late = time.monotonic() - row_end
                    assert late <= 0.5, f"lost {late:.2f} s after the row's end"
                finally:
                    connects.released.set()
        assert await _until(lambda: hub._task is not None and hub._task.done()), "the hub did not retire"

    _run(body)
    scopes_db.execute("DELETE FROM pglock.scopes")
    assert advisory_locks_left(scopes_db) == 0
