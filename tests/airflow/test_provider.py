"""The provider registers with Airflow through its entry point."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.airflow


@pytest.mark.matrix("provider")
def test_providers_manager_knows_the_provider_and_its_decorator() -> None:
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "airflow-provider-pglock" in manager.providers
    decorators = manager.taskflow_decorators
    assert "advisory_lock" in decorators
    from airflow_pglock.decorators.advisory_lock import advisory_lock_task

    assert decorators["advisory_lock"] is advisory_lock_task


@pytest.mark.matrix("provider")
def test_airflow_providers_list_shows_it(airflow_db: Any) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "list", "-o", "plain"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "airflow-provider-pglock" in result.stdout


def test_importing_the_package_is_cheap() -> None:
    code = "import sys, airflow_pglock; print(sorted(m for m in ('airflow', 'psycopg') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
