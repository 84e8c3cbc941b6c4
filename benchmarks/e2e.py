"""6. End to end through Airflow: ``dag.test()`` of a guarded and an unguarded task, and a
200-tenant mapped fan-out.

Runs in a child process with its own throwaway ``AIRFLOW_HOME`` (a migrated SQLite
metadata database), so that the harness's own process never configures Airflow. The
guarded and unguarded DAGs alternate, round-robin. During the guarded fan-out the parent
holds the keys of the first tenants, so that those are skipped: the outcome counts show
it.

    python -m benchmarks.e2e child RESULT.json RUNS TENANTS FANOUT_RUNS
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.stats import Summary, progress, table

CONN_ID = "pglock_bench"
ROOT = Path(__file__).resolve().parents[1]

DAG_SOURCE = textwrap.dedent(
    """
    import pendulum
    from airflow.sdk import dag, task

    START = pendulum.datetime(2026, 1, 1, tz="UTC")


    @dag(dag_id="bench_unguarded", schedule=None, start_date=START, catchup=False)
    def bench_unguarded():
        @task
        def work():
            return 1

        work()


    @dag(dag_id="bench_guarded", schedule=None, start_date=START, catchup=False)
    def bench_guarded():
        @task.advisory_lock(postgres_conn_id="pglock_bench")
        def work():
            return 1

        work()


    def fanout(dag_id, guarded):
        @dag(dag_id=dag_id, schedule=None, start_date=START, catchup=False, params={"tenants": 200})
        def build():
            @task
            def tenants(params=None):
                return list(range(int(params["tenants"])))

            if guarded:
                @task.advisory_lock(postgres_conn_id="pglock_bench", tenant_arg="tenant")
                def export(tenant):
                    return tenant
            else:
                @task
                def export(tenant):
                    return tenant

            export.expand(tenant=tenants())

        return build()


    bench_unguarded_dag = bench_unguarded()
    bench_guarded_dag = bench_guarded()
    bench_fanout_guarded_dag = fanout("bench_fanout_guarded", True)
    bench_fanout_unguarded_dag = fanout("bench_fanout_unguarded", False)
    """
)


@dataclass
class E2EResult:
    runs: int
    wall: dict[str, list[float]] = field(default_factory=dict)
    task: dict[str, list[float]] = field(default_factory=dict)
    states: dict[str, list[dict[str, int]]] = field(default_factory=dict)
    fanout: dict[str, dict[str, Any]] = field(default_factory=dict)
    profile: dict[str, float] | None = None
    tenants: int = 0
    held_tenants: int = 0
    fanout_runs: int = 0
    migrate_seconds: float = 0.0
    error: str | None = None


# ----------------------------------------------------------------------- child


def _child(result_path: str, runs: int, tenants: int, fanout_runs: int) -> None:
    dags_folder = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    path = dags_folder / "bench_dags.py"
    spec = importlib.util.spec_from_file_location("bench_dags", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dags = {d.dag_id: d for d in vars(module).values() if hasattr(d, "dag_id") and hasattr(d, "test")}
    out: dict[str, Any] = {"wall": {}, "task": {}, "states": {}, "fanout": {}}

    def run(dag_id: str, conf: dict[str, Any] | None = None) -> tuple[float, Any]:
        started = time.perf_counter()
        dag_run = dags[dag_id].test(run_conf=conf)
        return time.perf_counter() - started, dag_run

    def states(dag_run: Any) -> dict[str, int]:
        return dict(Counter(str(getattr(ti.state, "value", ti.state)) for ti in dag_run.get_task_instances()))

    order = ["bench_unguarded", "bench_guarded"]
    for dag_id in order:  # warm-up: first-run imports and caches are paid here, not by either variant
        run(dag_id)
    for round_no in range(runs):
        for dag_id in order[round_no % 2 :] + order[: round_no % 2]:
            wall, dag_run = run(dag_id)
            out["wall"].setdefault(dag_id, []).append(wall)
            (ti,) = dag_run.get_task_instances()
            duration = (ti.end_date - ti.start_date).total_seconds() if ti.end_date and ti.start_date else None
            out["task"].setdefault(dag_id, []).append(duration)
            out["states"].setdefault(dag_id, []).append(states(dag_run))
    out["profile"] = _profile_guarded(lambda: run("bench_guarded"), runs)
    pair = ["bench_fanout_unguarded", "bench_fanout_guarded"]
    for round_no in range(fanout_runs):  # ABBA...: a slow drift of the machine's load hits both alike
        for dag_id in pair if round_no % 2 == 0 else pair[::-1]:
            wall, dag_run = run(dag_id, {"tenants": tenants})
            record = out["fanout"].setdefault(dag_id, {"wall": [], "states": [], "export": []})
            record["wall"].append(wall)
            record["states"].append(states(dag_run))
            record["export"] += [  # the mapped task instances' own durations
                (ti.end_date - ti.start_date).total_seconds()
                for ti in dag_run.get_task_instances()
                if ti.task_id == "export" and ti.start_date and ti.end_date
            ]
    Path(result_path).write_text(json.dumps(out))


PROFILED = {
    "run_guarded": "inside the guard (`run_guarded`: key, hook, LockGuard)",
    "connect": "of which: opening the lock connection (`LockDatabase.connect`)",
}


def _profile_guarded(run: Any, runs: int) -> dict[str, float] | None:
    """pyinstrument over ``runs`` guarded dag.test() calls: seconds per call in total and in the guard."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        return None
    profiler = Profiler(interval=0.0005)
    profiler.start()
    for _ in range(runs):
        run()
    profiler.stop()
    root = profiler.last_session.root_frame() if profiler.last_session else None
    if root is None:
        return None
    found = {"total": root.time / runs, "run_guarded": 0.0, "connect": 0.0}

    def walk(frame: Any, inside: bool) -> None:
        here = frame.function == "run_guarded" and frame.file_path.endswith("task_guard.py")
        if here and not inside:
            found["run_guarded"] += frame.time / runs
        if inside and frame.function == "connect" and frame.file_path.endswith("pg/database.py"):
            found["connect"] += frame.time / runs
            return
        for child in frame.children:
            walk(child, inside or here)

    walk(root, False)
    return found


# ---------------------------------------------------------------------- parent


def run_e2e(dsn: str, runs: int, tenants: int, held_tenants: int, fanout_runs: int) -> E2EResult:
    from airflow_pglock.keys import LockKey

    result = E2EResult(runs=runs, tenants=tenants, held_tenants=held_tenants, fanout_runs=fanout_runs)
    home = Path(tempfile.mkdtemp(prefix="pglock-bench-airflow-"))
    dags_folder = home / "dags"
    dags_folder.mkdir()
    (dags_folder / "bench_dags.py").write_text(DAG_SOURCE)
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        f"AIRFLOW_CONN_{CONN_ID.upper()}": f"postgresql://{info.get('user', 'postgres')}@{info['host']}:"
        f"{info['port']}/{info['dbname']}",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    holder = psycopg.connect(dsn, autocommit=True, application_name="bench e2e: holds the first tenants")
    try:
        started = time.monotonic()
        migrate = subprocess.run(
            [sys.executable, "-m", "airflow", "db", "migrate"], env=env, capture_output=True, text=True, timeout=900
        )
        result.migrate_seconds = time.monotonic() - started
        if migrate.returncode != 0:
            result.error = f"airflow db migrate failed: {migrate.stderr[-2000:]}"
            return result
        keys = [LockKey.for_task("bench_fanout_guarded", "export", tenant=str(t)) for t in range(held_tenants)]
        for key in keys:
            holder.execute("SELECT pg_advisory_lock(%s)", key.numbers)
        result_path = home / "result.json"
        progress(f"e2e: {runs} guarded + {runs} unguarded dag.test() runs, then {tenants}-tenant fan-outs")
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.e2e", "child", *map(str, (result_path, runs, tenants, fanout_runs))],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
            cwd=ROOT,
        )
        if child.returncode != 0 or not result_path.exists():
            result.error = f"dag.test child failed ({child.returncode}): {child.stderr[-3000:]}"
            return result
        data = json.loads(result_path.read_text())
        result.wall, result.task, result.states, result.fanout = (
            data["wall"],
            data["task"],
            data["states"],
            data["fanout"],
        )
        result.profile = data.get("profile")
        return result
    finally:
        holder.close()
        shutil.rmtree(home, ignore_errors=True)


def render(result: E2EResult) -> str:
    lines = ["## 6. End to end through Airflow (`dag.test()`)", ""]
    if result.error:
        return "\n".join([*lines, f"Not measured: {result.error}"])
    guarded, unguarded = "bench_guarded", "bench_unguarded"
    ratios = [g / u for g, u in zip(result.wall[guarded], result.wall[unguarded], strict=True)]
    task_ratios = [
        g / u for g, u in zip(result.task[guarded], result.task[unguarded], strict=True) if g is not None and u
    ]
    rows = []
    for dag_id, label in ((unguarded, "unguarded `@task`"), (guarded, "guarded `@task.advisory_lock`")):
        wall = Summary.of(result.wall[dag_id])
        task = Summary.of([t for t in result.task[dag_id] if t is not None])
        state_counts: Counter[str] = Counter()
        for states in result.states[dag_id]:
            state_counts.update(states)
        rows.append(
            [label, wall.fmt(1, " s"), task.fmt(1000, " ms", 1), ", ".join(f"{k} {v}" for k, v in state_counts.items())]
        )
    ratio, task_ratio = Summary.of(ratios), Summary.of(task_ratios)
    fan_rows = []
    for dag_id, label in (("bench_fanout_unguarded", "unguarded"), ("bench_fanout_guarded", "guarded")):
        data = result.fanout.get(dag_id, {"wall": [], "states": [], "export": []})
        per_run = sorted({", ".join(f"{k} {v}" for k, v in sorted(s.items())) for s in data["states"]})
        export = Summary.of(data.get("export", []))
        fan_rows.append(
            [label, Summary.of(data["wall"]).fmt(1, " s", 1), export.fmt(1000, " ms", 1), " / ".join(per_run)]
        )
    guarded_walls = result.fanout["bench_fanout_guarded"]["wall"]
    fan_ratio_values = [
        g / u for g, u in zip(guarded_walls, result.fanout["bench_fanout_unguarded"]["wall"], strict=True)
    ]
    fan_ratio = Summary.of(fan_ratio_values)
    lines += [
        f"A one-task DAG whose task returns at once, guarded and unguarded, {result.runs} `dag.test()` runs each, "
        "alternating (after one warm-up run of each). The wall time is the whole `dag.test()` call (DAG run "
        "creation, scheduling, task execution, state updates in the SQLite metadata DB); the task time is the task "
        "instance's start to end.",
        "",
        table(["DAG", "dag.test() wall time", "task instance duration", "states"], rows),
        "",
        f"**Guarded / unguarded, per pair: wall time {ratio.median:.2f}x (p25 {ratio.p25:.2f}, p75 {ratio.p75:.2f}, "
        f"n {ratio.n}); task duration {task_ratio.median:.2f}x (p25 {task_ratio.p25:.2f}, p75 {task_ratio.p75:.2f}).**",
        "",
        *_render_profile(result),
        f"### {result.tenants}-tenant mapped fan-out",
        "",
        f"`export.expand(tenant=...)` over {result.tenants} tenants, unguarded and with "
        '`@task.advisory_lock(tenant_arg="tenant")` (one key per tenant); during the guarded run another session '
        f"holds the keys of tenants 0-{result.held_tenants - 1}, so exactly {result.held_tenants} must be skipped. "
        f"{result.fanout_runs} runs each, in the order unguarded, guarded, guarded, unguarded, ... (the task "
        "instance states, the same in every run, include the upstream `tenants` task).",
        "",
        table(
            ["fan-out", "dag.test() wall time", "one mapped `export` task instance (all runs)", "states (every run)"],
            fan_rows,
        ),
        "",
        f"Guarded / unguarded fan-out wall time, per pair: {fan_ratio.median:.2f}x (min {min(fan_ratio_values):.2f}, "
        f"max {max(fan_ratio_values):.2f}, n {fan_ratio.n}). (`airflow db migrate` of the throwaway metadata "
        f"DB took {result.migrate_seconds:.0f} s and is not counted.)",
    ]
    return "\n".join(lines)


def _render_profile(result: E2EResult) -> list[str]:
    profile = result.profile
    if not profile:
        return ["(pyinstrument is not installed: no breakdown of the guarded run.)", ""]
    total = profile["total"]
    rows = [["whole `dag.test()` call", f"{total * 1000:.1f}", "100%"]] + [
        [label, f"{profile[name] * 1000:.1f}", f"{profile[name] / total:.1%}"] for name, label in PROFILED.items()
    ]
    return [
        f"Where a guarded `dag.test()` spends its time (pyinstrument, sampling every 0.5 ms, {result.runs} runs, "
        "per run):",
        "",
        table(["", "ms per run", "share"], rows),
        "",
    ]


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "child":
        _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit(__doc__)
