"""Parsing a DAG file that uses the lock never loads psycopg nor the lock machinery.

The DAG processor imports every DAG file again and again; parsing never takes a lock, so
the hook, the guard, the heartbeat, the trigger and psycopg load only when a task runs.
Checked in a fresh interpreter (``sys.modules``) so that nothing imported by another
test hides a regression.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.airflow

ROOT = Path(__file__).resolve().parents[2]

#: One DAG using every form a DAG author writes, options included (they are checked at parse time).
DAG_FILE = """
import datetime as dt

import pendulum

try:  # Airflow 3
    from airflow.providers.standard.operators.bash import BashOperator
    from airflow.sdk import dag, task
except ImportError:  # Airflow 2.11
    from airflow.decorators import dag, task
    from airflow.operators.bash import BashOperator

from airflow_pglock.decorators.advisory_lock import advisory_lock
from airflow_pglock.operators.advisory_lock import guarded
from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor


@dag(schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"), catchup=False)
def parse_only():
    @task.advisory_lock(key="reports-{{ ds }}", on_busy="wait", wait_timeout=5, lease=dt.timedelta(seconds=20))
    def decorated():
        return 1

    @task
    @advisory_lock(key="composed", once_per="{{ ds }}", fencing=True)
    def composed():
        return 2

    sensor = AdvisoryLockSensor(task_id="wait_free", key="reports-{{ ds }}", poke_interval=1, timeout=5)
    bash = guarded(BashOperator(task_id="bash", bash_command="true"), key="bash", mode="transaction")
    sensor >> decorated() >> composed() >> bash


parse_only()
"""

#: Loaded only when a task executes (and every module of the lock database, ``airflow_pglock.pg``).
RUNTIME_ONLY = (
    "psycopg",
    "airflow_pglock.guard",
    "airflow_pglock.handle",
    "airflow_pglock.heartbeat",
    "airflow_pglock.interruption",
    "airflow_pglock.lock_set",
    "airflow_pglock.registry",
    "airflow_pglock.hooks.advisory_lock",
    "airflow_pglock.triggers.advisory_lock",
)

PROBE = textwrap.dedent(
    """
    import json, runpy, sys
    from airflow_pglock.compat import BaseOperator, BaseSensorOperator  # Airflow's own bases
    # Some lines load the trigger base themselves (2.11's sensor base on import, 3.0's operator
    # base when an operator is built): only what the provider adds to Airflow's own imports counts.
    BaseOperator(task_id="airflow_own_operator")
    BaseSensorOperator(task_id="airflow_own_sensor")
    airflow_loads_triggers = "airflow.triggers.base" in sys.modules
    namespace = runpy.run_path(sys.argv[1])
    dag = namespace["parse_only"]  # the @dag function; its DAG was built by the call at the end of the file
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("psycopg", "airflow_pglock")
                    or (m == "airflow.triggers.base" and not airflow_loads_triggers))
    print(json.dumps(loaded))
    """
)


@pytest.mark.matrix("parse-time")
def test_parsing_a_dag_file_loads_neither_psycopg_nor_the_guard(tmp_path: Path) -> None:
    dag_file = tmp_path / "parse_only.py"
    dag_file.write_text(DAG_FILE)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(dag_file)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "airflow_pglock.options" in loaded  # the options were checked while parsing
    leaked = [
        module
        for module in loaded
        if module.split(".")[0] == "psycopg" or module in RUNTIME_ONLY or module.startswith("airflow_pglock.pg.")
    ]
    if "airflow.triggers.base" in loaded:
        leaked.append("airflow.triggers.base")
    assert leaked == [], f"parsing the DAG file loaded {leaked}"


@pytest.mark.matrix("parse-time")
def test_a_bad_option_is_still_refused_at_parse_time(tmp_path: Path) -> None:
    dag_file = tmp_path / "parse_only.py"
    dag_file.write_text(DAG_FILE.replace('on_busy="wait"', 'on_busy="sometimes"'))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(dag_file)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "on_busy must be one of" in out.stderr and "got 'sometimes'" in out.stderr


def test_the_default_connection_id_is_the_hooks() -> None:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.options import LockOptions, declared
    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

    sensor_default = inspect.signature(AdvisoryLockSensor.__init__).parameters["postgres_conn_id"].default
    assert AdvisoryLockHook.default_conn_name == "postgres_default"
    assert declared(LockOptions)["postgres_conn_id"].default == sensor_default == AdvisoryLockHook.default_conn_name
