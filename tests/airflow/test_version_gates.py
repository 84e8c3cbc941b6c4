"""Features that need a newer Airflow are absent on older lines: a clear refusal, never a parse failure.

On a line that has the feature these tests skip; the feature's own tests
(test_cli_entry_points, test_ui_page) run there instead.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from airflow_pglock.compat import HAS_PROVIDER_CLI, HAS_UI_PAGE, PROVIDER_CLI_SINCE, UI_PAGE_SINCE

pytestmark = pytest.mark.airflow


@pytest.mark.matrix("cli-group", since=PROVIDER_CLI_SINCE)
@pytest.mark.skipif(HAS_PROVIDER_CLI, reason="this Airflow has `airflow pglock` (test_cli_entry_points runs it)")
def test_airflow_pglock_group_is_refused_before_3_2(airflow_db: Any) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "airflow", "pglock", "locks"], capture_output=True, text=True, timeout=180
    )
    assert refused.returncode != 0
    assert "invalid choice: 'pglock'" in refused.stderr, refused.stderr[-2000:]
    # The provider's 'cli' entry is ignored there, not an error: the provider still registers.
    providers = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "list", "-o", "plain"], capture_output=True, text=True
    )
    assert providers.returncode == 0 and "airflow-provider-pglock" in providers.stdout, providers.stderr[-2000:]


@pytest.mark.matrix("ui-page", since=UI_PAGE_SINCE)
@pytest.mark.skipif(HAS_UI_PAGE, reason="this Airflow serves the page (test_ui_page runs it)")
def test_ui_page_is_absent_before_3_1(airflow_db: Any) -> None:
    from airflow_pglock.plugins.lock_view import PgLockPlugin

    assert getattr(PgLockPlugin, "fastapi_apps", []) == []
    assert getattr(PgLockPlugin, "external_views", []) == []
    plugins = subprocess.run(
        [sys.executable, "-m", "airflow", "plugins", "-o", "plain"], capture_output=True, text=True, timeout=180
    )
    assert plugins.returncode == 0, plugins.stderr[-2000:]
    assert "pglock" in plugins.stdout and "error" not in plugins.stderr.lower(), plugins.stderr[-2000:]
