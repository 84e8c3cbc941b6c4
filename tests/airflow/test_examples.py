"""The example DAGs in dags/ import cleanly and run as they are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import advisory_locks, run_dag

pytestmark = pytest.mark.airflow
DAGS = Path(__file__).resolve().parents[2] / "dags"
ROOT = DAGS.parent


@pytest.mark.matrix("examples")
def test_example_dags_import_without_errors() -> None:
    from tests.sdk import DagBag

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    assert {"forecast_refresh", "daily_settlement", "tenant_exports", "fenced_forecasts"} <= set(bag.dag_ids)
    from airflow_pglock.compat import HAS_LOCK_SCOPE

    assert ("ingestion_refresh" in bag.dag_ids) == HAS_LOCK_SCOPE  # lock scopes need Airflow 3


def test_settlement_and_exports_run(airflow_db: Any, admin: Any, tmp_path: Path) -> None:
    from airflow_pglock.pg import schema

    os.environ["PGLOCK_EXPORT_DIR"] = str(tmp_path)
    admin.execute("DROP TABLE IF EXISTS settlements; DROP SCHEMA IF EXISTS pglock CASCADE")
    schema.migrate(admin)  # tenant_exports records each exported day (once_per)
    settlement = run_dag((DAGS / "daily_settlement.py").read_text(), "daily_settlement")
    assert settlement.state("settle") == "success"
    processed = admin.execute("SELECT count(*) FROM settlements WHERE status = 'processed'").fetchone()[0]
    assert processed == 25

    exports = run_dag(
        (DAGS / "tenant_exports.py").read_text(), "tenant_exports", conf={"tenants": [3, 4], "work_seconds": 0}
    )
    assert exports.state("export_tenant", 0) == exports.state("export_tenant", 1) == "success"
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == ["3", "4"]
    assert advisory_locks(admin) == []
    admin.execute("DROP TABLE settlements; DROP SCHEMA pglock CASCADE")


@pytest.mark.slow
def test_the_demo_command(tmp_path: Path) -> None:
    """The README's demo: two deployments; forecast_refresh runs in one and skips in the other; A exports one
    slow tenant, B all four: each tenant exported exactly once, B's export of A's tenant deferring until the
    release, then finding the day done."""
    import re

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PGLOCK_TEST"))}
    result = subprocess.run(
        [sys.executable, str(ROOT / "devtools" / "demo.py")], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "starting an embedded PostgreSQL" in out
    assert "forecast_refresh ran 1 time(s) across 2 deployments" in out
    assert "SKIPPED  key 'refresh-forecasts'" in out and "is held by pid" in out

    rows = re.findall(r"^  deployment ([AB])  export tenant (\d)\s+(\w+)\s+(.*)$", out, re.MULTILINE)
    for number in "1234":
        tenant = [(who, verb, detail) for who, i, verb, detail in rows if i == number]
        ran = [who for who, verb, _ in tenant if verb == "RAN"]
        assert ran == (["A"] if number == "1" else ["B"]), (number, tenant)  # exactly once across the two
        assert all(f"export_tenant/{number}'" in detail for _, verb, detail in tenant if verb == "RAN"), tenant
    # B's export of A's tenant deferred while A held it, then took the key and found the day exported:
    # skipped by once_per, never run, never failed.
    slow = [(verb, detail) for who, i, verb, detail in rows if i == "1" and who == "B"]
    assert [verb for verb, _ in slow] == ["DEFERRED", "SKIPPED"], slow
    assert "is held by pid" in slow[0][1] and "deployment-A" in slow[0][1], slow
    assert "already done for period" in slow[1][1] and "(once_per)" in slow[1][1], slow
    assert [who for who, *_ in rows] == ["A", "B", "B", "B", "B", "B"], rows  # A ran one tenant; B tried all four
    written = re.search(r"export files written: (\d+) for 4 tenants \((.*)\)\.", out)
    assert written is not None, out
    assert written[1] == "4"
    assert re.fullmatch(r"tenant 1 by [AB], tenant 2 by [AB], tenant 3 by [AB], tenant 4 by [AB]", written[2])
    from airflow_pglock.compat import HAS_LOCK_SCOPE

    if not HAS_LOCK_SCOPE:
        assert "lock scopes need Airflow 3" in out, out
        return
    # The lock scope: A's three tasks ran in it; B's setup found it held, naming A's run (or A's task).
    assert "ingestion_refresh: the scope's tasks ran in deployment(s) A;" in out, out
    assert re.search(
        # between A's tasks its scope's row holds the key; while one of them runs, that task does
        r"^  deployment B  refresh\.pglock_scope_enter\s+SKIPPED\s+key 'ingestion-server' .*is held by "
        r"(the lock scope of deployment-A: ingestion_refresh |pid \d+ of deployment 'deployment-A')",
        out,
        re.MULTILINE,
    ), out
    for task in ("refresh.trigger_refresh", "refresh.wait_for_refresh", "refresh.promote"):
        assert re.search(rf"^  deployment A  {re.escape(task)}\s+RAN", out, re.MULTILINE), (task, out)


@pytest.mark.slow
def test_the_getting_started_dags_test_commands(airflow_db: Any, admin: Any, tmp_path: Path) -> None:
    """docs/getting-started.md's `airflow dags test ...` lines, run as written with dags/ as the dags folder."""
    import re

    guide = (ROOT / "docs" / "getting-started.md").read_text()
    block = re.search(r"<!-- dags-test[^>]*-->\n```bash\n(.*?)```", guide, re.DOTALL)
    assert block is not None, "docs/getting-started.md lost its dags-test block"
    commands = [line for line in block[1].splitlines() if line.strip()]
    assert commands and all(line.startswith("airflow dags test ") for line in commands)
    env = {**os.environ, "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS)}  # "copy them into your dags folder"
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    for command in commands:
        result = subprocess.run(
            ["bash", "-e", "-c", command], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
        )
        out = result.stdout + result.stderr
        assert result.returncode == 0, f"{command}:\n{out[-3000:]}"
        assert "pglock outcome=completed" in out, f"{command}: no guarded task completed\n{out[-3000:]}"
    assert advisory_locks(admin) == []


def test_fenced_forecasts_refuses_a_stale_writer(airflow_db: Any, admin: Any) -> None:
    import psycopg

    from airflow_pglock.pg import schema

    admin.execute("DROP TABLE IF EXISTS forecasts; DROP SCHEMA IF EXISTS pglock CASCADE")
    schema.migrate(admin)
    try:
        first = run_dag((DAGS / "fenced_forecasts.py").read_text(), "fenced_forecasts")
        second = run_dag((DAGS / "fenced_forecasts.py").read_text(), "fenced_forecasts")
        assert first.state("refresh") == second.state("refresh") == "success"
        newest = admin.execute("SELECT max(fencing_token) FROM forecasts").fetchone()[0]
        assert admin.execute("SELECT count(DISTINCT fencing_token) FROM forecasts").fetchone()[0] == 1
        with pytest.raises(psycopg.errors.CheckViolation, match="stale fencing token"):
            admin.execute("UPDATE forecasts SET temperature = -99, fencing_token = %s", [newest - 1])
    finally:
        admin.execute("DROP TABLE IF EXISTS forecasts; DROP SCHEMA IF EXISTS pglock CASCADE")
