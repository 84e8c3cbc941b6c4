"""Many deferred tasks at once in one real triggerer (tests/e2e/test_defer_triggerer.py).

``wait`` is mapped ``PGLOCK_E2E_WAITERS`` ways (the test sets it: 200 in CI, 48 by default), each
on its own key ``e2e/many/<i>``, which the test holds before it triggers the run: every
mapped task defers, all their triggers wait in one triggerer, then the test releases the
keys. Each run of a mapped task inserts a row: exactly one per index may exist. ``defer_after=0``:
each defers at once (no wait on the worker first).
"""

from __future__ import annotations

import os

import pendulum
import psycopg
from airflow.sdk import dag, task

LOCK_DSN = os.environ.get("PGLOCK_E2E_DSN", "")
WAITERS = int(os.environ.get("PGLOCK_E2E_WAITERS", "48"))


@dag(dag_id="e2e_defer_many", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def e2e_defer_many() -> None:
    @task.advisory_lock(key="e2e/many", tenant_arg="index", on_busy="defer", wait_timeout=900, defer_after=0)
    def wait(index: int) -> None:
        with psycopg.connect(LOCK_DSN, autocommit=True) as conn:
            conn.execute("INSERT INTO e2e_defer_runs (task_id) VALUES (%s)", [f"many/{index}"])

    wait.expand(index=list(range(WAITERS)))


e2e_defer_many_dag = e2e_defer_many()
