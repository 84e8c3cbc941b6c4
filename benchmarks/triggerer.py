"""Deferred tasks in a real Airflow 3 deployment: resume latency, and many waiting tasks in one triggerer.

    .venv/bin/python -m benchmarks.triggerer --out /tmp/t.md [--write docs/benchmarks.md] [--tuned]
        [--resumes 20 [--airflow-baseline]] [--prompts 10] [--executor local|celery]
        [--herd 200 [--herd-airflow] [--probe]]

One deployment (api-server, scheduler with LocalExecutor, dag-processor, ``airflow
triggerer``; Airflow 3) on a throwaway PostgreSQL cluster: its metadata database and the
lock database. ``--executor celery``: the deployment of tests/celery instead (CeleryExecutor,
a Redis broker, one Celery worker in a network namespace of its own; needs root and
redis-server). The DAGs are in ``benchmarks/triggerer_dags``.

* **Resume latency** (``bench_resume``): ``--resumes`` mapped tasks defer on keys the
  benchmark holds with ``AdvisoryLockHook`` (a provider release, announced). The keys are
  released one at a time, each after the previous task finished, so every sample is a
  task resuming alone. Each sample is split at: the release (``time.time()`` just before
  the unlock), the trigger's event (the triggerer's "Trigger fired event" line in the
  task's log), the task instance's ``scheduled_dttm`` (the triggerer wrote the event),
  ``queued_dttm`` (the scheduler queued it) and the moment the resumed function started
  (a row it inserts, ``clock_timestamp()``). All on one machine's clock. Between two
  samples the benchmark sleeps 1-2 s at random, so the releases fall at any phase of the
  triggerer's and the scheduler's once-a-second loops.
* **Prompt wake-ups** (``--prompts``): keys freed the moment their tasks deferred, next to
  Airflow's own sensor woken as early as it can be (``benchmarks/prompt_resumes.py``): how
  long after the deferral each woke, and how many resumed attempts failed
  (apache/airflow#72716).
* **Many waiting tasks** (``--herd``): the same number of mapped tasks wait in the
  triggerer twice: on airflow-pglock keys that one plain session holds and then releases
  at once (``bench_herd_pglock``), and on Airflow's own ``DateTimeSensorAsync`` all
  waiting for the same moment (``bench_herd_airflow``, the baseline). For each, the
  triggerer's "async thread was blocked" warnings and, with ``--probe``, what the event
  loop ran when it stalled (``devtools/loopprobe``).

``--tuned`` sets what a user can set to shorten the scheduler's part:
``[scheduler] scheduler_idle_sleep_time = 0.1`` (default 1 s). The triggerer's own
loops (the runner's 1 s sync, the supervisor's 1 s service) are not configurable.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from airflow_pglock.triggers.advisory_lock import RESUME_HOLD_SECONDS  # noqa: E402
from benchmarks import prompt_resumes  # noqa: E402
from benchmarks.deployment_steps import fired_at, fired_in, start_herd, task_states, wait_for  # noqa: E402
from benchmarks.stats import percentile  # noqa: E402
from devtools.pgcluster import Cluster, free_port  # noqa: E402
from tests.e2e.deployment import Deployment  # noqa: E402

DAGS = Path(__file__).parent / "triggerer_dags"
PROBE_DIR = ROOT / "devtools" / "loopprobe"
BLOCKED = "async thread was blocked"
TUNED = {"AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.1"}
#: --executor: the executor's name as the report says it.
EXECUTORS = {"local": "LocalExecutor", "celery": "CeleryExecutor"}


def _gap(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


@dataclass
class Sample:
    release: float
    event: float | None
    scheduled: float | None
    queued: float | None
    started: float | None
    state: str | None = None

    def parts(self) -> dict[str, float | None]:
        return {
            "release -> trigger event": _gap(self.release, self.event),
            "event -> scheduled": _gap(self.event, self.scheduled),
            "scheduled -> queued": _gap(self.scheduled, self.queued),
            "queued -> function starts": _gap(self.queued, self.started),
            "release -> function starts": _gap(self.release, self.started),
        }


@dataclass
class Herd:
    trigger: str
    waiters: int
    seconds_to_defer_all: float
    seconds_release_to_all_done: float
    blocked: list[str] = field(default_factory=list)
    probe: list[dict[str, Any]] = field(default_factory=list)


def _log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _read_from(path: Path, offset: int) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


def measure_resumes(
    d: Deployment, locks_dsn: str, count: int, between: Callable[[int], None] | None = None
) -> list[Sample]:
    """``count`` provider releases, one at a time; ``between(i)`` runs after the i-th resumed (the
    Airflow baseline's sample, so that both are measured in the same run, alternating)."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.liveness import Liveness

    hook = AdvisoryLockHook(dsn=locks_dsn, liveness=Liveness(lease=600))
    held = []
    for index in range(count):
        lock = hook.acquire(f"bench/resume/{index}", application_name="bench holder")
        assert lock is not None
        held.append(lock)
    triggered = d.airflow("dags", "trigger", "bench_resume", timeout=120)
    assert triggered.returncode == 0, triggered.stderr[-2000:]
    wait_for(
        f"{count} deferred",
        lambda: list(task_states(d, "bench_resume", "resume").values()).count("deferred") == count,
        60 + 10 * count,
        d,
    )
    # Past the trigger's hold (RESUME_HOLD_SECONDS after it started): the samples time the hand-over itself.
    time.sleep(RESUME_HOLD_SECONDS + 1)
    released: list[float] = []
    for index, lock in enumerate(held):
        released.append(time.time())
        lock.release()
        done = functools.partial(
            lambda i: task_states(d, "bench_resume", "resume").get(i) in ("success", "failed"), index
        )
        wait_for(f"task {index} resumed", done, 120, d)
        print(f"resume {index}: done {time.time() - released[-1]:.1f} s after the release", flush=True)
        time.sleep(1 + random.random())  # a random phase against the triggerer's and the scheduler's loops
        if between is not None:
            between(index)
            time.sleep(1 + random.random())
    rows = d.query(
        "SELECT map_index, extract(epoch from scheduled_dttm), extract(epoch from queued_dttm)"
        " FROM task_instance WHERE dag_id = 'bench_resume'"
    )
    times = {int(r[0]): (float(r[1]) if r[1] else None, float(r[2]) if r[2] else None) for r in rows}
    with psycopg.connect(locks_dsn, autocommit=True) as conn:
        started = dict(
            conn.execute(
                "SELECT map_index, extract(epoch from at)::float8 FROM bench_started WHERE dag_id = 'bench_resume'"
            ).fetchall()
        )
    states = task_states(d, "bench_resume", "resume")
    return [
        Sample(released[i], fired_at(d, "bench_resume", i), times[i][0], times[i][1], started.get(i), states.get(i))
        for i in range(count)
    ]


@dataclass
class AirflowSample:
    """One resume of Airflow's own deferrable sensor: its moment, the trigger's event, the
    sensor's resumed method and the downstream function, each when it started."""

    target: float
    event: float | None
    resumed: float | None
    downstream: float | None
    state: str | None
    scheduled: float | None = None
    queued: float | None = None

    def parts(self) -> dict[str, float | None]:
        return {
            "moment -> trigger event": _gap(self.target, self.event),
            "trigger event -> scheduled": _gap(self.event, self.scheduled),
            "scheduled -> queued": _gap(self.scheduled, self.queued),
            "queued -> the sensor's resumed method starts": _gap(self.queued, self.resumed),
            "trigger event -> the sensor's resumed method starts": _gap(self.event, self.resumed),
            "trigger event -> its downstream function starts": _gap(self.event, self.downstream),
        }


#: Seconds between triggering a bench_resume_airflow run and its moment: long enough for the
#: sensor to be scheduled, started and deferred first (a sample whose sensor did not defer is left out).
AIRFLOW_LEAD = 10.0


def measure_airflow_resume(d: Deployment, locks_dsn: str, index: int) -> AirflowSample:
    """One run of bench_resume_airflow: its sensor defers until a moment AIRFLOW_LEAD s ahead."""
    target = time.time() + AIRFLOW_LEAD
    run_id = f"bench_airflow_{index}_{int(target)}"
    moment = dt.datetime.fromtimestamp(target, dt.timezone.utc).isoformat()
    conf = json.dumps({"target": moment, "index": index})
    triggered = d.airflow("dags", "trigger", "bench_resume_airflow", "--run-id", run_id, "--conf", conf, timeout=120)
    assert triggered.returncode == 0, triggered.stderr[-2000:]

    def run_state() -> str | None:
        rows = d.query("SELECT state FROM dag_run WHERE dag_id = 'bench_resume_airflow' AND run_id = %s", [run_id])
        return rows[0][0] if rows else None

    wait_for(f"airflow sample {index}", lambda: run_state() in ("success", "failed"), 120 + AIRFLOW_LEAD, d)
    with psycopg.connect(locks_dsn, autocommit=True) as conn:
        started = dict(
            conn.execute(
                "SELECT dag_id, extract(epoch from at)::float8 FROM bench_started"
                " WHERE dag_id IN ('bench_resume_airflow', 'bench_resume_airflow_downstream') AND map_index = %s",
                [index],
            ).fetchall()
        )
    [(scheduled, queued)] = d.query(
        "SELECT extract(epoch from scheduled_dttm), extract(epoch from queued_dttm) FROM task_instance"
        " WHERE dag_id = 'bench_resume_airflow' AND run_id = %s AND task_id = 'wait'",
        [run_id],
    )
    return AirflowSample(
        target,
        fired_in(d, "bench_resume_airflow", run_id, "wait"),
        started.get("bench_resume_airflow"),
        started.get("bench_resume_airflow_downstream"),
        run_state(),
        float(scheduled) if scheduled else None,
        float(queued) if queued else None,
    )


def _probe_records(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def measure_herd(d: Deployment, locks_dsn: str, count: int, trigger: str, probe: Path, defer_estimate: float) -> Herd:
    d.restart("triggerer")  # each herd in a triggerer process of its own, started afresh
    time.sleep(5)
    log, log_at, probe_at = d.home / "triggerer.log", _log_size(d.home / "triggerer.log"), _log_size(probe)
    dag_id = f"bench_herd_{trigger}"
    started = time.monotonic()
    holder = psycopg.connect(locks_dsn, autocommit=True, application_name="bench foreign holder")
    release_at = time.time() + defer_estimate  # Airflow's sensors: a moment past the deferral of all
    try:
        start_herd(d, holder, trigger, count, release_at)

        def deferred() -> int:
            return list(task_states(d, dag_id, "wait").values()).count("deferred")

        wait_for(f"{count} {trigger} tasks deferred", lambda: deferred() == count, 60 + 5 * count, d)
        defer_all = time.monotonic() - started
        print(f"herd {trigger}: {count} deferred after {defer_all:.0f} s", flush=True)
        if trigger == "pglock":
            time.sleep(10)  # all waiting: the steady state
            released = time.monotonic()
            holder.execute("SELECT pg_advisory_unlock_all()")
        else:
            assert time.time() < release_at, f"the moment passed before all {count} deferred: raise the estimate"
            released = time.monotonic() + (release_at - time.time())
        wait_for(
            f"{count} {trigger} tasks done",
            lambda: set(task_states(d, dag_id, "wait").values()) == {"success"},
            120 + 5 * count,
            d,
        )
        done = time.monotonic() - released
        print(f"herd {trigger}: all done {done:.0f} s after the release", flush=True)
    finally:
        holder.close()
    time.sleep(3)
    blocked = [line for line in _read_from(log, log_at).splitlines() if BLOCKED in line]
    return Herd(trigger, count, defer_all, done, blocked, _probe_records(_read_from(probe, probe_at)))


#: The Celery worker's network namespace (devtools/netns.py leaves 231..250 to explicit users).
CELERY_NAMESPACE = 238


def _create_databases(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in ("bench_meta", "bench_locks"):
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def _create_started_table(locks_dsn: str) -> None:
    with psycopg.connect(locks_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE bench_started (dag_id text, map_index int, at timestamptz DEFAULT clock_timestamp())"
        )


def celery_unavailable() -> str | None:
    """Why a Celery deployment cannot run here (network namespaces, ``unshare``, redis-server), or None."""
    from tests.celery.deployment import unavailable_reason

    return unavailable_reason()


@contextlib.contextmanager
def _celery(env: dict[str, str], home: Path) -> Iterator[tuple[Deployment, str]]:
    """The deployment of tests/celery (CeleryExecutor, Redis) with one worker in a network namespace."""
    from devtools import redisserver
    from devtools.netns import NetNamespace
    from tests.celery.deployment import CeleryDeployment, Worker

    reason = celery_unavailable()
    if reason:
        raise RuntimeError(f"a Celery deployment needs network namespaces and redis-server: {reason}")
    namespace = NetNamespace(CELERY_NAMESPACE)
    namespace.signal_all(signal.SIGKILL)  # a worker of an earlier run that was killed
    namespace.create()
    try:
        with Cluster(
            {"listen_addresses": f"'127.0.0.1,{namespace.host_addr}'"}, trusted_subnets=[namespace.subnet]
        ) as cluster:
            _create_databases(cluster.dsn)
            locks_dsn = cluster.dsn_for("bench_locks")
            _create_started_table(locks_dsn)
            redis = redisserver.RedisServer.start(("127.0.0.1", namespace.host_addr))
            worker = Worker("bench", namespace)
            d = CeleryDeployment(
                "bench",
                home,
                cluster.dsn_for("bench_meta"),
                free_port(),
                DAGS,
                {**env, "AIRFLOW__OPERATORS__DEFAULT_QUEUE": worker.name},
                broker_port=redis.port,
                pg_port=cluster.port,
                metadata_db="bench_meta",
                lock_db="bench_locks",
            )
            try:  # Airflow's processes and the worker stop before the broker and the cluster
                migrated = d.airflow("db", "migrate")
                assert migrated.returncode == 0, migrated.stderr[-3000:]
                d.start([worker])
                d.wait_for_workers()
                yield d, locks_dsn
            finally:
                d.stop()
                redis.stop()
    finally:
        namespace.destroy()


@contextlib.contextmanager
def _local(env: dict[str, str], home: Path) -> Iterator[tuple[Deployment, str]]:
    """api-server, scheduler with LocalExecutor, dag-processor and triggerer on one throwaway cluster."""
    with Cluster() as cluster:
        _create_databases(cluster.dsn)
        locks_dsn = cluster.dsn_for("bench_locks")
        _create_started_table(locks_dsn)
        local_env = {**env, "AIRFLOW_CONN_POSTGRES_DEFAULT": locks_dsn, "PGLOCK_BENCH_DSN": locks_dsn}
        d = Deployment("bench", home, cluster.dsn_for("bench_meta"), free_port(), DAGS, local_env)
        migrated = d.airflow("db", "migrate")
        assert migrated.returncode == 0, migrated.stderr[-3000:]
        try:
            d.start_api_server()
            d.start_scheduling()
            d.start_triggerer()
            yield d, locks_dsn
        finally:
            d.stop()


@contextlib.contextmanager
def deployment(
    tuned: bool,
    resumes: int,
    herd: int,
    probe: Path | None,
    executor: str = "local",
    prompts: int = 0,
    heartbeat_interval: float | None = None,
) -> Iterator[tuple[Deployment, str]]:
    env = {
        "PGLOCK_BENCH_RESUMES": str(resumes),
        "PGLOCK_BENCH_HERD": str(herd),
        "PGLOCK_BENCH_PROMPTS": str(prompts),
        **(TUNED if tuned else {}),
    }
    if heartbeat_interval is not None:  # the task supervisors' longest wait: the provider's hold follows it
        env["AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL"] = f"{heartbeat_interval:g}"
    if probe is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(PROBE_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["PGLOCK_LOOP_PROBE"] = str(probe)
        if os.environ.get("PGLOCK_LOOP_PROBE_FREEZE"):
            env["PGLOCK_LOOP_PROBE_FREEZE"] = "1"
    home = Path(tempfile.mkdtemp(prefix="pglock-bench-triggerer-"))
    start = _celery if executor == "celery" else _local
    try:
        with start(env, home) as (d, locks_dsn):
            dag_files = len(list(DAGS.glob("bench_*.py")))
            wait_for("DAGs parsed", lambda: len(d.query("SELECT dag_id FROM dag")) >= dag_files, 180, d)
            yield d, locks_dsn
    finally:
        if os.environ.get("PGLOCK_BENCH_KEEP"):
            print(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


def _p95(values: list[float]) -> float:
    return percentile(values, 95) if values else float("nan")


def comparison(ours: list[Sample], theirs: list[AirflowSample], executor: str = "LocalExecutor") -> str:
    """Ours next to Airflow's own deferrable sensor, measured alternately in the same deployment and run."""
    valid = [t for t in theirs if t.event is not None]  # the sensor deferred before its moment
    our_start = [v for s in ours if (v := s.parts()["release -> function starts"]) is not None]
    their_resumed = _their_resumed(theirs)
    rows = ["| part | p50 | p95 | max | n |", "|---|---|---|---|---|"]
    for name in AirflowSample(0.0, None, None, None, None).parts():
        values = [v for t in valid if (v := t.parts()[name]) is not None]
        rows.append(
            f"| Airflow's `DateTimeSensorAsync`: {name} | {percentile(values, 50):.2f} s | {_p95(values):.2f} s"
            f" | {max(values, default=float('nan')):.2f} s | {len(values)} |"
        )
    their_downstream = _their_downstream(theirs)
    failed_ours = sum(1 for s in ours if s.state == "failed")
    failed_theirs = sum(1 for t in theirs if t.state == "failed")
    gap = _p95(our_start) - _p95(their_resumed)
    verdict = "met" if gap <= 0.1 else "missed"
    downstream_gap = _p95(our_start) - _p95(their_downstream)
    downstream_verdict = "met" if downstream_gap <= 0.1 else "missed"
    return "\n".join(
        [
            *rows,
            "",
            f"p95 from the release (ours: the trigger's own event is in it) or the trigger's event (Airflow's) to "
            f"the resumed task's own code: airflow-pglock "
            f"{_p95(our_start):.2f} s, Airflow's own deferrable sensor {_p95(their_resumed):.2f} s "
            f"({gap:+.2f} s). Target: ours at most Airflow's + 0.1 s: **{verdict}**. "
            f"{len(theirs) - len(valid)} Airflow sample(s) left out (the sensor did not defer before its moment).",
            "",
            f"The issue's own measure counts Airflow's to its downstream task's function, the work a sensor "
            f"guards: {_p95(their_downstream):.2f} s, n {len(their_downstream)} ({downstream_gap:+.2f} s for ours): "
            f"**{downstream_verdict}**. That downstream task is a task instance of its own, scheduled once the "
            "sensor succeeded: a second scheduling that only Airflow's side pays, so this measure is the easier "
            "one for the provider. The figure above compares like with like (a deferred task's resumed attempt "
            "starting its code on both sides). A sensor attempt that failed starts no downstream task and is "
            "not in this n.",
            "",
            f"Resumed attempts failed (the executor's stale report of the deferring process, apache/airflow#72716, "
            f"or anything else): airflow-pglock {failed_ours} of {len(ours)}, Airflow's sensor {failed_theirs} of "
            f"{len(theirs)} ({executor}).",
        ]
    )


@dataclass
class SideBySide:
    """The provider's resumes and Airflow's own, alternating in one deployment, and (``prompts``) the
    wake-ups at once after a deferral of both (``dev.py bench``)."""

    ours: list[Sample]
    theirs: list[AirflowSample]
    airflow: str
    seconds: float
    executor: str = "local"
    prompts: prompt_resumes.PromptResult | None = None

    @property
    def executor_name(self) -> str:
        return EXECUTORS[self.executor]


def run_side_by_side(resumes: int, executor: str = "local", prompts: int = 0) -> SideBySide:
    """``resumes`` provider releases, each followed by one of Airflow's own sensor resumes; then
    ``prompts`` wake-ups at once of each (benchmarks/prompt_resumes.py)."""
    import airflow

    started = time.monotonic()
    theirs: list[AirflowSample] = []
    prompted = None
    with deployment(False, resumes, 0, None, executor, prompts) as (d, locks_dsn):
        ours = measure_resumes(d, locks_dsn, resumes, lambda i: theirs.append(measure_airflow_resume(d, locks_dsn, i)))
        if prompts:
            prompted = prompt_resumes.PromptResult(
                EXECUTORS[executor],
                prompt_resumes.measure_ours(d, locks_dsn, prompts),
                prompt_resumes.measure_theirs(d, locks_dsn, prompts),
            )
    return SideBySide(ours, theirs, airflow.__version__, time.monotonic() - started, executor, prompted)


def _their_part(theirs: list[AirflowSample], part: str) -> list[float]:
    """One part of Airflow's samples whose sensor deferred before its moment (its event is known)."""
    return [v for t in theirs if t.event is not None and (v := t.parts()[part]) is not None]


def _their_resumed(theirs: list[AirflowSample]) -> list[float]:
    return _their_part(theirs, "trigger event -> the sensor's resumed method starts")


def _their_downstream(theirs: list[AirflowSample]) -> list[float]:
    return _their_part(theirs, "trigger event -> its downstream function starts")


def headline_rows(result: SideBySide) -> list[list[str]]:
    ours = [v for s in result.ours if (v := s.parts()["release -> function starts"]) is not None]
    theirs = _their_resumed(result.theirs)
    gap = _p95(ours) - _p95(theirs)
    downstream = _their_downstream(result.theirs)
    downstream_gap = _p95(ours) - _p95(downstream)
    rows = [
        [
            f"Deferred task resumed, real deployment, {result.executor_name} (p95: a provider release -> the "
            "function starts; Airflow's own `DateTimeSensorAsync`: its trigger's event -> its resumed method "
            "starts; alternating in one run, section 10)",
            "<= Airflow's + 0.1 s",
            f"{_p95(ours):.2f} s vs Airflow's {_p95(theirs):.2f} s ({gap:+.2f} s)",
            "met" if gap <= 0.1 else "**missed**",
        ],
        [
            f"The same, {result.executor_name}, by the issue's measure (Airflow's `DateTimeSensorAsync`: its "
            "trigger's event -> its downstream task's function starts; section 10)",
            "<= Airflow's + 0.1 s",
            f"{_p95(ours):.2f} s vs Airflow's {_p95(downstream):.2f} s ({downstream_gap:+.2f} s; n {len(ours)} "
            f"and {len(downstream)}; the easier measure for the provider: a second scheduling on Airflow's side)",
            "met" if downstream_gap <= 0.1 else "**missed**",
        ],
    ]
    if result.prompts is not None:
        rows.append(prompt_resumes.headline_row(result.prompts))
    return rows


def render_side_by_side(results: list[SideBySide] | SideBySide) -> str:
    runs = results if isinstance(results, list) else [results]
    parts = [
        "## 10. A deferred task resumed, next to Airflow's own deferrable sensor (real deployment)",
        "",
        "Both wait for the same loops: the triggerer hands a fired event on once per pass of its runner and "
        "of its supervisor (about 1 s each), then the scheduler queues the task and a worker starts it. The "
        "provider's trigger sees a release in milliseconds (section 9), and its event is inside its figure; "
        "Airflow's is counted from its trigger's event (its `DateTimeTrigger` may fire after its moment). "
        "The two differ in `trigger event -> scheduled`: `DateTimeTrigger` checks its moment once a "
        "second, in step with the triggerer's once-a-second pass, so its event lands just before a pass; a "
        "release lands at any moment of the pass, and its event waits for the next (half a pass on average). "
        "Closing that gap takes a triggerer that hands an event on as it fires (Airflow's loop), not a faster "
        "trigger.",
    ]
    for result in runs:
        parts += ["", render_run(result)]
    return "\n".join(parts)


def render_run(result: SideBySide) -> str:
    where = (
        "scheduler with LocalExecutor"
        if result.executor == "local"
        else "scheduler with CeleryExecutor, one Celery worker in a network namespace of its own, Redis as the broker"
    )
    lines = [
        f"### {result.executor_name}",
        "",
        f"One Airflow {result.airflow} deployment on this machine (api-server, {where}, "
        "dag-processor, `airflow triggerer`; its metadata and lock databases on one throwaway PostgreSQL "
        f"cluster), Airflow's defaults; {result.seconds / 60:.1f} min. {len(result.ours)} provider releases "
        '(`bench_resume`: tasks deferred with `on_busy="defer", defer_after=0`, released one at a time, '
        "each past the trigger's hold), each followed by one run of `bench_resume_airflow` (Airflow's "
        f"`DateTimeSensorAsync` deferred until a moment {AIRFLOW_LEAD:g} s ahead, then its downstream task). "
        "`benchmarks/triggerer.py` says what each column is.",
        "",
        "The provider's resumes:",
        "",
        resume_table(result.ours),
        "",
        "Airflow's own, alternating with them:",
        "",
        comparison(result.ours, result.theirs, result.executor_name),
    ]
    if result.prompts is not None:
        lines += ["", prompt_resumes.render(result.prompts), "", prompt_resumes.READING]
    return "\n".join(lines)


def resume_table(samples: list[Sample]) -> str:
    rows = ["| part | p50 | p95 | max | n |", "|---|---|---|---|---|"]
    names = list(samples[0].parts()) if samples else []
    for name in names:
        values = [v for s in samples if (v := s.parts()[name]) is not None]
        rows.append(
            f"| {name} | {percentile(values, 50):.2f} s | {percentile(values, 95):.2f} s"
            f" | {max(values, default=float('nan')):.2f} s | {len(values)} |"
        )
    return "\n".join(rows)


def _ours(group: str) -> bool:
    return group.startswith(("trigger bench_herd_pglock", "WakeupHub."))


def herd_row(h: Herd) -> list[str]:
    """One row: what the triggerer warned, and what the loop probe says ran meanwhile."""
    stalls = [r for r in h.probe if r["kind"] == "stall"]
    gcs = [r["seconds"] for r in h.probe if r["kind"] == "gc" and r["generation"] == 2]
    slow = [r for r in h.probe if r["kind"] == "slow_callback"]
    ours_step = max((r["wall"] - r["gc"] for r in slow if _ours(r["group"])), default=0.0)
    turns = [r for r in h.probe if r["kind"] == "slow_iteration"]
    ours_turn = max((sum(g[2] - g[3] for g in r["by_group"] if _ours(g[0])) for r in turns), default=0.0)
    worst = max(stalls, key=lambda r: r["wall"], default=None)
    culprit = max(slow, key=lambda r: r["wall"], default=None)
    seconds = ", ".join(
        line.split("blocked for ")[1].split(" seconds")[0] for line in h.blocked if "blocked for " in line
    )
    stall = "-" if worst is None else f"{worst['wall']:.2f} s / {worst['main_thread_cpu']:.2f} s"
    return [
        'airflow-pglock (`on_busy="defer"`)' if h.trigger == "pglock" else "Airflow's `DateTimeSensorAsync`",
        f"{h.waiters}",
        f"{len(h.blocked)}" + (f" ({seconds} s)" if seconds else ""),
        stall if worst is None else f"{stall} (load {worst['loadavg'][0]:.1f})",
        "-" if culprit is None else f"{culprit['wall']:.2f} s, GC {culprit['gc']:.2f} s: `{culprit['group']}`",
        f"{len(gcs)}" + (f" (longest {max(gcs):.2f} s)" if gcs else ""),
        f"{ours_step * 1000:.0f} ms / {ours_turn * 1000:.0f} ms" if h.trigger == "pglock" else "-",
    ]


def herd_table(herds: list[Herd]) -> str:
    header = [
        "waiting tasks",
        "n",
        "triggerer warnings 'async thread was blocked'",
        "longest stall: wall / loop thread CPU",
        "slowest callback on the loop",
        "full garbage collections",
        "airflow-pglock's code, GC excluded: slowest step over 50 ms / share of a turn over 150 ms",
    ]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows += ["| " + " | ".join(herd_row(h)) + " |" for h in herds]
    return "\n".join(rows)


def herd_summary(h: Herd) -> str:
    lines = [
        f"{h.trigger}: {h.waiters} tasks deferred in {h.seconds_to_defer_all:.0f} s, all done "
        f"{h.seconds_release_to_all_done:.0f} s after the release; {len(h.blocked)} 'blocked' warnings",
        *[f"  warning: {line.strip()[:200]}" for line in h.blocked],
    ]
    for record in h.probe:
        if record["kind"] != "started":
            lines.append("  " + json.dumps(record)[:3000])
    return "\n".join(lines)


def write_block(path: Path, tag: str, text: str) -> None:
    """Replace the block between this run's markers in section 9 of ``path``, or append it at the end of the file."""
    document = path.read_text()
    begin, end = f"<!-- benchmarks/triggerer.py {tag} -->", f"<!-- /benchmarks/triggerer.py {tag} -->"
    block = f"{begin}\n{text}\n{end}"
    if begin in document:
        head, rest = document.split(begin, 1)
        document = head + block + rest.split(end, 1)[1]
    else:
        document = document.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(document)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="a markdown report, with the raw records")
    parser.add_argument("--write", type=Path, help="also write the tables into this file (docs/benchmarks.md)")
    parser.add_argument("--tuned", action="store_true")
    parser.add_argument("--resumes", type=int, default=10)
    parser.add_argument(
        "--airflow-baseline", action="store_true", help="alternate each resume with one of DateTimeSensorAsync's"
    )
    parser.add_argument("--herd", type=int, default=0)
    parser.add_argument("--herd-airflow", action="store_true", help="also the DateTimeSensorAsync baseline")
    parser.add_argument("--probe", action="store_true", help="run the triggerer under devtools/loopprobe")
    parser.add_argument(
        "--executor", choices=EXECUTORS, default="local", help="celery: tests/celery's deployment, one worker"
    )
    parser.add_argument(
        "--prompts", type=int, default=0, help="this many prompt wake-ups of each kind (benchmarks/prompt_resumes.py)"
    )
    parser.add_argument(
        "--prompt-herd",
        type=int,
        default=0,
        help="this many mapped tasks of each kind woken at once after their deferral (not with --herd)",
    )
    parser.add_argument(
        "--min-heartbeat-interval",
        type=float,
        help="[workers] min_heartbeat_interval of the deployment (Airflow's default: 5 s)",
    )
    args = parser.parse_args()
    if args.executor == "celery" and args.herd:
        parser.error("--herd restarts the triggerer of a LocalExecutor deployment: not with --executor celery")
    if args.herd and args.prompt_herd:
        parser.error("--herd and --prompt-herd use the same DAGs: one at a time")
    probe = Path(tempfile.mkdtemp(prefix="pglock-probe-")) / "probe.jsonl" if args.probe else None
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out: list[str] = [
        f"`.venv/bin/python -m benchmarks.triggerer {' '.join(sys.argv[1:])}`, {started}, "
        f"load average {os.getloadavg()[0]:.2f} at start",
    ]
    raw: list[str] = []
    herd_size = args.herd or args.prompt_herd
    with deployment(
        args.tuned, args.resumes, herd_size, probe, args.executor, args.prompts, args.min_heartbeat_interval
    ) as (d, locks_dsn):
        if args.resumes:
            theirs: list[AirflowSample] = []

            def airflow_sample(index: int) -> None:
                theirs.append(measure_airflow_resume(d, locks_dsn, index))

            between = airflow_sample if args.airflow_baseline else None
            samples = measure_resumes(d, locks_dsn, args.resumes, between)
            settings = ", ".join(f"{k}={v}" for k, v in TUNED.items()) if args.tuned else "Airflow's defaults"
            out += ["", f"Resume after a provider release ({settings}):", "", resume_table(samples)]
            raw.append(json.dumps([s.__dict__ for s in samples]))
            if theirs:
                out += [
                    "",
                    "Airflow's own deferrable sensor, alternating with the samples above:",
                    "",
                    comparison(samples, theirs, EXECUTORS[args.executor]),
                ]
                raw.append(json.dumps([t.__dict__ for t in theirs]))
        if args.prompts:
            prompted = prompt_resumes.PromptResult(
                EXECUTORS[args.executor],
                prompt_resumes.measure_ours(d, locks_dsn, args.prompts),
                prompt_resumes.measure_theirs(d, locks_dsn, args.prompts),
            )
            out += ["", prompt_resumes.render(prompted)]
            raw.append(
                json.dumps(
                    {k: [s.__dict__ for s in v] for k, v in (("ours", prompted.ours), ("theirs", prompted.theirs))}
                )
            )
        if args.prompt_herd:
            prompt_herds = [
                prompt_resumes.measure_herd(d, locks_dsn, args.prompt_herd, trigger, EXECUTORS[args.executor])
                for trigger in ("pglock", "airflow")
            ]
            out += ["", "Many tasks woken at once after their deferral:", "", prompt_resumes.render_herds(prompt_herds)]
            raw.append(json.dumps([h.__dict__ for h in prompt_herds]))
        herds = []
        if args.herd:
            herds.append(measure_herd(d, locks_dsn, args.herd, "pglock", probe or Path("/nonexistent"), 0))
            if args.herd_airflow:
                estimate = herds[0].seconds_to_defer_all * 1.5 + 30
                herds.append(measure_herd(d, locks_dsn, args.herd, "airflow", probe or Path("/nonexistent"), estimate))
            out += ["", "Many waiting tasks, each set in a triggerer started afresh:", "", herd_table(herds)]
            raw += [herd_summary(h) for h in herds]
    out.append(f"\nLoad average at the end: {os.getloadavg()[0]:.2f}.")
    args.out.write_text("\n".join(out) + "\n\n" + "\n".join(raw) + "\n")
    if args.write:
        tag = ("tuned" if args.tuned else "default") + ("" if args.herd else " resume")
        if args.prompt_herd:
            tag = f"prompt herd {args.executor}"
        write_block(args.write, tag, "\n".join(out))
    print("\n".join(out) + "\n\n" + "\n".join(raw))


if __name__ == "__main__":
    main()
