"""Run every benchmark and write docs/benchmarks.md.

    python3 devtools/dev.py bench                 # the full run (about 21 minutes on 2 cores)
    .venv/bin/python -m benchmarks.run --quick --out /tmp/b.md   # a tiny run (the smoke test)

Starts its own PostgreSQL cluster, Redis server and (as root) network namespace, and
stops them at the end. ``--sections`` picks a subset: overhead, imports, contention,
recovery, scale, e2e, capacity, round_trips, wakeups, triggerer (section 10: a real
deployment's resumes next to Airflow's own deferrable sensor's, and wake-ups at once after
a deferral of both; with LocalExecutor, then, where network namespaces and redis-server
are available, with CeleryExecutor), many_keys (a lock session per
key, and batches). What the run does not measure
stays in the document it rewrites: the section of ``benchmarks.slots``, the 200-task herd of
section 9 (``benchmarks.triggerer --herd``), and any section left out.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import (  # noqa: E402
    capacity,
    contention,
    e2e,
    imports,
    many_keys,
    overhead,
    recovery,
    round_trips,
    scale,
    triggerer,
    wakeups,
)
from benchmarks.machine import load, machine, versions  # noqa: E402
from benchmarks.servers import servers  # noqa: E402
from benchmarks.stats import keep_unmeasured, progress, table  # noqa: E402

SECTIONS = (
    "overhead",
    "imports",
    "contention",
    "recovery",
    "scale",
    "e2e",
    "capacity",
    "round_trips",
    "wakeups",
    "triggerer",
    "many_keys",
)
ALTERNATIVES = {"pals", "python-redis-lock"}


@dataclass(frozen=True)
class Settings:
    """How much of each benchmark to run."""

    overhead_rounds: int = 400
    profile_runs: int = 300
    import_runs: int = 10
    contention_processes: tuple[int, ...] = (2, 8, 32)
    contention_seconds: float = 1.5
    contention_repeats: int = 2
    lease: float = 5.0
    recovery_cap: float = 60.0
    recovery_trials: int = 3
    recovery_faults: tuple[str, ...] = recovery.FAULTS
    scale_counts: tuple[int, ...] = (10, 1_000, 10_000)
    scale_rounds: int = 5
    scale_process_rounds: int = 3
    concurrent_tasks: int = 8
    guarded_runs: int = 10_000
    run_workers: int = 2
    e2e_runs: int = 5
    fanout_tenants: int = 200
    held_tenants: int = 10
    fanout_runs: int = 2
    capacity_holders: int = 1_000
    capacity_processes: int = 4
    capacity_rounds: int = 5
    round_trip_rounds: int = 200
    wakeup_samples: int = 40
    wakeup_poll: float = 5.0  # AdvisoryLockTrigger's default poll_interval (on_busy="defer")
    wakeup_sensor_poll: float = 60.0  # AdvisoryLockSensor's default poke_interval
    wakeup_waiters: int = 200
    wakeup_steady: float = 20.0
    triggerer_resumes: int = 10
    triggerer_prompts: int = 10
    #: Also the section-10 run with CeleryExecutor (needs network namespaces and redis-server).
    triggerer_celery: bool = True
    many_keys_rounds: int = 2000
    many_keys_batch: int = 1000
    many_keys_repeats: int = 20


QUICK = Settings(
    overhead_rounds=5,
    profile_runs=5,
    import_runs=1,
    contention_processes=(2,),
    contention_seconds=0.3,
    contention_repeats=1,
    lease=3.0,
    recovery_cap=5.0,
    recovery_trials=1,
    recovery_faults=(recovery.KILL,),
    scale_counts=(10, 100),
    scale_rounds=1,
    scale_process_rounds=0,
    concurrent_tasks=2,
    guarded_runs=20,
    run_workers=2,
    e2e_runs=1,
    fanout_tenants=3,
    held_tenants=1,
    fanout_runs=1,
    capacity_holders=60,
    capacity_processes=2,
    capacity_rounds=2,
    round_trip_rounds=3,
    wakeup_samples=3,
    wakeup_poll=1.0,
    wakeup_sensor_poll=2.0,
    wakeup_waiters=10,
    wakeup_steady=1.0,
    triggerer_resumes=2,
    triggerer_prompts=2,
    many_keys_rounds=20,
    many_keys_batch=100,
    many_keys_repeats=2,
)


def headline(results: dict[str, Any]) -> str:
    """The summary table at the top of the document."""
    rows: list[list[str]] = []
    if "overhead" in results:
        r = results["overhead"]
        verdict = "met" if r.guard_ratio <= overhead.TARGET_RATIO else "**missed**"
        floor = r.samples["floor (raw psycopg)"]
        guard = r.samples["LockGuard"]
        from benchmarks.stats import Summary

        rows.append(
            [
                "Guard overhead (LockGuard / raw psycopg floor)",
                f"<= {overhead.TARGET_RATIO}x",
                f"{r.guard_ratio:.2f}x ({Summary.of(guard).median * 1000:.2f} ms vs "
                f"{Summary.of(floor).median * 1000:.2f} ms)",
                verdict,
            ]
        )
    if "imports" in results:
        r = results["imports"]
        extra = r.over_bash()
        rows.append(
            [
                "DAG parse-time imports, over another provider's decorator (@task.bash)",
                f"< {imports.TARGET_SECONDS * 1000:.0f} ms",
                f"{extra * 1000:.0f} ms (ours {r.ours().median * 1000:.0f} ms)",
                "met" if extra < imports.TARGET_SECONDS else "**missed**",
            ]
        )
    if "round_trips" in results:
        checks = round_trips.verdicts(results["round_trips"])
        for measure, target, check in (
            ("Round trips of a guarded execution over the floor", "+0", "flights"),
            ("Guarded execution / floor, loopback", f"<= {round_trips.TARGET_LOOPBACK}x", "loopback"),
            ("hook.lock() / floor, loopback", f"<= {round_trips.TARGET_LOOPBACK}x", "hook"),
            ("Guarded execution ahead of pals NullPool, loopback", "p75 < its p25", "pals"),
            ("Guarded execution / floor, 2 ms relay", f"<= {round_trips.TARGET_DELAYED}x", "delayed"),
        ):
            text, met = checks[check]
            rows.append([measure, target, text, "met" if met else "**missed**"])
    if "contention" in results:
        r = results["contention"]
        overlaps = sum(x.overlaps + x.unfinished for runs in r.runs.values() for x in runs)
        acquired = sum(x.acquired for runs in r.runs.values() for x in runs)
        rows.append(
            [
                "Overlaps under contention (all libraries, all runs)",
                "0",
                f"{overlaps} in {acquired:,} acquisitions",
                "met" if overlaps == 0 else "**missed**",
            ]
        )
    if "recovery" in results:
        r = results["recovery"]
        for fault in recovery.FAULTS:
            ours = r.times.get(recovery.Item(recovery.PGLOCK, fault))
            theirs = r.times.get(recovery.Item(recovery.DEFAULTS, fault))
            if not ours:
                continue
            worst = max((v for v in ours if v is not None), default=None)
            ours_text = f"{worst:.2f} s worst of {len(ours)}" if worst is not None and None not in ours else "capped"
            theirs_text = (
                ("capped at " + f"{r.cap:g} s")
                if theirs and None in theirs
                else (f"{max(v for v in theirs if v is not None):.2f} s" if theirs else "?")
            )
            ok = None not in ours and worst is not None and worst <= r.lease + 1
            rows.append(
                [
                    f"Recovery after {fault} (lease {r.lease:g} s)",
                    f"<= lease ({r.lease:g} s)",
                    f"{ours_text}; PostgreSQL defaults: {theirs_text}",
                    "met" if ok else "**missed**",
                ]
            )
    if "scale" in results:
        r = results["scale"]
        ok = r.lock_sessions_while_held == r.concurrent_tasks and not r.left_sessions and r.left_locks == 0
        rows.append(
            [
                "Connections per concurrently guarded task; left after the runs",
                "1; 0",
                f"{r.lock_sessions_while_held / max(r.concurrent_tasks, 1):g}; {len(r.left_sessions)} sessions, "
                f"{r.left_locks} locks after {r.runs:,} runs",
                "met" if ok else "**missed**",
            ]
        )
    if "e2e" in results and results["e2e"].error is None:
        r = results["e2e"]
        from benchmarks.stats import Summary

        ratio = Summary.of([g / u for g, u in zip(r.wall["bench_guarded"], r.wall["bench_unguarded"], strict=True)])
        runs_states = r.fanout.get("bench_fanout_guarded", {}).get("states", [])
        expected = {"skipped": r.held_tenants, "success": r.tenants - r.held_tenants + 1}
        seen = sorted({", ".join(f"{k} {v}" for k, v in sorted(s.items())) for s in runs_states})
        rows.append(["dag.test() guarded / unguarded (wall)", "-", f"{ratio.median:.2f}x", ""])
        rows.append(
            [
                f"{r.tenants}-tenant fan-out ({r.held_tenants} held elsewhere), {len(runs_states)} runs",
                f"{r.held_tenants} skipped, the rest success",
                " / ".join(seen),
                "met" if runs_states and all(s == expected for s in runs_states) else "**missed**",
            ]
        )
    if "capacity" in results:
        r = results["capacity"]
        ok = r.lock_sessions == r.holders and capacity.stages_met(r) and (r.left_sessions, r.left_locks) == (0, 0)
        rows.append(
            [
                f"{r.holders:,} guarded locks at once: slots per holder; doctor thresholds; left after",
                "1; as documented; 0",
                f"{r.lock_sessions / max(r.holders, 1):g}; "
                f"{'all stages as expected' if capacity.stages_met(r) else 'stages differ'}; "
                f"{r.left_sessions} sessions, {r.left_locks} locks",
                "met" if ok else "**missed**",
            ]
        )
    if "wakeups" in results:
        rows += wakeups.headline_rows(results["wakeups"])
    if "many_keys" in results:
        rows.append(many_keys.headline_row(results["many_keys"].samples))
    if "triggerer" in results:
        for run_result in results["triggerer"]:
            rows += triggerer.headline_rows(run_result)
    return table(["measure", "target", "result", ""], rows)


def write_document(
    path: Path,
    command: str,
    settings: Settings,
    facts: dict[str, dict[str, str]],
    results: dict[str, Any],
    loads: tuple[str, str],
    seconds: float,
) -> None:
    parts = [
        "# Benchmarks",
        "",
        "Reproducible measurements of airflow-pglock next to its physical floor and next to what one would "
        "otherwise pick (pals, python-redis-lock). Generated by the harness in `benchmarks/` - do not edit by hand; "
        "rerun it:",
        "",
        f"    {command}",
        "",
        f"The run took {seconds / 60:.1f} min. The machine is shared and noisy: every comparison ran side by side "
        "in one run, interleaved round-robin, and is reported as a ratio; absolute times are only valid for this "
        "machine at this load.",
        "",
        "## Summary",
        "",
        headline(results),
        "",
        "## Machine and versions",
        "",
        table(
            ["", ""],
            [[k, v] for k, v in facts["machine"].items()]
            + [["load average (1/5/15 min) at start", loads[0]], ["load average at end", loads[1]]],
        ),
        "",
        table(["software", "version"], [[k, v] for k, v in facts["versions"].items()]),
        "",
        f"Settings: `{settings}`",
        "",
    ]
    renderers: dict[str, Callable[[Any], str]] = {
        "overhead": overhead.render,
        "imports": imports.render,
        "contention": contention.render,
        "recovery": recovery.render,
        "scale": scale.render,
        "e2e": e2e.render,
        "capacity": capacity.render,
        "round_trips": round_trips.render,
        "wakeups": wakeups.render,
        "triggerer": triggerer.render_side_by_side,
        "many_keys": lambda result: result.render(command),
    }
    for name in SECTIONS:
        if name in results:
            parts += [renderers[name](results[name]), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    document = "\n".join(parts)
    if path.exists():  # sections measured by their own scripts, or not in this run, stay
        document = keep_unmeasured(path.read_text(), document)
    path.write_text(document)


def run(
    sections: tuple[str, ...], settings: Settings, without: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    overhead.quiet_task_logger()
    logging.getLogger("sqlalchemy").setLevel(logging.WARNING)
    results: dict[str, Any] = {}
    s = settings
    with servers(with_netns="recovery" in sections, without=without) as srv:
        redis_version = srv.redis_server.version if srv.redis_server else srv.missing.get("python-redis-lock", "?")
        facts = {"machine": machine(), "versions": versions(srv.server_version(), redis_version)}
        if "overhead" in sections:
            progress(f"overhead: {s.overhead_rounds} interleaved rounds")
            results["overhead"] = overhead.run_overhead(srv, s.overhead_rounds, s.profile_runs)
        if "imports" in sections:
            progress(f"imports: {s.import_runs} fresh interpreters")
            results["imports"] = imports.run_imports(s.import_runs)
        if "contention" in sections:
            results["contention"] = contention.run_contention(
                srv, s.contention_processes, s.contention_seconds, s.contention_repeats
            )
        if "recovery" in sections:
            results["recovery"] = recovery.run_recovery(
                srv, s.lease, s.recovery_cap, s.recovery_trials, s.recovery_faults
            )
        if "scale" in sections:
            results["scale"] = scale.run_scale(
                srv,
                s.scale_counts,
                s.scale_rounds,
                s.scale_process_rounds,
                s.concurrent_tasks,
                s.guarded_runs,
                s.run_workers,
            )
        if "e2e" in sections:
            results["e2e"] = e2e.run_e2e(srv.dsn, s.e2e_runs, s.fanout_tenants, s.held_tenants, s.fanout_runs)
        if "capacity" in sections:
            progress(f"capacity: {s.capacity_holders:,} guarded locks held at once")
            results["capacity"] = capacity.run_capacity(s.capacity_holders, s.capacity_processes, s.capacity_rounds)
        if "round_trips" in sections:
            progress(f"round_trips: flights, then {s.round_trip_rounds} interleaved rounds (loopback and relay)")
            results["round_trips"] = round_trips.run_round_trips(srv, s.round_trip_rounds)
        if "wakeups" in sections:
            results["wakeups"] = wakeups.run_wakeups(
                srv.dsn, s.wakeup_samples, s.wakeup_poll, s.wakeup_sensor_poll, s.wakeup_waiters, s.wakeup_steady
            )
        if "many_keys" in sections:
            client = srv.redis.client() if srv.has("python-redis-lock") else None
            results["many_keys"] = many_keys.run_many_keys(
                srv.dsn, srv.cluster.port, client, s.many_keys_rounds, s.many_keys_batch, s.many_keys_repeats
            )
    if "triggerer" in sections:  # a whole deployment of its own
        runs = ["local"]
        if s.triggerer_celery:
            reason = triggerer.celery_unavailable()
            if reason:
                progress(f"triggerer: no CeleryExecutor run: {reason}")
            else:
                runs.append("celery")
        results["triggerer"] = []
        for executor in runs:
            progress(
                f"triggerer ({executor}): {s.triggerer_resumes} provider resumes, each with one of Airflow's own; "
                f"{s.triggerer_prompts} wake-ups at once of each"
            )
            results["triggerer"].append(triggerer.run_side_by_side(s.triggerer_resumes, executor, s.triggerer_prompts))
    return results, facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the markdown to write")
    parser.add_argument("--quick", action="store_true", help="a tiny configuration (seconds; for the smoke test)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument(
        "--without", default="", help="comma-separated alternatives to leave out: pals, python-redis-lock"
    )
    args = parser.parse_args(argv)
    without = tuple(name.strip() for name in args.without.split(",") if name.strip())
    if set(without) - ALTERNATIVES:
        parser.error(f"--without takes {', '.join(sorted(ALTERNATIVES))}; got {args.without!r}")
    sections = tuple(name.strip() for name in args.sections.split(",") if name.strip())
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    command = os.environ.get("PGLOCK_BENCH_COMMAND") or shlex.join(
        ["python", "-m", "benchmarks.run", *(argv if argv is not None else sys.argv[1:])]
    )
    settings = QUICK if args.quick else Settings()
    started, load_at_start = time.monotonic(), load()
    progress(f"start: load average {load_at_start}; sections {', '.join(sections)}")
    results, facts = run(sections, settings, without)
    seconds = time.monotonic() - started
    write_document(args.out, command, settings, facts, results, (load_at_start, load()), seconds)
    progress(f"wrote {args.out} in {seconds / 60:.1f} min; load average {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
