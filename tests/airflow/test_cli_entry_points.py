"""The installed entry points: the ``airflow-pglock`` console script and ``airflow pglock`` (Airflow >= 3.2).

Each runs in a new process, as an operator would run it: stdout must be nothing but the
result (JSON stays parseable), the exit codes are the documented ones, and a connection
stored in Airflow's metadata database (not only AIRFLOW_CONN_*) is found.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_pglock.compat import HAS_PROVIDER_CLI, PROVIDER_CLI_SINCE
from airflow_pglock.keys import LockKey
from tests.ops_helpers import dsn_uri, hold, run_console_script, scratch_database

pytestmark = pytest.mark.airflow

COMMANDS = ("locks", "key", "doctor", "init-db")


@pytest.fixture
def ops_dsn(pg_server: str) -> Iterator[str]:
    with scratch_database(pg_server) as dsn:
        yield dsn


@pytest.mark.matrix("console-script")
def test_console_script_reads_a_metadata_db_connection(airflow_db: Path, ops_dsn: str) -> None:
    from airflow.models import Connection
    from airflow.utils.session import create_session

    with create_session() as session:  # a connection only the metadata database knows
        session.add(Connection(conn_id="pglock_meta_only", uri=dsn_uri(ops_dsn)))
    holder = hold(ops_dsn, LockKey.from_name("console-key").numbers, application_name="pglock cdag ctask man__r1")
    holder_pid = holder.info.backend_pid
    try:
        result = run_console_script("locks", "--conn-id", "pglock_meta_only", "--output", "json")
    finally:
        holder.close()
        with create_session() as session:
            session.query(Connection).filter(Connection.conn_id == "pglock_meta_only").delete()
    assert result.code == 0, result.err
    [entry] = json.loads(result.out)["locks"]  # stdout is only the JSON document
    assert entry["pid"] == holder_pid
    assert entry["airflow"] == {"dag_id": "cdag", "task_id": "ctask", "run_id": "manual__r1", "map_index": -1}
    helped = run_console_script("--help")
    assert helped.code == 0 and all(command in helped.out for command in COMMANDS)
    assert "exit codes" in helped.out
    assert run_console_script("locks", "--output", "yaml").code == 2


@pytest.mark.matrix("cli-group", since=PROVIDER_CLI_SINCE)
@pytest.mark.skipif(
    not HAS_PROVIDER_CLI,
    reason="`airflow pglock` comes from the provider's 'cli' entry, which Airflow reads from 3.2",
)
def test_airflow_pglock_group(ops_dsn: str) -> None:
    holder = hold(ops_dsn, (77,))
    try:
        group = subprocess.run(
            [sys.executable, "-m", "airflow", "pglock", "locks", "--dsn", ops_dsn, "--output=json"],
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        holder.close()
    assert group.returncode == 0, group.stderr
    assert [e["key"]["numbers"] for e in json.loads(group.stdout)["locks"]] == [[77]]
    missing = subprocess.run(
        [sys.executable, "-m", "airflow", "pglock", "doctor", "--conn-id", "pglock_no_such_conn"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert missing.returncode == 3 and "'pglock_no_such_conn' was not found" in missing.stderr
