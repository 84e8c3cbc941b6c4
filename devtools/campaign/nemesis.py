"""The nemesis: the faults the campaign injects, at random times, each recorded with its span.

Every kind runs at least once per campaign (a shuffled round of all kinds first), then kinds
are drawn at random, with a quiet gap of 1 to 3 s between two faults. What each kind does:

* ``sigkill``: SIGKILL a worker process (the runner starts it again);
* ``sigstop-short`` / ``sigstop-long``: freeze a worker for 0.3-0.5 / 1.5-2.5 leases;
* ``netcut``: cut a network namespace (a "host" of workers) off for 1.5-2.5 leases, then heal it;
* ``terminate``: ``pg_terminate_backend`` of a session that holds an advisory lock;
* ``cancel``: ``pg_cancel_backend`` of every campaign session (a running batch, wait or unlock);
* ``restart-fast`` / ``restart-immediate``: the primary restarted (``pg_ctl -m fast|immediate``);
* ``failover``: the primary stopped at once, the synchronous standby promoted;
* ``failover-frozen``: the primary frozen (SIGSTOP, as a hung machine), the standby promoted at
  once, the frozen one killed two leases later.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from devtools.campaign.history import HistoryWriter
from devtools.campaign.servers import FailoverPair

FAULT_KINDS = (
    "sigkill",
    "sigstop-short",
    "sigstop-long",
    "netcut",
    "terminate",
    "cancel",
    "restart-fast",
    "restart-immediate",
    "failover",
    "failover-frozen",
)
#: Faults aimed at one worker process (or a host of them): they affect its runs only.
WORKER_FAULTS = frozenset({"sigkill", "sigstop-short", "sigstop-long", "netcut"})


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
        """Inject faults for ``seconds``: every kind once first, then at random."""
        deadline = time.monotonic() + seconds
        first = self.kinds()
        self.rng.shuffle(first)
        while time.monotonic() < deadline and not stop():
            time.sleep(self.rng.uniform(1.0, 3.0))
            kind = first.pop() if first else self.rng.choice(self.kinds())
            self.inject(kind)

    def inject(self, kind: str) -> None:
        start = time.time()
        target, pids, detail = getattr(self, "_" + kind.replace("-", "_"))()
        self.counts[kind] += 1
        self.history.emit("fault", kind=kind, start=start, end=time.time(), target=target, pids=pids, detail=detail)

    # ----------------------------------------------------------------- on workers

    def _worker(self) -> Target:
        return self.rng.choice(list(self.targets()))

    def _sigkill(self) -> tuple[str, list[int], str]:
        target = self._worker()
        with contextlib.suppress(ProcessLookupError):
            os.kill(target.pid, signal.SIGKILL)
        return f"w{target.index}", [target.pid], ""

    def _freeze(self, factor: tuple[float, float]) -> tuple[str, list[int], str]:
        target = self._worker()
        seconds = self.rng.uniform(*factor) * self.lease
        with contextlib.suppress(ProcessLookupError):
            os.kill(target.pid, signal.SIGSTOP)
        time.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):
            os.kill(target.pid, signal.SIGCONT)
        return f"w{target.index}", [target.pid], f"{seconds:.2f} s"

    def _sigstop_short(self) -> tuple[str, list[int], str]:
        return self._freeze((0.3, 0.5))

    def _sigstop_long(self) -> tuple[str, list[int], str]:
        return self._freeze((1.5, 2.5))

    def _netcut(self) -> tuple[str, list[int], str]:
        name = self.rng.choice(sorted(self.namespaces))
        inside = [target.pid for target in self.targets() if target.netns == name]
        seconds = self.rng.uniform(1.5, 2.5) * self.lease
        self.namespaces[name].cut()
        try:
            time.sleep(seconds)
        finally:
            self.namespaces[name].restore()
        return name, inside, f"{seconds:.2f} s"

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

    def _terminate(self) -> tuple[str, list[int], str]:
        deadline = time.monotonic() + 3
        holding = self._backends(holding=True)
        while not holding and time.monotonic() < deadline:
            time.sleep(0.1)
            holding = self._backends(holding=True)
        if not holding:
            return "server", [], "no session held a lock"
        pid = self.rng.choice(holding)
        with psycopg.connect(self.pair.primary_dsn(), autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", [pid])
        return f"backend {pid}", [pid], ""

    def _cancel(self) -> tuple[str, list[int], str]:
        pids = self._backends(holding=False)
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.pair.primary_dsn(), autocommit=True) as conn:
            for pid in pids:
                conn.execute("SELECT pg_cancel_backend(%s)", [pid])
        return "server", pids, f"{len(pids)} sessions"

    def _restart_fast(self) -> tuple[str, list[int], str]:
        self.pair.restart("fast")
        return "server", [], f"port {self.pair.primary.port}"

    def _restart_immediate(self) -> tuple[str, list[int], str]:
        self.pair.restart("immediate")
        return "server", [], f"port {self.pair.primary.port}"

    def _failover(self) -> tuple[str, list[int], str]:
        old = self.pair.primary.port
        self.pair.failover(freeze=False)
        return "server", [], f"{old} -> {self.pair.primary.port}"

    def _failover_frozen(self) -> tuple[str, list[int], str]:
        old = self.pair.primary.port
        self.pair.failover(freeze=True, frozen_seconds=2 * self.lease)
        return "server", [], f"{old} frozen -> {self.pair.primary.port}"
