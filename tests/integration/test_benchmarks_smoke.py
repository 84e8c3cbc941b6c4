"""The benchmark harness (benchmarks/, `python3 devtools/dev.py bench`) runs end to end in a
tiny configuration, so that it cannot rot. No timing is asserted: only that every section
ran and that the correctness facts it reports hold (no overlaps, one connection per guarded
task, nothing left behind, a killed holder's lock freed). The alternatives (pals,
python-redis-lock) are measured when the `bench` extra is installed, left out otherwise.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_pglock.compat import AIRFLOW_V_3_PLUS

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not AIRFLOW_V_3_PLUS, reason="the benchmarks measure on top of airflow.sdk (Airflow 3)")


def run_quick(tmp_path: Path, sections: str) -> str:
    out = tmp_path / "benchmarks.md"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--sections", sections, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"the harness failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return out.read_text()


def test_quick_run_writes_every_section_and_the_invariants_hold(tmp_path: Path) -> None:
    text = run_quick(tmp_path, "overhead,imports,contention,recovery,scale")
    for heading in (
        "## Summary",
        "## Machine and versions",
        "## 1. Guard overhead",
        "## 2. Import cost",
        "## 3. Contention",
        "## 4. Recovery",
        "## 5. Scale",
    ):
        assert heading in text, heading
    assert "python -m benchmarks.run --quick" in text  # the exact command is stated
    assert re.search(r"load average \(1/5/15 min\) at start \| [\d.]+ / [\d.]+ / [\d.]+", text)
    assert re.search(r"\| LockGuard \| [\d.]+ ms \(p25 [\d.]+, p75 [\d.]+, n 5\)", text)
    assert "**Overlaps over all runs: 0**" in text
    assert "Errors" not in text
    assert "**1 per task**" in text
    assert "Afterwards: **0 sessions** and **0 advisory locks** left" in text
    # A SIGKILLed holder's lock is taken by the contender before the cap, with and without the provider.
    for holder in ("airflow-pglock", "PostgreSQL defaults"):
        assert re.search(rf"\| SIGKILL \| {holder} \| [\d.]+ s \(p25", text), holder
    # `locks` listed every held lock.
    assert "10 locks -> 10, 100 locks -> 100" in text
    assert "### The first lock statement, part by part" in text  # what each part of it costs


@pytest.mark.slow
def test_quick_end_to_end_section(tmp_path: Path) -> None:
    text = run_quick(tmp_path, "e2e")
    assert "## 6. End to end through Airflow" in text
    assert "Not measured" not in text
    assert "| guarded `@task.advisory_lock` |" in text and "| success 1 |" in text
    # 3 tenants, 1 of them held by another session: 1 skipped, 2 exported + the upstream task succeeded.
    assert "| guarded | " in text and "skipped 1, success 3" in text
    assert "| skipped 1, success 3 | met |" in text  # the summary checks it too


@pytest.mark.slow
def test_quick_capacity_section(tmp_path: Path) -> None:
    text = run_quick(tmp_path, "capacity")
    assert "## 7. Capacity of one lock database" in text
    assert "**60 lock sessions** and **60 granted advisory locks**" in text  # one slot per running guarded task
    assert "**1 slot per running guarded task**" in text
    # doctor's connections check: one holder below and at each threshold, as the thresholds say.
    assert "Every stage as expected: **yes**." in text
    assert re.search(r"\| \d+ \| \d+ of \d+ \(4\d\.\d+%\) \| \d+ \| ok \| ok \|", text)
    assert re.search(r"\| \d+ \| \d+ of \d+ \(5\d\.\d+%\) \| \d+ \| warning \| warning \|", text)
    assert re.search(r"\| \d+ \| \d+ of \d+ \(8\d\.\d+%\) \| \d+ \| problem \| problem \|", text)
    assert re.search(r"\| USS \(private pages.*\| [\d.]+ MiB \(p25", text)
    # Both readers saw every held lock: `locks` and the UI's JSON through a real api-server.
    assert "`locks` listed 60 of the 60 capacity locks; the UI's JSON 60." in text
    assert "Afterwards, all released: **0 sessions** and **0 advisory locks** left" in text
    assert "Errors" not in text


def test_quick_round_trips_section(tmp_path: Path) -> None:
    text = run_quick(tmp_path, "round_trips")
    assert "## 8. Round trips, and their cost on a network" in text
    assert re.search(r"\| floor \(raw psycopg[^|]*\| 5 \| \+0 \|", text)
    assert re.search(r"\| LockGuard \(named key[^|]*\| \d+ \| \+\d+ \|", text)
    assert "| Round trips of a guarded execution over the floor | +0 |" in text  # in the summary


def test_quick_wakeups_section(tmp_path: Path) -> None:
    """Real triggers under asyncio, real releases: every waiter woken, one shared connection, no stall reported."""
    text = run_quick(tmp_path, "wakeups")
    assert "## 9. Wake-ups of deferred waits" in text
    for label in ("provider release (announced)", "foreign release (plain psycopg session)"):
        assert re.search(rf"\| {re.escape(label)} \| 1 s \| \d+ ms \| \d+ ms \| \d+ ms \| 3 \| 0 \|", text), label
    assert re.search(r"\| foreign release, poll = the sensor's default poke_interval \| 2 s \| .* \| 3 \| 0 \|", text)
    assert "| connections named `airflow-pglock wakeups` (max seen) | 1 |" in text
    assert "| other connections of the waiting process (max seen) | 0 |" in text
    assert "(10 of 10 fired `free`)" in text
    assert "Target: at most 2 connections: **met** (1)." in text
    assert "| Connections of 10 waiting triggers | <= 2 | 1 | met |" in text  # in the summary
    summary_row = "| Deferred wait woken after a provider release (trigger p95; the resumed task: section 9) | <= 1 s |"
    assert summary_row in text
