"""Resume latency of Airflow's own deferrable sensor (benchmarks/triggerer.py): the baseline of ``bench_resume``.

Each run waits in ``DateTimeSensorAsync`` (Airflow's standard provider; its trigger is
``DateTimeTrigger``) for the moment ``conf["target"]``, which the benchmark sets a few seconds
ahead so that the sensor defers first. When the trigger fires, the sensor resumes on a worker
(``execute_complete``, which records when it started), then the downstream task records when
its function started. ``conf["index"]`` numbers the sample.
"""

from __future__ import annotations

import os
from typing import Any

import pendulum
import psycopg
from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import dag, task

# A Celery worker reaches the lock database at an address of its own (tests/celery/deployment.py).
LOCK_DSN = os.environ.get("PGLOCK_CELERY_LOCK_DSN") or os.environ.get("PGLOCK_BENCH_DSN", "")


def _record(dag_id: str, index: int) -> None:
    with psycopg.connect(LOCK_DSN, autocommit=True) as conn:
        conn.execute("INSERT INTO bench_started (dag_id, map_index) VALUES (%s, %s)", [dag_id, index])


class TimedDateTimeSensorAsync(DateTimeSensorAsync):
    """Records when it is about to defer, and when its resumed method starts (the moment a resumed task's own
    code runs)."""

    def execute(self, context: Any) -> Any:
        _record("bench_resume_airflow_deferring", int(context["dag_run"].conf["index"]))
        return super().execute(context)

    def execute_complete(self, context: Any, event: Any = None) -> None:
        _record("bench_resume_airflow", int(context["dag_run"].conf["index"]))
        return super().execute_complete(context, event)


@dag(dag_id="bench_resume_airflow", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def bench_resume_airflow() -> None:
    @task
    def downstream(**context: Any) -> None:
        _record("bench_resume_airflow_downstream", int(context["dag_run"].conf["index"]))

    TimedDateTimeSensorAsync(task_id="wait", target_time="{{ dag_run.conf['target'] }}") >> downstream()


bench_resume_airflow_dag = bench_resume_airflow()
