"""Many keys, one session (issue 15): per-key cost and a 1,000-key batch.

    .venv/bin/python -m benchmarks.many_keys            # one run; writes its section of docs/benchmarks.md
    .venv/bin/python -m benchmarks.many_keys --quick --out /tmp/many.md

Per key, each variant takes and releases one key on a connection that is already open
(how a long-lived process uses each), timed round-robin (:func:`benchmarks.stats.interleaved`).
Every call takes a key of its own name (``bench/many-keys/<n>``, as tenants are), and the raw
side hashes each name to its key as the provider does:

* ``raw psycopg``: ``pg_try_advisory_lock`` + ``pg_advisory_unlock`` on an open connection.
* ``raw psycopg, release announced``: the same, the unlock with the ``pg_notify`` the
  provider's release sends (so that a deferred waiter wakes at once): the server's share of it.
* ``lock session``: ``with session.try_lock(key)`` on ``hook.lock_session()`` (tracking,
  thread safety, loss check; its heartbeat running).
* ``pals, pool warm`` and ``python-redis-lock, warm client`` (``expire`` + ``auto_renewal``),
  as in section 1.

Then ``try_lock_many`` for 1,000 keys, with the client's flights to the server counted by
a relay (:mod:`devtools.relay`). Only this section of docs/benchmarks.md is replaced.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook  # noqa: E402
from airflow_pglock.keys import LockKey  # noqa: E402
from benchmarks.overhead import quiet_task_logger  # noqa: E402
from benchmarks.servers import servers  # noqa: E402
from benchmarks.stats import Summary, interleaved, paired_ratios, progress, table, write_section  # noqa: E402
from devtools.relay import Relay  # noqa: E402

HEADING = "## Many keys, one session"
KEY = "bench/many-keys"
PER_KEY_TARGET = 1.2
ROUND_TRIP_TARGET = 3


def per_key(dsn: str, redis_client: Any | None, rounds: int) -> dict[str, list[float]]:
    raw = psycopg.connect(dsn, autocommit=True)
    names = (f"{KEY}/{n}" for n in itertools.count())
    variants: dict[str, Callable[[], object]] = {}

    def raw_psycopg() -> None:
        number = LockKey.from_name(next(names)).int64
        assert raw.execute("SELECT pg_try_advisory_lock(%s::bigint)", [number]).fetchone() == (True,)
        raw.execute("SELECT pg_advisory_unlock(%s::bigint)", [number])

    def raw_announced() -> None:
        name = next(names)
        number = LockKey.from_name(name).int64
        assert raw.execute("SELECT pg_try_advisory_lock(%s::bigint)", [number]).fetchone() == (True,)
        raw.execute("SELECT pg_advisory_unlock(%s::bigint), pg_notify('pglock_released', %s)", [number, name])

    variants["raw psycopg, open connection"] = raw_psycopg
    variants["raw psycopg, release announced"] = raw_announced
    hook = AdvisoryLockHook(dsn=dsn)
    with hook.lock_session(application_name="pglock-bench session") as session:

        def lock_session() -> None:
            with session.try_lock(next(names)) as sub:
                assert sub is not None

        variants["lock session: try_lock + release"] = lock_session
        closers: list[Callable[[], None]] = [raw.close]
        try:
            import pals

            locker = pals.Locker(
                "bench", dsn.replace("postgresql://", "postgresql+psycopg://", 1), blocking_default=False
            )

            def pals_warm() -> None:
                lock = locker.lock(next(names))
                assert lock.acquire()
                lock.release()

            variants["pals, pool warm"] = pals_warm
            closers.append(locker.engine.dispose)
        except ImportError:
            progress("pals not installed: left out")
        if redis_client is not None:
            import redis_lock

            def redis_warm() -> None:
                lock = redis_lock.Lock(redis_client, next(names), expire=30, auto_renewal=True)
                assert lock.acquire(blocking=False)
                lock.release()

            variants["python-redis-lock, warm client"] = redis_warm
        try:
            return interleaved(variants, rounds, warmup=20)
        finally:
            for close in closers:
                close()


def batch(host: str, port: int, database: str, count: int, repeats: int) -> list[tuple[float, int, float, int]]:
    """(seconds, flights) of try_lock_many(count keys), then of releasing them, per repeat."""
    results = []
    with Relay(port, host) as flights:
        hook = AdvisoryLockHook(dsn=f"postgresql://postgres@127.0.0.1:{flights.port}/{database}")
        keys = [f"tenant-export/{n}" for n in range(count)]
        for _ in range(repeats):
            with hook.lock_session() as session:
                flights.reset()
                started = time.perf_counter()
                taken = session.try_lock_many(keys)
                took, took_flights = time.perf_counter() - started, flights.flights
                assert len(taken) == count
                flights.reset()
                started = time.perf_counter()
                assert session.release(*taken)
                results.append((took, took_flights, time.perf_counter() - started, flights.flights))
    return results


def session_ratio(samples: dict[str, list[float]]) -> float:
    """The lock session's per-key time over raw psycopg's (median of the per-round ratios)."""
    return paired_ratios(samples, "raw psycopg, open connection")["lock session: try_lock + release"].median


def headline_row(samples: dict[str, list[float]]) -> list[str]:
    ratio = session_ratio(samples)
    return [
        "Lock session per key (try + release, a name of its own each time) / raw psycopg",
        f"<= {PER_KEY_TARGET}x",
        f"{ratio:.2f}x",
        "met" if ratio <= PER_KEY_TARGET else "**missed**",
    ]


def run_many_keys(dsn: str, port: int, redis_client: Any | None, rounds: int, count: int, repeats: int) -> ManyKeys:
    progress(f"many keys: per key, {rounds} rounds")
    samples = per_key(dsn, redis_client, rounds)
    progress(f"many keys: try_lock_many({count}) x {repeats}")
    return ManyKeys(samples, batch("127.0.0.1", port, "pglock_bench", count, repeats), count)


@dataclass
class ManyKeys:
    samples: dict[str, list[float]]
    batches: list[tuple[float, int, float, int]]
    count: int

    def render(self, command: str) -> str:
        return section(self.samples, self.batches, self.count, command)


def section(
    samples: dict[str, list[float]], batches: list[tuple[float, int, float, int]], count: int, command: str
) -> str:
    baseline = "raw psycopg, open connection"
    ratios = paired_ratios(samples, baseline)
    rows = []
    for name, values in samples.items():
        ratio = ratios[name]
        rows.append(
            [name, Summary.of(values).fmt(1000, " ms", 3), f"{ratio.median:.2f}x ({ratio.p25:.2f}-{ratio.p75:.2f})"]
        )
    session_ratio = ratios["lock session: try_lock + release"].median
    session_ms = Summary.of(samples["lock session: try_lock + release"]).median
    announced = ratios["raw psycopg, release announced"].median
    faster = [
        name
        for name in ("pals, pool warm", "python-redis-lock, warm client")
        if name in samples and Summary.of(samples[name]).median > session_ms
    ]
    take = Summary.of([b[0] for b in batches])
    release = Summary.of([b[2] for b in batches])
    flights_take = sorted({b[1] for b in batches})
    flights_release = sorted({b[3] for b in batches})
    verdict_key = "met" if session_ratio <= PER_KEY_TARGET else "missed"
    verdict_batch = "met" if max(flights_take) <= ROUND_TRIP_TARGET else "missed"
    return "\n".join(
        [
            HEADING,
            "",
            f"Command: `{command}` (one run on this machine; each ratio is per round, against raw psycopg in "
            "the same round).",
            "",
            "Per key: take and release one key on a connection that is already open.",
            "",
            table(["variant", "per key (median, p25, p75, n)", "ratio to raw psycopg (median, p25-p75)"], rows),
            "",
            f"Target: a lock session at most {PER_KEY_TARGET}x raw psycopg ({verdict_key}: {session_ratio:.2f}x) and "
            f"faster than pals and python-redis-lock (faster than: {', '.join(faster) or 'neither'}).",
            "",
            f"The release's announcement (`pg_notify`, which wakes a deferred waiter at once instead of at its "
            f"next poll) costs the server {announced:.2f}x raw psycopg; the lock session is "
            f"{session_ratio / announced:.2f}x that: the rest is its client work (tracking, thread safety, the "
            "loss check).",
            "",
            f"`try_lock_many` for {count:,} keys on a lock session, through a relay that counts the client's flights:",
            "",
            table(
                ["step", "time (median, p25, p75, n)", "round trips"],
                [
                    [f"try_lock_many({count:,} keys)", take.fmt(1000, " ms"), "/".join(map(str, flights_take))],
                    [f"release({count:,} keys)", release.fmt(1000, " ms"), "/".join(map(str, flights_release))],
                ],
            ),
            "",
            f"Target: {count:,} keys in at most {ROUND_TRIP_TARGET} round trips ({verdict_batch}).",
            "",
        ]
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    rounds, repeats, count = (20, 2, 1000) if args.quick else (2000, 20, 1000)
    quiet_task_logger()
    command = ".venv/bin/python -m benchmarks.many_keys"
    with servers(with_netns=False) as running:
        redis_client = running.redis.client() if running.has("python-redis-lock") else None
        progress(f"many keys: per key, {rounds} rounds")
        samples = per_key(running.dsn, redis_client, rounds)
        progress(f"many keys: try_lock_many({count}) x {repeats}")
        batches = batch("127.0.0.1", running.cluster.port, "pglock_bench", count, repeats)
    text = section(samples, batches, count, command)
    write_section(args.out, HEADING, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
