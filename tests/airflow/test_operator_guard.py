"""guarded(operator): any operator under an advisory lock, in a real Airflow 3 on a real PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from airflow_pglock.compat import HAS_LOCK_SCOPE, LOCK_SCOPE_SINCE
from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from devtools.pgcluster import free_port
from tests.helpers import advisory_locks, advisory_locks_once_exited, assert_unknown_param_reported, run_dag

pytestmark = pytest.mark.airflow

LOST_SLEEP = "37.25"  # a distinctive sleep, to find the child process the lost task must kill

GUARD_DAG = '''
import pendulum
from airflow.providers.common.sql.operators.sql import SQLExecuteQueryOperator
from airflow.providers.standard.operators.bash import BashOperator
from airflow.providers.standard.triggers.temporal import DateTimeTrigger
from airflow.sdk import BaseOperator, dag

from airflow_pglock.operators.advisory_lock import guarded

CONN = "pglock_test"


class DefersAnyway(BaseOperator):
    """Defers although nobody asked it to (no deferrable flag to refuse at parse time)."""

    def execute(self, context):
        self.defer(trigger=DateTimeTrigger(moment=pendulum.now("UTC").add(hours=1)), method_name="done")

    def done(self, context, event=None):
        raise AssertionError("must not resume")


@dag(dag_id="operator_guard", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"out": "", "tenant": "acme"})
def operator_guard():
    guarded(BashOperator(task_id="busy_bash", bash_command="touch {{ params.out }}/busy_ran"),
            key="etl/busy", postgres_conn_id=CONN)
    guarded(BashOperator(task_id="free_bash", bash_command="echo {{ ti.task_id }} > {{ params.out }}/free_ran"),
            key="etl/{{ params.tenant }}", postgres_conn_id=CONN)
    guarded(BashOperator(task_id="busy_fail", bash_command="touch {{ params.out }}/busy_fail_ran"),
            key="etl/busy", on_busy="fail", postgres_conn_id=CONN)
    guarded(BashOperator(task_id="bash_fails", bash_command="exit 3"), postgres_conn_id=CONN)
    guarded(SQLExecuteQueryOperator(task_id="sql_guarded", conn_id=CONN,
                                    sql="INSERT INTO guarded_rows (id) VALUES (1)"),
            key=(42, 7), mode="transaction", postgres_conn_id=CONN)
    guarded(BashOperator(task_id="lost_bash", bash_command="sleep LOST_SLEEP; touch {{ params.out }}/lost_ran"),
            key="etl/lost", lease=3, postgres_conn_id=CONN)
    guarded(DefersAnyway(task_id="defers"), key="etl/defers", mode="transaction", postgres_conn_id=CONN)
    guarded(BashOperator(task_id="unknown_param", bash_command="true"), key="{{ params.no_such_param }}",
            postgres_conn_id=CONN)
    guarded(BashOperator(task_id="unreachable", bash_command="true"), postgres_conn_id="pglock_unreachable")


operator_guard_dag = operator_guard()
'''.replace("LOST_SLEEP", LOST_SLEEP)


@pytest.fixture
def guarded_rows(admin: Any) -> Any:
    admin.execute("DROP TABLE IF EXISTS guarded_rows; CREATE TABLE guarded_rows (id int PRIMARY KEY)")
    yield admin
    admin.execute("DROP TABLE guarded_rows")


@pytest.fixture
def unreachable_conn() -> Any:
    name = "AIRFLOW_CONN_PGLOCK_UNREACHABLE"
    os.environ[name] = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres?connect_timeout=2"
    yield
    os.environ.pop(name, None)


def _terminate_when_seen(dsn: str, application_name_prefix: str, stop: threading.Event) -> None:
    """Kill the lock session of the task once it holds its lock (another 'failover').

    Only a session holding an advisory lock: one terminated between its connect and its lock
    statement fails the task as an error, not as a lost lock (the CI race of the 3.13 leg).
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            row = conn.execute(
                "SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a"
                " JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted"
                " WHERE a.application_name LIKE %s",
                [application_name_prefix + "%"],
            ).fetchone()
            if row is not None:
                return
            time.sleep(0.2)


def _sleepers() -> list[psutil.Process]:
    """The lost task's child processes still running: this process's descendants only (dag.test runs
    the task here), since another matrix leg may be running the same DAG at the same time."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if LOST_SLEEP in " ".join(process.cmdline()):
                found.append(process)
    return found


@pytest.mark.matrix("guarded")
def test_guarded_operators(
    airflow_db: Any, dsn: str, guarded_rows: Any, unreachable_conn: Any, tmp_path: Path, capfd: Any
) -> None:
    holder = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=600))  # no heartbeat: a long lease
    held = holder.acquire("etl/busy", application_name="other deployment")
    assert held is not None
    stop = threading.Event()
    killer = threading.Thread(target=_terminate_when_seen, args=(dsn, "pglock:% operator_guard lost_bash ", stop))
    killer.start()
    try:
        result = run_dag(GUARD_DAG, "operator_guard", conf={"out": str(tmp_path)})
    finally:
        stop.set()
        killer.join()
        held.release()
    log = "".join(capfd.readouterr())

    assert result.states == {
        ("busy_bash", -1): "skipped",
        ("free_bash", -1): "success",
        ("busy_fail", -1): "failed",
        ("bash_fails", -1): "failed",
        ("sql_guarded", -1): "success",
        ("lost_bash", -1): "failed",
        ("defers", -1): "failed",
        ("unknown_param", -1): "failed",
        ("unreachable", -1): "failed",
    }, log[-4000:]

    # Busy: the operator did not run, and the skip names the key, its numbers and the holder.
    assert not (tmp_path / "busy_ran").exists() and not (tmp_path / "busy_fail_ran").exists()
    busy = LockKey.from_name("etl/busy")
    skip = next(line for line in log.splitlines() if "outcome=skipped" in line and "'etl/busy'" in line)
    assert f"int64 {busy.numbers[0]}" in skip and f"pid {held.server.backend_pid}" in skip
    assert "'other deployment'" in skip
    assert "(on_busy='fail')" in log
    # Free: the operator ran with its own templates rendered, under the rendered key.
    assert (tmp_path / "free_ran").read_text().strip() == "free_bash"
    assert re.search(r"pglock outcome=completed key 'etl/acme' \(int64 -?\d+\)", log)
    # A failing operator fails the task; its lock is released all the same (checked at the end).
    assert re.search(r"pglock outcome=failed key 'operator_guard/bash_fails' .*AirflowException", log)
    # Any operator: the SQL ran while the (42, 7) pair was held in transaction mode.
    assert guarded_rows.execute("SELECT id FROM guarded_rows").fetchall() == [(1,)]
    assert "pglock outcome=completed key (int32 pair 42, 7) mode=transaction" in log
    # Lost mid-run: the task failed and on_kill() stopped the operator's child process.
    assert "pglock outcome=lost key 'etl/lost'" in log
    assert _sleepers() == []
    assert not (tmp_path / "lost_ran").exists()
    # Deferring under a lock is refused; bad input fails with a clear message.
    assert "tried to defer while guarded by key 'etl/defers'" in log
    assert_unknown_param_reported(log)
    assert "cannot connect to the lock database 'postgres' on 127.0.0.1" in log
    # One outcome line per guarded execution that reached the lock database (not the bad template).
    assert len(re.findall(r"pglock outcome=", log)) == 8
    assert advisory_locks(guarded_rows) == []


@pytest.mark.matrix("deferrable-guard", since=LOCK_SCOPE_SINCE)
@pytest.mark.skipif(HAS_LOCK_SCOPE, reason="Airflow 3 hands the hold over (tests/airflow/test_deferrable_guard.py)")
def test_a_deferrable_operator_guard_is_refused_before_airflow_3() -> None:
    """The matrix's 'absent' on 2.11 (the marker sat on a helper of test_deferrable_guard.py, so the
    refusal was never recorded there)."""
    from airflow_pglock.operators.advisory_lock import guarded
    from tests.sdk import DAG, BashOperator

    class Deferrable(BashOperator):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.deferrable = True

    with DAG("guard_deferrable_on_2", schedule=None), pytest.raises(LockConfigurationError) as refused:
        guarded(Deferrable(task_id="d", bash_command="true"), key="k")
    assert "is deferrable, and its hold cannot pass to the triggerer: that needs Airflow 3.0 or newer" in str(
        refused.value
    )


def test_guarded_dag_survives_serialization_and_keeps_the_operator_class() -> None:
    from airflow_pglock.operators.advisory_lock import OperatorGuard, guarded
    from tests.sdk import DAG, BashOperator, DagSerialization

    with DAG("serialized_guard", schedule=None) as dag:
        op = guarded(BashOperator(task_id="vacuum", bash_command="echo {{ ds }}"), key="maintenance", tenant="x")
    assert isinstance(op, BashOperator) and isinstance(op.pglock_guard, OperatorGuard)  # type: ignore[attr-defined]

    serialized = DagSerialization.to_dict(dag)
    text = json.dumps(serialized)
    assert "maintenance" not in text  # the guard lives in the DAG file, re-applied when the worker parses it
    task = DagSerialization.from_dict(serialized).get_task("vacuum")
    assert task.task_type == "BashOperator"
    assert tuple(task.template_fields) == tuple(BashOperator.template_fields)


def test_bad_guards_are_refused_when_the_dag_is_parsed() -> None:
    from airflow_pglock.operators.advisory_lock import guarded
    from tests.sdk import DAG, BashOperator

    class MaybeDeferrable(BashOperator):
        def __init__(self, *, deferrable: bool = False, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.deferrable = deferrable

    class StartsInTriggerer(BashOperator):
        start_from_trigger = True

    with DAG("guard_parse_errors", schedule=None):
        cases: list[tuple[Any, dict[str, Any], str]] = [
            (
                MaybeDeferrable(task_id="d", bash_command="true", deferrable=True),
                {"mode": "transaction"},
                "is deferrable",
            ),
            (
                MaybeDeferrable(task_id="n", bash_command="true", deferrable=True),
                {"key": 7},
                "needs a named key" if HAS_LOCK_SCOPE else "needs Airflow 3.0 or newer",
            ),
            (StartsInTriggerer(task_id="s", bash_command="true"), {}, "start_from_trigger=True"),
            (BashOperator(task_id="l", bash_command="true"), {"deferral_lease": 0}, "deferral_lease must be"),
            (BashOperator.partial(task_id="m").expand(bash_command=["a", "b"]), {}, "mapped task 'm'"),
            ("not an operator", {}, "takes an operator"),
            (BashOperator(task_id="k", bash_command="true"), {"key": 3.5}, "3.5"),
            (BashOperator(task_id="t", bash_command="true"), {"key": 7, "tenant": "x"}, "cannot be combined"),
            (BashOperator(task_id="o", bash_command="true"), {"on_busy": "later"}, "on_busy must be one of"),
            (BashOperator(task_id="w", bash_command="true"), {"on_busy": "wait"}, "needs wait_timeout"),
        ]
        from airflow_pglock.compat import AIRFLOW_V_3_PLUS

        if AIRFLOW_V_3_PLUS:  # its task runner triggers the run after execute() returned, outside any guard
            from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator

            cases.append((TriggerDagRunOperator(task_id="tr", trigger_dag_id="x"), {}, "is a TriggerDagRunOperator"))
        for operator, options, fragment in cases:
            with pytest.raises(LockConfigurationError if fragment != "3.5" else ValueError, match=re.escape(fragment)):
                guarded(operator, **options)
        twice = guarded(BashOperator(task_id="twice", bash_command="true"))
        with pytest.raises(LockConfigurationError, match="already guarded"):
            guarded(twice)


RULES_DAG = """
import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock
from airflow_pglock.operators.advisory_lock import guarded

CONN = "pglock_test"


@dag(dag_id="guard_rules", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"period": "2026-11-30"})
def guard_rules():
    guarded(BashOperator(task_id="nightly", bash_command="echo nightly"), key="rules/nightly",
            once_per="{{ params.period }}", postgres_conn_id=CONN)
    guarded(BashOperator(task_id="fresh", bash_command="echo fresh"), key="rules/fresh", min_interval=3600,
            postgres_conn_id=CONN)
    guarded(BashOperator(task_id="fenced_bash", bash_command="echo fenced"), key="rules/fenced", fencing=True,
            postgres_conn_id=CONN)

    @task
    @advisory_lock(key="rules/composable", once_per="{{ params.period }}", fencing=True, postgres_conn_id=CONN)
    def composable(lock):
        assert lock.fencing_token is not None and lock.fencing_token > 0, lock
        return lock.fencing_token

    composable()


guard_rules_dag = guard_rules()
"""


@pytest.fixture
def ledger(admin: Any) -> Any:
    from airflow_pglock.pg import schema

    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")
    schema.migrate(admin)
    yield admin
    admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")


def test_run_rules_reach_guarded_operators_and_the_composable_decorator(
    airflow_db: Any, ledger: Any, capfd: Any
) -> None:
    """once_per, min_interval and fencing, as @task.advisory_lock has them (same run_guarded)."""

    def tokens() -> dict[str, int]:
        return dict(ledger.execute("SELECT key_name, token FROM pglock.fencing_tokens").fetchall())

    first = run_dag(RULES_DAG, "guard_rules")
    assert set(first.states.values()) == {"success"}, first.states
    first_tokens = tokens()
    assert set(first_tokens) == {"rules/fenced", "rules/composable"}

    capfd.readouterr()
    second = run_dag(RULES_DAG, "guard_rules")
    log = "".join(capfd.readouterr())
    assert second.states == {
        ("nightly", -1): "skipped",  # already done for the period
        ("fresh", -1): "skipped",  # completed less than an hour ago
        ("fenced_bash", -1): "success",
        ("composable", -1): "skipped",  # already done for the period
    }
    assert "already done for period '2026-11-30'" in log and "less than min_interval=3600 s" in log
    assert tokens()["rules/fenced"] > first_tokens["rules/fenced"]
    assert advisory_locks_once_exited(ledger) == []  # a skip after the take gives the key back


INTERRUPTED_DAG = '''
import datetime as dt
import json
import os
import signal
import time

import pendulum
import psycopg
from airflow.sdk import BaseOperator, dag

from airflow_pglock.operators.advisory_lock import guarded

# Who holds the named key now, read from a connection of its own (the design's key formula in SQL).
HOLDERS = """
SELECT l.pid
  FROM pg_locks l, (SELECT ('x' || left(encode(sha256(convert_to(%s, 'UTF8')), 'hex'), 16))::bit(64)::bigint) AS k(n)
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.classid::bigint = (k.n >> 32) & 4294967295 AND l.objid::bigint = k.n & 4294967295
"""


class ExternalJob(BaseOperator):
    """Starts an external job and waits for it; its on_kill() cancels it. Records who holds its key."""

    template_fields = ("out",)

    def __init__(self, *, out, key, ending, **kwargs):
        super().__init__(**kwargs)
        self.out, self.key, self.ending = out, key, ending

    def _record(self, event):
        with psycopg.connect(os.environ["AIRFLOW_CONN_PGLOCK_TEST"], autocommit=True) as conn:
            holders = [row[0] for row in conn.execute(HOLDERS, [self.key]).fetchall()]
        with open(os.path.join(self.out, "records.jsonl"), "a") as record:
            record.write(json.dumps({"event": event, "holders": holders}) + "\\n")

    def execute(self, context):
        self._record("started")
        if self.ending == "sigint":
            # Python's own handler: a process started in the background (CI's) inherits SIGINT ignored
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: Python raises KeyboardInterrupt here
        time.sleep(60)

    def on_kill(self):
        self._record("on_kill")


@dag(dag_id="operator_ENDING", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"out": ""})
def operator_interrupted():
    guarded(ExternalJob(task_id="job", out="{{ params.out }}", key="job/ENDING", ending="ENDING",
                        execution_timeout=dt.timedelta(seconds=2)), key="job/ENDING", postgres_conn_id="pglock_test")


operator_interrupted_dag = operator_interrupted()
'''


@pytest.mark.parametrize(
    ("ending", "interruption"), [("timeout", "AirflowTaskTimeout"), ("sigint", "KeyboardInterrupt")]
)
def test_an_interrupted_operator_is_stopped_while_its_key_is_held(
    airflow_db: Any, admin: Any, tmp_path: Path, capfd: Any, caplog: Any, ending: str, interruption: str
) -> None:
    """Review rev87 F3: Airflow calls on_kill() after an execution timeout only once the timeout has
    left the guard, after the release: another holder could start while the external job still ran.
    The guard calls on_kill() itself while the key is held (also on Ctrl-C), and Airflow's own call
    after the timeout does not call it a second time."""
    from airflow_pglock.compat import AIRFLOW_V_3_PLUS

    source = INTERRUPTED_DAG.replace("ENDING", ending)
    if AIRFLOW_V_3_PLUS:
        result = run_dag(source, f"operator_{ending}", conf={"out": str(tmp_path)})
        assert result.states == {("job", -1): "failed"}
    else:  # Airflow 2's dag.test() raises what is not an Exception (its AirflowTaskTimeout is not)
        with pytest.raises(BaseException) as raised:
            run_dag(source, f"operator_{ending}", conf={"out": str(tmp_path)})
        assert type(raised.value).__name__ == interruption
    log = "".join(capfd.readouterr()) + caplog.text
    started, *killed = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert started["event"] == "started" and len(started["holders"]) == 1, started
    # on_kill() ran once, while the task's own lock session still held the key.
    assert killed == [{"event": "on_kill", "holders": started["holders"]}], killed
    assert re.search(rf"pglock outcome=failed key 'job/{ending}' .*{interruption}", log), log[-4000:]
    assert "interrupted task job: its on_kill() runs while it still holds" in log
    if ending == "timeout":  # Airflow's own call after the timeout found it done
        assert f"on_kill() of task job ran already, under its key, after {interruption}" in log
    assert advisory_locks(admin) == []
