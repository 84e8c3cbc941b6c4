"""Pools of slots (issue 18): time and round trips to take one slot, next to the mutex.

    .venv/bin/python -m benchmarks.slots            # one run; writes its section of docs/benchmarks.md
    .venv/bin/python -m benchmarks.slots --quick --out /tmp/slots.md

For pools of N = 1, 8 and 64 slots with 0, half and N - 1 slots held by other sessions,
one session that is already connected takes a slot (``pg.statements.try_slot``: one
statement that tries the slots in order) and gives it back; only the take is timed. The
mutex row is ``try_lock`` of a plain key on the same connection. The client's flights to
the server are counted by a relay (:mod:`devtools.relay`). Only this section of
docs/benchmarks.md is replaced.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from airflow_pglock.keys import LockKey, slot_keys  # noqa: E402
from airflow_pglock.pg import statements  # noqa: E402
from airflow_pglock.pg.release import unlock  # noqa: E402
from benchmarks.servers import servers  # noqa: E402
from benchmarks.stats import Summary, progress, table, write_section  # noqa: E402
from devtools.relay import Relay  # noqa: E402

HEADING = "## Pools of slots: taking one slot"
SIZES = (1, 8, 64)


def held_counts(size: int) -> list[int]:
    return sorted({0, size // 2, size - 1})


#: Untimed takes before each case (psycopg prepares a statement on its 5th execution: one extra flight once).
WARMUP = 10


def measure(host: str, port: int, database: str, rounds: int) -> list[tuple[str, int, list[float], set[int]]]:
    """(what, slots held by others, take times in seconds, flights per take) for each case."""
    direct = f"postgresql://postgres@{host}:{port}/{database}"
    results: list[tuple[str, int, list[float], set[int]]] = []
    with (
        Relay(port, host) as flights,
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{flights.port}/{database}", autocommit=True) as conn,
    ):
        mutex = LockKey.from_name("bench/slots-mutex")
        times, seen = [], set()
        for round_no in range(WARMUP + rounds):
            flights.reset()
            started = time.perf_counter()
            assert statements.try_lock(conn, mutex)
            if round_no >= WARMUP:
                times.append(time.perf_counter() - started)
                seen.add(flights.flights)
            unlock(conn, mutex)
        results.append(("mutex (try_lock)", 0, times, seen))
        for size in SIZES:
            pool = slot_keys(LockKey.from_name(f"bench/slots-{size}"), size)
            for held in held_counts(size):
                others = [psycopg.connect(direct, autocommit=True) for _ in range(held)]
                try:
                    for other, key in zip(others, pool, strict=False):
                        assert statements.try_lock(other, key)
                    times, seen = [], set()
                    for round_no in range(WARMUP + rounds):
                        flights.reset()
                        started = time.perf_counter()
                        slot = statements.try_slot(conn, pool)
                        if round_no >= WARMUP:
                            times.append(time.perf_counter() - started)
                            seen.add(flights.flights)
                        assert slot == held, (slot, held)
                        unlock(conn, pool[slot])
                    results.append((f"pool of {size}", held, times, seen))
                finally:
                    for other in others:
                        other.close()
    return results


def section(results: list[tuple[str, int, list[float], set[int]]], command: str) -> str:
    rows = [
        [what, str(held), Summary.of(times).fmt(1000, " ms", 3), "/".join(map(str, sorted(seen)))]
        for what, held, times, seen in results
    ]
    flights = sorted({flight for _, _, _, seen in results for flight in seen})
    slowest = max(results, key=lambda result: Summary.of(result[2]).median)
    return "\n".join(
        [
            HEADING,
            "",
            f"Command: `{command}` (one run on this machine, a 2-core VM shared with other jobs).",
            "",
            "One connected session takes one slot of a pool whose first slots other sessions hold (the statement "
            "tries the slots in order, so the free slot it finds is the one after them) and gives it back; only "
            f"the take is timed, after {WARMUP} untimed takes. Round trips: the client's flights to the server, "
            "counted by a relay. A guarded task with `slots=N` runs this statement on its fresh lock connection; "
            "with `slots=1` it runs the mutex statement (the `pool of 1` row is the pool statement with one slot).",
            "",
            table(["what", "slots held by others", "take one slot (median, p25, p75, n)", "round trips"], rows),
            "",
            f"Round trips per take, in every case: {'/'.join(map(str, flights))}. The slowest median: "
            f"{slowest[0]} with {slowest[1]} held, {Summary.of(slowest[2]).median * 1000:.3f} ms "
            "(the statement does one `pg_try_advisory_lock` per slot it tries).",
            "",
        ]
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    rounds = 20 if args.quick else 1000
    command = ".venv/bin/python -m benchmarks.slots"
    with servers(with_netns=False, without=("pals", "python-redis-lock")) as running:
        progress(f"slots: {rounds} takes per case")
        results = measure("127.0.0.1", running.cluster.port, "pglock_bench", rounds)
    text = section(results, command)
    write_section(args.out, HEADING, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
