"""airflow-pglock: guard Airflow tasks with PostgreSQL advisory try-locks.

Importing this package is cheap: it pulls in neither Airflow nor psycopg. Use
``@task.advisory_lock`` in DAGs, or import from the submodules.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
