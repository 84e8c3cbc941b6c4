"""Loss and errors through a real Airflow run (dag.test): a task whose lock session is
terminated mid-run fails (it is interrupted, it does not sleep on), ``on_lost="warn"``
lets it finish, and DNS / connect-timeout errors fail the task with the cause, or skip it
with a log line when ``on_error="skip"``.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import advisory_locks, run_dag

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.airflow]

FAULTS_DAG = '''
import json
import os
import threading
import time

import pendulum
import psycopg
from airflow.sdk import dag, task

MARKS = os.environ["PGLOCK_FAULT_MARKS"]
ADMIN_DSN = os.environ["PGLOCK_FAULT_ADMIN_DSN"]


def mark(name, **data):
    with open(MARKS, "a") as marks:
        marks.write(json.dumps({"name": name, "t": time.monotonic(), **data}) + "\\n")


def terminate_later(pid, delay):
    """What an administrator (or a failover) does to the lock session, from outside the work."""
    def terminate():
        time.sleep(delay)
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        mark("terminated", pid=pid)
    threading.Thread(target=terminate, daemon=True).start()


@dag(dag_id="lock_faults", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def lock_faults():
    @task.advisory_lock(postgres_conn_id="pglock_test", key="dag-fault-lost")  # the default lease: 30 s
    def lost_fails(lock):
        in_main_thread = threading.current_thread() is threading.main_thread()
        mark("lost_fails started", pid=lock.backend_pid, main_thread=in_main_thread)
        terminate_later(lock.backend_pid, 0.3)
        try:
            time.sleep(30)
            mark("lost_fails slept through")  # never: the loss interrupts the sleep
        except Exception:
            mark("lost_fails caught Exception")  # never: the interruption is not an Exception
            raise
        finally:
            mark("lost_fails finally", lost=lock.lost)

    @task.advisory_lock(postgres_conn_id="pglock_test", key="dag-fault-warn", lease=3, on_lost="warn")
    def lost_warns(lock):
        terminate_later(lock.backend_pid, 0.3)
        time.sleep(2.5)
        mark("lost_warns finished", lost=lock.lost)
        return "finished, without the lock for the last 2 s"

    @task.advisory_lock(postgres_conn_id="pglock_dns")
    def dns_failure():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_dns", on_error="skip")
    def dns_failure_skip():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_blackhole")
    def connect_timeout():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_blackhole", on_error="skip")
    def connect_timeout_skip():
        raise AssertionError("must not run")

    for t in (lost_fails, lost_warns, dns_failure, dns_failure_skip, connect_timeout, connect_timeout_skip):
        t()


lock_faults_dag = lock_faults()
'''


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A port whose listener completes the TCP handshake and then never says a word."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


@pytest.fixture
def fault_env(dsn: str, blackhole: int) -> Iterator[Path]:
    marks = Path(tempfile.mkstemp(prefix="pglock-marks-")[1])
    names = {
        "PGLOCK_FAULT_MARKS": str(marks),
        "PGLOCK_FAULT_ADMIN_DSN": dsn,
        "AIRFLOW_CONN_PGLOCK_DNS": "postgresql://postgres@pglock-no-such-host.invalid:5432/x?connect_timeout=5",
        "AIRFLOW_CONN_PGLOCK_BLACKHOLE": f"postgresql://postgres@127.0.0.1:{blackhole}/x?connect_timeout=2",
    }
    os.environ.update(names)
    yield marks
    for name in names:
        os.environ.pop(name, None)
    marks.unlink(missing_ok=True)


def test_loss_fails_the_task_and_errors_fail_or_skip(airflow_db: Any, admin: Any, fault_env: Path, capfd: Any) -> None:
    started = time.monotonic()
    result = run_dag(FAULTS_DAG, "lock_faults")
    log = "".join(capfd.readouterr())
    marks = [json.loads(line) for line in fault_env.read_text().splitlines()]
    names = [mark["name"] for mark in marks]
    at = {mark["name"]: mark for mark in marks}

    assert result.states == {
        ("lost_fails", -1): "failed",
        ("lost_warns", -1): "success",
        ("dns_failure", -1): "failed",
        ("dns_failure_skip", -1): "skipped",
        ("connect_timeout", -1): "failed",
        ("connect_timeout_skip", -1): "skipped",
    }

    # Lost -> interrupted at once (the socket watch; the next heartbeat of a 30 s lease is 10 s
    # away), never ran on, never reported success.
    assert at["lost_fails started"]["main_thread"] is True  # Airflow runs the task in the main thread
    assert "lost_fails slept through" not in names and "lost_fails caught Exception" not in names
    pid = at["lost_fails started"]["pid"]
    [terminated] = [mark for mark in marks if mark["name"] == "terminated" and mark["pid"] == pid]
    interrupted_after = at["lost_fails finally"]["t"] - terminated["t"]
    print(f"\nMEASURED dag.test: pg_terminate_backend -> task interrupted: {interrupted_after:.3f} s")
    assert interrupted_after <= 2.0
    assert "the session was terminated" in at["lost_fails finally"]["lost"]  # first reason, at the interruption
    assert "terminated by pg_terminate_backend() (an administrator" in log  # refined by asking the server
    assert "LockLostError" in log and "Another worker may now run the same work" in log

    # on_lost="warn": the work finishes, knows it lost the lock, and the log says so.
    assert "terminated" in at["lost_warns finished"]["lost"]
    assert "on_lost='warn': the work went on without the lock" in log

    # Errors name their cause; on_error="skip" says in the log why it skipped.
    assert "pglock-no-such-host.invalid" in log and "resolve host" in log
    assert "timeout" in log and str(os.environ["AIRFLOW_CONN_PGLOCK_BLACKHOLE"].split(":")[2].split("/")[0]) in log
    assert log.count("pglock on_error='skip': skipping instead of failing") == 2
    assert advisory_locks(admin) == []
    assert time.monotonic() - started < 120
