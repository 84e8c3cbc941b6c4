"""DAGs that two real Airflow deployments schedule at the same time (tests/e2e).

Both deployments read this file, run the same catch-up periods and share only the lock
database (connection ``postgres_default``). Every task first *meets* the other deployment
(a row per deployment in ``e2e_meet``, then waits for both), so the guarded tasks really
overlap. The guarded functions record what they did in the lock database:

- ``e2e_report``: one key per period (``e2e/report/<ds>``), work long enough that the
  other deployment always arrives while the lock is held, so it must skip (busy). Each
  run inserts a row into ``e2e_reports`` (no constraint: a double run would show).
- ``e2e_tenants``: 50 mapped tenants, one key per tenant. The lock prevents *concurrent*
  runs only; "exactly once" needs a record of completion too: ``once_per="{{ ds }}"``
  records the completed (key, period) in ``pglock.completions`` under the lock, and a
  later holder of the same tenant and period skips. Each run also inserts its row into
  ``e2e_tenants_done`` (primary key (period, tenant): a second run would fail).
"""

from __future__ import annotations

import os
import time

import pendulum
import psycopg
from airflow.sdk import dag, task

LOCK_DSN = os.environ.get("PGLOCK_E2E_DSN", "")
DEPLOYMENT = os.environ.get("PGLOCK_E2E_DEPLOYMENT", "?")
DEPLOYMENTS = int(os.environ.get("PGLOCK_E2E_DEPLOYMENTS", "2"))
REPORT_SECONDS = float(os.environ.get("PGLOCK_E2E_REPORT_SECONDS", "15"))
TENANT_SECONDS = float(os.environ.get("PGLOCK_E2E_TENANT_SECONDS", "1.5"))
TENANTS = 50
MEET_TIMEOUT = 180.0


def meet(dag_id: str, period: str) -> None:
    """Wait until every deployment reached this DAG's period (so the locks really compete)."""
    with psycopg.connect(LOCK_DSN, autocommit=True, application_name=f"e2e meet {DEPLOYMENT}") as conn:
        conn.execute(
            "INSERT INTO e2e_meet (dag_id, period, deployment) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
            [dag_id, period, DEPLOYMENT],
        )
        deadline = time.monotonic() + MEET_TIMEOUT
        while time.monotonic() < deadline:
            row = conn.execute("SELECT count(*) FROM e2e_meet WHERE dag_id = %s AND period = %s", [dag_id, period])
            if row.fetchone() == (DEPLOYMENTS,):
                return
            time.sleep(0.2)
    raise RuntimeError(f"deployment {DEPLOYMENT}: the other deployments never reached {dag_id} {period}")


@dag(
    dag_id="e2e_report",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 1, 3, tz="UTC"),
    catchup=True,
    max_active_runs=3,
)
def e2e_report() -> None:
    @task
    def rendezvous(ds: str | None = None) -> None:
        meet("e2e_report", str(ds))

    @task.advisory_lock(key="e2e/report/{{ ds }}")
    def report(ds: str | None = None) -> str:
        with psycopg.connect(LOCK_DSN, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO e2e_reports (period, deployment) VALUES (%s, %s)",
                [ds, DEPLOYMENT],
            )
        time.sleep(REPORT_SECONDS)
        return f"report {ds} by {DEPLOYMENT}"

    rendezvous() >> report()


@dag(
    dag_id="e2e_tenants",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,
)
def e2e_tenants() -> None:
    @task
    def rendezvous(ds: str | None = None) -> None:
        meet("e2e_tenants", str(ds))

    @task.advisory_lock(tenant_arg="tenant_id", once_per="{{ ds }}")
    def process(tenant_id: int, ds: str | None = None) -> str:
        with psycopg.connect(LOCK_DSN, autocommit=True) as conn:  # a second run would violate the primary key
            conn.execute(
                "INSERT INTO e2e_tenants_done (period, tenant, deployment) VALUES (%s, %s, %s)",
                [ds, tenant_id, DEPLOYMENT],
            )
        time.sleep(TENANT_SECONDS)
        return f"tenant {tenant_id} {ds} by {DEPLOYMENT}"

    rendezvous() >> process.expand(tenant_id=list(range(TENANTS)))


e2e_report_dag = e2e_report()
e2e_tenants_dag = e2e_tenants()
