"""Wake-ups for waiting triggers: one listening connection per triggerer process and lock database.

Every :class:`~airflow_pglock.triggers.advisory_lock.AdvisoryLockTrigger` of a process
that waits on the same Airflow connection registers its key with one :class:`WakeupHub`.
The hub keeps one connection that ``LISTEN`` s for released keys (a guard announces its
release in its unlock statement) and re-checks a key when it is announced; once per poll
interval it re-checks every waiting key in one statement, which covers holders that
died or are not airflow-pglock. After (re)connecting it checks every key at once, so a
restarted triggerer or lock database loses at most one poll interval, never the wake-up.

Anyone who may connect can NOTIFY the channel: a payload that is not an announcement is
ignored. An error nobody foresaw restarts the hub (a new connection, every key checked
again); only when it fails again and again without ever completing a check do its
waiters report the error: a hub's error never leaves a trigger waiting in silence.

Nothing here blocks the event loop: the Airflow connection is read in a worker thread
(``AdvisoryLockHook.aconnect``), log lines are written from one (a triggerer's log socket
can block while its supervisor is busy), the rest is asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from airflow_pglock.exceptions import LockConfigurationError, LockConnectionError, PgLockError, UnsafeSetupError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import wakeups
from airflow_pglock.pg.wakeups import Coordinates

log = logging.getLogger("airflow_pglock.wakeups")

#: application_name of the hub's listening connection.
WAKEUP_APPLICATION_NAME = "airflow-pglock wakeups"
#: Seconds between two looks for announcements (and for keys that started waiting).
LISTEN_SLICE = 0.1
#: Seconds between two attempts to reconnect after the lock database went away.
RECONNECT_DELAY = 1.0
#: Keys settled before the hub lets the loop turn: many keys freed at once wake their
#: triggers a batch per turn, so the loop's timers (Airflow's watchdog) run in between.
WAKE_BATCH = 20
#: Seconds a hub whose first connection fails keeps trying before its waiters report the error:
#: a lock database that blinks as a triggerer (re)starts fails no deferred task, and a connection
#: the triggerer can never open is still reported soon.
FIRST_CONNECT_GRACE = 30.0
#: Unforeseen errors in a row, with no complete check of the waiting keys in between, after
#: which the waiting triggers report the error instead of waiting on a hub that cannot read.
FAILURES_REPORTED = 3


def start_apart(coroutine: Any, name: str) -> asyncio.Task[None]:
    """Start a hub's task outside the context of the trigger that happens to start it: the
    triggerer sends a trigger's log lines to that task's log by context variables, and a hub
    serves every trigger (its lines belong in the triggerer's own log)."""
    loop = asyncio.get_running_loop()
    return contextvars.Context().run(loop.create_task, coroutine, name=name)


@dataclass(eq=False)
class Waiter:
    """One waiting trigger: its key, and events the hub sets."""

    coordinates: Coordinates
    shared: bool
    poll_interval: float
    #: Seconds a deadline waits for a read of the key when none counts (the hub may be (re)connecting).
    read_grace: float = RECONNECT_DELAY
    checked: asyncio.Event = field(default_factory=asyncio.Event)  # read since the hub's connection came up
    free: asyncio.Event = field(default_factory=asyncio.Event)
    woken: asyncio.Event = field(default_factory=asyncio.Event)  # free, or the hub failed
    error: BaseException | None = None
    unreadable: BaseException | None = None  # why the hub cannot read the key now (its connection went)
    reached: bool = True  # whether the hub's connection ever opened (else it is still trying its first)

    async def wait(self, timeout: float | None) -> bool:
        """True once the key is free; False at ``timeout`` when the hub's last read, on a
        connection still up, found it held. Raises the hub's error, and when the key could not be
        read by ``timeout`` plus :attr:`read_grace` (for a connect or reconnect on its way): a
        deadline is never answered "held" from a read the hub can no longer vouch for (the lock
        database went away; a stopped server holds nothing)."""
        if not self.woken.is_set() and (timeout is None or timeout > 0):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.woken.wait(), timeout)
        if not self.checked.is_set():  # a read may be on its way (a connect, a reconnect)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.checked.wait(), self.read_grace)
        if self.error is not None:
            raise self.error
        if self.free.is_set():
            return True
        if not self.checked.is_set():
            raise self._unread()
        return False

    def _unread(self) -> LockConnectionError:
        if self.unreadable is not None and not self.reached:
            return LockConnectionError(f"could not connect to the lock database ({self.unreadable})")
        if self.unreadable is not None:
            return LockConnectionError(
                f"the wake-up connection to the lock database was lost ({self.unreadable}) and is not back"
            )
        return LockConnectionError(f"the lock database did not answer a read of the key within {self.read_grace:g} s")

    def settle(self, held_exclusively: bool | None) -> None:
        """The hub read the key: None (nobody holds it), True (held exclusively), False (held shared)."""
        if held_exclusively is None or (self.shared and not held_exclusively):
            self.free.set()
            self.woken.set()
        self.unreadable = None
        self.checked.set()

    def unsettle(self, error: BaseException, *, reached: bool = True) -> None:
        """The hub lost its connection (``reached``), or cannot open its first: its last read of
        the key, if any, no longer counts."""
        self.unreadable = error
        self.reached = reached
        self.checked.clear()

    def fail(self, error: BaseException) -> None:
        """The hub cannot read the key: the trigger reports ``error`` now, checked or not."""
        self.error = error
        self.woken.set()
        self.checked.set()


class WakeupHub:
    """The waiting keys of one event loop and one Airflow connection, and the connection that watches them."""

    def __init__(self, postgres_conn_id: str, connect_timeout: int) -> None:
        self.postgres_conn_id = postgres_conn_id
        self.connect_timeout = connect_timeout
        self.waiters: dict[Coordinates, set[Waiter]] = {}
        self.pending: set[Coordinates] = set()
        self._task: asyncio.Task[None] | None = None
        self._connected_once = False
        self._checked_all = False  # since the hub (re)started: it read every waiting key once
        self._told_of_foreign = False
        self._unreadable: BaseException | None = None  # its connection went and is not back yet
        self._poll_due = math.inf  # when every waiting key is read again (monotonic)
        self._started = 0.0  # when _serve began (monotonic)
        self._standby_since: float | None = None  # the first look at a standby since the last primary

    @contextlib.asynccontextmanager
    async def watch(self, key: LockKey, *, shared: bool, poll_interval: float) -> AsyncIterator[Waiter]:
        """Register ``key`` while the block runs; the hub checks it at once, then on wake-ups and polls."""
        waiter = Waiter(key.pg_locks, shared, poll_interval, read_grace=self.connect_timeout + RECONNECT_DELAY)
        if self._task is None or self._task.done():
            self._unreadable = None  # an outage the last waiters left behind says nothing of now
        elif self._unreadable is not None:
            waiter.unsettle(self._unreadable, reached=self._connected_once)
        self.waiters.setdefault(waiter.coordinates, set()).add(waiter)
        self.pending.add(waiter.coordinates)
        # Read at once, then again within its own interval: a waiter that polls less often must not hold it back.
        self._poll_due = min(self._poll_due, time.monotonic() + poll_interval)
        if self._task is None or self._task.done():
            self._task = start_apart(self._serve(), "pglock wakeups")
        try:
            yield waiter
        finally:
            same_key = self.waiters.get(waiter.coordinates)
            if same_key is not None:
                same_key.discard(waiter)
                if not same_key:
                    del self.waiters[waiter.coordinates]

    @property
    def poll_interval(self) -> float:
        return min((w.poll_interval for ws in self.waiters.values() for w in ws), default=5.0)

    async def _serve(self) -> None:
        """Watch while keys wait; after an unforeseen error start again, checking every key."""
        self._connected_once = False
        self._started = time.monotonic()
        failures = 0
        while self.waiters:
            self._checked_all = False
            try:
                await self._connect_and_watch()
                return
            except Exception as error:  # a bug or an input nobody foresaw: restart rather than go silent
                self._unsettle_all(error)
                failures = 1 if self._checked_all else failures + 1
                if failures < FAILURES_REPORTED:
                    await asyncio.to_thread(
                        log.error,
                        "pglock wakeups: restarting after an error; every waiting key is read again",
                        exc_info=error,
                    )
                else:
                    self._fail_all(error)
                    failures = 0
                    await asyncio.to_thread(
                        log.error,
                        "pglock wakeups: failed %d times in a row; the waiting triggers report it",
                        FAILURES_REPORTED,
                        exc_info=error,
                    )
                await asyncio.sleep(RECONNECT_DELAY)

    async def _connect_and_watch(self) -> None:
        while self.waiters:
            # A hook per connection: a hook resolves its Airflow connection once, and a reconnect
            # must read it anew (a rotated password).
            hook = AdvisoryLockHook(self.postgres_conn_id, connect_timeout=self.connect_timeout)
            try:
                conn = await hook.aconnect(WAKEUP_APPLICATION_NAME)
            except (PgLockError, psycopg.Error, OSError) as error:
                never_reached = not self._connected_once and time.monotonic() - self._started > FIRST_CONNECT_GRACE
                if never_reached or isinstance(error, LockConfigurationError | UnsafeSetupError):
                    self._fail_all(error)  # a setting to fix, or no database at all: the waiters report it
                    return
                if not self._connected_once:
                    self._unsettle_all(error, reached=False)  # a deadline meanwhile reports this error, never "held"
                await asyncio.to_thread(
                    log.warning, "pglock wakeups: cannot connect to the lock database (%s); retrying", error
                )
                await asyncio.sleep(RECONNECT_DELAY)
                continue
            self._connected_once = True
            try:
                async with conn:
                    await wakeups.alisten(conn)
                    self._standby_since = None
                    self.pending |= set(self.waiters)  # anything released while we were away
                    await self._watch(conn)
            except UnsafeSetupError as error:  # a standby (alisten): maybe one being promoted in a failover
                if self._standby_since is None:
                    self._standby_since = time.monotonic()
                if time.monotonic() - self._standby_since > FIRST_CONNECT_GRACE:
                    self._fail_all(error)  # a setting to fix: the waiters report it
                    return
                self._unsettle_all(error)  # a deadline meanwhile reports this error, never "free"
                await asyncio.to_thread(log.warning, "pglock wakeups: %s; retrying", error)
                await asyncio.sleep(RECONNECT_DELAY)
            except (psycopg.Error, OSError) as error:
                self._unsettle_all(error)
                await asyncio.to_thread(
                    log.warning, "pglock wakeups: lost the lock database connection (%s); reconnecting", error
                )
                await asyncio.sleep(RECONNECT_DELAY)

    async def _watch(self, conn: psycopg.AsyncConnection[object]) -> None:
        self._poll_due = time.monotonic() + self.poll_interval
        while self.waiters:
            if time.monotonic() >= self._poll_due:
                self.pending |= set(self.waiters)
                self._poll_due = time.monotonic() + self.poll_interval
            keys = self.pending & set(self.waiters)
            self.pending.clear()
            if keys:
                every_key = keys == set(self.waiters)
                # Only the waiters registered before the read began: one that registers during it (its
                # key is in pending again) waits for a read of its own, which may find the key taken.
                readers = {coordinates: list(self.waiters.get(coordinates, ())) for coordinates in keys}
                held = await wakeups.aheld(conn, keys)
                for count, coordinates in enumerate(keys, 1):
                    for waiter in readers[coordinates]:
                        waiter.settle(held.get(coordinates))
                    if count % WAKE_BATCH == 0:
                        await asyncio.sleep(0)  # the woken triggers run WAKE_BATCH to a turn of the loop
                self._checked_all = self._checked_all or every_key
                if every_key:
                    self._unreadable = None
            try:
                async for notify in conn.notifies(timeout=LISTEN_SLICE, stop_after=1):
                    await self._read_announcement(notify.payload)
            except UnicodeDecodeError as error:
                # A payload not in the connection's encoding (a SQL_ASCII database passes any
                # byte on). psycopg drops the rest of its batch with it: read every key again.
                self.pending |= set(self.waiters)
                await self._tell_of_foreign(repr(error.object[:80]))

    async def _read_announcement(self, payload: str) -> None:
        announced = wakeups.coordinates(payload)
        if announced is None:
            await self._tell_of_foreign(repr(payload[:80]))
        elif announced in self.waiters:
            self.pending.add(announced)

    async def _tell_of_foreign(self, payload: str) -> None:
        """Log the first foreign NOTIFY on the channel (at debug: anyone who may connect can send one)."""
        if not self._told_of_foreign:
            self._told_of_foreign = True
            await asyncio.to_thread(
                log.debug,
                "pglock wakeups: ignored a NOTIFY on %s that is not an announcement: %s (and any later)",
                wakeups.RELEASED_CHANNEL,
                payload,
            )

    def _unsettle_all(self, error: BaseException, *, reached: bool = True) -> None:
        self._unreadable = error
        for waiters in self.waiters.values():
            for waiter in waiters:
                waiter.unsettle(error, reached=reached)

    def _fail_all(self, error: BaseException) -> None:
        for waiters in self.waiters.values():
            for waiter in waiters:
                waiter.fail(error)


_HUBS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], WakeupHub]] = (
    weakref.WeakKeyDictionary()
)


def hub_for(postgres_conn_id: str, connect_timeout: int) -> WakeupHub:
    """The hub of the running event loop for this Airflow connection (created on first use)."""
    hubs = _HUBS.setdefault(asyncio.get_running_loop(), {})
    return hubs.setdefault((postgres_conn_id, connect_timeout), WakeupHub(postgres_conn_id, connect_timeout))
