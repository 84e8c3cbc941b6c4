"""The campaign's live look at the lock database: connections the workers keep open for nothing.

A worker's process exits at the end of the campaign, and with it every connection it left open:
the end-of-run look (``run._leftovers``) cannot see a guard that kept its connection after its
hold. This look runs while the workers work: every :data:`PERIOD` seconds it lists the workers'
sessions (``application_name`` ``campaign w<n>``, the hold hub's ``... holds`` included) that are
``idle`` (no transaction open), hold no advisory lock and have been idle for more than
:data:`REPORT_FROM` seconds, and writes each to its history (``idle-session``). The checker's
rule 13 judges them against :func:`idle_bound`.

Which sessions of a running worker are idle and hold nothing, and for how long: a guard's, a scope
task's and ``hook.lock()``'s between their connect and their lock statement and between their
release and their close (milliseconds: the next statement follows at once); a lock session
between two keys, whose heartbeat probes it every ``lease / 3`` (which resets its idle time); the
hold hub's session between its hand-back and its close; the heartbeat's side looks (a connect and
a statement). A session that holds nothing and has no heartbeat is one its process forgot: the
server ends it only after ``idle_session_timeout`` (the lease).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import psycopg

from devtools.campaign.history import HistoryWriter

#: Seconds between two looks.
PERIOD = 1.0
#: Idle sessions holding nothing are written to the history from this many seconds of idleness
#: (the shorter ones are every guard's connect and close: not worth a line).
REPORT_FROM = 0.5

QUERY = (
    "SELECT a.pid, a.application_name, extract(epoch FROM clock_timestamp() - a.state_change)::float8"
    " FROM pg_stat_activity a"
    " WHERE a.application_name LIKE 'campaign w%%' AND a.state = 'idle'"
    " AND clock_timestamp() - a.state_change > make_interval(secs => %(from)s)"
    " AND NOT EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory')"
)


def idle_bound(lease: float) -> float:
    """How long a running worker's session may be idle holding nothing: 0.8 of the lease.

    Between two statements of a running process (connect then lock, release then close) a
    session is idle for milliseconds; a lock session holding nothing is probed by its heartbeat
    every ``lease / 3`` (1 s with the campaign's lease); the rest leaves a loaded machine (CI runs
    two test processes beside the campaign's workers) well over a second of scheduling. A
    connection kept open after its hold is idle until the server ends it at
    ``idle_session_timeout`` (the lease): looked at every :data:`PERIOD` seconds, most are seen
    past this bound before that, and one in transaction mode (no such timeout) always is. A frozen
    or cut-off worker's sessions are excused by the checker (their process cannot send a statement).
    """
    return 0.8 * lease


class SessionWatch:
    """A thread that looks every :data:`PERIOD` seconds until stopped.

    :param dsn: the lock database's primary (asked at each look: a failover moves it).
    :param history: where each idle session found goes.
    """

    def __init__(self, dsn: Callable[[], str], history: HistoryWriter) -> None:
        self.dsn = dsn
        self.history = history
        self.looks = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="campaign-session-watch", daemon=True)

    def start(self) -> SessionWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop looking; the history says how many looks there were (the checker's figure)."""
        self._stop.set()
        self._thread.join(10)
        self.history.emit("session-watch", looks=self.looks, failed=self.failed)

    def look(self) -> None:
        """One look; a look that fails (the server is restarting, failing over) is counted, no more:
        a leaked connection outlives it (the next look sees it)."""
        try:
            with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=1) as conn:
                rows = conn.execute(QUERY, {"from": REPORT_FROM}).fetchall()
        except psycopg.Error:
            self.failed += 1
            return
        self.looks += 1
        for pid, name, idle in rows:
            self.history.emit("idle-session", backend=int(pid), application_name=name, idle=round(float(idle), 3))

    def _loop(self) -> None:
        while not self._stop.wait(PERIOD):
            with contextlib.suppress(Exception):  # the look must never end the campaign
                self.look()
