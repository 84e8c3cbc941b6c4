"""slots=N through every adapter on real Airflow, and two deployments sharing one pool."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey, slot_keys
from airflow_pglock.pg.held import HeldLock
from tests.helpers import TEST_CONN_ID, advisory_locks, advisory_locks_once_exited, for_this_airflow, run_dag
from tests.statsd import StatsdListener

pytestmark = pytest.mark.airflow

POOL_DAG = """
import pendulum
from airflow.sdk import chain, dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock
from airflow_pglock.operators.advisory_lock import guarded
from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor
from tests.sdk import BashOperator

CONN = "pglock_test"
DONE = "all_done"


@dag(dag_id="slots_pool", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def slots_pool():
    @task.advisory_lock(key="warehouse-exports", slots=3, postgres_conn_id=CONN)
    def decorated(lock):
        return lock.key.name

    @task(trigger_rule=DONE)
    @advisory_lock(key="warehouse-exports", slots=3, postgres_conn_id=CONN)
    def composable(lock):
        return lock.key.name

    chain(
        AdvisoryLockSensor(task_id="sensor", key="warehouse-exports", slots=3, postgres_conn_id=CONN,
                           poke_interval=0.2, timeout=1, soft_fail=True),
        decorated(),
        composable(),
        guarded(BashOperator(task_id="operator", bash_command="echo exported", trigger_rule=DONE),
                key="warehouse-exports", slots=3, postgres_conn_id=CONN),
    )


slots_pool_dag = slots_pool()
"""

ADAPTERS = ("decorated", "composable", "operator")


def _hold(
    hook: AdvisoryLockHook, count: int, pool: str = "warehouse-exports", slots: int = 3, first: int = 0
) -> list[HeldLock]:
    """``count`` slots of ``pool`` held by other sessions (application_name ``other exporter <n>``)."""
    held = [
        hook.acquire(pool, application_name=f"other exporter {n}", slots=slots) for n in range(first, first + count)
    ]
    assert all(lock is not None for lock in held)
    return [lock for lock in held if lock is not None]


def test_every_adapter_takes_the_free_slot_and_skips_a_full_pool_naming_the_holders(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any, capfd: Any
) -> None:
    free_slot = slot_keys(LockKey.from_name("warehouse-exports"), 3)[2]
    held = _hold(holder_hook, 2)  # slots 1 and 2, from another "deployment"
    try:
        capfd.readouterr()
        result = run_dag(POOL_DAG, "slots_pool")
        log = "".join(capfd.readouterr())
        assert result.state("sensor") == "success"
        for task_id in ADAPTERS:
            assert result.state(task_id) == "success", task_id
        assert log.count(f"pglock outcome=completed key {free_slot.name!r}") == len(ADAPTERS), log[-3000:]

        held += _hold(holder_hook, 1, first=2)  # the pool is full
        result = run_dag(POOL_DAG, "slots_pool")
        log = "".join(capfd.readouterr())
        assert result.state("sensor") == "skipped"
        for task_id in ADAPTERS:
            assert result.state(task_id) == "skipped", task_id
        assert "busy: all 3 slots of the pool key 'warehouse-exports'" in log, log[-3000:]
        for lock in held:
            assert f"pid {lock.server.backend_pid} " in log
        assert "application_name 'other exporter 1'" in log
    finally:
        for lock in held:
            lock.release()
    assert advisory_locks_once_exited(admin) == []  # a full pool: its markers go with the close


DEPLOYMENT_DAG = """
import os
import re
import time

import pendulum
import psycopg
from airflow.sdk import chain, dag, task

CONN = "pglock_test"
ME = os.environ["PGLOCK_DEPLOYMENT"]
DSN = os.environ["PGLOCK_TEST_DSN"]


def mark(event, slot=None):
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute("INSERT INTO pool_runs (deployment, event, slot, at) VALUES (%s, %s, %s, clock_timestamp())",
                     [ME, event, slot])


def wait_for(condition, params, seconds=240):
    deadline = time.monotonic() + seconds
    with psycopg.connect(DSN, autocommit=True) as conn:
        while time.monotonic() < deadline:
            if conn.execute(condition, params).fetchone()[0]:
                return
            time.sleep(0.2)
    raise TimeoutError(condition)


@dag(dag_id="nightly_export", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def nightly_export():
    @task
    def arrive():
        mark("arrived")
        wait_for("SELECT count(DISTINCT deployment) = 2 FROM pool_runs WHERE event = 'arrived'", [])

    @task.advisory_lock(key="warehouse-exports", slots=2, postgres_conn_id=CONN)
    def export(lock):
        mark("holding", lock.key.name)
        # hold the slot until the other deployment has tried the pool and finished
        wait_for("SELECT count(*) > 0 FROM pool_runs WHERE event = 'after' AND deployment <> %s", [ME])
        mark("released", lock.key.name)

    @task(trigger_rule="all_done")
    def after():
        mark("after")

    chain(arrive(), export(), after())


nightly_export_dag = nightly_export()
"""


def _deployment(home: Path, name: str, dsn: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "PGLOCK_DEPLOYMENT": name,
            "PGLOCK_TEST_DSN": dsn,
        }
    )
    (home / "dags").mkdir(parents=True)
    (home / "dags" / "nightly_export.py").write_text(for_this_airflow(DEPLOYMENT_DAG))
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    return env


def _dags_test(env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "airflow", "dags", "test", "nightly_export", "2026-11-30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    return result.stdout + result.stderr


@pytest.mark.slow
def test_two_deployments_share_a_pool_at_most_n_run_and_the_other_skips_naming_holders(
    dsn: str, admin: Any, holder_hook: AdvisoryLockHook
) -> None:
    admin.execute(
        "DROP TABLE IF EXISTS pool_runs;"
        " CREATE TABLE pool_runs (deployment text, event text, slot text, at timestamptz)"
    )
    base = Path(tempfile.mkdtemp(prefix="pglock-two-deployments-slots-"))
    with ThreadPoolExecutor(2) as pool:
        envs = list(pool.map(_deployment, [base / "a", base / "b"], ["a", "b"], [dsn, dsn]))
    outside = holder_hook.acquire("warehouse-exports", application_name="cron exporter", slots=2)
    assert outside is not None and outside.key.name == "warehouse-exports"  # slot 1: a non-Airflow holder
    try:
        with ThreadPoolExecutor(2) as pool:
            outputs = dict(zip("ab", pool.map(_dags_test, envs), strict=True))
    finally:
        outside.release()
    holding = admin.execute("SELECT deployment, slot FROM pool_runs WHERE event = 'holding'").fetchall()
    assert len(holding) == 1, (holding, {name: text[-3000:] for name, text in outputs.items()})
    winner, slot = holding[0]
    loser = "b" if winner == "a" else "a"
    assert slot == "warehouse-exports#slot2"
    assert "pglock outcome=completed key 'warehouse-exports#slot2'" in outputs[winner], outputs[winner][-3000:]
    skipped = outputs[loser]
    assert "pglock outcome=skipped key 'warehouse-exports'" in skipped, skipped[-3000:]
    assert "busy: all 2 slots of the pool key 'warehouse-exports'" in skipped
    assert "application_name 'cron exporter'" in skipped  # the holder outside Airflow, named
    assert "nightly_export" in skipped.split("all 2 slots", 1)[1]  # and the other deployment's task
    assert admin.execute("SELECT count(*) FROM pool_runs WHERE event = 'after'").fetchone()[0] == 2
    assert advisory_locks(admin) == []


def _release_once_waiting(hook: AdvisoryLockHook, held: HeldLock) -> None:
    deadline = time.monotonic() + 120
    with hook.database.connect("pglock-tests watcher") as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'airflow-pglock wakeups'"
                " AND datname = current_database()"
            ).fetchone()
            if waiting and waiting[0]:
                break
            time.sleep(0.1)
    held.release()


DEFER_DAG = """
import pendulum
from airflow.sdk import dag, task

from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor


@dag(dag_id="slots_defer_task", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def slots_defer_task():
    @task.advisory_lock(key="deferred-exports", slots=2, on_busy="defer", wait_timeout=120,
                        postgres_conn_id="pglock_test")
    def export(lock):
        return lock.key.name

    export()


@dag(dag_id="slots_defer_sensor", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def slots_defer_sensor():
    AdvisoryLockSensor(task_id="sensor", key="deferred-exports", slots=2, postgres_conn_id="pglock_test",
                       deferrable=True, poke_interval=60, timeout=120)


task_dag = slots_defer_task()
sensor_dag = slots_defer_sensor()
"""


@pytest.mark.parametrize(
    ("dag_id", "task_id", "deferred"),
    [
        ("slots_defer_task", "export", "pglock deferred: all 2 slots of the pool"),
        ("slots_defer_sensor", "sensor", "pglock waiting: a slot of the pool"),
    ],
)
def test_a_deferred_task_and_sensor_wake_when_any_slot_of_the_pool_frees(
    airflow_db: Any,
    holder_hook: AdvisoryLockHook,
    admin: Any,
    capfd: Any,
    caplog: Any,
    dag_id: str,
    task_id: str,
    deferred: str,
) -> None:
    held = _hold(holder_hook, 2, "deferred-exports", slots=2)
    second = held[1]
    assert second.key.name == "deferred-exports#slot2"
    # Once the trigger watches the pool, only slot 2 frees (its release is announced; the poll
    # interval, 60 s, is far longer than this test waits).
    timer = threading.Thread(target=_release_once_waiting, args=(holder_hook, second))
    timer.start()
    try:
        capfd.readouterr()
        result = run_dag(DEFER_DAG, dag_id)
        log = "".join(capfd.readouterr()) + caplog.text
    finally:
        timer.join()
        for lock in held:
            if lock is not None:
                lock.release()
    assert result.state(task_id) == "success", log[-3000:]
    assert deferred in log, log[-3000:]
    # the trigger watched every slot of the pool (not the pool's key alone)
    assert re.search(r"pglock waiting: a slot of the pool key 'deferred-exports' .* until it is free", log), log[-3000:]
    if task_id == "export":
        assert "pglock outcome=completed key 'deferred-exports#slot2'" in log
    assert advisory_locks(admin) == []


HOWTO = Path(__file__).resolve().parents[2] / "docs" / "howto-slots.md"


def test_the_howto_dag_runs_as_written_on_the_slot_freed_while_it_waits(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any, capfd: Any, caplog: Any
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", HOWTO.read_text(), re.DOTALL)
    [source] = [block for block in blocks if "@dag(" in block]
    source = source.replace('"postgres_locks"', repr(TEST_CONN_ID))  # the only change: the test's connection
    held = _hold(holder_hook, 3)
    second = held[1]
    releaser = threading.Thread(target=_release_once_waiting, args=(holder_hook, second))
    releaser.start()
    try:
        capfd.readouterr()
        result = run_dag(source, "warehouse_export")
        log = "".join(capfd.readouterr()) + caplog.text
    finally:
        releaser.join()
        for lock in held:
            if lock is not None:
                lock.release()
    assert result.state("export") == "success", log[-3000:]
    assert "pglock deferred: all 3 slots of the pool key 'warehouse-exports'" in log
    assert "exporting while holding warehouse-exports#slot2" in log
    assert "pglock outcome=completed key 'warehouse-exports#slot2'" in log
    assert advisory_locks(admin) == []


METRICS_DAG = """
import pendulum
from airflow.sdk import dag, task


@dag(dag_id="slots_metrics", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def slots_metrics():
    @task.advisory_lock(key="metered-exports", slots=3, postgres_conn_id="pglock_test")
    def export():
        return "exported"

    export()


slots_metrics_dag = slots_metrics()
"""


def test_metrics_report_how_many_slots_of_the_pool_were_in_use(
    airflow_db: Any,
    holder_hook: AdvisoryLockHook,
    statsd: StatsdListener,
) -> None:
    held = _hold(holder_hook, 1, "metered-exports")  # the task takes slot 2: at least 2 were in use
    try:
        assert run_dag(METRICS_DAG, "slots_metrics").state("export") == "success"
        held += _hold(holder_hook, 2, "metered-exports", first=1)  # all 3: the task skips, 3 in use
        assert run_dag(METRICS_DAG, "slots_metrics").state("export") == "skipped"
    finally:
        for lock in held:
            lock.release()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sum(name == "pool_in_use" for name, _, _ in statsd.metrics()) < 2:
        time.sleep(0.1)
    metrics = statsd.metrics()
    assert all(tags.get("slots") == "3" for _, tags, _ in metrics), metrics
    gauges = [line for line in statsd.lines if line.startswith("airflow.pglock.pool_in_use,")]
    assert [line.rpartition(":")[2] for line in gauges] == ["2|g", "3|g"], gauges
    names = [name for name, _, _ in metrics]
    assert names.count("acquired") == 1 and names.count("skipped") == 1


WAIT_FAIL_DAG = """
import pendulum
from airflow.sdk import dag, task

CONN = "pglock_test"


@dag(dag_id="wait_then_fail", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def wait_then_fail():
    @task.advisory_lock(key="wait-fail-key", on_busy="wait", wait_timeout=0.5, on_wait_timeout="fail",
                        postgres_conn_id=CONN)
    def plain():
        raise AssertionError("must not run")

    @task.advisory_lock(key="wait-fail-pool", slots=2, on_busy="wait", wait_timeout=0.5, on_wait_timeout="fail",
                        postgres_conn_id=CONN, trigger_rule="all_done")
    def pooled():
        raise AssertionError("must not run")

    plain() >> pooled()


wait_then_fail_dag = wait_then_fail()
"""


def test_on_wait_timeout_fail_fails_the_task_and_its_outcome_line_says_failed(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any, capfd: Any, caplog: Any
) -> None:
    held = _hold(holder_hook, 1, "wait-fail-key", slots=1) + _hold(holder_hook, 2, "wait-fail-pool", slots=2)
    try:
        capfd.readouterr()
        result = run_dag(WAIT_FAIL_DAG, "wait_then_fail")
        log = "".join(capfd.readouterr()) + caplog.text
    finally:
        for lock in held:
            lock.release()
    assert result.state("plain") == "failed", log[-3000:]
    assert result.state("pooled") == "failed", log[-3000:]
    outcomes = re.findall(r"pglock outcome=(\w+) key '(wait-fail-[a-z]+)'", log)
    assert sorted(set(outcomes)) == [("failed", "wait-fail-key"), ("failed", "wait-fail-pool")], outcomes
    assert "after wait_timeout (on_wait_timeout='fail')" in log
    assert advisory_locks_once_exited(admin) == []  # a full pool: its markers go with the close
