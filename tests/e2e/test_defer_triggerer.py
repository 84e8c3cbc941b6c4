"""on_busy="defer" and the deferrable sensor in a real ``airflow triggerer`` (Airflow 3).

One deployment (api-server, scheduler with LocalExecutor, dag-processor, triggerer) with
its metadata database in one PostgreSQL cluster and the lock database in another, so the
lock database can restart alone. The test process holds the keys, as another deployment
would. While the tasks wait in the triggerer: the triggerer is killed and restarted, then
the lock database restarts (the holder takes its key back at once). Then the holder
releases: the deferred task runs exactly once, the sensor succeeds, and the task whose
key stays held ends as a skip at its deadline. All waiting triggers share one connection.

Then many tasks wait at once: ``e2e_defer_many`` maps one task ``PGLOCK_E2E_WAITERS`` ways
(48 by default, about two minutes for the module on two cores; 200, the issue's case, under
``CI=true`` or with ``PGLOCK_E2E_WAITERS=200``: that test alone about two minutes), each
deferred on a key the test holds, then released.

The event loop. The trigger runner runs under ``devtools/loopprobe``, which records every
callback over 50 ms (wall, CPU, garbage collection), every stall Airflow's watchdog would
see, and every long collection. Both tests fail on any step of airflow-pglock's code (its
triggers' steps, the wake-up hub's) over 0.1 s, GC excluded. The triggerer's own
"async thread was blocked" warning fails the first test (a few waiting tasks) outright.
With many waiting tasks a warning fails the second test unless the probe saw that stall
and none of ours caused it; it is printed with the probe's records. Measured with 200
(docs/benchmarks.md, section 9): such warnings come from the triggerer's first full
garbage collection (0.2 s of CPU, up to 1 s on a loaded machine) and, with Airflow's own
DateTimeSensorAsync, from its triggers' blocking log writes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg.held import HeldLock
from devtools.pgcluster import Cluster, free_port
from tests.conftest import AIRFLOW_HOME
from tests.e2e import loop_check
from tests.e2e.deployment import Deployment

pytestmark = [pytest.mark.slow, pytest.mark.airflow]

airflow_compat = pytest.importorskip("airflow_pglock.compat")
if not airflow_compat.AIRFLOW_V_3_PLUS:
    pytest.skip("drives Airflow 3 processes; 2.11 covers on_busy='defer' with dag.test()", allow_module_level=True)

DAGS = Path(__file__).parent / "defer_dags"
DEADLINE_SECONDS = 300
BLOCKED_WARNING = "async thread was blocked"
# CI waits with the 200 tasks (about a minute more); a developer's run with 48.
WAITERS = int(os.environ.get("PGLOCK_E2E_WAITERS", "200" if os.environ.get("CI") else "48"))


@pytest.fixture(scope="module")
def clusters() -> Iterator[tuple[Cluster, Cluster]]:
    with Cluster() as metadata, Cluster() as locks:
        yield metadata, locks


@pytest.fixture(scope="module")
def deployment(clusters: tuple[Cluster, Cluster]) -> Iterator[Deployment]:
    metadata, locks = clusters
    with psycopg.connect(metadata.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier("meta_defer")))
    with psycopg.connect(locks.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE e2e_defer_runs (task_id text, at timestamptz DEFAULT clock_timestamp())")
    home = AIRFLOW_HOME / "e2e-defer"
    env = {
        "AIRFLOW_CONN_POSTGRES_DEFAULT": locks.dsn,
        "PGLOCK_E2E_DSN": locks.dsn,
        "PGLOCK_E2E_WAITERS": str(WAITERS),
        # The trigger runner's event loop under devtools/loopprobe: what ran when it stalled.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(loop_check.PROBE), os.environ.get("PYTHONPATH")])),
        "PGLOCK_LOOP_PROBE": str(home / "loopprobe.jsonl"),
    }
    d = Deployment("D", home, metadata.dsn_for("meta_defer"), free_port(), DAGS, env)
    d.home.mkdir(parents=True)
    migrated = d.airflow("db", "migrate")
    assert migrated.returncode == 0, migrated.stdout[-3000:] + migrated.stderr[-3000:]
    try:
        d.start_api_server()
        d.start_scheduling()
        d.start_triggerer()
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def _states(d: Deployment) -> dict[str, str | None]:
    return dict(d.query("SELECT task_id, state FROM task_instance WHERE dag_id = 'e2e_defer'"))  # type: ignore[arg-type]


def _wait_for(d: Deployment, done: object, what: str) -> dict[str, str | None]:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        states = _states(d)
        if callable(done) and done(states):
            return states
        d.check_alive()
        time.sleep(0.5)
    raise AssertionError(f"{what}: not reached after {DEADLINE_SECONDS} s: {_states(d)}\n{_diagnosis(d)}")


def _diagnosis(d: Deployment) -> str:
    """What a stuck wait needs to be understood: the triggers and who runs them, the triggerers' heartbeats,
    the task states of every DAG, and the triggerer's and the scheduler's logs."""
    triggers = d.query("SELECT triggerer_id, count(*) FROM trigger GROUP BY triggerer_id")
    jobs = d.query(
        "SELECT id, state, latest_heartbeat, now() - latest_heartbeat FROM job WHERE job_type = 'TriggererJob'"
    )
    states = d.query("SELECT dag_id, state, count(*) FROM task_instance GROUP BY dag_id, state ORDER BY dag_id")
    mismatches = d.query("SELECT dttm, map_index, extra FROM log WHERE event = 'state mismatch' ORDER BY dttm")
    return (
        f"triggers by triggerer_id: {triggers}\ntriggerer jobs: {jobs}\ntask states: {states}\n"
        f"the scheduler's 'state mismatch' failures: {mismatches}\n"
        f"{_failed_task_logs(d)}\n{d.logs('triggerer')}\n{d.logs('scheduler')}"
    )


def _reports_taken(d: Deployment, dag_id: str) -> set[int]:
    """The map indexes of ``dag_id``'s task instances whose executor report the scheduler has taken.

    Its "Received executor event" line (state success or failed: how a deferring process ends) says
    the report left the executor's buffer; a "TaskInstance Finished" line follows only if the task
    instance's row was not locked at that moment (the scheduler reads the rows with SKIP LOCKED and
    drops the events of the rows it skipped). A dropped report never fails a resumed attempt either."""
    log = (d.home / "scheduler.log").read_text(errors="replace")
    name = re.escape(dag_id)
    key = rf"TaskInstanceKey\(dag_id='{name}'.*?map_index=(-?\d+)\)"
    received = re.findall(rf"Received executor event with state (?:success|failed) for task instance {key}", log)
    finished = re.findall(rf"TaskInstance Finished: dag_id={name}, .*?map_index=(-?\d+)", log)
    return {int(index) for index in received + finished}


def _scheduler_lines_about(d: Deployment, dag_id: str, missing: set[int], most: int = 5) -> str:
    """The scheduler's log lines that name ``dag_id`` and one of (at most ``most`` of) the ``missing`` map indexes."""
    wanted = sorted(missing)[:most]
    lines = (d.home / "scheduler.log").read_text(errors="replace").splitlines()
    pattern = re.compile(rf"{re.escape(dag_id)}.*map_index[=:]\s*({'|'.join(str(index) for index in wanted)})\b")
    return "\n".join(line[:400] for line in lines if pattern.search(line))


def _failed_task_logs(d: Deployment, most: int = 3) -> str:
    """The end of the task log of (at most ``most``) failed task instances: why they failed."""
    failed = d.query("SELECT dag_id, task_id, map_index FROM task_instance WHERE state = 'failed' ORDER BY map_index")
    parts = []
    for dag_id, task_id, map_index in failed[:most]:
        marks = [f"dag_id={dag_id}", f"task_id={task_id}"] + ([f"map_index={map_index}"] if map_index >= 0 else [])
        for path in sorted((d.home / "logs").rglob("attempt=*.log")):
            if all(f"/{mark}/" in f"/{path.relative_to(d.home)}" for mark in marks):
                parts.append(f"--- {path.relative_to(d.home)} ---\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def _hold(hook: AdvisoryLockHook, key: str) -> HeldLock:
    held = hook.acquire(key, application_name="other deployment")
    assert held is not None, key
    return held


def _hold_again(hook: AdvisoryLockHook, key: str) -> HeldLock:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            return _hold(hook, key)
        except Exception:  # the server is still starting
            time.sleep(0.02)
    raise AssertionError(f"could not take {key} back after the restart")


def test_deferred_tasks_wait_in_the_triggerer_and_resume_after_the_release(
    deployment: Deployment, clusters: tuple[Cluster, Cluster]
) -> None:
    _, locks = clusters
    hook = AdvisoryLockHook(dsn=locks.dsn, liveness=Liveness(lease=600))
    waiting, held = _hold(hook, "e2e/defer"), _hold(hook, "e2e/held")
    try:
        states = _wait_for(
            deployment,
            lambda s: (
                s.get("after_holder") == "deferred"
                and s.get("sensor") == "deferred"
                and s.get("deadline") in ("skipped", "failed")
            ),
            "both waiting in the triggerer, the deadline passed",
        )
        assert states["deadline"] == "skipped"
        with psycopg.connect(locks.dsn, autocommit=True) as conn:
            watchers = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'airflow-pglock wakeups'"
                " AND datname = current_database()"
            ).fetchone()
        assert watchers == (1,), watchers  # every waiting trigger of the process shares one connection

        deployment.kill("triggerer")  # a crash mid-wait: the tasks stay deferred
        deployment.start_triggerer()
        time.sleep(5)
        locks.restart()  # the lock database restarts mid-wait; the other deployment takes its keys back
        waiting, held = _hold_again(hook, "e2e/defer"), _hold_again(hook, "e2e/held")

        time.sleep(3)
        states = _states(deployment)
        assert states["after_holder"] == "deferred" and states["sensor"] == "deferred", states
        released_at, released_wall = time.monotonic(), time.time()
        waiting.release()  # announced in the unlock statement: the triggerer wakes the waiters
        states = _wait_for(
            deployment,
            lambda s: s.get("after_holder") == "success" and s.get("sensor") == "success",
            "resumed after the release",
        )
        print(f"e2e defer: both resumed and finished {time.monotonic() - released_at:.1f} s after the release")
    finally:
        waiting.release()
        held.release()
    with psycopg.connect(locks.dsn, autocommit=True) as conn:
        runs = conn.execute("SELECT task_id FROM e2e_defer_runs").fetchall()
    assert runs == [("after_holder",)]  # exactly once, triggerer crash and database restart included
    log = deployment.logs("triggerer", tail=10**7)
    assert "Starting the triggerer" in log or "triggerer" in log.lower()
    _check_the_loop(deployment, warnings_allowed=False)  # a few waiting tasks: no warning at all
    # The triggers' own lines go to the tasks' logs (the trigger part of each attempt's log).
    task_logs = "".join(path.read_text(errors="replace") for path in (deployment.home / "logs").rglob("*.log*"))
    assert "pglock waiting: key 'e2e/defer'" in task_logs
    # Not a resume latency (benchmarks/triggerer.py measures that): the triggers of the killed
    # triggerer start again only once Airflow finds it dead; when they did, from the tasks' logs:
    starts = sorted(
        round(
            dt.datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp() - released_wall,
            1,
        )
        for line in task_logs.splitlines()
        if "pglock waiting: key 'e2e/defer'" in line and line.startswith("{")
    )
    print(f"e2e defer: triggers of 'e2e/defer' started at {starts} s from the release")
    assert "pglock deferred: " in task_logs and "other deployment" in task_logs


def _blocked_lines(d: Deployment) -> list[str]:
    """Each "async thread was blocked" warning of the triggerer, with the 12 log lines before it."""
    lines = d.logs("triggerer", tail=10**7).splitlines()
    return ["\n".join(lines[max(0, i - 12) : i + 1]) for i, line in enumerate(lines) if BLOCKED_WARNING in line]


def _check_the_loop(d: Deployment, *, warnings_allowed: bool) -> None:
    """airflow-pglock's code never blocks the triggerer's loop; each warning the triggerer logs has a named cause.

    With ``warnings_allowed`` a warning may remain when the probe shows that the loop was
    stalled by something else (the garbage collector, Airflow's own coroutines, a busy machine):
    it is printed with the probe's records, never ignored silently.
    """
    records = loop_check.read(d.home / "loopprobe.jsonl")
    ours = loop_check.our_slow_steps(records, ["e2e_defer", "e2e_defer_many"])
    assert ours == [], "airflow-pglock blocked the triggerer's loop:\n" + "\n".join(json.dumps(r) for r in ours)
    blocked = _blocked_lines(d)
    stalls = [r for r in records if r["kind"] == "stall"]
    if blocked:
        print(f"triggerer warnings ({len(blocked)}), none from airflow-pglock's code:", *blocked, sep="\n")
        print("what the loop probe saw:\n" + loop_check.report(records))
    if not warnings_allowed:
        assert blocked == [], "\n\n".join(blocked) + "\n" + loop_check.report(records)
    unseen = "a warning the probe did not see: its cause is unknown\n"
    assert len(stalls) >= len(blocked), unseen + loop_check.report(records)


@pytest.mark.timeout(240 + 3 * WAITERS)  # each mapped task starts twice (defers, resumes): ~1 s each on 2 cores
def test_many_deferred_tasks_share_one_connection_and_never_block_the_triggerer(
    deployment: Deployment, clusters: tuple[Cluster, Cluster]
) -> None:
    _, locks = clusters
    keys = [f"e2e/many/{index}" for index in range(WAITERS)]
    started = time.monotonic()
    with psycopg.connect(locks.dsn, autocommit=True, application_name="other deployment") as holder:
        for key in keys:  # held by a plain session, not airflow-pglock: its release is seen at the poll
            holder.execute("SELECT pg_advisory_lock(%s)", [LockKey.from_name(key).numbers[0]])
        _wait_for(
            deployment,
            lambda _: deployment.query("SELECT 1 FROM dag WHERE dag_id = 'e2e_defer_many'") != [],
            "e2e_defer_many parsed by the dag-processor",
        )
        triggered = deployment.airflow("dags", "trigger", "e2e_defer_many", timeout=120)
        assert triggered.returncode == 0, triggered.stdout[-2000:] + triggered.stderr[-2000:]

        def many_states() -> list[str | None]:
            rows = deployment.query("SELECT state FROM task_instance WHERE dag_id = 'e2e_defer_many'")
            return [row[0] for row in rows]

        _wait_for(
            deployment,
            lambda _: len(many_states()) == WAITERS and all(state == "deferred" for state in many_states()),
            f"{WAITERS} mapped tasks deferred",
        )
        with psycopg.connect(locks.dsn, autocommit=True) as conn:
            watchers = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'airflow-pglock wakeups'"
                " AND datname = current_database()"
            ).fetchone()
        assert watchers is not None and 1 <= watchers[0] <= 2, watchers
        # Airflow 3's scheduler fails a resumed task if the executor's report of the process
        # that deferred it arrives after the resumed attempt started (apache/airflow#72716, open).
        # Under load the last tasks' reports lag the release, so the keys stay held until the
        # scheduler has taken every report: the test is about the triggers, not that race.
        try:
            _wait_for(
                deployment,
                lambda _: len(_reports_taken(deployment, "e2e_defer_many")) == WAITERS,
                f"the executor's {WAITERS} reports of the deferring processes taken by the scheduler",
            )
        except AssertionError as waited:
            missing = set(range(WAITERS)) - _reports_taken(deployment, "e2e_defer_many")
            about = _scheduler_lines_about(deployment, "e2e_defer_many", missing)
            raise AssertionError(f"no report taken for map indexes {sorted(missing)}:\n{about}\n{waited}") from None
        holder.execute("SELECT pg_advisory_unlock_all()")
    _wait_for(deployment, lambda _: set(many_states()) == {"success"}, f"{WAITERS} mapped tasks resumed and succeeded")
    print(
        f"e2e defer many: {WAITERS} mapped tasks deferred, released and finished in {time.monotonic() - started:.0f} s"
    )
    with psycopg.connect(locks.dsn, autocommit=True) as conn:
        runs = conn.execute("SELECT task_id FROM e2e_defer_runs WHERE task_id LIKE 'many/%'").fetchall()
    assert sorted(row[0] for row in runs) == sorted(f"many/{index}" for index in range(WAITERS))  # each once
    _check_the_loop(deployment, warnings_allowed=True)
