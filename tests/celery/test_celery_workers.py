"""Guarded tasks on a distributed Airflow: CeleryExecutor, two workers on two "hosts".

One deployment for the module (tests/celery/deployment.py): scheduler, dag-processor,
api-server and triggerer on this host; workers ``w1`` and ``w2`` each in a network
namespace with its own address and host name, reaching the broker (Redis), the metadata
database, the execution API and the lock database over their own link. DAG runs are
triggered through the REST API; a task lands on a worker by its queue
(tests/celery/dags/celery_pglock.py). Outcomes are read from Airflow's metadata
(task_instance: state, hostname, try_number), from the side-effect table the guarded work
writes (``start`` / ``end`` rows) and from its journal of 0.2 s steps (a shared file, so a
cut-off worker's steps still show).

Faults are applied to the holding worker's whole "host": its link is cut, or every process
in its namespace is SIGKILLed or SIGSTOPped. Each test prints its measurements (``-s``);
docs/failure-modes.md ("Distributed deployment") quotes them.
"""

from __future__ import annotations

import itertools
import re
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from devtools.netns import NetNamespace, NetNamespaceUnavailableError
from devtools.pgcluster import Cluster, free_port
from tests.conftest import AIRFLOW_HOME

pytestmark = [pytest.mark.slow, pytest.mark.airflow, pytest.mark.faults, pytest.mark.timeout(600)]

airflow_compat = pytest.importorskip("airflow_pglock.compat")
if not airflow_compat.AIRFLOW_V_3_PLUS:
    pytest.skip("the Celery suite drives Airflow 3 processes (api-server, execution API)", allow_module_level=True)
pytest.importorskip("airflow.providers.celery", reason="apache-airflow-providers-celery is not installed")

from airflow_pglock.keys import LockKey  # noqa: E402
from devtools import redisserver  # noqa: E402
from tests.celery.deployment import CeleryDeployment, Worker, unavailable_reason  # noqa: E402

DAGS = Path(__file__).parent / "dags"
LEASE = 6.0  # the DAGs' lease (celery_pglock.LEASE)
# Scheduling noise on a loaded 2-core machine; the bounds themselves come from the lease.
MARGIN = 3.0
NAMESPACE_INDICES = {"w1": 231, "w2": 232}
FINISHED = ("success", "failed", "skipped", "upstream_failed", "removed")
EFFECTS_TABLE = """
CREATE TABLE celery_effects (
    key text, dag_id text, run_id text, try_number int, worker text, event text,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""


def measured(name: str, seconds: float) -> None:
    print(f"\nMEASURED celery {name}: {seconds:.3f} s")


@dataclass
class Celery:
    deployment: CeleryDeployment
    cluster: Cluster
    journal: Path

    @property
    def w1(self) -> Worker:
        return self.deployment.workers["w1"]

    @property
    def w2(self) -> Worker:
        return self.deployment.workers["w2"]

    def locks_db(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.cluster.dsn_for("locks"), autocommit=True, application_name="celery-suite")

    def effects(self, key: str) -> list[tuple[str, int, str, str, float]]:
        """(dag_id, try_number, worker, event, epoch seconds) in order."""
        with self.locks_db() as conn:
            rows = conn.execute(
                "SELECT dag_id, try_number, worker, event, extract(epoch FROM at)::float8 FROM celery_effects"
                " WHERE key = %s ORDER BY at",
                [key],
            ).fetchall()
        return [tuple(row) for row in rows]  # type: ignore[misc]

    def steps(self, key: str) -> dict[tuple[str, int], list[float]]:
        """The journal: (dag_id, try_number) -> times of its work steps."""
        path = self.journal / f"{key.replace('/', '-')}.journal"
        result: dict[tuple[str, int], list[float]] = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            at, dag_id, try_number = line.split()
            result.setdefault((dag_id, int(try_number)), []).append(float(at))
        return result

    def release(self, key: str) -> None:
        (self.journal / f"{key.replace('/', '-')}.release").touch()

    def holders(self, key: str) -> list[tuple[int, bool]]:
        """(pid, granted) of the sessions holding or waiting for ``key``."""
        classid, objid, objsubid = LockKey.from_name(key).pg_locks
        with self.locks_db() as conn:
            rows = conn.execute(
                "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s"
                " AND objsubid = %s",
                [classid, objid, objsubid],
            ).fetchall()
        return [(int(pid), bool(granted)) for pid, granted in rows]

    def ti(self, dag_id: str, run_id: str) -> tuple[str | None, str | None, int]:
        """(state, hostname, try_number) of the run's guarded task."""
        rows = self.deployment.query(
            "SELECT state, hostname, try_number FROM task_instance WHERE dag_id = %s AND run_id = %s"
            " AND task_id = 'guarded'",
            [dag_id, run_id],
        )
        return rows[0] if rows else (None, None, 0)  # type: ignore[return-value]

    def wait(self, what: str, condition: Any, timeout: float = 120, every: float = 0.05) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout} s: {what}\n{self.deployment.logs()}")
            time.sleep(every)

    def wait_finished(self, dag_id: str, run_id: str, timeout: float = 120) -> tuple[str | None, str | None, int]:
        return self.wait(  # type: ignore[no-any-return]
            f"{dag_id} {run_id} finished",
            lambda: (ti := self.ti(dag_id, run_id))[0] in FINISHED and ti,
            timeout,
            every=0.5,
        )

    def wait_for_event(self, key: str, dag_id: str, event: str, timeout: float = 120) -> float:
        """Epoch time of the first ``event`` row of ``dag_id`` for ``key``."""
        return self.wait(  # type: ignore[no-any-return]
            f"{dag_id} writes {event} for {key}",
            lambda: next((at for d, _, _, e, at in self.effects(key) if d == dag_id and e == event), None),
            timeout,
            every=0.1,
        )


@pytest.fixture(scope="module")
def celery() -> Iterator[Celery]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the Celery suite needs network namespaces and redis-server: {reason}")
    namespaces: list[NetNamespace] = []
    cluster: Cluster | None = None
    redis: redisserver.RedisServer | None = None
    deployment: CeleryDeployment | None = None
    home = AIRFLOW_HOME / "celery"
    try:
        try:
            for index in NAMESPACE_INDICES.values():
                leftover = NetNamespace(index)
                leftover.signal_all(signal.SIGKILL)  # workers of an earlier run of this suite that was killed
                namespaces.append(leftover.create())
        except NetNamespaceUnavailableError as error:
            pytest.skip(f"no network namespace on this machine: {error}")
        host_addrs = [ns.host_addr for ns in namespaces]
        cluster = Cluster(
            {"max_connections": "300", "listen_addresses": f"'{','.join(['127.0.0.1', *host_addrs])}'"},
            trusted_subnets=[ns.subnet for ns in namespaces],
        )
        cluster.init().start()
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            for name in ("airflow", "locks"):
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        with psycopg.connect(cluster.dsn_for("locks"), autocommit=True) as conn:
            conn.execute(EFFECTS_TABLE)
        redis = redisserver.RedisServer.start(("127.0.0.1", *host_addrs))
        journal = home / "journal"
        journal.mkdir(parents=True)
        deployment = CeleryDeployment(
            "celery",
            home,
            cluster.dsn_for("airflow"),
            free_port(),
            DAGS,
            {"PGLOCK_CELERY_JOURNAL": str(journal)},
            broker_port=redis.port,
            pg_port=cluster.port,
        )
        migrated = deployment.airflow("db", "migrate")
        assert migrated.returncode == 0, f"db migrate failed:\n{migrated.stdout[-3000:]}\n{migrated.stderr[-3000:]}"
        deployment.start([Worker(name, ns) for name, ns in zip(NAMESPACE_INDICES, namespaces, strict=True)])
        deployment.wait_for_dags([f"celery_{f}_{w}" for f in ("skip", "wait") for w in NAMESPACE_INDICES])
        deployment.wait_for_workers()
        yield Celery(deployment, cluster, journal)
    finally:
        if deployment is not None:
            deployment.stop()
        if redis is not None:
            redis.stop()
        if cluster is not None:
            cluster.destroy()
        for ns in namespaces:
            ns.destroy()
        shutil.rmtree(home, ignore_errors=True)


def bursts(times: list[float], gap: float = 1.0) -> list[tuple[float, float]]:
    """Spans of uninterrupted work: steps come every 0.2 s, so a longer gap means the run was
    frozen or cut off in between (a thawed run may take a step or two before it is stopped)."""
    spans: list[tuple[float, float]] = []
    for at in sorted(times):
        if spans and at - spans[-1][1] <= gap:
            spans[-1] = (spans[-1][0], at)
        else:
            spans.append((at, at))
    return spans


def assert_no_overlap(celery: Celery, key: str) -> None:
    """At no moment did two runs of ``key`` work at the same time (from the journal of work steps)."""
    spans = sorted((start, end, run) for run, times in celery.steps(key).items() for start, end in bursts(times))
    for (_, end, run), (start, _, next_run) in itertools.pairwise(spans):
        assert end < start, f"{key}: {run} worked until {end:.3f}, {next_run} from {start:.3f}: overlap"


def test_same_key_on_two_workers_one_runs_the_other_skips_and_names_the_holders_host(celery: Celery) -> None:
    key = "celery/busy"
    runs = {w: celery.deployment.trigger(f"celery_skip_{w}", {"key": key, "seconds": 90}) for w in ("w1", "w2")}
    started = celery.wait(
        "one run holds the key", lambda: next((r[0] for r in celery.effects(key) if r[3] == "start"), None)
    )
    holder = started.removeprefix("celery_skip_")
    other = "w2" if holder == "w1" else "w1"
    skipped = celery.wait_finished(f"celery_skip_{other}", runs[other])
    celery.release(key)
    held = celery.wait_finished(f"celery_skip_{holder}", runs[holder])

    workers = celery.deployment.workers
    assert held[:2] == ("success", workers[holder].hostname), held
    assert skipped[:2] == ("skipped", workers[other].hostname), skipped
    events = [(dag_id, event) for dag_id, _, _, event, _ in celery.effects(key)]
    assert events == [(f"celery_skip_{holder}", "start"), (f"celery_skip_{holder}", "end")]
    log = celery.deployment.task_log(f"celery_skip_{other}", runs[other], "guarded", 1)
    assert f"client {workers[holder].address}" in log, log[-3000:]  # the holder's host
    # and its DAG and task, in the holder's application_name (pglock:<deployment>@<host> <dag> <task> <run>)
    assert re.search(rf"application_name 'pglock:\S+ celery_skip_{holder} guarded ", log), log[-3000:]
    print("\nthe skipped task's log: " + next(line for line in log.splitlines() if "client " in line)[:400])


def _start_holder_and_waiting_contender(celery: Celery, key: str) -> tuple[str, str, int]:
    """Holder on w1 (fails when it loses the lock: no retry), contender on w2 waiting for the key."""
    holder_run = celery.deployment.trigger("celery_skip_w1", {"key": key, "seconds": 120})
    celery.wait_for_event(key, "celery_skip_w1", "start")
    pid = celery.wait("the holder's lock", lambda: next((p for p, granted in celery.holders(key) if granted), None))
    contender_run = celery.deployment.trigger("celery_wait_w2", {"key": key, "seconds": 3})
    celery.wait("the contender waits for the key", lambda: any(not granted for _, granted in celery.holders(key)))
    time.sleep(LEASE / 3 * 1.5)  # a heartbeat or two pass: the fault lands between two of them
    return holder_run, contender_run, pid


def _released(celery: Celery, key: str, pid: int) -> float:
    celery.wait(
        f"{key}: pid {pid} releases",
        lambda: pid not in [p for p, granted in celery.holders(key) if granted],
        timeout=LEASE + 30,
        every=0.02,
    )
    return time.time()


def _assert_contender_ran_after_the_holder(
    celery: Celery, key: str, holder_run: str, contender_run: str, fault: str, faulted_at: float
) -> None:
    holder = celery.wait_finished("celery_skip_w1", holder_run)
    measured(f"{fault} -> the holder's task instance is failed", time.time() - faulted_at)
    contender = celery.wait_finished("celery_wait_w2", contender_run)
    assert holder[0] == "failed", f"the cut-off / killed / frozen holder must fail, never succeed: {holder}"
    assert holder[1] == celery.w1.hostname
    assert contender[:2] == ("success", celery.w2.hostname), contender
    events = [(dag_id, event) for dag_id, _, _, event, _ in celery.effects(key)]
    assert events == [("celery_skip_w1", "start"), ("celery_wait_w2", "start"), ("celery_wait_w2", "end")], events
    assert_no_overlap(celery, key)
    log = celery.deployment.task_log("celery_skip_w1", holder_run, "guarded", 1)
    how = "the task itself (pglock LOST in its log)" if "pglock LOST" in log else "Airflow (no heartbeat)"
    print(f"\n{fault}: the holder's task was failed by {how}")


def test_holding_worker_cut_off_lock_free_within_the_lease_contender_runs_holder_fails(celery: Celery) -> None:
    key = "celery/cut"
    holder_run, contender_run, pid = _start_holder_and_waiting_contender(celery, key)
    cut = time.time()
    celery.w1.netns.cut()
    try:
        released = _released(celery, key, pid)
        acquired = celery.wait_for_event(key, "celery_wait_w2", "start", timeout=60)
        celery.wait_for_event(key, "celery_wait_w2", "end", timeout=60)
    finally:
        celery.w1.netns.restore()
    measured("network cut -> server releases the holder's lock", released - cut)
    measured("network cut -> contender on the other worker starts its work", acquired - cut)
    assert released - cut <= LEASE + MARGIN
    holder_steps = celery.steps(key)[("celery_skip_w1", 1)]
    measured("network cut -> the cut-off holder's last work step", max(holder_steps) - cut)
    assert max(holder_steps) < released, "the cut-off holder kept working after the server released its lock"
    _assert_contender_ran_after_the_holder(celery, key, holder_run, contender_run, "network cut", cut)


def test_holding_worker_sigkilled_lock_free_contender_runs_holder_fails(celery: Celery) -> None:
    key = "celery/sigkill"
    holder_run, contender_run, pid = _start_holder_and_waiting_contender(celery, key)
    killed = time.time()
    celery.deployment.kill_worker(celery.w1)
    released = _released(celery, key, pid)
    acquired = celery.wait_for_event(key, "celery_wait_w2", "start", timeout=60)
    celery.deployment.start_worker(celery.w1)  # the host comes back (the next tests need it)
    measured("worker SIGKILL -> server releases the holder's lock", released - killed)
    measured("worker SIGKILL -> contender on the other worker starts its work", acquired - killed)
    assert released - killed <= MARGIN
    _assert_contender_ran_after_the_holder(celery, key, holder_run, contender_run, "worker SIGKILL", killed)
    celery.deployment.wait_for_workers()


def test_holding_worker_sigstopped_lock_free_within_the_lease_contender_runs_holder_fails(celery: Celery) -> None:
    key = "celery/sigstop"
    holder_run, contender_run, pid = _start_holder_and_waiting_contender(celery, key)
    frozen = time.time()
    celery.w1.netns.signal_all(signal.SIGSTOP)
    try:
        released = _released(celery, key, pid)
        acquired = celery.wait_for_event(key, "celery_wait_w2", "start", timeout=60)
        celery.wait_for_event(key, "celery_wait_w2", "end", timeout=60)
    finally:
        thawed = time.time()
        celery.w1.netns.signal_all(signal.SIGCONT)
    measured("worker SIGSTOP -> server releases the holder's lock", released - frozen)
    measured("worker SIGSTOP -> contender on the other worker starts its work", acquired - frozen)
    assert released - frozen <= LEASE + MARGIN
    _assert_contender_ran_after_the_holder(celery, key, holder_run, contender_run, "worker SIGSTOP", frozen)
    measured("worker SIGSTOP -> SIGCONT (after the contender's run)", thawed - frozen)
    # Thawed, the holder may take a step before its heartbeat finds the session gone and
    # interrupts it (the contender's run was over by then: no overlap, asserted above).
    after_thaw = [t for t in celery.steps(key)[("celery_skip_w1", 1)] if t >= thawed]
    print(f"\nthawed holder: {len(after_thaw)} work step(s) after SIGCONT before it was interrupted")
    if after_thaw:
        measured("worker SIGCONT -> the thawed holder's last work step", max(after_thaw) - thawed)
        assert max(after_thaw) - thawed <= LEASE / 3 + MARGIN


def test_retry_of_a_failed_guarded_task_runs_once_after_the_lock_is_free(celery: Celery) -> None:
    key = "celery/retry"
    run = celery.deployment.trigger("celery_wait_w1", {"key": key, "seconds": 120, "retry_seconds": 2})
    celery.wait_for_event(key, "celery_wait_w1", "start")
    pid = celery.wait("the first try's lock", lambda: next((p for p, granted in celery.holders(key) if granted), None))
    # The first try loses its lock (its session is ended); this test takes the key at once
    # and keeps it until the retry waits for it.
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    hook = AdvisoryLockHook(dsn=celery.cluster.dsn_for("locks"))
    with celery.locks_db() as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    held = celery.wait(
        "the test takes the key",
        lambda: hook.acquire(LockKey.from_name(key), application_name="celery-suite blocker"),
        timeout=10,
        every=0.01,
    )
    try:
        celery.wait("the retry waits for the key", lambda: any(not granted for _, granted in celery.holders(key)))
    finally:
        freed = time.time()
        assert held.release()
    state, hostname, try_number = celery.wait_finished("celery_wait_w1", run)
    assert (state, hostname, try_number) == ("success", celery.w1.hostname, 2)
    events = [(try_no, event) for _, try_no, _, event, _ in celery.effects(key)]
    assert events == [(1, "start"), (2, "start"), (2, "end")], events
    retry_start = next(at for _, try_no, _, event, at in celery.effects(key) if try_no == 2 and event == "start")
    assert retry_start >= freed, "the retry ran before the lock was free"
    measured("lock freed -> the retry starts its work", retry_start - freed)
    assert_no_overlap(celery, key)
