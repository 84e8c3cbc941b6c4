"""DAGs the Celery suite triggers (tests/celery): one guarded task per DAG, routed to one worker.

``celery_<flavour>_<worker>``: the task runs on queue ``<worker>`` (each worker consumes only
its own queue), guards the key given in the run's conf (``key``) with a 6 s lease, and
- ``skip`` flavour: skips when the key is busy (the default);
- ``wait`` flavour: waits for the key (up to 60 s) and retries once after a failure.

The guarded work writes its side effects where the test reads them:
- rows ``start`` and ``end`` in ``celery_effects`` in the lock database (from the worker,
  over its network link);
- a line per 0.2 s step in ``<PGLOCK_CELERY_JOURNAL>/<key>.journal`` (``/`` in the key as ``-``) (a shared file system,
  unaffected by a network cut: what the work did while it was cut off shows there);
and runs until ``seconds`` (a retry: ``retry_seconds``) have passed or the file ``<key>.release`` appears.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path
from typing import Any

import pendulum
import psycopg
from airflow.sdk import dag, task

LEASE = 6.0
WORKERS = ("w1", "w2")
JOURNAL = Path(os.environ.get("PGLOCK_CELERY_JOURNAL", "/tmp"))
WORKER = os.environ.get("PGLOCK_CELERY_WORKER", "host")


def record(event: str, key: str, ti: Any) -> None:
    dsn = os.environ["PGLOCK_CELERY_LOCK_DSN"]
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5, application_name=f"effects {WORKER}") as conn:
        conn.execute(
            "INSERT INTO celery_effects (key, dag_id, run_id, try_number, worker, event)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            [key, ti.dag_id, ti.run_id, ti.try_number, WORKER, event],
        )


def work(key: str, seconds: float, ti: Any) -> None:
    record("start", key, ti)
    journal = JOURNAL / f"{key.replace('/', '-')}.journal"
    release = JOURNAL / f"{key.replace('/', '-')}.release"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not release.exists():
        with open(journal, "a") as out:
            out.write(f"{time.time():.6f} {ti.dag_id} {ti.try_number}\n")
        time.sleep(0.2)
    record("end", key, ti)


def guarded_dag(flavour: str, worker: str) -> Any:
    waits = flavour == "wait"

    @dag(
        dag_id=f"celery_{flavour}_{worker}",
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        params={"key": "celery/unset", "seconds": 5.0, "retry_seconds": 2.0},
        default_args={"queue": worker},
    )
    def the_dag() -> None:
        @task.advisory_lock(
            key="{{ params.key }}",
            lease=LEASE,
            on_busy="wait" if waits else "skip",
            wait_timeout=60 if waits else None,
            retries=1 if waits else 0,
            retry_delay=dt.timedelta(seconds=1),
        )
        def guarded(params: dict[str, Any] | None = None, ti: Any = None) -> None:
            assert params is not None
            seconds = params["seconds"] if ti.try_number <= 1 else params["retry_seconds"]
            work(str(params["key"]), float(seconds), ti)

        guarded()

    return the_dag()


for _flavour in ("skip", "wait"):
    for _worker in WORKERS:
        globals()[f"celery_{_flavour}_{_worker}"] = guarded_dag(_flavour, _worker)
