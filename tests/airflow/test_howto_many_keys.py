"""docs/howto-many-keys.md: its DAG runs as written (dag.test) and skips the tenant another job holds."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from tests.helpers import TEST_CONN_ID, advisory_locks, run_dag

pytestmark = pytest.mark.airflow

HOWTO = Path(__file__).resolve().parents[2] / "docs" / "howto-many-keys.md"


def test_the_howto_dag_skips_tenants_another_job_holds(
    airflow_db: Any, holder_hook: AdvisoryLockHook, admin: Any, capfd: Any
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", HOWTO.read_text(), re.DOTALL)
    [source] = [block for block in blocks if "@dag(" in block]
    source = source.replace('"postgres_locks"', repr(TEST_CONN_ID))  # the only change: the test's connection
    other_job = holder_hook.acquire("tenant-export/globex", application_name="pglock-tests other job")
    assert other_job is not None
    try:
        result = run_dag(source, "export_tenants")
    finally:
        other_job.release()
    log = "".join(capfd.readouterr())
    assert result.state("export_all") == "success"
    assert "exported ['acme', 'initech', 'umbrella']; skipped ['globex'] (held by another job)" in log
    assert "exporting globex" not in log
    assert advisory_locks(admin) == []
