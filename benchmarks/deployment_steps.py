"""Steps the triggerer benchmarks take on a running deployment (tests/e2e's ``Deployment``): read
task states and when a trigger fired (from the task logs), wait for a condition, start a herd."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psycopg

from tests.e2e.deployment import Deployment


def wait_for(what: str, done: Callable[[], bool], timeout: float, d: Deployment) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        d.check_alive()
        time.sleep(0.1)
    raise AssertionError(f"{what}: not after {timeout} s\n{d.logs('triggerer')}")


def task_states(d: Deployment, dag_id: str, task_id: str) -> dict[int, str | None]:
    rows = d.query("SELECT map_index, state FROM task_instance WHERE dag_id = %s AND task_id = %s", [dag_id, task_id])
    return {int(row[0]): row[1] for row in rows}


def fired_at(d: Deployment, dag_id: str, map_index: int) -> float | None:
    """When the triggerer logged "Trigger fired event" for this task (from the task's log)."""
    return fired_in_logs((d.home / "logs" / f"dag_id={dag_id}").rglob(f"map_index={map_index}/*.log"))


def fired_in_logs(paths: Iterable[Path]) -> float | None:
    """The timestamp of the first "Trigger fired event" line in these task logs."""
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            if "Trigger fired event" not in line:
                continue
            with contextlib.suppress(ValueError):
                stamp = json.loads(line).get("timestamp")
                if stamp:
                    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return None


def fired_in(d: Deployment, dag_id: str, run_id: str, task_id: str) -> float | None:
    """When the triggerer logged "Trigger fired event" for this task of this run."""
    return fired_in_logs(
        (d.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}").rglob("*.log")
    )


def start_herd(d: Deployment, holder: psycopg.Connection, trigger: str, count: int, release_at: float) -> list[int]:
    """Trigger ``bench_herd_<trigger>`` (``count`` mapped tasks). ``pglock``: its keys
    ``bench/herd/<index>`` are held on ``holder`` first; ``airflow``: its sensors wait until
    ``release_at`` (epoch seconds). Returns the keys' numbers, in task order."""
    from airflow_pglock.keys import LockKey

    numbers = [LockKey.from_name(f"bench/herd/{index}").numbers[0] for index in range(count)]
    dag_id = f"bench_herd_{trigger}"
    if trigger == "pglock":
        for number in numbers:
            holder.execute("SELECT pg_advisory_lock(%s)", [number])
        triggered = d.airflow("dags", "trigger", dag_id, timeout=120)
    else:
        moment = dt.datetime.fromtimestamp(release_at, dt.timezone.utc).isoformat()
        triggered = d.airflow("dags", "trigger", dag_id, "--conf", json.dumps({"release_at": moment}), timeout=120)
    assert triggered.returncode == 0, triggered.stderr[-2000:]
    return numbers
