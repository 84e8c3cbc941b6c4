"""Daily settlement in transaction mode: the lock and the writes share one transaction.

``mode="transaction"`` takes ``pg_try_advisory_xact_lock`` inside a transaction on the
lock's own connection and hands that connection to the function: the settlement rows are
committed together with the end of the lock, or rolled back with it if anything fails.
Run it as is:

    airflow dags test daily_settlement
"""

from __future__ import annotations

from typing import Any

import pendulum

try:
    from airflow.sdk import dag, task
except ImportError:  # Airflow 2.x
    from airflow.decorators import dag, task

from airflow_pglock.handle import LockHandle


@dag(
    dag_id="daily_settlement",
    schedule="0 2 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["pglock", "example"],
)
def daily_settlement() -> None:
    @task.advisory_lock(key="daily-settlement", mode="transaction")
    def settle(lock: LockHandle | None = None) -> dict[str, Any]:
        assert lock is not None and lock.connection is not None
        conn = lock.connection
        conn.execute(
            "CREATE TABLE IF NOT EXISTS settlements ("
            " id bigserial PRIMARY KEY, account_id int NOT NULL, amount numeric(12, 2) NOT NULL,"
            " status text NOT NULL DEFAULT 'pending', processed_at timestamptz)"
        )
        pending = conn.execute("SELECT count(*) FROM settlements WHERE status = 'pending'").fetchone()
        if pending is not None and pending[0] == 0:
            # Demo data, so that a fresh database has something to settle.
            conn.execute(
                "INSERT INTO settlements (account_id, amount)"
                " SELECT n, round((random() * 1000)::numeric, 2) FROM generate_series(1, 25) AS n"
            )
        processed = conn.execute(
            "UPDATE settlements SET status = 'processed', processed_at = now() WHERE status = 'pending' RETURNING id"
        ).fetchall()
        return {"processed": len(processed)}

    settle()


daily_settlement_dag = daily_settlement()
