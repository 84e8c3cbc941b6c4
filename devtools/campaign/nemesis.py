"""The nemesis: the faults the campaign injects, at random times, each recorded with its span.

Every kind runs at least once per campaign (a shuffled round of all kinds first), then kinds
are drawn at random, with a quiet gap of 1 to 3 s between two faults. What each kind does:

* ``sigkill``: SIGKILL a worker process (the runner starts it again);
* ``sigstop-short`` / ``sigstop-long``: freeze a worker for 0.3-0.5 / 1.5-2.5 leases;
* ``sigstop-waiter``: freeze, for 2-2.5 leases, a worker whose session waits for a busy key (it
  may be granted the key while frozen), or any worker when none waits within
  :data:`WAITER_SEARCH_SECONDS`;
* ``netcut``: cut a network namespace (a "host" of workers) off for 1.5-2.5 leases, then heal it;
* ``terminate``: ``pg_terminate_backend`` of a session that holds an advisory lock (the fault's
  ``terminated`` says whether it signalled the backend, or found it gone);
* ``cancel``: ``pg_cancel_backend`` of every campaign session (a running batch, wait or unlock);
* ``restart-fast`` / ``restart-immediate``: the primary restarted (``pg_ctl -m fast|immediate``);
* ``failover``: the primary stopped at once, the synchronous standby promoted;
* ``failover-frozen``: the primary frozen (SIGSTOP, as a hung machine), the standby promoted at
  once, the frozen one killed two leases later.

While a freeze or a cut lasts past :func:`release_bound`, the nemesis looks, at that moment, for
advisory locks still granted to the sessions of the workers it hit (by their
``application_name``): the server must have ended them by then (invariant 7: a dead holder's lock
is freed within a bounded time). What it finds is the fault's ``kept`` (rule 9 of the checker).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from devtools.campaign.history import HistoryWriter
from devtools.campaign.servers import FailoverPair
from devtools.campaign.workers import WAIT_TIMEOUT

FAULT_KINDS = (
    "sigkill",
    "sigstop-short",
    "sigstop-long",
    "sigstop-waiter",
    "netcut",
    "terminate",
    "cancel",
    "restart-fast",
    "restart-immediate",
    "failover",
    "failover-frozen",
)
#: Faults aimed at one worker process (or a host of them): they affect its runs only.
WORKER_FAULTS = frozenset({"sigkill", "sigstop-short", "sigstop-long", "sigstop-waiter", "netcut"})
#: How long the nemesis looks for a worker whose session waits for a busy key before it freezes
#: another one instead.
WAITER_SEARCH_SECONDS = 3.0
#: A worker's session name: ``campaign w<index>``, and the deferred kind's hold hub ``... holds``.
_WORKER_SESSION = re.compile(r"^campaign w(\d+)(?: |$)")


def release_bound(lease: float) -> float:
    """Seconds after a worker froze or was cut off by which the server has freed every advisory
    lock of its sessions: the lease after its last statement (``idle_session_timeout``, or
    ``idle_in_transaction_session_timeout`` for a wait's transaction or a transaction lock), where
    that statement may be a wait for a busy key that lasts up to :data:`WAIT_TIMEOUT` (and may be
    granted), and a second for the server's timers and the look itself."""
    return lease + WAIT_TIMEOUT + 1.0


@dataclass
class Injected:
    """What a fault did: its target, the process (or backend) ids it hit, a note, and, for a freeze
    or a cut that lasted past :func:`release_bound`, the advisory locks its workers' sessions still
    held then (``None``: not looked at)."""

    target: str
    pids: list[int]
    detail: str = ""
    kept: list[str] | None = None
    began: float | None = None  # when the fault itself began, after a search for its target (default: the call)
    waiter: bool | None = None  # sigstop-waiter: whether its target was found waiting for a key
    #: sigstop-waiter: the ``pg_locks`` coordinates (``classid/objid/objsubid``) of the keys its target waited for
    waited: list[str] | None = None
    terminated: bool | None = None  # terminate: whether pg_terminate_backend() signalled the backend


@dataclass
class Target:
    """A worker the nemesis may aim at: its index, its process id now, its namespace."""

    index: int
    pid: int
    netns: str | None


class Nemesis:
    """Injects faults on the pair, the workers and the namespaces.

    :param pair: the lock database.
    :param lease: the workers' lease (faults are sized by it).
    :param targets: the live workers (asked for at each fault: a killed one is restarted).
    :param namespaces: the namespaces by name (``cut`` / ``restore``), possibly none.
    :param history: where each fault is recorded.
    :param seed: the random choices' seed.
    """

    def __init__(
        self,
        pair: FailoverPair,
        lease: float,
        targets: Callable[[], Sequence[Target]],
        namespaces: dict[str, Any],
        history: HistoryWriter,
        seed: int,
    ) -> None:
        self.pair = pair
        self.lease = lease
        self.targets = targets
        self.namespaces = namespaces
        self.history = history
        self.rng = random.Random(seed)
        self.counts: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)

    def kinds(self) -> list[str]:
        """The kinds this set-up can inject (``netcut`` needs a namespace with workers in it)."""
        return [kind for kind in FAULT_KINDS if kind != "netcut" or self.namespaces]

    def run(self, seconds: float, stop: Callable[[], bool]) -> None:
        """Inject faults for ``seconds``: every kind once first (even when that takes longer), then
        at random."""
        deadline = time.monotonic() + seconds
        first = self.kinds()
        self.rng.shuffle(first)
        while (first or time.monotonic() < deadline) and not stop():
            time.sleep(self.rng.uniform(1.0, 3.0))
            kind = first.pop() if first else self.rng.choice(self.kinds())
            self.inject(kind)

    def inject(self, kind: str) -> None:
        called = time.time()
        done: Injected = getattr(self, "_" + kind.replace("-", "_"))()
        self.counts[kind] += 1
        looked: dict[str, Any] = {} if done.kept is None else {"kept": done.kept}
        if done.waiter is not None:
            looked["waiter"] = done.waiter
        if done.waited is not None:
            looked["waited"] = done.waited
        if done.terminated is not None:
            looked["terminated"] = done.terminated
        self.history.emit(
            "fault",
            kind=kind,
            start=called if done.began is None else done.began,
            end=time.time(),
            target=done.target,
            pids=done.pids,
            detail=done.detail,
            **looked,
        )

    # ----------------------------------------------------------------- on workers

    def _worker(self) -> Target:
        return self.rng.choice(list(self.targets()))

    def _sigkill(self) -> Injected:
        target = self._worker()
        with contextlib.suppress(ProcessLookupError):
            os.kill(target.pid, signal.SIGKILL)
        return Injected(f"w{target.index}", [target.pid])

    def _freeze(self, factor: tuple[float, float], target: Target | None = None, note: str = "") -> Injected:
        target = target or self._worker()
        seconds = self.rng.uniform(*factor) * self.lease
        began = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(target.pid, signal.SIGSTOP)
        try:
            kept = self._last(seconds, [target.index])
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target.pid, signal.SIGCONT)
        return Injected(f"w{target.index}", [target.pid], f"{seconds:.2f} s{note}", kept, began)

    def _sigstop_short(self) -> Injected:
        return self._freeze((0.3, 0.5))

    def _sigstop_long(self) -> Injected:
        return self._freeze((1.5, 2.5))

    def _sigstop_waiter(self) -> Injected:
        found = self._waiter()
        waiter, waited = found if found is not None else (None, None)
        note = ", a waiter" if waiter is not None else ", no worker waited: any one"
        return replace(self._freeze((2.0, 2.5), waiter, note), waiter=waiter is not None, waited=waited)

    def _waiter(self) -> tuple[Target, list[str]] | None:
        """A live worker whose session waits for a busy key, found within :data:`WAITER_SEARCH_SECONDS`,
        and the ``pg_locks`` coordinates of what it waits for (it may be granted that while frozen: the
        history then has no event of it, and the checker's rule 11 needs the key)."""
        query = (
            "SELECT a.application_name, l.classid, l.objid, l.objsubid FROM pg_locks l"
            " JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND NOT l.granted"
        )
        deadline = time.monotonic() + WAITER_SEARCH_SECONDS
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.pair.primary_dsn(), autocommit=True) as conn:
            while time.monotonic() < deadline:
                waiting: dict[int, set[str]] = {}
                for name, classid, objid, objsubid in conn.execute(query).fetchall():
                    matched = _WORKER_SESSION.match(name or "")
                    if matched is not None:
                        waiting.setdefault(int(matched.group(1)), set()).add(f"{classid}/{objid}/{objsubid}")
                found = [target for target in self.targets() if target.index in waiting]
                if found:
                    target = self.rng.choice(found)
                    return target, sorted(waiting[target.index])
                time.sleep(0.05)
        return None

    def _netcut(self) -> Injected:
        name = self.rng.choice(sorted(self.namespaces))
        inside = [target for target in self.targets() if target.netns == name]
        seconds = self.rng.uniform(1.5, 2.5) * self.lease
        self.namespaces[name].cut()
        try:
            kept = self._last(seconds, [target.index for target in inside])
        finally:
            self.namespaces[name].restore()
        return Injected(name, [target.pid for target in inside], f"{seconds:.2f} s", kept)

    def _last(self, seconds: float, workers: Sequence[int]) -> list[str] | None:
        """Let a freeze or a cut of ``workers`` last ``seconds``; when that reaches past
        :func:`release_bound`, the advisory locks their sessions still held at that bound."""
        began = time.monotonic()
        bound = release_bound(self.lease)
        if seconds < bound + 0.2:
            time.sleep(seconds)
            return None
        time.sleep(bound)
        kept = self.held_by(workers)
        time.sleep(max(0.0, seconds - (time.monotonic() - began)))
        return kept

    def held_by(self, workers: Sequence[int]) -> list[str]:
        """The advisory locks granted to the sessions of ``workers``; a look that fails is one too
        (the check must not pass unseen)."""
        query = (
            "SELECT a.application_name, l.pid, l.classid, l.objid, l.objsubid, a.state"
            " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted"
        )
        try:
            with psycopg.connect(self.pair.primary_dsn(), autocommit=True, connect_timeout=5) as conn:
                rows = conn.execute(query).fetchall()
        except psycopg.Error as error:
            return [f"the look failed: {error}"]
        wanted = set(workers)
        kept = []
        for name, pid, classid, objid, objsubid, state in rows:
            match = _WORKER_SESSION.match(name or "")
            if match is not None and int(match.group(1)) in wanted:
                kept.append(f"{name!r} (backend {pid}, {state}) holds ({classid}, {objid}, {objsubid})")
        return kept

    # ----------------------------------------------------------------- on the server

    def _backends(self, holding: bool) -> list[int]:
        query = (
            "SELECT DISTINCT a.pid FROM pg_stat_activity a"
            + (" JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted" if holding else "")
            + " WHERE a.application_name LIKE 'campaign%%' AND a.pid <> pg_backend_pid()"
        )
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.pair.primary_dsn(), autocommit=True) as conn:
            return [int(row[0]) for row in conn.execute(query).fetchall()]
        return []

    def _terminate(self) -> Injected:
        deadline = time.monotonic() + 3
        holding = self._backends(holding=True)
        while not holding and time.monotonic() < deadline:
            time.sleep(0.1)
            holding = self._backends(holding=True)
        if not holding:
            return Injected("server", [], "no session held a lock")
        pid = self.rng.choice(holding)
        began = time.time()
        with psycopg.connect(self.pair.primary_dsn(), autocommit=True) as conn:
            row = conn.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()
        # False: the backend had gone already (its session ended between the look and the signal):
        # nothing was terminated, and the checker's rule 12 must not count on a loss.
        terminated = bool(row is not None and row[0])
        return Injected(
            f"backend {pid}", [pid], "terminated" if terminated else "already gone", began=began, terminated=terminated
        )

    def _cancel(self) -> Injected:
        pids = self._backends(holding=False)
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.pair.primary_dsn(), autocommit=True) as conn:
            for pid in pids:
                conn.execute("SELECT pg_cancel_backend(%s)", [pid])
        return Injected("server", pids, f"{len(pids)} sessions")

    def _restart_fast(self) -> Injected:
        self.pair.restart("fast")
        return Injected("server", [], f"port {self.pair.primary.port}")

    def _restart_immediate(self) -> Injected:
        self.pair.restart("immediate")
        return Injected("server", [], f"port {self.pair.primary.port}")

    def _failover(self) -> Injected:
        old = self.pair.primary.port
        self.pair.failover(freeze=False)
        return Injected("server", [], f"{old} -> {self.pair.primary.port}")

    def _failover_frozen(self) -> Injected:
        old = self.pair.primary.port
        self.pair.failover(freeze=True, frozen_seconds=2 * self.lease)
        return Injected("server", [], f"{old} frozen -> {self.pair.primary.port}")
