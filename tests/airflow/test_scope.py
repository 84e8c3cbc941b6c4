"""Lock scopes (advisory_lock_scope) through real Airflow runs (dag.test()) on a real PostgreSQL.

dag.test() runs the tasks one after the other in this process: these tests show what each
task of a scope does with the lease row and the key (taken, re-entered, freed, refused,
lost); tests/e2e/test_scope_deployments.py shows two real deployments sharing a scope.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest

from airflow_pglock.keys import LockKey
from airflow_pglock.pg import scopes
from tests.helpers import held_lock, run_dag

pytestmark = pytest.mark.airflow

compat = pytest.importorskip("airflow_pglock.compat")
if not compat.HAS_LOCK_SCOPE:
    pytest.skip(
        "lock scopes need Airflow 3 (refused at parse time on 2.x: tests/airflow/test_scope_refusals.py)",
        allow_module_level=True,
    )

SCOPE_DAG = """
import pendulum
import psycopg
from airflow.sdk import dag, task
from airflow_pglock.operators.scope import advisory_lock_scope

CONN = "pglock_test"


def _row(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT holder, task_now, token, lease_until > clock_timestamp() FROM pglock.scopes"
            " WHERE key_name = 'scope-key'"
        ).fetchone()


@dag(dag_id="scoped", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"dsn": "", "fail_b": False, "lapse_between": False})
def scoped():
    @task
    def before():
        return "ok"

    @task
    def gap(params=None):  # outside the scope: nothing holds the key while it runs
        if params["lapse_between"]:  # as a deployment gone longer than the scope lease
            with psycopg.connect(params["dsn"], autocommit=True) as conn:
                conn.execute("UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second'")

    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id=CONN, fencing=True, scope_lease=300):
        @task
        def a(lock=None, params=None, ti=None):
            holder, task_now, token, live = _row(params["dsn"])
            entered = ti.xcom_pull(task_ids="publish.pglock_scope_enter")
            assert holder == entered["holder"] and task_now == "publish.a" and live, (holder, task_now, live)
            return {"token": token, "pushed": ti.xcom_pull(task_ids="publish.pglock_scope_enter")["token"]}

        @task
        def b(first, params=None):
            holder, task_now, token, live = _row(params["dsn"])
            assert task_now == "publish.b" and token == first["token"] == first["pushed"], (task_now, token, first)
            if params["fail_b"]:
                raise RuntimeError("b failed")
            return token

        first = a()
        second = b(first)
    first >> gap() >> second

    before()


scoped_dag = scoped()
"""

PLAIN_DAG = """
import pendulum
from airflow.sdk import dag, task

@dag(dag_id="plain_guard", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def plain_guard():
    @task.advisory_lock(postgres_conn_id="pglock_test", key="scope-key")
    def plain():
        return "ran"

    plain()


plain_guard_dag = plain_guard()
"""

KEY = LockKey.from_name("scope-key")


def _scope_rows(admin: Any) -> list[tuple[Any, ...]]:
    return admin.execute("SELECT holder, run, task_now, lease_until > clock_timestamp() FROM pglock.scopes").fetchall()


def _hold_scope_elsewhere(admin: Any, lease: float = 300) -> str:
    """Another run's scope, as its setup leaves it (taken under the key, then the key released)."""
    holder = uuid.uuid4().hex
    admin.execute("SELECT pg_advisory_lock(%s)", [KEY.int64])
    try:
        taken, _ = scopes.enter(admin, KEY, holder, "deployment-b: openverse manual__other", lease)
        assert taken
    finally:
        admin.execute("SELECT pg_advisory_unlock(%s)", [KEY.int64])
    return holder


@pytest.mark.matrix("lock-scope", since=compat.LOCK_SCOPE_SINCE)
def test_a_scope_is_taken_held_across_tasks_with_one_token_and_freed(airflow_db: Any, scopes_db: Any, dsn: str) -> None:
    result = run_dag(SCOPE_DAG, "scoped", {"dsn": dsn, "fail_b": False, "lapse_between": False})
    assert result.state("publish.pglock_scope_enter") == "success"
    assert result.state("publish.a") == result.state("gap") == result.state("publish.b") == "success"
    assert result.state("publish.pglock_scope_exit") == "success"
    assert _scope_rows(scopes_db) == [], "the teardown frees the scope"
    token = scopes_db.execute("SELECT token FROM pglock.fencing_tokens WHERE key_name = 'scope-key'").fetchone()[0]
    assert token is not None


def test_the_teardown_frees_the_scope_after_a_failed_task(airflow_db: Any, scopes_db: Any, dsn: str) -> None:
    result = run_dag(SCOPE_DAG, "scoped", {"dsn": dsn, "fail_b": True, "lapse_between": False})
    assert result.state("publish.b") == "failed"
    assert result.state("publish.pglock_scope_exit") == "success"
    assert _scope_rows(scopes_db) == []


@pytest.mark.matrix("lock-scope", since=compat.LOCK_SCOPE_SINCE)
def test_another_runs_live_scope_skips_the_setup_and_every_plain_guard(
    airflow_db: Any, scopes_db: Any, dsn: str, capfd: Any, caplog: Any
) -> None:
    holder = _hold_scope_elsewhere(scopes_db)
    result = run_dag(SCOPE_DAG, "scoped", {"dsn": dsn, "fail_b": False, "lapse_between": False})
    assert result.state("publish.pglock_scope_enter") == "skipped"
    assert result.state("publish.a") == "skipped" and result.state("publish.b") == "skipped"
    assert result.state("before") == "success"
    plain = run_dag(PLAIN_DAG, "plain_guard")
    assert plain.state("plain") == "skipped"
    log = "".join(capfd.readouterr()) + caplog.text
    assert "is held by the lock scope of deployment-b: openverse manual__other, between its tasks, lease until" in log
    rows = _scope_rows(scopes_db)
    assert [(row[0], row[3]) for row in rows] == [(holder, True)], "the other run's scope is left alone"
    # Its lease runs out (its deployment died): the key is free for everyone again.
    scopes_db.execute("UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second'")
    assert run_dag(PLAIN_DAG, "plain_guard").state("plain") == "success"
    again = run_dag(SCOPE_DAG, "scoped", {"dsn": dsn, "fail_b": False, "lapse_between": False})
    assert again.state("publish.b") == "success" and _scope_rows(scopes_db) == []


def test_a_task_whose_scope_lapsed_between_tasks_fails_as_lost(
    airflow_db: Any, scopes_db: Any, dsn: str, capfd: Any, caplog: Any
) -> None:
    result = run_dag(SCOPE_DAG, "scoped", {"dsn": dsn, "fail_b": False, "lapse_between": True})
    assert result.state("publish.a") == "success"
    assert result.state("publish.b") == "failed"
    log = "".join(capfd.readouterr()) + caplog.text
    assert "lost the lock scope of key 'scope-key'" in log and "its lease ran out at" in log
    assert result.state("publish.pglock_scope_exit") == "success"
    assert _scope_rows(scopes_db) == []


def test_a_scope_without_its_table_fails_naming_init_db(
    airflow_db: Any, admin: Any, dsn: str, capfd: Any, caplog: Any
) -> None:
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")
    result = run_dag(SCOPE_DAG, "scoped", {"dsn": dsn, "fail_b": False, "lapse_between": False})
    assert result.state("publish.pglock_scope_enter") == "failed"
    assert result.state("publish.a") != "success"
    assert "run `airflow-pglock init-db --conn-id" in "".join(capfd.readouterr()) + caplog.text


SKIP_ON_ERROR_DAG = """
import pendulum
from airflow.sdk import dag, task
from airflow_pglock.operators.scope import advisory_lock_scope


@dag(dag_id="scoped_skip_on_error", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def scoped_skip_on_error():
    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test", on_error="skip"):
        @task
        def work():
            return "ran"

        work()


scoped_skip_on_error_dag = scoped_skip_on_error()
"""


def test_an_error_after_the_setup_took_the_key_fails_it_whatever_on_error_says(
    airflow_db: Any, admin: Any, capfd: Any, caplog: Any
) -> None:
    """Review -62: on_error applies when the lock cannot be tried, never after it was taken. A setup
    checks under the key it took (its table, a fencing token that did not reach the synchronous
    standby): those errors were skipped with on_error="skip", as if the database had refused the lock."""
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")
    result = run_dag(SKIP_ON_ERROR_DAG, "scoped_skip_on_error")
    assert result.state("publish.pglock_scope_enter") == "failed"
    assert result.state("publish.work") != "success"
    assert "run `airflow-pglock init-db --conn-id" in "".join(capfd.readouterr()) + caplog.text


DEFER_DAG = """
import pendulum
from airflow.sdk import dag, task
from airflow_pglock.operators.scope import advisory_lock_scope


@dag(dag_id="scoped_defer", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def scoped_defer():
    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test", on_busy="defer",
                             wait_timeout=120, defer_after=0):
        @task
        def work():
            return "ran"

        work()


scoped_defer_dag = scoped_defer()
"""


def test_a_deferring_setup_waits_in_the_triggerer_until_the_other_scope_ends(
    airflow_db: Any, scopes_db: Any, dsn: str, capfd: Any, caplog: Any
) -> None:
    _hold_scope_elsewhere(scopes_db, lease=15)  # past dag.test()'s start-up: the setup finds it live
    result = run_dag(DEFER_DAG, "scoped_defer")
    log = "".join(capfd.readouterr()) + caplog.text
    assert "pglock deferred: key 'scope-key'" in log and "is held by the lock scope of deployment-b" in log
    assert result.state("publish.pglock_scope_enter") == "success"
    assert result.state("publish.work") == "success"
    assert _scope_rows(scopes_db) == []


SELF_DEFERRING_DAG = """
import pendulum
from airflow.sdk import BaseOperator, dag
from airflow.providers.standard.triggers.temporal import DateTimeTrigger
from airflow_pglock.operators.scope import advisory_lock_scope


class DefersItself(BaseOperator):  # no `deferrable` attribute: nothing at parse time says it defers
    def execute(self, context):
        print("started its external work")
        self.defer(trigger=DateTimeTrigger(moment=pendulum.now("UTC").add(seconds=1)), method_name="resumed")

    def resumed(self, context, event=None):
        print("RESUMED OUTSIDE THE SCOPE")

    def on_kill(self):
        print("ON_KILL: stopped its external work")


@dag(dag_id="scoped_self_deferring", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def scoped_self_deferring():
    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test"):
        DefersItself(task_id="waits")


scoped_self_deferring_dag = scoped_self_deferring()
"""


def test_a_task_of_the_scope_that_defers_at_run_time_fails_and_is_stopped(
    airflow_db: Any, scopes_db: Any, capfd: Any
) -> None:
    """An operator that defers without saying so (``self.defer()``, no ``deferrable`` flag) passes
    the parse-time check; at run time its deferral would release the key and resume it outside
    the scope, unguarded, while the scope's lease runs out."""
    result = run_dag(SELF_DEFERRING_DAG, "scoped_self_deferring")
    out = "".join(capfd.readouterr())
    assert result.state("publish.waits") == "failed"
    assert "RESUMED OUTSIDE THE SCOPE" not in out
    assert "ON_KILL: stopped its external work" in out
    assert result.state("publish.pglock_scope_exit") == "success"
    assert _scope_rows(scopes_db) == []


OTHER_KEY_DAG = """
import pendulum
from airflow.sdk import dag, task
from airflow_pglock.decorators.advisory_lock import advisory_lock
from airflow_pglock.operators.scope import advisory_lock_scope


@advisory_lock(postgres_conn_id="pglock_test", key="other-key", on_busy="skip")
def helper():
    print("HELPER RAN")


@dag(dag_id="scoped_other_key", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def scoped_other_key():
    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test"):
        @task.advisory_lock(postgres_conn_id="pglock_test", key="other-key", on_busy="skip")
        def own_guard():
            print("OWN GUARD RAN")

        @task
        def step_then_helper():
            print("a step of its own")
            helper()

        own_guard()
        step_then_helper()


scoped_other_key_dag = scoped_other_key()
"""


def test_a_task_of_the_scope_whose_own_guard_finds_its_key_busy_is_skipped(
    airflow_db: Any, scopes_db: Any, capfd: Any, holder_hook: Any
) -> None:
    """Its own guard (another key) runs first thing in the task: nothing of it has run, so its
    on_busy="skip" holds inside a scope as outside (work begun would make it a failure)."""
    with held_lock(holder_hook, "other-key") as blocker:
        assert blocker is not None
        result = run_dag(OTHER_KEY_DAG, "scoped_other_key")
    out = "".join(capfd.readouterr())
    assert "OWN GUARD RAN" not in out and "HELPER RAN" not in out
    assert result.state("publish.own_guard") == "skipped"
    # A task with no guard of its own ran a step, then its helper found the key busy: a failure.
    assert result.state("publish.step_then_helper") == "failed"
    assert result.state("publish.pglock_scope_exit") == "success"
    assert _scope_rows(scopes_db) == []


SENSOR_DAG = """
import pendulum
from airflow.sdk import dag
from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor


@dag(dag_id="scope_sensor", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def scope_sensor():
    poking = AdvisoryLockSensor(task_id="poking", key="scope-key", postgres_conn_id="pglock_test",
                                poke_interval=0.5, timeout=3, soft_fail=True)
    deferring = AdvisoryLockSensor(task_id="deferring", key="scope-key", postgres_conn_id="pglock_test",
                                   poke_interval=1, timeout=120, deferrable=True, trigger_rule="all_done")
    poking >> deferring


scope_sensor_dag = scope_sensor()
"""


def test_the_sensor_sees_a_scope_between_its_tasks_as_held(
    airflow_db: Any, scopes_db: Any, dsn: str, capfd: Any, caplog: Any
) -> None:
    _hold_scope_elsewhere(scopes_db, lease=15)
    result = run_dag(SENSOR_DAG, "scope_sensor")
    log = "".join(capfd.readouterr()) + caplog.text
    assert result.state("poking") == "skipped", "the poking sensor timed out: the scope held the key"
    assert "is still held by the lock scope of deployment-b: openverse manual__other" in log
    assert result.state("deferring") == "success", "the deferrable sensor waited the scope out"
    ended = scopes_db.execute("SELECT lease_until < clock_timestamp() FROM pglock.scopes").fetchone()[0]
    assert ended


@pytest.mark.parametrize("soft_fail", [False, True], ids=["timeout", "soft_fail"])
def test_a_deferrable_sensor_woken_behind_a_scope_at_its_deadline_times_out_instead_of_deferring_again(
    airflow_db: Any, scopes_db: Any, soft_fail: bool
) -> None:
    """The trigger fires at the sensor's deadline with the key free in pg_locks, a scope's row
    holding it: deferring again with the deadline passed fired at once, again and again, for as
    long as the scope lasted (its lease: an hour here)."""
    import time

    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor
    from airflow_pglock.triggers.advisory_lock import FREE

    _hold_scope_elsewhere(scopes_db, lease=3600)
    sensor = AdvisoryLockSensor(
        task_id="s", key="scope-key", postgres_conn_id="pglock_test", deferrable=True, timeout=5, soft_fail=soft_fail
    )
    event = {"status": FREE, "message": "key 'scope-key' is free", "deadline": time.time() - 1}
    expected = compat.AirflowSkipException if soft_fail else compat.AirflowSensorTimeout
    with pytest.raises(expected, match="still held by the lock scope of deployment-b") as raised:
        sensor.execute_complete({}, event)  # type: ignore[arg-type]
    assert "at the sensor's deadline (timeout 5 s)" in str(raised.value)


@pytest.mark.parametrize(
    ("slots", "once_per"), [(1, None), (2, None), (1, "2026-12-01")], ids=["one-key", "pool", "once-per"]
)
@pytest.mark.parametrize("error", [RuntimeError, compat.AirflowSkipException], ids=["failed", "skipped"])
def test_a_setup_that_fails_after_taking_the_scope_frees_it(
    airflow_db: Any, scopes_db: Any, error: type, slots: int, once_per: str | None
) -> None:
    """Airflow skips the teardown of a failed (or skipped: on_error="skip") setup: the setup frees
    what it took itself, and records no completion (no task of the scope ran)."""
    import types

    from airflow.sdk import DAG

    from airflow_pglock.operators import scope

    with (
        DAG("scope_setup_fails", schedule=None) as dag,
        scope.advisory_lock_scope(
            "publish", key="scope-key", postgres_conn_id="pglock_test", slots=slots, once_per=once_per
        ),
    ):
        from airflow_pglock.compat import PythonOperator

        PythonOperator(task_id="work", python_callable=lambda: None)
    enter = dag.get_task("publish.pglock_scope_enter")

    def refuse(**_: Any) -> None:
        assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone()[0] == 1  # taken by now
        raise error("the XCom could not be stored")

    ti = types.SimpleNamespace(
        dag_id=dag.dag_id,
        task_id=enter.task_id,
        run_id="manual__f",
        map_index=-1,
        hostname="h",
        task=enter,
        xcom_push=refuse,
    )
    with pytest.raises(error, match="the XCom could not be stored"):
        enter.python_callable(ti=ti, task=enter, params={})
    assert _scope_rows(scopes_db) == [], "the failed setup freed its scope"
    recorded = scopes_db.execute("SELECT period, task_id FROM pglock.completions").fetchall()
    assert recorded == [], f"a setup that failed recorded its period as done: {recorded}"
    assert run_dag(PLAIN_DAG, "plain_guard").state("plain") == "success"


ONCE_DAG = """
import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import dag, task
from airflow_pglock.operators.scope import advisory_lock_scope


@dag(dag_id="scoped_once", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"day": "2026-12-01", "fail_b": False, "unstorable": False})
def scoped_once():
    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test",
                             once_per="{{ params.day }}"):
        @task
        def a():
            return "a"

        @task
        def b(first, params=None):
            if params["fail_b"]:
                raise RuntimeError("b failed")
            if params["unstorable"]:  # fails after its work and its marker: Airflow cannot store it as XCom
                return object()
            return first

        b(a()) >> EmptyOperator(task_id="noop")  # never runs (Airflow 3 marks it success): no marker


scoped_once_dag = scoped_once()
"""

PLAIN_ONCE_DAG = """
import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import dag, task

@dag(dag_id="plain_once", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"day": "2026-12-01"})
def plain_once():
    @task.advisory_lock(postgres_conn_id="pglock_test", key="scope-key", once_per="{{ params.day }}")
    def plain():
        return "ran"

    plain()


plain_once_dag = plain_once()
"""


def _completions(admin: Any) -> list[tuple[Any, ...]]:
    return admin.execute("SELECT period, task_id FROM pglock.completions ORDER BY completed_at").fetchall()


@pytest.mark.matrix("lock-scope", since=compat.LOCK_SCOPE_SINCE)
def test_once_per_on_a_scope_the_setup_checks_and_the_teardown_records_when_every_task_succeeded(
    airflow_db: Any, scopes_db: Any, dsn: str, capfd: Any, caplog: Any
) -> None:
    failed = run_dag(ONCE_DAG, "scoped_once", {"day": "2026-12-01", "fail_b": True})
    assert failed.state("publish.b") == "failed" and failed.state("publish.pglock_scope_exit") == "success"
    assert _completions(scopes_db) == [], "a scope with a failed task records no completion"
    assert _scope_rows(scopes_db) == []
    unstorable = run_dag(ONCE_DAG, "scoped_once", {"day": "2026-12-01", "unstorable": True})
    assert unstorable.state("publish.b") == "failed", "its return value could not be stored"
    assert unstorable.state("publish.pglock_scope_exit") == "success"
    assert _completions(scopes_db) == [], "a task that failed after its marker records no completion"

    done = run_dag(ONCE_DAG, "scoped_once", {"day": "2026-12-01", "fail_b": False})
    assert done.state("publish.a") == done.state("publish.b") == "success"
    assert _completions(scopes_db) == [("2026-12-01", "publish.pglock_scope_exit")], "one record, by the teardown"
    capfd.readouterr()

    again = run_dag(ONCE_DAG, "scoped_once", {"day": "2026-12-01", "fail_b": False})
    assert again.state("publish.pglock_scope_enter") == "skipped"
    assert again.state("publish.a") == again.state("publish.b") == "skipped"
    log = "".join(capfd.readouterr()) + caplog.text
    assert "already done for period '2026-12-01'" in log and "by scoped_once/publish.pglock_scope_exit" in log
    assert _scope_rows(scopes_db) == [], "a done period takes no scope"
    # The period is the key's, whoever holds it: a plain guard of the key finds it done too.
    assert run_dag(PLAIN_ONCE_DAG, "plain_once", {"day": "2026-12-01"}).state("plain") == "skipped"
    next_day = run_dag(ONCE_DAG, "scoped_once", {"day": "2026-12-02", "fail_b": False})
    assert next_day.state("publish.b") == "success"
    assert [period for period, _ in _completions(scopes_db)] == ["2026-12-01", "2026-12-02"]


def test_the_teardown_waits_for_every_task_that_runs_and_never_skips_on_error() -> None:
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG, Asset

    from airflow_pglock.compat import PythonOperator
    from airflow_pglock.operators import scope

    with DAG("scope_members", schedule=None) as dag:
        tasks = [
            PythonOperator(task_id="work", python_callable=lambda: None),
            EmptyOperator(task_id="never_runs"),
            EmptyOperator(task_id="emits", outlets=[Asset("pglock-test-asset")]),  # Airflow 3 runs it
            EmptyOperator(task_id="calls_back", on_success_callback=lambda context: None),
        ]
    assert scope.scope_members(tasks) == ("work", "emits", "calls_back")
    spec = scope._scope_spec("g.", {"key": "k", "on_error": "skip"})
    assert spec.enter.policy.on_error == "skip" and spec.member_spec().policy.on_error == "fail"
    assert spec.member_spec(record_rules=True).policy.on_error == "fail"
    assert dag.dag_id == "scope_members"


class _TaskInstance:
    """What a task of the scope reads of its task instance: the setup's XCom, and the task (which
    Airflow 3.0 reads from here: ``compat.rendered_task``)."""

    dag_id, run_id, map_index, hostname = "scoped", "manual__1", -1, "worker-1"

    def __init__(self, task: _Task, setup_xcom: dict[str, Any] | None) -> None:
        self.task, self.task_id = task, task.task_id
        self._setup_xcom = setup_xcom

    def xcom_pull(self, task_ids: Any = None, key: Any = None) -> Any:
        return self._setup_xcom

    def xcom_push(self, key: Any = None, value: Any = None) -> None:
        raise AssertionError("a task of the scope other than its setup stores nothing here")


class _Task:
    def __init__(self, task_id: str) -> None:
        import logging

        self.task_id = task_id
        self.log = logging.getLogger("tests.scope")
        self.ran = False

    def get_template_env(self) -> Any:
        import jinja2

        return jinja2.Environment()

    def execute(self, context: Any) -> None:
        self.ran = True


def test_a_task_of_the_scope_never_skips_on_an_error_whatever_on_error_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scope's task skipped on a lock-database error, after an earlier task of the scope started
    external work, would let the teardown free the scope while that work goes on: it fails (and
    retries, if given retries) instead, as the teardown does. The lock database is unreachable
    (nothing listens on port 1)."""
    from airflow_pglock.compat import AirflowSkipException
    from airflow_pglock.operators import scope

    monkeypatch.setenv("AIRFLOW_CONN_PGLOCK_SCOPE_DOWN", "postgres://postgres@127.0.0.1:1/nowhere")
    spec = scope._scope_spec("g.", {"key": "scope-down", "on_error": "skip", "postgres_conn_id": "pglock_scope_down"})
    task = _Task("g.wait_for_refresh")
    context = {"ti": _TaskInstance(task, {"holder": uuid.uuid4().hex}), "task": task}
    with pytest.raises(Exception) as raised:
        scope.ScopeMemberGuard(spec).execute(context)
    assert not isinstance(raised.value, AirflowSkipException), raised.value
    assert "cannot connect" in str(raised.value) and not task.ran


@pytest.mark.parametrize("setup_xcom", [{"holder": "0" * 32, "slot": 2}, None], ids=["slot-of-a-pool", "no-holder"])
def test_the_teardown_never_skips_on_a_configuration_error(setup_xcom: dict[str, Any] | None) -> None:
    """The teardown's role cannot be built (the setup's XCom names slot 2 of a pool while the scope
    now says slots=1, or holds no holder id): it fails, whatever the setup's ``on_error``."""
    from airflow_pglock.compat import AirflowFailException, AirflowSkipException
    from airflow_pglock.operators import scope

    spec = scope._scope_spec("g.", {"key": "scope-misconfigured", "on_error": "skip"})
    task = _Task("g.pglock_scope_exit")
    context = {"ti": _TaskInstance(task, setup_xcom), "task": task}
    with pytest.raises(AirflowFailException) as raised:
        scope._run_scope_task(spec, "leave", context)
    assert not isinstance(raised.value, AirflowSkipException)


POOL_DAG = """
import pendulum
import psycopg
from airflow.sdk import dag, task
from airflow_pglock.operators.scope import advisory_lock_scope


def _rows(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute("SELECT key_name, task_now FROM pglock.scopes").fetchall())


@dag(dag_id="scoped_pool", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"dsn": ""})
def scoped_pool():
    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test", slots=2):
        @task
        def a(params=None, ti=None):
            entered = ti.xcom_pull(task_ids="publish.pglock_scope_enter")
            rows = _rows(params["dsn"])
            assert entered["slot"] == 2 and rows["scope-key#slot2"] == "publish.a", (entered, rows)
            return entered["slot"]

        @task
        def b(slot, params=None):
            assert _rows(params["dsn"])["scope-key#slot2"] == "publish.b"
            return slot

        b(a())


scoped_pool_dag = scoped_pool()
"""


@pytest.mark.matrix("lock-scope", since=compat.LOCK_SCOPE_SINCE)
def test_a_scope_over_a_pool_takes_a_free_slot_its_tasks_reenter_and_skips_when_all_are_held(
    airflow_db: Any, scopes_db: Any, dsn: str, capfd: Any, caplog: Any
) -> None:
    from airflow_pglock.keys import slot_keys
    from airflow_pglock.sensors.advisory_lock import AdvisoryLockSensor

    other = _hold_scope_elsewhere(scopes_db)  # slot 1 of the pool is the key of its name
    result = run_dag(POOL_DAG, "scoped_pool", {"dsn": dsn})
    assert result.state("publish.a") == result.state("publish.b") == "success"
    assert result.state("publish.pglock_scope_exit") == "success"
    assert [row[0] for row in _scope_rows(scopes_db)] == [other], "the teardown freed slot 2, not the other's slot"
    first = "".join(capfd.readouterr()) + caplog.text
    # Their lines name the slot the scope held, not the pool's key (its slot 1: the other's scope).
    assert "pglock: took the lock scope of key 'scope-key#slot2' (int64 " in first, first[-5000:]
    assert "pglock: the lock scope of key 'scope-key#slot2' (int64 " in first, first[-5000:]
    slot_2 = slot_keys(KEY, 2)[1]
    scopes_db.execute("SELECT pg_advisory_lock(%s)", [slot_2.int64])
    try:
        scopes.enter(scopes_db, slot_2, uuid.uuid4().hex, "deployment-c: openverse manual__third", 300)
    finally:
        scopes_db.execute("SELECT pg_advisory_unlock(%s)", [slot_2.int64])
    sensor = AdvisoryLockSensor(task_id="s", key="scope-key", slots=2, postgres_conn_id="pglock_test")
    assert not sensor.poke({}), "every slot is held by a scope between its tasks"
    busy = run_dag(POOL_DAG, "scoped_pool", {"dsn": dsn})
    assert busy.state("publish.pglock_scope_enter") == "skipped"
    assert busy.state("publish.a") == "skipped"
    log = "".join(capfd.readouterr()) + caplog.text
    assert "all 2 slots of the pool key 'scope-key'" in log and "2 by lock scopes" in log
    scopes_db.execute("UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second'")
    assert sensor.poke({}), "the scopes' leases ran out: the pool is free"


def test_a_pool_setup_that_failed_before_it_learnt_its_slot_finds_and_frees_it(
    airflow_db: Any, scopes_db: Any, dsn: str
) -> None:
    """The fallback of a pool setup that failed before its work (its guard could not free the slot:
    its session was gone): the slot whose row is this acquisition's is found and freed, no other."""
    import types

    from airflow.sdk import DAG

    from airflow_pglock.compat import PythonOperator
    from airflow_pglock.keys import slot_keys
    from airflow_pglock.operators import scope
    from airflow_pglock.scope_rules import ScopeRole

    with (
        DAG("scope_pool_setup_fails", schedule=None) as dag,
        scope.advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test", slots=2),
    ):
        work = PythonOperator(task_id="work", python_callable=lambda: None)
    spec = work._pglock_scope
    other = _hold_scope_elsewhere(scopes_db)  # slot 1: another run's
    mine = uuid.uuid4().hex
    slot_2 = slot_keys(KEY, 2)[1]
    scopes_db.execute("SELECT pg_advisory_lock(%s)", [slot_2.int64])
    try:
        assert scopes.enter(scopes_db, slot_2, mine, "deployment-a: scope_pool_setup_fails manual__f", 300)[0]
    finally:
        scopes_db.execute("SELECT pg_advisory_unlock(%s)", [slot_2.int64])
    enter = dag.get_task("publish.pglock_scope_enter")
    ti = types.SimpleNamespace(
        dag_id=dag.dag_id, task_id=enter.task_id, run_id="manual__f", map_index=-1, hostname="h", task=enter
    )
    role = ScopeRole(kind="enter", holder=mine, run="deployment-a", task=enter.task_id)
    context = {"ti": ti, "task": enter, "params": {}}
    scope._free_after_failed_setup(spec, role, context, {"key": "scope-key", "tenant": None}, enter.log)
    assert [row[0] for row in _scope_rows(scopes_db)] == [other], "its own slot freed, the other run's left alone"
    from airflow_pglock.exceptions import LockConfigurationError

    with pytest.raises(LockConfigurationError, match="was slots= changed"):
        scope._entered_slot({"holder": mine, "slot": 2}, 1)


BUSY_FAILS_DAG = """
import pendulum
from airflow.sdk import dag, task
from airflow_pglock.operators.scope import advisory_lock_scope


@dag(dag_id="scope_busy_fails", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def scope_busy_fails():
    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test", on_busy="fail",
                             member_wait=5):
        @task
        def step():
            print("STEP RAN")

        step()


scope_busy_fails_dag = scope_busy_fails()
"""


def test_a_setup_that_fails_on_a_busy_key_took_nothing_and_frees_nothing(
    airflow_db: Any, scopes_db: Any, capfd: Any, holder_hook: Any
) -> None:
    """on_busy="fail": the setup fails as soon as it finds the key busy. It took nothing, so it does
    not try to free a scope it never took (that teardown-like guard waited member_wait in the key's
    lock queue behind the holder, then warned that it could not free the scope: review helper-40)."""
    with held_lock(holder_hook, "scope-key") as blocker:
        assert blocker is not None
        result = run_dag(BUSY_FAILS_DAG, "scope_busy_fails")
    out = "".join(capfd.readouterr())
    assert result.state("publish.pglock_scope_enter") == "failed"
    assert "STEP RAN" not in out
    assert "could not free the lock scope after its setup failed" not in out, out[-3000:]
    assert len(re.findall(r"pglock outcome=\w+ key 'scope-key'", out)) == 1, out[-3000:]
    assert _scope_rows(scopes_db) == []


SAME_KEY_TEMPLATED_DAG = """
import pendulum
from airflow.sdk import dag, task
from airflow_pglock.keys import LockKey
from airflow_pglock.operators.scope import advisory_lock_scope


@dag(dag_id="scope_same_key_templated", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def scope_same_key_templated():
    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test"):
        @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ 'scope-key' }}", on_busy="skip", retries=0)
        def own_guard_on_the_scopes_key():
            print("OWN GUARD RAN")

        @task.advisory_lock(postgres_conn_id="pglock_test", key=LockKey.from_name("scope-key").int64, retries=0)
        def own_guard_on_its_number():
            print("NUMBER GUARD RAN")

        own_guard_on_the_scopes_key()
        own_guard_on_its_number()  # the name's number: another text, the same key


scope_same_key_templated_dag = scope_same_key_templated()
"""


def test_a_tasks_own_guard_on_the_scopes_key_through_a_template_fails_instead_of_skipping(
    airflow_db: Any, scopes_db: Any, capfd: Any
) -> None:
    """The parse-time check compares the key options' text: a template that renders to the scope's
    key passes it. At run time that guard found the key busy (its own scope holds it) and skipped
    the task, which lets the teardown end the scope early (review helper-40). It now fails."""
    result = run_dag(SAME_KEY_TEMPLATED_DAG, "scope_same_key_templated")
    out = "".join(capfd.readouterr())
    assert "OWN GUARD RAN" not in out
    assert result.state("publish.own_guard_on_the_scopes_key") == "failed", out[-3000:]
    assert "NUMBER GUARD RAN" not in out
    assert result.state("publish.own_guard_on_its_number") == "failed"
    for task_id in ("publish.own_guard_on_the_scopes_key", "publish.own_guard_on_its_number"):
        assert f"the guard of task {task_id!r} takes " in out, task_id
    assert "which its lock scope or an enclosing guard of the same task already holds" in out
    assert result.state("publish.pglock_scope_exit") == "success"
    assert _scope_rows(scopes_db) == []


SAME_POOL_DAG = """
import pendulum
from airflow.sdk import dag, task
from airflow_pglock.operators.scope import advisory_lock_scope


@dag(dag_id="scope_same_pool", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def scope_same_pool():
    with advisory_lock_scope("publish", key="scope-key", postgres_conn_id="pglock_test", slots=2):
        @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ 'scope-key' }}", slots=2, on_busy="skip", retries=0)
        def own_pool_guard():
            print("POOL GUARD RAN")

        @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ 'scope-key' }}", on_busy="skip", retries=0)
        def own_plain_guard():
            print("PLAIN GUARD RAN")

        own_pool_guard()
        own_plain_guard()


scope_same_pool_dag = scope_same_pool()
"""


@pytest.mark.parametrize("scope_slot", [1, 2])
def test_a_tasks_own_guard_on_the_scopes_pool_fails_whatever_slot_the_scope_holds(
    airflow_db: Any, scopes_db: Any, capfd: Any, scope_slot: int
) -> None:
    """The same-key refusal compared the key the scope held (review helper-41): a scope in slot 2
    let a guard of the pool's name through, which found slot 1 held by another run's scope and
    skipped the task (the teardown then ends the scope early); a scope in slot 1 refused it saying
    the key would always be busy, though a pool guard could take slot 2. One rule, every slot."""
    other = [_hold_scope_elsewhere(scopes_db)] if scope_slot == 2 else []  # slot 1 is the key of the name
    result = run_dag(SAME_POOL_DAG, "scope_same_pool")
    out = "".join(capfd.readouterr())
    assert "POOL GUARD RAN" not in out and "PLAIN GUARD RAN" not in out
    for task_id in ("publish.own_pool_guard", "publish.own_plain_guard"):
        assert result.state(task_id) == "failed", (task_id, out[-3000:])
        assert f"the guard of task {task_id!r} takes key 'scope-key'" in out, task_id
    refusal = f"the name of the pool whose slot {scope_slot} its lock scope or an enclosing guard of the same task"
    assert out.count(refusal) >= 2, out[-3000:]
    assert result.state("publish.pglock_scope_exit") == "success"
    assert [row[0] for row in _scope_rows(scopes_db)] == other
