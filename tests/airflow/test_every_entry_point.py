"""One DAG file that uses every public entry point parses and runs, on whichever Airflow line this is.

What a new user on Airflow 3.0 / 3.1 saw before compat.py knew those lines: every DAG that
imported the provider failed to parse. This file is parsed by a DagBag (no import error
allowed) and run with dag.test(), against a real PostgreSQL, on every line of the matrix.
"""

from __future__ import annotations

from typing import Any

import pytest

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.liveness import Liveness
from tests.helpers import advisory_locks, run_dag, write_dag

pytestmark = pytest.mark.airflow

EVERY_ENTRY_POINT_DAG = """
import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import chain, dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.operators.advisory_lock import guarded
from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

CONN = "pglock_test"


@dag(dag_id="every_entry_point", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def every_entry_point():
    @task.advisory_lock(postgres_conn_id=CONN, key="every/session")
    def session_lock(lock):
        return lock.key.name

    @task.advisory_lock(postgres_conn_id=CONN, key="every/busy")
    def skipped_when_busy():
        raise AssertionError("must not run while the test holds every/busy")

    @task.advisory_lock(postgres_conn_id=CONN, key=(41, 1), mode="transaction")
    def transaction_lock(lock):
        return lock.connection.execute("SELECT pg_try_advisory_xact_lock(41, 1)").fetchone()[0]

    @task.advisory_lock(postgres_conn_id=CONN, key="every/tenant", tenant_arg="tenant")
    def per_tenant(tenant):
        return tenant

    @task.branch
    @advisory_lock(postgres_conn_id=CONN, key="every/branch")
    def choose():
        return "chosen"

    @task
    def chosen():
        return "chosen"

    @task
    def not_chosen():
        raise AssertionError("not chosen")

    @task
    def hook_in_a_task():
        held = AdvisoryLockHook(CONN).acquire("every/hook", application_name="pglock-tests hook task")
        assert held is not None
        held.release()

    bash = guarded(BashOperator(task_id="guarded_bash", bash_command="echo guarded"), key="every/bash",
                   postgres_conn_id=CONN)
    poke = AdvisoryLockSensor(task_id="sensor_poke", key="every/free", postgres_conn_id=CONN, poke_interval=0.2,
                              timeout=60)
    deferred = AdvisoryLockSensor(task_id="sensor_deferrable", key="every/free", postgres_conn_id=CONN,
                                  deferrable=True, poke_interval=0.2, timeout=60)

    chain(session_lock(), transaction_lock(), bash, poke, deferred, hook_in_a_task())
    skipped_when_busy()
    per_tenant.expand(tenant=["a", "b"])
    choose() >> [chosen(), not_chosen()]


every_entry_point_dag = every_entry_point()
"""


@pytest.mark.matrix("every-entry-point")
def test_a_dag_using_every_entry_point_parses_and_runs(airflow_db: Any, dsn: str, admin: Any) -> None:
    from tests.sdk import DagBag

    path = write_dag(EVERY_ENTRY_POINT_DAG, "every_entry_point")
    bag = DagBag(dag_folder=str(path))
    assert bag.import_errors == {}
    assert bag.dag_ids == ["every_entry_point"]

    held = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=600)).acquire("every/busy", application_name="other")
    assert held is not None
    try:
        result = run_dag(EVERY_ENTRY_POINT_DAG, "every_entry_point")
    finally:
        held.release()

    assert result.states == {
        ("session_lock", -1): "success",
        ("skipped_when_busy", -1): "skipped",
        ("transaction_lock", -1): "success",
        ("per_tenant", 0): "success",
        ("per_tenant", 1): "success",
        ("choose", -1): "success",
        ("chosen", -1): "success",
        ("not_chosen", -1): "skipped",
        ("hook_in_a_task", -1): "success",
        ("guarded_bash", -1): "success",
        ("sensor_poke", -1): "success",
        ("sensor_deferrable", -1): "success",
    }
    assert advisory_locks(admin) == []
