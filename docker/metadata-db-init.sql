-- One metadata database per Airflow deployment (they share nothing else but the lock database).
CREATE DATABASE airflow_a OWNER airflow;
CREATE DATABASE airflow_b OWNER airflow;
