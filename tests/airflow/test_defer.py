"""on_busy="defer" in a real Airflow on a real PostgreSQL (dag.test() runs the trigger in line).

A busy task defers, its trigger is woken by the holder's release (announced by the unlock
statement) and the task tries again and runs; a key that stays held ends the whole wait
as a skip, or a failure with on_wait_timeout="fail". The composable decorator refuses
"defer" when the DAG is parsed. The real triggerer is in tests/e2e/test_defer_triggerer.py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest

from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.liveness import Liveness
from tests.helpers import held_lock, run_dag
from tests.statsd import StatsdListener

pytestmark = pytest.mark.airflow

DEFER_DAG = '''
import threading

import pendulum
from airflow.sdk import chain, dag, task

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.operators.advisory_lock import guarded
from tests.sdk import BashOperator

CONN = "pglock_test"
DONE = "all_done"


def hold_for(name, seconds):
    """Another session takes the key now; a threading.Timer releases it after `seconds`."""
    held = AdvisoryLockHook(CONN).acquire(name, application_name="export holder")
    assert held is not None, name
    threading.Timer(seconds, held.release).start()


@dag(dag_id="defer", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def defer():
    @task
    def hold_task_key():
        hold_for("defer/task", 1.5)

    @task.advisory_lock(key="defer/task", on_busy="defer", wait_timeout=120, defer_after=0, postgres_conn_id=CONN,
                        trigger_rule=DONE)
    def after_holder():
        return "ran"

    @task(trigger_rule=DONE)
    def hold_operator_key():
        hold_for("defer/operator", 1.5)

    @task(trigger_rule=DONE)
    def hold_brief_key():
        hold_for("defer/brief", 3)

    # Freed within defer_after: taken on the worker, never deferred.
    @task.advisory_lock(key="defer/brief", on_busy="defer", wait_timeout=120, defer_after=60, postgres_conn_id=CONN,
                        trigger_rule=DONE)
    def taken_on_the_worker():
        return "ran"

    # Waits 1 s on the worker, then defers; the deadline skips.
    @task.advisory_lock(key="defer/held", on_busy="defer", wait_timeout=3, defer_after=1, postgres_conn_id=CONN,
                        trigger_rule=DONE)
    def deadline_skips():
        return "never"

    @task.advisory_lock(key="defer/held", on_busy="defer", wait_timeout=1, on_wait_timeout="fail",
                        postgres_conn_id=CONN, trigger_rule=DONE)
    def deadline_fails():
        return "never"

    chain(
        hold_task_key(),
        after_holder(),
        hold_operator_key(),
        guarded(BashOperator(task_id="operator_after_holder", bash_command="echo ran", trigger_rule=DONE),
                key="defer/operator", on_busy="defer", wait_timeout=120, defer_after=0, postgres_conn_id=CONN),
        hold_brief_key(),
        taken_on_the_worker(),
        deadline_skips(),
        deadline_fails(),
    )


defer_dag = defer()
'''


def test_defer_waits_in_the_trigger_and_runs_after_the_release(
    airflow_db: Any, hook: AdvisoryLockHook, capfd: Any, caplog: Any
) -> None:
    holder = AdvisoryLockHook(dsn=hook.dsn, liveness=Liveness(lease=600))
    held = holder.acquire("defer/held", application_name="nightly holder")
    assert held is not None
    try:
        result = run_dag(DEFER_DAG, "defer")
    finally:
        held.release()
    log = "".join(capfd.readouterr()) + caplog.text

    assert result.states == {
        ("hold_task_key", -1): "success",
        ("after_holder", -1): "success",
        ("hold_operator_key", -1): "success",
        ("operator_after_holder", -1): "success",
        ("hold_brief_key", -1): "success",
        ("taken_on_the_worker", -1): "success",
        ("deadline_skips", -1): "skipped",
        ("deadline_fails", -1): "failed",
    }, log[-5000:]
    # It said that it deferred and who held the key, then acquired it and completed.
    deferred = re.search(r"pglock deferred: .*key 'defer/task'.*export holder.*waiting in the triggerer", log)
    assert deferred, log[-5000:]
    assert re.search(r"pglock outcome=completed key 'defer/task'", log[deferred.end() :]), log[-5000:]
    assert re.search(r"pglock deferred: .*key 'defer/operator'", log)
    assert re.search(r"pglock outcome=completed key 'defer/operator'", log)
    # defer_after: a key freed within it is taken on the worker; one still busy after it defers.
    assert not re.search(r"pglock deferred: .*key 'defer/brief'", log), log[-5000:]
    assert re.search(r"pglock outcome=completed key 'defer/brief'", log), log[-5000:]
    assert re.search(r"pglock deferred: .*key 'defer/held'.*after waiting 1 s; waiting in the triggerer", log), log
    # At the deadline: the holder is named, then a skip (or the failure asked for).
    assert re.search(r"pglock outcome=skipped key 'defer/held'.*nightly holder", log), log[-5000:]
    assert "on_wait_timeout='fail'" in log


FOREIGN_NOTIFY_DAG = """
import os
import threading
import time

import pendulum
import psycopg
from airflow.sdk import chain, dag, task

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

CONN = "pglock_test"
HUB_READY = (
    "SELECT 1 FROM pg_stat_activity WHERE application_name = 'airflow-pglock wakeups'"
    " AND state = 'idle' AND query LIKE '%pg_locks%' AND datname = current_database()"
)


def notify_then_release(held):
    \"\"\"Once the waiting trigger's hub listens: a foreign NOTIFY that int() cannot read, then the release.\"\"\"
    with psycopg.connect(os.environ["AIRFLOW_CONN_PGLOCK_TEST"], autocommit=True) as foreign:
        limit = time.monotonic() + 60
        while not foreign.execute(HUB_READY).fetchone() and time.monotonic() < limit:
            time.sleep(0.05)
        foreign.execute("SELECT pg_notify('pglock_released', '\u00b2/0/1')")
    held.release()
    print(f"HOLDER released at {time.time():.3f}", flush=True)


@dag(dag_id="defer_foreign_notify", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def defer_foreign_notify():
    @task
    def hold():
        held = AdvisoryLockHook(CONN).acquire("defer/foreign-notify", application_name="export holder")
        assert held is not None
        threading.Thread(target=notify_then_release, args=(held,)).start()

    @task.advisory_lock(key="defer/foreign-notify", on_busy="defer", wait_timeout=120, postgres_conn_id=CONN,
                        trigger_rule="all_done")
    def after_holder():
        print(f"WAITER ran at {time.time():.3f}", flush=True)

    chain(hold(), after_holder())


defer_foreign_notify_dag = defer_foreign_notify()
"""


def test_a_foreign_notify_does_not_keep_a_deferred_task_waiting_until_its_deadline(
    airflow_db: Any, capfd: Any, caplog: Any
) -> None:
    """Anyone who may connect can NOTIFY the release channel: a payload int() cannot read stopped
    the triggerer's wake-ups, and the task ran at its deadline (120 s) instead of at the release."""
    result = run_dag(FOREIGN_NOTIFY_DAG, "defer_foreign_notify")
    log = "".join(capfd.readouterr()) + caplog.text

    assert result.states == {("hold", -1): "success", ("after_holder", -1): "success"}, log[-5000:]
    assert re.search(r"pglock deferred: .*key 'defer/foreign-notify'", log), log[-5000:]
    released = re.search(r"HOLDER released at ([0-9.]+)", log)
    ran = re.search(r"WAITER ran at ([0-9.]+)", log)
    assert released and ran, log[-5000:]
    # Woken by the release, not at the deadline 120 s after the deferral (a generous bound: half of it).
    assert float(released[1]) < float(ran[1]) < float(released[1]) + 60, log[-5000:]


def test_defer_needs_a_bounded_wait_and_a_flavour_that_can_resume(airflow_db: Any) -> None:
    from airflow_pglock.decorators.advisory_lock import advisory_lock
    from airflow_pglock.options import LockOptions, LockSpec

    with pytest.raises(LockConfigurationError, match="on_busy='defer' needs wait_timeout"):
        LockSpec.from_options({"on_busy": "defer"}, declaration=LockOptions, caller="guarded")
    with pytest.raises(LockConfigurationError, match="on_wait_timeout only applies"):
        LockSpec.from_options({"on_wait_timeout": "fail"}, declaration=LockOptions, caller="guarded")
    with pytest.raises(LockConfigurationError, match=r"@advisory_lock\(on_busy='defer'\) cannot defer"):
        advisory_lock(key="k", on_busy="defer", wait_timeout=10)


SOFT_FAIL_SENSOR_DAG = """
import pendulum
from airflow.sdk import dag

from airflow_pglock.operators.advisory_lock import guarded

try:
    from airflow.providers.standard.sensors.python import PythonSensor
except ImportError:  # Airflow 2
    from airflow.sensors.python import PythonSensor

CONN = "pglock_test"


@dag(dag_id="soft_fail_sensor", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def soft_fail_sensor():
    for on_wait_timeout in ("fail", "skip"):
        guarded(
            PythonSensor(task_id=f"deadline_{on_wait_timeout}", python_callable=lambda: True, soft_fail=True),
            key="defer/sensor-held", on_busy="defer", wait_timeout=2, defer_after=0,
            on_wait_timeout=on_wait_timeout, postgres_conn_id=CONN,
        )


soft_fail_sensor_dag = soft_fail_sensor()
"""


def test_a_guarded_soft_fail_sensor_resumed_from_its_wait_maps_the_outcome_as_its_first_try(
    airflow_db: Any, hook: AdvisoryLockHook, capfd: Any, caplog: Any
) -> None:
    """The resume of an on_busy="defer" wait goes through the sensor's resume_execution, which
    turns any AirflowException into a skip under soft_fail: on_wait_timeout="fail" (or a
    configuration error found then) skipped the task instead of failing it."""
    holder = AdvisoryLockHook(dsn=hook.dsn, liveness=Liveness(lease=600))
    with held_lock(holder, "defer/sensor-held", application_name="nightly holder") as held:
        assert held is not None
        result = run_dag(SOFT_FAIL_SENSOR_DAG, "soft_fail_sensor")
    log = "".join(capfd.readouterr()) + caplog.text
    assert result.state("deadline_fail") == "failed", log[-3000:]
    assert result.state("deadline_skip") == "skipped", log[-3000:]
    assert re.search(r"pglock deferred: .*key 'defer/sensor-held'", log), log[-3000:]


def _deferring_operator(key: str, **options: Any) -> tuple[Any, Any]:
    """A guarded PythonOperator with on_busy="defer" (no wait on the worker first) and the context
    of one of its task instances (task "t" of DAG "d"), to call its execute and resume by hand."""
    import types

    from airflow_pglock.compat import PythonOperator
    from airflow_pglock.operators.advisory_lock import guarded

    operator = guarded(
        PythonOperator(task_id="t", python_callable=lambda: "ran"),
        key=key,
        on_busy="defer",
        defer_after=0,
        postgres_conn_id="pglock_test",
        **options,
    )
    ti = types.SimpleNamespace(dag_id="d", task_id="t", run_id="manual__r", map_index=-1, hostname="h", task=operator)
    return operator, {"ti": ti, "task": operator}


def _resumed_after_a_trigger_error(hook: AdvisoryLockHook, on_error: str, before_the_try: Callable[[], None]) -> Any:
    """Defer a guarded task on a busy key, wake it while the key is still busy (it defers again), then
    resume it with the trigger's error event; ``before_the_try`` runs just before that try. Returns
    (pytest's ExceptionInfo of what that try raised, the wait's deadline)."""
    from airflow_pglock.compat import AirflowSkipException, TaskDeferred
    from airflow_pglock.exceptions import LockConnectionError
    from airflow_pglock.task_guard import RESUME_METHOD, resolve_key

    operator, context = _deferring_operator("defer/trigger-error", wait_timeout=120, on_error=on_error)
    holder = AdvisoryLockHook(dsn=hook.dsn, liveness=Liveness(lease=600))
    key = resolve_key("defer/trigger-error", None, "d", "t")
    with held_lock(holder, key, application_name="nightly holder") as held:
        assert held is not None
        with pytest.raises(TaskDeferred) as deferred:
            operator.execute(context)
        deadline = deferred.value.kwargs["deadline"]
        free = {"status": "free", "message": "free", "deadline": deadline}
        with pytest.raises(TaskDeferred):  # woken while another took the key first: waits again
            operator.resume_execution(RESUME_METHOD, {"event": free, "deadline": deadline}, context)
        error = {"status": "error", "message": "could not read who holds it (LockConnectionError: refused)"}
        before_the_try()
        expected = LockConnectionError if on_error == "fail" else AirflowSkipException
        with pytest.raises(expected, match="the wait for it in the triggerer failed: could not read who") as ended:
            operator.resume_execution(RESUME_METHOD, {"event": error, "deadline": deadline}, context)
    return ended, deadline


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_wait_the_triggerer_could_not_keep_fails_the_resumed_task_instead_of_deferring_again(
    airflow_db: Any, hook: AdvisoryLockHook, on_error: str, caplog: Any, capfd: Any
) -> None:
    """A trigger that cannot read the lock database ends its wait at once with an error event; the
    resumed task, finding the key still busy, deferred again at once, over and over until the
    deadline (each resume well inside the window of apache/airflow#72716). The error is the lock
    database's, so on_error="skip" skips the task naming it, as for any other such error."""
    import time

    from airflow_pglock.exceptions import LockConnectionError

    def clear_logs() -> None:
        caplog.clear()
        caplog.set_level(logging.INFO)
        capfd.readouterr()

    ended, deadline = _resumed_after_a_trigger_error(hook, on_error, clear_logs)
    if on_error == "skip":
        assert "skipped because of an error (on_error='skip')" in str(ended.value)
        assert isinstance(ended.value.__cause__, LockConnectionError)
    # The one outcome line of that try says what the task becomes, not "deferred".
    log = "".join(capfd.readouterr()) + caplog.text
    outcomes = re.findall(r"pglock outcome=(\w+) key 'defer/trigger-error'.* - busy: ", log)
    # (a set: Airflow 2 writes the line to both the output and the log capture)
    assert set(outcomes) == {"failed" if on_error == "fail" else "skipped"}, log[-3000:]
    assert deadline > time.time() + 60, "failed long before the deadline, as soon as it resumed"


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_the_try_after_a_trigger_error_counts_as_failed_under_the_tasks_own_on_busy(
    airflow_db: Any, hook: AdvisoryLockHook, on_error: str, statsd: StatsdListener
) -> None:
    """That try's metrics: pglock.failed (the lock database's error, as the task's own error says),
    not busy or skipped, tagged with the task's own on_busy ("defer"), as its other tries are."""
    import time

    def tries_ended(count: int) -> list[tuple[str, dict[str, str], str]]:
        """The task's metrics once ``count`` of its tries have sent theirs (each ends with its wait timer)."""
        ends = time.monotonic() + 10
        while True:
            the_task = [metric for metric in statsd.metrics() if metric[1].get("task_id") == "t"]
            if sum(name == "wait" for name, _, _ in the_task) >= count or time.monotonic() > ends:
                return the_task
            time.sleep(0.05)

    before: list[int] = []
    _resumed_after_a_trigger_error(hook, on_error, lambda: before.append(len(tries_ended(2))))
    every_try = tries_ended(3)
    last_try = every_try[before[0] :]
    assert {name for name, _, kind in last_try if kind == "c"} == {"failed"}, every_try
    assert len(every_try) >= 3 and {tags["on_busy"] for _, tags, _ in every_try} == {"defer"}, every_try


def test_a_timeout_from_a_triggerer_whose_clock_is_ahead_ends_the_wait(
    airflow_db: Any, hook: AdvisoryLockHook, caplog: Any
) -> None:
    """The deadline is set on the worker's clock and checked on the triggerer's. A triggerer ahead
    by more than the time left fires its timeout at once; the resumed task, still seeing time left
    on its own clock, deferred again (to another timeout at once), over and over until its clock
    caught up (review helper-40). The trigger's timeout now makes that try the last."""
    from airflow_pglock.compat import AirflowSkipException, TaskDeferred
    from airflow_pglock.task_guard import RESUME_METHOD, resolve_key

    operator, context = _deferring_operator("defer/clock-skew", wait_timeout=600)
    holder = AdvisoryLockHook(dsn=hook.dsn, liveness=Liveness(lease=600))
    with held_lock(holder, resolve_key("defer/clock-skew", None, "d", "t")) as held:
        assert held is not None
        with pytest.raises(TaskDeferred) as deferred:
            operator.execute(context)
        deadline = deferred.value.kwargs["deadline"]  # ten minutes away on this clock
        timed_out = {"status": "timeout", "message": "still held at the deadline", "deadline": deadline}
        with pytest.raises(AirflowSkipException, match=r"skipped: key .defer/clock-skew. .* is held by"):
            operator.resume_execution(RESUME_METHOD, {"event": timed_out, "deadline": deadline}, context)
