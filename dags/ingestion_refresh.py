"""Refresh a search index in three steps that must run as one: trigger, wait, promote (Airflow 3).

The openverse pattern (docs/scopes.md): the three tasks hold one lock scope on
``ingestion-server``, from the trigger to the promotion, gaps between the tasks included. A
second run (this DAG in another deployment, an overlapping run, or another DAG with the same
scope key) finds the scope held and its tasks are skipped; a plain ``@task.advisory_lock``
on the same key is skipped too. Needs ``airflow-pglock init-db`` (the scope's lease row). Run:

    airflow dags test ingestion_refresh

The lock database is the Airflow connection ``postgres_default``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pendulum

try:
    from airflow.sdk import dag, task
except ImportError:  # Airflow 2.x: lock scopes need Airflow 3 (advisory_lock_scope refuses 2.x)
    dag = None

if dag is not None:
    from airflow_pglock.operators.scope import advisory_lock_scope

    @dag(
        dag_id="ingestion_refresh",
        schedule="@daily",
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        params={"work_seconds": 3},
        tags=["pglock", "example"],
    )
    def ingestion_refresh() -> None:
        with advisory_lock_scope("refresh", key="ingestion-server", scope_lease=timedelta(minutes=10)):

            @task
            def trigger_refresh(params: dict | None = None) -> str:
                time.sleep(int((params or {}).get("work_seconds", 3)))  # stand-in: ask the server to rebuild
                return "index-2026"

            @task
            def wait_for_refresh(index: str, params: dict | None = None) -> str:
                time.sleep(int((params or {}).get("work_seconds", 3)))  # stand-in: poll until it is built
                return index

            @task
            def promote(index: str) -> str:
                return f"promoted {index}"

            promote(wait_for_refresh(trigger_refresh()))

    ingestion_refresh_dag = ingestion_refresh()
