"""docs/howto-tenant-locks.md: each of its DAG files runs as written (dag.test) and does what the page says."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from tests.helpers import advisory_locks, advisory_locks_once_exited, run_dag

pytestmark = pytest.mark.airflow

HOWTO = Path(__file__).resolve().parents[2] / "docs" / "howto-tenant-locks.md"


def _dag_source(dag_id: str) -> str:
    """The page's DAG file that defines `dag_id` (its `@dag` function); the connection is postgres_default."""
    blocks = re.findall(r"```python\n(.*?)```", HOWTO.read_text(), re.DOTALL)
    [source] = [block for block in blocks if re.search(rf"^def {dag_id}\(", block, re.MULTILINE)]
    return source


def test_every_snippet_is_a_whole_dag_file() -> None:
    blocks = re.findall(r"```python\n(.*?)```", HOWTO.read_text(), re.DOTALL)
    assert len(blocks) == 4
    assert all("from airflow.sdk import dag, task" in block and "\n@dag(" in block for block in blocks)


def test_tenant_arg_skips_only_the_tenant_held_elsewhere(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any
) -> None:
    elsewhere = holder_hook.acquire("tenant_export/export_tenant/3", application_name="pglock-tests elsewhere")
    assert elsewhere is not None
    try:
        result = run_dag(_dag_source("tenant_export"), "tenant_export")
    finally:
        elsewhere.release()
    states = [result.state("export_tenant", index) for index in range(4)]
    assert states == ["success", "success", "skipped", "success"]  # only export_tenant[2], tenant 3
    assert advisory_locks(admin) == []


def test_tenant_from_the_run_conf(airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any) -> None:
    source = _dag_source("tenant_export_on_request")
    assert run_dag(source, "tenant_export_on_request", conf={"tenant_id": 7}).state("export") == "success"
    elsewhere = holder_hook.acquire("export/7", application_name="pglock-tests elsewhere")
    assert elsewhere is not None
    try:
        assert run_dag(source, "tenant_export_on_request", conf={"tenant_id": 7}).state("export") == "skipped"
        assert run_dag(source, "tenant_export_on_request", conf={"tenant_id": 8}).state("export") == "success"
    finally:
        elsewhere.release()
    assert advisory_locks(admin) == []


def test_once_per_runs_each_tenant_once_a_day(airflow_db: Any, admin: Any) -> None:
    from airflow_pglock.pg import schema

    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")
    schema.migrate(admin)  # the page's `airflow-pglock init-db`
    try:
        source = _dag_source("tenant_export_daily")
        first = run_dag(source, "tenant_export_daily")
        assert [first.state("export_tenant", i) for i in range(4)] == ["success"] * 4
        again = run_dag(source, "tenant_export_daily")  # the same day (ds): already done
        assert [again.state("export_tenant", i) for i in range(4)] == ["skipped"] * 4
    finally:
        admin.execute("DROP SCHEMA pglock CASCADE")
    assert advisory_locks_once_exited(admin) == []  # a once_per skip gives the key back


def test_transaction_mode_with_a_completion_row(airflow_db: Any, admin: Any) -> None:
    source = _dag_source("tenant_process")
    [create] = re.findall(r"^#\s+(CREATE TABLE tenant_done .*);$", source, re.MULTILINE)  # the page's "once"
    admin.execute("DROP TABLE IF EXISTS tenant_done")
    admin.execute(create)
    try:
        first = run_dag(source, "tenant_process")
        assert [first.state("process", i) for i in range(4)] == ["success"] * 4
        assert admin.execute("SELECT count(*) FROM tenant_done").fetchone()[0] == 4
        again = run_dag(source, "tenant_process")
        assert [again.state("process", i) for i in range(4)] == ["skipped"] * 4
        assert admin.execute("SELECT count(*) FROM tenant_done").fetchone()[0] == 4  # the skips rolled back
    finally:
        admin.execute("DROP TABLE tenant_done")
    assert advisory_locks(admin) == []
