"""A lock scope's misuse is refused when the DAG file is parsed, naming the value and what was
expected (nothing connects: no database is needed here)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pendulum
import pytest

from airflow_pglock.exceptions import LockConfigurationError

pytestmark = pytest.mark.airflow

compat = pytest.importorskip("airflow_pglock.compat")
scope = pytest.importorskip("airflow_pglock.operators.scope")


def _dag() -> Any:
    from airflow_pglock.compat import AIRFLOW_V_3_PLUS

    if AIRFLOW_V_3_PLUS:
        from airflow.sdk import DAG
    else:
        from airflow import DAG  # type: ignore[no-redef]
    return DAG("scope_refusals", schedule=None, start_date=pendulum.datetime(2026, 1, 1))


def _task(name: str) -> Any:
    from airflow_pglock.compat import PythonOperator

    return PythonOperator(task_id=name, python_callable=lambda: None)


@pytest.mark.matrix("lock-scope", since=compat.LOCK_SCOPE_SINCE)
@pytest.mark.skipif(compat.HAS_LOCK_SCOPE, reason="Airflow 3 builds scopes (tests/airflow/test_scope.py runs them)")
def test_refused_before_airflow_3() -> None:
    with (
        _dag(),
        pytest.raises(LockConfigurationError, match=r"advisory_lock_scope needs Airflow 3\.0 or newer"),
        scope.advisory_lock_scope("publish", key="k"),
    ):
        _task("a")


needs_scopes = pytest.mark.skipif(not compat.HAS_LOCK_SCOPE, reason="lock scopes need Airflow 3")


@needs_scopes
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "advisory_lock_scope() needs key= a non-empty name (a Jinja template), got None"),
        ({"key": 42}, "needs key= a non-empty name (a Jinja template), got 42"),
        ({"key": "k", "mode": "transaction"}, "does not take mode= (a scope holds session locks)"),
        ({"key": "k", "slots": 2, "fencing": True}, "cannot combine fencing=True with slots=2"),
        ({"key": "k", "slots": 2, "once_per": "{{ ds }}"}, "once_per"),
        ({"key": "k", "slots": 0}, "slots must be an integer from 1 to"),
        ({"key": "k", "once_per": " "}, "once_per must be a non-empty period or template"),
        ({"key": "k", "min_interval": -1}, "min_interval must be a positive timedelta or number of seconds, got -1"),
        ({"key": "k", "scope_lease": 0}, "scope_lease must be a positive timedelta or number of seconds, got 0"),
        ({"key": "k", "member_wait": "soon"}, "member_wait must be a positive timedelta or number of seconds"),
        ({"key": "k", "member_wait": float("inf")}, "member_wait must be a positive timedelta or number of seconds"),
        ({"key": "k", "scope_lease": float("inf")}, "scope_lease must be a positive timedelta or number of seconds"),
        ({"key": "k", "member_wait": dt.timedelta(days=30)}, "member_wait=2.592e+06 s is too long: the longest is"),
        ({"key": "k", "scope_lease": dt.timedelta.max}, "scope_lease=8.64e+13 s is too long: at most 315,576,000 s"),
        ({"key": "k", "fencing": "yes"}, "fencing must be True or False, got 'yes'"),
        ({"key": "k", "on_busy": "wait"}, "wait_timeout"),
        ({"key": "k", "tenant": ""}, "tenant='' is empty"),
        ({"key": "k", "tenant": "  "}, "tenant='  ' is empty"),
    ],
)
def test_bad_options_are_refused_at_parse_time(options: dict[str, Any], message: str) -> None:
    with _dag(), pytest.raises(LockConfigurationError) as refused, scope.advisory_lock_scope("publish", **options):
        _task("a")
    assert message in str(refused.value)


@needs_scopes
def test_a_mapped_task_inside_a_scope_is_refused() -> None:
    from airflow.sdk import task

    @task
    def each(n: int) -> int:
        return n

    with (
        _dag(),
        pytest.raises(LockConfigurationError, match=r"is mapped \(\.expand\(\)\)"),
        scope.advisory_lock_scope("publish", key="k"),
    ):
        each.expand(n=[1, 2])


@needs_scopes
def test_a_task_guarded_by_the_scopes_own_key_is_refused() -> None:
    from airflow.sdk import task

    @task.advisory_lock(key="k")
    def again() -> None:
        return None

    with (
        _dag(),
        pytest.raises(LockConfigurationError, match="inside the lock scope on the same key"),
        scope.advisory_lock_scope("publish", key="k"),
    ):
        again()


@needs_scopes
def test_a_task_of_a_scope_that_would_defer_on_its_own_key_is_refused() -> None:
    """A deferred task holds no lock: it would resume outside the scope, with its own guard only."""
    from airflow.sdk import task

    @task.advisory_lock(key="other", on_busy="defer", wait_timeout=60)
    def defers() -> None:
        return None

    with (
        _dag(),
        pytest.raises(LockConfigurationError, match="has on_busy='defer'"),
        scope.advisory_lock_scope("publish", key="k"),
    ):
        defers()


@needs_scopes
def test_a_scope_inside_a_scope_on_the_same_tasks_is_refused() -> None:
    with (
        _dag(),
        pytest.raises(LockConfigurationError, match="is in two lock scopes"),
        scope.advisory_lock_scope("outer", key="k1"),
        scope.advisory_lock_scope("inner", key="k2"),
    ):
        _task("a")


@needs_scopes
def test_the_scope_wires_setup_and_teardown_around_its_tasks() -> None:
    with _dag() as dag:
        first = _task("before")
        with scope.advisory_lock_scope("publish", key="k") as group:
            a, b = _task("a"), _task("b")
            a >> b
        first >> group
    enter, leave = dag.get_task("publish.pglock_scope_enter"), dag.get_task("publish.pglock_scope_exit")
    assert enter.is_setup and leave.is_teardown
    assert "publish.a" in enter.downstream_task_ids and "publish.b" in leave.upstream_task_ids
    assert "publish.pglock_scope_enter" in leave.upstream_task_ids


@needs_scopes
def test_the_whole_run_as_one_scope() -> None:
    with _dag() as dag:
        a, b = _task("a"), _task("b")
        a >> b
        enter, leave = scope.advisory_lock_dag_scope(dag, key="k", on_busy="skip")
    assert enter.task_id == "pglock_scope_enter" and "a" in enter.downstream_task_ids
    assert "b" in leave.upstream_task_ids
    with pytest.raises(LockConfigurationError, match=r"unexpected options \['colour'\]"):
        scope.advisory_lock_dag_scope(dag, key="k", colour="red")


@needs_scopes
def test_a_setup_refused_for_a_busy_key_is_known_through_every_error_that_says_so() -> None:
    """A setup that took nothing must not try to free a scope (that waits member_wait behind the
    holder): its refusal may come as the busy error itself, as a skip or failure from it, or as
    on_error="skip"'s skip from the lock database's error from it (a wait the triggerer lost)."""
    from airflow_pglock.compat import AirflowFailException, AirflowSkipException
    from airflow_pglock.exceptions import LockBusyError, LockConnectionError, LockLostError

    def caused(error: BaseException, cause: BaseException) -> BaseException:
        error.__cause__ = cause
        return error

    busy = LockBusyError("key 'k' is held by pid 1", key="k")
    assert scope._refused(busy)
    assert scope._refused(caused(AirflowFailException("busy (on_busy='fail')"), busy))
    lost_wait = caused(LockConnectionError("busy; the wait for it in the triggerer failed"), busy)
    assert scope._refused(caused(AirflowSkipException("skipped because of an error"), lost_wait))
    assert not scope._refused(LockConnectionError("could not connect"))
    assert not scope._refused(
        caused(AirflowSkipException("skipped because of an error"), LockLostError("lost", "k", "x"))
    )
