"""Provider metadata, read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any

from airflow_pglock import __version__


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-pglock",
        "name": "PostgreSQL advisory locks (pglock)",
        "description": "Guard Airflow tasks with PostgreSQL advisory try-locks: one run at a time per key, "
        "across DAG runs, DAGs and Airflow deployments; the others are skipped and told who holds the lock.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "PostgreSQL advisory locks",
                "external-doc-url": "https://www.postgresql.org/docs/current/explicit-locking.html#ADVISORY-LOCKS",
                "tags": ["software"],
            }
        ],
        "hooks": [
            {
                "integration-name": "PostgreSQL advisory locks",
                "python-modules": ["airflow_pglock.hooks.advisory_lock"],
            }
        ],
        "operators": [
            {
                "integration-name": "PostgreSQL advisory locks",
                "python-modules": ["airflow_pglock.operators.advisory_lock"],
            }
        ],
        "sensors": [
            {
                "integration-name": "PostgreSQL advisory locks",
                "python-modules": ["airflow_pglock.sensors.advisory_lock"],
            }
        ],
        "triggers": [
            {
                "integration-name": "PostgreSQL advisory locks",
                "python-modules": ["airflow_pglock.triggers.advisory_lock"],
            }
        ],
        "connection-types": [],
        "task-decorators": [
            {"name": "advisory_lock", "class-name": "airflow_pglock.decorators.advisory_lock.advisory_lock_task"},
        ],
        # `airflow pglock ...` (Airflow >= 3.2 reads "cli"; older versions ignore it).
        "cli": ["airflow_pglock.cli.definition.get_pglock_cli_commands"],
        # The "Advisory locks" UI page (Airflow >= 3.1); also an `airflow.plugins` entry point.
        "plugins": [{"name": "pglock", "plugin-class": "airflow_pglock.plugins.lock_view.PgLockPlugin"}],
    }
