"""``airflow-pglock`` (console script) and ``airflow pglock`` (Airflow >= 3.2): operate the locks."""
