"""Resume latency (benchmarks/triggerer.py): ``PGLOCK_BENCH_RESUMES`` mapped tasks defer on keys the benchmark holds.

The benchmark releases one key at a time; each resumed task records when its function started.
``defer_after=0``: each defers at once (the deferral's hand-over is what is measured, not the wait on the worker).
"""

from __future__ import annotations

import os

import pendulum
import psycopg
from airflow.sdk import dag, task

# A Celery worker reaches the lock database at an address of its own (tests/celery/deployment.py).
LOCK_DSN = os.environ.get("PGLOCK_CELERY_LOCK_DSN") or os.environ.get("PGLOCK_BENCH_DSN", "")
SAMPLES = int(os.environ.get("PGLOCK_BENCH_RESUMES", "10"))


@dag(dag_id="bench_resume", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def bench_resume() -> None:
    @task.advisory_lock(key="bench/resume", tenant_arg="index", on_busy="defer", wait_timeout=1800, defer_after=0)
    def resume(index: int) -> None:
        with psycopg.connect(LOCK_DSN, autocommit=True) as conn:
            conn.execute("INSERT INTO bench_started (dag_id, map_index) VALUES ('bench_resume', %s)", [index])

    resume.expand(index=list(range(SAMPLES)))


bench_resume_dag = bench_resume()
