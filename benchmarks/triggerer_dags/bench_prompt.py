"""Prompt wake-ups (benchmarks/prompt_resumes.py): ``PGLOCK_BENCH_PROMPTS`` mapped tasks defer on keys the
benchmark holds, and each key is released as soon as its task is deferred.

That is the case apache/airflow#72716 is about: a trigger that fires a moment after its task deferred. The
provider's trigger then holds its event until the deferral is ``RESUME_HOLD_SECONDS`` old; each resumed task
records when its function started.
"""

from __future__ import annotations

import os

import pendulum
import psycopg
from airflow.sdk import dag, task

# A Celery worker reaches the lock database at an address of its own (tests/celery/deployment.py).
LOCK_DSN = os.environ.get("PGLOCK_CELERY_LOCK_DSN") or os.environ.get("PGLOCK_BENCH_DSN", "")
SAMPLES = int(os.environ.get("PGLOCK_BENCH_PROMPTS", "10"))


@dag(dag_id="bench_prompt", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def bench_prompt() -> None:
    @task.advisory_lock(key="bench/prompt", tenant_arg="index", on_busy="defer", wait_timeout=1800, defer_after=0)
    def prompt(index: int) -> None:
        with psycopg.connect(LOCK_DSN, autocommit=True) as conn:
            conn.execute("INSERT INTO bench_started (dag_id, map_index) VALUES ('bench_prompt', %s)", [index])

    prompt.expand(index=list(range(SAMPLES)))


bench_prompt_dag = bench_prompt()
