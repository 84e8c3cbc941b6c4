"""Operating guarded tasks in a real Airflow (dag.test) on a real PostgreSQL.

One DAG run answers several questions at once (each run costs seconds):

* ``airflow-pglock locks``, run from inside a guarded task while it holds its lock, shows
  that task by DAG / task / run, with the key's human name from the registry, next to a
  plain psql-style session holding another key;
* the guarded executions send their metrics through Airflow's own StatsD client to a UDP
  socket this test listens on: counters, timers and bounded tags.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.identity import parse_application_name, run_digest
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.schema import migrate
from tests.helpers import run_dag
from tests.ops_helpers import dsn_uri, hold, scratch_database
from tests.statsd import StatsdListener

pytestmark = pytest.mark.airflow

CONN_ID = "pglock_ops_af"

OPS_DAG = """
import io
import json
import os

import pendulum
from airflow.sdk import dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock

CONN = "pglock_ops_af"


@dag(dag_id="ops_view", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def ops_view():
    @task.advisory_lock(postgres_conn_id=CONN, key="ops-hold")
    def holds_and_looks():
        from airflow_pglock.cli.main import main

        out = io.StringIO()
        code = main(["locks", "--dsn", os.environ["PGLOCK_OPS_DSN"], "--output", "json"], out=out)
        with open(os.environ["PGLOCK_OPS_OUT"], "w") as result:
            json.dump({"code": code, "report": json.loads(out.getvalue())}, result)

    @task.advisory_lock(postgres_conn_id=CONN, key="ops-busy")
    def skipped_when_busy():
        raise AssertionError("ops-busy is held by the test")

    @task.advisory_lock(postgres_conn_id=CONN, key="ops-busy", on_busy="fail")
    def fails_when_busy():
        raise AssertionError("ops-busy is held by the test")

    @task.advisory_lock(postgres_conn_id=CONN, key="ops-nothing-new")
    def skips_itself():
        from airflow.sdk.exceptions import AirflowSkipException  # this test runs on Airflow 3.2+

        raise AirflowSkipException("nothing new")

    @task.advisory_lock(postgres_conn_id=CONN, key="ops-once", once_per="2026-12-01")
    def once_first():
        pass

    @task.advisory_lock(postgres_conn_id=CONN, key="ops-once", once_per="2026-12-01")
    def once_again():  # the period is the key's: done by once_first
        raise AssertionError("ops-once was done for the period")

    @task.advisory_lock(postgres_conn_id=CONN, key="ops-stacked")
    @advisory_lock(postgres_conn_id=CONN, key="ops-busy")
    def stacked_skips():  # the outer guard holds ops-stacked; the task's own (inner) one finds ops-busy held
        raise AssertionError("ops-busy is held by the test")

    holds_and_looks()
    skipped_when_busy()
    stacked_skips()
    fails_when_busy()
    skips_itself()
    once_first() >> once_again()


the_dag = ops_view()
"""


def test_locks_from_a_task_and_metrics(
    airflow_db: Path, pg_server: str, statsd: StatsdListener, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with scratch_database(pg_server) as ops_dsn:
        with psycopg.connect(ops_dsn, autocommit=True) as conn:
            migrate(conn)  # the registry names "ops-hold" for `locks`...
        earlier = AdvisoryLockHook(dsn=ops_dsn).acquire("ops-hold")
        assert earlier is not None and earlier.release()  # ...recorded when an earlier hold ended
        monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", dsn_uri(ops_dsn))
        monkeypatch.setenv("PGLOCK_OPS_DSN", ops_dsn)
        monkeypatch.setenv("AIRFLOW__PGLOCK__DEPLOYMENT", "ops eu")  # the holder names it
        monkeypatch.setenv("PGLOCK_OPS_OUT", str(tmp_path / "locks.json"))
        psql = hold(ops_dsn, LockKey.from_name("ops-busy").numbers)
        try:
            result = run_dag(OPS_DAG, "ops_view")
        finally:
            psql.close()

    assert result.state("holds_and_looks") == "success"
    assert result.state("skipped_when_busy") == "skipped"
    assert result.state("fails_when_busy") == "failed"
    assert result.state("skips_itself") == "skipped"
    assert result.state("stacked_skips") == "skipped"
    assert result.state("once_first") == "success" and result.state("once_again") == "skipped"

    seen = json.loads((tmp_path / "locks.json").read_text())
    assert seen["code"] == 0
    report: dict[str, Any] = seen["report"]
    assert report["registry"] == "installed"
    assert len(report["locks"]) == 2
    [task_entry] = [entry for entry in report["locks"] if entry["airflow"] is not None]
    [psql_entry] = [entry for entry in report["locks"] if entry["airflow"] is None]
    assert task_entry["key"]["name"] == "ops-hold"
    assert task_entry["state"] == "holding" and task_entry["key"]["name_source"] == "registry"
    # The run id as the lock session's application_name carries it (past 63 bytes: shortened,
    # ending with "~" and the digest of the full run id).
    shown = parse_application_name(task_entry["application_name"])
    assert shown is not None
    assert shown.run_id == result.run_id or shown.run_id.endswith("~" + run_digest(result.run_id)), shown
    assert task_entry["airflow"] == {
        "dag_id": "ops_view",
        "task_id": "holds_and_looks",
        "run_id": shown.run_id,
        "map_index": -1,
    }
    # The deployment ([pglock] deployment, here from AIRFLOW__PGLOCK__DEPLOYMENT) and the host it runs on.
    assert task_entry["application_name"].startswith("pglock:ops_eu@")
    assert task_entry["deployment"] == "ops_eu" and task_entry["host"]
    assert task_entry["key"]["name_unknown_reason"] is None
    assert task_entry["since_basis"] == "lock session start" and task_entry["seconds"] >= 0
    # No guarded task ever took ops-busy, so nothing recorded its name: the numbers are shown.
    assert psql_entry["application_name"] == "psql" and psql_entry["key"]["name"] is None
    assert psql_entry["deployment"] is None and psql_entry["host"] is None
    assert "names are recorded when a hold ends" in psql_entry["key"]["name_unknown_reason"]
    assert psql_entry["key"]["numbers"] == list(LockKey.from_name("ops-busy").numbers)

    by_task: dict[str, set[tuple[str, str]]] = {}
    for name, tags, kind in statsd.metrics():
        assert set(tags) == {"dag_id", "task_id", "mode", "shared", "on_busy"}, tags
        assert tags["dag_id"] == "ops_view" and tags["mode"] == "session" and tags["shared"] == "false"
        by_task.setdefault(tags["task_id"], set()).add((name, kind))
    assert by_task == {
        "holds_and_looks": {("acquired", "c"), ("completed", "c"), ("wait", "ms"), ("hold", "ms")},
        "skipped_when_busy": {("skipped", "c"), ("wait", "ms")},
        "fails_when_busy": {("busy", "c"), ("wait", "ms")},
        "skips_itself": {("acquired", "c"), ("work_skipped", "c"), ("wait", "ms"), ("hold", "ms")},
        # The inner guard's busy skip; the outer one took its key, and the skip is not the work's own.
        "stacked_skips": {("acquired", "c"), ("skipped", "c"), ("wait", "ms"), ("hold", "ms")},
        "once_first": {("acquired", "c"), ("completed", "c"), ("wait", "ms"), ("hold", "ms")},
        "once_again": {("acquired", "c"), ("wait", "ms")},  # found done: neither skipped (busy) nor work_skipped
    }
    pglock_lines = [line for line in statsd.lines if line.startswith("airflow.pglock.")]
    assert not any(result.run_id in line or "ops-hold" in line or "ops-busy" in line for line in pglock_lines)
