"""DAGs with a lock scope that two real Airflow deployments schedule at once (tests/e2e).

Both deployments read this file and share only the lock database (connection
``postgres_default``). Every task of a scope records its span (deployment, task, database
clock at its start and at its end) in ``e2e_scope_spans``, so the test can check from the
lock database alone whether the two deployments' scopes ever interleaved.

- ``e2e_scope_ingest``: the openverse pattern. ``rendezvous`` meets the other deployment,
  then ``start >> wait >> promote`` run in one scope on ``openverse/ingest``
  (``on_busy="skip"``): one deployment's group runs entirely, the other's is skipped (or
  runs entirely after it).
- ``e2e_scope_crash``: ``gate`` waits until the test lets this deployment go (a row in
  ``e2e_go``), then ``start >> wait >> promote`` in a scope on ``openverse/crash`` with a
  15 s scope lease and ``on_busy="wait"``; ``peek``, a plain guard of the same key, runs
  beside the scope. The test kills deployment A while its scope is held and then lets B go.

- ``e2e_scope_pool_1`` and ``e2e_scope_pool_2`` (in both deployments: four runs): ``gate``, then
  ``start >> wait >> promote`` in a scope over a pool of two slots on ``openverse/pool``
  (``on_busy="skip"``); each task records its span under ``<task>@slot<N>``, the slot its setup
  took (XCom), after checking that the slot's scope row names it. At most two scopes at once,
  each in its own slot.

Deployment A alone (``PGLOCK_E2E_DEPLOYMENT``) has these four:

- ``e2e_scope_retry``: ``first >> flaky >> last`` in a scope on ``e2e/retried`` with
  ``fencing=True``; ``flaky`` fails its first try (``retries=1``). Every try of every task of
  the scope records the scope row it runs in (holder, token, task now, read from
  ``pglock.scopes`` by key name) and the setup's XCom in ``e2e_scope_holders``. The test then
  clears ``flaky`` with ``airflow tasks clear``.
- ``e2e_scope_hold``: a scope on ``e2e/deferred`` whose tasks ``hold`` and ``last`` have
  ``pause`` (outside the scope, 20 s) between them: the row alone keeps the scope meanwhile.
  ``last`` fails: the teardown frees the scope after a failed task.

- ``e2e_scope_midclear``: ``flaky >> last`` in a scope on ``e2e/midclear`` with ``fencing=True``
  and ``on_busy="skip"``; ``flaky`` fails its first try and waits ten minutes for its retry
  (``up_for_retry``, the scope live): the test clears it meanwhile, which runs the setup again
  while the run's scope is still held by its row.

- ``e2e_scope_timeout`` (unscheduled: the test triggers it): a scope on ``e2e/timeout`` with a
  ten-minute ``scope_lease`` in a DAG whose ``dagrun_timeout`` is 40 s; its first task ``long``
  sleeps past it, so the scheduler times the run out while the scope is held.

Deployment B alone has ``e2e_scope_defer``: a scope on ``e2e/deferred`` with
``on_busy="defer"`` (``defer_after=0``) around ``after``; the test lets it go while A's
``pause`` runs, so its setup defers to B's triggerer behind A's scope.
"""

from __future__ import annotations

import datetime as dt
import os
import time

import pendulum
import psycopg
from airflow.sdk import dag, get_current_context, task

from airflow_pglock.operators.scope import advisory_lock_scope

LOCK_DSN = os.environ.get("PGLOCK_E2E_DSN", "")
DEPLOYMENT = os.environ.get("PGLOCK_E2E_DEPLOYMENT", "?")
DEPLOYMENTS = int(os.environ.get("PGLOCK_E2E_DEPLOYMENTS", "2"))
CONN = "postgres_default"
WAIT_SECONDS = float(os.environ.get("PGLOCK_E2E_SCOPE_WAIT_SECONDS", "6"))
CRASH_SCOPE_LEASE = 15
TIMEOUT_RUN_SECONDS = 40  # dagrun_timeout of e2e_scope_timeout (room for a slow setup and start)
TIMEOUT_SCOPE_LEASE = 600  # its scope_lease
MEET_TIMEOUT = 180.0
GATE_TIMEOUT = 400.0


def span(dag_id: str, task_id: str, seconds: float = 0.0) -> None:
    """Work ``seconds`` and record the span (database clock) of this task in ``e2e_scope_spans``."""
    with psycopg.connect(LOCK_DSN, autocommit=True, application_name=f"e2e span {DEPLOYMENT}") as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        time.sleep(seconds)
        conn.execute(
            "INSERT INTO e2e_scope_spans (dag_id, deployment, task_id, started, ended)"
            " VALUES (%s, %s, %s, %s, clock_timestamp())",
            [dag_id, DEPLOYMENT, task_id, row[0]],
        )


def record_scope(dag_id: str, key: str, group: str) -> int:
    """Record the scope row this task runs in (read by key name) and its setup's XCom in ``e2e_scope_holders``.

    :returns: this task's try number."""
    ti = get_current_context()["ti"]
    entered = ti.xcom_pull(task_ids=f"{group}.pglock_scope_enter")
    entered = entered if isinstance(entered, dict) else {}
    with psycopg.connect(LOCK_DSN, autocommit=True, application_name=f"e2e record {DEPLOYMENT}") as conn:
        conn.execute(
            "INSERT INTO e2e_scope_holders (dag_id, deployment, task_id, try_number, holder, token, task_now, run,"
            " xcom_holder, xcom_token)"
            " SELECT %(dag_id)s, %(deployment)s, %(task_id)s, %(try_number)s, s.holder, s.token, s.task_now, s.run,"
            " %(xcom_holder)s, %(xcom_token)s"
            " FROM (VALUES (1)) AS one LEFT JOIN pglock.scopes AS s ON s.key_name = %(key)s",
            {
                "dag_id": dag_id,
                "deployment": DEPLOYMENT,
                "task_id": ti.task_id,
                "try_number": ti.try_number,
                "xcom_holder": entered.get("holder"),
                "xcom_token": entered.get("token"),
                "key": key,
            },
        )
    return int(ti.try_number)


def meet(dag_id: str) -> None:
    """Wait until every deployment reached this DAG (so the scopes really compete)."""
    with psycopg.connect(LOCK_DSN, autocommit=True, application_name=f"e2e meet {DEPLOYMENT}") as conn:
        conn.execute(
            "INSERT INTO e2e_scope_meet (dag_id, deployment) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            [dag_id, DEPLOYMENT],
        )
        deadline = time.monotonic() + MEET_TIMEOUT
        while time.monotonic() < deadline:
            row = conn.execute("SELECT count(*) FROM e2e_scope_meet WHERE dag_id = %s", [dag_id]).fetchone()
            if row == (DEPLOYMENTS,):
                return
            time.sleep(0.2)
    raise RuntimeError(f"deployment {DEPLOYMENT}: the other deployments never reached {dag_id}")


def gate(dag_id: str) -> None:
    """Wait until the test lets this deployment go (a row in ``e2e_go``)."""
    with psycopg.connect(LOCK_DSN, autocommit=True, application_name=f"e2e gate {DEPLOYMENT}") as conn:
        deadline = time.monotonic() + GATE_TIMEOUT
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM e2e_go WHERE dag_id = %s AND deployment = %s", [dag_id, DEPLOYMENT]
            ).fetchone()
            if row == (1,):
                return
            time.sleep(0.3)
    raise RuntimeError(f"deployment {DEPLOYMENT}: never let go for {dag_id}")


@dag(
    dag_id="e2e_scope_ingest",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,
)
def e2e_scope_ingest() -> None:
    @task
    def rendezvous() -> None:
        meet("e2e_scope_ingest")

    with advisory_lock_scope(
        "publish", key="openverse/ingest", postgres_conn_id=CONN, on_busy="skip", scope_lease=60
    ) as publish:

        @task
        def start() -> None:
            span("e2e_scope_ingest", "start")

        @task
        def wait() -> None:
            span("e2e_scope_ingest", "wait", WAIT_SECONDS)

        @task
        def promote() -> None:
            span("e2e_scope_ingest", "promote")

        start() >> wait() >> promote()

    rendezvous() >> publish


@dag(
    dag_id="e2e_scope_crash",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,
)
def e2e_scope_crash() -> None:
    @task
    def wait_for_go() -> None:
        gate("e2e_scope_crash")

    @task.advisory_lock(postgres_conn_id=CONN, key="openverse/crash", on_busy="skip")
    def peek() -> None:
        span("e2e_scope_crash", "peek")

    with advisory_lock_scope(
        "publish",
        key="openverse/crash",
        postgres_conn_id=CONN,
        on_busy="wait",
        wait_timeout=150,
        scope_lease=CRASH_SCOPE_LEASE,
    ) as publish:

        @task
        def start() -> None:
            span("e2e_scope_crash", "start")

        @task
        def wait() -> None:
            span("e2e_scope_crash", "wait", WAIT_SECONDS)

        @task
        def promote() -> None:
            span("e2e_scope_crash", "promote")

        start() >> wait() >> promote()

    go = wait_for_go()
    go >> publish
    go >> peek()


@dag(
    dag_id="e2e_scope_retry",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,
)
def e2e_scope_retry() -> None:
    @task
    def wait_for_go() -> None:
        gate("e2e_scope_retry")

    with advisory_lock_scope(
        "retried", key="e2e/retried", postgres_conn_id=CONN, on_busy="fail", fencing=True, scope_lease=120
    ) as retried:

        @task
        def first() -> None:
            record_scope("e2e_scope_retry", "e2e/retried", "retried")

        @task(retries=1, retry_delay=dt.timedelta(seconds=2))
        def flaky() -> None:
            if record_scope("e2e_scope_retry", "e2e/retried", "retried") == 1:
                raise RuntimeError("e2e: flaky fails its first try")

        @task
        def last() -> None:
            record_scope("e2e_scope_retry", "e2e/retried", "retried")

        first() >> flaky() >> last()

    wait_for_go() >> retried


@dag(
    dag_id="e2e_scope_midclear",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,
)
def e2e_scope_midclear() -> None:
    @task
    def wait_for_go() -> None:
        gate("e2e_scope_midclear")

    with advisory_lock_scope(
        "cleared", key="e2e/midclear", postgres_conn_id=CONN, on_busy="skip", fencing=True, scope_lease=300
    ) as cleared:

        @task(retries=1, retry_delay=dt.timedelta(minutes=10))
        def flaky() -> None:
            if record_scope("e2e_scope_midclear", "e2e/midclear", "cleared") == 1:
                raise RuntimeError("e2e: flaky fails its first try; its retry is ten minutes away")

        @task
        def last() -> None:
            record_scope("e2e_scope_midclear", "e2e/midclear", "cleared")

        flaky() >> last()

    wait_for_go() >> cleared


@dag(
    dag_id="e2e_scope_hold",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,
)
def e2e_scope_hold() -> None:
    @task
    def wait_for_go() -> None:
        gate("e2e_scope_hold")

    @task
    def pause() -> None:  # outside the scope: the key is free, the row keeps the scope
        time.sleep(20)

    with advisory_lock_scope(
        "held", key="e2e/deferred", postgres_conn_id=CONN, on_busy="fail", scope_lease=120
    ) as held:

        @task
        def hold() -> None:
            span("e2e_scope_hold", "hold", 3)

        @task
        def last() -> None:
            span("e2e_scope_hold", "last")
            raise RuntimeError("e2e: last fails; the teardown frees the scope all the same")

        before, after = hold(), last()

    before >> pause() >> after
    wait_for_go() >> held


@dag(
    dag_id="e2e_scope_timeout",
    schedule=None,  # the test triggers it: the timeout counts from the run's start
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    dagrun_timeout=dt.timedelta(seconds=TIMEOUT_RUN_SECONDS),
)
def e2e_scope_timeout() -> None:
    with advisory_lock_scope(
        "timed", key="e2e/timeout", postgres_conn_id=CONN, scope_lease=dt.timedelta(seconds=TIMEOUT_SCOPE_LEASE)
    ):

        @task
        def long() -> None:  # stopped when the scheduler times the run out
            span("e2e_scope_timeout", "long", 10 * TIMEOUT_RUN_SECONDS)

        @task
        def after() -> None:
            span("e2e_scope_timeout", "after")

        long() >> after()


@dag(
    dag_id="e2e_scope_defer",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,
)
def e2e_scope_defer() -> None:
    @task
    def wait_for_go() -> None:
        gate("e2e_scope_defer")

    with advisory_lock_scope(
        "deferred",
        key="e2e/deferred",
        postgres_conn_id=CONN,
        on_busy="defer",
        wait_timeout=180,
        defer_after=0,
        scope_lease=120,
    ) as deferred:

        @task
        def after() -> None:
            span("e2e_scope_defer", "after")

        after()

    wait_for_go() >> deferred


def pool_slot(dag_id: str) -> int:
    """The slot this run's pool scope took (its setup's XCom), checked against the slot's row."""
    ti = get_current_context()["ti"]
    entered = ti.xcom_pull(task_ids="pooled.pglock_scope_enter")
    slot = int(entered["slot"])
    name = "openverse/pool" if slot == 1 else f"openverse/pool#slot{slot}"
    with psycopg.connect(LOCK_DSN, autocommit=True, application_name=f"e2e pool {DEPLOYMENT}") as conn:
        row = conn.execute(
            "SELECT holder, task_now FROM pglock.scopes WHERE key_name = %s AND lease_until > clock_timestamp()", [name]
        ).fetchone()
    assert row == (entered["holder"], ti.task_id), f"{dag_id}: slot {slot}'s row is {row}, not this task's scope"
    return slot


def pool_scope_dag(dag_id: str):  # type: ignore[no-untyped-def]
    @dag(
        dag_id=dag_id,
        schedule="@daily",
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        end_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=True,
    )
    def e2e_scope_pool() -> None:
        @task
        def wait_for_go() -> None:
            gate(dag_id)

        with advisory_lock_scope(
            "pooled", key="openverse/pool", slots=2, postgres_conn_id=CONN, on_busy="skip", scope_lease=60
        ) as pooled:

            @task
            def start() -> None:
                span(dag_id, f"start@slot{pool_slot(dag_id)}")

            @task
            def wait() -> None:
                span(dag_id, f"wait@slot{pool_slot(dag_id)}", WAIT_SECONDS)

            @task
            def promote() -> None:
                span(dag_id, f"promote@slot{pool_slot(dag_id)}")

            start() >> wait() >> promote()

        wait_for_go() >> pooled

    return e2e_scope_pool()


e2e_scope_pool_1_dag = pool_scope_dag("e2e_scope_pool_1")
e2e_scope_pool_2_dag = pool_scope_dag("e2e_scope_pool_2")
e2e_scope_ingest_dag = e2e_scope_ingest()
e2e_scope_crash_dag = e2e_scope_crash()
# Only one deployment has each of these (the other would run it too, on the same key).
if DEPLOYMENT == "A":
    e2e_scope_retry_dag = e2e_scope_retry()
    e2e_scope_midclear_dag = e2e_scope_midclear()
    e2e_scope_hold_dag = e2e_scope_hold()
    e2e_scope_timeout_dag = e2e_scope_timeout()
if DEPLOYMENT == "B":
    e2e_scope_defer_dag = e2e_scope_defer()
