"""Helpers shared by the tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEST_CONN_ID = "pglock_test"


def other_sessions(conn: Any) -> list[tuple[int, str]]:
    """Client sessions on this database other than ``conn``'s own."""
    rows = conn.execute(
        "SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend' ORDER BY pid"
    ).fetchall()
    return [(row[0], row[1]) for row in rows]


def advisory_locks(conn: Any) -> list[tuple[int, int, int, int, bool]]:
    """(pid, classid, objid, objsubid, granted) of every advisory lock in this database."""
    rows = conn.execute(
        "SELECT pid, classid::bigint, objid::bigint, objsubid, granted FROM pg_locks"
        " WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchall()
    return [tuple(row) for row in rows]


def wait_until_no_sessions(conn: Any, timeout: float = 5.0) -> list[tuple[int, str]]:
    """Poll until no other session remains (a closed client's backend exits asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        left = other_sessions(conn)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@dataclass
class DagResult:
    states: dict[tuple[str, int], str]
    run_id: str

    def state(self, task_id: str, map_index: int = -1) -> str:
        return self.states[(task_id, map_index)]


def write_dag(source: str, dag_id: str) -> Path:
    from tests.conftest import DAGS_FOLDER

    path = DAGS_FOLDER / f"{dag_id}.py"
    path.write_text(textwrap.dedent(source))
    return path


def run_dag(source: str, dag_id: str, conf: dict[str, Any] | None = None) -> DagResult:
    """Write a DAG file into the dags folder, load it and run it with ``dag.test()``."""
    path = write_dag(source, dag_id)
    module_name = f"pglock_test_dag_{dag_id}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    dags = [
        value for value in vars(module).values() if getattr(value, "dag_id", None) == dag_id and hasattr(value, "test")
    ]
    assert dags, f"no DAG {dag_id!r} in {path}"
    dag_run = dags[0].test(run_conf=conf)
    states = {
        (ti.task_id, ti.map_index): str(ti.state.value if hasattr(ti.state, "value") else ti.state)
        for ti in dag_run.get_task_instances()
    }
    return DagResult(states=states, run_id=dag_run.run_id)


def pglock_env() -> dict[str, str]:
    return dict(os.environ)
