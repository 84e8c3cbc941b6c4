"""Lock scopes across two real Airflow 3 deployments that share one lock database.

Deployment A and B each have their own AIRFLOW_HOME and metadata database and run
``airflow api-server`` (execution API), ``airflow scheduler`` (LocalExecutor) and ``airflow
dag-processor`` (tests/e2e/deployment.py), as tests/e2e/test_real_scheduler.py does. Both
schedule tests/e2e/scope_dags/e2e_scope.py, whose scope tasks record their spans (database
clock) in the lock database:

- the openverse pattern: ``start >> wait >> promote`` in one scope on ``openverse/ingest``,
  run by both deployments at once: the scope tasks of one deployment never run between the
  first and last scope task of the other;
- retries and clearing (A alone): a task of the scope that fails its first try retries in the
  same scope (same holder id and fencing token); ``airflow tasks clear`` of that task runs the
  setup and teardown again, so the cleared run takes a new scope (new holder id, new token);
  cleared while its scope is still live (the task up for retry), the setup takes that scope over;
- deferring (B's triggerer): B's setup with ``on_busy="defer"`` waits in the triggerer while
  A's scope on the same key is live, between A's tasks, and runs its task after A's scope ended
  (A's last scope task fails: its teardown frees the scope all the same, long before its lease);
- a pool of two slots (both deployments, two DAGs each): at most two scopes at once, each in its
  own slot, which every task of it re-enters;
- a crash: deployment A is killed while its scope on ``openverse/crash`` is held; B's scope
  takes the key only once A's scope lease ran out (last: A stays dead).
"""

from __future__ import annotations

import datetime as dt
import itertools
import shutil
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
RETRY = "e2e_scope_retry"  # deployment A only
MIDCLEAR = "e2e_scope_midclear"  # deployment A only
HOLD = "e2e_scope_hold"  # deployment A only
DEFER = "e2e_scope_defer"  # deployment B only
TIMEOUT = "e2e_scope_timeout"  # deployment A only; dagrun_timeout 40 s, triggered by its test
TIMEOUT_SCOPE_LEASE = 600  # its scope_lease
RUN_ID = "scheduled__2026-01-01T00:00:00+00:00"  # the one run of every DAG of e2e_scope.py
LOGICAL_DATE = "2026-01-01T00:00:00+00:00"
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
CREATE TABLE e2e_scope_holders (
    id bigserial PRIMARY KEY, dag_id text, deployment text, task_id text, try_number int,
    holder text, token bigint, task_now text, run text, xcom_holder text, xcom_token bigint,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
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
            deployment.kill_leftovers()
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


def _tries(deployment: Deployment, dag_id: str) -> dict[str, tuple[str | None, int]]:
    """task_id -> (state, try_number) of ``dag_id``'s one run."""
    rows = deployment.query("SELECT task_id, state, try_number FROM task_instance WHERE dag_id = %s", [dag_id])
    return {task_id: (state, try_number) for task_id, state, try_number in rows}


def _run_state(deployment: Deployment, dag_id: str) -> str | None:
    rows = deployment.query("SELECT state FROM dag_run WHERE dag_id = %s", [dag_id])
    assert len(rows) <= 1, rows
    return rows[0][0] if rows else None


def _wait_until(deployment: Deployment, done: Any, what: str, dag_id: str, timeout: float = DEADLINE_SECONDS) -> None:
    """Poll until ``done()``; ``deployment`` must stay alive meanwhile (failing: its ``dag_id`` run and logs)."""
    deadline = time.monotonic() + timeout
    while not done():
        deployment.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what}: not reached after {timeout} s: run {_run_state(deployment, dag_id)}, "
                f"tasks {_tries(deployment, dag_id)}\n{deployment.logs()}"
            )
        time.sleep(1)


def _holders(conn: psycopg.Connection[Any], dag_id: str) -> list[tuple[Any, ...]]:
    """(task_id, try_number, holder, token, task_now, run, xcom_holder, xcom_token) in the order recorded."""
    return conn.execute(
        "SELECT task_id, try_number, holder, token, task_now, run, xcom_holder, xcom_token"
        " FROM e2e_scope_holders WHERE dag_id = %s ORDER BY id",
        [dag_id],
    ).fetchall()


def _task_log(deployment: Deployment, dag_id: str, task_id: str) -> str:
    """Every attempt's log of ``task_id`` in ``dag_id`` (the trigger's lines included)."""
    logs = deployment.home / "logs" / f"dag_id={dag_id}"
    paths = sorted(path for path in logs.rglob("*.log*") if f"/task_id={task_id}/" in path.as_posix())
    return "\n".join(path.read_text(errors="replace") for path in paths)


def test_a_retried_task_reenters_and_a_cleared_run_takes_the_scope_again(
    deployments: dict[str, Deployment], cluster: Cluster
) -> None:
    a = deployments["A"]
    lock_uri = cluster.dsn_for("locks")
    scope = (
        "retried.pglock_scope_enter",
        "retried.first",
        "retried.flaky",
        "retried.last",
        "retried.pglock_scope_exit",
    )
    started = time.monotonic()
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        conn.execute("INSERT INTO e2e_go (dag_id, deployment) VALUES (%s, 'A')", [RETRY])
    _wait_until(a, lambda: _run_state(a, RETRY) in ("success", "failed"), f"A's {RETRY} run", RETRY)
    first_run = _tries(a, RETRY)
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        first_holders = _holders(conn, RETRY)
        left = conn.execute("SELECT holder FROM pglock.scopes WHERE key_name = 'e2e/retried'").fetchall()
    print(f"e2e scope retry: first run done in {time.monotonic() - started:.0f} s: {first_run}; {first_holders}")
    history = a.query(
        "SELECT try_number, state FROM task_instance_history WHERE dag_id = %s AND task_id = 'retried.flaky'"
        " ORDER BY try_number",
        [RETRY],
    )

    assert _run_state(a, RETRY) == "success", first_run
    assert {task_id: first_run[task_id][0] for task_id in scope} == dict.fromkeys(scope, "success"), first_run
    assert first_run["retried.flaky"] == ("success", 2), "flaky failed its first try and its retry succeeded"
    assert first_run["retried.pglock_scope_enter"] == ("success", 1), "the retry did not run the setup again"
    assert [try_number for try_number, _ in history] == [1], history  # the failed first try
    tasks = [(task_id, try_number) for task_id, try_number, *_ in first_holders]
    assert tasks == [("retried.first", 1), ("retried.flaky", 1), ("retried.flaky", 2), ("retried.last", 1)], tasks
    holder, token = first_holders[0][2], first_holders[0][3]
    assert holder and token is not None, first_holders
    for task_id, _, row_holder, row_token, task_now, run, xcom_holder, xcom_token in first_holders:
        # Each try ran in the one scope the setup took: its row, now naming this task, and the setup's XCom.
        assert (row_holder, row_token, xcom_holder, xcom_token) == (holder, token, holder, token), first_holders
        assert task_now == task_id and run == f"deployment-A: {RETRY} {RUN_ID}", first_holders
    assert left == [], "the teardown freed the scope"

    # Clear flaky with the real CLI: Airflow clears the scope's setup and teardown with it. -t: Airflow
    # 3.3's partial_subset matches it as a substring, not a regex (an anchored ^...$ matches nothing).
    cleared_at = time.monotonic()
    cleared = a.airflow(
        "tasks", "clear", RETRY, "-t", "retried.flaky", "-s", LOGICAL_DATE, "-e", LOGICAL_DATE, "-y", timeout=180
    )
    assert cleared.returncode == 0, f"airflow tasks clear failed:\n{cleared.stdout[-3000:]}\n{cleared.stderr[-3000:]}"
    after_clear = _tries(a, RETRY)
    assert after_clear != first_run, f"nothing was cleared: {after_clear}\n{cleared.stderr[-3000:]}"

    def done_again() -> bool:
        tries = _tries(a, RETRY)
        return _run_state(a, RETRY) in ("success", "failed") and tries["retried.pglock_scope_exit"][1] >= 2

    _wait_until(a, done_again, f"A's cleared {RETRY} run", RETRY)
    again = _tries(a, RETRY)
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        holders = _holders(conn, RETRY)
        scope_rows = conn.execute("SELECT key_name, holder, run FROM pglock.scopes").fetchall()
    print(
        f"e2e scope retry: cleared {after_clear}; done again in {time.monotonic() - cleared_at:.0f} s: "
        f"{again}; {holders}"
    )

    assert {task_id: after_clear[task_id][0] for task_id in ("retried.first", "retried.last")} == {
        "retried.first": "success",
        "retried.last": "success",
    }, after_clear
    assert _run_state(a, RETRY) == "success", again
    assert {task_id: again[task_id][0] for task_id in scope} == dict.fromkeys(scope, "success"), again
    # The setup and teardown ran again (a second try each), flaky a third time; first and last did not run.
    assert again["retried.pglock_scope_enter"][1] == 2 and again["retried.pglock_scope_exit"][1] == 2, again
    assert again["retried.flaky"][1] == 3, again
    assert again["retried.first"] == first_run["retried.first"] == ("success", 1), again
    assert again["retried.last"] == first_run["retried.last"] == ("success", 1), again
    assert holders[: len(first_holders)] == first_holders, holders
    new = holders[len(first_holders) :]
    assert [(task_id, try_number) for task_id, try_number, *_ in new] == [("retried.flaky", 3)], holders
    _, _, new_holder, new_token, task_now, run, xcom_holder, xcom_token = new[0]
    # A new acquisition: a new holder id and a larger fencing token, the same in the row and the setup's XCom.
    assert new_holder and new_holder != holder, (holder, new)
    assert new_token is not None and new_token > token, (token, new)
    assert (xcom_holder, xcom_token) == (new_holder, new_token), new
    assert task_now == "retried.flaky" and run == f"deployment-A: {RETRY} {RUN_ID}", new
    assert scope_rows == [], "the cleared run's teardown freed its scope"


def test_a_deferring_setup_waits_in_the_triggerer(deployments: dict[str, Deployment], cluster: Cluster) -> None:
    a, b = deployments["A"], deployments["B"]
    lock_uri = cluster.dsn_for("locks")
    if "triggerer" not in b.processes:
        b.start_triggerer()
    held = ("held.pglock_scope_enter", "held.hold", "pause", "held.last", "held.pglock_scope_exit")
    deferred = ("deferred.pglock_scope_enter", "deferred.after", "deferred.pglock_scope_exit")
    started = time.monotonic()
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        conn.execute("INSERT INTO e2e_go (dag_id, deployment) VALUES (%s, 'A')", [HOLD])
    # B goes once A's scope is between its tasks (pause, outside the scope, runs 20 s): the row alone holds it.
    _wait_until(a, lambda: _task_states(a, HOLD).get("pause") == "running", f"A's {HOLD} between its scope tasks", HOLD)
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        a_row = conn.execute("SELECT holder, run FROM pglock.scopes WHERE key_name = 'e2e/deferred'").fetchone()
        conn.execute("INSERT INTO e2e_go (dag_id, deployment) VALUES (%s, 'B')", [DEFER])
    assert a_row is not None and a_row[1] == f"deployment-A: {HOLD} {RUN_ID}", a_row
    go_b = time.monotonic()

    def b_done() -> bool:
        return _run_state(b, DEFER) in ("success", "failed") and _run_state(a, HOLD) in ("success", "failed")

    _wait_until(b, b_done, f"B's {DEFER} run after A's {HOLD}", DEFER)
    a_states, b_states = _tries(a, HOLD), _tries(b, DEFER)
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        a_spans, b_spans = _spans(conn, HOLD).get("A", []), _spans(conn, DEFER).get("B", [])
        scope_rows = conn.execute("SELECT key_name, holder, run FROM pglock.scopes").fetchall()
    setup_log = _task_log(b, DEFER, "deferred.pglock_scope_enter")
    print(
        f"e2e scope defer: B let go {go_b - started:.0f} s after A, done {time.monotonic() - go_b:.0f} s later; "
        f"A {a_states}; B {b_states}; spans A {a_spans} B {b_spans}"
    )
    print("e2e scope defer: B's setup log, pglock lines:")
    print("\n".join(line[:400] for line in setup_log.splitlines() if "pglock" in line))

    # A's last scope task failed; its teardown ran all the same and freed the scope (well before its lease).
    assert {task_id: a_states[task_id][0] for task_id in held} == {
        **dict.fromkeys(held, "success"),
        "held.last": "failed",
    }, a_states
    assert _run_state(a, HOLD) == "failed"
    assert {task_id: b_states[task_id][0] for task_id in deferred} == dict.fromkeys(deferred, "success"), b_states
    # The setup deferred (to B's triggerer) behind A's scope, between A's tasks, and resumed in the same try.
    assert "pglock deferred" in setup_log, setup_log[-5000:]
    assert f"is held by the lock scope of deployment-A: {HOLD} {RUN_ID}" in setup_log, setup_log[-5000:]
    assert "pglock waiting" in setup_log, "the trigger's lines (from B's triggerer)\n" + setup_log[-5000:]
    assert "pglock: took the lock scope of key 'e2e/deferred' (int64 " in setup_log, setup_log[-5000:]
    assert b_states["deferred.pglock_scope_enter"][1] == 1, b_states
    # It took the scope once A's teardown freed it; its task ran after A's last scope task.
    a_exit_start, _ = _task_times(a, HOLD, "held.pglock_scope_exit")
    _, b_enter_end = _task_times(b, DEFER, "deferred.pglock_scope_enter")
    assert b_enter_end > a_exit_start, (b_enter_end, a_exit_start)
    assert (b_enter_end - a_exit_start).total_seconds() < 60, "B took the scope when A's teardown freed it, not "
    "when A's 120 s lease ran out"
    assert [task for task, _, _ in a_spans] == ["hold", "last"], a_spans
    assert [task for task, _, _ in b_spans] == ["after"], b_spans
    a_last_end = max(end for _, _, end in a_spans)
    assert b_spans[0][1] > a_last_end, f"B's scope task ran at {b_spans[0][1]}, within A's scope (ended {a_last_end})"
    assert scope_rows == [], "both teardowns freed their scopes"


POOLS = ("e2e_scope_pool_1", "e2e_scope_pool_2")  # in both deployments: four runs on a pool of two slots
POOL_ALL = ("pooled.pglock_scope_enter", "pooled.start", "pooled.wait", "pooled.promote", "pooled.pglock_scope_exit")


def test_a_task_cleared_while_its_scope_is_live_runs_the_scope_again(
    deployments: dict[str, Deployment], cluster: Cluster
) -> None:
    """Review -65: ``flaky`` fails and waits for its retry (the scope live, held by its row); the user
    clears it. Airflow clears the setup and teardown with it; the setup ran again, found its own run's
    earlier row live and skipped the whole scope (the cleared task never ran), the row then blocking
    the key until its lease ran out. Now the setup takes the scope over (a new holder id and token)."""
    a = deployments["A"]
    lock_uri = cluster.dsn_for("locks")
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        conn.execute("INSERT INTO e2e_go (dag_id, deployment) VALUES (%s, 'A')", [MIDCLEAR])
    _wait_until(
        a, lambda: _tries(a, MIDCLEAR).get("cleared.flaky", (None, 0))[0] == "up_for_retry", "flaky failed", MIDCLEAR
    )
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        before = conn.execute("SELECT holder, token FROM pglock.scopes WHERE key_name = 'e2e/midclear'").fetchall()
    assert len(before) == 1, before
    cleared = a.airflow(
        "tasks", "clear", MIDCLEAR, "-t", "cleared.flaky", "-s", LOGICAL_DATE, "-e", LOGICAL_DATE, "-y", timeout=180
    )
    assert cleared.returncode == 0, f"airflow tasks clear failed:\n{cleared.stdout[-3000:]}\n{cleared.stderr[-3000:]}"
    _wait_until(a, lambda: _run_state(a, MIDCLEAR) in ("success", "failed"), f"A's cleared {MIDCLEAR} run", MIDCLEAR)
    after = _tries(a, MIDCLEAR)
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        holders = _holders(conn, MIDCLEAR)
        rows = conn.execute("SELECT holder FROM pglock.scopes WHERE key_name = 'e2e/midclear'").fetchall()
    print(f"e2e scope cleared mid-scope: {after}; {holders}")

    assert _run_state(a, MIDCLEAR) == "success", after
    assert after["cleared.pglock_scope_enter"] == ("success", 2), after
    assert after["cleared.flaky"][0] == "success" and after["cleared.last"] == ("success", 1), after
    assert after["cleared.pglock_scope_exit"][0] == "success", after
    [(old_holder, old_token)] = before
    tasks = [(task_id, try_number) for task_id, try_number, *_ in holders]
    assert tasks[0] == ("cleared.flaky", 1) and tasks[-1] == ("cleared.last", 1), tasks
    assert tasks[-2][0] == "cleared.flaky" and tasks[-2][1] >= 2, tasks
    new_holder, new_token = holders[-1][2], holders[-1][3]
    assert new_holder != old_holder and new_token > old_token, (before, holders)
    assert new_holder[:32] == old_holder[:32], "the same setup of the same run: the same lineage"
    assert all(row[2] == new_holder for row in holders[-2:]), holders
    assert rows == [], "the teardown freed the scope"


def test_clear_only_failed_runs_the_failed_task_alone_which_fails_as_lost(
    deployments: dict[str, Deployment], cluster: Cluster
) -> None:
    """docs/scopes.md: "Clear -> Only failed" leaves the setup and teardown out (they succeeded), so the
    failed task of the scope runs alone, finds the scope freed by its teardown, and fails as lost
    without running its work. (A's e2e_scope_hold: its last scope task fails.)"""
    a = deployments["A"]
    lock_uri = cluster.dsn_for("locks")
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        conn.execute("INSERT INTO e2e_go (dag_id, deployment) VALUES (%s, 'A') ON CONFLICT DO NOTHING", [HOLD])
    _wait_until(a, lambda: _run_state(a, HOLD) in ("success", "failed"), f"A's {HOLD} run", HOLD)
    before = _tries(a, HOLD)
    assert before["held.last"] == ("failed", 1) and _run_state(a, HOLD) == "failed", before
    cleared = a.airflow(
        "tasks", "clear", HOLD, "--only-failed", "-s", LOGICAL_DATE, "-e", LOGICAL_DATE, "-y", timeout=180
    )
    assert cleared.returncode == 0, f"airflow tasks clear failed:\n{cleared.stdout[-3000:]}\n{cleared.stderr[-3000:]}"
    cleared_now = _tries(a, HOLD)
    # Cleared: no longer failed, or already tried again (the retry fails before its work, and the
    # scheduler may have run it before the clear command returned: a dry run saw ('failed', 2) here).
    state, try_number = cleared_now["held.last"]
    assert state != "failed" or try_number >= 2, f"nothing was cleared: {cleared_now}\n{cleared.stderr[-3000:]}"

    def done_again() -> bool:
        state, try_number = _tries(a, HOLD)["held.last"]
        return try_number >= 2 and state in FINISHED and _run_state(a, HOLD) in ("success", "failed")

    _wait_until(a, done_again, f"A's {HOLD} run after clear --only-failed", HOLD)
    after = _tries(a, HOLD)
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        spans = [task for task, *_ in _spans(conn, HOLD).get("A", [])]
        rows = conn.execute("SELECT holder FROM pglock.scopes WHERE key_name = 'e2e/deferred'").fetchall()
    log = _task_log(a, HOLD, "held.last")
    print(f"e2e scope clear --only-failed: before {before}; cleared {cleared_now}; after {after}; spans {spans}")

    assert after["held.last"] == ("failed", 2), after
    for task_id in ("held.pglock_scope_enter", "held.hold", "pause", "held.pglock_scope_exit"):
        assert after[task_id] == before[task_id] == ("success", 1), (task_id, after)  # not run again
    assert spans.count("last") == 1, spans  # the cleared try failed before its work
    assert "the scope was freed (its teardown ran, or its row was deleted) before" in log, log[-5000:]
    assert rows == [], rows


def test_a_dagrun_timeout_skips_the_teardown_and_the_scope_stays_held_until_its_lease(
    deployments: dict[str, Deployment], cluster: Cluster
) -> None:
    """docs/scopes.md: a dagrun_timeout sets every unfinished task of the run to skipped, the teardown
    included, so the scope's row stays until scope_lease runs out. (A's e2e_scope_timeout: its first
    scope task sleeps past the run's 40 s timeout; the scope's lease is ten minutes.)"""
    a = deployments["A"]
    lock_uri = cluster.dsn_for("locks")
    triggered = a.airflow("dags", "trigger", TIMEOUT, timeout=180)
    assert triggered.returncode == 0, (
        f"airflow dags trigger failed:\n{triggered.stdout[-3000:]}\n{triggered.stderr[-3000:]}"
    )
    try:
        _wait_until(a, lambda: _run_state(a, TIMEOUT) == "failed", f"A's {TIMEOUT} run timed out", TIMEOUT)
        states = _task_states(a, TIMEOUT)
        (run_id,) = a.query("SELECT run_id FROM dag_run WHERE dag_id = %s", [TIMEOUT])[0]
        with psycopg.connect(lock_uri, autocommit=True) as conn:
            row = conn.execute(
                "SELECT holder, task_now, lease_until - clock_timestamp(), run, lease_until FROM pglock.scopes"
                " WHERE key_name = 'e2e/timeout'"
            ).fetchone()
            spans = [task for task, *_ in _spans(conn, TIMEOUT).get("A", [])]
        print(f"e2e scope dagrun_timeout: tasks {states}; scope row {row}; spans {spans}")

        assert states["timed.pglock_scope_enter"] == "success", states
        assert states["timed.pglock_scope_exit"] == "skipped", states
        assert states["timed.after"] == "skipped" and "after" not in spans, (states, spans)
        assert states["timed.long"] in ("skipped", "failed"), states
        assert row is not None, "the scope's row is gone: the teardown ran after all"
        holder, task_now, left, run, lease_until = row
        assert holder and run == f"deployment-A: {TIMEOUT} {run_id}", row
        # held until its lease runs out: most of the ten minutes are left
        assert dt.timedelta(seconds=TIMEOUT_SCOPE_LEASE / 2) < left <= dt.timedelta(seconds=TIMEOUT_SCOPE_LEASE), row
        # The stopped task did not end its part: the row still names it, and the lease runs from its start.
        ((long_started,),) = a.query(
            "SELECT start_date FROM task_instance WHERE dag_id = %s AND task_id = 'timed.long'", [TIMEOUT]
        )
        assert task_now == "timed.long", row
        from_start = (lease_until - long_started).total_seconds()
        assert abs(from_start - TIMEOUT_SCOPE_LEASE) < 15, (from_start, long_started, row)
    finally:
        with psycopg.connect(lock_uri, autocommit=True) as conn:  # the other tests find no scope left
            conn.execute("DELETE FROM pglock.scopes WHERE key_name = 'e2e/timeout'")


def test_at_most_two_scopes_over_a_pool_of_two_each_in_its_own_slot(
    deployments: dict[str, Deployment], cluster: Cluster
) -> None:
    with psycopg.connect(cluster.dsn_for("locks"), autocommit=True) as conn:
        for dag_id in POOLS:
            for name in deployments:
                conn.execute("INSERT INTO e2e_go (dag_id, deployment) VALUES (%s, %s)", [dag_id, name])
    states = {
        dag_id: _wait_for(
            deployments,
            dag_id,
            lambda s: all(_all_finished(states, POOL_ALL) for states in s.values()),
            f"the pool scopes of {dag_id}",
        )
        for dag_id in POOLS
    }
    with psycopg.connect(cluster.dsn_for("locks"), autocommit=True) as conn:
        spans = {dag_id: _spans(conn, dag_id) for dag_id in POOLS}
        left = conn.execute("SELECT key_name FROM pglock.scopes WHERE key_name LIKE 'openverse/pool%'").fetchall()
    scopes: list[tuple[str, int, dt.datetime, dt.datetime]] = []  # who, slot, first start, last end
    for dag_id in POOLS:
        for name, deployment_states in states[dag_id].items():
            scope_states = {task_id: deployment_states[task_id] for task_id in POOL_ALL}
            ran = spans[dag_id].get(name, [])
            if scope_states["pooled.pglock_scope_enter"] != "success":
                assert set(scope_states.values()) == {"skipped"}, f"{name} {dag_id} found the pool full: {scope_states}"
                assert ran == [], f"{name} {dag_id} skipped its scope but a task of it ran: {ran}"
                continue
            assert set(scope_states.values()) == {"success"}, f"{name} {dag_id} took a slot: {scope_states}"
            slots = {task.split("@slot")[1] for task, _, _ in ran}
            assert [task.split("@")[0] for task, _, _ in ran] == ["start", "wait", "promote"], ran
            assert len(slots) == 1, f"{name} {dag_id}: its tasks ran in different slots: {ran}"
            scopes.append((f"{name} {dag_id}", int(slots.pop()), ran[0][1], ran[-1][2]))
    print(f"e2e pool scopes: {[(who, slot, str(start), str(end)) for who, slot, start, end in scopes]}")
    assert len(scopes) >= 2, f"the first two setups take the two slots: {scopes}"
    for who, slot, start, end in scopes:
        beside = [other for other in scopes if other[0] != who and other[2] < end and start < other[3]]
        assert len(beside) <= 1, f"{who} ran beside {len(beside)} other scopes of a pool of two: {beside}"
        assert all(other[1] != slot for other in beside), f"{who} shared slot {slot} with {beside}"
    assert left == [], "every pool scope's teardown freed its slot"


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
    leftovers = a.kill_leftovers()
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
