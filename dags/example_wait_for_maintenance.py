"""Loads wait for warehouse maintenance instead of skipping; maintenance never runs under a load.

Two DAGs share one key, ``warehouse-maintenance``:

* ``warehouse_maintenance`` runs a maintenance script (a BashOperator) holding the key
  *exclusively*. If a load is running, maintenance is skipped: it will run next night.
* ``warehouse_load`` must not be skipped by maintenance: its sensor *waits* (deferred,
  holding no worker slot) until no maintenance holds the key, then the load runs holding
  the key *shared*, so that several loads may run together but maintenance cannot start
  under them. The sensor only reads ``pg_locks``: waiting never blocks maintenance.

The sensor alone would leave a gap (maintenance could start between "free" and the
load); the shared guard closes it. Run them as they are::

    airflow dags test warehouse_maintenance
    airflow dags test warehouse_load

The lock database is the Airflow connection ``postgres_default`` (any PostgreSQL 12+).
"""

from __future__ import annotations

import datetime as dt

import pendulum

try:
    from airflow.providers.standard.operators.bash import BashOperator
    from airflow.sdk import dag
except ImportError:  # Airflow 2.x
    from airflow.decorators import dag
    from airflow.operators.bash import BashOperator

from airflow_pglock.operators.advisory_lock import guarded
from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

MAINTENANCE_KEY = "warehouse-maintenance"


@dag(
    dag_id="warehouse_maintenance",
    schedule="0 2 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={"work_seconds": 3},
    tags=["pglock", "example"],
)
def warehouse_maintenance() -> None:
    # Exclusive: skipped (not failed) while any load holds the key shared.
    guarded(
        BashOperator(
            task_id="vacuum_and_reindex",
            bash_command="echo 'maintenance started'; sleep {{ params.work_seconds }}; echo 'maintenance done'",
        ),
        key=MAINTENANCE_KEY,
    )


@dag(
    dag_id="warehouse_load",
    schedule="@hourly",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={"work_seconds": 1},
    tags=["pglock", "example"],
)
def warehouse_load() -> None:
    wait = AdvisoryLockSensor(
        task_id="wait_for_maintenance",
        key=MAINTENANCE_KEY,
        shared=True,  # other loads (shared holders) do not make us wait; maintenance does
        deferrable=True,  # wait in the triggerer; mode="reschedule" works without one
        poke_interval=30,
        timeout=dt.timedelta(hours=2),
        soft_fail=True,  # still under maintenance after 2 h: skip this hour's load, do not fail
    )
    load = guarded(
        BashOperator(
            task_id="load_orders",
            bash_command="echo 'loading orders for {{ ds }}'; sleep {{ params.work_seconds }}",
        ),
        key=MAINTENANCE_KEY,
        shared=True,
        # Maintenance may grab the key between the sensor's "free" and this task's start:
        # then wait for it (bounded) rather than skip the load.
        on_busy="wait",
        wait_timeout=dt.timedelta(hours=2),
    )
    wait >> load


warehouse_maintenance_dag = warehouse_maintenance()
warehouse_load_dag = warehouse_load()
