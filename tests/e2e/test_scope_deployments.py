"""Lock scopes across two real Airflow 3 deployments that share one lock database.

Deployment A and B each have their own AIRFLOW_HOME and metadata database and run
``airflow api-server`` (execution API), ``airflow scheduler`` (LocalExecutor) and ``airflow
dag-processor`` (tests/e2e/deployment.py), as tests/e2e/test_real_scheduler.py does. Both
schedule tests/e2e/scope_dags/e2e_scope.py, whose scope tasks record their spans (database
clock) in the lock database:

- the openverse pattern: ``start >> wait >> promote`` in one scope on ``openverse/ingest``,
  run by both deployments at once: the scope tasks of one deployment never run between the
  first and last scope task of the other;
- a crash: deployment A is killed while its scope on ``openverse/crash`` is held; B's scope
  takes the key only once A's scope lease ran out.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_pglock.pg import schema
from devtools.pgcluster import Cluster, free_port
from tests.conftest import AIRFLOW_HOME
from tests.e2e.deployment import Deployment

pytestmark = [pytest.mark.slow, pytest.mark.airflow]

airflow_compat = pytest.importorskip("airflow_pglock.compat")
if not airflow_compat.AIRFLOW_V_3_PLUS:
    pytest.skip(
        "lock scopes need Airflow 3, and the deployments run Airflow 3 processes (api-server, dag-processor); "
        "tests/airflow/test_scope.py covers the refusal on 2.x",
        allow_module_level=True,
    )

DAGS = Path(__file__).parent / "scope_dags"
INGEST = "e2e_scope_ingest"
CRASH = "e2e_scope_crash"
SCOPE_TASKS = ("publish.start", "publish.wait", "publish.promote")
SCOPE_ALL = ("publish.pglock_scope_enter", *SCOPE_TASKS, "publish.pglock_scope_exit")
CRASH_SCOPE_LEASE = dt.timedelta(seconds=15)  # scope_lease of e2e_scope_crash
FINISHED = ("success", "failed", "skipped", "upstream_failed", "removed")
DEADLINE_SECONDS = 180

LOCK_TABLES = """
CREATE TABLE e2e_scope_meet (dag_id text, deployment text, PRIMARY KEY (dag_id, deployment));
CREATE TABLE e2e_go (dag_id text, deployment text, PRIMARY KEY (dag_id, deployment));
CREATE TABLE e2e_scope_spans (
    dag_id text, deployment text, task_id text, started timestamptz NOT NULL, ended timestamptz NOT NULL
);
"""

States = dict[str, str | None]  # task_id -> state (one run per DAG and deployment)
Span = tuple[str, dt.datetime, dt.datetime]  # task, started, ended (database clock)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster({"max_connections": "200"}) as server:
        yield server


def _create_database(cluster: Cluster, name: str, template: str | None = None) -> str:
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        conn.execute(statement)
    return cluster.dsn_for(name)


def _kill_task_processes(deployment: Deployment) -> list[int]:
    """SIGKILL what is left of ``deployment``'s processes: task processes run in process groups of their own.

    Found by their environment (this deployment's AIRFLOW_HOME); all of them descend from the
    processes the fixture started."""
    marker = f"AIRFLOW_HOME={deployment.home}".encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


@pytest.fixture(scope="module")
def deployments(cluster: Cluster) -> Iterator[dict[str, Deployment]]:
    """A and B: metadata DBs ``meta_a`` (migrated) and ``meta_b`` (a copy of the fresh ``meta_a``)."""
    lock_uri = _create_database(cluster, "locks")
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        conn.execute(LOCK_TABLES)
        schema.migrate(conn)  # airflow-pglock init-db: creates pglock.scopes
    base = AIRFLOW_HOME / "e2e-scope"
    shutil.rmtree(base, ignore_errors=True)
    shared_env = {
        "AIRFLOW_CONN_POSTGRES_DEFAULT": lock_uri,
        "PGLOCK_E2E_DSN": lock_uri,
        "PGLOCK_E2E_DEPLOYMENTS": "2",
    }
    # [pglock] deployment names each deployment's scopes (pglock.scopes.run) and lock sessions.
    env_a = {**shared_env, "AIRFLOW__PGLOCK__DEPLOYMENT": "deployment-A"}
    env_b = {**shared_env, "AIRFLOW__PGLOCK__DEPLOYMENT": "deployment-B"}
    a = Deployment("A", base / "A", _create_database(cluster, "meta_a"), free_port(), DAGS, env_a)
    a.home.mkdir(parents=True)
    migrated = a.airflow("db", "migrate")
    assert migrated.returncode == 0, f"airflow db migrate failed:\n{migrated.stdout[-3000:]}\n{migrated.stderr[-3000:]}"
    meta_b = _create_database(cluster, "meta_b", template="meta_a")
    b = Deployment("B", base / "B", meta_b, free_port(), DAGS, env_b)
    started: list[Deployment] = []
    try:
        for deployment in (a, b):
            started.append(deployment)
            deployment.start_api_server()
        for deployment in (a, b):
            deployment.start_scheduling()
        yield {"A": a, "B": b}
    finally:
        for deployment in started:
            deployment.stop()
            _kill_task_processes(deployment)
        shutil.rmtree(base, ignore_errors=True)


def _task_states(deployment: Deployment, dag_id: str) -> States:
    rows = deployment.query("SELECT task_id, state FROM task_instance WHERE dag_id = %s", [dag_id])
    return dict(rows)


def _task_times(deployment: Deployment, dag_id: str, task_id: str) -> tuple[Any, Any]:
    rows = deployment.query(
        "SELECT start_date, end_date FROM task_instance WHERE dag_id = %s AND task_id = %s", [dag_id, task_id]
    )
    assert len(rows) == 1, rows
    return rows[0]


def _wait_for(
    deployments: dict[str, Deployment], dag_id: str, done: Any, what: str, timeout: float = DEADLINE_SECONDS
) -> dict[str, States]:
    """Poll every deployment's metadata until ``done(states)``; the deployments must stay alive meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        states = {name: _task_states(d, dag_id) for name, d in deployments.items()}
        if done(states):
            return states
        for deployment in deployments.values():
            deployment.check_alive()
        if time.monotonic() > deadline:
            logs = "\n".join(d.logs() for d in deployments.values())
            raise AssertionError(f"{what}: not reached after {timeout} s: {states}\n{logs}")
        time.sleep(1)


def _all_finished(states: States, task_ids: tuple[str, ...]) -> bool:
    return all(states.get(task_id) in FINISHED for task_id in task_ids)


def _spans(conn: psycopg.Connection[Any], dag_id: str) -> dict[str, list[Span]]:
    rows = conn.execute(
        "SELECT deployment, task_id, started, ended FROM e2e_scope_spans WHERE dag_id = %s ORDER BY started",
        [dag_id],
    ).fetchall()
    found: dict[str, list[Span]] = {}
    for deployment, task_id, started, ended in rows:
        found.setdefault(deployment, []).append((task_id, started, ended))
    return found


def test_two_deployments_never_interleave_one_scope(deployments: dict[str, Deployment], cluster: Cluster) -> None:
    started = time.monotonic()
    states = _wait_for(
        deployments,
        INGEST,
        lambda s: all(_all_finished(states, ("rendezvous", *SCOPE_ALL)) for states in s.values()),
        "both deployments' scope runs",
    )
    print(f"e2e scope: both deployments finished {INGEST} {time.monotonic() - started:.0f} s after start-up")
    with psycopg.connect(cluster.dsn_for("locks"), autocommit=True) as conn:
        spans = _spans(conn, INGEST)
        scope_rows = conn.execute("SELECT key_name, holder, run, lease_until FROM pglock.scopes").fetchall()

    ran = []
    for name, deployment_states in states.items():
        assert deployment_states["rendezvous"] == "success", f"deployment {name}: {deployment_states}"
        scope_states = {task_id: deployment_states[task_id] for task_id in SCOPE_ALL}
        if scope_states["publish.pglock_scope_enter"] == "success":
            ran.append(name)
            assert set(scope_states.values()) == {"success"}, f"deployment {name} took the scope: {scope_states}"
            assert sorted(task for task, _, _ in spans.get(name, [])) == ["promote", "start", "wait"], spans
        else:  # the other deployment's scope was live: the setup and every task of the group skipped
            assert set(scope_states.values()) == {"skipped"}, f"deployment {name} found the scope busy: {scope_states}"
            assert name not in spans, f"deployment {name} skipped its scope but a task of it ran: {spans}"
    print(f"e2e scope: deployments that ran the scope: {ran}; spans {spans}")
    assert ran, f"no deployment took the scope: {states}"
    # The scope tasks of one deployment never ran within the other's scope (first start to last end).
    if len(ran) == 2:
        first, second = sorted(ran, key=lambda name: min(start for _, start, _ in spans[name]))
        first_end = max(end for _, _, end in spans[first])
        second_start = min(start for _, start, _ in spans[second])
        assert first_end < second_start, f"the scopes of {first} and {second} interleaved: {spans}"
    for name in ran:  # within one scope, the tasks ran in order, one after the other
        ordered = spans[name]
        assert [task for task, _, _ in ordered] == ["start", "wait", "promote"], ordered
        assert all(prev[2] <= nxt[1] for prev, nxt in itertools.pairwise(ordered)), ordered
    assert scope_rows == [], "every scope's teardown freed it"


def test_a_killed_deployments_scope_holds_until_its_lease_runs_out(
    deployments: dict[str, Deployment], cluster: Cluster
) -> None:
    a, b = deployments["A"], deployments["B"]
    lock_uri = cluster.dsn_for("locks")
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        conn.execute("INSERT INTO e2e_go (dag_id, deployment) VALUES (%s, 'A')", [CRASH])
    # A's scope is taken and its first task done: A dies before it finishes the scope.
    _wait_for({"A": a}, CRASH, lambda s: s["A"].get("publish.start") == "success", "A's first scope task")
    for role in ("scheduler", "dag-processor", "api-server"):
        a.kill(role)
    leftovers = _kill_task_processes(a)
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        held = conn.execute(
            "SELECT holder, run, task_now, lease_until, clock_timestamp() FROM pglock.scopes WHERE key_name = %s",
            ["openverse/crash"],
        ).fetchone()
        assert held is not None, "A's scope row is there after A died"
        _, a_run, task_now, lease_until, killed_at = held
        print(
            f"e2e scope: killed A ({len(leftovers)} task processes left over) with its scope held "
            f"{'during ' + task_now if task_now else 'between its tasks'}, "
            f"lease until {lease_until} ({(lease_until - killed_at).total_seconds():.1f} s later)"
        )
        a_spans = _spans(conn, CRASH).get("A", [])
        conn.execute("INSERT INTO e2e_go (dag_id, deployment) VALUES (%s, 'B')", [CRASH])

    states = _wait_for(
        {"B": b},
        CRASH,
        lambda s: _all_finished(s["B"], ("wait_for_go", "peek", *SCOPE_ALL)),
        "B's scope after A died",
    )["B"]
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        spans = _spans(conn, CRASH)
        scope_rows = conn.execute("SELECT key_name, holder, run, lease_until FROM pglock.scopes").fetchall()
    print(f"e2e scope: B after A died: {states}; spans {spans}")

    assert a_run == f"deployment-A: {CRASH} scheduled__2026-01-01T00:00:00+00:00", f"the row left is A's: {a_run}"
    assert [task for task, _, _ in a_spans if task != "peek"][:1] == ["start"], a_spans
    a_last_end = max(end for task, _, end in a_spans if task != "peek")
    # The lease counts from the last renewal, which follows the end of A's last scope task.
    assert lease_until >= a_last_end + CRASH_SCOPE_LEASE, (lease_until, a_spans)
    assert spans.get("A", []) == a_spans, "nothing of A ran after it was killed"

    assert {task_id: states[task_id] for task_id in SCOPE_ALL} == dict.fromkeys(SCOPE_ALL, "success"), states
    b_scope = [span for span in spans["B"] if span[0] != "peek"]
    assert [task for task, _, _ in b_scope] == ["start", "wait", "promote"], spans["B"]
    # B's scope took the key only once A's scope lease ran out (both on the lock database's clock).
    assert b_scope[0][1] >= lease_until, f"B's scope ran at {b_scope[0][1]}, within A's lease until {lease_until}"
    # The plain guard of the same key beside B's scope: refused while a scope was live, else after A's lease.
    b_peek = [span for span in spans["B"] if span[0] == "peek"]
    if states["peek"] == "success":
        assert len(b_peek) == 1 and b_peek[0][1] >= lease_until, (b_peek, lease_until)
    else:
        assert states["peek"] == "skipped" and b_peek == [], (states, b_peek)
    enter_start, enter_end = _task_times(b, CRASH, "publish.pglock_scope_enter")
    print(
        f"e2e scope: B's setup ran {enter_start} .. {enter_end}, A's lease ended {lease_until}; "
        f"B's peek {states['peek']}"
    )
    assert scope_rows == [], "B's teardown freed the scope"
