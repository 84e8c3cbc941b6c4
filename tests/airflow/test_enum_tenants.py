"""An enum tenant locks its value's key through every adapter, Jinja rendering included (a
(str, Enum) member is a str, so Airflow renders it as a template: Jinja spells it by its name)."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.liveness import Liveness
from tests.helpers import advisory_locks, run_dag

pytestmark = pytest.mark.airflow

ENUM_DAG = """
import enum

import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock
from airflow_pglock.operators.advisory_lock import guarded

CONN = "pglock_test"


class Shop(str, enum.Enum):
    ACME = "acme"


class Plain(int, enum.Enum):
    ONE = 1


@dag(dag_id="enum_tenants", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def enum_tenants():
    @task.advisory_lock(key="exports", tenant=Shop.ACME, postgres_conn_id=CONN)
    def decorated_str_enum():
        raise AssertionError("must not run: exports/acme is held")

    @task.advisory_lock(key="exports", tenant=Plain.ONE, postgres_conn_id=CONN)
    def decorated_int_enum():
        raise AssertionError("must not run: exports/1 is held")

    @task
    @advisory_lock(key="exports", tenant=Shop.ACME, postgres_conn_id=CONN)
    def composable_str_enum():
        raise AssertionError("must not run: exports/acme is held")

    guarded(BashOperator(task_id="guarded_str_enum", bash_command="exit 3"), key="exports", tenant=Shop.ACME,
            postgres_conn_id=CONN)

    decorated_str_enum()
    decorated_int_enum()
    composable_str_enum()


enum_tenants_dag = enum_tenants()
"""


def test_an_enum_tenant_is_the_lock_of_its_value_in_every_adapter(airflow_db: Any, dsn: str, admin: Any) -> None:
    holder = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=600))  # no heartbeat: a long lease
    held = [holder.acquire(name, application_name="other deployment") for name in ("exports/acme", "exports/1")]
    try:
        result = run_dag(ENUM_DAG, "enum_tenants")
    finally:
        for lock in held:
            assert lock is not None
            lock.release()
    assert result.states == {
        ("decorated_str_enum", -1): "skipped",
        ("decorated_int_enum", -1): "skipped",
        ("composable_str_enum", -1): "skipped",
        ("guarded_str_enum", -1): "skipped",
    }
    assert advisory_locks(admin) == []
