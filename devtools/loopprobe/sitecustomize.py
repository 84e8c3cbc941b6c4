"""Event-loop probe for ``airflow triggerer``: what ran on the loop when it stalled.

Loaded as ``sitecustomize`` (``PYTHONPATH=devtools/loopprobe``) when ``PGLOCK_LOOP_PROBE``
names a file; otherwise it does nothing. Only a process whose command line says
``triggerer`` is probed, and only its event loops (the trigger runner that the triggerer
forks: its async thread is the one Airflow's watchdog times). Standard library only.

Written to the file, one JSON object a line:

* ``slow_callback``: one callback that ran longer than ``PGLOCK_LOOP_PROBE_CALLBACK_MS``
  (default 50): wall, loop-thread CPU and GC seconds, ``cpu_wait`` (seconds the loop
  thread was ready to run but the OS ran other processes, outside garbage collections: its
  run-queue wait, from ``/proc/self/task/<tid>/schedstat``), its group (``trigger dag/task`` for a trigger's task,
  else the coroutine's name) and where its task waits after it;
* ``slow_iteration``: one turn of the loop whose callbacks ran longer than
  ``PGLOCK_LOOP_PROBE_MS`` (default 150) in total: wall, main-thread CPU and GC seconds,
  the number of callbacks, per group [group, callbacks, wall, GC, cpu_wait], the slowest ones, and
  the main thread's stacks sampled meanwhile (a thread samples them every 5 ms; it gets
  the GIL when the main thread lets go of it, so blocking calls are over-represented);
* ``stall``: a 0.1 s sleep that ended late, as Airflow's ``block_watchdog`` measures it
  (wall, main-thread CPU and run-queue wait, whole-process CPU, load average): CPU near the wall means work
  on the loop; CPU far below it means the process was not running (other processes
  had the cores) or the loop waited in a blocking call;
* ``gc``: a garbage collection longer than 20 ms (generation, seconds).

``PGLOCK_LOOP_PROBE_FREEZE=1`` also calls ``gc.freeze()`` when the loop starts (after the
runner's imports), the experiment for a triggerer that froze its start-up heap.

The CPU numbers tell the causes apart: code on the loop costs loop-thread CPU, a busy
machine costs run-queue wait, a blocking call costs wall time only.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import sys
import threading
import time

PROBE_FILE = os.environ.get("PGLOCK_LOOP_PROBE", "")
SLOW = float(os.environ.get("PGLOCK_LOOP_PROBE_MS", "150")) / 1000
SAMPLE_EVERY = 0.005
STALL = 0.2
CALLBACK = float(os.environ.get("PGLOCK_LOOP_PROBE_CALLBACK_MS", "50")) / 1000
TICK = 0.1


class RunQueueClock:
    """Per thread: its run-queue wait so far (seconds, from its ``schedstat``; 0.0 where Linux
    has none), and the part of it inside garbage collections (their wall time counts it already)."""

    def __init__(self) -> None:
        self._threads = threading.local()

    def read(self) -> float:
        fd = getattr(self._threads, "fd", None)
        try:
            if fd is None:
                fd = self._threads.fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
            return int(os.pread(fd, 128, 0).split()[1]) / 1e9 if fd >= 0 else 0.0
        except (OSError, IndexError, ValueError):
            self._threads.fd = -1
            return 0.0

    def outside_gc(self) -> float:
        return self.read() - getattr(self._threads, "in_gc", 0.0)

    def gc_started(self) -> None:
        self._threads.gc_from = self.read()

    def gc_ended(self) -> None:
        start = getattr(self._threads, "gc_from", None)
        if start is not None:
            self._threads.in_gc = getattr(self._threads, "in_gc", 0.0) + self.read() - start
            self._threads.gc_from = None


def _write(record: dict) -> None:
    record = {"pid": os.getpid(), "t": round(time.time(), 3), **record}
    with open(PROBE_FILE, "a") as out:
        out.write(json.dumps(record, default=str) + "\n")


def _frames(frame, limit: int = 30) -> list[str]:
    out = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        path = code.co_filename
        for marker in ("site-packages/", "lib/python3"):
            if marker in path:
                path = path.split(marker, 1)[1]
                break
        out.append(f"{path}:{frame.f_lineno}:{code.co_name}")
        frame = frame.f_back
    return out


def _awaiting(task) -> str:
    """The task's name and the chain of coroutines it waits in now."""
    names = []
    coro = task.get_coro() if hasattr(task, "get_coro") else None
    while coro is not None and len(names) < 8:
        names.append(getattr(coro, "__qualname__", type(coro).__name__))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return f"{task.get_name()} [{' > '.join(names)}]"


def _group(task) -> str:
    """ "trigger dag/task" for a trigger's task (named "dag/run/task/map/try (ID n)"), else its coroutine."""
    name = task.get_name()
    parts = name.split("/")
    if " (ID " in name and len(parts) >= 3:
        return f"trigger {parts[0]}/{parts[2]}"
    return getattr(task.get_coro(), "__qualname__", "?")


def _describe(handle, detail: bool) -> tuple[str, str]:
    """The callback's group (a trigger, or a coroutine or function name), and with ``detail`` where its task waits."""
    callback = getattr(handle, "_callback", None)
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        return _group(owner), _awaiting(owner) if detail else ""
    name = getattr(callback, "__qualname__", type(callback).__name__)
    return name, name


class Probe:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.main = threading.main_thread().ident
        self.samples: collections.deque[tuple[float, tuple[str, ...]]] = collections.deque(maxlen=4000)
        self.iteration: list[tuple[float, float, float, float, tuple[str, str]]] = []
        self.run_queue = RunQueueClock()
        self.iteration_start = time.monotonic()
        self.gc_start = 0.0
        self.gc_total = 0.0
        threading.Thread(target=self._sample, name="loop probe sampler", daemon=True).start()
        gc.callbacks.append(self._gc)
        if os.environ.get("PGLOCK_LOOP_PROBE_FREEZE"):  # the experiment: what Airflow's own gc.freeze() would do here
            gc.freeze()
        _write({"kind": "started", "argv": sys.argv, "frozen": gc.get_freeze_count()})

    def _sample(self) -> None:
        while True:
            time.sleep(SAMPLE_EVERY)
            frame = sys._current_frames().get(self.main)
            if frame is not None:
                self.samples.append((time.monotonic(), tuple(_frames(frame))))

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.gc_start = time.perf_counter()
            self.run_queue.gc_started()
        elif self.gc_start:
            self.run_queue.gc_ended()
            took = time.perf_counter() - self.gc_start
            self.gc_total += took
            if took > 0.02:
                _write({"kind": "gc", "generation": info.get("generation"), "seconds": round(took, 3)})

    def stacks(self, since: float, until: float) -> list[tuple[int, str]]:
        """The sampled stacks of the main thread in [since, until], most frequent first (innermost 12 frames)."""
        counts: collections.Counter[str] = collections.Counter()
        for at, stack in list(self.samples):
            if since <= at <= until and not (stack and "selectors.py" in stack[0]):
                counts["\n".join(stack[:12])] += 1
        return counts.most_common(4)

    def end_iteration(self) -> None:
        handles, self.iteration = self.iteration, []
        busy = sum(handle[0] for handle in handles)
        if busy < SLOW:
            return
        start, end = self.iteration_start, time.monotonic()
        groups: dict[str, list[float]] = {}
        slowest = sorted(handles, key=lambda h: h[0], reverse=True)[:6]
        for wall, _cpu, collected, waited, (group, _) in handles:
            count_wall_gc_wait = groups.setdefault(group, [0, 0.0, 0.0, 0.0])
            count_wall_gc_wait[0] += 1
            count_wall_gc_wait[1] += wall
            count_wall_gc_wait[2] += collected
            count_wall_gc_wait[3] += waited
        _write(
            {
                "kind": "slow_iteration",
                "busy_wall": round(busy, 3),
                "busy_cpu": round(sum(handle[1] for handle in handles), 3),
                "gc": round(sum(handle[2] for handle in handles), 3),
                "cpu_wait": round(sum(handle[3] for handle in handles), 3),
                "callbacks": len(handles),
                "by_group": sorted(
                    ([g, int(n), round(w, 4), round(c, 4), round(q, 4)] for g, (n, w, c, q) in groups.items()),
                    key=lambda r: -r[2],
                )[:8],
                "slowest": [(round(w, 4), round(c, 4), round(g, 4), round(q, 4), d[0]) for w, c, g, q, d in slowest],
                "stacks": self.stacks(start, end),
            }
        )

    async def tick(self) -> None:
        while True:
            wall, cpu, process, waited = time.monotonic(), time.thread_time(), os.times(), self.run_queue.read()
            await asyncio.sleep(TICK)
            elapsed = time.monotonic() - wall
            if elapsed > STALL:
                now = os.times()
                _write(
                    {
                        "kind": "stall",
                        "wall": round(elapsed, 3),
                        "main_thread_cpu": round(time.thread_time() - cpu, 3),
                        "main_thread_cpu_wait": round(self.run_queue.read() - waited, 3),
                        "process_cpu": round((now.user + now.system) - (process.user + process.system), 3),
                        "loadavg": os.getloadavg(),
                        "tasks": len(asyncio.all_tasks()),
                        "samples": sum(1 for at, _ in list(self.samples) if at >= wall),
                        "samples_expected": int(elapsed / SAMPLE_EVERY),
                        "stacks": self.stacks(wall, time.monotonic()),
                    }
                )


_PROBE: Probe | None = None


def _install() -> None:
    run_once = asyncio.base_events.BaseEventLoop._run_once
    handle_run = asyncio.events.Handle._run

    def probed_run_once(loop) -> None:
        global _PROBE
        if _PROBE is None or _PROBE.pid != os.getpid():
            _PROBE = Probe()
            loop.create_task(_PROBE.tick(), name="loop probe ticker")
        _PROBE.end_iteration()
        _PROBE.iteration_start = time.monotonic()
        run_once(loop)

    def probed_handle_run(handle) -> None:
        if _PROBE is None or _PROBE.pid != os.getpid():
            return handle_run(handle)
        before = _describe(handle, False)
        wall, cpu, collected = time.perf_counter(), time.thread_time(), _PROBE.gc_total
        waited = _PROBE.run_queue.outside_gc()
        try:
            return handle_run(handle)
        finally:
            took = time.perf_counter() - wall
            waited = _PROBE.run_queue.outside_gc() - waited
            spent = (took, time.thread_time() - cpu, _PROBE.gc_total - collected, waited)
            _PROBE.iteration.append((*spent, before))
            if took > CALLBACK:
                _write(
                    {
                        "kind": "slow_callback",
                        "wall": round(spent[0], 4),
                        "cpu": round(spent[1], 4),
                        "gc": round(spent[2], 4),
                        "cpu_wait": round(spent[3], 4),
                        "group": before[0],
                        "now": _describe(handle, True)[1],  # where its task waits after the step
                    }
                )

    asyncio.base_events.BaseEventLoop._run_once = probed_run_once  # type: ignore[method-assign]
    asyncio.events.Handle._run = probed_handle_run  # type: ignore[method-assign]


if PROBE_FILE and any("triggerer" in arg for arg in sys.argv):
    _install()
