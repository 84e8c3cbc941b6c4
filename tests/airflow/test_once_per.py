"""once_per, min_interval and fencing tokens through real Airflow runs on a real PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from airflow_pglock.pg import schema
from tests.helpers import advisory_locks, for_this_airflow, run_dag

pytestmark = pytest.mark.airflow

RULES_DAG = """
from datetime import timedelta

import pendulum
from airflow.sdk import dag, task

CONN = "pglock_test"


@dag(dag_id="run_rules", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"period": "2026-11-30", "fail": False})
def run_rules():
    @task.advisory_lock(postgres_conn_id=CONN, key="settle-once", mode="transaction", once_per="{{ params.period }}")
    def settle(lock, params=None):
        lock.connection.execute("INSERT INTO settled (period) VALUES (%s)", [params["period"]])
        if params["fail"]:
            raise RuntimeError("settlement failed after writing")
        return lock.period

    @task.advisory_lock(postgres_conn_id=CONN, key="fresh-key", min_interval=timedelta(seconds=60))
    def refresh():
        return "refreshed"

    @task.advisory_lock(postgres_conn_id=CONN, key="fenced-key", fencing=True)
    def fenced(lock):
        return lock.fencing_token

    @task
    def token_in_xcom(returned, ti=None):
        pushed = ti.xcom_pull(task_ids="fenced", key="pglock_fencing_token")
        assert pushed == returned, (pushed, returned)
        return pushed

    settle()
    refresh()
    token_in_xcom(fenced())


run_rules_dag = run_rules()
"""


def _last_token(conn: Any) -> int:
    return int(conn.execute("SELECT token FROM pglock.fencing_tokens WHERE key_name = 'fenced-key'").fetchone()[0])


@pytest.fixture
def ledger_db(admin: Any) -> Any:
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")
    admin.execute("DROP TABLE IF EXISTS settled; CREATE TABLE settled (period text)")
    yield admin
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE; DROP TABLE settled")


def test_once_per_min_interval_and_fencing(airflow_db: Any, ledger_db: Any, capfd: Any) -> None:
    # Without init-db: the task fails and says which command to run.
    missing = run_dag(RULES_DAG, "run_rules")
    log = "".join(capfd.readouterr())
    assert missing.state("settle") == "failed" and missing.state("refresh") == "failed"
    assert "run `airflow-pglock init-db --conn-id" in log

    schema.migrate(ledger_db)
    failed = run_dag(RULES_DAG, "run_rules", conf={"period": "2026-11-30", "fail": True})
    assert failed.state("settle") == "failed"
    assert ledger_db.execute("SELECT count(*) FROM settled").fetchone()[0] == 0  # rolled back with the lock
    assert ledger_db.execute("SELECT count(*) FROM pglock.completions WHERE period = '2026-11-30'").fetchone()[0] == 0
    assert failed.state("refresh") == "success"
    assert failed.state("token_in_xcom") == "success"  # the XCom equals the handle's token
    first_token = _last_token(ledger_db)

    capfd.readouterr()
    done = run_dag(RULES_DAG, "run_rules", conf={"period": "2026-11-30", "fail": False})
    log = "".join(capfd.readouterr())
    assert done.state("settle") == "success", "a failed run recorded nothing, so the next one runs"
    assert done.state("refresh") == "skipped", "completed less than 60 s ago"
    assert "less than min_interval=60 s" in log and "(database clock)" in log
    assert done.state("token_in_xcom") == "success"
    assert _last_token(ledger_db) > first_token

    # Move the last refresh back 61 s on the database clock: the window has passed.
    ledger_db.execute(
        "UPDATE pglock.completions SET completed_at = completed_at - interval '61 seconds' WHERE key_name = 'fresh-key'"
    )
    again = run_dag(RULES_DAG, "run_rules", conf={"period": "2026-11-30", "fail": False})
    log = "".join(capfd.readouterr())
    assert again.state("settle") == "skipped"
    assert "already done for period '2026-11-30' at " in log and "by run_rules/settle run " + done.run_id in log
    assert again.state("refresh") == "success"
    assert ledger_db.execute("SELECT array_agg(period) FROM settled").fetchone()[0] == ["2026-11-30"]
    assert advisory_locks(ledger_db) == []


ONCE_DAG = """
import time

import pendulum
from airflow.sdk import dag, task


@dag(dag_id="daily_report", schedule="@daily", start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def daily_report():
    @task.advisory_lock(postgres_conn_id="pglock_test", key="daily-report", once_per="{{ ds }}")
    def build_report(ds=None):
        time.sleep(0.5)
        return ds

    build_report()


daily_report_dag = daily_report()
"""


def _deployment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        }
    )
    (home / "dags").mkdir(parents=True)
    (home / "dags" / "daily_report.py").write_text(for_this_airflow(ONCE_DAG))
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    return env


@pytest.mark.slow
def test_two_deployments_same_period_seconds_apart_run_once(dsn: str, ledger_db: Any) -> None:
    schema.migrate(ledger_db)
    base = Path(tempfile.mkdtemp(prefix="pglock-two-deployments-"))
    with ThreadPoolExecutor(2) as pool:
        env_a, env_b = pool.map(_deployment, [base / "a", base / "b"])
    outputs = []
    for env in (env_a, env_b):  # B fires after A has finished: the lock alone would let B run again
        result = subprocess.run(
            [sys.executable, "-m", "airflow", "dags", "test", "daily_report", "2026-11-30"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        outputs.append(result.stdout + result.stderr)
    a, b = outputs
    assert "pglock outcome=completed key 'daily-report'" in a, a[-3000:]
    assert "pglock outcome=skipped key 'daily-report'" in b, b[-3000:]
    assert "already done for period '2026-11-30'" in b and "by daily_report/build_report" in b
    rows = ledger_db.execute("SELECT period, dag_id FROM pglock.completions WHERE key_name = 'daily-report'").fetchall()
    assert rows == [("2026-11-30", "daily_report")]


PERIOD_DAG = """
import datetime as dt
import hashlib

import pendulum
from airflow.sdk import dag, task

# A period that does not compress: past the btree's index row limit even stored compressed.
LONG = "".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(200))


@dag(dag_id="bad_periods", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"nul": "2026\\x0012", "long": LONG},
     default_args={"retries": 1, "retry_delay": dt.timedelta(0)})
def bad_periods():
    @task.advisory_lock(postgres_conn_id="pglock_test", key="period-nul", once_per="{{ params.nul }}")
    def nul():
        print("WORK RAN nul")

    @task.advisory_lock(postgres_conn_id="pglock_test", key="period-long", once_per="{{ params.long }}")
    def long():
        print("WORK RAN long")

    nul()
    long()


bad_periods_dag = bad_periods()
"""


def test_a_period_the_ledger_cannot_store_fails_before_the_work_naming_once_per(
    airflow_db: Any, ledger_db: Any, capfd: Any
) -> None:
    """A period past the key names' limit let the work run, then failed its record ("index row
    requires ... bytes") at every try, each retry doing the work again; a NUL failed with the driver's
    DataError. Both are now settings to fix: refused before any connection, naming once_per, no retry
    (review -87)."""
    from airflow_pglock.keys import MAX_KEY_NAME_BYTES
    from airflow_pglock.run_rules import MAX_PERIOD_BYTES

    assert MAX_PERIOD_BYTES == MAX_KEY_NAME_BYTES == 2048, "a period is held to the key names' limit"
    schema.migrate(ledger_db)
    result = run_dag(PERIOD_DAG, "bad_periods")
    log = "".join(capfd.readouterr())
    assert result.states == {("nul", -1): "failed", ("long", -1): "failed"}
    assert result.tries == {("nul", -1): 1, ("long", -1): 1}, "a setting to fix was retried"
    assert "WORK RAN" not in log, "the work ran with a period that cannot be recorded"
    assert "once_per must render to a period without NUL characters" in log and "'2026\\x0012'" in log
    assert "once_per rendered to a period of 12800 bytes in UTF-8; a period is at most 2048 bytes" in log
    assert "... (12800 characters)" in log, "the value is shown shortened"
    assert "DataError" not in log and "index row" not in log
    assert ledger_db.execute("SELECT count(*) FROM pglock.completions").fetchone()[0] == 0
    assert advisory_locks(ledger_db) == []
