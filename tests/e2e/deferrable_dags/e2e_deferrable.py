"""Airflow's own deferrable operators, guarded, in two real deployments (tests/e2e/test_deferrable_deployments.py).

Both deployments read this file and share only the lock database (connection
``postgres_default``) and a folder of files (``PGLOCK_E2E_FILES``). Every DAG has one
scheduled run and starts with ``gate``, which waits for the file ``<dag_id>.<deployment>.go``
that the test creates when it lets that deployment go. No gate touches the lock database: it
may restart at any time.

- ``e2e_deferrable_race`` (A and B; the test lets both go at once): two races of the two
  deployments. ``file``: Airflow's ``FileSensor(deferrable=True)`` guarded on
  ``e2e/deferrable/file``; it fires once the test creates ``file.file``. ``clock``: Airflow's
  ``DateTimeSensorAsync`` guarded on ``e2e/deferrable/clock``, 25 s after its start (rendered on
  the worker). In each race one deployment takes the key and defers (its triggerer holds the
  key), the other skips (``on_busy="skip"``, the default).
- ``e2e_deferrable_kill`` (A): the FileSensor on ``e2e/deferrable/kill``; the test kills A's
  triggerer while it waits. ``e2e_deferrable_peek`` (B): a plain ``@task.advisory_lock`` of the
  same key, let go while A's triggerer is down: the lease row alone keeps the key, it skips.
- ``e2e_deferrable_named`` (A): the FileSensor on ``e2e/deferrable/named``; while A's triggerer
  holds the key, the test's own guard of the key is refused.
- ``e2e_deferrable_clear`` (A): the FileSensor on ``e2e/deferrable/clear``; the test clears it
  while it is deferred (its triggerer holding the key), and fires it once the cleared try deferred.
- ``e2e_deferrable_restart`` (B): the FileSensor on ``e2e/deferrable/restart``; the lock
  database restarts while it waits.
- ``e2e_deferrable_lapse`` (A): ``DateTimeSensorAsync`` (its moment far ahead) on
  ``e2e/deferrable/lapse`` with a 30 s deferral lease (the shortest allowed); the test stops A's
  triggerer for longer. Its class only adds an ``on_kill()`` that leaves a marker file; its
  trigger is Airflow's own DateTimeTrigger, so the triggerer needs nothing of this file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pendulum
from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.providers.standard.sensors.filesystem import FileSensor
from airflow.sdk import dag, task

from airflow_pglock.operators.advisory_lock import guarded

FILES = Path(os.environ.get("PGLOCK_E2E_FILES", "/nonexistent"))
DEPLOYMENT = os.environ.get("PGLOCK_E2E_DEPLOYMENT", "?")
CONN = "postgres_default"
LEASE = 120  # seconds: bridges a killed triggerer's restart and the lock database's
LAPSE_LEASE = 30  # e2e_deferrable_lapse (the shortest deferral_lease): the test stops A's triggerer for longer
CLOCK_SECONDS = 25  # the clock race's sensor fires this long after it started
GATE_TIMEOUT = 900.0
START = pendulum.datetime(2026, 1, 1, tz="UTC")


def wait_for_go(dag_id: str) -> None:
    """Wait until the test lets this deployment go (the file ``<dag_id>.<deployment>.go``)."""
    go = FILES / f"{dag_id}.{DEPLOYMENT}.go"
    deadline = time.monotonic() + GATE_TIMEOUT
    while not go.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"deployment {DEPLOYMENT}: never let go for {dag_id}")
        time.sleep(0.3)


class MarkedDateTimeSensorAsync(DateTimeSensorAsync):
    """Airflow's DateTimeSensorAsync whose ``on_kill()`` leaves the file ``<dag_id>.<task_id>.on_kill``."""

    def on_kill(self) -> None:
        (FILES / f"{self.dag_id}.{self.task_id}.on_kill").write_text(DEPLOYMENT)
        super().on_kill()


def one_run(dag_id: str) -> Any:
    """``@dag``: one scheduled run (2026-01-01) as soon as the dag-processor has parsed the file."""
    return dag(dag_id=dag_id, schedule="@daily", start_date=START, end_date=START, catchup=True)


def gate(dag_id: str) -> Any:
    @task(task_id="gate")
    def wait() -> None:
        wait_for_go(dag_id)

    return wait()


def file_sensor(name: str) -> FileSensor:
    """Airflow's FileSensor, deferrable, guarded on ``e2e/deferrable/<name>``; it waits for ``<name>.file``."""
    sensor = FileSensor(task_id=name, filepath=str(FILES / f"{name}.file"), deferrable=True, poke_interval=1)
    return guarded(sensor, key=f"e2e/deferrable/{name}", deferral_lease=LEASE, postgres_conn_id=CONN)


@one_run("e2e_deferrable_race")
def e2e_deferrable_race() -> None:
    soon = f"{{{{ (macros.datetime.utcnow() + macros.timedelta(seconds={CLOCK_SECONDS})).isoformat() }}}}+00:00"
    clock = guarded(
        DateTimeSensorAsync(task_id="clock", target_time=soon),
        key="e2e/deferrable/clock",
        deferral_lease=LEASE,
        postgres_conn_id=CONN,
    )
    gate("e2e_deferrable_race") >> [file_sensor("file"), clock]


def gated_file_sensor(name: str) -> Any:
    @one_run(f"e2e_deferrable_{name}")
    def gated() -> None:
        gate(f"e2e_deferrable_{name}") >> file_sensor(name)

    return gated()


@one_run("e2e_deferrable_peek")
def e2e_deferrable_peek() -> None:
    @task.advisory_lock(key="e2e/deferrable/kill", postgres_conn_id=CONN, on_busy="skip")
    def peek() -> None:
        (FILES / "peek.ran").write_text(DEPLOYMENT)

    gate("e2e_deferrable_peek") >> peek()


@one_run("e2e_deferrable_lapse")
def e2e_deferrable_lapse() -> None:
    sensor = MarkedDateTimeSensorAsync(task_id="lapse", target_time="2099-01-01T00:00:00+00:00")
    lapse = guarded(sensor, key="e2e/deferrable/lapse", deferral_lease=LAPSE_LEASE, postgres_conn_id=CONN)
    gate("e2e_deferrable_lapse") >> lapse


e2e_deferrable_race_dag = e2e_deferrable_race()
if DEPLOYMENT == "A":
    e2e_deferrable_kill_dag = gated_file_sensor("kill")
    e2e_deferrable_named_dag = gated_file_sensor("named")
    e2e_deferrable_clear_dag = gated_file_sensor("clear")
    e2e_deferrable_lapse_dag = e2e_deferrable_lapse()
if DEPLOYMENT == "B":
    e2e_deferrable_peek_dag = e2e_deferrable_peek()
    e2e_deferrable_restart_dag = gated_file_sensor("restart")
