"""guarded(deferrable operator): the hold follows the task into the triggerer and back (dag.test()).

dag.test() runs each deferral's trigger in this process, on an event loop of its own, through
the same GuardedTrigger and hold hub a real triggerer runs: these tests show what each step does
with the key and its lease row (held by the worker's connection, then by the hold hub's one
session, then by the worker again; one fencing token throughout; the row freed at the end), and
what a fault does while the task is deferred: the hub's session killed (the key is taken back
under the lease: the task succeeds) or the lease run out meanwhile (lost: ``on_kill()`` and a
failed task). tests/e2e/test_deferrable_deployments.py runs the same in real processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import advisory_locks_once_exited, run_dag

pytestmark = pytest.mark.airflow

compat = pytest.importorskip("airflow_pglock.compat")
if not compat.HAS_LOCK_SCOPE:
    pytest.skip("a deferred hold needs Airflow 3 (refused at parse time on 2.x)", allow_module_level=True)

DEFER_DAG = '''
import asyncio
import datetime as dt
import json
import pathlib
import time

import pendulum
import psycopg
from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import BaseOperator, dag
from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_pglock.keys import LockKey
from airflow_pglock.operators.advisory_lock import guarded

CONN = "pglock_test"


def holder_of(conn, key):
    """The application_name of the session that holds ``key`` (None: nobody)."""
    classid, objid, objsubid = LockKey.from_name(key).pg_locks
    row = conn.execute(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = %s AND l.objid::bigint = %s"
        " AND l.objsubid = %s",
        [classid, objid, objsubid],
    ).fetchone()
    return row[0] if row else None


def row_of(conn, key):
    row = conn.execute(
        "SELECT task_now, token, lease_until > clock_timestamp() FROM pglock.scopes WHERE key_name = %s", [key]
    ).fetchone()
    return list(row) if row else None


class Fault(BaseTrigger):
    """Waits a moment in the triggerer; does to the hold what a fault would; says who held the key."""

    def __init__(self, dsn, key, fault):
        super().__init__()
        if fault == "unbuildable":  # as a trigger whose module or arguments the triggerer lacks
            raise RuntimeError("this trigger cannot be built in the triggerer")
        self.dsn, self.key, self.fault = dsn, key, fault

    def serialize(self):
        fault = "unbuildable" if self.fault == "unbuildable_in_triggerer" else self.fault
        return f"{type(self).__module__}.Fault", {"dsn": self.dsn, "key": self.key, "fault": fault}

    async def run(self):
        await asyncio.sleep(0.5)
        if self.fault == "raise":
            raise RuntimeError("the external job's API answered 500")
        seen = await asyncio.to_thread(self._act)
        await asyncio.sleep(4)  # the hub notices a killed session within moments, and takes the key back
        seen["after"] = await asyncio.to_thread(self._look)
        yield TriggerEvent(seen)

    def _look(self):
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return {"holder": holder_of(conn, self.key), "row": row_of(conn, self.key)}

    def _act(self):
        seen = self._look()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            if self.fault == "lapse":  # as a triggerer gone longer than the lease
                conn.execute("UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second'"
                             " WHERE key_name = %s", [self.key])
            if self.fault in ("kill", "lapse"):
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                             " WHERE application_name = 'airflow-pglock deferred holds'")
        return seen


class Steps(BaseOperator):
    """Defers ``defers`` times; records who holds its key and its row at every step."""

    template_fields = ("dsn", "out")

    def __init__(self, *, key, dsn, out, fault="none", defers=2, **kwargs):
        super().__init__(**kwargs)
        self.key, self.dsn, self.out, self.fault, self.defers = key, dsn, out, fault, defers

    def execute(self, context):
        self._record("execute", context, None)
        if self.fault == "foreign_row":  # another's live row appears under the key: no hand-over possible
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                classid, objid, objsubid = LockKey.from_name(self.key).pg_locks
                conn.execute(
                    "INSERT INTO pglock.scopes (objsubid, classid, objid, key_name, holder, run, acquired_at,"
                    " lease_until) VALUES (%s, %s, %s, %s, 'foreign', 'another: app', clock_timestamp(),"
                    " clock_timestamp() + interval '5 minutes')",
                    [objsubid, classid, objid, self.key],
                )
        self.defer(trigger=Fault(self.dsn, self.key, self.fault), method_name="step", kwargs={"n": 1})

    def step(self, context, event=None, n=0):
        self._record(f"step{n}", context, event)
        if self.fault == "kill_in_resume":  # the resumed task's own lock session ends under it
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                classid, objid, objsubid = LockKey.from_name(self.key).pg_locks
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                    " AND classid::bigint = %s AND objid::bigint = %s AND objsubid = %s",
                    [classid, objid, objsubid],
                )
            time.sleep(10)  # the heartbeat's socket watch interrupts this within moments
        if n < self.defers:
            self.defer(trigger=Fault(self.dsn, self.key, "none"), method_name="step", kwargs={"n": n + 1})
        return n

    def on_kill(self):
        pathlib.Path(self.out, f"{self.task_id}.killed").touch()

    def _record(self, step, context, event):
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            line = {"step": step, "holder": holder_of(conn, self.key), "row": row_of(conn, self.key),
                    "xcom_token": context["ti"].xcom_pull(task_ids=self.task_id, key="pglock_fencing_token"),
                    "event": event}
        with open(pathlib.Path(self.out, f"{self.task_id}.jsonl"), "a") as out:
            out.write(json.dumps(line) + "\\n")


@dag(dag_id="deferrable_guard", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"dsn": "", "out": ""})
def deferrable_guard():
    guarded(Steps(task_id="steps", key="defer/steps", dsn="{{ params.dsn }}", out="{{ params.out }}"),
            key="defer/steps", fencing=True, deferral_lease=60, postgres_conn_id=CONN)
    guarded(Steps(task_id="killed_session", key="defer/kill", dsn="{{ params.dsn }}", out="{{ params.out }}",
                  fault="kill", defers=1), key="defer/kill", deferral_lease=60, postgres_conn_id=CONN)
    guarded(Steps(task_id="lapsed", key="defer/lapse", dsn="{{ params.dsn }}", out="{{ params.out }}",
                  fault="lapse", defers=1), key="defer/lapse", deferral_lease=60, postgres_conn_id=CONN)
    # A lease far longer than the run: the check at the end sees which rows were left, whatever
    # order dag.test() ran the tasks in (a 60 s lease had run out by then on a slow run).
    for task_id, fault in (("foreign_row", "foreign_row"), ("kill_in_resume", "kill_in_resume"), ("raises", "raise"),
                           ("unbuildable", "unbuildable_in_triggerer")):
        guarded(Steps(task_id=task_id, key=f"defer/{task_id}", dsn="{{ params.dsn }}", out="{{ params.out }}",
                      fault=fault, defers=1), key=f"defer/{task_id}", deferral_lease=1800, postgres_conn_id=CONN)
    soon = "{{ (macros.datetime.utcnow() + macros.timedelta(seconds=2)).isoformat() }}"
    guarded(DateTimeSensorAsync(task_id="date_time", target_time=soon), key="defer/sensor", postgres_conn_id=CONN)


deferrable_guard_dag = deferrable_guard()
'''

HOLDS = "airflow-pglock deferred holds"


def _steps(out: Path, task_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"{task_id}.jsonl").read_text().splitlines()]


@pytest.mark.matrix("deferrable-guard", since=compat.LOCK_SCOPE_SINCE)
def test_the_hold_follows_a_deferred_operator_into_the_triggerer_and_back(
    airflow_db: Any, scopes_db: Any, dsn: str, tmp_path: Path, capfd: Any, caplog: Any
) -> None:
    result = run_dag(DEFER_DAG, "deferrable_guard", {"dsn": dsn, "out": str(tmp_path)})
    log = "".join(capfd.readouterr()) + caplog.text

    # Two deferrals: the worker holds the key, then the triggerer's hold hub, then the worker again.
    assert result.state("steps") == "success", log[-3000:]
    steps = _steps(tmp_path, "steps")
    assert [s["step"] for s in steps] == ["execute", "step1", "step2"]
    assert steps[0]["holder"] not in (None, HOLDS) and steps[0]["row"] is None, steps[0]
    for resumed in steps[1:]:
        assert resumed["event"]["holder"] == HOLDS, resumed  # while the trigger waited
        assert resumed["event"]["row"][0].endswith("(deferred, held by the triggerer)") and resumed["event"]["row"][2]
        assert resumed["holder"] not in (None, HOLDS), resumed  # re-entered by the resumed task
        assert resumed["row"][0] == "steps" and resumed["row"][2], resumed
    tokens = {s["xcom_token"] for s in steps} | {s["row"][1] for s in steps[1:]}
    assert len(tokens) == 1 and None not in tokens, f"one fencing token for the whole task: {steps}"

    # The hub's session killed mid-wait: the key is taken back under the lease, the task succeeds.
    assert result.state("killed_session") == "success", log[-3000:]
    killed = _steps(tmp_path, "killed_session")
    assert killed[1]["event"]["holder"] == HOLDS and killed[1]["event"]["after"]["holder"] == HOLDS, killed
    assert not (tmp_path / "killed_session.killed").exists()

    # The lease ran out while the session was gone: lost; on_kill() is called, the task fails.
    assert result.state("lapsed") == "failed"
    assert [s["step"] for s in _steps(tmp_path, "lapsed")] == ["execute"], "its resume method never ran"
    assert (tmp_path / "lapsed.killed").exists(), "on_kill() stops the external work"
    assert "lost the hold of key 'defer/lapse'" in log and "its lease ran out at" in log

    # Each way the hold can end across a deferral stops the external work (on_kill) and fails: never a skip.
    assert result.state("foreign_row") == "failed" and (tmp_path / "foreign_row.killed").exists()
    assert "the hold could not pass to the triggerer" in log or "took the key's scope" in log
    assert result.state("kill_in_resume") == "failed" and (tmp_path / "kill_in_resume.killed").exists()
    assert result.state("raises") == "failed" and (tmp_path / "raises.killed").exists()
    assert "the trigger of task 'raises' failed while it held 'defer/raises'" in log
    assert [s["step"] for s in _steps(tmp_path, "raises")] == ["execute"]
    # A trigger the triggerer cannot build: the same path.
    assert result.state("unbuildable") == "failed" and (tmp_path / "unbuildable.killed").exists()
    assert "the trigger of task 'unbuildable' failed while it held 'defer/unbuildable'" in log
    assert "could not be built in the triggerer: RuntimeError: this trigger cannot be built" in log
    assert [s["step"] for s in _steps(tmp_path, "unbuildable")] == ["execute"]
    # Airflow's own deferrable sensor, guarded.
    assert result.state("date_time") == "success", log[-3000:]
    assert "pglock: date_time deferred to airflow.providers.standard.triggers.temporal.DateTimeTrigger" in log

    live = "SELECT key_name, holder FROM pglock.scopes WHERE lease_until > clock_timestamp() ORDER BY key_name"
    left = scopes_db.execute(live).fetchall()
    # Freed: every hold, the failed trigger's too. Left: the foreign row, and the row of the hold
    # lost in its resume method (nothing could free it under the key; its lease ends it).
    assert [(key, holder == "foreign") for key, holder in left] == [
        ("defer/foreign_row", True),
        ("defer/kill_in_resume", False),
    ], left
    assert advisory_locks_once_exited(scopes_db) == []  # lost holds close without an unlock


def _deferring(task_id: str, on_kill: Any = None) -> Any:
    """An operator that defers for five minutes (Airflow's DateTimeTrigger), then resumes with ``done``."""
    import datetime as dt

    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from airflow_pglock.compat import BaseOperator

    class Defers(BaseOperator):
        def execute(self, context: Any) -> None:
            moment = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
            self.defer(trigger=DateTimeTrigger(moment=moment), method_name="done")

        def done(self, context: Any, event: Any = None) -> str:
            return "resumed"

        def on_kill(self) -> None:
            if on_kill is not None:
                on_kill()

    return Defers(task_id=task_id)


def _context_of(operator: Any, *, try_number: int = 1, clear_number: int = 0, started: Any = None) -> Any:
    """A task's context as a guarded operator reads it outside a DAG run (dag_id 'd', run 'manual__r')."""
    import datetime as dt
    import types

    ti = types.SimpleNamespace(
        dag_id="d",
        task_id=operator.task_id,
        run_id="manual__r",
        map_index=-1,
        hostname="h",
        task=operator,
        try_number=try_number,
        xcom_push=lambda **_: None,
    )
    start = started or dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)
    return {"ti": ti, "task": operator, "dag_run": types.SimpleNamespace(start_date=start, clear_number=clear_number)}


def test_a_task_airflow_resumes_with_fail_frees_the_hold_it_handed_over_and_stops_its_work(
    airflow_db: Any, scopes_db: Any, tmp_path: Path
) -> None:
    """Airflow's ``__fail__`` (a GuardedTrigger the triggerer could not run at all, Airflow's own
    deferral timeout) bypassed the guard: no on_kill(), the row kept the key until its lease
    ended, and a guarded sensor with soft_fail was skipped."""

    from airflow.providers.standard.sensors.python import PythonSensor

    from airflow_pglock.compat import TaskDeferred
    from airflow_pglock.exceptions import LockLostError
    from airflow_pglock.operators.advisory_lock import guarded

    killed = tmp_path / "killed"

    deferring = _deferring("t", on_kill=killed.touch)
    operator = guarded(deferring, key="defer/fail", deferral_lease=600, postgres_conn_id="pglock_test")
    context = _context_of(operator)
    with pytest.raises(TaskDeferred):
        operator.execute(context)  # the hand-over: the row holds the key for the trigger
    assert [row[0] for row in scopes_db.execute("SELECT key_name FROM pglock.scopes").fetchall()] == ["defer/fail"]
    with pytest.raises(LockLostError, match=r"failed while it held 'defer/fail'.*__fail__ \(Trigger failure\)"):
        operator.resume_execution("__fail__", {"error": "Trigger failure"}, context)
    assert killed.exists(), "on_kill() stops the external work"
    assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone()[0] == 0, "the row is freed"

    sensor = guarded(
        PythonSensor(task_id="s", python_callable=lambda: True, soft_fail=True),
        key="defer/fail-sensor",
        on_busy="defer",
        wait_timeout=60,
        postgres_conn_id="pglock_test",
    )
    with pytest.raises(Exception, match="Trigger failure") as failed:  # no hold handed over: Airflow's error
        sensor.resume_execution("__fail__", {"error": "Trigger failure"}, _context_of(sensor))
    assert "Skip" not in type(failed.value).__name__


def test_a_task_cleared_while_deferred_takes_over_its_own_row(airflow_db: Any, scopes_db: Any) -> None:
    """Clearing a deferred task cancels its trigger (the key is let go, the row stays for the lease)
    and raises the run's clear_number. The hold's id hashed that number, so the cleared try found
    its own row another's and skipped, "held by the triggerer", for up to deferral_lease."""
    import datetime as dt
    import types

    from airflow_pglock.compat import TaskDeferred
    from airflow_pglock.operators.advisory_lock import guarded

    operator = guarded(_deferring("t"), key="defer/cleared", deferral_lease=600, postgres_conn_id="pglock_test")
    started = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)

    def context_of(try_number: int, clear_number: int) -> Any:
        return _context_of(operator, try_number=try_number, clear_number=clear_number, started=started)

    def holders() -> list[str]:
        return [row[0] for row in scopes_db.execute("SELECT holder FROM pglock.scopes").fetchall()]

    with pytest.raises(TaskDeferred):
        operator.execute(context_of(1, 0))  # the first try hands its hold over, and is cleared
    [first] = holders()
    with pytest.raises(TaskDeferred):  # was AirflowSkipException: "held by the triggerer"
        operator.execute(context_of(2, 1))
    assert holders() == [first], "the cleared try took its own row over"
    with pytest.raises(Exception, match="held by the deferred task"):  # another run's task is still refused
        operator.execute({**context_of(1, 0), "dag_run": types.SimpleNamespace(start_date=started + dt.timedelta(1))})


@pytest.mark.parametrize("interruption", ["AirflowTaskTimeout", "KeyboardInterrupt"])
def test_a_resumed_method_interrupted_is_stopped_while_its_key_is_held(
    airflow_db: Any, scopes_db: Any, interruption: str
) -> None:
    """Review rev87 F3, the resume: an execution timeout (or Ctrl-C) in the operator's resume method,
    which runs under the re-entered hold: its on_kill() runs before the key is let go, once (the
    task runner's own call after a timeout, made as Airflow makes it, does not call it again)."""
    from airflow_pglock.compat import AirflowTaskTimeout, TaskDeferred
    from airflow_pglock.keys import LockKey
    from airflow_pglock.operators.advisory_lock import guarded
    from airflow_pglock.triggers.guarded import HELD

    classid, objid, objsubid = LockKey.from_name("defer/interrupted").pg_locks

    def holders() -> list[int]:  # read from a connection of its own
        query = (
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid::bigint = %s"
            " AND objid::bigint = %s AND objsubid = %s"
        )
        return [row[0] for row in scopes_db.execute(query, [classid, objid, objsubid]).fetchall()]

    seen: list[list[int]] = []  # who held the key at each on_kill() call
    resumed_by: list[list[int]] = []  # who held it while the resume method ran: the task's own session
    deferring = _deferring("t", on_kill=lambda: seen.append(holders()))

    def done(self: Any, context: Any, event: Any = None) -> None:
        resumed_by.append(holders())
        raise AirflowTaskTimeout("Timeout, PID: 1") if interruption == "AirflowTaskTimeout" else KeyboardInterrupt()

    type(deferring).done = done  # type: ignore[attr-defined]
    operator = guarded(deferring, key="defer/interrupted", deferral_lease=600, postgres_conn_id="pglock_test")
    context = _context_of(operator)
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(context)  # the hand-over: the row carries the hold to the resume
    event = {"pglock": HELD, "event": None}
    with pytest.raises(BaseException) as interrupted:  # as Airflow runs it: on_kill() after a timeout
        try:
            operator.resume_execution(deferred.value.method_name, {**deferred.value.kwargs, "event": event}, context)
        except AirflowTaskTimeout:
            operator.on_kill()
            raise
    assert type(interrupted.value).__name__ == interruption
    assert len(resumed_by) == 1 and len(resumed_by[0]) == 1, resumed_by
    assert seen == resumed_by, "on_kill() once, while the resumed task still held the key"
    assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone()[0] == 0, "the row is freed"
    if interruption == "KeyboardInterrupt":  # Airflow calls nothing then: a later call (a SIGTERM's) is the one skipped
        operator.on_kill()
        assert len(seen) == 1
    operator.on_kill()  # then the operator's own on_kill() is back
    assert len(seen) == 2
