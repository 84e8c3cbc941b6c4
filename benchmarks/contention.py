"""3. Contention: N processes hammering one key, or many keys, with each lock library.

Every worker process loops for a fixed time: try the lock (never wait); when it got it,
record its entry and exit in PostgreSQL (``clock_timestamp()``, on a separate logging
connection, inside the protected section) and release; when busy, count a skip. After
each run, SQL checks the records: per key, no entry may precede the previous exit
(``overlaps``, must be 0), and no entry may lack its exit.

The entry is recorded after the lock was granted and the exit before it is released, and
each record is committed before the next step, so two sections of one key that really
overlapped in time must overlap in the records too.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from benchmarks.servers import Servers
from benchmarks.stats import Summary, progress, table

VARIANTS = ("airflow-pglock LockGuard", "raw psycopg, connection per attempt", "pals", "python-redis-lock")
MANY_KEYS = 1000
OVERLAP_SQL = (
    "SELECT count(*) FILTER (WHERE entered < previous_exit), count(*) FILTER (WHERE exited IS NULL), count(*)"
    " FROM (SELECT entered, exited, max(exited) OVER (PARTITION BY key ORDER BY entered, id"
    " ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS previous_exit FROM bench_protected WHERE run = %s) s"
)


@dataclass(frozen=True)
class Config:
    processes: int
    many_keys: bool

    @property
    def label(self) -> str:
        return f"{self.processes} processes, {'many keys' if self.many_keys else 'one key'}"


@dataclass
class RunResult:
    attempts: int
    acquired: int
    errors: list[str]
    seconds: float
    overlaps: int
    unfinished: int
    recorded: int

    @property
    def per_second(self) -> float:
        return self.acquired / self.seconds

    @property
    def skip_rate(self) -> float:
        return 1 - self.acquired / self.attempts if self.attempts else float("nan")


@dataclass
class ContentionResult:
    duration: float
    repeats: int
    runs: dict[tuple[Config, str], list[RunResult]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


def _attempt_function(variant: str, dsn: str, redis_port: int) -> Callable[[str, Callable[[], None]], bool]:
    """``attempt(key_name, work) -> acquired`` for one library, set up once per worker process."""
    if variant == "airflow-pglock LockGuard":
        from airflow_pglock.exceptions import LockBusyError
        from airflow_pglock.guard import LockGuard
        from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
        from airflow_pglock.keys import LockKey
        from airflow_pglock.policy import LockPolicy

        hook, policy = AdvisoryLockHook(dsn=dsn), LockPolicy()

        def pglock(name: str, work: Callable[[], None]) -> bool:
            try:
                with LockGuard(hook.database, LockKey.from_name(name), policy, application_name="bench contention"):
                    work()
            except LockBusyError:
                return False
            return True

        return pglock
    if variant == "raw psycopg, connection per attempt":
        from airflow_pglock.keys import LockKey

        def raw(name: str, work: Callable[[], None]) -> bool:
            numbers = LockKey.from_name(name).numbers
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", numbers).fetchone()
                if not (row and row[0]):
                    return False
                work()
                conn.execute("SELECT pg_advisory_unlock(%s)", numbers)
            return True

        return raw
    if variant == "pals":
        import pals

        locker = pals.Locker("bench", dsn.replace("postgresql://", "postgresql+psycopg://", 1), blocking_default=False)

        def with_pals(name: str, work: Callable[[], None]) -> bool:
            lock = locker.lock(name)
            if not lock.acquire():
                if lock.conn is not None:
                    lock.conn.close()  # back to the pool (pals unlocks everything on check-in)
                return False
            try:
                work()
            finally:
                lock.release()
            return True

        return with_pals
    if variant == "python-redis-lock":
        import redis
        import redis_lock

        client = redis.Redis(host="127.0.0.1", port=redis_port)

        def with_redis(name: str, work: Callable[[], None]) -> bool:
            lock = redis_lock.Lock(client, name, expire=30, auto_renewal=True)
            if not lock.acquire(blocking=False):
                return False
            try:
                work()
            finally:
                lock.release()
            return True

        return with_redis
    raise ValueError(f"unknown variant {variant!r}")


def _worker(
    variant: str,
    dsn: str,
    redis_port: int,
    run: str,
    worker: int,
    config: Config,
    duration: float,
    start: Any,
    results: Any,
) -> None:
    from benchmarks.overhead import quiet_task_logger

    quiet_task_logger()
    attempts = acquired = 0
    errors: list[str] = []
    try:
        attempt = _attempt_function(variant, dsn, redis_port)
        rng = random.Random(worker)
        with psycopg.connect(dsn, autocommit=True, application_name="bench contention log") as log:

            def work(key: str) -> Callable[[], None]:
                def record() -> None:
                    row = log.execute(
                        "INSERT INTO bench_protected (run, key, worker, entered) VALUES (%s, %s, %s, clock_timestamp())"
                        " RETURNING id",
                        [run, key, worker],
                    ).fetchone()
                    assert row is not None
                    log.execute("UPDATE bench_protected SET exited = clock_timestamp() WHERE id = %s", [row[0]])

                return record

            start.wait()
            deadline = time.monotonic() + duration
            while time.monotonic() < deadline:
                key = f"bench/contention/{rng.randrange(MANY_KEYS) if config.many_keys else 'one'}"
                attempts += 1
                try:
                    acquired += attempt(key, work(key))
                except Exception as error:  # counted and reported, never hidden
                    errors.append(f"{type(error).__name__}: {error}")
    except BaseException as error:
        errors.append(f"worker {worker}: {type(error).__name__}: {error}")
        start.abort()
    results.put((attempts, acquired, errors[:3] + ([f"... {len(errors)} errors"] if len(errors) > 3 else [])))


def run_once(servers: Servers, variant: str, config: Config, duration: float, run: str) -> RunResult:
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(config.processes + 1), ctx.Queue()
    redis_port = servers.redis_server.port if servers.redis_server is not None else 0
    workers = [
        ctx.Process(
            target=_worker,
            args=(variant, servers.dsn, redis_port, run, n, config, duration, start, results),
            daemon=True,
        )
        for n in range(config.processes)
    ]
    for process in workers:
        process.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a worker that failed to start reports why below
        start.wait(timeout=120)
    began = time.monotonic()
    outcomes = [results.get(timeout=duration + 120) for _ in workers]
    seconds = time.monotonic() - began
    for process in workers:
        process.join(timeout=30)
    with servers.admin() as conn:
        row = conn.execute(OVERLAP_SQL, [run]).fetchone()
    assert row is not None
    return RunResult(
        attempts=sum(o[0] for o in outcomes),
        acquired=sum(o[1] for o in outcomes),
        errors=[e for o in outcomes for e in o[2]],
        seconds=max(seconds, duration),
        overlaps=row[0],
        unfinished=row[1],
        recorded=row[2],
    )


def preload(variants: tuple[str, ...]) -> None:
    """Import every library here, once: the forked workers then start in milliseconds (an
    import of Airflow in each of 32 workers would take longer than the run)."""
    for variant in variants:
        _attempt_function(variant, "postgresql://localhost/none", 0)
    import benchmarks.overhead  # noqa: F401


def run_contention(
    servers: Servers, process_counts: tuple[int, ...], duration: float, repeats: int
) -> ContentionResult:
    variants = tuple(v for v in VARIANTS if servers.has(v))
    preload(variants)
    with servers.admin() as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_protected (id bigserial PRIMARY KEY, run text, key text, worker int,"
            " entered timestamptz, exited timestamptz)"
        )
        conn.execute("CREATE INDEX IF NOT EXISTS bench_protected_run ON bench_protected (run, key, entered)")
    result = ContentionResult(duration, repeats, missing=dict(servers.missing))
    configs = [Config(n, many) for n in process_counts for many in (False, True)]
    # Round-robin: every (configuration, library) once per repeat, the library order rotated.
    for repeat in range(repeats):
        for index, config in enumerate(configs):
            shift = (repeat + index) % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                run = f"{variant}|{config.label}|{repeat}"
                outcome = run_once(servers, variant, config, duration, run)
                progress(
                    f"contention {run}: {outcome.acquired}/{outcome.attempts} acquired, {outcome.overlaps} overlaps"
                )
                result.runs.setdefault((config, variant), []).append(outcome)
    return result


def render(result: ContentionResult) -> str:
    rows = []
    total_overlaps = 0
    errors: list[str] = []
    ordered = sorted(
        result.runs.items(), key=lambda item: (item[0][0].many_keys, item[0][0].processes, VARIANTS.index(item[0][1]))
    )
    for (config, variant), runs in ordered:
        overlaps = sum(r.overlaps + r.unfinished for r in runs)
        total_overlaps += overlaps
        errors += [f"{variant}, {config.label}: {e}" for r in runs for e in r.errors]
        rate = Summary.of([r.per_second for r in runs])
        skip = Summary.of([r.skip_rate for r in runs])
        rows.append(
            [
                config.label,
                variant,
                f"{rate.median:,.0f} ({rate.p25:,.0f}-{rate.p75:,.0f})",
                f"{skip.median:.1%}",
                f"{sum(r.acquired for r in runs):,}",
                f"{sum(r.recorded for r in runs):,}",
                f"**{overlaps}**",
            ]
        )
    lines = [
        "## 3. Contention: acquisitions per second, skips, overlaps",
        "",
        f"Each run: N worker processes try the lock without waiting, in a loop, for {result.duration:g} s; the "
        "protected section records its entry and exit in PostgreSQL (two statements on a separate connection). "
        f"'many keys' = a key drawn at random from {MANY_KEYS:,} per attempt. Every (configuration, library) ran "
        f"{result.repeats} times, round-robin; rates are the median (p25-p75) over the repeats. "
        "Overlaps are counted by SQL over the records (an entry before the previous exit of the same key, or an "
        "entry without an exit).",
        "",
        table(
            ["configuration", "library", "acquisitions/s (p25-p75)", "skip rate", "acquired", "records", "overlaps"],
            rows,
        ),
        "",
        f"**Overlaps over all runs: {total_overlaps}** (must be 0).",
        "",
        "How to read it: the raw psycopg row is the floor (a connection per attempt, two statements). pals keeps "
        "one pooled connection per process and python-redis-lock one client, so each attempt is a round trip or "
        "two; a LockGuard attempt opens a dedicated connection, as every guarded task does, and a busy attempt "
        "opens a second short one to name the holder in the skip message (invariant 6). On one key the rate is "
        "bounded by the protected section itself; with many keys it shows how far each scales on 2 shared cores.",
    ]
    lines += [f"\nNot measured: {reason}." for reason in result.missing.values()]
    if errors:
        lines += ["", f"Errors ({len(errors)}):", "", *[f"- {e}" for e in errors[:20]]]
    return "\n".join(lines)
