"""A campaign worker's stall watch records a stretch in which the machine did not run its process,
and not one in which the process worked (devtools/campaign/workers.py, ``watch_stalls``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.campaign.history import read_events
from devtools.campaign.workers import STALL_MIN

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, threading, time
from pathlib import Path
from devtools.campaign.history import HistoryWriter
from devtools.campaign.workers import watch_stalls

history = HistoryWriter(Path(sys.argv[1]), pid=0)
stop = threading.Event()
watch = threading.Thread(target=watch_stalls, args=(history, stop), daemon=True)
watch.start()
history.emit("ready")
busy = float(sys.argv[2])
if busy:  # its own work, in one C call that keeps the interpreter from the watch thread throughout
    sum(range(1_000_000))  # warm
    began = time.process_time()
    sum(range(5_000_000))
    per_million = max(time.process_time() - began, 1e-4) / 5
    began, cpu = time.monotonic(), time.process_time()
    sum(range(int(busy / per_million * 1_000_000)))
    history.emit("busy", seconds=time.monotonic() - began, cpu=time.process_time() - cpu)
time.sleep(0.3)
stop.set()
watch.join()
history.emit("done")
"""


def _watched(tmp_path: Path, busy: float, freeze: float | None) -> list[dict]:
    path = tmp_path / "w.jsonl"
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(path), str(busy)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (path.exists() and "ready" in path.read_text()):
            assert time.monotonic() < deadline and process.poll() is None, "the watched process did not start"
            time.sleep(0.02)
        if freeze is not None:
            os.kill(process.pid, signal.SIGSTOP)
            time.sleep(freeze)
            os.kill(process.pid, signal.SIGCONT)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        process.wait()
    return [e for e in read_events(tmp_path) if e["event"] == "stall"]


def test_a_process_the_machine_did_not_run_records_its_stall(tmp_path: Path) -> None:
    frozen_at = time.time()
    stalls = _watched(tmp_path, busy=0, freeze=1.5)
    assert stalls, "a 1.5 s SIGSTOP was not recorded"
    longest = max(stalls, key=lambda e: e["end"] - e["start"])
    assert longest["end"] - longest["start"] >= 1.5 and longest["start"] >= frozen_at - 1.0, stalls


def test_a_process_busy_with_its_own_work_records_no_stall(tmp_path: Path) -> None:
    """Its watch thread waits for the interpreter while the main thread works: it wakes late, but the
    process ran (the CPU it used says so). A try in which the loaded machine hardly ran the process
    (under half of the call's time) is a stall indeed, and is tried again."""
    for attempt in range(3):
        directory = tmp_path / str(attempt)
        directory.mkdir()
        stalls = _watched(directory, busy=4 * STALL_MIN, freeze=None)
        busy = next(e for e in read_events(directory) if e["event"] == "busy")
        if busy["cpu"] >= 0.5 * busy["seconds"]:
            break
    else:
        pytest.skip(f"the machine ran the busy process for under half of its call three times: {busy}")
    assert stalls == [], (stalls, busy)
    assert busy["seconds"] > 2 * STALL_MIN, busy  # the watch was kept waiting that long
