"""Many deferred tasks in one triggerer, airflow-pglock's trigger (benchmarks/triggerer.py).

``wait`` is mapped ``PGLOCK_BENCH_HERD`` ways, each deferred on a key the benchmark holds in
one plain session; the benchmark releases them all at once (seen at the next poll).
"""

from __future__ import annotations

import os

import pendulum
import psycopg
from airflow.sdk import dag, task

# A Celery worker reaches the lock database at an address of its own (tests/celery/deployment.py).
LOCK_DSN = os.environ.get("PGLOCK_CELERY_LOCK_DSN") or os.environ.get("PGLOCK_BENCH_DSN", "")
WAITERS = int(os.environ.get("PGLOCK_BENCH_HERD", "200"))


@dag(dag_id="bench_herd_pglock", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def bench_herd_pglock() -> None:
    @task.advisory_lock(key="bench/herd", tenant_arg="index", on_busy="defer", wait_timeout=1800, defer_after=0)
    def wait(index: int) -> None:
        with psycopg.connect(LOCK_DSN, autocommit=True) as conn:
            conn.execute("INSERT INTO bench_started (dag_id, map_index) VALUES ('bench_herd_pglock', %s)", [index])

    wait.expand(index=list(range(WAITERS)))


bench_herd_pglock_dag = bench_herd_pglock()
