"""1. Guard overhead: acquire + release around an empty function, next to the floor and the alternatives.

Every variant takes and releases one exclusive lock on one key around nothing, and each
is timed once per round, round-robin (see :func:`benchmarks.stats.interleaved`):

* ``floor``: raw psycopg: connect, ``pg_try_advisory_lock``, ``pg_advisory_unlock``, close.
* ``LockGuard``: what a guarded task does per execution (dedicated connection, server
  checks, liveness settings, key-name registry state, heartbeat thread, outcome line).
* ``LockGuard, registry installed``: the same on a database where ``airflow-pglock init-db``
  ran (the key's name is recorded with the unlock: an insert that finds the row already there).
* ``hook.acquire + release``: the hook's manual form alone (no heartbeat, no outcome line).
* ``pals``: PyPI ``pals`` (SQLAlchemy); with its engine's connection pool warm (how it is
  used in a long-lived process) and with ``NullPool`` (a connection per lock, like a task
  process that starts cold).
* ``python-redis-lock``: with ``expire`` and ``auto_renewal`` (its heartbeat thread, the
  equivalent of a lease); on a warm client, and on a new client per lock.

If ``LockGuard`` misses the 1.10x target, the where-the-time-goes table comes from
cProfile over guarded runs of the same kind.
"""

from __future__ import annotations

import cProfile
import logging
import os
import pstats
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from benchmarks.servers import Servers
from benchmarks.stats import Summary, interleaved, paired_ratios, table

TARGET_RATIO = 1.10  # issue 31 (was 1.25)
KEY_NAME = "bench/overhead"
REGISTRY_DATABASE = "pglock_bench_registry"


def quiet_task_logger() -> None:
    """Send the lock libraries' lines (INFO, as in a task log) to /dev/null, not to the console.

    The lines are still formatted and written, as in a task; only the destination differs.
    """
    for name in ("airflow_pglock", "redis_lock"):  # python-redis-lock logs each acquisition at INFO too
        logger = logging.getLogger(name)
        logger.handlers[:] = [logging.FileHandler(os.devnull)]
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _registry_dsn(servers: Servers) -> str:
    from airflow_pglock.pg.schema import migrate

    with servers.admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {REGISTRY_DATABASE}")
        conn.execute(f"CREATE DATABASE {REGISTRY_DATABASE}")
    dsn = servers.cluster.dsn_for(REGISTRY_DATABASE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
    return dsn


def _pals_variants(dsn: str) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    import pals
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    url = dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    pooled = pals.Locker("bench", url, blocking_default=False)
    unpooled = pals.Locker(
        "bench", create_engine_callable=lambda: create_engine(url, poolclass=NullPool), blocking_default=False
    )

    def pals_lock(locker: Any) -> Callable[[], None]:
        def run() -> None:
            lock = locker.lock(KEY_NAME)
            assert lock.acquire()
            lock.release()

        return run

    def close() -> None:
        pooled.engine.dispose()
        unpooled.engine.dispose()

    return {"pals, pool warm": pals_lock(pooled), "pals, NullPool": pals_lock(unpooled)}, close


def _redis_variants(servers: Servers) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    import redis
    import redis_lock

    warm_client = servers.redis.client()

    def redis_warm() -> None:
        lock = redis_lock.Lock(warm_client, KEY_NAME, expire=30, auto_renewal=True)
        assert lock.acquire(blocking=False)
        lock.release()

    def redis_cold() -> None:
        client = redis.Redis(host="127.0.0.1", port=servers.redis.port)
        try:
            lock = redis_lock.Lock(client, KEY_NAME, expire=30, auto_renewal=True)
            assert lock.acquire(blocking=False)
            lock.release()
        finally:
            client.close()

    variants: dict[str, Callable[[], object]] = {
        "python-redis-lock, warm client": redis_warm,
        "python-redis-lock, new client": redis_cold,
    }

    def close() -> None:
        warm_client.close()

    return variants, close


def build_variants(
    servers: Servers, *, registry_dsn: str | None
) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    """name -> one acquire + release around nothing; and what closes the pools and clients afterwards."""
    from airflow_pglock.compat import get_stats
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.keys import LockKey
    from airflow_pglock.policy import LockPolicy

    dsn = servers.dsn
    key = LockKey.from_name(KEY_NAME)
    int_key = LockKey.from_int(key.numbers[0])
    numbers = key.numbers
    policy = LockPolicy()
    hook = AdvisoryLockHook(dsn=dsn)
    app = "dag_id=bench task_id=overhead run_id=manual__1 map_index=-1 try=1"  # an application_name of typical size

    def floor() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_try_advisory_lock(%s)", numbers).fetchone()
            conn.execute("SELECT pg_advisory_unlock(%s)", numbers).fetchone()

    def guarded(guard_hook: Any, guard_key: Any) -> Callable[[], None]:
        def run() -> None:
            # As a guarded task runs it: its lines written (quiet_task_logger), its metrics sent.
            with LockGuard(guard_hook.database, guard_key, policy, application_name=app, stats=get_stats):
                pass

        return run

    def hook_only() -> None:
        held = hook.acquire(key, application_name=app)
        assert held is not None
        held.release()

    variants: dict[str, Callable[[], object]] = {"floor (raw psycopg)": floor, "LockGuard": guarded(hook, key)}
    if registry_dsn is not None:
        variants["LockGuard, registry installed"] = guarded(AdvisoryLockHook(dsn=registry_dsn), key)
    variants["LockGuard, int64 key (no registry state asked)"] = guarded(hook, int_key)
    variants["hook.acquire + release"] = hook_only
    closers: list[Callable[[], None]] = []
    if servers.has("pals"):
        more, close = _pals_variants(dsn)
        variants.update(more)
        closers.append(close)
    if servers.has("python-redis-lock"):
        more, close = _redis_variants(servers)
        variants.update(more)
        closers.append(close)

    def close_all() -> None:
        for close in closers:
            close()

    return variants, close_all


@dataclass
class OverheadResult:
    samples: dict[str, list[float]]
    ratios: dict[str, Summary]
    round_trip: Summary
    connect: Summary
    profile: list[tuple[str, float, int]]
    profile_total: float
    profile_runs: int
    steps: dict[str, list[float]]
    missing: dict[str, str] = field(default_factory=dict)
    statement_parts: dict[str, list[float]] = field(default_factory=dict)

    @property
    def guard_ratio(self) -> float:
        return self.ratios["LockGuard"].median


# What a guarded execution spends its time on, by function (cumulative, per execution).
PROFILED_STEPS: tuple[tuple[str, str, str], ...] = (
    ("connect (libpq start-up, auth, parameters)", "database.py", "connect"),
    ("server facts from the handshake + its rules (no I/O)", "server_rules.py", "from_handshake"),
    ("first lock statement (try + server facts + registry state): 1 round trip", "take.py", "first_try"),
    (
        "key-name registry (no I/O: an installed one's write travels with the unlock)",
        "registry.py",
        "record_acquisition",
    ),
    ("heartbeat thread start", "heartbeat.py", "start"),
    ("heartbeat thread stop + join", "guard.py", "_stop_heartbeat"),
    ("unlock: 1 round trip", "release.py", "unlock"),
    ("outcome line + metrics", "outcome.py", "report"),
    ("acquired line", "__init__.py", "info"),
)


def profile_guard(run: Callable[[], object], runs: int) -> tuple[list[tuple[str, float, int]], float]:
    """cProfile ``runs`` guarded executions: (step, seconds per execution, calls) and the total per execution."""
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(runs):
        run()
    profiler.disable()
    total = (time.perf_counter() - started) / runs
    collected: Any = pstats.Stats(profiler)
    stats = collected.stats
    steps: list[tuple[str, float, int]] = []
    for label, file_suffix, function in PROFILED_STEPS:
        seconds, count = 0.0, 0
        for (filename, _line, name), (_cc, calls, _tt, cumulative, _callers) in stats.items():
            if name == function and filename.endswith(file_suffix) and (function != "info" or "logging" in filename):
                seconds += cumulative
                count += calls
        steps.append((label, seconds / runs, count // runs))
    return steps, total


def _handshake(hook: Any, conn: Any) -> Any:
    from airflow_pglock import server_rules
    from airflow_pglock.pg.server import server_from_handshake

    info = server_from_handshake(conn)
    server_rules.check_server(info, "session", None, server_rules.HANDSHAKE_RULES)
    return info


def decompose(servers: Servers, rounds: int) -> dict[str, list[float]]:
    """Time each step of a guarded execution and of the floor, without a profiler.

    The guard's steps are the lock database's own functions, called in LockGuard's order on a fresh
    connection; the floor's are its two statements. Both sequences alternate, round by
    round. The heartbeat is LockGuard's own (:class:`~airflow_pglock.heartbeat.Heartbeat`), started
    and stopped at once, as around an empty function.
    """
    from airflow_pglock import server_rules
    from airflow_pglock.heartbeat import Heartbeat
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.keys import LockKey
    from airflow_pglock.pg.held import HeldLock
    from airflow_pglock.pg.release import unlock
    from airflow_pglock.pg.take import first_try

    hook = AdvisoryLockHook(dsn=servers.dsn)
    key = LockKey.from_name(KEY_NAME)
    steps: dict[str, list[float]] = {}

    def timed(name: str, operation: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        value = operation()
        steps.setdefault(name, []).append(time.perf_counter() - started)
        return value

    def guard_steps() -> None:
        startup = hook.liveness.server_settings(transaction=False)
        conn = timed(
            "guard: connect (+ liveness options, keepalives, application_name)",
            lambda: hook.database.connect("bench", server_settings=startup),
        )
        info = timed("guard: handshake facts + their rules (no I/O)", lambda: _handshake(hook, conn))
        answer = timed(
            "guard: first lock statement (try + server facts + registry state)",
            lambda: first_try(conn, info, [key], shared=False, scope="session", pool_mode=None),
        )
        timed("guard: server rules (no I/O)", lambda: server_rules.check_server(answer.server, "session", None))
        held = HeldLock(key=key, shared=False, scope="session", connection=conn, server=answer.server)
        beat = Heartbeat(hook.database, held, lambda reason, ask: None, lambda reason: None, threading.Event())
        timed("guard: heartbeat thread start", beat.start)
        timed("guard: heartbeat thread stop + join", beat.stop)
        timed("guard: unlock (1 statement)", lambda: unlock(conn, key))
        timed("guard: close", conn.close)

    def floor_steps() -> None:
        conn = timed("floor: connect", lambda: psycopg.connect(servers.dsn, autocommit=True))
        lock, unlock = "SELECT pg_try_advisory_lock(%s)", "SELECT pg_advisory_unlock(%s)"
        timed("floor: pg_try_advisory_lock", lambda: conn.execute(lock, key.numbers).fetchone())
        timed("floor: pg_advisory_unlock", lambda: conn.execute(unlock, key.numbers).fetchone())
        timed("floor: close", conn.close)

    interleaved({"guard": guard_steps, "floor": floor_steps}, rounds)
    return steps


_TRY = "pg_try_advisory_lock(%(k)s::bigint)"
_WHERE = "NOT pg_is_in_recovery() AND pg_backend_pid() = %(p)s"
_SCHEMA = ", CASE WHEN to_regnamespace('pglock') IS NULL THEN 'absent' ELSE 'present' END"


def first_statement_parts() -> tuple[tuple[str, str], ...]:
    """The first lock statement of a named key, built up part by part: the last two rows are the
    product's own text (``pg.take``), as a guarded task sends it, then with what it no longer asks."""
    from airflow_pglock.pg.key_names import REGISTRY_STATE
    from airflow_pglock.pg.take import _first_try_statement, _Shape

    shape = _Shape("pg_try_advisory_lock", False, True, False, "session", True, False)
    today = _first_try_statement(shape).as_string(None)
    registry = ", " + REGISTRY_STATE.as_string(None)
    return (
        ("the try alone (the floor's statement)", f"SELECT {_TRY}"),
        (
            "+ only on the session that answered the handshake (pooler check)",
            f"SELECT CASE WHEN pg_backend_pid() = %(p)s THEN {_TRY} END, pg_backend_pid()",
        ),
        (
            "+ only on a primary (`pg_is_in_recovery()`)",
            f"SELECT CASE WHEN {_WHERE} THEN {_TRY} END, pg_backend_pid(), pg_is_in_recovery()",
        ),
        (
            "+ whether the key-name registry's schema is there (`to_regnamespace`)",
            f"SELECT CASE WHEN {_WHERE} THEN {_TRY} END, pg_backend_pid(), pg_is_in_recovery(){_SCHEMA}",
        ),
        (
            "+ the rest of the registry's state (schema privilege, lock scopes' horizon)",
            f"SELECT CASE WHEN {_WHERE} THEN {_TRY} END, pg_backend_pid(), pg_is_in_recovery(){registry}",
        ),
        ("+ a pool of the name's presence marker (today's statement, as `pg.take` sends it)", today),
        (
            "+ the server's start time (the statement before; now asked only after a loss)",
            today + ", pg_postmaster_start_time()",
        ),
    )


def first_statement_parts_timed(servers: Servers, rounds: int) -> dict[str, list[float]]:
    """The first statement on a fresh connection, part by part, the variants round-robin."""
    from airflow_pglock.keys import LockKey, pool_presence_marker
    from airflow_pglock.pg.pools import pool_params
    from airflow_pglock.pg.sql import key_params

    key = LockKey.from_name(KEY_NAME)
    # The bench's own parts name k, m and p; the product's text its own names (the same values).
    params = {"k": key.int64, "m": pool_presence_marker(key).int64, "pooled": False}
    params |= {**pool_params(key, 1), **key_params(key)}

    def variant(statement: str) -> Callable[[], float]:
        def run() -> float:
            with psycopg.connect(servers.dsn, autocommit=True) as conn:
                started = time.perf_counter()
                pid = conn.info.backend_pid
                conn.execute(statement, {**params, "p": pid, "reported_pid": pid}).fetchone()  # type: ignore[arg-type]
                took = time.perf_counter() - started
                conn.execute("SELECT pg_advisory_unlock_all()")
            return took

        return run

    parts = first_statement_parts()
    took: dict[str, list[float]] = {label: [] for label, _ in parts}
    runs = {label: variant(statement) for label, statement in parts}
    for round_number in range(rounds):
        order = list(runs.items())
        shift = round_number % len(order)
        for label, run in order[shift:] + order[:shift]:
            took[label].append(run())
    return took


def run_overhead(servers: Servers, rounds: int, profile_runs: int) -> OverheadResult:
    quiet_task_logger()
    registry_dsn = _registry_dsn(servers)
    variants, close = build_variants(servers, registry_dsn=registry_dsn)
    # The physical floor's parts, in the same rounds: one connect + close, one round trip.
    probe = psycopg.connect(servers.dsn, autocommit=True)

    def round_trip() -> None:
        probe.execute("SELECT 1").fetchone()

    def connect_close() -> None:
        psycopg.connect(servers.dsn, autocommit=True).close()

    try:
        samples = interleaved({**variants, "_round_trip": round_trip, "_connect": connect_close}, rounds)
        profile, total = profile_guard(variants["LockGuard"], profile_runs)
        steps = decompose(servers, rounds)
        statement_parts = first_statement_parts_timed(servers, rounds)
    finally:
        probe.close()
        close()
    rtt, connect = Summary.of(samples.pop("_round_trip")), Summary.of(samples.pop("_connect"))
    ratios = paired_ratios(samples, "floor (raw psycopg)")
    return OverheadResult(
        samples, ratios, rtt, connect, profile, total, profile_runs, steps, dict(servers.missing), statement_parts
    )


def render(result: OverheadResult) -> str:
    rows = []
    for name, values in result.samples.items():
        ratio = result.ratios[name]
        rows.append(
            [name, Summary.of(values).fmt(1000, " ms"), f"{ratio.median:.2f}x ({ratio.p25:.2f}-{ratio.p75:.2f})"]
        )
    verdict = "met" if result.guard_ratio <= TARGET_RATIO else "MISSED"
    lines = [
        "## 1. Guard overhead: acquire + release around an empty function",
        "",
        "One exclusive lock on one key, taken and released around nothing, including the dedicated connection. "
        "All variants run in the same rounds, round-robin (order rotated each round); the ratio is taken per round "
        "against the floor of that round, then summarised (median, p25-p75).",
        "",
        table(["variant", "time per acquire + release", "ratio to the floor (p25-p75)"], rows),
        "",
        f"Measured in the same rounds: one connect + close {result.connect.fmt(1000, ' ms')}; one round trip "
        f"(`SELECT 1` on an open connection) {result.round_trip.fmt(1000, ' ms', 3)}.",
        "",
        *[f"Not measured: {reason}.\n" for reason in result.missing.values()],
        f"**Target: LockGuard at most {TARGET_RATIO}x the floor: {verdict}** (median ratio {result.guard_ratio:.2f}x).",
        "",
        "pals with a warm pool and python-redis-lock with a warm client do not open a connection per lock, so they "
        "can be faster than the floor; a guarded Airflow task runs in a fresh task process and cannot reuse one "
        "(nor should it: `pg_try_advisory_lock` succeeds again on a session that already holds the key, so a reused "
        "session could let two tasks both hold it). The NullPool and new-client rows are the like-for-like "
        "comparison.",
        "",
        "### Where a guarded execution spends its time (cProfile)",
        "",
        f"cProfile over {result.profile_runs} LockGuard executions (profiling inflates the Python-heavy "
        "steps; the round-trip steps are mostly waiting for the server):",
        "",
        table(
            ["step", "ms per execution", "calls"],
            [[label, f"{seconds * 1000:.3f}", str(calls)] for label, seconds, calls in result.profile]
            + [["**total (profiled)**", f"**{result.profile_total * 1000:.3f}**", ""]],
        ),
        "",
        *render_decomposition(result),
    ]
    return "\n".join(lines)


GUARD_ONLY = ("handshake", "first lock statement", "rules", "heartbeat")


def render_decomposition(result: OverheadResult) -> list[str]:
    medians = {name: Summary.of(values).median for name, values in result.steps.items()}
    guard = {name: value for name, value in medians.items() if name.startswith("guard:")}
    floor = {name: value for name, value in medians.items() if name.startswith("floor:")}
    rows = [[name, f"{value * 1000:.3f}"] for name, value in {**floor, **guard}.items()]
    guard_total, floor_total = sum(guard.values()), sum(floor.values())
    extra = {name: value for name, value in guard.items() if any(word in name for word in GUARD_ONLY)}
    extra_total = sum(extra.values())
    biggest = sorted(extra.items(), key=lambda item: -item[1])[:3]
    connect_delta = guard.get("guard: connect (+ liveness options, keepalives, application_name)", 0.0) - floor.get(
        "floor: connect", 0.0
    )
    lines = [
        "### The same, step by step, without a profiler",
        "",
        "Each step of a guarded execution timed alone (the hook's own methods, in LockGuard's order, on a fresh "
        "connection), next to the floor's steps, the two sequences alternating round by round (medians, ms):",
        "",
        table(["step", "median ms"], rows),
        "",
        f"Sum of the medians: guard {guard_total * 1000:.2f} ms, floor {floor_total * 1000:.2f} ms "
        f"({guard_total / floor_total:.2f}x). The steps the floor does not have add {extra_total * 1000:.2f} ms "
        f"({extra_total / floor_total:.0%} of the floor); the largest: "
        + "; ".join(f"{name.removeprefix('guard: ')} {value * 1000:.2f} ms" for name, value in biggest)
        + f". The guard's connect differs from the floor's by {connect_delta * 1000:+.2f} ms.",
        "",
        "What this shows: on a fresh connection, a statement costs far more than the round trip measured on a warm "
        "connection above: the new backend's catalog caches are empty, so each statement that names functions or "
        "catalog tables first loads them. What the first lock statement asks besides the try (`pg_backend_pid()`, "
        "`pg_is_in_recovery()`, the registry's state, a pool's marker) is paid there, in the same round trip.",
        *render_statement_parts(result),
    ]
    return lines


def render_statement_parts(result: OverheadResult) -> list[str]:
    if not result.statement_parts:
        return []
    medians = {label: Summary.of(values).median for label, values in result.statement_parts.items()}
    labels = list(medians)
    rows = []
    for index, label in enumerate(labels):
        step = medians[label] - medians[labels[index - 1]] if index else 0.0
        total = medians[label] - medians[labels[0]]
        rows.append([label, f"{medians[label] * 1000:.3f}", f"{step * 1000:+.3f}", f"{total * 1000:+.3f}"])
    whole = medians[labels[-1]] - medians[labels[0]]
    today = medians[labels[-2]] - medians[labels[0]]
    floor = sum(Summary.of(values).median for name, values in result.steps.items() if name.startswith("floor:"))
    return [
        "",
        "### The first lock statement, part by part",
        "",
        "The first statement of a named key's lock built up one part at a time, each variant on a fresh connection "
        "(the backend's caches empty, as a task's are), the variants round-robin (medians, ms):",
        "",
        table(["statement", "median ms", "this part", "over the try alone"], rows),
        "",
        f"Everything today's statement asks besides the try costs {today * 1000:.2f} ms, "
        f"{today / floor:.0%} of the floor's {floor * 1000:.2f} ms: taken out whole it would bring a guarded "
        f"execution {result.guard_ratio:.2f}x -> about {result.guard_ratio - today / floor:.2f}x the floor. Each part "
        "keeps a promise: the pooler check (a lock taken behind a transaction pooler would be held by a session "
        "nobody owns), the standby check (a lock on a standby excludes nobody; asked of the session rather than "
        "read from the handshake's `in_hot_standby`, which a pooler replays and PostgreSQL 12/13 lack), the "
        "registry's state (`airflow-pglock locks` names keys; a lock scope between its tasks holds its key by a "
        "row), the marker (a plain lock and a pool of one name never both run). The last row is what the statement "
        f"no longer asks ({(whole - today) * 1000:+.2f} ms): the server's start time, asked only after a loss, "
        "which is told from a restart by the server's uptime against the time the lock was held.",
    ]
