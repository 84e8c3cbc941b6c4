"""docs/getting-started.md's first DAG, run in two deployments at once with the page's own commands.

The DAG file and the shell lines are read from the page's code blocks, so the page and the
test cannot drift apart. Only the lock database's URI (the one line the page tells the
reader to fill in) is replaced by this test's; everything else runs as written, with
`airflow db migrate`, `airflow-pglock init-db` and two `airflow dags test` in the
background, on real Airflow and real PostgreSQL.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import advisory_locks

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

if not importlib.import_module("airflow_pglock.compat").AIRFLOW_V_3_PLUS:
    pytest.skip("the page's DAG uses airflow.sdk (Airflow 3)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "getting-started.md"
DATABASE = "pglock_getting_started"
CONN_LINE = re.compile(r"^export AIRFLOW_CONN_POSTGRES_DEFAULT='[^']*'$", re.MULTILINE)


def _block(marker: str, language: str) -> str:
    found = re.search(rf"<!-- {marker}[^>]*-->\n```{language}\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    assert found is not None, f"docs/getting-started.md lost its {marker} block"
    return found[1]


@pytest.fixture
def lock_database(pg_server: str) -> Iterator[tuple[str, object]]:
    """A database of its own (init-db installs the pglock schema in it): its URI and an admin connection."""
    import psycopg
    from psycopg import sql

    def recreate(conn: psycopg.Connection[tuple[object, ...]], create: bool) -> None:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DATABASE)))
        if create:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))

    with psycopg.connect(pg_server, autocommit=True) as server:
        recreate(server, create=True)
        info = psycopg.conninfo.conninfo_to_dict(pg_server)
        uri = "postgresql://{}@{}:{}/{}".format(
            info.get("user", "postgres"), info.get("host", "127.0.0.1"), info.get("port", 5432), DATABASE
        )
        with psycopg.connect(uri, autocommit=True) as admin:
            yield uri, admin
        recreate(server, create=False)


def test_the_page_lists_the_commands_it_explains() -> None:
    commands = _block("two-deployments", "bash")
    assert len(CONN_LINE.findall(commands)) == 1, "the page's connection line changed shape: update this test"
    for needed in ("airflow db migrate", "airflow-pglock init-db", "airflow dags test first_lock", "wait"):
        assert needed in commands
    assert "def first_lock" in _block("first-dag", "python")


@pytest.mark.timeout(900)  # two Airflow homes migrated, then two `airflow dags test` at once
def test_two_deployments_run_the_first_dag_once(lock_database: tuple[str, object], tmp_path: Path) -> None:
    """One deployment's run completes, the other's is skipped and names the holder (its pid, DAG, task)."""
    uri, admin = lock_database
    (tmp_path / "dags").mkdir()
    (tmp_path / "dags" / "first_lock.py").write_text(_block("first-dag", "python"))  # "save it as dags/first_lock.py"
    commands = CONN_LINE.sub(f"export AIRFLOW_CONN_POSTGRES_DEFAULT='{uri}'", _block("two-deployments", "bash"))
    # A reader's shell: no Airflow settings of the test session; HOME is theirs (init-db's Airflow reads ~/airflow).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PGLOCK_TEST"))}
    env.update({"HOME": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"})
    result = subprocess.run(
        ["bash", "-e", "-c", commands], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900
    )
    logs = {name: (tmp_path / name).read_text() for name in ("a.log", "b.log") if (tmp_path / name).exists()}
    detail = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n" + "\n".join(v[-3000:] for v in logs.values())
    assert result.returncode == 0, detail

    outcomes = re.findall(r"pglock outcome=(\w+)", result.stdout)  # what the page's grep prints
    assert sorted(outcomes) == ["completed", "skipped"], detail
    skipped = next(line for line in result.stdout.splitlines() if "pglock outcome=skipped" in line)
    assert "key 'nightly-refresh'" in skipped and "is held by pid" in skipped, skipped
    # The holder: the other deployment (both run on this host: told apart by [pglock] deployment), DAG, task, run.
    holder = re.search(
        r"of deployment '(blue|green)' on host '[^']+' \(application_name 'pglock:(blue|green)@\S+ first_lock refresh ",
        skipped,
    )
    assert holder is not None and holder.group(1) == holder.group(2), skipped
    completed = next(line for line in result.stdout.splitlines() if "pglock outcome=completed" in line)
    # The winner's own line names its deployment.
    assert f" deployment={holder.group(1)} " in completed, (completed, skipped)
    assert all("state=success" in log for log in logs.values()), detail  # a skip does not fail the DAG run
    assert advisory_locks(admin) == []
    registered = admin.execute("SELECT count(*) FROM pglock.key_names WHERE name = 'nightly-refresh'")  # type: ignore[attr-defined]
    assert registered.fetchone()[0] == 1  # init-db's registry: `locks` can name the key
