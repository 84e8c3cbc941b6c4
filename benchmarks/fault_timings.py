"""Measure how fast airflow-pglock reacts to each fault, for a few leases.

    .venv/bin/python benchmarks/fault_timings.py --leases 3 6 30 --repeat 5

Starts its own throwaway PostgreSQL (and, as root, a network namespace), runs each fault
``--repeat`` times per lease against a holder process (devtools.holder), and prints a
markdown table of min / median / max seconds. The faults land at a random moment between
two heartbeats, so the spread shows the best and the worst case. Times are
``time.monotonic()`` in the benchmark and in the holder (one clock for the machine);
"server releases" is when pg_locks, polled every 20 ms, no longer shows the lock.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook  # noqa: E402
from airflow_pglock.keys import LockKey  # noqa: E402
from airflow_pglock.liveness import Liveness  # noqa: E402
from devtools.holder import Holder, HolderConfig  # noqa: E402
from devtools.netns import NetNamespace, NetNamespaceUnavailableError  # noqa: E402
from devtools.pgcluster import Cluster  # noqa: E402

DATABASE = "pglock_bench"
Results = dict[tuple[str, float], list[float]]


def held_by(admin: psycopg.Connection[object], pid: int) -> bool:
    row = admin.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = %s AND granted)", [pid]
    ).fetchone()
    return bool(row and row[0])


def until(predicate: Callable[[], bool], timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.02)
    raise TimeoutError(f"not within {timeout} s")


class Bench:
    def __init__(self, cluster: Cluster, netns: NetNamespace | None) -> None:
        self.cluster = cluster
        self.netns = netns
        self.dsn = cluster.dsn_for(DATABASE)
        self.results: Results = defaultdict(list)

    def admin(self) -> psycopg.Connection[object]:
        return psycopg.connect(self.dsn, autocommit=True)

    def holder(self, lease: float, key: str, *, netns: bool = False) -> tuple[Holder, int]:
        dsn = self.dsn
        if netns:
            assert self.netns is not None
            dsn = f"postgresql://postgres@{self.netns.host_addr}:{self.cluster.port}/{DATABASE}"
        holder = Holder(HolderConfig(dsn, key, lease=lease, netns=self.netns.name if netns else None)).start()
        pid = holder.wait_for("acquired", 30)["backend_pid"]
        time.sleep(random.uniform(0.1, Liveness(lease).heartbeat_interval * 2))  # a random phase
        return holder, pid

    def record(self, fault: str, lease: float, seconds: float) -> None:
        self.results[(fault, lease)].append(seconds)
        print(f"  {fault} (lease {lease:g} s): {seconds:.3f} s", flush=True)

    def sigkill(self, lease: float) -> None:
        holder, _ = self.holder(lease, "bench-kill")
        hook = AdvisoryLockHook(dsn=self.dsn)
        key = LockKey.from_name("bench-kill")
        try:
            killed = holder.signal(signal.SIGKILL)

            def acquired() -> bool:
                held = hook.acquire(key)
                if held is None:
                    return False
                held.release()
                return True

            self.record("SIGKILL -> next contender acquires", lease, until(acquired, 10) - killed)
        finally:
            holder.stop()

    def sigstop(self, lease: float) -> None:
        holder, pid = self.holder(lease, "bench-stop")
        try:
            with self.admin() as admin:
                frozen = holder.signal(signal.SIGSTOP)
                released = until(lambda: not held_by(admin, pid), lease + 10)
            self.record("SIGSTOP -> server releases", lease, released - frozen)
        finally:
            holder.stop()

    def terminate(self, lease: float) -> None:
        holder, pid = self.holder(lease, "bench-terminate")
        try:
            with self.admin() as admin:
                terminated = time.monotonic()
                admin.execute("SELECT pg_terminate_backend(%s)", [pid])
            interrupted = holder.wait_for("interrupted", lease + 10)["t"]
            self.record("pg_terminate_backend -> work interrupted", lease, interrupted - terminated)
        finally:
            holder.stop()

    def restart(self, lease: float) -> None:
        holder, _ = self.holder(lease, "bench-restart")
        try:
            restarting = time.monotonic()
            self.cluster.restart()
            interrupted = holder.wait_for("interrupted", lease + 10)["t"]
            self.record("PostgreSQL restart -> work interrupted", lease, interrupted - restarting)
        finally:
            holder.stop()

    def network_cut(self, lease: float) -> None:
        if self.netns is None:
            return
        holder, pid = self.holder(lease, "bench-cut", netns=True)
        try:
            with self.admin() as admin:
                cut = time.monotonic()
                self.netns.cut()
                try:
                    interrupted = holder.wait_for("interrupted", lease + 10)["t"]
                    released = until(lambda: not held_by(admin, pid), lease + 10)
                finally:
                    self.netns.restore()
            self.record("network cut -> holder's work interrupted", lease, interrupted - cut)
            self.record("network cut -> server releases", lease, released - cut)
        finally:
            holder.stop()


def table(results: Results) -> str:
    lines = ["| fault | lease | n | min | median | max |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for (fault, lease), values in results.items():
        lines.append(
            f"| {fault} | {lease:g} s | {len(values)} | {min(values):.3f} | "
            f"{statistics.median(values):.3f} | {max(values):.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leases", type=float, nargs="+", default=[3.0, 6.0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    netns: NetNamespace | None = None
    if NetNamespace.unavailable_reason() is None:
        try:
            netns = NetNamespace().create()
        except NetNamespaceUnavailableError as error:
            print(f"no network namespace, network cut not measured: {error}")
    listen = "127.0.0.1" + (f",{netns.host_addr}" if netns else "")
    cluster = Cluster(settings={"listen_addresses": f"'{listen}'"}, trusted_subnets=[netns.subnet] if netns else [])
    try:
        cluster.init()
        cluster.start()
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        bench = Bench(cluster, netns)
        for lease in args.leases:
            for run in range(args.repeat):
                print(f"lease {lease:g} s, run {run + 1}/{args.repeat}", flush=True)
                for fault in (bench.sigkill, bench.sigstop, bench.terminate, bench.restart, bench.network_cut):
                    fault(lease)
        print()
        print(table(bench.results))
    finally:
        cluster.destroy()
        if netns is not None:
            netns.destroy()


if __name__ == "__main__":
    main()
