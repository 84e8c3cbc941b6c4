"""The lock database layer: psycopg and every SQL statement of the provider; no Airflow."""
