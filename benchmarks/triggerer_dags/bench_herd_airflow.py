"""The same many deferred tasks with Airflow's own trigger (benchmarks/triggerer.py): the baseline.

``DateTimeSensorAsync`` (Airflow's standard provider; its trigger is ``DateTimeTrigger``) is
mapped ``PGLOCK_BENCH_HERD`` ways, every one waiting for the same moment, the run's
``conf["release_at"]``: they all defer, then all fire at once, as the pglock tasks do when
their keys are released together.
"""

from __future__ import annotations

import os

import pendulum
from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import dag, task

WAITERS = int(os.environ.get("PGLOCK_BENCH_HERD", "200"))


@dag(dag_id="bench_herd_airflow", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def bench_herd_airflow() -> None:
    @task
    def moments(**context: object) -> list[str]:
        return [context["dag_run"].conf["release_at"]] * WAITERS  # type: ignore[attr-defined]

    DateTimeSensorAsync.partial(task_id="wait").expand(target_time=moments())


bench_herd_airflow_dag = bench_herd_airflow()
