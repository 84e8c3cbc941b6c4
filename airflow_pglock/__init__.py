"""airflow-pglock: guard Airflow tasks with PostgreSQL advisory try-locks.

Importing this package is cheap: it pulls in neither Airflow nor psycopg. Use
``@task.advisory_lock`` in DAGs, or import from the submodules.
"""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    """``__version__``, read when first asked for (a DAG file's parse never pays for it)."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    version = _installed_version()
    globals()["__version__"] = version
    return version


def _installed_version() -> str:
    try:  # written by the build (setuptools-scm, from git): 0.1.devN+g<hash>
        from airflow_pglock._version import version
    except ImportError:  # a source tree that was never built: the installed distribution's, if any
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as distribution_version

        try:
            return distribution_version("airflow-provider-pglock")
        except PackageNotFoundError:
            return "0+unknown"
    return str(version)
