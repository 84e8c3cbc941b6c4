"""A guarded execution: one lock held around one piece of work, from acquisition to outcome.

The lifetime object between the Airflow adapters (and the hook's ``lock()``) and the lock
database. :class:`LockGuard` coordinates small parts with one job each: the held lock (it
owns its release and commit), the run rules, the
:class:`~airflow_pglock.heartbeat.Heartbeat` that keeps a healthy session alive and notices
a lost one, the :class:`~airflow_pglock.interruption.Interruption` of the work, the words of
:mod:`~airflow_pglock.loss`, and the single :class:`~airflow_pglock.outcome.OutcomeLine`
each execution logs. It raises plain airflow-pglock errors; the adapters turn them into
Airflow outcomes.

``__exit__`` stops the heartbeat, releases (or commits / rolls back in transaction mode),
closes the connection and logs exactly one outcome line. A lock lost during the block raises
LockLostError (``on_lost="fail"``), also when the block itself succeeded. While the block
runs, a heartbeat thread probes the lock every ``lease / 3`` s; with ``on_lost="fail"`` a loss
interrupts the block: :class:`~airflow_pglock.exceptions.LockLostInterrupt` is raised in the
guarded thread (at once in the main thread, via a signal; at its next Python bytecode in
another thread).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import psycopg

from airflow_pglock import forks, loss
from airflow_pglock.exceptions import (
    AlreadyDoneError,
    LockBusyError,
    LockConfigurationError,
    LockLostError,
    LockLostInterrupt,
    PgLockError,
)
from airflow_pglock.finish import Ending, finish, finish_session, finish_transaction
from airflow_pglock.handle import LockHandle
from airflow_pglock.heartbeat import Heartbeat
from airflow_pglock.holder import LockHolder, blocking_holders, describe_holders
from airflow_pglock.identity import DEFERRED_HOLDS_APPLICATION_NAME, TaskIdentity, check_application_name
from airflow_pglock.interruption import Interruption, protect_clean_up
from airflow_pglock.keys import LockKey, slot_keys
from airflow_pglock.outcome import OutcomeContext, OutcomeLine, Reported, WorkEnding
from airflow_pglock.pg.database import LockDatabase
from airflow_pglock.pg.held import HeldLock
from airflow_pglock.policy import LockPolicy
from airflow_pglock.registry import record_acquisition
from airflow_pglock.run_rules import (
    RunRules,
    check_before_work,
    check_not_pooled,
    check_not_shared,
    check_not_warned,
    record_success,
)
from airflow_pglock.scope_rules import (
    OUTSIDE,
    HandOver,
    ScopeRole,
    end_deferred_hold,
    end_member_task,
    free_after_failed_enter,
    hand_over,
    record_and_free,
)
from airflow_pglock.scope_rules import check_before_work as check_scope

#: Seconds between two tries of a guard that waits (``on_busy="wait"``) for another's lock
#: scope to end: a scope between its tasks is a row, not a lock the server could wait on.
SCOPE_POLL_SECONDS = 1.0

T = TypeVar("T")

log = logging.getLogger("airflow_pglock")


def busy_error(
    database: LockDatabase, pool: Sequence[LockKey], timeout: float | None, logger: Any, *, shared: bool = False
) -> LockBusyError:
    """The refusal for a busy key (or full pool: its slots, slot 1 first), naming who holds it
    (as far as the server can still tell); for a ``shared`` try, also the exclusive requests
    queued for it, which PostgreSQL serves first (a shared try fails behind them even when only
    shared holders hold the key)."""
    key, slots = pool[0], len(pool)
    waited = f" after waiting {timeout:g} s" if timeout is not None else ""
    # Explaining who holds the key never turns the busy key into a failure: whatever goes wrong
    # reading or describing the holders (the server, the driver reading a value, a bug), the key
    # is still busy, held by a holder it cannot name.
    try:
        holders = database.holders(pool)
        now = dt.datetime.now(dt.timezone.utc)
        who = describe_holders(holders, now, nobody="a session that released it since")
        queued = [holder for holder in blocking_holders(holders, shared) if not holder.granted] if shared else []
        if queued:
            who += " and waited for by an exclusive request queued ahead of this shared one: " + "; ".join(
                holder.describe(now) for holder in queued
            )
    except Exception as error:
        logger.warning("pglock could not read the holders of %s: %s: %s", key.describe(), type(error).__name__, error)
        holders, who = [], f"an unknown holder (its holders could not be read: {type(error).__name__})"
    if slots == 1:
        try:
            deferred = _deferred_holder(database, key, holders, logger)
        except Exception as error:  # the holder's session is named all the same
            logger.warning(
                "pglock could not read the deferred holder of %s: %s: %s", key.describe(), type(error).__name__, error
            )
            deferred = None
        if deferred is not None:  # the triggerer's session holds it: its row names the task
            who = f"{deferred.describe()}: the triggerer's session {who}"
        return LockBusyError(f"{key.describe()} is held by {who}{waited}", key, holders)
    return LockBusyError(f"all {slots} slots of the pool {key.describe()} are held, by {who}{waited}", key, holders)


def _deferred_holder(database: LockDatabase, key: LockKey, holders: Sequence[LockHolder], logger: Any) -> Any:
    """The row of a deferred guarded operator whose key a triggerer's session holds, else None."""
    if key.name is None or not any(
        h.granted and h.application_name == DEFERRED_HOLDS_APPLICATION_NAME for h in holders
    ):
        return None
    try:
        return database.live_scope(key)
    except (PgLockError, psycopg.Error) as error:  # the holder's session is named all the same
        logger.warning("pglock could not read the deferred holder of %s: %s", key.describe(), error)
        return None


def _pool_scoped_error(
    pool: Sequence[LockKey], scoped: dict[int, LockBusyError], others: LockBusyError | None
) -> LockBusyError:
    """The refusal for a pool whose every slot is held: some by lock scopes between their tasks
    (their rows), the others by sessions (``others``, read from pg_locks)."""
    by_scope = "; ".join(f"slot {index + 1}: {scoped[index]}" for index in sorted(scoped))
    rest = ""
    if others is not None:
        who = describe_holders(others.holders, dt.datetime.now(dt.timezone.utc), nobody="sessions that released since")
        rest = f"; the other {len(pool) - len(scoped)} by {who}"
    # A scope's slot is free in pg_locks: a deferred retry must wait for the rows, not a release.
    hints = [error.retry_after for error in scoped.values() if error.retry_after is not None]
    return LockBusyError(
        f"all {len(pool)} slots of the pool {pool[0].describe()} are held, {len(scoped)} by lock scopes "
        f"({by_scope}){rest}",
        pool[0],
        others.holders if others is not None else (),
        retry_after=min(hints) if hints else None,
    )


class LockGuard:
    """Hold ``key`` around a ``with`` block according to ``policy`` (see the module's docstring).

    ``__enter__`` acquires (or raises LockBusyError / a connection or set-up error, after
    logging the outcome) and returns a :class:`LockHandle`; ``__exit__`` releases, closes
    and logs exactly one outcome line. :meth:`run` is the airtight form of the ``with`` block.

    :param database: the lock database, which opens the dedicated connection.
    :param key: the key to hold.
    :param policy: what to do when busy, lost, ...
    :param application_name: names the holder in ``pg_stat_activity``.
    :param logger: where the acquisition and outcome lines go.
    :param rules: once_per / min_interval / fencing, checked and recorded under the lock.
    :param identity: the Airflow task instance, recorded with a completion.
    :param stats: gives the metrics client the outcome's metrics go to (``compat.get_stats``);
        None: no metrics.
    :param scope: how this execution stands to a lock scope on its key (``scope_rules``).
    :param work_ending: names an exception the work ended with that is no failure (an Airflow
        adapter's skip or reschedule signal): a :class:`~airflow_pglock.outcome.WorkEnding`, or
        None for a failure. The lock is given back as for any exception (a transaction rolled back).
    :param asked_on_busy: the ``on_busy`` the task asked for, where ``policy`` replaces it for this
        try (a deferred wait's last try, or its try after a trigger error): the metrics' tag names it.
    :param busy_counted_as: what the metrics count a busy refusal as, where it is not what the
        outcome says (``failed``: the try after the triggerer's wait failed: the lock database's error).
    """

    def __init__(
        self,
        database: LockDatabase,
        key: LockKey,
        policy: LockPolicy,
        *,
        application_name: str | None = None,
        logger: logging.Logger | Any | None = None,
        rules: RunRules | None = None,
        identity: TaskIdentity | None = None,
        stats: Callable[[], Any] | None = None,
        scope: ScopeRole = OUTSIDE,
        work_ending: Callable[[BaseException], WorkEnding | None] | None = None,
        asked_on_busy: str | None = None,
        busy_counted_as: str | None = None,
    ) -> None:
        self.database = database
        self._busy_counted_as = busy_counted_as
        self._work_ending = work_ending
        self.scope = scope
        if scope.kind != "outside" and (policy.mode != "session" or policy.shared):
            raise LockConfigurationError(
                "a lock scope holds exclusive session locks: mode='session' and shared=False, got "
                f"mode={policy.mode!r}, shared={policy.shared!r}"
            )
        if scope.hands_over and (policy.slots > 1 or scope.kind not in ("outside", "resume")):
            raise LockConfigurationError(
                f"only a guarded task (not a lock scope's) over one key hands its hold to the triggerer: slots="
                f"{policy.slots!r}, scope {scope.kind!r}"
            )
        if scope.kind in ("member", "leave") and (scope.slot is not None) != (policy.slots > 1):
            raise LockConfigurationError(
                f"a task of a lock scope over a pool re-enters the slot its setup took: slots={policy.slots!r} "
                f"with the scope's slot {scope.slot!r}"
            )
        #: the scope's row as this execution's check found it (a teardown: as it freed it).
        self.scope_row: Any = None
        self.rules = rules or RunRules()
        if scope.kind in ("member", "resume") and self.rules.active:
            raise LockConfigurationError(
                "a task of a lock scope checks no once_per / min_interval / fencing rule of its own: the scope's "
                "setup checks them and its teardown records the completion"
            )
        # A scope's setup checks once_per / min_interval before it takes the scope; its teardown
        # records the completion (when every task of the scope succeeded) without checking again.
        self._records_completion = self.rules.records_completion and scope.kind in ("outside", "leave")
        check_not_shared(self.rules, policy.shared)
        check_not_warned(self.rules, policy.on_lost)
        check_not_pooled(self.rules, policy.slots)
        check_application_name(application_name)
        self.identity = identity
        self.key = key
        self.policy = policy
        self.application_name = application_name
        self.log = logger or log
        self.held: HeldLock | None = None
        #: Whether a try took the key (a scope's setup checks under it before it is held for the
        #: work): an error from then on is never the database's refusal of the lock (on_error).
        self.took_the_lock = False
        self.fencing_token: int | None = None
        #: the busy / already-done refusal this guard raised itself (an adapter turns only
        #: that one into a skip; the same error raised by the work is a failure).
        self.refusal: LockBusyError | AlreadyDoneError | None = None
        self.interruption = Interruption(key.describe())
        self._stop = threading.Event()
        self._holder_pid = os.getpid()  # the process that holds the lock (set again when it is taken)
        self._heartbeat: Heartbeat | None = None
        self._outcome = OutcomeLine(
            self.log, OutcomeContext.of(key, policy, application_name, database, asked_on_busy), stats
        )
        self._started = 0.0
        self._wait_seconds = 0.0
        self._handle: LockHandle | None = None
        #: the work deferred and returned this: its hold passes to the triggerer at the release.
        self._hand_over: HandOver | None = None

    @property
    def outcome(self) -> str | None:
        """``completed``, ``skipped``, ``rescheduled``, ``deferred``, ``failed`` or ``lost`` once logged, else None."""
        return self._outcome.outcome

    @property
    def lost(self) -> str | None:
        """Why the lock was lost, or None (as far as is known now)."""
        return self.interruption.reason

    # ------------------------------------------------------------------ acquire

    def __enter__(self) -> LockHandle:
        self._started = time.monotonic()
        try:
            self.held = self._acquire()
        except LockBusyError as busy:
            self.refusal = busy
            self._report(
                self.policy.busy_outcome(),
                detail=f"busy: {busy}",
                holders=busy.holders,
                counted_as=self._busy_counted_as,
            )
            raise
        except AlreadyDoneError as done:  # a scope's setup: checked before it takes the scope
            self.refusal = done
            self._report("skipped", detail=f"done: {done}")
            raise
        except LockLostError as lost:  # a recording teardown found its scope lapsed or gone
            self._report("lost", detail=lost.cause)
            raise
        except Exception as error:  # a database error, a refused set-up, or a bug: one outcome line all the same
            self._report("failed", detail=f"{type(error).__name__}: {error}")
            raise
        except BaseException as interrupted:  # Ctrl-C, Airflow's timeout: during a wait, or a give-back
            self._report("failed", detail=f"interrupted while taking the lock: {type(interrupted).__name__}")
            raise
        # From here on the lock is held: one try, so that nothing (an error, Airflow's task
        # timeout, Ctrl-C) can leave the lock connection open with no outcome line.
        try:
            if self.held.slot is not None:  # a slot of a pool: the outcome line names the slot taken
                self._outcome.context = dataclasses.replace(
                    self._outcome.context, key=self.held.key, slot=self.held.slot
                )
                self.interruption.label = self.held.key.describe()
            self._holder_pid = os.getpid()
            forks.after_fork_in_child(self, LockGuard._forked)
            self._wait_seconds = time.monotonic() - self._started
            self._outcome.acquired(self.held.key, self.held.server, self._wait_seconds)
            record_acquisition(self.held, self.application_name, self.log, self.policy.slots)  # written at release
            if self.scope.kind in ("member", "resume"):
                self.fencing_token, self.scope_row = check_scope(
                    self.scope, self.held.key, self.held, self.application_name
                )
            if self.rules.active and self.scope.kind == "outside":  # a scope's setup checked them in _acquire
                self.fencing_token = check_before_work(self.rules, self.held, self.database, self.application_name)
            self.interruption.arm(interrupt=self.policy.on_lost == "fail")
            self._heartbeat = Heartbeat(self.database, self.held, self._lose, self.interruption.lost, self._stop)
            self._heartbeat.start()
            self._handle = LockHandle(
                self.held, lambda: self.lost, fencing_token=self.fencing_token, period=self.rules.period
            )
            return self._handle
        except BaseException as error:
            if self.scope.kind == "enter" and self.scope_row is not None:
                self._free_entered_scope()
            try:
                self._abandon(give_back=_gives_back(error))
            except BaseException as late:  # e.g. Airflow's timeout while the key was given back
                self._report("failed", detail=f"giving the key back was interrupted: {type(late).__name__}")
                raise
            if isinstance(error, AlreadyDoneError):
                self.refusal = error
                self._report("skipped", detail=f"done: {error}")
            elif isinstance(error, LockLostError):  # found not held before the work (fencing token)
                self.interruption.refine(error.cause)
                held_for = self.held.held_seconds if self.held is not None else None
                self._report("lost", detail=error.cause, held=held_for)
            else:
                self._report("failed", detail=f"{type(error).__name__}: {error}")
            raise

    def _own_slots_first(self, pool: list[LockKey], lineage: str) -> list[int]:
        """A scope's setup run again over a pool: the slot its earlier try holds by a live row first
        (it takes that row over there; another slot would leave it held until its lease)."""
        try:
            rows = self.database.live_scopes(pool)
        except Exception as error:  # only an order: the take itself meets the database's errors
            self.log.warning("pglock could not read the scopes of %s's slots: %s", self.key.describe(), error)
            return list(range(len(pool)))
        own = [index for index, key in enumerate(pool) if key in rows and rows[key].holder.startswith(lineage)]
        return own + [index for index in range(len(pool)) if index not in own]

    def _acquire(self) -> HeldLock:
        timeout = self.policy.first_wait()
        deadline = None if timeout is None else time.monotonic() + timeout
        pool = slot_keys(self.key, self.policy.slots)  # the key, or a pool's slots: computed once
        every_slot = list(range(len(pool))) if len(pool) > 1 else None
        if self.scope.slot is not None:  # a task of a scope over a pool: its own slot, nothing else
            every_slot = [self.scope.slot - 1]
        elif every_slot is not None and self.scope.lineage is not None:
            every_slot = self._own_slots_first(pool, self.scope.lineage)
        # Slots that lock scopes hold between their tasks (their rows, read under each slot's lock):
        # the next try passes over them, until none is left to try.
        scoped: dict[int, LockBusyError] = {}
        while True:
            remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
            candidates = None if every_slot is None else [index for index in every_slot if index not in scoped]
            if scoped and remaining is not None:
                remaining = min(remaining, SCOPE_POLL_SECONDS)  # a scoped slot frees by its row, not a lock
            held = None
            self.took_the_lock = False  # a try after a give-back: its own take decides
            if candidates != []:
                held = self.database.acquire_lock(
                    pool,
                    shared=self.policy.shared,
                    scope=self.policy.mode,
                    timeout=remaining,
                    application_name=self.application_name,
                    candidates=candidates,
                )
            if held is None:
                left = None if deadline is None else deadline - time.monotonic()
                if scoped and left is not None and left > 0:
                    if candidates == []:
                        time.sleep(min(SCOPE_POLL_SECONDS, left))
                    scoped.clear()  # the wait goes on: every slot is tried again
                    continue
                if scoped:
                    others = (
                        busy_error(self.database, pool, timeout, self.log, shared=self.policy.shared)
                        if candidates
                        else None
                    )
                    raise _pool_scoped_error(pool, scoped, others)
                if self.scope.slot is not None:  # a task of a scope over a pool: its own slot was busy
                    raise busy_error(
                        self.database, [pool[self.scope.slot - 1]], timeout, self.log, shared=self.policy.shared
                    )
                raise busy_error(self.database, pool, timeout, self.log, shared=self.policy.shared)
            self.took_the_lock = True
            if self.scope.kind in ("member", "resume"):
                break  # checked with the run rules: a lost scope is reported as lost
            try:
                if self.scope.kind == "enter" and self.rules.active:  # a done period takes no scope
                    check_before_work(self.rules, held, self.database, self.application_name)
                token, self.scope_row = check_scope(
                    self.scope, held.key, held, self.application_name, records=self._records_completion
                )
            except LockBusyError as busy:
                held.give_back()
                if held.slot is not None and self.scope.kind in ("outside", "enter"):
                    scoped[held.slot - 1] = busy  # another slot may be free: tried at once
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is None or remaining <= 0:
                    raise
                time.sleep(min(SCOPE_POLL_SECONDS, remaining))  # another's scope: its row ends it, not a lock
                continue
            except BaseException as error:
                if _gives_back(error):
                    held.give_back()
                else:
                    held.close()
                raise
            if token is not None:
                self.fencing_token = token
            if self.scope.kind == "leave" and not self._records_completion:
                self._say_what_the_teardown_found(held.key)
            break
        return held

    def _say_what_the_teardown_found(self, key: LockKey) -> None:
        """A teardown that found its scope gone or lapsed freed nothing: its log says so (it ends
        well: the scope is free either way, and the tasks of the scope checked it as they ran).
        ``key``: the key whose row it checked (a pool's slot, not the pool: slot 1, maybe another's)."""
        row = self.scope_row
        if row is None:
            self.log.warning(
                "pglock: the lock scope of %s (holder %s) was already gone when it was to be freed: it had been "
                "freed, or had lapsed and been taken by another run",
                key.describe(),
                self.scope.holder,
            )
        elif not row.live:
            self.log.warning(
                "pglock: the lock scope of %s had lapsed before its teardown (lease until %s, database clock); "
                "its row is deleted",
                key.describe(),
                row.lease_until.isoformat(timespec="seconds"),
            )

    def _free_entered_scope(self) -> None:
        """A setup that took its scope failed before its work: free the scope under the lock, the
        heartbeat and any interruption stopped first. Best effort: its operator tries again on a
        connection of its own, and the scope lease ends it at the latest."""
        try:
            self._stop_heartbeat()
            self.interruption.disarm_absorbing()
            if self.held is not None and not self.held.connection.closed:
                free_after_failed_enter(self.scope, self.held.key, self.held, self.log)
        except BaseException as late:  # e.g. an interrupt during the clean-up: the setup's own error is reported
            self.log.warning("pglock could not free the lock scope after its setup failed: %r", late)

    # --------------------------------------------------------------------- loss

    def _forked(self) -> None:
        """In a child forked inside the block: the lock is the parent's. Its end here touches
        neither the lock nor the parent's session, and is reported as not held."""
        self._stop = threading.Event()  # the parent's may have been mid-use by its heartbeat
        self.interruption.forked(forks.forked_reason(self._holder_pid))

    def _lose(self, reason: str, ask_server: bool) -> None:
        """From the heartbeat: record the loss and interrupt the work at once; then refine the
        reason if the server can tell more; keep the interruption pending until taken."""
        self.interruption.lost(reason)
        if ask_server:
            assert self.held is not None
            held = self.held
            try:
                self.interruption.refine(
                    loss.refine_with_server_start(
                        reason, self.database.server_start(), held.acquired_clock, held.server.server
                    )
                )
            except Exception as error:  # the reason stays as it was; the interruption must still be kept pending
                self.log.warning("pglock could not ask the server why the lock was lost: %r", error)
        held_key = self.held.key if self.held is not None else self.key  # a pool's slot: the slot
        self.log.error("pglock LOST %s: %s", held_key.describe(), self.lost)
        self.interruption.keep_pending(self._stop)

    def _abandon(self, *, give_back: bool = False) -> None:
        """Stop everything and close the lock connection (ends the session, and a transaction
        lock's transaction, so the lock goes with it). Safe to call more than once.

        :param give_back: before the work: free the key first (see :meth:`HeldLock.give_back`).
        """
        try:
            try:
                self._stop.set()
                if self._heartbeat is not None:
                    self._heartbeat.stop()  # joined first: a heartbeat still running would take the close for a loss
            finally:
                self.interruption.disarm()
        finally:  # whatever interrupts the steps before (a signal handler's exception), the lock goes
            if self.held is not None:
                if give_back:
                    self.held.give_back()
                else:
                    self.held.close()
            forks.forget(self)

    # ----------------------------------------------------------------- release

    def run(self, work: Callable[[LockHandle], T]) -> T:
        """Hold the lock around ``work(handle)``: the airtight form of the ``with`` block.

        Same outcomes as ``with guard as handle: work(handle)``; in addition, an
        interruption that lands between the end of ``work`` and the release is absorbed
        here rather than escaping the clean-up.

        :param work: the protected function; it receives the :class:`LockHandle`.
        """
        error: BaseException | None = None
        try:
            handle = self.__enter__()
        except BaseException as raised:
            if self._handle is None or self.outcome is not None:
                raise  # not taken, or taken and given up: __enter__ said so and left nothing
            # Taken, then interrupted (Airflow's timeout, Ctrl-C) before the work began: release it
            # with one outcome line, as an error of the work would.
            try:
                self.__exit__(type(raised), raised, raised.__traceback__)
            except BaseException as escaped:
                self._unreleased(escaped)
                raise
            raise
        try:
            try:
                result = work(handle)
            except BaseException as raised:
                error = raised
            while True:
                try:
                    self.interruption.disarm()
                    break
                except LockLostInterrupt as late:
                    error = error or late
        except BaseException as raised:  # e.g. Ctrl-C while disarming: still release, still one outcome
            error = error or raised
        # No call between here and the try (CPython runs a pending signal handler as a function
        # is entered, and at calls): one landing as __exit__ is entered is caught here.
        try:
            if error is not None:
                self.__exit__(type(error), error, error.__traceback__)
            else:
                if isinstance(result, HandOver) and self.scope.hands_over:
                    self._hand_over = result
                self.__exit__(None, None, None)
        except BaseException as escaped:
            self._unreleased(escaped)
            raise
        if error is not None:
            raise error
        return result

    def _unreleased(self, escaped: BaseException) -> None:
        """``__exit__`` raised ``escaped``. When that was an asynchronous exception (a signal
        handler's: Airflow's timeout, SIGTERM, Ctrl-C) landing before its clean-up said how it
        ended (as ``__exit__`` was entered, before any ``try`` of its own could catch it), give
        the lock up here all the same, with one outcome line."""
        if self.outcome is not None:
            return  # __exit__'s own ending: its clean-up ran and said so
        held = self.held
        try:
            self._abandon()
        finally:
            interrupted = f"the clean-up was interrupted before it said how it ended: {type(escaped).__name__}"
            lost = self.lost
            outcome, detail = ("failed", interrupted) if lost is None else ("lost", f"{lost} (then {interrupted})")
            self._report(outcome, detail=detail, held=held.held_seconds if held is not None else None)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        held = self.held
        assert held is not None
        lost: str | None = None
        commit_error: BaseException | None = None
        note: str | None = None
        handed: str | None = None
        finished = False
        try:
            self.interruption.disarm_absorbing()
            self._stop_heartbeat()
            lost = self.lost
            record = lambda: self._record(held)  # noqa: E731
            if lost is None and self._handle is not None and not held.connection.closed:
                # Session locks: free now (the closed session would free them only when its backend
                # ends). Transaction locks: checked and announced, to end with the commit or rollback.
                self._handle.release_all()
                in_transaction = held.connection.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
                ended = self._handle.sub_key_ended_early
                if ended is not None and held.scope == "transaction" and in_transaction:
                    lost = loss.sub_key_ended(ended.describe())  # else the commit tells what ended the transaction
            if lost is None and self.scope.kind == "member" and not held.connection.closed:
                end_member_task(self.scope, held.key, held, self.log)  # before the release: the next task's gap
            if lost is None and self._hand_over is not None:
                lost, commit_error, handed = self._pass_to_triggerer(held)
            elif lost is None and self.scope.kind == "resume" and not held.connection.closed:
                end_deferred_hold(self.scope, held.key, held, self.log)
            if lost is None and commit_error is None:
                ending = Ending(
                    held,
                    succeeded=exc_type is None,
                    record=record,
                    describe_error=self._describe_error,
                    records_completion=self._records_completion,
                    commit_status=self.database.transaction_status,
                    seen_aside=lambda: self.database.holds_seen_aside(held),
                )
                lost, commit_error, note = finish(ending)
            finished = True
            self._abandon()  # also rolls back a transaction lock's open transaction
        except BaseException as interrupted:  # an asynchronous exception during the clean-up
            outcome, detail = "failed", f"the clean-up was interrupted: {type(interrupted).__name__}"
            if finished and lost is not None:  # what the end found comes first
                outcome, detail = "lost", f"{lost} (then {detail})"
            elif finished and commit_error is not None:
                detail = f"{_FINISHING_FAILED}: {commit_error} (then {detail})"
            elif finished:
                detail = f"the clean-up was interrupted after the lock was given back: {type(interrupted).__name__}"
            try:
                self._abandon()
            finally:  # one outcome line, even when a second interruption lands in the close
                self._report(outcome, detail=detail, held=held.held_seconds)
            raise
        if lost is not None:
            self.interruption.refine(lost)
        held_for = held.held_seconds
        if lost is not None:
            # In transaction mode the lock's transaction is gone with it: nothing the work wrote
            # on its connection was committed (or, at a COMMIT whose answer was lost, that is not
            # known), so even on_lost="warn" cannot report success.
            transaction = held.scope == "transaction"
            if self.policy.on_lost == "fail" or transaction:
                self._report("lost", detail=lost, held=held_for)
                message = loss.lost_message(held.key.describe(), lost, transaction=transaction)
                raise LockLostError(message, held.key, lost) from exc
            self._report("lost", detail=loss.warned(lost), held=held_for)
            return
        if commit_error is not None:
            self._report("failed", detail=f"{_FINISHING_FAILED}: {commit_error}", held=held_for)
            raise commit_error
        if exc_type is not None:
            named = self._work_ending(exc) if self._work_ending is not None and exc is not None else None
            if named is None:
                self._report("failed", detail=f"{exc_type.__name__}: {exc}", held=held_for)
            else:
                self._report(named.outcome, detail=named.detail, held=held_for, counted_as=named.counted_as)
        else:
            self._report("deferred" if handed else "completed", detail=note or handed, held=held_for)

    def _pass_to_triggerer(self, held: HeldLock) -> tuple[str | None, BaseException | None, str | None]:
        """The work deferred: before the release, write the lease row that carries the hold until
        the trigger takes the key. Either fails the task (its deferral is then not raised: nothing
        would hold the key while the external work goes on)."""
        try:
            row = hand_over(self.scope, held.key, held, self.fencing_token)
        except LockLostError as lost:
            return lost.cause, None, None
        except psycopg.OperationalError as error:  # the session may be gone, the key with it
            return f"the hold could not pass to the triggerer: {self._describe_error(error)}", None, None
        except (PgLockError, psycopg.Error) as error:
            return None, error, None
        until = row.lease_until.isoformat(timespec="seconds")
        return None, None, f"deferred: the hold passes to the triggerer (lease until {until}, database clock)"

    def _record(self, held: HeldLock) -> bool:
        """Record the completion (once_per / min_interval) under the lock; a scope's teardown
        then frees its scope, still under the lock. False: the key was found not held."""
        if not self._records_completion:
            return True

        def record() -> bool:
            return record_success(self.rules, held, self.identity, self.fencing_token)

        if self.scope.kind == "leave":
            return record_and_free(self.scope, held.key, held, record, self.log)
        return record()

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def _describe_error(self, error: psycopg.Error) -> str:
        if self._heartbeat is not None:
            return self._heartbeat.describe_error(error)[0]
        return loss.error_reason(error, self.database.liveness.lease)[0]

    # ----------------------------------------------------------------- outcome

    def _report(
        self,
        outcome: str,
        *,
        detail: str | None = None,
        held: float | None = None,
        holders: Sequence[LockHolder] = (),
        counted_as: str | None = None,
    ) -> None:
        waited = self._wait_seconds if self.held is not None else time.monotonic() - self._started
        server = self.held.server if self.held is not None else None
        self._outcome.report(Reported(outcome, server, waited, detail, held, holders, counted_as))


_FINISHING_FAILED = "finishing failed (commit or completion record)"


def _gives_back(error: BaseException) -> bool:
    """Whether a guard that gave up with ``error`` before its work frees the key before its close:
    for a skip, a refusal or a failed check, not for an interruption (Ctrl-C, Airflow's timeout:
    no statement then) or a broken connection (the close is all there is to do)."""
    return isinstance(error, Exception) and not isinstance(error, psycopg.OperationalError)


protect_clean_up(LockGuard.__exit__, LockGuard._abandon, finish, finish_transaction, finish_session)
