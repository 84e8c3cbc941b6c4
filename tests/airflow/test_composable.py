"""@advisory_lock under @task.branch / @task.short_circuit / @task, in a real Airflow 3 on a real PostgreSQL."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from devtools.pgcluster import free_port
from tests.helpers import advisory_locks, assert_unknown_param_reported, run_dag

pytestmark = pytest.mark.airflow

COMPOSABLE_DAG = """
import pendulum
from airflow.sdk import dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock

CONN = "pglock_test"


@dag(dag_id="composable", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"region": "eu"})
def composable():
    @task.branch
    @advisory_lock(key="report/choose", postgres_conn_id=CONN)
    def choose(lock, ti=None):
        assert lock.key.name == "report/choose", lock
        assert ti is not None and ti.task_id == "choose"  # the outer flavour still injects the context
        return "branch_a"

    @task.branch
    @advisory_lock(key="report/busy", postgres_conn_id=CONN)
    def choose_busy():
        raise AssertionError("must not run while another session holds report/busy")

    @task.short_circuit
    @advisory_lock(key="report/short", postgres_conn_id=CONN)
    def short():
        return False

    @task
    @advisory_lock(key="export", tenant_arg="tenant", postgres_conn_id=CONN)
    def export(tenant, lock):
        return lock.key.name

    @task
    @advisory_lock(key="report/{{ params.region }}", postgres_conn_id=CONN)
    def templated(lock):
        return lock.key.name

    @task
    def check(rendered):
        assert rendered == "report/eu", rendered

    @task
    @advisory_lock(key="{{ params.no_such_param }}", postgres_conn_id=CONN)
    def unknown_param():
        raise AssertionError("must not run")

    @task
    @advisory_lock(postgres_conn_id="pglock_unreachable")
    def unreachable():
        raise AssertionError("must not run")

    @task
    def branch_a():
        return "a"

    @task
    def branch_b():
        raise AssertionError("not chosen")

    @task
    def after_busy():
        raise AssertionError("downstream of a skipped branch")

    @task
    def after_short():
        raise AssertionError("short-circuited")

    choose() >> [branch_a(), branch_b()]
    choose_busy() >> after_busy()
    short() >> after_short()
    export.expand(tenant=["a", "b"])
    check(templated())
    unknown_param()
    unreachable()


composable_dag = composable()
"""


@pytest.fixture
def unreachable_conn() -> Any:
    name = "AIRFLOW_CONN_PGLOCK_UNREACHABLE"
    os.environ[name] = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres?connect_timeout=2"
    yield
    os.environ.pop(name, None)


@pytest.mark.matrix("branch")
def test_composable_decorator_under_other_task_flavours(
    airflow_db: Any, dsn: str, admin: Any, unreachable_conn: Any, capfd: Any
) -> None:
    holder = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=600))  # no heartbeat: a long lease
    held = [
        holder.acquire("report/busy", application_name="other deployment"),
        holder.acquire("export/b", application_name="other deployment"),
    ]
    try:
        result = run_dag(COMPOSABLE_DAG, "composable")
    finally:
        for lock in held:
            assert lock is not None
            lock.release()
    log = "".join(capfd.readouterr())

    assert result.states == {
        ("choose", -1): "success",
        ("branch_a", -1): "success",
        ("branch_b", -1): "skipped",
        ("choose_busy", -1): "skipped",
        ("after_busy", -1): "skipped",
        ("short", -1): "success",
        ("after_short", -1): "skipped",
        ("export", 0): "success",
        ("export", 1): "skipped",
        ("templated", -1): "success",
        ("check", -1): "success",
        ("unknown_param", -1): "failed",
        ("unreachable", -1): "failed",
    }, log[-4000:]

    busy = LockKey.from_name("report/busy")
    skip = next(line for line in log.splitlines() if "outcome=skipped" in line and "'report/busy'" in line)
    assert f"int64 {busy.numbers[0]}" in skip and "'other deployment'" in skip and "holding ExclusiveLock" in skip
    assert re.search(r"pglock outcome=completed key 'report/short' ", log)  # short-circuited after running
    assert_unknown_param_reported(log)
    assert "cannot connect to the lock database 'postgres' on 127.0.0.1" in log
    # choose, choose_busy, short, export x2, templated, unreachable: one outcome line each.
    assert len(re.findall(r"pglock outcome=", log)) == 7
    assert advisory_locks(admin) == []


def test_composable_decorator_refuses_bad_use() -> None:
    from airflow_pglock.decorators.advisory_lock import advisory_lock
    from tests.sdk import DAG, task

    @advisory_lock(key="k")
    def outside(lock: Any) -> None: ...

    with pytest.raises(LockConfigurationError, match=r"outside\(\) is guarded by @advisory_lock but was called"):
        outside()
    with pytest.raises(LockConfigurationError, match="receives the held lock; do not pass it yourself"):
        outside(lock=None)

    with DAG("composable_parse_errors", schedule=None):
        with pytest.raises(LockConfigurationError, match="below the @task decorator"):

            @advisory_lock(key="k")
            @task
            def upside_down() -> None: ...

        with pytest.raises(LockConfigurationError, match=r"tenant_arg='customer' is not an argument of work\(\)"):

            @advisory_lock(tenant_arg="customer")
            def work(tenant_id: int) -> None: ...

        with pytest.raises(LockConfigurationError, match="on_busy must be one of"):
            advisory_lock(on_busy="never")
        with pytest.raises(ValueError, match=r"3\.5"):

            @advisory_lock(key=3.5)  # type: ignore[arg-type]
            def bad_key() -> None: ...

        # The lock argument is hidden from the task flavour on top; the others stay.
        @task.branch
        @advisory_lock(key="k")
        def choose(day: str, lock: Any) -> str:
            return day

        choose("monday")
        assert list(choose.function_signature.parameters) == ["day"]  # type: ignore[attr-defined]
