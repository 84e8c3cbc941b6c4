"""Refresh weather forecasts from a rate-limited upstream API, once at a time across deployments.

One global key: whichever deployment (or overlapping DAG run) gets it refreshes; every other
attempt is skipped and its log says who holds the key. Run it as is:

    airflow dags test forecast_refresh

The lock database is the Airflow connection ``postgres_default`` (PostgreSQL 14+).
"""

from __future__ import annotations

import time

import pendulum

try:
    from airflow.sdk import dag, task
except ImportError:  # Airflow 2.x
    from airflow.decorators import dag, task


@dag(
    dag_id="forecast_refresh",
    schedule="@hourly",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={"work_seconds": 3},
    tags=["pglock", "example"],
)
def forecast_refresh() -> None:
    @task.advisory_lock(key="refresh-forecasts")
    def refresh_forecasts(params: dict | None = None) -> dict[str, int]:
        # Stand-in for the upstream calls: hold the lock for a while, as a real refresh would.
        seconds = int((params or {}).get("work_seconds", 3))
        time.sleep(seconds)
        return {"stations_refreshed": 120, "seconds": seconds}

    @task(trigger_rule="none_failed")
    def publish(result: dict[str, int] | None = None) -> str:
        # Runs after a refresh *or* after a skip (another deployment refreshed): see docs/concepts.md.
        return "published fresh forecasts" if result else "nothing new: another run refreshed"

    publish(refresh_forecasts())


forecast_refresh_dag = forecast_refresh()
