"""Two independent Airflow 3 deployments, real schedulers, one lock database.

Deployment A and B each have their own AIRFLOW_HOME and metadata database and run
``airflow api-server`` (execution API), ``airflow scheduler`` (LocalExecutor) and
``airflow dag-processor``. They catch up the same periods of the same DAGs
(tests/e2e/dags/e2e_pglock.py) at the same time and share only the lock database. The
assertions read each deployment's own metadata (task_instance states) and the rows the
guarded functions wrote in the lock database.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

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
        "the real-scheduler test drives Airflow 3 processes (api-server, dag-processor); "
        "the 2.11 suite covers the provider through dag.test()",
        allow_module_level=True,
    )

DAGS = Path(__file__).parent / "dags"
REPORT_PERIODS = ["2026-01-01", "2026-01-02", "2026-01-03"]
TENANT_PERIOD = "2026-01-01"
TENANTS = 50
FINISHED = ("success", "failed", "skipped", "upstream_failed", "removed")
DEADLINE_SECONDS = 240

LOCK_TABLES = """
CREATE TABLE e2e_meet (dag_id text, period text, deployment text, PRIMARY KEY (dag_id, period, deployment));
CREATE TABLE e2e_reports (period text, deployment text, at timestamptz DEFAULT clock_timestamp());
CREATE TABLE e2e_tenants_done (period text, tenant int, deployment text, PRIMARY KEY (period, tenant));
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster({"max_connections": "300"}) as server:
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
        schema.migrate(conn)  # airflow-pglock init-db: once_per records completions in pglock.completions
    base = AIRFLOW_HOME / "e2e"
    shared_env = {
        "AIRFLOW_CONN_POSTGRES_DEFAULT": lock_uri,
        "PGLOCK_E2E_DSN": lock_uri,
        "PGLOCK_E2E_DEPLOYMENTS": "2",
    }
    a = Deployment("A", base / "A", _create_database(cluster, "meta_a"), free_port(), DAGS, shared_env)
    a.home.mkdir(parents=True)
    migrated = a.airflow("db", "migrate")
    assert migrated.returncode == 0, f"airflow db migrate failed:\n{migrated.stdout[-3000:]}\n{migrated.stderr[-3000:]}"
    meta_b = _create_database(cluster, "meta_b", template="meta_a")
    b = Deployment("B", base / "B", meta_b, free_port(), DAGS, shared_env)
    started: list[Deployment] = []
    try:
        for deployment in (a, b):  # both api-servers start at once, then both schedulers
            started.append(deployment)
            deployment.start_api_server()
        for deployment in (a, b):
            deployment.start_scheduling()
        yield {"A": a, "B": b}
    finally:
        for deployment in started:
            deployment.stop()
        shutil.rmtree(base, ignore_errors=True)


States = dict[tuple[str, str, int], str | None]  # (period, task_id, map_index) -> state


def _task_states(deployment: Deployment, dag_id: str) -> States:
    rows = deployment.query(
        "SELECT dr.logical_date::date::text, ti.task_id, ti.map_index, ti.state FROM task_instance ti"
        " JOIN dag_run dr ON dr.dag_id = ti.dag_id AND dr.run_id = ti.run_id WHERE ti.dag_id = %s",
        [dag_id],
    )
    return {(period, task_id, map_index): state for period, task_id, map_index, state in rows}


def _expected_done(states: States, periods: list[str], task_id: str, count: int) -> bool:
    finished = [key for key, state in states.items() if key[1] == task_id and state in FINISHED]
    return len(finished) == len(periods) * count


def _wait_for_runs(deployments: dict[str, Deployment]) -> dict[str, dict[str, States]]:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        states = {
            name: {dag_id: _task_states(d, dag_id) for dag_id in ("e2e_report", "e2e_tenants")}
            for name, d in deployments.items()
        }
        if all(
            _expected_done(s["e2e_report"], REPORT_PERIODS, "report", 1)
            and _expected_done(s["e2e_tenants"], [TENANT_PERIOD], "process", TENANTS)
            for s in states.values()
        ):
            return states
        for deployment in deployments.values():
            deployment.check_alive()
        if time.monotonic() > deadline:
            logs = "\n".join(d.logs() for d in deployments.values())
            raise AssertionError(f"runs not finished after {DEADLINE_SECONDS} s: {states}\n{logs}")
        time.sleep(2)


def test_two_deployments_share_one_lock_database(deployments: dict[str, Deployment], cluster: Cluster) -> None:
    started = time.monotonic()
    states = _wait_for_runs(deployments)
    print(f"e2e: both deployments finished their runs {time.monotonic() - started:.0f} s after start-up")
    with psycopg.connect(cluster.dsn_for("locks"), autocommit=True) as conn:
        reports = conn.execute("SELECT period, deployment FROM e2e_reports ORDER BY period").fetchall()
        done = conn.execute("SELECT tenant, deployment FROM e2e_tenants_done WHERE period = %s", [TENANT_PERIOD])
        done_by = dict(done.fetchall())
        completions = conn.execute(
            "SELECT key_name, dag_id, task_id, map_index FROM pglock.completions WHERE period = %s", [TENANT_PERIOD]
        ).fetchall()

    # Per key and period: exactly one deployment ran the report, the other one skipped it.
    for period in REPORT_PERIODS:
        outcome = {name: states[name]["e2e_report"][(period, "report", -1)] for name in deployments}
        assert sorted(outcome.values()) == ["skipped", "success"], f"report {period}: {outcome}"
        ran = [name for name, state in outcome.items() if state == "success"]
        assert [d for p, d in reports if p == period] == ran, f"report {period}: metadata {outcome}, rows {reports}"
        for name in deployments:  # the rendezvous made both deployments reach the period
            assert states[name]["e2e_report"][(period, "rendezvous", -1)] == "success"

    # Tenant fan-out: every tenant ran exactly once across both deployments.
    ran_by: dict[int, list[str]] = {tenant: [] for tenant in range(TENANTS)}
    for name in deployments:
        tenant_states = states[name]["e2e_tenants"]
        assert tenant_states[(TENANT_PERIOD, "rendezvous", -1)] == "success"
        for tenant in range(TENANTS):
            state = tenant_states[(TENANT_PERIOD, "process", tenant)]
            assert state in ("success", "skipped"), f"deployment {name} tenant {tenant}: {state}"
            if state == "success":
                ran_by[tenant].append(name)
    twice_or_never = {tenant: names for tenant, names in ran_by.items() if len(names) != 1}
    assert twice_or_never == {}, f"tenants not run exactly once: {twice_or_never}"
    assert done_by == {tenant: names[0] for tenant, names in ran_by.items()}
    # once_per recorded each tenant's completion for the period, once.
    expected = [(f"e2e_tenants/process/{tenant}", "e2e_tenants", "process", tenant) for tenant in range(TENANTS)]
    assert sorted(completions) == sorted(expected)
    # Both deployments really worked in parallel: each ran some of the tenants.
    per_deployment = Counter(names[0] for names in ran_by.values())
    assert set(per_deployment) == {"A", "B"}, f"tenants per deployment: {per_deployment}"
