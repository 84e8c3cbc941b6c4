"""Fencing tokens: a holder that lost its lock cannot overwrite a newer holder's data.

``fencing=True`` gives every acquisition a token larger than all before it. The forecasts
table carries the token of the writer, and a trigger (``pglock.reject_stale_fencing_token``)
refuses any write whose token is older than the newest one issued for the key, e.g. from a
worker that froze, lost its lock, and woke up after another worker took over.
Needs ``airflow-pglock init-db`` once on the lock database. Run it as is:

    airflow dags test fenced_forecasts
"""

from __future__ import annotations

import pendulum

try:
    from airflow.sdk import dag, task
except ImportError:  # Airflow 2.x
    from airflow.decorators import dag, task

from airflow.providers.postgres.hooks.postgres import PostgresHook

from airflow_pglock.handle import LockHandle

KEY = "fenced-forecasts"


@dag(
    dag_id="fenced_forecasts",
    schedule="@hourly",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["pglock", "example"],
)
def fenced_forecasts() -> None:
    @task.advisory_lock(key=KEY, fencing=True)
    def refresh(lock: LockHandle | None = None) -> int:
        # Session mode: the writes go through another connection (here the same database,
        # but it could be any store that checks the token), so a holder that froze, lost its
        # lock and woke up later could still write: the token makes the table refuse it.
        assert lock is not None and lock.fencing_token is not None
        token = lock.fencing_token
        data = PostgresHook(postgres_conn_id="postgres_default").get_conn()
        try:
            with data.cursor() as cur:
                cur.execute(
                    "CREATE TABLE IF NOT EXISTS forecasts (station int PRIMARY KEY, temperature float8,"
                    " fencing_token bigint NOT NULL)"
                )
                cur.execute(
                    "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'forecasts_fenced') THEN"
                    " CREATE TRIGGER forecasts_fenced BEFORE INSERT OR UPDATE ON forecasts FOR EACH ROW"
                    " EXECUTE FUNCTION pglock.reject_stale_fencing_token('fenced-forecasts'); END IF; END $$"
                )
                for station in range(1, 11):
                    cur.execute(
                        "INSERT INTO forecasts VALUES (%s, %s, %s) ON CONFLICT (station) DO UPDATE"
                        " SET temperature = excluded.temperature, fencing_token = excluded.fencing_token",
                        [station, 15.0 + station / 10, token],
                    )
            data.commit()
        finally:
            data.close()
        return token

    refresh()


fenced_forecasts_dag = fenced_forecasts()
