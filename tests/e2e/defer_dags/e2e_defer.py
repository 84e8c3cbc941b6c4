"""A deployment's tasks that wait for keys another process holds (tests/e2e/test_defer_triggerer.py).

``after_holder`` (``on_busy="defer"``) and ``sensor`` (deferrable AdvisoryLockSensor) wait
in the real triggerer for ``e2e/defer``; ``deadline`` waits for ``e2e/held``, which stays
held, and ends as a skip. Each run of ``after_holder`` inserts a row: exactly one may exist.
"""

from __future__ import annotations

import os

import pendulum
import psycopg
from airflow.sdk import dag, task

from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

LOCK_DSN = os.environ.get("PGLOCK_E2E_DSN", "")


@dag(dag_id="e2e_defer", schedule="@once", start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def e2e_defer() -> None:
    @task.advisory_lock(key="e2e/defer", on_busy="defer", wait_timeout=600)
    def after_holder() -> None:
        with psycopg.connect(LOCK_DSN, autocommit=True) as conn:
            conn.execute("INSERT INTO e2e_defer_runs (task_id) VALUES ('after_holder')")

    @task.advisory_lock(key="e2e/held", on_busy="defer", wait_timeout=20)
    def deadline() -> None:
        raise RuntimeError("e2e/held is held for the whole test: this never runs")

    after_holder()
    deadline()
    AdvisoryLockSensor(task_id="sensor", key="e2e/defer", deferrable=True, poke_interval=5, timeout=600)


e2e_defer_dag = e2e_defer()
