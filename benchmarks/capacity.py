"""7. Capacity of one lock database: N guarded tasks holding their locks at the same time.

Each holder is what a running guarded task is to the lock database: a
:class:`~airflow_pglock.guard.LockGuard` with its own connection, its lock and its
heartbeat (default lease, 30 s). The holders run as threads of a few processes (forked),
named like Airflow task instances. The cluster is a throwaway one of its own, with
``max_connections`` sized so that N holders fill about 85 % of the usable slots.

Measured:

* the server's memory per holder: ``/proc/<pid>/smaps_rollup`` of each lock session's
  backend (RSS, PSS and USS = private pages), and the whole server's PSS before and with
  the N holders;
* connection slots: client sessions and advisory locks on the server, next to N;
* ``doctor``: its ``connections`` check is read on the way up, one holder below and at
  each of its thresholds (warning at 50 %, problem at 80 % of the usable slots), and its
  lock-table ``capacity`` check with N holders;
* how long ``airflow-pglock locks`` (in-process table and JSON, and as a new process)
  and the Airflow UI's JSON (``GET /pglock/api/locks`` of a real ``airflow api-server``)
  take with N locks held;
* afterwards, with every holder released: sessions and advisory locks left (0 and 0).
"""

from __future__ import annotations

import contextlib
import io
import math
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.stats import Summary, progress, table
from devtools.pgcluster import Cluster, free_port

CAPACITY_DATABASE = "pglock_capacity"
#: Share of the usable connection slots that N holders fill.
TARGET_SHARE = 0.85
#: Client sessions besides the holders while doctor runs: the observer and doctor's own.
OBSERVER_SESSIONS = 2
#: The holders' application_name (pglock:<deployment>@<host> capacity_dag hold#<i> <run>), as a LIKE pattern.
APPLICATION_PATTERN = "pglock:% capacity_dag hold%"


@dataclass
class Stage:
    """doctor's ``connections`` check with ``holders`` held: ``clients`` sessions counted by the
    benchmark, ``reported`` by doctor (its summary), ``expected`` from the thresholds."""

    holders: int
    clients: int
    reported: int
    usable: int
    status: str
    expected: str
    #: client sessions the server still counted when the wait for closed sessions' backends gave
    #: up (None: they settled), so a mismatch says why.
    unsettled: int | None = None


@dataclass
class CapacityResult:
    holders: int
    processes: int
    max_connections: int = 0
    reserved: int = 0
    start_seconds: float = 0.0
    client_sessions: int = 0
    lock_sessions: int = 0
    advisory_locks: int = 0
    backend_kib: dict[str, list[float]] = field(default_factory=dict)  # rss / pss / uss per lock session
    server_pss_kib: tuple[float, float] = (0.0, 0.0)  # whole server: before, with the holders
    stages: list[Stage] = field(default_factory=list)
    lock_table: str = ""
    timings: dict[str, list[float]] = field(default_factory=dict)
    rows_listed: int = 0
    ui_rows: int = 0
    ui_error: str | None = None
    left_sessions: int = -1
    left_locks: int = -1
    errors: list[str] = field(default_factory=list)


def max_connections_for(holders: int, reserved: int = 3) -> int:
    """``max_connections`` at which ``holders`` + the observers fill :data:`TARGET_SHARE` of the usable slots."""
    return math.ceil((holders + OBSERVER_SESSIONS) / TARGET_SHARE) + reserved


def expected_status(clients: int, usable: int) -> str:
    """What doctor's ``connections`` check must say for ``clients`` of ``usable`` slots."""
    from airflow_pglock.doctor import CAPACITY_PROBLEM, CAPACITY_WARNING

    share = clients / usable
    return "problem" if share >= CAPACITY_PROBLEM else "warning" if share >= CAPACITY_WARNING else "ok"


def threshold_stages(usable: int, holders: int) -> list[int]:
    """Holder counts one below and at each doctor threshold (as far as ``holders`` reach), then all."""
    from airflow_pglock.doctor import CAPACITY_PROBLEM, CAPACITY_WARNING

    counts = []
    for share in (CAPACITY_WARNING, CAPACITY_PROBLEM):
        at = math.ceil(share * usable) - OBSERVER_SESSIONS  # holders whose sessions reach the threshold
        counts += [at - 1, at]
    return sorted({c for c in counts if 0 < c <= holders} | {holders})


# ------------------------------------------------------------------ holder processes


def _holder_process(dsn: str, indices: list[int], control: Connection, ready: Any) -> None:
    """Hold a lock per index (a thread each) as the parent raises the target; release on "release"."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.identity import TaskIdentity
    from airflow_pglock.keys import LockKey
    from airflow_pglock.policy import LockPolicy

    hook = AdvisoryLockHook(dsn=dsn)
    policy = LockPolicy()
    release = threading.Event()
    errors: list[str] = []

    def hold(index: int) -> None:
        identity = TaskIdentity("capacity_dag", "hold", "scheduled__2026-01-01T00:00:00+00:00", index)
        try:
            guard = LockGuard(
                hook.database,
                LockKey.from_name(f"capacity/{index}"),
                policy,
                application_name=identity.application_name(),
            )
            with guard:
                ready.release()
                release.wait(3600)
        except BaseException as error:  # reported to the parent: a holder that failed is a result
            errors.append(f"holder {index}: {type(error).__name__}: {error}")
            ready.release()

    threads: list[threading.Thread] = []
    started = 0
    while True:
        message = control.recv()
        if message == "release":
            release.set()
            for thread in threads:
                thread.join(60)
            control.send(errors)
            return
        target = int(message)
        while started < len(indices) and indices[started] < target:
            thread = threading.Thread(target=hold, args=(indices[started],), daemon=True)
            thread.start()
            threads.append(thread)
            started += 1


class Holders:
    """``count`` lock holders spread over ``processes`` processes, raised stage by stage."""

    def __init__(self, dsn: str, count: int, processes: int) -> None:
        import airflow_pglock.guard  # noqa: F401  (the forked processes start with it imported)

        ctx = multiprocessing.get_context("fork")
        self.ready = ctx.Semaphore(0)
        self.held = 0
        self.pipes: list[Connection] = []
        self.processes = []
        for p in range(processes):
            parent_end, child_end = ctx.Pipe()
            indices = list(range(p, count, processes))
            process = ctx.Process(target=_holder_process, args=(dsn, indices, child_end, self.ready), daemon=True)
            process.start()
            self.pipes.append(parent_end)
            self.processes.append(process)

    def raise_to(self, target: int, timeout: float = 600) -> None:
        for pipe in self.pipes:
            pipe.send(target)
        deadline = time.monotonic() + timeout
        while self.held < target:
            if not self.ready.acquire(timeout=max(0.1, deadline - time.monotonic())):
                raise RuntimeError(f"only {self.held} of {target} holders ready after {timeout} s")
            self.held += 1

    def release(self) -> list[str]:
        errors: list[str] = []
        for pipe in self.pipes:
            pipe.send("release")
        for pipe in self.pipes:
            if pipe.poll(120):
                errors += pipe.recv()
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.kill()
        return errors


# ------------------------------------------------------------------ measurements


def _smaps_kib(pid: int) -> dict[str, float]:
    """Rss, Pss and USS (Private_Clean + Private_Dirty) of a process, in KiB."""
    values: dict[str, float] = {}
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                values[parts[0][:-1]] = float(parts[1])
    return {
        "rss": values.get("Rss", 0.0),
        "pss": values.get("Pss", 0.0),
        "uss": values.get("Private_Clean", 0.0) + values.get("Private_Dirty", 0.0),
    }


def _server_pids(postmaster: int) -> list[int]:
    """The postmaster and every process it forked."""
    pids = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(entry))
    return pids


def _server_pss(cluster: Cluster) -> float:
    pid = cluster.postmaster_pid()
    assert pid is not None
    total = 0.0
    for child in _server_pids(pid):
        with contextlib.suppress(OSError):
            total += _smaps_kib(child)["pss"]
    return total


def _lock_session_pids(admin: psycopg.Connection[Any]) -> list[int]:
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s", [APPLICATION_PATTERN]
    ).fetchall()
    return [int(pid) for (pid,) in rows]


#: Seconds a stage waits for the backends of sessions closed just before to exit.
SETTLE_SECONDS = 10.0


def _doctor_stage(dsn: str, admin: psycopg.Connection[Any], holders: int, usable: int) -> Stage:
    from airflow_pglock.doctor import run_doctor
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    # A session closed just before (the previous stage's doctor, the set-up's) leaves its backend
    # counted until it exits: wait for the holders and the observer alone, as doctor would find them.
    settle_by, settled = time.monotonic() + SETTLE_SECONDS, holders + OBSERVER_SESSIONS - 1
    while True:
        row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'").fetchone()
        seen = int(row[0]) if row is not None else -1
        if seen == settled or time.monotonic() >= settle_by:
            break
        time.sleep(0.05)
    check = next(c for c in run_doctor(AdvisoryLockHook(dsn=dsn)).checks if c.name == "connections")
    found = re.search(r"(\d+) of (\d+) connection slots in use", check.summary)
    reported = int(found.group(1)) if found else -1
    clients = holders + OBSERVER_SESSIONS
    unsettled = None if seen == settled else seen
    return Stage(holders, clients, reported, usable, check.status, expected_status(clients, usable), unsettled)


def _timed(result: CapacityResult, name: str, operation: Any, rounds: int) -> Any:
    value = None
    for _ in range(rounds):
        started = time.perf_counter()
        value = operation()
        result.timings.setdefault(name, []).append(time.perf_counter() - started)
    return value


@dataclass
class UiServer:
    """``airflow api-server --apps core`` with the plugin, all users admins, metadata in ``database``."""

    home: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, cluster: Cluster, lock_dsn: str) -> UiServer:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS pglock_capacity_airflow")
            conn.execute("CREATE DATABASE pglock_capacity_airflow")
        server = cls(Path(tempfile.mkdtemp(prefix="pglock-capacity-airflow-")), free_port())
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        meta = cluster.dsn_for("pglock_capacity_airflow").replace("postgresql://", "postgresql+psycopg2://", 1)
        env.update(
            {
                "AIRFLOW_HOME": str(server.home),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_FOLDER": str(server.home / "dags"),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": meta,
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                "AIRFLOW__API_AUTH__JWT_SECRET": os.urandom(16).hex(),
                "AIRFLOW_CONN_POSTGRES_DEFAULT": lock_dsn,
            }
        )
        airflow = [sys.executable, "-m", "airflow"]
        migrated = subprocess.run([*airflow, "db", "migrate"], env=env, capture_output=True, text=True, timeout=600)
        if migrated.returncode != 0:
            raise RuntimeError(f"airflow db migrate failed: {migrated.stderr[-2000:]}")
        serve = ["api-server", "--apps", "core", "--workers", "1", "--host", "127.0.0.1", "--port", str(server.port)]
        with open(server.home / "api-server.log", "wb") as log:
            server.process = subprocess.Popen(
                [*airflow, *serve],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(server.url("/api/v2/monitor/health"), timeout=2):
                return server
            if server.process.poll() is not None or time.monotonic() > deadline:
                log_text = (server.home / "api-server.log").read_text(errors="replace")[-2000:]
                server.stop()
                raise RuntimeError(f"the api-server did not come up: {log_text}")
            time.sleep(0.5)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get_locks(self) -> bytes:
        with urllib.request.urlopen(self.url("/pglock/api/locks"), timeout=120) as response:
            return bytes(response.read())

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        shutil.rmtree(self.home, ignore_errors=True)


def measure_reading(result: CapacityResult, cluster: Cluster, dsn: str, rounds: int, with_ui: bool) -> None:
    import json

    from airflow_pglock.cli.main import main as cli_main

    def table_output() -> str:
        out = io.StringIO()
        cli_main(["locks", "--dsn", dsn], out)
        return out.getvalue()

    listed = _timed(result, "airflow-pglock locks (in-process, table)", table_output, rounds)
    result.rows_listed = sum(1 for line in listed.splitlines() if "capacity/" in line)
    _timed(
        result,
        "airflow-pglock locks (in-process, --output json)",
        lambda: cli_main(["locks", "--dsn", dsn, "--output", "json"], io.StringIO()),
        rounds,
    )
    command = [str(Path(sys.executable).with_name("airflow-pglock")), "locks", "--dsn", dsn]
    _timed(
        result,
        "airflow-pglock locks (new process, table)",
        lambda: subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
        max(1, rounds // 2),
    )
    if not with_ui:
        result.ui_error = "not measured (--quick without the UI)"
        return
    progress("capacity: starting an airflow api-server for the UI's JSON")
    try:
        server = UiServer.start(cluster, dsn)
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        result.ui_error = f"the api-server could not start: {error}"
        return
    try:
        server.get_locks()  # the first request builds the plugin's app
        body = _timed(result, "UI JSON: GET /pglock/api/locks (api-server)", server.get_locks, rounds)
        result.ui_rows = len(json.loads(body)["locks"])
    finally:
        server.stop()


def run_capacity(holders: int, processes: int, rounds: int = 5, with_ui: bool = True) -> CapacityResult:
    from airflow_pglock.keys import LockKey
    from airflow_pglock.pg.key_names import record_key_name
    from airflow_pglock.pg.schema import migrate

    result = CapacityResult(holders, processes)
    result.max_connections = max_connections_for(holders)
    cluster = Cluster({"max_connections": str(result.max_connections)})
    try:
        cluster.init().start()
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {CAPACITY_DATABASE}")
        dsn = cluster.dsn_for(CAPACITY_DATABASE)
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)  # the key-name registry: `locks` shows names...
            with conn.transaction():  # ...recorded, as by earlier runs (a first hold's name is written at its release)
                for index in range(holders):
                    record_key_name(conn, LockKey.from_name(f"capacity/{index}"), "earlier run", installed=True)
        with psycopg.connect(dsn, autocommit=True, application_name="pglock-capacity observer") as admin:
            row = admin.execute("SELECT current_setting('superuser_reserved_connections')::int").fetchone()
            result.reserved = int(row[0]) if row else 3
            usable = result.max_connections - result.reserved
            before = _server_pss(cluster)
            pool = Holders(dsn, holders, processes)
            started = time.monotonic()
            try:
                for count in threshold_stages(usable, holders):
                    progress(f"capacity: {count} of {holders} holders")
                    pool.raise_to(count)
                    result.stages.append(_doctor_stage(dsn, admin, count, usable))
                result.start_seconds = time.monotonic() - started
                time.sleep(1.0)  # every holder has run its first statements; backends settled
                pids = _lock_session_pids(admin)
                for pid in pids:
                    with contextlib.suppress(OSError):
                        for name, value in _smaps_kib(pid).items():
                            result.backend_kib.setdefault(name, []).append(value)
                result.server_pss_kib = (before, _server_pss(cluster))
                counts = admin.execute(
                    "SELECT (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'),"
                    " (SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s),"
                    " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted)",
                    [APPLICATION_PATTERN],
                ).fetchone()
                assert counts is not None
                result.client_sessions, result.lock_sessions, result.advisory_locks = map(int, counts)
                from airflow_pglock.doctor import run_doctor
                from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

                capacity = next(c for c in run_doctor(AdvisoryLockHook(dsn=dsn)).checks if c.name == "capacity")
                result.lock_table = f"{capacity.status}: {capacity.summary}"
                progress(f"capacity: reading {holders} held locks")
                measure_reading(result, cluster, dsn, rounds, with_ui)
            finally:
                result.errors += pool.release()
            deadline = time.monotonic() + 10
            while True:
                left = admin.execute(
                    "SELECT (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
                    " AND pid <> pg_backend_pid()), (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory')"
                ).fetchone()
                assert left is not None
                result.left_sessions, result.left_locks = int(left[0]), int(left[1])
                if (result.left_sessions, result.left_locks) == (0, 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
    finally:
        cluster.destroy()
    return result


def stages_met(result: CapacityResult) -> bool:
    """doctor said what the thresholds say at every stage, counting the same sessions."""
    return bool(result.stages) and all(s.status == s.expected and s.reported == s.clients for s in result.stages)


def render(result: CapacityResult) -> str:
    n = result.holders
    backend = {name: Summary.of(values) for name, values in result.backend_kib.items()}
    before, with_holders = result.server_pss_kib
    per_holder_total = (with_holders - before) / n if n else float("nan")
    usable = result.max_connections - result.reserved

    def kib(name: str) -> str:
        s = backend.get(name)
        return f"{s.median / 1024:.2f} MiB (p25 {s.p25 / 1024:.2f}, p75 {s.p75 / 1024:.2f}, n {s.n})" if s else "?"

    stage_rows = [
        [
            f"{s.holders:,}",
            f"{s.clients:,} of {s.usable:,} ({s.clients / s.usable:.2%})",
            f"{s.reported:,}"
            + (
                ""
                if s.unsettled is None
                else f" (the server still counted {s.unsettled:,} client sessions after {SETTLE_SECONDS:g} s, "
                f"{s.clients - 1:,} expected before doctor's own)"
            ),
            s.expected,
            s.status,
        ]
        for s in result.stages
    ]
    timing_rows = [[name, f"{Summary.of(values).fmt(1000, ' ms', 1)}"] for name, values in result.timings.items()]
    met = stages_met(result)
    lines = [
        "## 7. Capacity of one lock database",
        "",
        f"{n:,} guarded locks held at once, as {n:,} running guarded tasks hold them: one `LockGuard` each (own "
        f"connection, own heartbeat, lease 30 s), {n // max(result.processes, 1):,} threads in each of "
        f"{result.processes} processes, named like Airflow task instances. PostgreSQL `max_connections` "
        f"{result.max_connections:,} (superuser_reserved_connections {result.reserved}: {usable:,} usable). "
        f"All {n:,} were held {result.start_seconds:.1f} s after the first was asked for (doctor ran at each stage).",
        "",
        "### Connection slots",
        "",
        f"- With {n:,} holders: **{result.lock_sessions:,} lock sessions** and **{result.advisory_locks:,} granted "
        f"advisory locks**; {result.client_sessions:,} client sessions in all (the observer included): "
        f"**{result.lock_sessions / max(n, 1):g} slot per running guarded task**.",
        f"- Lock table with {n:,} holders (doctor's `capacity` check): {result.lock_table}",
        "",
        "### Server memory per holder",
        "",
        table(
            ["per lock session's backend", "median"],
            [
                ["RSS", kib("rss")],
                ["PSS (shared pages split among the processes sharing them)", kib("pss")],
                ["USS (private pages: what the server frees when the session ends)", kib("uss")],
            ],
        ),
        "",
        f"Whole server (postmaster and every process it forked), PSS: {before / 1024:,.1f} MiB before, "
        f"{with_holders / 1024:,.1f} MiB with {n:,} holders: **{per_holder_total / 1024:.2f} MiB per holder**.",
        "",
        "### doctor's `connections` check on the way up",
        "",
        "Client sessions = holders + the observer + doctor's own session. Thresholds: warning from 50 %, problem "
        "from 80 % of the usable slots; each stage is one holder below or exactly at a threshold.",
        "",
        table(["holders", "client sessions of usable slots", "doctor counted", "expected", "doctor said"], stage_rows),
        "",
        f"Every stage as expected: **{'yes' if met else 'NO'}**.",
        "",
        f"### Reading {n:,} held locks",
        "",
        table(["operation", "time"], timing_rows),
        "",
        f"`locks` listed {result.rows_listed:,} of the {n:,} capacity locks"
        + (
            f"; the UI's JSON {result.ui_rows:,}."
            if result.ui_error is None
            else f"; the UI's JSON: {result.ui_error}."
        ),
        "",
        f"Afterwards, all released: **{result.left_sessions} sessions** and **{result.left_locks} advisory locks** "
        "left on the server.",
    ]
    if result.errors:
        lines += ["", f"Errors ({len(result.errors)}): {result.errors[:5]}"]
    return "\n".join(lines)
