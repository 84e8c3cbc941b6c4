"""Shared fixtures: a real PostgreSQL (PGLOCK_TEST_DSN or a throwaway cluster) and a real Airflow.

Airflow reads AIRFLOW_HOME when it is first imported, so the throwaway Airflow home is
set up here, at import time, before any test module imports airflow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="pglock-airflow-home-"))
DAGS_FOLDER = AIRFLOW_HOME / "dags"
DAGS_FOLDER.mkdir()
os.environ.update(
    {
        "AIRFLOW_HOME": str(AIRFLOW_HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False",
    }
)

from devtools.pgcluster import Cluster  # noqa: E402
from tests.helpers import TEST_CONN_ID, wait_until_no_sessions  # noqa: E402

TEST_DATABASE = os.environ.get("PGLOCK_TEST_DATABASE", "pglock_tests")  # dev.py gives each part of the suite its own
pytest_plugins = ["tests.matrix"]  # records which public feature passed on this Airflow / Python


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(AIRFLOW_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """DSN of a PostgreSQL server the tests may create databases on."""
    configured = os.environ.get("PGLOCK_TEST_DSN")
    if configured:
        yield configured
        return
    cluster = Cluster().init().start()
    try:
        yield cluster.dsn
    finally:
        cluster.destroy()


@pytest.fixture(scope="session")
def dsn(pg_server: str) -> str:
    """A fresh database for this test session; the Airflow connection TEST_CONN_ID points at it."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [TEST_DATABASE],
        )
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(TEST_DATABASE)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEST_DATABASE)))
    info = psycopg.conninfo.conninfo_to_dict(pg_server)
    info["dbname"] = TEST_DATABASE
    test_dsn = psycopg.conninfo.make_conninfo(**info)
    uri = "postgresql://{user}@{host}:{port}/{db}".format(
        user=info.get("user", "postgres"),
        host=info.get("host", "127.0.0.1"),
        port=info.get("port", 5432),
        db=TEST_DATABASE,
    )
    os.environ[f"AIRFLOW_CONN_{TEST_CONN_ID.upper()}"] = uri
    os.environ["AIRFLOW_CONN_POSTGRES_DEFAULT"] = uri
    return test_dsn


@pytest.fixture
def admin(dsn: str) -> Iterator[object]:
    """An autocommit connection for assertions; after the test, no other session may remain."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True, application_name="pglock-tests admin") as conn:
        yield conn
        leftovers = wait_until_no_sessions(conn)
        assert leftovers == [], f"sessions left open by the test: {leftovers}"


@pytest.fixture
def scopes_db(admin: Any) -> Iterator[Any]:
    """``admin`` on a lock database with airflow-pglock's schema freshly installed (init-db), dropped after."""
    from airflow_pglock.pg import schema

    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")
    schema.migrate(admin)
    yield admin
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")


@pytest.fixture
def hook(dsn: str) -> object:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    return AdvisoryLockHook(dsn=dsn)


@pytest.fixture
def holder_hook(dsn: str) -> object:
    """A hook for locks a test holds for a long time without a heartbeat (a 600 s lease,
    so that a slow run cannot see the server end the idle holder after the default 30 s)."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.liveness import Liveness

    return AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=600))


@pytest.fixture
def statsd(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Airflow's StatsD metrics (with InfluxDB-style tags) sent to a socket the test reads."""
    try:
        from airflow.sdk._shared.observability.metrics import stats as sdk_stats
    except ImportError:
        pytest.skip(
            "this metrics test resets the Task SDK's Stats (Airflow 3.2+); older Airflow picks its "
            "StatsD client once at import"
        )

    from tests.statsd import StatsdListener

    listener = StatsdListener()
    for name, value in {
        "STATSD_ON": "True",
        "STATSD_HOST": "127.0.0.1",
        "STATSD_PORT": str(listener.port),
        "STATSD_PREFIX": "airflow",
        "STATSD_INFLUXDB_ENABLED": "True",
    }.items():
        monkeypatch.setenv(f"AIRFLOW__METRICS__{name}", value)
    # Start from "Stats not set up in this process" (as in a fresh task process); restored after.
    monkeypatch.setattr(sdk_stats, "_factory", None)
    monkeypatch.setattr(sdk_stats, "_backend", None)
    yield listener
    listener.close()


@pytest.fixture(scope="session")
def airflow_db(dsn: str) -> Path:
    """A migrated Airflow metadata DB (SQLite) in the throwaway AIRFLOW_HOME."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"], capture_output=True, text=True, env=os.environ.copy()
    )
    assert result.returncode == 0, f"airflow db migrate failed:\n{result.stdout}\n{result.stderr}"
    assert time.monotonic() - started < 600
    return AIRFLOW_HOME
