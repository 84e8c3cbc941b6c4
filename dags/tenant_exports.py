"""Per-tenant exports: one lock per tenant, each tenant exported once a day across deployments.

``tenant_arg="tenant_id"`` adds the mapped argument to the key
(``tenant_exports/export_tenant/<tenant_id>``). If another deployment is exporting tenant 7
right now, this deployment's tenant 7 *defers* (``on_busy="defer"``: it waits in the
triggerer, holding no worker slot) and tries again the moment the key is released; then
``once_per="{{ ds }}"`` finds the day already exported and skips it. The export file name
is deterministic, so a retry after a crash overwrites instead of duplicating. Needs
``airflow-pglock init-db`` once on the lock database (``once_per`` records completed days)
and an ``airflow triggerer`` (``airflow dags test`` runs the wait inline).

    airflow dags test tenant_exports
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
import time
from pathlib import Path

import pendulum

try:
    from airflow.sdk import dag, task
except ImportError:  # Airflow 2.x
    from airflow.decorators import dag, task

EXPORT_DIR = Path(os.environ.get("PGLOCK_EXPORT_DIR", Path(tempfile.gettempdir()) / "pglock-exports"))


@dag(
    dag_id="tenant_exports",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={"tenants": [1, 2, 3, 4, 5, 6, 7, 8], "work_seconds": 1},
    tags=["pglock", "example"],
)
def tenant_exports() -> None:
    @task
    def list_tenants(params: dict | None = None) -> list[int]:
        return [int(tenant) for tenant in (params or {}).get("tenants", [])]

    @task.advisory_lock(
        tenant_arg="tenant_id",
        on_busy="defer",  # busy: wait in the triggerer for the release, then try again
        wait_timeout=dt.timedelta(hours=1),
        once_per="{{ ds }}",  # ...and skip a tenant another deployment already exported today
    )
    def export_tenant(tenant_id: int, ds: str | None = None, params: dict | None = None) -> str:
        time.sleep(float((params or {}).get("work_seconds", 1)))
        EXPORT_DIR.mkdir(parents=True, exist_ok=True)
        target = EXPORT_DIR / f"tenant-{tenant_id}-{ds}.json"  # deterministic: retries overwrite
        target.write_text(json.dumps({"tenant": tenant_id, "day": ds}))
        return str(target)

    export_tenant.expand(tenant_id=list_tenants())


tenant_exports_dag = tenant_exports()
