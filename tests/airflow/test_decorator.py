"""@task.advisory_lock in a real Airflow 3 (dag.test) against a real PostgreSQL.

Each dag.test() run costs seconds, so one DAG exercises many behaviours at once; the test
holds some keys itself before the run, as another deployment would.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from tests.helpers import advisory_locks, run_dag

pytestmark = pytest.mark.airflow

GUARDED_DAG = """
import threading
import time

import pendulum
from airflow.sdk import dag, task

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

CONN = "pglock_test"


@dag(dag_id="guarded", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def guarded():
    @task.advisory_lock(postgres_conn_id=CONN, key="free-key")
    def runs_when_free(lock):
        assert lock.key.name == "free-key", lock
        assert lock.connection is None  # session mode: the connection is the guard's own
        return {"ran": True, "key": lock.key.numbers[0]}

    @task
    def reads_xcom(value):
        assert value["ran"] is True
        return "xcom ok"

    @task.advisory_lock(postgres_conn_id=CONN, key="busy-key")
    def skipped_when_busy():
        raise AssertionError("must not run while another session holds busy-key")

    @task
    def after_skip_default():
        raise AssertionError("all_success downstream of a skipped task is skipped too")

    @task(trigger_rule="none_failed")
    def after_skip_none_failed():
        return "ran after a skip"

    @task.advisory_lock(postgres_conn_id=CONN, key="fail-key")
    def raises():
        raise ValueError("protected work failed")

    @task.advisory_lock(postgres_conn_id=CONN, key="busy-fail-key", on_busy="fail")
    def fails_when_busy():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id=CONN, tenant_arg="tenant_id")
    def export_one(tenant_id: int):
        return tenant_id

    @task
    def hold_wait_key_briefly():
        hook = AdvisoryLockHook(CONN)
        held = hook.acquire("wait-key", application_name="pglock-tests brief holder")
        assert held is not None
        threading.Timer(2.0, held.release).start()

    @task.advisory_lock(postgres_conn_id=CONN, key="wait-key", on_busy="wait", wait_timeout=30)
    def waits_then_runs():
        return "waited"

    @task.advisory_lock(postgres_conn_id=CONN, key="wait-timeout-key", on_busy="wait", wait_timeout=0.5)
    def waits_then_skips():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id=CONN, key=(42, 1001), mode="transaction")
    def settle(lock):
        assert lock.mode == "transaction"
        lock.connection.execute("INSERT INTO settlements (id, status) VALUES (1, 'processed')")
        return "settled"

    @task.advisory_lock(postgres_conn_id=CONN, key=(42, 1002), mode="transaction")
    def settle_and_fail(lock):
        lock.connection.execute("INSERT INTO settlements (id, status) VALUES (2, 'processed')")
        raise RuntimeError("settlement failed after writing")

    @task.advisory_lock(postgres_conn_id=CONN, key="readers", shared=True)
    def shared_reader():
        return "read"

    @task.advisory_lock(postgres_conn_id=CONN, tenant="{{ params.tenant }}")
    def templated_tenant(lock):
        return lock.key.name

    reads_xcom(runs_when_free())
    skipped = skipped_when_busy()
    skipped >> after_skip_default()
    skipped >> after_skip_none_failed()
    raises()
    fails_when_busy()
    export_one.expand(tenant_id=[1, 2, 3])
    hold_wait_key_briefly() >> waits_then_runs()
    waits_then_skips()
    settle()
    settle_and_fail()
    shared_reader()
    templated_tenant()


guarded_dag = guarded()
"""


@pytest.fixture
def settlements(admin: Any) -> Any:
    admin.execute("DROP TABLE IF EXISTS settlements; CREATE TABLE settlements (id int PRIMARY KEY, status text)")
    yield admin
    admin.execute("DROP TABLE settlements")


@pytest.mark.matrix("task-session", "task-transaction", "tenant-arg")
def test_guarded_dag(airflow_db: Any, holder_hook: AdvisoryLockHook, settlements: Any, capfd: Any) -> None:
    hook = holder_hook
    held = [
        hook.acquire("busy-key", application_name="other deployment"),
        hook.acquire("busy-fail-key", application_name="other deployment"),
        hook.acquire("wait-timeout-key", application_name="other deployment"),
        hook.acquire(LockKey.for_task("guarded", "export_one", "2"), application_name="other deployment"),
        hook.acquire("readers", shared=True, application_name="another reader"),
    ]
    assert all(h is not None for h in held)
    try:
        result = run_dag(GUARDED_DAG, "guarded", conf={"tenant": "acme"})
    finally:
        for h in held:
            assert h is not None
            h.release()
    output = capfd.readouterr()
    log = output.out + output.err

    assert result.state("runs_when_free") == "success"
    assert result.state("reads_xcom") == "success"
    assert result.state("skipped_when_busy") == "skipped"
    assert result.state("after_skip_default") == "skipped"
    assert result.state("after_skip_none_failed") == "success"
    assert result.state("raises") == "failed"
    assert result.state("fails_when_busy") == "failed"
    assert [result.state("export_one", i) for i in range(3)] == ["success", "skipped", "success"]
    assert result.state("waits_then_runs") == "success"
    assert result.state("waits_then_skips") == "skipped"
    assert result.state("settle") == "success"
    assert result.state("settle_and_fail") == "failed"
    assert result.state("shared_reader") == "success"
    assert result.state("templated_tenant") == "success"

    busy = LockKey.from_name("busy-key")
    skip_line = next(line for line in log.splitlines() if "outcome=skipped" in line and "'busy-key'" in line)
    assert str(busy.numbers[0]) in skip_line
    assert f"pid {held[0].server.backend_pid}" in skip_line  # type: ignore[union-attr]
    assert "'other deployment'" in skip_line and "holding ExclusiveLock since" in skip_line
    assert "after waiting 0.5 s" in log
    assert "ValueError: protected work failed" in log
    assert "(on_busy='fail')" in log

    # Exactly one outcome line per guarded execution (3 mapped + 10 other guarded tasks).
    outcomes = re.findall(r"pglock outcome=(\w+)", log)
    assert len(outcomes) == 13, outcomes
    assert sorted(set(outcomes)) == ["completed", "failed", "skipped"]

    # Transaction mode: committed with the lock, rolled back on error.
    assert settlements.execute("SELECT id, status FROM settlements ORDER BY id").fetchall() == [(1, "processed")]
    # Nothing left behind: no advisory lock, and (admin fixture) no open session.
    assert advisory_locks(settlements) == []
