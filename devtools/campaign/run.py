"""Run a randomized fault campaign and check its history (``python3 devtools/dev.py campaign``).

    python -m devtools.campaign.run [--minutes M] [--seed S] [--out DIR] [--lease L] [--no-plot]

Sets up a lock database that can fail over (:class:`~devtools.campaign.servers.FailoverPair`),
the fencing register, two network namespaces (two more "hosts", when this machine allows
them), then starts the workers (every kind of holder, some on the other hosts) and lets the
nemesis inject faults for M minutes. Then it stops the workers, checks that nothing was
left behind, runs the checker over the whole history and writes ``report.json`` (and, with
matplotlib, ``timeline.png``) into DIR. Exit code 0 when every rule held, 1 otherwise;
a failing run prints its seed, and DIR keeps its history for a replay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from devtools.campaign.checker import Report, check
from devtools.campaign.history import HistoryWriter, read_events
from devtools.campaign.nemesis import Nemesis, Target
from devtools.campaign.servers import FailoverPair, Register
from devtools.campaign.watch import SessionWatch
from devtools.campaign.workers import KINDS, PAIR_KEY, WorkerConfig, machine_watch_main, worker_main
from devtools.netns import NetNamespace, NetNamespaceUnavailableError

HOT_KEYS = ("campaign/hot/0", "campaign/hot/1", "campaign/hot/2")
POOL, POOL_SLOTS = "campaign/pool", 2
#: A key taken by its number (no name: no registry state asked, no scope row read, a lock set's
#: single-key statements): the history names it by this label. Only kinds without a fencing token
#: and outside scopes take it (a scope's row holds named keys only, by design).
NUMERIC_KEY = "campaign/numeric"
#: The key the guard kinds take now and then with ``once_per`` and ``min_interval`` (and ``hook-lock`` without).
RULES_KEY = "campaign/rules"
#: Indices of the campaign's namespaces (devtools/netns.py leaves 231..250 to explicit users).
NAMESPACE_INDICES = (245, 246)
#: The workers: every kind on this host; fenced guards, a lock session, a second pool holder and a
#: scope on the others.
LAYOUT: tuple[tuple[str, int | None], ...] = (
    *((kind, None) for kind in KINDS),
    ("guard-transaction", 0),
    ("pool", 0),
    ("lock-session", 1),
    ("guard-session", 1),
    ("scope", 1),
    ("deferred", 0),
    ("deferred", 1),  # a third: half of its runs take the GuardedTrigger, half of those are cleared
)


@dataclass
class Campaign:
    """A running campaign's parts (its workers are restarted after a SIGKILL while it runs)."""

    out: Path
    seed: int
    lease: float
    pair: FailoverPair
    register: Register
    namespaces: list[NetNamespace]
    configs: list[WorkerConfig] = field(default_factory=list)
    processes: dict[int, Any] = field(default_factory=dict)
    spawns: dict[int, int] = field(default_factory=dict)
    stopping: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start_worker(self, index: int) -> None:
        config = self.configs[index]
        self.spawns[index] = self.spawns.get(index, 0) + 1
        process = multiprocessing.get_context("spawn").Process(
            target=worker_main, args=(config, self.spawns[index]), name=f"campaign-w{index}", daemon=True
        )
        process.start()
        self.processes[index] = process

    def targets(self) -> list[Target]:
        with self.lock:
            return [
                Target(index, process.pid, self.configs[index].netns)
                for index, process in self.processes.items()
                if process.is_alive() and process.pid is not None
            ]

    def supervise(self) -> None:
        """Start again every worker that died (a SIGKILL) until the campaign stops."""
        while not self.stopping:
            with self.lock:
                for index, process in list(self.processes.items()):
                    if not process.is_alive() and not self.stopping:
                        process.join()
                        self.start_worker(index)
            time.sleep(0.2)


def _namespaces() -> list[NetNamespace]:
    if NetNamespace.unavailable_reason() is not None:
        return []
    made = []
    try:
        for index in NAMESPACE_INDICES:
            made.append(NetNamespace(index).create())
    except NetNamespaceUnavailableError:
        for namespace in made:
            namespace.destroy()
        return []
    return made


def _leftovers(campaign: Campaign, timeout: float = 10.0) -> list[str]:
    """What is still there once every worker has stopped: processes, sessions, locks."""
    found = [f"worker w{i} (pid {p.pid}) still running" for i, p in campaign.processes.items() if p.is_alive()]
    deadline = time.monotonic() + timeout
    sessions: list[Any] = []
    locks: list[Any] = []
    while time.monotonic() < deadline:
        with psycopg.connect(campaign.pair.primary_dsn(), autocommit=True) as conn:
            sessions = conn.execute(
                "SELECT pid, application_name FROM pg_stat_activity WHERE application_name LIKE 'campaign%'"
            ).fetchall()
            locks = conn.execute(
                "SELECT pid, classid, objid, objsubid FROM pg_locks WHERE locktype = 'advisory'"
            ).fetchall()
        if not sessions and not locks:
            return found
        time.sleep(0.2)
    return [*found, *(f"session {row}" for row in sessions), *(f"advisory lock {row}" for row in locks)]


def _stop_workers(campaign: Campaign, nemesis_history: HistoryWriter, timeout: float = 30.0) -> None:
    campaign.stopping = True
    (campaign.out / "stop").touch()
    deadline = time.monotonic() + timeout
    for process in campaign.processes.values():
        process.join(max(0.1, deadline - time.monotonic()))
    stuck = [p.pid for p in campaign.processes.values() if p.is_alive() and p.pid is not None]
    if stuck:  # recorded like a SIGKILL: their runs end there
        start = time.time()
        for pid in stuck:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        nemesis_history.emit("fault", kind="runner-kill", start=start, end=time.time(), target="stuck", pids=stuck)
        for process in campaign.processes.values():
            process.join(5)


def git_commit() -> str:
    """The checkout's commit (``git describe --always --dirty``), or ``unknown`` outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def run_campaign(
    seconds: float, seed: int, out: Path, *, lease: float = 3.0, plot: bool = False, command: str | None = None
) -> Report:
    """Run the campaign for ``seconds`` of faults; its history and report go to ``out``.

    :param command: how to run it again (recorded in the report; docs/safety.md quotes it).
    """
    from airflow_pglock.pg import schema

    out.mkdir(parents=True, exist_ok=True)
    (out / "stop").unlink(missing_ok=True)
    history_dir = out / "history"
    history_dir.mkdir(exist_ok=True)
    namespaces = _namespaces()
    listen = [namespace.host_addr for namespace in namespaces]
    subnets = [namespace.subnet for namespace in namespaces]
    register = Register(
        [*HOT_KEYS, POOL, f"{POOL}#slot2", NUMERIC_KEY, PAIR_KEY, RULES_KEY], listen=listen, trusted_subnets=subnets
    )
    pair = FailoverPair(listen=listen, trusted_subnets=subnets)
    campaign = Campaign(out, seed, lease, pair, register, namespaces)
    started = time.time()
    commit = git_commit()  # the code the run judged: the report and docs/safety.md say which
    try:
        register.start()
        pair.start()
        with psycopg.connect(pair.primary_dsn(), autocommit=True) as conn:
            schema.migrate(conn)  # airflow-pglock init-db: the fencing tokens' ledger
        for index, (kind, host) in enumerate(LAYOUT):
            namespace = namespaces[host] if host is not None and host < len(namespaces) else None
            address = namespace.host_addr if namespace is not None else "127.0.0.1"
            campaign.configs.append(
                WorkerConfig(
                    index=index,
                    kind=kind,
                    lock_dsn=pair.dsn(address),
                    register_dsn=register.dsn(address),
                    lease=lease,
                    history=history_dir / f"worker-{index}.jsonl",
                    stop_file=out / "stop",
                    seed=seed * 100 + index,
                    hot_keys=HOT_KEYS,
                    pool=POOL,
                    pool_slots=POOL_SLOTS,
                    numeric_key=NUMERIC_KEY,
                    pair_key=PAIR_KEY,
                    rules_key=RULES_KEY,
                    netns=namespace.name if namespace is not None else None,
                )
            )
            campaign.start_worker(index)
        machine = multiprocessing.get_context("spawn").Process(
            target=machine_watch_main,
            args=(history_dir / "machine.jsonl", out / "stop"),
            name="machine-watch",
            daemon=True,
        )
        machine.start()  # the machine's own stalls: a worker's stall counts only where it saw one too
        supervisor = threading.Thread(target=campaign.supervise, daemon=True)
        supervisor.start()
        nemesis_history = HistoryWriter(history_dir / "nemesis.jsonl")
        by_name = {namespace.name: namespace for namespace in namespaces}
        nemesis = Nemesis(pair, lease, campaign.targets, by_name, nemesis_history, seed)
        # Connections kept open for nothing while the workers run (their exit closes them: the end's look cannot)
        watch = SessionWatch(pair.primary_dsn, HistoryWriter(history_dir / "watch.jsonl")).start()
        time.sleep(2 * lease)  # everyone working before the first fault
        nemesis.run(seconds, stop=lambda: False)
        time.sleep(2 * lease)  # the last fault's aftermath
        watch.stop()
        watch.history.close()
        _stop_workers(campaign, nemesis_history)
        supervisor.join(5)
        machine.join(5)
        leftovers = _leftovers(campaign)
        nemesis_history.close()
        report = check(read_events(history_dir), register.writes(), lease=lease, leftovers=leftovers)
        report.figures.update(
            seed=seed,
            seconds=round(time.time() - started, 1),
            nemesis_seconds=seconds,
            hosts=1 + len(namespaces),
            workers=len(campaign.configs),
            failovers=pair.failovers,
            commit=commit,
            command=command or f"python3 devtools/dev.py campaign --minutes {seconds / 60:g} --seed {seed}",
        )
        (out / "report.json").write_text(
            json.dumps({"passed": report.passed, "violations": report.violations, **report.figures}, indent=2)
        )
        if plot:
            try:
                from devtools.campaign.plot import timeline

                timeline(read_events(history_dir), register.writes(), out / "timeline.png")
            except ImportError as error:  # the picture is optional: the report says everything
                print(f"[campaign] no timeline.png: {error} (`python3 devtools/dev.py campaign` installs it)")
        return report
    finally:
        campaign.stopping = True
        (out / "stop").touch()
        for process in campaign.processes.values():
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        pair.destroy()
        register.destroy()
        for namespace in namespaces:
            namespace.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dev.py campaign", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="how long the nemesis injects faults")
    parser.add_argument("--seed", type=int, default=None, help="the random seed (default: from the clock)")
    parser.add_argument("--out", type=Path, default=None, help="where the history and report go")
    parser.add_argument("--lease", type=float, default=3.0, help="the workers' lease in seconds")
    parser.add_argument("--no-plot", action="store_true", help="skip timeline.png (needs matplotlib)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    out = args.out or Path(tempfile.mkdtemp(prefix=f"pglock-campaign-{seed}-"))
    print(
        f"[campaign] seed {seed}, {args.minutes:g} min of faults, lease {args.lease:g} s; history in {out}", flush=True
    )
    report = run_campaign(args.minutes * 60, seed, out, lease=args.lease, plot=not args.no_plot)
    figures = report.figures
    print(
        f"[campaign] {figures['runs']} runs, {figures['writes']} writes ({figures['refused_writes']} refused), "
        f"faults {figures['faults']}, {figures['failovers']} failovers; stale writes accepted "
        f"{figures['stale_writes_accepted']}, lost holds reported as success "
        f"{figures['lost_holds_reported_as_success']}",
        flush=True,
    )
    for violation in report.violations:
        print(f"[campaign] VIOLATION: {violation}", flush=True)
    print(f"[campaign] {'passed' if report.passed else 'FAILED'} (seed {seed}); report: {out / 'report.json'}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
