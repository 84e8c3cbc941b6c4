"""The Airflow facade of the lock database: :class:`~airflow_pglock.hooks.advisory_lock.AdvisoryLockHook`."""

#: The Airflow connection a lock uses unless told otherwise (the hook's ``default_conn_name``).
DEFAULT_CONN_ID = "postgres_default"
