"""Airflow plugins shipped with the provider (the advisory-lock page of the Airflow UI)."""
