"""The triggerer's holds of deferred guarded operators: one lock session per triggerer process and lock database.

A guarded deferrable operator that defers hands its hold over under a lease row (the lock
scopes' table, ``pglock.scopes``). While its trigger waits, the :class:`HoldHub` of the
triggerer process holds the advisory key itself, on one dedicated connection shared by every
deferred task of that process (a :class:`~airflow_pglock.lock_set.LockSession`: tracked keys,
its heartbeat), and renews the lease row under it every ``lease / 3`` s. So a foreign client
that only tries the key finds it busy, and a guard of this provider finds the row as well.

Taking a key: the hub tries it; once held, it renews the row if the row is still this task's
and live (database clock). A row that lapsed or was taken ends the hold as lost. A key that is
busy (a guard reading the row for a moment, or a foreign client) is tried again every second
while the row is live; once the row is found lapsed, the hold is lost.

When the session ends (the lock database restarted, the connection broke, the server ended
it), every key goes with it: the hub opens a new session and takes every key again the same
way. A hold whose row lapsed meanwhile is lost; otherwise the lease bridged the gap. A triggerer
that dies leaves its rows: the trigger, started again by a triggerer, takes its key again the
same way, or finds it lost.

Nothing here blocks the event loop: every statement runs in the hub's one worker thread
(the session's statements one at a time), log lines from a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import psycopg

from airflow_pglock.exceptions import (
    LockConfigurationError,
    PgLockError,
    ScopeHorizonBusyError,
    StandbyServerError,
    UnsafeSetupError,
)
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.identity import DEFERRED_HOLDS_APPLICATION_NAME
from airflow_pglock.keys import LockKey
from airflow_pglock.lock_set import LockSession, SubLock
from airflow_pglock.pg import scopes
from airflow_pglock.triggers.wakeups import start_apart

log = logging.getLogger("airflow_pglock.holds")

T = TypeVar("T")

#: application_name of the hub's lock session.
HOLDS_APPLICATION_NAME = DEFERRED_HOLDS_APPLICATION_NAME
#: Seconds between two passes of the hub (keys to take again, leases to renew, a lost session).
PASS_SECONDS = 1.0
#: What :meth:`HoldHub._renew` says when the hold's key is no longer the one it was given.
_REPLACED = "replaced"

HoldState = Literal["taking", "held", "lost", "ended"]


@dataclass(eq=False)
class DeferredHold:
    """One deferred task's hold, kept by the hub while its trigger waits.

    :param key: the task's key (named).
    :param holder: the acquisition's id (the row's holder).
    :param task: the task, for people (``dag.task run``).
    :param lease: seconds the row keeps the hold when nobody renews it.
    """

    key: LockKey
    holder: str
    task: str
    lease: float
    state: HoldState = "taking"
    reason: str | None = None
    sub: SubLock | None = None
    renew_at: float = 0.0
    lease_ends: float = 0.0
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        # The row was renewed at most a lease ago: a hold not taken within one more is lost.
        self.lease_ends = time.monotonic() + self.lease

    def lose(self, reason: str) -> None:
        if self.state in ("lost", "ended"):
            return
        self.state = "lost"
        self.reason = reason
        self.sub = None
        self.lost.set()
        self.settled.set()

    def renewed(self, now: float) -> None:
        self.renew_at = now + self.lease / 3
        self.lease_ends = now + self.lease


class HoldHub:
    """The deferred holds of one event loop and one Airflow connection, on one lock session."""

    def __init__(self, open_session: Callable[[], LockSession], forget: Callable[[], None] = lambda: None) -> None:
        """:param open_session: opens the hub's lock session (blocking: called in the hub's thread).
        :param forget: called when the hub retires (no hold left): :func:`hub_for` makes a new one then."""
        self._open_session = open_session
        self._forget = forget
        self.holds: set[DeferredHold] = set()
        self.session: LockSession | None = None
        self._connected_once = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        # One thread: the session's statements run one at a time, never on the event loop.
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pglock-holds")
        self._retired = False

    async def _in_thread(self, function: Callable[..., T], *args: Any) -> T:
        if self._retired:  # its session is closed: every key it held went with it
            raise PgLockError("the hold hub retired (its session is closed)")
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    @contextlib.asynccontextmanager
    async def holding(self, hold: DeferredHold) -> AsyncIterator[DeferredHold]:
        """Keep ``hold`` while the block runs; its ``settled`` event is set once the key is held (or lost).

        When the block ends without :meth:`hand_back` (the trigger was cancelled: the task was
        cleared, timed out, or its triggerer stops), the key is released and the row left: its
        lease ends it, or a triggerer that runs the trigger again takes the hold back.
        """
        self.holds.add(hold)
        self._lose_if_lapsed(hold)
        if self._task is None or self._task.done():
            self._task = start_apart(self._serve(), "pglock deferred holds")
        self._wake.set()
        try:
            yield hold
        finally:
            self.holds.discard(hold)
            sub, hold.sub = hold.sub, None
            if hold.state not in ("lost", "ended"):
                hold.state = "ended"
            if sub is not None and not self._retired:  # retired: its session closed, the key with it
                # Shielded: a cancelled trigger must still give its key back.
                with contextlib.suppress(PgLockError):
                    await asyncio.shield(self._in_thread(self._release_quietly, sub))

    async def hand_back(self, hold: DeferredHold) -> bool:
        """The trigger fired: renew the row for the hand-over to a worker and release the key.

        :returns: False when the hold was lost meanwhile (``hold.reason`` says why).
        """
        return await self._let_go(hold, self._renew_for_resume)

    async def end(self, hold: DeferredHold) -> bool:
        """The task ended in the triggerer (its operator's trigger finished it there): no worker
        resumes to free the hold, so its row is deleted under the key, then the key released.

        :returns: False when the hold was lost meanwhile (``hold.reason`` says why).
        """
        return await self._let_go(hold, self._free_row)

    async def _let_go(self, hold: DeferredHold, last_write: Callable[[DeferredHold, SubLock], str | None]) -> bool:
        while True:
            while hold.state == "taking":  # the session is being replaced: a pass takes the key back
                if self._task is None or self._task.done():  # no pass will come: the hub stopped
                    hold.lose("the triggerer's hold hub stopped before it took the key back")
                    return False
                await asyncio.sleep(PASS_SECONDS / 4)
            sub = hold.sub
            if hold.state != "held" or sub is None:
                return False
            try:
                renewed = await self._in_thread(last_write, hold, sub)
            except (PgLockError, psycopg.Error) as error:
                if self._session_gone():
                    # The session ended under the write (the lock database restarted, the connection
                    # broke), its key with it: as on a pass, the key is taken back on a new session
                    # while the row is still this hold's and live (else lost), then written there.
                    if hold.sub is sub and hold.state == "held":
                        hold.state, hold.sub = "taking", None
                    self._wake.set()
                    continue
                renewed = f"the hold's row could not be written as its trigger fired ({type(error).__name__}: {error})"
            if renewed is _REPLACED:
                continue  # its key was taken back on a new session meanwhile: renew it there
            if renewed is None:
                hold.sub, hold.state = None, "ended"
            else:
                hold.lose(renewed)
                self._wake.set()
            # Shielded: a trigger cancelled now must still give its key back (nothing tracks it any more).
            with contextlib.suppress(PgLockError):  # a retired hub's session took its keys with it
                await asyncio.shield(self._in_thread(self._release_quietly, sub))
            return renewed is None

    # ------------------------------------------------------------------ the hub's passes

    async def _serve(self) -> None:
        try:
            await self._passes()
        except asyncio.CancelledError:  # the loop ends (a triggerer stopping, dag.test): the keys go now
            self._drop_session()
            await self._in_thread(self._close_session)
            self._retire()
            raise

    def _retire(self) -> None:
        """No hold left and the session closed: the hub's thread ends, and a later hold gets a new hub."""
        self._retired = True
        self._forget()
        self._thread.shutdown(wait=False)

    async def _passes(self) -> None:
        while True:
            while self.holds:
                try:
                    await self._pass()
                except Exception as error:  # a bug or an input nobody foresaw: a new session, every key again
                    await asyncio.to_thread(log.error, "pglock deferred holds: a pass failed", exc_info=error)
                    self._drop_session()
                    await self._in_thread(self._close_session)
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), PASS_SECONDS)
            await self._in_thread(self._close_session)
            if not self.holds:  # no await since the check: nothing can register with this hub any more
                self._retire()
                return

    async def _pass(self) -> None:
        for hold in list(self.holds):
            self._lose_if_lapsed(hold, watch=False)  # the timer set when it was registered watches it
        session = self.session
        if self._session_gone():
            if session is not None:
                self._drop_session()
                await self._in_thread(self._close_session)
                await asyncio.to_thread(
                    log.warning,
                    "pglock deferred holds: the lock session was lost (%s); taking every held key back",
                    session.lost or "its connection closed",
                )
            if not await self._connect():
                return
        for hold in list(self.holds):
            try:
                # A lease is counted from before its statement: the row's own end is no earlier.
                started = time.monotonic()
                if hold.state == "taking":
                    taken = await self._in_thread(self._take, hold)
                    if isinstance(taken, str):
                        hold.lose(taken)
                    elif isinstance(taken, float):
                        # Busy, and the row was this hold's and live (renewed by another copy of the
                        # trigger, in another triggerer, or read by a guard): it holds the key as long
                        # as it said (from before the statement: never past the row's own end).
                        hold.lease_ends = max(hold.lease_ends, started + taken)
                    elif taken is not None and (hold not in self.holds or hold.state != "taking"):
                        await self._in_thread(self._release_quietly, taken)  # its trigger ended meanwhile
                    elif taken is not None:
                        hold.sub, hold.state = taken, "held"
                        hold.renewed(started)
                        hold.settled.set()
                elif hold.state == "held" and hold.sub is not None and started >= hold.renew_at:
                    lost = await self._in_thread(self._renew, hold, hold.sub, scopes.deferred_task(hold.task))
                    if lost is None:
                        hold.renewed(started)
                    elif lost is not _REPLACED:
                        hold.lose(lost)
            except ScopeHorizonBusyError as error:
                # The session and its keys are fine (the write was rolled back): the next pass tries
                # again. The other holds' writes would meet the same busy lock, each after its bound.
                await asyncio.to_thread(log.warning, "pglock deferred holds: %s: %s", hold.key.describe(), error)
                return
            except (PgLockError, psycopg.Error) as error:
                await asyncio.to_thread(log.warning, "pglock deferred holds: %s: %s", hold.key.describe(), error)
                self._drop_session()  # every key is taken back on a new session at the next pass
                await self._in_thread(self._close_session)
                self._wake.set()
                return

    def _session_gone(self) -> bool:
        """Whether the hub's session has ended (a pass replaces it)."""
        session = self.session
        return session is None or session.lost is not None or session.connection.closed

    def _drop_session(self) -> None:
        """The session is being replaced: its keys go with it; every held key is taken again."""
        for hold in self.holds:
            if hold.state == "held":
                hold.state, hold.sub = "taking", None

    def _lose_if_lapsed(self, hold: DeferredHold, *, watch: bool = True) -> None:
        """Lose a hold whose row's lease may have lapsed (no renewal answered within it: its key
        being taken back after its session ended, or a renewal that hangs on a session cut off
        without a word); ``watch``: if not yet, look again then, on a timer of the loop (a pass,
        or the hub's thread, may be blocked meanwhile: in a connect that waits out its timeout, in
        a statement that waits for an answer). Whatever key the hold had is given back."""
        if hold.state not in ("taking", "held") or hold not in self.holds:
            return
        left = hold.lease_ends - time.monotonic()
        if left > 0:
            if watch:
                asyncio.get_running_loop().call_later(left, self._lose_if_lapsed, hold)
            return
        sub, held = hold.sub, hold.state == "held"
        what = f"renew the row of {hold.key.describe()}" if held else f"take {hold.key.describe()} back"
        hold.lose(
            f"the triggerer could not {what} within the lease ({hold.lease:g} s): another holder may have run meanwhile"
        )
        if sub is not None and not self._retired:  # behind whatever the hub's thread waits for
            self._thread.submit(self._release_quietly, sub)
        self._wake.set()

    async def _connect(self) -> bool:
        try:
            await self._in_thread(self._open_and_keep_session)
        except (PgLockError, psycopg.Error, OSError) as error:
            # A standby is often a failover under way: waited for, as a database that is down (each
            # hold is lost at its lease all the same).
            fixed_only_by_hand = not isinstance(error, StandbyServerError)
            if (
                not self._connected_once
                and isinstance(error, LockConfigurationError | UnsafeSetupError)
                and fixed_only_by_hand
            ):
                for hold in list(self.holds):  # a setting to fix: waiting for it would not help
                    hold.lose(f"the triggerer cannot hold the key: {type(error).__name__}: {error}")
                return False
            await asyncio.to_thread(
                log.warning, "pglock deferred holds: cannot connect to the lock database (%s); retrying", error
            )
            return False
        self._connected_once = True
        return True

    # ------------------------------------------------------------------ in the hub's thread
    # These run in the hub's thread: they return what they found; the loop applies it.

    def _take(self, hold: DeferredHold) -> SubLock | str | float:
        """The key taken (its row renewed); when busy, how long its row still holds it, in seconds
        (the database's; try again); or why the hold is lost."""
        session = self.session
        assert session is not None
        sub = session.take_for_scope(hold.key)
        if sub is None:  # busy: a guard reading the row for a moment, or another holder
            row = scopes.read(session.connection, hold.key)
            if row is None or row.holder != hold.holder or not row.live:
                return _why_lost(hold, row, busy=True)
            return float(row.seconds_left)
        try:
            row = scopes.rejoin(session.connection, hold.key, hold.holder, scopes.deferred_task(hold.task), hold.lease)
            if row is None:
                found = scopes.read(session.connection, hold.key)
                self._release_quietly(sub)
                return _why_lost(hold, found, busy=False)
        except BaseException:
            self._release_quietly(sub)
            raise
        return sub

    def _renew(self, hold: DeferredHold, sub: SubLock, task: str) -> str | None:
        """Renew the row under ``sub``, the hold's key (nobody could take the row meanwhile: the key
        was held). Why the hold is lost; None when renewed; :data:`_REPLACED` when ``sub`` is no
        longer the hold's (handed back, ended, or its session replaced since the caller looked)."""
        session = self.session
        if hold.sub is not sub or hold.state != "held":
            return _REPLACED
        if session is None or session.lost is not None:
            raise PgLockError("the lock session ended before the renewal")
        row = scopes.rejoin(session.connection, hold.key, hold.holder, task, hold.lease, require_live=False)
        if row is None:
            self._release_quietly(sub)
            return f"the row of the hold of {hold.key.describe()} was deleted while the triggerer held the key"
        if session.lost is not None:  # the session ended around the statement: the key may be gone
            raise PgLockError(f"the lock session ended during the renewal: {session.lost}")
        return None

    def _renew_for_resume(self, hold: DeferredHold, sub: SubLock) -> str | None:
        return self._renew(hold, sub, scopes.resuming_task(hold.task))

    def _free_row(self, hold: DeferredHold, sub: SubLock) -> str | None:
        """Delete the hold's row under ``sub``, its key (as :meth:`_renew`: why the hold is lost,
        None when freed, :data:`_REPLACED`)."""
        session = self.session
        if hold.sub is not sub or hold.state != "held":
            return _REPLACED
        if session is None or session.lost is not None:
            raise PgLockError("the lock session ended before the row was freed")
        if scopes.leave(session.connection, hold.key, hold.holder, lower=False) is None:
            return f"the row of the hold of {hold.key.describe()} was deleted while the triggerer held the key"
        try:
            scopes.lower_horizon(session.connection)
        except (PgLockError, psycopg.Error) as error:
            # The row is gone: a horizon left high only makes guards read the rows.
            log.warning("pglock: the lock scopes' horizon was not lowered after %s ended: %s", hold.task, error)
        return None

    def _release_quietly(self, sub: SubLock | None) -> None:
        if sub is not None:
            with contextlib.suppress(PgLockError, psycopg.Error):
                sub.release()

    def _open_and_keep_session(self) -> None:
        """Open the session and keep it, in the hub's thread: a pass cancelled while it connects
        (the loop ending) leaves it for the close that the cancellation queues behind it."""
        self.session = self._open_session()

    def _close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(Exception):  # it is being replaced: its keys go with it
                session.close()


def _why_lost(hold: DeferredHold, row: scopes.ScopeRow | None, *, busy: bool) -> str:
    key = hold.key.describe()
    if row is None:
        return f"the row of the hold of {key} was deleted while the task was deferred"
    if row.holder != hold.holder:
        return f"its lease ran out while the task was deferred and {row.describe()} took {key}"
    held = " and another session holds the key" if busy else ""
    return (
        f"its lease ran out at {row.lease_until.isoformat(timespec='seconds')} (database clock) while the task "
        f"was deferred{held}: another guard of {key} may have run in the gap"
    )


_HUBS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], HoldHub]] = (
    weakref.WeakKeyDictionary()
)


def hub_for(postgres_conn_id: str, connect_timeout: int) -> HoldHub:
    """The hub of the running event loop for this Airflow connection (created on first use)."""
    hubs = _HUBS.setdefault(asyncio.get_running_loop(), {})
    hub = hubs.get((postgres_conn_id, connect_timeout))
    if hub is None:

        def open_session() -> LockSession:
            # A hook per session: a hook resolves its Airflow connection once, and a new session
            # must read it anew (a rotated password).
            hook = AdvisoryLockHook(postgres_conn_id, connect_timeout=connect_timeout)
            return hook.open_lock_session(application_name=HOLDS_APPLICATION_NAME)

        def forget() -> None:
            hubs.pop((postgres_conn_id, connect_timeout), None)

        hub = hubs[(postgres_conn_id, connect_timeout)] = HoldHub(open_session, forget)
    return hub
