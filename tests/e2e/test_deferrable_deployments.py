"""Guarded deferrable operators (issue #29) in real Airflow 3 deployments.

Deployment A and B each have their own AIRFLOW_HOME and metadata database (one PostgreSQL
cluster) and run ``airflow api-server`` (execution API), ``airflow scheduler``
(LocalExecutor), ``airflow dag-processor`` and ``airflow triggerer``
(tests/e2e/deployment.py). They share one lock database, in a cluster of its own so that it
can restart alone. They schedule tests/e2e/deferrable_dags/e2e_deferrable.py, whose guarded
operators are Airflow's own deferrable ones: ``FileSensor(deferrable=True)`` (it fires when the
test creates its file) and ``DateTimeSensorAsync``. Nothing runs through ``dag.test()``
(tests/airflow/test_deferrable_guard.py does): the hold goes from a LocalExecutor worker to a
real triggerer process and back to another worker.

- Both deployments run the same two guarded sensors at once, each on its own key: in each
  race one deployment holds the key, the other skips. Sampled from ``pg_locks`` and
  ``pglock.scopes`` meanwhile: only the winner's sessions (its worker, its triggerer's hold
  session, its resumed worker) ever hold the key, under one lease row, and from the first take
  to the last release the key is never without a holder or a live lease row.
- A's triggerer is SIGKILLed while its guarded sensor waits: while it is down, nobody holds the
  key but the lease row keeps it (B's ``@task.advisory_lock`` of the key and the test's own guard
  are refused, B's naming the deferred task); the restarted triggerer takes the key back under
  the same row and the task succeeds.
- The lock database restarts while B's guarded sensor waits: B's triggerer takes the key back
  on a new session, the task succeeds.
- A's triggerer is stopped for longer than the deferral lease (30 s): when it returns, the hold
  is lost, the task resumes, the operator's ``on_kill()`` runs and the task fails.

- While A's triggerer holds the key of a deferred task, a refused guard names the deferred
  task and its deployment (read from its row), next to the triggerer's hold session.
- A deferred guarded sensor cleared (``airflow tasks clear``): its next try waits for the earlier
  try's hold to let go (the triggerer cancels that trigger), takes the key over and defers again.

(``guarded(TriggerDagRunOperator(...))`` is refused on Airflow 3: its task runner triggers the
run after ``execute`` returned, outside any guard; tests/airflow/test_operator_guard.py.)

After each test no advisory lock, no live lease row and no triggerer hold session is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_pglock.exceptions import LockBusyError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import schema
from airflow_pglock.policy import LockPolicy
from devtools.pgcluster import Cluster, free_port
from tests.conftest import AIRFLOW_HOME
from tests.e2e.deployment import Deployment

pytestmark = [pytest.mark.slow, pytest.mark.airflow]

airflow_compat = pytest.importorskip("airflow_pglock.compat")
if not airflow_compat.AIRFLOW_V_3_PLUS:
    pytest.skip(
        "a guarded operator keeps its hold while deferred on Airflow 3 only (refused at parse time on 2.x); "
        "the deployments run Airflow 3 processes",
        allow_module_level=True,
    )

DAGS = Path(__file__).parent / "deferrable_dags"
RUN_ID = "scheduled__2026-01-01T00:00:00+00:00"  # the one run of every gated DAG of e2e_deferrable.py
RUN_DATE = "2026-01-01T00:00:00+00:00"  # its logical date
HOLDS = "airflow-pglock deferred holds"  # application_name of a triggerer's hold session
DEFERRED_SUFFIX = " (deferred, held by the triggerer)"
FILE_TRIGGER = "airflow.providers.standard.triggers.file.FileTrigger"
DATE_TIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"
LEASE = 120  # deferral_lease of the file sensors (e2e_deferrable.py)
LAPSE_LEASE = 30  # deferral_lease of e2e_deferrable_lapse (the shortest allowed)
FINISHED = ("success", "failed", "skipped", "upstream_failed", "removed")
DEADLINE_SECONDS = 150
# A killed triggerer's triggers go to a triggerer started again once the dead one's heartbeat is
# this old (Airflow's default: 30 s); the leases above bridge it.
TRIGGERER_ENV = {
    "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "10",
    "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
}

States = dict[str, str | None]  # task_id -> state (one run per DAG and deployment)


#: Seconds ``Setup.fire`` waits before it creates a sensor's file (see there).
FIRE_SETTLE_SECONDS = 10.0


@dataclass
class Setup:
    """The two deployments, the lock database and the folder of gate and sensor files."""

    a: Deployment
    b: Deployment
    locks: Cluster
    lock_uri: str
    files: Path

    @property
    def both(self) -> list[Deployment]:
        return [self.a, self.b]

    def go(self, dag_id: str, *deployments: Deployment) -> None:
        """Let ``deployments`` run ``dag_id`` (its gate waits for the file); all at once."""
        for deployment in deployments:
            (self.files / f"{dag_id}.{deployment.name}.tmp").write_text("go")
        for deployment in deployments:
            (self.files / f"{dag_id}.{deployment.name}.tmp").rename(self.files / f"{dag_id}.{deployment.name}.go")

    def fire(self, name: str) -> None:
        """Create the file the guarded FileSensor ``name`` waits for, once its deferral has settled.

        Airflow 3's scheduler fails a resumed try when the executor's report of the process that
        deferred arrives after that try was queued (apache/airflow#72716). The trigger fires no
        sooner than 8 s after the deferral; on a loaded machine (the whole suite runs two pytest
        processes at once) that report took 6 s once (the lock database restarting meanwhile), so
        the file comes 10 s after the test found the task deferred.
        """
        time.sleep(FIRE_SETTLE_SECONDS)
        (self.files / f"{name}.file").write_text("fire")

    def hook(self) -> AdvisoryLockHook:
        return AdvisoryLockHook(dsn=self.lock_uri)

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.lock_uri, autocommit=True, application_name="e2e deferrable test")


@pytest.fixture(scope="module")
def clusters() -> Iterator[tuple[Cluster, Cluster]]:
    """The metadata cluster (both deployments' metadata databases) and the lock database's own cluster."""
    with Cluster() as metadata, Cluster() as locks:
        yield metadata, locks


def _create_database(cluster: Cluster, name: str, template: str | None = None) -> str:
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        conn.execute(statement)
    return cluster.dsn_for(name)


@pytest.fixture(scope="module")
def setup(clusters: tuple[Cluster, Cluster]) -> Iterator[Setup]:
    """A and B: metadata DBs ``meta_a`` (migrated) and ``meta_b`` (a copy of the fresh ``meta_a``); one lock DB."""
    metadata, locks = clusters
    lock_uri = _create_database(locks, "locks")
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        schema.migrate(conn)  # airflow-pglock init-db: creates pglock.scopes, where a deferred hold's lease lives
    base = AIRFLOW_HOME / "e2e-deferrable"
    shutil.rmtree(base, ignore_errors=True)
    files = base / "files"
    files.mkdir(parents=True)
    shared_env = {
        **TRIGGERER_ENV,
        "AIRFLOW_CONN_POSTGRES_DEFAULT": lock_uri,
        "AIRFLOW_CONN_FS_DEFAULT": "fs://",  # FileSensor's connection: absolute paths as they are
        "PGLOCK_E2E_FILES": str(files),
    }
    # [pglock] deployment names each deployment's lease rows (pglock.scopes.run) and lock sessions.
    # Each triggerer serves its logs on a port of its own (both would take Airflow's default).
    env_a = {
        **shared_env,
        "AIRFLOW__PGLOCK__DEPLOYMENT": "deployment-A",
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
    }
    env_b = {
        **shared_env,
        "AIRFLOW__PGLOCK__DEPLOYMENT": "deployment-B",
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
    }
    a = Deployment("A", base / "A", _create_database(metadata, "meta_a"), free_port(), DAGS, env_a)
    a.home.mkdir(parents=True)
    migrated = a.airflow("db", "migrate")
    assert migrated.returncode == 0, f"airflow db migrate failed:\n{migrated.stdout[-3000:]}\n{migrated.stderr[-3000:]}"
    b = Deployment("B", base / "B", _create_database(metadata, "meta_b", template="meta_a"), free_port(), DAGS, env_b)
    started: list[Deployment] = []
    try:
        for deployment in (a, b):
            started.append(deployment)
            deployment.start_api_server()
        for deployment in (a, b):
            deployment.start_scheduling()
            deployment.start_triggerer()
        yield Setup(a, b, locks, lock_uri, files)
    finally:
        for deployment in started:
            deployment.stop()
            deployment.kill_leftovers()
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------- reading what happened


def _holding(conn: psycopg.Connection[Any], key: str) -> list[tuple[int, str]]:
    """(pid, application_name) of the sessions that hold ``key``."""
    classid, objid, objsubid = LockKey.from_name(key).pg_locks
    rows = conn.execute(
        "SELECT l.pid, coalesce(a.application_name, '') FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = %s AND l.objid::bigint = %s"
        " AND l.objsubid = %s AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        [classid, objid, objsubid],
    ).fetchall()
    return [(int(pid), str(name)) for pid, name in rows]


@dataclass(frozen=True)
class Row:
    """A row of ``pglock.scopes``, and whether its lease was live when read (database clock)."""

    holder: str
    run: str
    task_now: str | None
    lease_until: Any
    live: bool


def _row(conn: psycopg.Connection[Any], key: str) -> Row | None:
    found = conn.execute(
        "SELECT holder, run, task_now, lease_until, lease_until > clock_timestamp() FROM pglock.scopes"
        " WHERE key_name = %s",
        [key],
    ).fetchone()
    return Row(*found) if found else None


def _leftovers(lock_uri: str) -> dict[str, list[Any]]:
    """What is still held in the lock database: advisory locks, live lease rows, triggerer hold sessions."""
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        locks = conn.execute(
            "SELECT l.pid, a.application_name, l.classid, l.objid, l.objsubid FROM pg_locks l"
            " LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory'"
        ).fetchall()
        rows = conn.execute(
            "SELECT key_name, holder, run, task_now, lease_until FROM pglock.scopes"
            " WHERE lease_until > clock_timestamp()"
        ).fetchall()
        sessions = conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [HOLDS]).fetchall()
    return {"advisory locks": locks, "live lease rows": rows, "hold sessions": sessions}


def _states(deployment: Deployment, dag_id: str) -> States:
    return dict(deployment.query("SELECT task_id, state FROM task_instance WHERE dag_id = %s", [dag_id]))


def _task_log(deployment: Deployment, dag_id: str, task_id: str) -> str:
    """Every attempt's log of ``task_id`` in ``dag_id``, the trigger's lines included."""
    logs = deployment.home / "logs" / f"dag_id={dag_id}"
    paths = sorted(path for path in logs.rglob("*.log*") if f"/task_id={task_id}/" in path.as_posix())
    return "\n".join(path.read_text(errors="replace") for path in paths)


def _diagnosis(setup: Setup, dag_id: str) -> str:
    """What a stuck wait needs to be understood: the tasks of ``dag_id``, their logs, the lock
    database's holds, and the end of every process's log."""
    parts = [f"lock database: {_leftovers(setup.lock_uri)}"]
    for deployment in setup.both:
        states = _states(deployment, dag_id)
        parts.append(f"deployment {deployment.name} {dag_id}: {states}")
        for task_id in states:
            log = _task_log(deployment, dag_id, task_id)[-3000:]
            parts.append(f"--- {deployment.name} {dag_id}.{task_id} ---\n{log}")
        parts.append(deployment.logs())
    return "\n".join(parts)


def _wait(setup: Setup, dag_id: str, done: Callable[[], bool], what: str, *, timeout: float = DEADLINE_SECONDS) -> None:
    """Poll until ``done()``; both deployments must keep their processes meanwhile (but a triggerer
    the test stopped: see :func:`_triggerer_stopped`). Failing: ``dag_id``'s tasks and every log."""
    deadline = time.monotonic() + timeout
    while not done():
        for deployment in setup.both:
            deployment.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached after {timeout} s\n{_diagnosis(setup, dag_id)}")
        time.sleep(0.5)


def _deferred_and_held(setup: Setup, deployment: Deployment, dag_id: str, task_id: str, key: str) -> Callable[[], bool]:
    """The task is deferred and a triggerer's hold session holds its key."""

    def check() -> bool:
        if _states(deployment, dag_id).get(task_id) != "deferred":
            return False
        with setup.connect() as conn:
            return [name for _, name in _holding(conn, key)] == [HOLDS]

    return check


@pytest.fixture(autouse=True)
def nothing_left(setup: Setup) -> Iterator[None]:
    """After each test: no advisory lock, no live lease row, no triggerer hold session in the lock database."""
    yield
    deadline = time.monotonic() + 30
    left = _leftovers(setup.lock_uri)
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _leftovers(setup.lock_uri)
    assert not any(left.values()), f"left in the lock database after the test: {left}"


@contextlib.contextmanager
def _triggerer_stopped(deployment: Deployment, sig: signal.Signals) -> Iterator[None]:
    """Stop ``deployment``'s triggerer (SIGKILL: a crash; SIGTERM: a shutdown) for the block, which
    starts it again (``start_triggerer``); a block that failed before that leaves it started all the same."""
    process = deployment.processes.pop("triggerer")  # check_alive() must not count it meanwhile
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    try:
        yield
    finally:
        if "triggerer" not in deployment.processes:
            deployment.start_triggerer()


# ---------------------------------------------------------------------- the tests

Sample = tuple[Any, list[str], Row | None]  # database clock, who holds the key, its lease row


class Sampler(threading.Thread):
    """Samples, every 0.1 s, who holds ``key`` (pg_locks) and its lease row, on the database clock.

    The last sample begins after :meth:`stop` was called: a test that stops it once the tasks are
    over reads the key as they left it (a sample begun before could precede a resumed worker's
    release, which comes just before its success).
    """

    def __init__(self, lock_uri: str, key: str) -> None:
        super().__init__(daemon=True)
        self.lock_uri, self.key = lock_uri, key
        self.samples: list[Sample] = []
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.lock_uri, autocommit=True, application_name="e2e sampler") as conn:
                while True:
                    last = self._stop_event.is_set()
                    row = conn.execute("SELECT clock_timestamp()").fetchone()
                    assert row is not None
                    holders = [name for _, name in _holding(conn, self.key)]
                    self.samples.append((row[0], holders, _row(conn, self.key)))
                    if last:
                        return
                    self._stop_event.wait(0.1)
        except BaseException as error:
            self.error = error

    def stop(self) -> list[Sample]:
        self._stop_event.set()
        self.join(timeout=10)
        assert self.error is None, f"the sampler of {self.key} failed: {self.error!r}"
        return self.samples


def _timeline(samples: list[Sample]) -> str:
    """The samples where something changed (holders, row holder, task_now, liveness): one line each."""
    lines: list[str] = []
    last: Any = object()
    for at, holders, row in samples:
        seen = (tuple(holders), None if row is None else (row.holder, row.task_now, row.live, row.lease_until))
        if seen != last:
            lines.append(f"{at.isoformat(timespec='milliseconds')} holders={holders} row={seen[1]}")
            last = seen
    return "\n".join(lines)


def _check_one_hold(samples: list[Sample], winner: Deployment, dag_id: str, task_id: str) -> None:
    """The database's view of a race: only the winner's sessions ever held the key (its worker,
    its triggerer's hold session, its resumed worker), under one lease row, and from the first
    take to the last release the key was never without a holder or a live row."""
    held = [i for i, (_, holders, row) in enumerate(samples) if holders or (row is not None and row.live)]
    assert held, f"{task_id}: the key was never seen held: {samples[:5]}"
    span = samples[held[0] : held[-1] + 1]
    gaps = [sample for sample in span if not sample[1] and not (sample[2] is not None and sample[2].live)]
    assert gaps == [], f"{task_id}: moments without the key held nor its row live: {gaps}"
    assert all(len(holders) <= 1 for _, holders, _ in samples), samples
    holders_seen = {name for _, holders, _ in samples for name in holders}
    assert HOLDS in holders_seen, f"{task_id}: a triggerer's hold session held the key: {holders_seen}"
    # A worker holds the key for moments (the sensor's first poke, its resume): seen when sampled then.
    workers = holders_seen - {HOLDS}
    assert all(name.startswith(f"pglock:deployment-{winner.name}@") for name in workers), holders_seen
    rows = {(row.holder, row.run) for _, _, row in samples if row is not None}
    assert len(rows) == 1, f"{task_id}: one hold, one lease row: {rows}"
    assert rows.pop()[1] == f"deployment-{winner.name}: {dag_id} {RUN_ID}"
    task_nows = {row.task_now for _, _, row in samples if row is not None}
    assert f"{dag_id}.{task_id} {RUN_ID}{DEFERRED_SUFFIX}" in task_nows, task_nows
    assert samples[-1][1] == [] and samples[-1][2] is None, f"{task_id}: held after the end: {samples[-1]}"


def _race_states(setup: Setup, dag_id: str, task_id: str) -> list[str]:
    return sorted(str(_states(deployment, dag_id).get(task_id)) for deployment in setup.both)


def test_two_deployments_race_and_one_holds_each_key_through_its_deferral(setup: Setup) -> None:
    dag_id = "e2e_deferrable_race"
    races = {"file": (FILE_TRIGGER, "e2e/deferrable/file"), "clock": (DATE_TIME_TRIGGER, "e2e/deferrable/clock")}
    samplers = {task_id: Sampler(setup.lock_uri, key) for task_id, (_, key) in races.items()}
    for sampler in samplers.values():
        sampler.start()
    started = time.monotonic()
    setup.go(dag_id, setup.a, setup.b)  # both deployments run both guarded sensors at once

    # The file sensor waits for the test: one deployment's is deferred while the other's skipped.
    _wait(setup, dag_id, lambda: _race_states(setup, dag_id, "file") == ["deferred", "skipped"], "the file race")
    winner = next(d for d in setup.both if _states(d, dag_id)["file"] == "deferred")
    key = races["file"][1]
    _wait(setup, dag_id, _deferred_and_held(setup, winner, dag_id, "file", key), "the winner's triggerer holds the key")
    with setup.connect() as conn:
        row = _row(conn, key)
    assert row is not None and row.live, row
    assert row.run == f"deployment-{winner.name}: {dag_id} {RUN_ID}", row
    assert row.task_now == f"{dag_id}.file {RUN_ID}{DEFERRED_SUFFIX}", row
    assert setup.hook().acquire(key, application_name="e2e other guard") is None, "another guard is refused"
    setup.fire("file")

    def finished() -> bool:
        return all(_states(d, dag_id).get(task_id) in FINISHED for d in setup.both for task_id in races)

    _wait(setup, dag_id, finished, "both races over")
    samples = {task_id: sampler.stop() for task_id, sampler in samplers.items()}
    print(
        f"e2e deferrable race: over {time.monotonic() - started:.0f} s after the go: "
        f"{ {d.name: _states(d, dag_id) for d in setup.both} }; samples {[len(s) for s in samples.values()]}"
    )
    for task_id, (trigger, key) in races.items():
        assert _race_states(setup, dag_id, task_id) == ["skipped", "success"], _diagnosis(setup, dag_id)
        winner, loser = sorted(setup.both, key=lambda d: _states(d, dag_id)[task_id] != "success")
        print(f"e2e deferrable race {task_id}, the key's timeline:\n{_timeline(samples[task_id])}")  # on failure too
        try:
            _check_one_hold(samples[task_id], winner, dag_id, task_id)
        except AssertionError as failed:
            raise AssertionError(f"{failed}\n{_diagnosis(setup, dag_id)}") from None
        winner_log, loser_log = _task_log(winner, dag_id, task_id), _task_log(loser, dag_id, task_id)
        described = LockKey.from_name(key).describe()
        refusal = [line for line in loser_log.splitlines() if f"busy: {described} is held by" in line]
        print(f"e2e deferrable race {task_id}: {winner.name} held, {loser.name} skipped:", *refusal[:1], sep="\n")
        deferred = f"pglock: {task_id} deferred to {trigger}; the triggerer holds {described}"
        held = f"pglock: the triggerer holds {described} for the deferred task {dag_id}.{task_id} {RUN_ID}"
        assert deferred in winner_log and held in winner_log, winner_log[-5000:]
        assert "deferred to" not in loser_log, loser_log[-5000:]
        # The refusal names the holder: the winner's worker, its triggerer's hold session, or (the
        # key free a moment in a hand-over) the deferred task its row names.
        names = (
            f"of deployment 'deployment-{winner.name}'",
            f"application_name '{HOLDS}'",
            f"the deferred task {dag_id}.{task_id} {RUN_ID} of deployment-{winner.name}: {dag_id} {RUN_ID}",
        )
        assert refusal and any(name in refusal[0] for name in names), loser_log[-5000:]


def test_a_killed_triggerer_leaves_the_key_to_its_lease_and_takes_it_back(setup: Setup) -> None:
    a, b = setup.a, setup.b
    dag_id, peek_dag, key = "e2e_deferrable_kill", "e2e_deferrable_peek", "e2e/deferrable/kill"
    described = LockKey.from_name(key).describe()
    setup.go(dag_id, a)
    _wait(setup, dag_id, _deferred_and_held(setup, a, dag_id, "kill", key), "A's sensor deferred, the key held")
    with setup.connect() as conn:
        before = _row(conn, key)
    assert before is not None and before.live and before.run == f"deployment-A: {dag_id} {RUN_ID}", before
    held_line = f"pglock: the triggerer holds {described} for the deferred task {dag_id}.kill {RUN_ID}"
    # The triggerer hands its log lines on after the fact: a SIGKILL can lose lines already emitted
    # (a CI run lost this one), so the kill waits for the first triggerer's line to reach the log.
    _wait(setup, dag_id, lambda: held_line in _task_log(a, dag_id, "kill"), "the first triggerer's hold logged")

    with _triggerer_stopped(a, signal.SIGKILL):  # a crash mid-wait: the task stays deferred
        killed_at = time.monotonic()

        def released() -> bool:
            with setup.connect() as conn:
                return _holding(conn, key) == []

        _wait(setup, dag_id, released, "the killed triggerer's hold session gone")
        # Nobody holds the key now; its lease row keeps it: every other guard of the key is refused.
        hook = setup.hook()
        assert hook.acquire(key, application_name="e2e other guard") is None, "the test's own guard is refused"
        seen = hook.scope(key)
        assert seen is not None and seen.holder == before.holder and seen.task_now == before.task_now, seen
        setup.go(peek_dag, b)  # B's @task.advisory_lock of the same key
        _wait(setup, peek_dag, lambda: _states(b, peek_dag).get("peek") in FINISHED, "B's guard of the key")
        with setup.connect() as conn:
            during, holders = _row(conn, key), _holding(conn, key)
        peek_log = _task_log(b, peek_dag, "peek")
        print(f"e2e deferrable kill: B's guard {_states(b, peek_dag)['peek']} while A's triggerer was down:")
        print("\n".join(line[:600] for line in peek_log.splitlines() if "pglock" in line))
        assert _states(b, peek_dag)["peek"] == "skipped", _diagnosis(setup, peek_dag)
        assert not (setup.files / "peek.ran").exists()
        held_by = f"{described} is held by the deferred task {dag_id}.kill {RUN_ID} of deployment-A: {dag_id} {RUN_ID}"
        assert f"{held_by} (held by the triggerer, lease until" in peek_log, peek_log[-5000:]
        assert holders == [], f"the triggerer is down: nobody holds the key, its row does: {holders}"
        assert during is not None and during.live and during.holder == before.holder, during
        assert _states(a, dag_id)["kill"] == "deferred"
        a.start_triggerer()

    _wait(setup, dag_id, _deferred_and_held(setup, a, dag_id, "kill", key), "A's new triggerer took the key back")
    with setup.connect() as conn:
        after = _row(conn, key)
    print(f"e2e deferrable kill: the key taken back {time.monotonic() - killed_at:.0f} s after the kill: {after}")
    assert after is not None and after.live and after.holder == before.holder, "the same hold, under its own row"
    setup.fire("kill")
    _wait(setup, dag_id, lambda: _states(a, dag_id).get("kill") in FINISHED, "A's sensor resumed")
    assert _states(a, dag_id)["kill"] == "success", _diagnosis(setup, dag_id)
    log = _task_log(a, dag_id, "kill")
    taken = log.count(held_line)
    assert taken >= 2, f"each triggerer took the key:\n{log[-5000:]}"


def test_a_guard_refused_while_the_triggerer_holds_the_key_names_the_deferred_task(setup: Setup) -> None:
    a = setup.a
    dag_id, key = "e2e_deferrable_named", "e2e/deferrable/named"
    described = LockKey.from_name(key).describe()
    setup.go(dag_id, a)
    _wait(setup, dag_id, _deferred_and_held(setup, a, dag_id, "named", key), "A's sensor deferred, the key held")
    try:  # a guard of this provider, as a guarded task's (its refusal is what such a task logs when it skips)
        LockGuard(setup.hook().database, LockKey.from_name(key), LockPolicy()).run(lambda handle: None)
    except LockBusyError as busy:
        refusal = str(busy)
    else:
        raise AssertionError(f"{key} was free while A's triggerer held it")
    with setup.connect() as conn:
        holders = _holding(conn, key)
    setup.fire("named")
    _wait(setup, dag_id, lambda: _states(a, dag_id).get("named") in FINISHED, "A's sensor resumed")
    print(f"e2e deferrable named: held by {holders}; the refusal: {refusal}")
    assert _states(a, dag_id)["named"] == "success", _diagnosis(setup, dag_id)
    assert [name for _, name in holders] == [HOLDS] and f"{described} is held by" in refusal, refusal
    named = f"{described} is held by the deferred task {dag_id}.named {RUN_ID} of deployment-A: {dag_id} {RUN_ID}"
    assert named in refusal, refusal


def test_a_task_cleared_while_deferred_waits_for_its_earlier_hold_instead_of_skipping(setup: Setup) -> None:
    """Review -65: cleared while deferred, the task's next try started within a second or two, while
    the triggerer still held the key for the earlier try's trigger (it lets go once it cancels that
    trigger): the try was skipped as busy, naming itself, and the row stayed until its lease. It now
    waits for its own earlier hold, takes the key over and defers again."""
    a = setup.a
    dag_id, key = "e2e_deferrable_clear", "e2e/deferrable/clear"
    setup.go(dag_id, a)
    _wait(setup, dag_id, _deferred_and_held(setup, a, dag_id, "clear", key), "A's sensor deferred, the key held")
    with setup.connect() as conn:
        before = _row(conn, key)
    cleared = a.airflow("tasks", "clear", dag_id, "-t", "clear", "-s", RUN_DATE, "-e", RUN_DATE, "-y", timeout=180)
    assert cleared.returncode == 0, f"airflow tasks clear failed:\n{cleared.stdout[-3000:]}\n{cleared.stderr[-3000:]}"

    def tried_again() -> tuple[str | None, int]:
        [(state, try_number)] = a.query(
            "SELECT state, try_number FROM task_instance WHERE dag_id = %s AND task_id = 'clear'", [dag_id]
        )
        return state, try_number

    deferred_again = _deferred_and_held(setup, a, dag_id, "clear", key)
    _wait(
        setup,
        dag_id,
        lambda: tried_again()[1] >= 2 and (tried_again()[0] in FINISHED or deferred_again()),
        "A's cleared sensor deferred again (or ended)",
    )
    state, try_number = tried_again()
    with setup.connect() as conn:
        after = _row(conn, key)
    print(f"e2e deferrable clear: try {try_number} {state}; the row before {before}, after {after}")
    assert state == "deferred", _diagnosis(setup, dag_id)
    assert before is not None and after is not None and after.live and after.holder == before.holder, (before, after)
    setup.fire("clear")
    _wait(setup, dag_id, lambda: _states(a, dag_id).get("clear") in FINISHED, "A's cleared sensor resumed")
    assert _states(a, dag_id)["clear"] == "success", _diagnosis(setup, dag_id)


def test_the_lock_database_restarts_and_the_triggerer_takes_the_hold_back(setup: Setup) -> None:
    b = setup.b
    dag_id, key = "e2e_deferrable_restart", "e2e/deferrable/restart"
    setup.go(dag_id, b)
    _wait(setup, dag_id, _deferred_and_held(setup, b, dag_id, "restart", key), "B's sensor deferred, the key held")
    with setup.connect() as conn:
        before, [(pid_before, _)] = _row(conn, key), _holding(conn, key)
    assert before is not None and before.live, before

    setup.locks.restart()  # the lock database alone: every session to it ends
    restarted_at = time.monotonic()

    def taken_back() -> bool:
        try:
            with setup.connect() as conn:
                holders = _holding(conn, key)
        except psycopg.OperationalError:  # still starting
            return False
        return len(holders) == 1 and holders[0][1] == HOLDS and holders[0][0] != pid_before

    _wait(setup, dag_id, taken_back, "B's triggerer took the key back on a new session")
    with setup.connect() as conn:
        after = _row(conn, key)
    print(f"e2e deferrable restart: the key taken back {time.monotonic() - restarted_at:.1f} s after the restart")
    assert after is not None and after.live and after.holder == before.holder, (before, after)
    assert _states(b, dag_id)["restart"] == "deferred"
    setup.fire("restart")
    _wait(setup, dag_id, lambda: _states(b, dag_id).get("restart") in FINISHED, "B's sensor resumed")
    assert _states(b, dag_id)["restart"] == "success", _diagnosis(setup, dag_id)
    lines = [line for line in b.logs("triggerer", tail=10**7).splitlines() if "pglock" in line]
    print("e2e deferrable restart: B's triggerer:", *lines[-5:], sep="\n")


def test_a_triggerer_gone_longer_than_the_lease_loses_the_hold_and_kills_the_operator(setup: Setup) -> None:
    a = setup.a
    dag_id, key = "e2e_deferrable_lapse", "e2e/deferrable/lapse"
    described = LockKey.from_name(key).describe()
    setup.go(dag_id, a)
    _wait(setup, dag_id, _deferred_and_held(setup, a, dag_id, "lapse", key), "A's sensor deferred, the key held")
    with _triggerer_stopped(a, signal.SIGTERM):  # a shutdown: the triggerer releases its keys, the row stays

        def lapsed() -> bool:
            with setup.connect() as conn:
                row = _row(conn, key)
            return row is not None and not row.live

        _wait(setup, dag_id, lapsed, f"the {LAPSE_LEASE} s lease ran out", timeout=LAPSE_LEASE + 60)
        assert _states(a, dag_id)["lapse"] == "deferred"
        # Another guard may run in the gap: the test's own takes the key and lets it go.
        other = setup.hook().acquire(key, application_name="e2e guard in the gap")
        assert other is not None, "the lease ran out: the key is free"
        other.release()
        a.start_triggerer()

    _wait(setup, dag_id, lambda: _states(a, dag_id).get("lapse") in FINISHED, "A's sensor resumed")
    log = _task_log(a, dag_id, "lapse")
    print("e2e deferrable lapse:", *(line[:600] for line in log.splitlines() if "lost the hold" in line), sep="\n")
    assert _states(a, dag_id)["lapse"] == "failed", _diagnosis(setup, dag_id)
    marker = setup.files / f"{dag_id}.lapse.on_kill"
    assert marker.exists() and marker.read_text() == "A", "the operator's on_kill() ran on A's worker"
    trigger_lost = f"pglock: lost the hold of {described} while task {dag_id}.lapse {RUN_ID} was deferred"
    assert f"{trigger_lost}: its lease ran out at" in log, log[-5000:]
    failure = [line for line in log.splitlines() if '"exc_type":"LockLostError"' in line]
    assert failure and "lost the hold of" in failure[0] and "its lease ran out at" in failure[0], log[-5000:]
