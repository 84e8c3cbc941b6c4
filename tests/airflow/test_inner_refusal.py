"""A busy or already-done refusal raised *by the work* (e.g. an inner guard) is a failure of
the task, never a skip: only the task's own guard may turn busy/done into a skip."""

from __future__ import annotations

import re
from typing import Any

import pytest

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from tests.helpers import advisory_locks, held_lock, run_dag

pytestmark = pytest.mark.airflow

INNER_BUSY_DAG = """
import pendulum
from airflow.sdk import dag, task

from airflow_pglock.guard import LockGuard
from airflow_pglock.policy import LockPolicy
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey

CONN = "pglock_test"


@dag(dag_id="inner_busy", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def inner_busy():
    @task.advisory_lock(postgres_conn_id=CONN, key="outer-step", on_busy="skip", retries=0)
    def outer():
        print("step 1 done (irreversible)")
        inner = LockGuard(AdvisoryLockHook(CONN).database, LockKey.from_name("inner-step"), LockPolicy(on_busy="fail"))
        inner.run(lambda lock: print("step 2 done"))

    outer()


inner_busy_dag = inner_busy()
"""


def test_busy_inner_guard_fails_the_outer_task(airflow_db: Any, admin: Any, holder_hook: AdvisoryLockHook) -> None:
    with held_lock(holder_hook, "inner-step") as blocker:
        assert blocker is not None
        result = run_dag(INNER_BUSY_DAG, "inner_busy")
    assert result.state("outer") == "failed"


INNER_DECORATED_DAG = """
import pendulum
from airflow.sdk import dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock

CONN = "pglock_test"


@advisory_lock(postgres_conn_id={inner_conn!r}, key="inner-step", on_busy="skip", on_error="skip")
def step_2():
    print("step 2 done")


@dag(dag_id="inner_decorated", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def inner_decorated():
    @task.advisory_lock(postgres_conn_id=CONN, key="outer-step", on_busy="skip", retries=0)
    def outer():
        print("step 1 done (irreversible)")
        step_2()

    outer()


inner_decorated_dag = inner_decorated()
"""


@pytest.mark.parametrize(
    ("inner_conn", "why"),
    [("pglock_test", "busy (on_busy='skip')"), ("no_such_connection", "an error (on_error='skip')")],
)
def test_a_guarded_function_called_by_guarded_work_fails_that_task_never_skips_it(
    airflow_db: Any, admin: Any, holder_hook: AdvisoryLockHook, inner_conn: str, why: str
) -> None:
    """A function under ``@advisory_lock`` maps busy (and on_error='skip' errors) to a skip: right for
    the task it guards, wrong for a task whose guarded work called it after a step of its own."""
    with held_lock(holder_hook, "inner-step") as blocker:
        assert blocker is not None
        result = run_dag(INNER_DECORATED_DAG.format(inner_conn=inner_conn), "inner_decorated")
    assert result.state("outer") == "failed", why
    assert advisory_locks(admin) == []


DEFERRING_WORK_DAG = """
import pendulum
from airflow.sdk import dag, task

from airflow_pglock.compat import TaskDeferred

try:
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger
except ImportError:  # Airflow 2
    from airflow.triggers.temporal import DateTimeTrigger


@dag(dag_id="deferring_work", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def deferring_work():
    @task.advisory_lock(postgres_conn_id="pglock_test", key="deferring-work", retries=0)
    def defers():
        print("WORK STARTED")
        raise TaskDeferred(trigger=DateTimeTrigger(moment=pendulum.now("UTC").add(seconds=1)), method_name="execute")

    defers()


deferring_work_dag = deferring_work()
"""


def test_guarded_work_that_defers_fails_instead_of_resuming_without_the_lock(
    airflow_db: Any, admin: Any, capfd: Any
) -> None:
    result = run_dag(DEFERRING_WORK_DAG, "deferring_work")
    out = "".join(capfd.readouterr())
    assert result.state("defers") == "failed"
    assert "a deferred task holds no lock, and its resumed method would run without it" in out
    assert out.count("WORK STARTED") == 1, "never run again after a deferral"
    assert advisory_locks(admin) == []


THREADED_AND_STACKED_DAG = """
from concurrent.futures import ThreadPoolExecutor

import pendulum
from airflow.sdk import dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock

CONN = "pglock_test"


@advisory_lock(postgres_conn_id=CONN, key="inner-step", on_busy="skip")
def step_2():
    print("step 2 done")


@dag(dag_id="threaded_and_stacked", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def threaded_and_stacked():
    @task.advisory_lock(postgres_conn_id=CONN, key="outer-step", on_busy="skip", retries=0)
    def in_a_thread():
        print("step 1 done (irreversible)")
        with ThreadPoolExecutor(1) as pool:
            pool.submit(step_2).result()

    @task.advisory_lock(postgres_conn_id=CONN, key="outer-stacked", on_busy="skip", retries=0)
    @advisory_lock(postgres_conn_id=CONN, key="inner-step", on_busy="skip")
    def stacked():  # two guards on one task's function: nothing of it runs before the second
        print("STACKED RAN")

    in_a_thread()
    stacked()


threaded_and_stacked_dag = threaded_and_stacked()
"""


def test_a_refusal_in_a_thread_of_guarded_work_fails_it_and_stacked_guards_still_skip(
    airflow_db: Any, admin: Any, holder_hook: AdvisoryLockHook, capfd: Any
) -> None:
    with held_lock(holder_hook, "inner-step") as blocker:
        assert blocker is not None
        result = run_dag(THREADED_AND_STACKED_DAG, "threaded_and_stacked")
    assert result.state("in_a_thread") == "failed", "a thread does not see the context: the skip itself says so"
    assert result.state("stacked") == "skipped"
    log = "".join(capfd.readouterr())
    assert "STACKED RAN" not in log
    # The outer guard names the inner one's skip as a guard's, not as the work's own.
    assert re.search(r"pglock outcome=skipped key 'outer-stacked' .* - the task's own guard skipped it: ", log), log
    assert "the work skipped the task" not in log
    assert advisory_locks(admin) == []


NESTED_SAME_KEY_DAG = """
import pendulum
from airflow.sdk import dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock

CONN = "pglock_test"


@advisory_lock(postgres_conn_id=CONN, key="nested-shared", shared=True)
def read_again():
    print("INNER SHARED RAN")


@advisory_lock(postgres_conn_id=CONN, key="nested-same")
def take_again():
    print("INNER SAME RAN")


@advisory_lock(postgres_conn_id=CONN, key="nested-pool", slots=2)
def take_another_slot():
    print("INNER POOL RAN")


@advisory_lock(postgres_conn_id=CONN, key="nested-deep", on_busy="wait", wait_timeout=60)
def deep_again():
    print("INNER DEEP RAN")


@advisory_lock(postgres_conn_id=CONN, key="nested-middle")
def middle():
    deep_again()


@dag(dag_id="nested_same_key", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def nested_same_key():
    @task.advisory_lock(postgres_conn_id=CONN, key="nested-deep", retries=0)
    def deep_outer():
        middle()  # its guard holds another key; the one around it holds nested-deep

    @task.advisory_lock(postgres_conn_id=CONN, key="nested-shared", shared=True, retries=0)
    def shared_outer():
        read_again()

    @task.advisory_lock(postgres_conn_id=CONN, key="nested-same", retries=0)
    def same_outer():
        take_again()

    @task.advisory_lock(postgres_conn_id=CONN, key="nested-pool", slots=2, retries=0)
    def pool_outer():
        take_another_slot()

    shared_outer()
    same_outer()
    pool_outer()
    deep_outer()


nested_same_key_dag = nested_same_key()
"""


def test_a_guard_inside_guarded_work_on_a_key_or_pool_held_around_it_fails_and_two_shared_guards_run(
    airflow_db: Any, admin: Any, capfd: Any
) -> None:
    """A guard around the work, however far out, holds the key (or a slot of the pool): an inner guard
    of it would always find it busy (or take a second slot of the pool), so it fails at once; two
    shared holds of one key do not exclude each other, and the inner shared guard runs."""
    result = run_dag(NESTED_SAME_KEY_DAG, "nested_same_key")
    out = "".join(capfd.readouterr())
    assert result.state("shared_outer") == "success" and "INNER SHARED RAN" in out
    assert result.state("same_outer") == "failed" and "INNER SAME RAN" not in out
    assert "the guard of task 'same_outer' takes key 'nested-same'" in out
    assert "which its lock scope or an enclosing guard of the same task already holds" in out
    assert result.state("pool_outer") == "failed" and "INNER POOL RAN" not in out
    assert "the guard of task 'pool_outer' takes key 'nested-pool'" in out
    assert "the name of the pool whose slot 1 its lock scope or an enclosing guard of the same task" in out
    # two guards out: found at once, not after the inner guard's 60 s wait
    assert result.state("deep_outer") == "failed" and "INNER DEEP RAN" not in out
    assert re.search(
        r"the guard of task 'deep_outer' takes key 'nested-deep' \(int64 -?\d+\), which its lock scope", out
    )
    assert advisory_locks(admin) == []
