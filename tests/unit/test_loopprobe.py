"""devtools/loopprobe names what blocked an event loop, and tests/e2e/loop_check tells ours from the rest.

A real interpreter runs under the probe (as ``airflow triggerer`` does in tests/e2e): one
task named as the triggerer names a trigger's task blocks the loop 0.3 s; another
trigger's task and a plain coroutine stay quick. The e2e test's check must flag exactly
the blocking trigger, so it can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.e2e import loop_check

CALLBACK_SECONDS = 0.05  # the probe records a callback longer than this (PGLOCK_LOOP_PROBE_CALLBACK_MS)

SCRIPT = """
import asyncio, time

async def blocking_trigger():
    await asyncio.sleep(0.05)
    time.sleep(0.3)  # a synchronous call on the loop

async def quick():
    for _ in range(5):
        await asyncio.sleep(0.02)

async def main():
    await asyncio.gather(
        asyncio.create_task(blocking_trigger(), name="ours_dag/run_1/wait/0/1 (ID 1)"),
        asyncio.create_task(quick(), name="other_dag/run_1/wait/0/1 (ID 2)"),
        asyncio.create_task(quick()),
    )
    await asyncio.sleep(0.3)

asyncio.run(main())
"""


def _run_probed(tmp_path: Path) -> list[loop_check.Record]:
    out = tmp_path / "probe.jsonl"
    env = {**os.environ, "PYTHONPATH": str(loop_check.PROBE), "PGLOCK_LOOP_PROBE": str(out)}
    subprocess.run([sys.executable, "-c", SCRIPT, "triggerer"], env=env, check=True, timeout=60)
    return loop_check.read(out)


def _own_time(record: loop_check.Record) -> float:
    """A slow callback's wall time less its collections and its wait for a core."""
    return float(record["wall"]) - float(record["gc"]) - float(record["cpu_wait"])  # type: ignore[arg-type]


def test_the_probe_names_the_blocking_trigger_and_its_stall(tmp_path: Path) -> None:
    records = _run_probed(tmp_path)
    # On a loaded machine any step may end late while the OS ran other processes (its run-queue
    # wait, recorded) or the collector ran: what remains is the step's own time.
    slow = [r for r in records if r["kind"] == "slow_callback" and _own_time(r) > CALLBACK_SECONDS]
    assert [r["group"] for r in slow] == ["trigger ours_dag/wait"], records
    assert float(slow[0]["wall"]) >= 0.3 and float(slow[0]["cpu"]) < 0.1  # type: ignore[arg-type]  # a wait, not work
    stalls = [r for r in records if r["kind"] == "stall"]
    assert stalls and max(float(r["wall"]) for r in stalls) >= 0.3, records  # type: ignore[arg-type]


def test_the_e2e_check_flags_our_blocking_step_and_nothing_else(tmp_path: Path) -> None:
    records = _run_probed(tmp_path)
    flagged = loop_check.our_slow_steps(records, ["ours_dag"])
    assert flagged and all("ours_dag" in str(r) for r in flagged), flagged
    assert loop_check.our_slow_steps(records, ["other_dag"]) == []  # the quick trigger is never blamed


STARVED_SCRIPT = """
import asyncio, os, sys, time

async def starved_trigger():
    await asyncio.sleep(0.05)
    end = time.thread_time() + 0.01  # 10 ms of work, while a busier process has the one core
    while time.thread_time() < end:
        pass

async def blocking_trigger():
    await asyncio.sleep(0.05)
    time.sleep(0.3)

async def main():
    os.nice(19)  # the competitor (nice 0) gets ~98% of the core: a 10 ms step takes ~0.6 s of wall time
    await asyncio.create_task(starved_trigger(), name="starved_dag/run_1/wait/0/1 (ID 1)")
    os.kill(int(sys.argv[2]), 9)
    await asyncio.create_task(blocking_trigger(), name="blocking_dag/run_1/wait/0/1 (ID 2)")
    await asyncio.sleep(0.3)

asyncio.run(main())
"""


def test_a_step_that_waited_for_a_core_is_not_blamed_but_a_blocking_call_still_is(tmp_path: Path) -> None:
    """On a loaded machine a step of ours can take long while the process was not running.

    The probe reads the loop thread's run-queue wait (``/proc/.../schedstat``): time the OS
    gave the core to other processes is not our code blocking the loop, a blocking call is.
    """
    if not Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").exists():
        pytest.skip("this kernel has no per-thread schedstat (CONFIG_SCHED_INFO): no run-queue wait to read")
    core = sorted(os.sched_getaffinity(0))[0]
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(competitor.pid, {core})
        out = tmp_path / "probe.jsonl"
        env = {**os.environ, "PYTHONPATH": str(loop_check.PROBE), "PGLOCK_LOOP_PROBE": str(out)}
        probed = subprocess.Popen(
            [sys.executable, "-c", STARVED_SCRIPT, "triggerer", str(competitor.pid)],
            env=env,
            preexec_fn=lambda: os.sched_setaffinity(0, {core}),
        )
        assert probed.wait(timeout=60) == 0
    finally:
        competitor.kill()
        competitor.wait()
    records = loop_check.read(out)
    starved = [r for r in records if r["kind"] == "slow_callback" and r["group"] == "trigger starved_dag/wait"]
    assert starved and float(starved[0]["wall"]) > 2 * loop_check.OURS_MAX_STEP, records  # type: ignore[arg-type]
    assert float(starved[0]["cpu_wait"]) > float(starved[0]["wall"]) - loop_check.OURS_MAX_STEP  # type: ignore[arg-type]
    assert loop_check.our_slow_steps(records, ["starved_dag"]) == []
    assert loop_check.our_slow_steps(records, ["blocking_dag"]) != []
