"""The DAG two deployments on different Airflow lines (blue/green) run at once (tests/e2e/test_blue_green.py).

The same file is parsed by both lines; only the environment differs: ``PGLOCK_BG_ROLE``
(``old`` or ``new``), the lock database (``PGLOCK_BG_DSN``, also ``postgres_default``) and
the other deployment's metadata database (``PGLOCK_BG_PEER_METADATA``). It imports only
what Airflow 2.11 and 3.x both have.

- Contenders: a named key, a tenant of each accepted type (str, int, uuid.UUID, an
  ``IntEnum`` and a ``(str, Enum)`` member, which render by value on every Python), an
  explicit int64, an (int32, int32) pair, and two tasks per line sharing a pool of 2
  slots. A winner records its lock session's pid in ``bg_runs`` and keeps the lock until
  the other line's task of the same id has finished (event-bound, not timed: whenever
  the other line gets there, the key is busy), so the other line skips.
- ``once_old_first`` / ``once_new_first``: ``once_per="{{ ds }}"``; one line completes it
  first, the other runs it after its ``gate`` (which waits, holding nothing, until the
  other line's task finished) and must skip: already done for the period.
- ``fence_first`` / ``fence_second``: ``fencing=True`` on one key, taken by old, new, old
  (the gates order them); each writes its token into ``bg_register``, whose trigger
  refuses any token older than the newest issued for the key.
- ``hold``: a key per line, held until the test writes ``bg_release`` (the test runs
  ``airflow-pglock locks`` from both lines while both hold).
"""

from __future__ import annotations

import enum
import os
import time
import uuid
from typing import Any

import pendulum
import psycopg

try:
    from airflow.sdk import dag, task
except ImportError:  # Airflow 2.x
    from airflow.decorators import dag, task

LOCK_DSN = os.environ.get("PGLOCK_BG_DSN", "")
PEER_METADATA = os.environ.get("PGLOCK_BG_PEER_METADATA", "")
OWN_METADATA = os.environ.get("PGLOCK_BG_OWN_METADATA", "")
ROLE = os.environ.get("PGLOCK_BG_ROLE", "old")
WAIT_TIMEOUT = float(os.environ.get("PGLOCK_BG_WAIT_TIMEOUT", "600"))
DAG_ID = "bluegreen"


class Tenant(enum.IntEnum):  # str() differs between Python 3.10 and 3.11+: the key must not
    ACME = 4343


class Shop(str, enum.Enum):  # str() is the member's name: the key must use its value
    ACME = "acme-shop"


TENANTS: dict[str, Any] = {
    "str": "acme-corp",
    "int": 4242,
    "uuid": uuid.UUID("7d4e3f0a-9b1c-4d2e-8f6a-5b4c3d2e1f0a"),
    "intenum": Tenant.ACME,
    "strenum": Shop.ACME,
}
INT64_KEY = 7_340_012_345_678_901_234
PAIR_KEY = (73400, -12345)
POOL_KEY = "bluegreen/pool"
POOL_TASKS = ("pool_0", "pool_1")
PEER = "new" if ROLE == "old" else "old"
#: What each line goes first with (no wait), and what it runs after its gate (the other line went first).
LEADS = {"old": ("once_old_first", "fence_first"), "new": ("once_new_first",)}
FOLLOWS = {"old": ("once_new_first", "fence_second"), "new": ("once_old_first", "fence_first")}
#: The other line's tasks each line's gate waits for: fencing order old, new, old on one key.
GATE_WAITS = {"old": ("once_new_first", "fence_first"), "new": ("once_old_first", "fence_first")}


def _lock_db() -> psycopg.Connection[Any]:
    return psycopg.connect(LOCK_DSN, autocommit=True, application_name=f"bluegreen {ROLE}")


def _wait(what: str, done: Any) -> None:
    deadline = time.monotonic() + WAIT_TIMEOUT
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"line {ROLE}: gave up waiting for {what} after {WAIT_TIMEOUT:g} s")
        time.sleep(0.3)


def _record_run(job: str, ds: str, pid: int, token: int | None = None) -> None:
    with _lock_db() as conn:
        conn.execute(
            "INSERT INTO bg_runs (job, period, line, pid, token) VALUES (%s, %s, %s, %s, %s)",
            [job, ds, ROLE, pid, token],
        )


def _peer_finished(task_ids: tuple[str, ...], count: int) -> Any:
    """True once ``count`` of the other line's task instances of these ids have finished."""

    def check() -> bool:
        with psycopg.connect(PEER_METADATA, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM task_instance WHERE dag_id = %s AND task_id = ANY(%s)"
                " AND state IN ('success', 'skipped', 'failed', 'upstream_failed')",
                [DAG_ID, list(task_ids)],
            ).fetchone()
        return row is not None and row[0] >= count

    return check


def _pool_skips(metadata_uri: str) -> int:
    """How many of a line's pool tasks found the pool full (read from that line's metadata database)."""
    with psycopg.connect(metadata_uri, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM task_instance WHERE dag_id = %s AND task_id = ANY(%s) AND state = 'skipped'",
            [DAG_ID, list(POOL_TASKS)],
        ).fetchone()
    return 0 if row is None else int(row[0])


def _hold_until_peer(job: str, ds: str, lock: Any, task_ids: tuple[str, ...], count: int = 1) -> str:
    _record_run(job, ds, lock.backend_pid)
    _wait(f"the other line's {', '.join(task_ids)}", _peer_finished(task_ids, count))
    return f"{job} {ds} by {ROLE}"


@dag(
    dag_id=DAG_ID,
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,
)
def bluegreen() -> None:
    @task.advisory_lock(task_id="named", key="bluegreen/named/{{ ds }}")
    def named(ds: str | None = None, lock: Any = None) -> str:
        return _hold_until_peer("named", str(ds), lock, ("named",))

    @task.advisory_lock(task_id="int64", key=INT64_KEY)
    def int64(ds: str | None = None, lock: Any = None) -> str:
        return _hold_until_peer("int64", str(ds), lock, ("int64",))

    @task.advisory_lock(task_id="pair", key=PAIR_KEY)
    def pair(ds: str | None = None, lock: Any = None) -> str:
        return _hold_until_peer("pair", str(ds), lock, ("pair",))

    named(), int64(), pair()
    for kind, tenant in TENANTS.items():

        @task.advisory_lock(task_id=f"tenant_{kind}", key="bluegreen/tenants/{{ ds }}", tenant=tenant)
        def tenant_job(ds: str | None = None, lock: Any = None, kind: str = kind) -> str:
            return _hold_until_peer(f"tenant_{kind}", str(ds), lock, (f"tenant_{kind}",))

        tenant_job()
    for pool_task in POOL_TASKS:

        @task.advisory_lock(task_id=pool_task, key=POOL_KEY, slots=2)
        def pool_job(ds: str | None = None, lock: Any = None, job: str = pool_task) -> str:
            # 4 contenders (2 per line), 2 slots: hold until the 2 that found the pool full are done
            _record_run(job, str(ds), lock.backend_pid)

            def two_skipped() -> bool:
                return _pool_skips(PEER_METADATA) + _pool_skips(OWN_METADATA) >= 2

            _wait("the two pool tasks that found the pool full", two_skipped)
            return f"{job} {ds} by {ROLE}"

        pool_job()

    def once_job(job: str) -> Any:
        @task.advisory_lock(task_id=job, key=f"bluegreen/{job}", once_per="{{ ds }}")
        def once(ds: str | None = None, lock: Any = None) -> str:
            _record_run(job, str(ds), lock.backend_pid)
            return f"{job} {ds} by {ROLE}"

        return once()

    def fence_job(job: str) -> Any:
        @task.advisory_lock(task_id=job, key="bluegreen/fence", fencing=True)
        def fence(ds: str | None = None, lock: Any = None) -> int:
            token = lock.fencing_token
            with _lock_db() as conn:  # the register's trigger refuses a token older than the newest issued
                conn.execute("UPDATE bg_register SET fencing_token = %s, line = %s", [token, ROLE])
            _record_run(job, str(ds), lock.backend_pid, token)
            return int(token)

        return fence()

    @task
    def gate(ds: str | None = None) -> None:
        """Wait (holding no lock) until the other line did what it goes first with."""

        # finished on the other line, so its lock is released (a row written under the lock is too early)
        _wait(
            f"the {PEER} line's {', '.join(GATE_WAITS[ROLE])}", _peer_finished(GATE_WAITS[ROLE], len(GATE_WAITS[ROLE]))
        )

    # once_per: each line completes one job first, the other must then skip it. Fencing: one key
    # taken by old, new, old (fence_first, fence_first, fence_second), each after the gate.
    waited = gate()
    for job in LEADS[ROLE]:
        once_job(job) if job.startswith("once") else fence_job(job)
    for job in FOLLOWS[ROLE]:
        waited >> (once_job(job) if job.startswith("once") else fence_job(job))

    @task.advisory_lock(task_id="hold", key=f"bluegreen/hold/{ROLE}")
    def hold(ds: str | None = None, lock: Any = None) -> None:
        _record_run("hold", str(ds), lock.backend_pid)

        def released() -> bool:
            with _lock_db() as conn:
                return conn.execute("SELECT count(*) FROM bg_release").fetchone() == (1,)

        _wait("the test's release after `airflow-pglock locks`", released)

    hold()


bluegreen_dag = bluegreen()
