"""Shared parts of the randomized lifetime races (test_lifetime_race*.py).

* :class:`Span`: one holder inside a protected section, by the database clock, and the
  overlap rule every race checks (:func:`overlap_violations`);
* :func:`lost_hold_violations`: a holder whose session was terminated while it was inside
  must not report success;
* faults sent from outside the holder: :class:`Fault` (terminate the session at a random
  moment, cancel a batch statement while it runs);
* :func:`untracked_locks`: advisory locks a session holds on the server but does not track.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from airflow_pglock.keys import LockKey
from tests.faults.conftest import FaultServer


def race_seed() -> int:
    """``PGLOCK_RACE_SEED`` or a fresh random seed (printed by the caller, to replay a failure)."""
    import random

    return int(os.environ.get("PGLOCK_RACE_SEED") or random.SystemRandom().randrange(1 << 30))


class Quiet:
    """The guards' log lines, kept out of the test output (hundreds of rounds)."""

    def _line(self, *args: Any, **kwargs: Any) -> None:
        pass

    info = warning = error = debug = _line


QUIET = Quiet()


@dataclass(frozen=True)
class Span:
    """A worker inside the section protected by ``key`` from ``enter`` to ``exit`` (None: it
    never recorded leaving). ``capacity``: how many holders its policy admits at once (1, or
    a pool's N)."""

    worker: int
    key: str
    capacity: int
    enter: dt.datetime
    exit: dt.datetime | None


def overlap_violations(spans: list[Span], succeeded: set[int]) -> list[str]:
    """Each entry into a section beyond what the holders inside admit.

    When a worker enters, the older holders of the same key that are still inside and report
    success must number fewer than the smallest capacity among them and the entrant: an
    overlap is allowed only where the older holder's run reported lost or failed (it lost its
    lock, which is how the newer one could take it). A pool's N holders are no overlap.
    """
    ordered = sorted(spans, key=lambda span: (span.enter, span.worker))
    problems = []
    for index, span in enumerate(ordered):
        inside = [
            older
            for older in ordered[:index]
            if older.key == span.key
            and older.worker != span.worker
            and older.worker in succeeded
            and (older.exit is None or older.exit > span.enter)
        ]
        capacity = min([span.capacity] + [older.capacity for older in inside])
        if len(inside) >= capacity:
            problems.append(
                f"{span.key!r}: worker {span.worker} entered at {span.enter:%H:%M:%S.%f} while "
                f"{len(inside)} older holder(s) that report success were inside (workers "
                f"{sorted(older.worker for older in inside)}; admitted at once: {capacity})"
            )
    return problems


@dataclass(frozen=True)
class Termination:
    """``pg_terminate_backend`` ended a worker's session at ``at`` (database clock)."""

    worker: int
    at: dt.datetime


def cut_by_termination(spans: list[Span], terminations: list[Termination]) -> dict[int, list[str]]:
    """Workers whose session was terminated before they left a protected section (they were
    inside without the lock), with those sections."""
    cut: dict[int, list[str]] = {}
    for end in terminations:
        keys = sorted({s.key for s in spans if s.worker == end.worker and (s.exit is None or end.at < s.exit)})
        if keys:
            cut[end.worker] = keys
    return cut


def lost_hold_violations(spans: list[Span], terminations: list[Termination], succeeded: set[int]) -> list[str]:
    """Workers that report success although their session was terminated inside a section."""
    return [
        f"worker {worker} reports success although its session was terminated while it was inside {keys}"
        for worker, keys in cut_by_termination(spans, terminations).items()
        if worker in succeeded
    ]


def backend_start(conn: psycopg.Connection[Any], pid: int) -> dt.datetime:
    """When the backend ``pid`` started: with the pid, names that session and no later one
    (a pid is reused by later sessions)."""
    row = conn.execute("SELECT backend_start FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    assert row is not None, f"no session with pid {pid}"
    return row[0]  # type: ignore[no-any-return]


@dataclass
class Fault:
    """A fault sent from outside to one worker's lock session (a thread of its own).

    ``terminate``: ``pg_terminate_backend`` after ``delay`` s. ``cancel``: ``pg_cancel_backend``
    while a lock statement runs on that session once :meth:`arm` was called (right before a
    ``try_lock_many`` batch; polled for until :meth:`stop`). What was done is appended to
    ``terminations`` / ``cancels``.
    """

    server: FaultServer
    worker: int
    kind: str
    delay: float
    terminations: list[Termination]
    cancels: list[int]
    thread: threading.Thread | None = field(default=None, init=False)
    done: threading.Event = field(default_factory=threading.Event, init=False)
    armed: threading.Event = field(default_factory=threading.Event, init=False)

    def start(self, pid: int, started: dt.datetime) -> None:
        target = self._terminate if self.kind == "terminate" else self._cancel
        self.thread = threading.Thread(target=target, args=(pid, started), daemon=True)
        self.thread.start()

    def arm(self) -> None:
        """From now on, cancel the first lock statement seen running (the batch about to be sent)."""
        self.armed.set()

    def stop(self) -> None:
        """Stop polling for a statement to cancel (a terminate still happens at its time)."""
        self.done.set()

    def join(self, timeout: float) -> bool:
        """Whether the fault's thread has ended."""
        if self.thread is not None:
            self.thread.join(timeout)
            return not self.thread.is_alive()
        return True

    def _terminate(self, pid: int, started: dt.datetime) -> None:
        time.sleep(self.delay)
        with self.server.admin() as admin:
            row = admin.execute(
                "SELECT pg_terminate_backend(pid), clock_timestamp() FROM pg_stat_activity"
                " WHERE pid = %s AND backend_start = %s",
                [pid, started],
            ).fetchone()
        if row is not None and row[0]:
            self.terminations.append(Termination(self.worker, row[1]))

    def _cancel(self, pid: int, started: dt.datetime) -> None:
        deadline = time.monotonic() + 60  # a bound in case the worker never stops it
        with self.server.admin() as admin:  # connected before the batch: polling starts at once
            while not self.done.is_set() and time.monotonic() < deadline:
                if not self.armed.wait(0.01):
                    continue
                row = admin.execute(
                    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE pid = %s AND backend_start = %s"
                    " AND state = 'active' AND position('pg_try_advisory_lock' in query) > 0",
                    [pid, started],
                ).fetchone()
                if row is not None and row[0]:
                    self.cancels.append(self.worker)
                    return


def untracked_locks(
    side: psycopg.Connection[Any], pid: int, tracked: list[LockKey], reserved: LockKey | None = None
) -> list[tuple[int, int, int]]:
    """Advisory locks session ``pid`` holds on the server that are neither in ``tracked`` nor
    ``reserved`` (``pg_locks`` coordinates)."""
    known = {key.pg_locks for key in tracked}
    if reserved is not None:
        known.add(reserved.pg_locks)
    rows = side.execute(
        "SELECT classid::bigint, objid::bigint, objsubid::int FROM pg_locks"
        " WHERE pid = %s AND locktype = 'advisory' AND granted",
        [pid],
    ).fetchall()
    return [(row[0], row[1], row[2]) for row in rows if (row[0], row[1], row[2]) not in known]
