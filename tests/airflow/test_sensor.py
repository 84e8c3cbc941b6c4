"""AdvisoryLockSensor and AdvisoryLockTrigger in a real Airflow 3 against a real PostgreSQL.

One dag.test() run exercises every mode (poke, reschedule, deferrable with the trigger run
inline) and the timeouts; each key is released only once its sensor (or trigger) has logged
that it waits for it. The trigger and the race between a
polling sensor and a real contender are also driven directly, on real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockConnectionError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg import statements
from airflow_pglock.pg.release import unlock
from devtools.pgcluster import free_port
from tests.helpers import TEST_CONN_ID, advisory_locks, held_lock, run_dag

pytestmark = pytest.mark.airflow

SENSOR_DAG = '''
import logging
import threading

import pendulum
from airflow.sdk import dag, task, chain

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

CONN = "pglock_test"
DONE = "all_done"


def hold_until_waited_for(name, by="is held by"):
    """Another session takes the key now, and releases it once a sensor (``by="is held by"``) or
    its trigger (``by="until it is free"``) has logged that it waits for it.

    Not after a fixed time: on a loaded machine a dag.test() task can take many seconds to
    start, and the sensor must find the key held. Bounded (120 s) so that a missing line
    fails the assertions below instead of hanging the run. Airflow 2 logs a task through
    logging; Airflow 3 through structlog, whose processors see the line before it is printed.
    """
    held = AdvisoryLockHook(CONN).acquire(name, application_name="maintenance holder")
    assert held is not None, name
    seen = threading.Event()

    def look(message):
        if f"pglock waiting: key '{name}'" in message and by in message:
            seen.set()

    class Watcher(logging.Handler):
        def emit(self, record):
            look(record.getMessage())

    def watch_structlog(logger, method, event_dict):
        if seen.is_set():  # stays in the list: removing it could race another thread's log call
            return event_dict
        event, args = str(event_dict.get("event", "")), event_dict.get("positional_args")
        try:
            look(event % args if args else event)
        except (TypeError, ValueError):
            look(event)
        return event_dict

    watcher = Watcher()
    loggers = [logging.getLogger(), logging.getLogger("airflow.task")]  # airflow.task may not propagate
    for logger in loggers:
        logger.addHandler(watcher)
    try:
        import structlog
    except ImportError:  # Airflow 2 may come without it; it logs through logging
        pass
    else:  # inserted before the sensor's task starts: dag.test() runs one task at a time
        structlog.get_config()["processors"].insert(0, watch_structlog)

    def release():
        seen.wait(120)
        for logger in loggers:
            logger.removeHandler(watcher)
        held.release()

    threading.Thread(target=release, daemon=True).start()


@dag(dag_id="sensors", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"tenant": "acme"})
def sensors():
    @task
    def hold_poke_key():
        hold_until_waited_for("maint/poke")

    @task(trigger_rule=DONE)
    def hold_reschedule_key():
        hold_until_waited_for("maint/reschedule")

    @task(trigger_rule=DONE)
    def hold_deferred_key():
        hold_until_waited_for("maint/deferred", by="until it is free")

    common = dict(postgres_conn_id=CONN, trigger_rule=DONE)
    chain(
        hold_poke_key(),
        AdvisoryLockSensor(task_id="wait_poke", key="maint/poke", poke_interval=0.2, timeout=60, **common),
        hold_reschedule_key(),
        AdvisoryLockSensor(task_id="wait_reschedule", key="maint/reschedule", mode="reschedule",
                           poke_interval=1, timeout=60, **common),
        hold_deferred_key(),
        AdvisoryLockSensor(task_id="wait_deferred", key="maint/deferred", deferrable=True, poke_interval=0.2,
                           timeout=60, **common),
        AdvisoryLockSensor(task_id="soft_poke", key="maint/held", poke_interval=0.2, timeout=1, soft_fail=True,
                           **common),
        AdvisoryLockSensor(task_id="soft_deferred", key="maint/held", deferrable=True, poke_interval=0.2,
                           timeout=1, soft_fail=True, **common),
        AdvisoryLockSensor(task_id="hard_deferred", key="maint/held", deferrable=True, poke_interval=0.2,
                           timeout=1, **common),
        AdvisoryLockSensor(task_id="free_pair", key=(7, 99), **common),
        AdvisoryLockSensor(task_id="free_tenant", key="maint", tenant="{{ params.tenant }}", **common),
        AdvisoryLockSensor(task_id="unknown_param", key="{{ params.no_such_param }}", soft_fail=True, **common),
        AdvisoryLockSensor(task_id="unreachable", key="maint/held", postgres_conn_id="pglock_unreachable",
                           soft_fail=True, timeout=30, trigger_rule=DONE),
        AdvisoryLockSensor(task_id="unreachable_deferred", key="maint/held", postgres_conn_id="pglock_unreachable",
                           deferrable=True, soft_fail=True, timeout=30, trigger_rule=DONE),
    )


sensors_dag = sensors()
'''


@pytest.fixture
def unreachable_conn() -> Any:
    name = "AIRFLOW_CONN_PGLOCK_UNREACHABLE"
    os.environ[name] = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres?connect_timeout=2"
    yield "pglock_unreachable"
    os.environ.pop(name, None)


def _reschedules(run_id: str, task_id: str) -> int:
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskreschedule import TaskReschedule
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session() as session:
        if hasattr(TaskReschedule, "ti_id"):  # Airflow 3: a reschedule row points at its task instance
            query = (
                select(func.count())
                .select_from(TaskReschedule)
                .join(TaskInstance, TaskInstance.id == TaskReschedule.ti_id)
                .where(TaskInstance.run_id == run_id, TaskInstance.task_id == task_id)
            )
        else:  # Airflow 2: it carries the task instance's key
            query = (
                select(func.count())
                .select_from(TaskReschedule)
                .where(TaskReschedule.run_id == run_id, TaskReschedule.task_id == task_id)
            )
        return int(session.scalar(query) or 0)


@pytest.mark.matrix("sensor-poke", "sensor-deferrable")
def test_sensor_modes_timeouts_and_errors(
    airflow_db: Any, hook: AdvisoryLockHook, admin: Any, unreachable_conn: str, capfd: Any, caplog: Any
) -> None:
    # A long lease: this holder sends no heartbeat, and the run may take longer than the default 30 s.
    holder = AdvisoryLockHook(dsn=hook.dsn, liveness=Liveness(lease=600))
    held = holder.acquire("maint/held", application_name="nightly maintenance")
    assert held is not None
    try:
        result = run_dag(SENSOR_DAG, "sensors")
    finally:
        held.release()
    log = "".join(capfd.readouterr()) + caplog.text

    assert result.states == {
        ("hold_poke_key", -1): "success",
        ("wait_poke", -1): "success",
        ("hold_reschedule_key", -1): "success",
        ("wait_reschedule", -1): "success",
        ("hold_deferred_key", -1): "success",
        ("wait_deferred", -1): "success",
        ("soft_poke", -1): "skipped",
        ("soft_deferred", -1): "skipped",
        ("hard_deferred", -1): "failed",
        ("free_pair", -1): "success",
        ("free_tenant", -1): "success",
        ("unknown_param", -1): "failed",  # an error fails the task even with soft_fail
        ("unreachable", -1): "failed",
        ("unreachable_deferred", -1): "failed",
    }, log[-5000:]

    # Each waiting sensor saw the key held (naming the key, its numbers and the holder) and then free.
    for name in ("maint/poke", "maint/reschedule", "maint/deferred"):
        key = LockKey.from_name(name)
        waiting = re.search(
            rf"pglock waiting: key '{name}' \(int64 {key.numbers[0]}\) is held by pid \d+ "
            r"\(application_name 'maintenance holder', client [^)]*\) holding ExclusiveLock since \S+ \(\d+\.\d s\)",
            log,
        )
        assert waiting, f"no waiting line for {name}"
        assert f"key '{name}' (int64 {key.numbers[0]}) is free" in log[waiting.end() :]
    assert _reschedules(result.run_id, "wait_reschedule") >= 1
    assert "[DAG TEST] running trigger in line" in log
    trigger_waited = re.search(r"pglock waiting: key 'maint/deferred' .*AdvisoryLockTrigger", log) or any(
        record.name.endswith("AdvisoryLockTrigger") and "pglock waiting: key 'maint/deferred'" in record.getMessage()
        for record in caplog.records  # Airflow 2's console lines don't name the logger; its records do
    )
    assert trigger_waited, "the trigger did not wait"

    # Timeouts name the key and the holder; soft_fail turns them into skips in both modes.
    held_key = LockKey.from_name("maint/held")
    # (not the lines of a boxed traceback, which Airflow 3.0 prints besides)
    timeouts = [line for line in log.splitlines() if "is still held by" in line and "│" not in line]
    assert any("soft_fail=True" in line and "after the sensor's timeout" in line for line in timeouts), timeouts
    assert any("at the sensor's deadline (timeout 1 s) (soft_fail=True)" in line for line in timeouts), timeouts
    assert any("AirflowSensorTimeout" in line and "at the sensor's deadline" in line for line in timeouts)
    assert all(f"(int64 {held_key.numbers[0]})" in line and "'nightly maintenance'" in line for line in timeouts)

    assert "key 'maint/acme'" in log and "int32 pair 7, 99" in log
    assert "no_such_param" in log
    assert "cannot connect to the lock database 'postgres' on 127.0.0.1" in log and "refused" in log
    assert advisory_locks(admin) == []


# ------------------------------------------------------------------ the trigger


def _run_trigger(trigger: Any) -> Any:
    async def first_event() -> Any:
        return await anext(trigger.run())

    return asyncio.run(first_event())


def test_trigger_serializes_without_secrets_and_round_trips(dsn: str) -> None:
    from airflow_pglock.triggers.advisory_lock import AdvisoryLockTrigger
    from tests.sdk import deserialize, serialize

    os.environ["AIRFLOW_CONN_PGLOCK_SECRET"] = "postgresql://postgres:s3cret-pw@127.0.0.1:5432/x"
    try:
        for key in (LockKey.from_name("maint/held"), LockKey.from_int(-5), LockKey.from_pair(7, -99)):
            trigger = AdvisoryLockTrigger.for_key(
                key, postgres_conn_id="pglock_secret", poll_interval=5, deadline=1.5e9
            )
            classpath, kwargs = trigger.serialize()
            assert classpath == "airflow_pglock.triggers.advisory_lock.AdvisoryLockTrigger"
            assert "s3cret" not in repr(kwargs) and "password" not in repr(kwargs).lower()
            rebuilt = AdvisoryLockTrigger(**deserialize(serialize(kwargs)))  # what the triggerer does
            assert rebuilt.serialize() == (classpath, kwargs)
            assert rebuilt.key == key
    finally:
        os.environ.pop("AIRFLOW_CONN_PGLOCK_SECRET")


def test_trigger_is_safe_to_run_twice_and_keeps_its_deadline(dsn: str, hook: AdvisoryLockHook, admin: Any) -> None:
    from airflow_pglock.triggers.advisory_lock import AdvisoryLockTrigger

    held = hook.acquire("maint/twice", application_name="nightly maintenance")
    assert held is not None
    kwargs = AdvisoryLockTrigger.for_key(
        held.key, postgres_conn_id=TEST_CONN_ID, poll_interval=0.05, deadline=time.time() + 60
    ).serialize()[1]
    timer = threading.Timer(0.5, held.release)
    timer.start()

    async def two_copies() -> list[Any]:
        return list(await asyncio.gather(*(anext(AdvisoryLockTrigger(**kwargs).run()) for _ in range(2))))

    try:
        events = asyncio.run(two_copies())
    finally:
        timer.join()
    assert [event.payload["status"] for event in events] == ["free", "free"]
    assert advisory_locks(admin) == []  # the two waiting copies took nothing

    # A trigger rebuilt after its deadline (triggerer restart) does not wait again.
    held = hook.acquire("maint/twice", application_name="nightly maintenance")
    assert held is not None
    try:
        late = AdvisoryLockTrigger.for_key(held.key, postgres_conn_id=TEST_CONN_ID, poll_interval=30, deadline=1.0)
        started = time.monotonic()
        event = _run_trigger(late)
        assert time.monotonic() - started < 25  # answered at once, not after a poll interval
    finally:
        held.release()
    assert event.payload["status"] == "timeout"
    assert "'nightly maintenance'" in event.payload["message"] and "maint/twice" in event.payload["message"]


def test_trigger_connection_error_is_a_clear_failure_even_with_soft_fail(
    dsn: str, unreachable_conn: str, airflow_db: Any
) -> None:
    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor
    from airflow_pglock.triggers.advisory_lock import AdvisoryLockTrigger

    key = LockKey.from_name("maint/held")
    event = _run_trigger(
        AdvisoryLockTrigger.for_key(key, postgres_conn_id=unreachable_conn, poll_interval=1, deadline=None)
    )
    assert event.payload["status"] == "error"
    assert event.payload["error_type"] == "LockConnectionError"
    message = event.payload["message"]
    assert "maint/held" in message and "cannot connect to the lock database" in message

    sensor = AdvisoryLockSensor(task_id="s", key="maint/held", postgres_conn_id=unreachable_conn, soft_fail=True)
    with pytest.raises(LockConnectionError, match="cannot connect to the lock database"):
        sensor.execute_complete({}, event.payload)  # type: ignore[arg-type]


def test_a_trigger_that_failed_fails_the_deferrable_sensor_even_with_soft_fail(airflow_db: Any) -> None:
    """Airflow resumes a task whose trigger raised (or could not be built in the triggerer) with
    ``__fail__``; BaseSensorOperator turned that into a skip under soft_fail. Only Airflow's
    deferral timeout is the sensor's timeout."""
    from airflow_pglock import compat
    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

    sensor = AdvisoryLockSensor(task_id="s", key="maint/held", postgres_conn_id=TEST_CONN_ID, soft_fail=True)
    with pytest.raises(Exception, match="Trigger failure") as failed:
        sensor.resume_execution("__fail__", {"error": "Trigger failure"}, {})  # type: ignore[arg-type]
    assert "Skip" not in type(failed.value).__name__
    if compat.AIRFLOW_V_3_PLUS:  # Airflow 2 has no deferral timeout of its own to resume with
        with pytest.raises(compat.AirflowSkipException, match="deferral timeout ended the wait for key 'maint/held'"):
            sensor.resume_execution("__fail__", {"error": "Trigger timeout"}, {})  # type: ignore[arg-type]


def test_shared_sensor_waits_only_for_exclusive_holders(dsn: str, hook: AdvisoryLockHook, admin: Any) -> None:
    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor
    from airflow_pglock.triggers.advisory_lock import AdvisoryLockTrigger

    key = LockKey.from_name("maint/shared")
    exclusive = AdvisoryLockSensor(task_id="x", key=key.name, postgres_conn_id=TEST_CONN_ID)
    shared = AdvisoryLockSensor(task_id="s", key=key.name, shared=True, postgres_conn_id=TEST_CONN_ID)

    def trigger_says(shared_mode: bool) -> str:
        trigger = AdvisoryLockTrigger.for_key(
            key, postgres_conn_id=TEST_CONN_ID, poll_interval=1, deadline=0, shared=shared_mode
        )
        return str(_run_trigger(trigger).payload["status"])

    with held_lock(hook, key, shared=True) as reader:
        assert reader is not None
        assert (exclusive.poke({}), shared.poke({})) == (False, True)  # type: ignore[arg-type]
        assert (trigger_says(False), trigger_says(True)) == ("timeout", "free")
    with held_lock(hook, key) as writer:
        assert writer is not None
        assert (exclusive.poke({}), shared.poke({})) == (False, False)  # type: ignore[arg-type]
        assert (trigger_says(False), trigger_says(True)) == ("timeout", "timeout")
    # A shared holder and an exclusive request queued behind it: PostgreSQL queues a new shared
    # request behind that one too, so a shared lock cannot be taken now (the shared sensor said free).
    reader = hook.acquire(key, shared=True)
    assert reader is not None
    waiter = psycopg.connect(dsn, autocommit=True, application_name="exclusive waiter")
    queued = threading.Thread(target=lambda: waiter.execute("SELECT pg_advisory_lock(%s)", [key.int64]))
    queued.start()
    try:
        queued_by = time.monotonic() + 30
        while not any(not granted for *_, granted in advisory_locks(admin)):
            assert time.monotonic() < queued_by, "the exclusive request never queued"
            time.sleep(0.01)
        assert admin.execute("SELECT pg_try_advisory_lock_shared(%s)", [key.int64]).fetchone() == (False,)
        assert (exclusive.poke({}), shared.poke({})) == (False, False)  # type: ignore[arg-type]
        assert (trigger_says(False), trigger_says(True)) == ("timeout", "timeout")
    finally:
        reader.release()
        queued.join(10)
        waiter.execute("SELECT pg_advisory_unlock_all()")  # granted once the reader left: freed now, not at the close
        waiter.close()
    assert advisory_locks(admin) == []


# ----------------------------------------------------------------- invariant 5


def test_a_polling_sensor_never_makes_a_contender_skip(dsn: str, hook: AdvisoryLockHook, admin: Any) -> None:
    """A contender takes and releases the key in a tight loop while the sensor's poke() and the
    trigger poll it as fast as they can: the contender must get the key every single time."""
    import psycopg

    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor
    from airflow_pglock.triggers.advisory_lock import AdvisoryLockTrigger

    key = LockKey.from_name("maint/race")
    sensor = AdvisoryLockSensor(task_id="race", key=key.name, postgres_conn_id=TEST_CONN_ID)
    stop = threading.Event()
    seen: dict[str, list[bool]] = {"poke": [], "trigger": []}

    def poke_loop() -> None:
        while not stop.is_set():
            seen["poke"].append(sensor.poke({}))  # type: ignore[arg-type]

    def trigger_loop() -> None:
        async def loop() -> None:
            while not stop.is_set():
                trigger = AdvisoryLockTrigger.for_key(
                    key, postgres_conn_id=TEST_CONN_ID, poll_interval=1, deadline=time.time() - 1
                )
                event = await anext(trigger.run())
                seen["trigger"].append(event.payload["status"] == "free")

        asyncio.run(loop())

    pollers = [threading.Thread(target=poke_loop), threading.Thread(target=trigger_loop)]
    rounds = missed = 0
    with psycopg.connect(dsn, autocommit=True, application_name="contender") as contender:
        for thread in pollers:
            thread.start()
        try:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline or min(len(v) for v in seen.values()) < 50:
                if statements.try_lock(contender, key):
                    time.sleep(0.0005)  # the "work": long enough for the pollers to see it held
                    assert unlock(contender, key)
                else:
                    missed += 1
                rounds += 1
        finally:
            stop.set()
            for thread in pollers:
                thread.join()
    assert missed == 0, f"the contender found the key busy {missed} times in {rounds} rounds"
    # The pollers really raced the contender: they saw the key both held and free.
    for name, results in seen.items():
        assert True in results and False in results, (name, len(results), sum(results))
    assert advisory_locks(admin) == []


def test_the_race_test_detects_a_checker_that_takes_the_lock(dsn: str, hook: AdvisoryLockHook, admin: Any) -> None:
    """Control for the test above: a checker that *tries the lock* to see whether it is free
    (what the sensor must not do) does make the contender skip under the same race."""
    import psycopg

    key = LockKey.from_name("maint/race-control")
    stop = threading.Event()

    def lock_taking_checker() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                if statements.try_lock(conn, key):
                    unlock(conn, key)

    checker = threading.Thread(target=lock_taking_checker)
    missed = 0
    with psycopg.connect(dsn, autocommit=True, application_name="contender") as contender:
        checker.start()
        try:
            deadline = time.monotonic() + 10
            while missed == 0 and time.monotonic() < deadline:
                if statements.try_lock(contender, key):
                    assert unlock(contender, key)
                else:
                    missed += 1
        finally:
            stop.set()
            checker.join()
    assert missed > 0
    assert advisory_locks(admin) == []


# ------------------------------------------------------------------ the example


def test_example_wait_for_maintenance(airflow_db: Any, dsn: str, admin: Any, capfd: Any) -> None:
    """dags/example_wait_for_maintenance.py as it is: a running load (a shared holder) lets other loads
    through the sensor and the shared guard, and makes maintenance (exclusive) skip."""
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "dags" / "example_wait_for_maintenance.py").read_text()
    holder = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=600))
    running_load = holder.acquire("warehouse-maintenance", shared=True, application_name="another load")
    assert running_load is not None
    try:
        load = run_dag(source, "warehouse_load", conf={"work_seconds": 0})
        maintenance = run_dag(source, "warehouse_maintenance", conf={"work_seconds": 0})
    finally:
        running_load.release()
    log = "".join(capfd.readouterr())
    assert load.states == {("wait_for_maintenance", -1): "success", ("load_orders", -1): "success"}
    assert maintenance.states == {("vacuum_and_reindex", -1): "skipped"}
    assert "key 'warehouse-maintenance'" in log and "is free for a shared lock" in log
    assert re.search(r"outcome=completed key 'warehouse-maintenance' .*mode=session", log)
    skip = next(line for line in log.splitlines() if "outcome=skipped" in line)
    assert "'another load'" in skip and "holding ShareLock" in skip
    assert advisory_locks(admin) == []


@pytest.mark.matrix("sensor-deferrable")
def test_the_wake_up_hold_reads_the_supervisors_own_wait_on_this_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compat module reads the setting the Task SDK's supervisor waits by, on every Airflow 3
    line; Airflow 2 has no supervisor, and its deferrals keep the measured hold."""
    from airflow_pglock import compat
    from airflow_pglock.triggers.advisory_lock import RESUME_HOLD_SECONDS, AdvisoryLockTrigger

    key = LockKey.from_name("sensor/supervisor-wait")
    monkeypatch.setenv("AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL", "20")
    trigger = AdvisoryLockTrigger.for_key(key, postgres_conn_id=TEST_CONN_ID, poll_interval=5, deadline=None)
    if not compat.AIRFLOW_V_3_PLUS:
        assert compat.task_supervisor_wait() is None
        assert trigger.resume_hold == RESUME_HOLD_SECONDS
        return
    assert compat.task_supervisor_wait() == 20.0
    assert trigger.resume_hold == 23.0
    import inspect

    from airflow.sdk.execution_time import supervisor  # the wait it is read for (read when imported)

    # The supervisor's loop waits by this very option (its name, not only its default value).
    assert re.search(r'conf\.get\w*\(\s*"workers",\s*"min_heartbeat_interval"\s*\)', inspect.getsource(supervisor))


@pytest.mark.parametrize("interval", [0, 0.0])
def test_a_deferrable_sensor_that_would_never_poll_is_refused_when_the_dag_is_parsed(interval: float) -> None:
    """The trigger re-reads the key every poke_interval: 0 was refused only after a first poke (a
    connection), as the trigger's poll_interval; now at parse time, naming poke_interval."""
    from airflow_pglock.exceptions import LockConfigurationError
    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

    with pytest.raises(LockConfigurationError, match=r"deferrable=True needs poke_interval above 0 seconds"):
        AdvisoryLockSensor(task_id="s", key="k", deferrable=True, poke_interval=interval)
    AdvisoryLockSensor(task_id="s", key="k", poke_interval=0)  # poke mode: Airflow's own rules


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"shared": "no"}, "shared must be True or False"),
        ({"connect_timeout": 0}, "connect_timeout must be a whole number"),
        ({"connect_timeout": -1}, "connect_timeout must be a whole number"),
        ({"connect_timeout": "x"}, "connect_timeout must be a whole number"),
        ({"poll_interval": float("inf")}, "poll_interval must be a positive number"),
        ({"postgres_conn_id": None}, "postgres_conn_id must be a non-empty string"),
        ({"postgres_conn_id": " "}, "postgres_conn_id must be a non-empty string"),
        ({"deadline": "x"}, "deadline must be a UNIX time or None"),
    ],
)
def test_the_wait_trigger_refuses_bad_arguments_naming_them(options: dict[str, Any], named: str) -> None:
    """The trigger is public (a custom operator may defer to it) and is built again in the triggerer
    from its serialized arguments: each is checked there, not taken as it comes (``"no"`` as a
    truthy ``shared``, a ``connect_timeout`` of 0 that waits for ever, a poll that never comes)."""
    from airflow_pglock.exceptions import LockConfigurationError
    from airflow_pglock.triggers.advisory_lock import AdvisoryLockTrigger

    arguments: dict[str, Any] = {"key_name": "k", "key_numbers": [7], "postgres_conn_id": "pglock_test", **options}
    with pytest.raises(LockConfigurationError, match=named):
        AdvisoryLockTrigger(**arguments)


def test_a_sensor_whose_deferrable_is_not_a_bool_is_refused() -> None:
    from airflow_pglock.exceptions import LockConfigurationError
    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

    with pytest.raises(LockConfigurationError, match=r"deferrable must be True or False, got 'yes'"):
        AdvisoryLockSensor(task_id="s", key="k", deferrable="yes")  # type: ignore[arg-type]


def test_never_fail_skips_an_error_in_poke_mode_only(unreachable_conn: str) -> None:
    """Airflow's own never_fail turns an error of its poke loop into a skip (the user asked for it);
    the first check of a deferrable sensor runs outside that loop, and fails."""
    from airflow_pglock import compat
    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

    def sensor(**mode: Any) -> Any:
        return AdvisoryLockSensor(
            task_id="s", key="maint/never-fail", postgres_conn_id=unreachable_conn, never_fail=True, timeout=5, **mode
        )

    context: Any = {"ti": None}
    with pytest.raises(compat.AirflowSkipException):
        sensor(mode="poke").execute(context)
    with pytest.raises(LockConnectionError, match="cannot connect to the lock database"):
        sensor(deferrable=True).execute(context)


# ------------------------------------------------- a sensor guarded by its own key

SELF_GUARDED_DAG = """
import functools

import pendulum
from airflow.sdk import dag, chain

from airflow_pglock.compat import HAS_LOCK_SCOPE
from airflow_pglock.operators.advisory_lock import guarded
from airflow_pglock.operators.scope import advisory_lock_scope
from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

CONN = "pglock_test"


def plain_sensor(task_id, key, **options):
    return AdvisoryLockSensor(task_id=task_id, key=key, postgres_conn_id=CONN, poke_interval=0.2, timeout=4,
                              retries=0, **options)


@dag(dag_id="self_guarded_sensors", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def self_guarded_sensors():
    sensor = functools.partial(plain_sensor, trigger_rule="all_done")
    tasks = [
        guarded(sensor("guarded_poke", "self/poke"), key="self/poke", postgres_conn_id=CONN),
        guarded(sensor("guarded_reschedule", "self/reschedule", mode="reschedule"), key="self/reschedule",
                postgres_conn_id=CONN),
        # A deferrable guard, and lock scopes, need Airflow 3 (its hold passes to the triggerer).
        *([guarded(sensor("guarded_deferred", "self/deferred", deferrable=True), key="self/deferred",
                   postgres_conn_id=CONN)] if HAS_LOCK_SCOPE else []),
        guarded(sensor("guarded_templated", "{{ 'self/' ~ 'poke' }}"), key="self/poke", postgres_conn_id=CONN),
        guarded(sensor("shared_guard_exclusive_sensor", "self/shared"), key="self/shared", shared=True,
                postgres_conn_id=CONN),
        guarded(sensor("guarded_pool_slot", "self/pool", slots=2), key="self/pool", slots=2, postgres_conn_id=CONN),
        # Controls: another key, and a shared sensor under a shared guard (its own hold is no exclusive one).
        guarded(sensor("guarded_other_key", "self/other"), key="self/poke", postgres_conn_id=CONN),
        guarded(sensor("shared_guard_shared_sensor", "self/shared", shared=True), key="self/shared", shared=True,
                postgres_conn_id=CONN),
    ]
    chain(*tasks)
    if HAS_LOCK_SCOPE:
        with advisory_lock_scope("publish", key="self/scope", postgres_conn_id=CONN):  # not chained: a setup's rules
            plain_sensor("wait_own_scope", "{{ 'self/scope' }}")


self_guarded_sensors_dag = self_guarded_sensors()
"""


def test_a_sensor_guarded_by_its_own_key_fails_at_once_instead_of_waiting_for_itself(
    airflow_db: Any, scopes_db: Any, capfd: Any, caplog: Any
) -> None:
    """A sensor run under a guard of the key it waits for (``guarded(sensor, key=...)`` in any mode,
    or inside a lock scope on that key) found the key held by its own task at every check, the
    triggerer's hold of its own deferral too, and waited until its timeout (review -74). It now
    fails at its first check, naming the key and its own hold; a sensor of another key, or a shared
    sensor under a shared guard (only exclusive holders make it wait), still runs."""
    from airflow_pglock import compat

    started = time.monotonic()
    result = run_dag(SELF_GUARDED_DAG, "self_guarded_sensors")
    log = "".join(capfd.readouterr()) + caplog.text
    refused = ["guarded_poke", "guarded_reschedule", "guarded_templated", "shared_guard_exclusive_sensor"]
    if compat.HAS_LOCK_SCOPE:  # a deferrable guard and lock scopes: Airflow 3
        refused += ["guarded_deferred", "publish.wait_own_scope"]
    for task_id in refused:
        assert result.state(task_id) == "failed", (task_id, log[-5000:])
        shared = ", shared" if task_id == "shared_guard_exclusive_sensor" else ""
        assert re.search(
            rf"AdvisoryLockSensor '{re.escape(task_id)}' waits for key '[^']+' \(int64 -?\d+\), which its own task "
            rf"already holds \(its guard's session, pid \d+, since \S+{shared}\): ",
            log,
        ), (task_id, log[-5000:])
    # A pool sensor whose task holds one slot of the pool may find another free: it runs.
    assert result.state("guarded_pool_slot") == "success"
    assert "still held by" not in log, "a sensor waited for its own key until its timeout"
    assert result.state("guarded_other_key") == "success"
    assert result.state("shared_guard_shared_sensor") == "success"
    if compat.HAS_LOCK_SCOPE:
        assert result.state("publish.pglock_scope_exit") == "success"
    assert time.monotonic() - started < 60
    assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone() == (0,)
    assert advisory_locks(scopes_db) == []


NONE_SENSOR_DAG = """
import pendulum
from airflow.sdk import dag

from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

CONN = "pglock_test"


def sensor(task_id, **options):
    return AdvisoryLockSensor(task_id=task_id, postgres_conn_id=CONN, poke_interval=0.2, timeout=4, retries=0,
                              trigger_rule="all_done", **options)


@dag(dag_id="{dag_id}", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     render_template_as_native_obj={native}, params={{"key": None, "tenant": None}})
def none_sensors():
    sensor("key_none", key="{{{{ params.key }}}}")
    sensor("tenant_none", key="intended", tenant="{{{{ params.tenant }}}}")
    if not {native}:  # (native templating reads any string option, even without a template, as Python: None)
        sensor("literal_none", key="None")  # a key named 'None', written without a template: waited for as any


none_sensors_dag = none_sensors()
"""


@pytest.mark.parametrize("native", [False, True], ids=["text", "native"])
def test_a_sensor_whose_key_or_tenant_template_renders_a_none_value_fails_instead_of_watching_another_key(
    native: bool, airflow_db: Any, hook: AdvisoryLockHook, admin: Any, capfd: Any
) -> None:
    """key="{{ params.key }}" with a None value rendered to the text 'None' (non-native templating):
    the sensor watched the key 'None', found it free and succeeded while the intended key was held;
    a tenant rendered None (native) was dropped, and 'None' (text) watched 'intended/None'. Both now
    fail at once, before any connection, naming the option (review -87)."""
    dag_id = f"none_sensors_{'native' if native else 'text'}"
    source = NONE_SENSOR_DAG.format(dag_id=dag_id, native=native)
    with held_lock(hook, "intended") as held:  # the key the templates meant: held all along
        assert held is not None
        result = run_dag(source, dag_id)
    log = "".join(capfd.readouterr())
    assert result.state("key_none") == "failed", log[-3000:]
    assert result.state("tenant_none") == "failed", log[-3000:]
    assert native or result.state("literal_none") == "success"
    rendered = "to None" if native else "to the text 'None'"
    assert f"the key template '{{{{ params.key }}}}' of task 'key_none' rendered {rendered}" in log
    assert f"the tenant template '{{{{ params.tenant }}}}' of task 'tenant_none' rendered {rendered}" in log
    assert native or "pglock sensor: key 'None'" in log  # the literal name
    assert "pglock sensor: key 'intended" not in log and "pglock waiting: key 'intended" not in log
    assert advisory_locks(admin) == []
