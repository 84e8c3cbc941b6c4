"""Prompt wake-ups: a trigger that fires a moment after its task deferred (apache/airflow#72716).

When a trigger fires right after its task deferred, the scheduler may take the executor's
report of the process that deferred ("success") only after the resumed attempt started, and
fail that attempt. The provider's trigger holds such an event until the deferral is
``RESUME_HOLD_SECONDS`` old. This measures, in a real deployment, how often a resumed attempt
fails when the wake-up comes at once:

* **airflow-pglock** (``bench_prompt``): ``count`` mapped tasks defer on keys the benchmark
  holds; each key is released as soon as its task instance is ``deferred`` (polled every
  20 ms). Recorded per task: when it was seen deferred, the trigger's event, when the resumed
  function started, its final state.
* **Airflow's own ``DateTimeSensorAsync``** (``bench_resume_airflow``, which has no such hold):
  runs one after the other, each with its moment already past when the run is triggered.
  The sensor defers all the same (its ``execute`` always does), and its trigger fires as
  soon as the triggerer runs it: the earliest wake-up Airflow's own deferrable sensors
  make. Recorded per run: when the sensor was about to defer (a row its ``execute`` writes
  first), its trigger's event, its resumed method, its final state.

* **Many at once** (``benchmarks/triggerer.py --prompt-herd N``, :func:`measure_herd`): N mapped
  tasks of each kind (``bench_herd_pglock``, keys released as each task is seen deferred;
  ``bench_herd_airflow``, one moment already past), with, per task, when the scheduler took
  the report of the process that deferred (:func:`report_delays`).

A failed resumed attempt is counted whatever the cause; the report lists the final states.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import random
import re
import time
from dataclasses import dataclass, field

import psycopg

from airflow_pglock.triggers.advisory_lock import RESUME_HOLD_SECONDS
from benchmarks.deployment_steps import fired_at, fired_in, start_herd, task_states, wait_for
from benchmarks.stats import percentile
from tests.e2e.deployment import Deployment


@dataclass
class PromptSample:
    """One prompt wake-up: when the task deferred, its trigger's event, its resumed code, its state."""

    deferred: float | None
    event: float | None
    started: float | None
    state: str | None

    @property
    def event_after_deferral(self) -> float | None:
        return None if self.deferred is None or self.event is None else self.event - self.deferred

    @property
    def start_after_deferral(self) -> float | None:
        return None if self.deferred is None or self.started is None else self.started - self.deferred


@dataclass
class PromptResult:
    executor: str
    ours: list[PromptSample]
    theirs: list[PromptSample]


def measure_ours(d: Deployment, locks_dsn: str, count: int) -> list[PromptSample]:
    """``count`` keys held, then each released as soon as its task instance is deferred."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.liveness import Liveness

    hook = AdvisoryLockHook(dsn=locks_dsn, liveness=Liveness(lease=600))
    held = {}
    for index in range(count):
        lock = hook.acquire(f"bench/prompt/{index}", application_name="bench holder")
        assert lock is not None
        held[index] = lock
    triggered = d.airflow("dags", "trigger", "bench_prompt", timeout=120)
    assert triggered.returncode == 0, triggered.stderr[-2000:]
    deferred: dict[int, float] = {}
    deadline = time.monotonic() + 120 + 10 * count
    while held:
        for index, state in task_states(d, "bench_prompt", "prompt").items():
            if state == "deferred" and index in held:
                deferred[index] = time.time()
                held.pop(index).release()
        if time.monotonic() > deadline:
            raise AssertionError(f"not deferred after {120 + 10 * count} s: {sorted(held)}\n{d.logs('scheduler')}")
        d.check_alive()
        time.sleep(0.02)
    finished = ("success", "failed", "up_for_retry", "upstream_failed")
    wait_for(
        f"{count} prompt tasks finished",
        lambda: all(state in finished for state in task_states(d, "bench_prompt", "prompt").values()),
        120 + 10 * count,
        d,
    )
    with psycopg.connect(locks_dsn, autocommit=True) as conn:
        started: dict[int, float] = dict(
            conn.execute(
                "SELECT map_index, min(extract(epoch from at)::float8) FROM bench_started"
                " WHERE dag_id = 'bench_prompt' GROUP BY map_index"
            ).fetchall()
        )
    states = task_states(d, "bench_prompt", "prompt")
    return [
        PromptSample(deferred.get(i), fired_at(d, "bench_prompt", i), started.get(i), states.get(i))
        for i in range(count)
    ]


def measure_theirs(d: Deployment, locks_dsn: str, count: int) -> list[PromptSample]:
    """``count`` runs of Airflow's own sensor, each moment past before the sensor defers."""

    samples: list[PromptSample] = []
    for index in range(count):
        # indexes of their own: bench_started also holds the side-by-side samples' rows
        number = 1000 + index
        target = time.time()
        run_id = f"bench_prompt_airflow_{index}_{int(target)}"
        moment = dt.datetime.fromtimestamp(target, dt.timezone.utc).isoformat()
        conf = json.dumps({"target": moment, "index": number})
        triggered = d.airflow("dags", "trigger", "bench_resume_airflow", "--run-id", run_id, "--conf", conf)
        assert triggered.returncode == 0, triggered.stderr[-2000:]

        def run_state(run_id: str = run_id) -> str | None:
            rows = d.query("SELECT state FROM dag_run WHERE dag_id = 'bench_resume_airflow' AND run_id = %s", [run_id])
            return rows[0][0] if rows else None

        wait_for(f"airflow prompt sample {index}", lambda: run_state() in ("success", "failed"), 180, d)
        with psycopg.connect(locks_dsn, autocommit=True) as conn:
            rows: dict[str, float] = dict(
                conn.execute(
                    "SELECT dag_id, min(extract(epoch from at)::float8) FROM bench_started"
                    " WHERE dag_id IN ('bench_resume_airflow_deferring', 'bench_resume_airflow') AND map_index = %s"
                    " GROUP BY dag_id",
                    [number],
                ).fetchall()
            )
        [(state,)] = d.query(
            "SELECT state FROM task_instance"
            " WHERE dag_id = 'bench_resume_airflow' AND run_id = %s AND task_id = 'wait'",
            [run_id],
        )
        samples.append(
            PromptSample(
                rows.get("bench_resume_airflow_deferring"),
                fired_in(d, "bench_resume_airflow", run_id, "wait"),
                rows.get("bench_resume_airflow"),
                state,
            )
        )
        print(f"airflow prompt {index}: {samples[-1]}", flush=True)
        time.sleep(1 + random.random())
    return samples


def _row(name: str, samples: list[PromptSample]) -> str:
    gaps = [v for s in samples if (v := s.event_after_deferral) is not None]
    starts = [v for s in samples if (v := s.start_after_deferral) is not None]
    failed = sum(1 for s in samples if s.state != "success")
    states = ", ".join(sorted({str(s.state) for s in samples}))

    def spread(values: list[float]) -> str:
        if not values:
            return "-"
        return f"{percentile(values, 50):.2f} s ({min(values):.2f}-{max(values):.2f} s)"

    return f"| {name} | {len(samples)} | {spread(gaps)} | {spread(starts)} | {failed} | {states} |"


def render(result: PromptResult) -> str:
    return "\n".join(
        [
            f"Prompt wake-ups ({result.executor}; `benchmarks/prompt_resumes.py` says how each is made):",
            "",
            "| wake-up at once after the deferral | n | deferral -> trigger event: median (min-max) "
            "| deferral -> resumed code starts: median (min-max) | resumed attempts failed | final states |",
            "|---|---|---|---|---|---|",
            _row("airflow-pglock: key released as its task is seen deferred", result.ours),
            _row("Airflow's `DateTimeSensorAsync`: moment past at its deferral", result.theirs),
        ]
    )


READING = (
    "Reading: the provider's trigger holds an event that comes sooner than "
    f"{RESUME_HOLD_SECONDS:g} s after the trigger started (it starts after the deferral) until then: that "
    "hold is the difference in the 'deferral -> trigger event' column, and the price of the protection. "
    "Airflow's own sensor has no hold: its trigger fires as soon as the triggerer runs it, which is as early "
    "as a deferrable task can be woken. A resumed attempt that failed (apache/airflow#72716, or anything "
    "else) is counted in the fifth column."
)


def headline_row(result: PromptResult) -> list[str]:
    def said(samples: list[PromptSample]) -> str:
        failed = sum(1 for s in samples if s.state != "success")
        gaps = [v for s in samples if (v := s.event_after_deferral) is not None]
        event = f", event {percentile(gaps, 50):.1f} s after the deferral (median)" if gaps else ""
        return f"{failed} of {len(samples)}{event}"

    ours_failed = sum(1 for s in result.ours if s.state != "success")
    return [
        f"Resumed attempts failed after a wake-up at once after the deferral (apache/airflow#72716), "
        f"{result.executor} (section 10)",
        "0 (Airflow's own sensor alongside)",
        f"airflow-pglock {said(result.ours)}; Airflow's `DateTimeSensorAsync` {said(result.theirs)}",
        "met" if ours_failed == 0 and result.ours else "**missed**",
    ]


@dataclass
class PromptHerd:
    """Many tasks woken at once after their deferral: how many resumed attempts failed."""

    trigger: str
    executor: str
    tasks: int
    states: dict[str, int]
    seconds: float
    #: Per task: seconds from its deferral to the scheduler's first "Received executor event" for it
    #: (the report of the process that deferred), from the task's log and the scheduler's.
    report_delays: list[float] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(count for state, count in self.states.items() if state != "success")


def measure_herd(d: Deployment, locks_dsn: str, count: int, trigger: str, executor: str) -> PromptHerd:
    """``count`` mapped tasks (``bench_herd_pglock`` or ``bench_herd_airflow``) woken at once after
    their deferral: each airflow-pglock key is released the moment its task is seen deferred; Airflow's
    sensors all wait for a moment already past when the run is triggered."""
    dag_id = f"bench_herd_{trigger}"
    started = time.monotonic()
    with psycopg.connect(locks_dsn, autocommit=True, application_name="bench foreign holder") as holder:
        numbers = start_herd(d, holder, trigger, count, release_at=time.time())  # Airflow's: a moment already past
        finished = ("success", "failed", "up_for_retry", "upstream_failed")
        deadline = time.monotonic() + 300 + 5 * count
        held = set(range(count)) if trigger == "pglock" else set()
        while True:
            states = task_states(d, dag_id, "wait")
            for index in sorted(held):
                if states.get(index) == "deferred":
                    holder.execute("SELECT pg_advisory_unlock(%s)", [numbers[index]])
                    held.discard(index)
            if len(states) == count and all(state in finished for state in states.values()):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{dag_id}: not finished after {300 + 5 * count} s: {states}")
            d.check_alive()
            time.sleep(0.02)
    wait_for(
        f"{dag_id} run finished",
        lambda: bool(d.query("SELECT 1 FROM dag_run WHERE dag_id = %s AND state IN ('success', 'failed')", [dag_id])),
        120,
        d,
    )
    by_state: dict[str, int] = {}
    for state in task_states(d, dag_id, "wait").values():
        by_state[str(state)] = by_state.get(str(state), 0) + 1
    return PromptHerd(trigger, executor, count, by_state, time.monotonic() - started, report_delays(d, dag_id))


def _stamp(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def report_delays(d: Deployment, dag_id: str) -> list[float]:
    """For each mapped ``wait`` of ``dag_id``: from its deferral ("Pausing task as DEFERRED" in its first
    attempt's log) to the scheduler's first "Received executor event" for it with the process's end (the
    deferring process's report; CeleryExecutor also reports each task's "queued", before it runs)."""
    received: dict[int, float] = {}
    log = d.home / "scheduler.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if "Received executor event" in line and "with state queued" not in line and f"dag_id='{dag_id}'" in line:
            found = re.search(r"map_index=(\d+)", line)
            if found is not None:
                received.setdefault(int(found.group(1)), _stamp(line.split()[0]))
    delays = []
    for index, at in received.items():
        for path in (d.home / "logs" / f"dag_id={dag_id}").glob(
            f"run_id=*/task_id=wait/map_index={index}/attempt=1.log"
        ):
            for line in path.read_text(errors="replace").splitlines():
                if "Pausing task as DEFERRED" in line:
                    with contextlib.suppress(ValueError, KeyError):
                        delays.append(at - _stamp(json.loads(line)["timestamp"]))
                    break
    return sorted(delays)


def render_herds(herds: list[PromptHerd]) -> str:
    rows = [
        "| woken at once after the deferral | executor | tasks | resumed attempts failed | final states "
        "| the deferring process's report: seconds after the deferral, median / p90 / max (n) |",
        "|---|---|---|---|---|---|",
    ]
    for h in herds:
        who = (
            "airflow-pglock: each key released as its task is seen deferred"
            if h.trigger == "pglock"
            else "Airflow's `DateTimeSensorAsync`: one moment, already past"
        )
        states = ", ".join(f"{state} {n}" for state, n in sorted(h.states.items()))
        delays = h.report_delays
        seen = (
            f"{percentile(delays, 50):.2f} / {percentile(delays, 90):.2f} / {max(delays):.2f} ({len(delays)})"
            if delays
            else "-"
        )
        rows.append(f"| {who} | {h.executor} | {h.tasks} | {h.failed} | {states} | {seen} |")
    return "\n".join(rows)
