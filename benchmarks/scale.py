"""5. Scale: reading thousands of held locks, and connections per guarded task.

* ``airflow-pglock locks`` (in-process, table and JSON output, and as a new process) and
  ``hook.holders(key)`` while 10, 1,000 and 10,000 advisory locks are held by a few
  sessions named like Airflow tasks, with every key's name in the key-name registry. The
  states alternate round-robin: the locks are taken (one statement per session) and
  released again between measurements.
* Connections: N guarded tasks (processes) hold a lock each at the same time, and
  PostgreSQL is asked how many sessions they have; then 10,000 guarded runs (some of them
  busy, hence skipped) and the count of sessions and locks left afterwards.
"""

from __future__ import annotations

import io
import multiprocessing
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.servers import Servers
from benchmarks.stats import Summary, progress, table

HOLDER_SESSIONS = 4
SCALE_DATABASE = "pglock_bench_scale"
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ScaleResult:
    counts: tuple[int, ...]
    timings: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    rows_seen: dict[int, int] = field(default_factory=dict)
    concurrent_tasks: int = 0
    sessions_while_held: int = 0
    lock_sessions_while_held: int = 0
    runs: int = 0
    run_seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    peak_sessions: int = 0
    workers: int = 0
    left_sessions: list[Any] = field(default_factory=list)
    left_locks: int = 0
    errors: list[str] = field(default_factory=list)


def _names(count: int) -> list[str]:
    return [f"scale/tenant-{i}" for i in range(count)]


def _prepare_database(servers: Servers, count: int) -> str:
    """A database with the registry installed and the names of all ``count`` keys recorded."""
    from airflow_pglock.keys import LockKey
    from airflow_pglock.pg.schema import migrate

    with servers.admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {SCALE_DATABASE}")
        conn.execute(f"CREATE DATABASE {SCALE_DATABASE}")
    dsn = servers.cluster.dsn_for(SCALE_DATABASE)
    keys = [LockKey.from_name(name) for name in _names(count)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute(
            "INSERT INTO pglock.key_names (objsubid, classid, objid, name, first_recorded_by)"
            " SELECT 1, c, o, n, 'benchmark' FROM unnest(%s::bigint[], %s::bigint[], %s::text[]) AS t(c, o, n)",
            [[k.pg_locks[0] for k in keys], [k.pg_locks[1] for k in keys], [k.name for k in keys]],
        )
    return dsn


class LockHolders:
    """A few sessions named like Airflow tasks, holding the first ``n`` keys between them."""

    def __init__(self, dsn: str, count: int) -> None:
        from airflow_pglock.identity import TaskIdentity
        from airflow_pglock.keys import LockKey

        self.numbers = [LockKey.from_name(name).numbers[0] for name in _names(count)]
        self.sessions = [
            psycopg.connect(
                dsn,
                autocommit=True,
                application_name=TaskIdentity(
                    "tenant_exports", "export", "scheduled__2026-01-01T00:00:00+00:00", i
                ).application_name(),
            )
            for i in range(HOLDER_SESSIONS)
        ]

    def hold(self, count: int) -> None:
        for index, session in enumerate(self.sessions):
            session.execute("SELECT pg_advisory_unlock_all()")
            share = self.numbers[index:count:HOLDER_SESSIONS]
            session.execute("SELECT count(pg_advisory_lock(k)) FROM unnest(%s::bigint[]) AS k", [share])

    def close(self) -> None:
        for session in self.sessions:
            session.close()


def measure_reading(servers: Servers, result: ScaleResult, rounds: int, process_rounds: int) -> None:
    from airflow_pglock.cli.main import main as cli_main
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.keys import LockKey
    from airflow_pglock.pg.holders import advisory_locks

    dsn = _prepare_database(servers, max(result.counts))
    hook = AdvisoryLockHook(dsn=dsn)
    probe_key = LockKey.from_name(_names(1)[0])
    holders = LockHolders(dsn, max(result.counts))
    reader = psycopg.connect(dsn, autocommit=True, application_name="pglock-bench reader")
    command = [str(Path(sys.executable).with_name("airflow-pglock")), "locks", "--dsn", dsn]
    try:
        for round_no in range(rounds):
            shift = round_no % len(result.counts)
            for count in result.counts[shift:] + result.counts[:shift]:
                holders.hold(count)

                def timed(name: str, operation: Any, count: int = count) -> Any:
                    started = time.perf_counter()
                    value = operation()
                    result.timings.setdefault((name, count), []).append(time.perf_counter() - started)
                    return value

                timed("hook.holders(key)", lambda: hook.holders(probe_key))
                timed("`locks`' SQL snapshot alone (open connection)", lambda: advisory_locks(reader))
                out = io.StringIO()
                timed(
                    "airflow-pglock locks (in-process, table)", lambda out=out: cli_main(["locks", "--dsn", dsn], out)
                )
                result.rows_seen[count] = _table_rows(out.getvalue())
                timed(
                    "airflow-pglock locks (in-process, --output json)",
                    lambda: cli_main(["locks", "--dsn", dsn, "--output", "json"], io.StringIO()),
                )
                if round_no < process_rounds:
                    timed(
                        "airflow-pglock locks (new process, table)",
                        lambda: subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
                    )
            progress(f"scale: reading round {round_no + 1}/{rounds}")
    finally:
        reader.close()
        holders.close()


def _hold_until(dsn: str, name: str, ready: Any, release: Any) -> None:
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.keys import LockKey
    from airflow_pglock.policy import LockPolicy

    with LockGuard(
        AdvisoryLockHook(dsn=dsn).database, LockKey.from_name(name), LockPolicy(), application_name=f"bench task {name}"
    ):
        ready.release()
        release.wait(120)


def _guarded_runs(dsn: str, worker: int, runs: int, queue: Any) -> None:
    from airflow_pglock.exceptions import LockBusyError
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.keys import LockKey
    from airflow_pglock.policy import LockPolicy

    outcomes: dict[str, int] = {}
    hook, policy = AdvisoryLockHook(dsn=dsn), LockPolicy()
    keys = [LockKey.from_name(f"scale/runs/{i}") for i in range(4)]  # shared by the workers: some runs are busy
    try:
        for run in range(runs):
            guard = LockGuard(hook.database, keys[run % len(keys)], policy, application_name=f"bench run {worker}")
            try:
                with guard:
                    pass
            except LockBusyError:
                pass
            outcomes[guard.outcome or "none"] = outcomes.get(guard.outcome or "none", 0) + 1
    except BaseException as error:
        outcomes[f"error: {type(error).__name__}: {error}"] = 1
    queue.put(outcomes)


def _client_sessions(conn: psycopg.Connection[Any], like: str = "%") -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND backend_type = 'client backend' AND application_name LIKE %s",
        [like],
    ).fetchone()
    return int(row[0]) if row else -1


def measure_connections(servers: Servers, result: ScaleResult, tasks: int, runs: int, workers: int) -> None:
    import airflow_pglock.guard  # noqa: F401  (forked workers start with it imported)

    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Semaphore(0), ctx.Event()
    holders = [
        ctx.Process(target=_hold_until, args=(servers.dsn, f"scale/task-{i}", ready, release), daemon=True)
        for i in range(tasks)
    ]
    with servers.admin() as admin:
        for process in holders:
            process.start()
        for _ in holders:
            ready.acquire(timeout=120)
        time.sleep(0.2)
        result.concurrent_tasks = tasks
        result.sessions_while_held = _client_sessions(admin)
        result.lock_sessions_while_held = _client_sessions(admin, "bench task %")
        release.set()
        for process in holders:
            process.join(30)

        queue = ctx.Queue()
        per_worker = runs // workers
        processes = [
            ctx.Process(target=_guarded_runs, args=(servers.dsn, w, per_worker, queue), daemon=True)
            for w in range(workers)
        ]
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            with servers.admin("pglock-bench sampler") as sampler:
                while not done.is_set():
                    peak[0] = max(peak[0], _client_sessions(sampler, "bench run %"))
                    time.sleep(0.02)

        started = time.monotonic()
        for process in processes:
            process.start()
        sampler = threading.Thread(target=sample, daemon=True)  # started after the forks
        sampler.start()
        for _ in processes:
            for outcome, number in queue.get(timeout=1800).items():
                result.outcomes[outcome] = result.outcomes.get(outcome, 0) + number
        result.run_seconds = time.monotonic() - started
        done.set()
        sampler.join(10)
        for process in processes:
            process.join(30)
        result.runs, result.workers, result.peak_sessions = per_worker * workers, workers, peak[0]
        deadline = time.monotonic() + 5  # a closed client's backend exits asynchronously
        while True:
            left = admin.execute(
                "SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            ).fetchall()
            locks = admin.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()
            if (not left and locks and locks[0] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        result.left_sessions, result.left_locks = list(left), int(locks[0]) if locks else -1


def _table_rows(printed: str) -> int:
    """The lock rows of a `locks` table: its lines but the header line, the column titles and
    the footnotes (each holder session here holds many keys: SINCE gets the session-start one)."""
    from airflow_pglock.cli.locks import FOOTNOTE_PREFIXES

    return sum(1 for line in printed.splitlines()[2:] if not line.startswith(FOOTNOTE_PREFIXES))


def run_scale(
    servers: Servers, counts: tuple[int, ...], rounds: int, process_rounds: int, tasks: int, runs: int, workers: int
) -> ScaleResult:
    result = ScaleResult(counts)
    measure_reading(servers, result, rounds, process_rounds)
    progress(f"scale: {tasks} concurrent guarded tasks, then {runs:,} guarded runs in {workers} processes")
    measure_connections(servers, result, tasks, runs, workers)
    return result


def render(result: ScaleResult) -> str:
    names = list(dict.fromkeys(name for name, _ in result.timings))
    rows = []
    for name in names:
        cells = [name]
        base = None
        for count in result.counts:
            values = result.timings.get((name, count), [])
            s = Summary.of(values)
            base = base or s.median
            cells.append(f"{s.median * 1000:,.1f} ms (p25 {s.p25 * 1000:,.1f}, p75 {s.p75 * 1000:,.1f}, n {s.n})")
        last = Summary.of(result.timings.get((name, result.counts[-1]), [])).median
        cells.append(f"{last / base:.1f}x" if base else "?")
        rows.append(cells)
    headers = (
        ["operation"]
        + [f"{c:,} locks held" for c in result.counts]
        + [f"{result.counts[-1]:,} vs {result.counts[0]:,}"]
    )
    outcome_text = ", ".join(f"{k} {v:,}" for k, v in sorted(result.outcomes.items()))
    rate = result.runs / result.run_seconds if result.run_seconds else float("nan")
    lines = [
        "## 5. Scale",
        "",
        f"### `airflow-pglock locks` and `hook.holders()` with {', '.join(f'{c:,}' for c in result.counts)} held locks",
        "",
        f"The locks are held by {HOLDER_SESSIONS} sessions named like Airflow tasks (one `pg_advisory_lock` statement "
        "each); every key's name is in the key-name registry, so the table shows names. `hook.holders(key)` "
        "reads one key (its own short connection included); `locks` lists every lock of the database. "
        "Rows printed by `locks` (table): "
        + ", ".join(f"{c:,} locks -> {result.rows_seen.get(c, 0):,}" for c in result.counts)
        + ".",
        "",
        table(headers, rows),
        "",
        "`pg_locks` is a snapshot of the whole shared lock table, so every reader pays for every lock held on the "
        "server; `hook.holders(key)` filters in SQL and returns one row, `locks` also builds and prints a row per "
        "lock (the snapshot row is the query `locks` runs, on an already open connection: the rest of `locks` is "
        "its connection and its Python work per row). The new-process row includes the interpreter start and "
        "imports (Airflow's among them).",
        "",
        "### Connections per guarded task",
        "",
        f"- {result.concurrent_tasks} guarded tasks (processes) holding a lock each at the same time: "
        f"**{result.lock_sessions_while_held} lock sessions** on the server "
        f"({result.sessions_while_held} client sessions in the database besides the observer), i.e. "
        f"**{result.lock_sessions_while_held / max(result.concurrent_tasks, 1):g} per task**.",
        f"- {result.runs:,} guarded runs in {result.workers} processes on 4 shared keys ({outcome_text}) in "
        f"{result.run_seconds:.1f} s ({rate:,.0f} runs/s); at most **{result.peak_sessions}** of their sessions seen "
        f"at once (sampled every 20 ms; a busy run briefly opens a second one to name the holder).",
        f"- Afterwards: **{len(result.left_sessions)} sessions** and **{result.left_locks} advisory locks** left "
        "on the server.",
    ]
    if result.left_sessions:
        lines.append(f"  Left: {result.left_sessions[:10]}")
    return "\n".join(lines)
