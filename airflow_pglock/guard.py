"""A guarded execution: one lock held around one piece of work, from acquisition to outcome.

The lifetime object between the Airflow adapters and the hook. :class:`LockGuard`
coordinates small parts with one job each: the held lock (hook; it owns its release and
commit), the run rules, the :class:`~airflow_pglock.heartbeat.Heartbeat` that keeps a
healthy session alive and notices a lost one, the
:class:`~airflow_pglock.interruption.Interruption` of the work, the words of
:mod:`~airflow_pglock.loss`, and the single :class:`~airflow_pglock.outcome.OutcomeLine`
each execution logs. It raises plain airflow-pglock errors; the adapters turn them into
Airflow outcomes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar

import psycopg

from airflow_pglock import loss
from airflow_pglock.exceptions import (
    AlreadyDoneError,
    LockBusyError,
    LockLostError,
    LockLostInterrupt,
    PgLockError,
)
from airflow_pglock.finish import finish_session, finish_transaction
from airflow_pglock.heartbeat import Heartbeat
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook, HeldLock, Scope
from airflow_pglock.hooks.holders import describe_holders
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.interruption import LOST_SIGNAL, Interruption, protect_clean_up
from airflow_pglock.keys import LockKey, slot_keys
from airflow_pglock.lock_set import AnyKey, LockSet, SubLock
from airflow_pglock.outcome import OutcomeContext, OutcomeLine
from airflow_pglock.policy import LockPolicy, OnBusy, OnError, OnLost
from airflow_pglock.registry import record_acquisition
from airflow_pglock.run_rules import RunRules, check_before_work, check_not_shared, record_success

__all__ = ["LOST_SIGNAL", "LockGuard", "LockHandle", "LockPolicy", "OnBusy", "OnError", "OnLost"]

T = TypeVar("T")

log = logging.getLogger("airflow_pglock")


class LockHandle:
    """What the protected work sees of its lock.

    :ivar key: the key held.
    :ivar connection: in transaction mode, the connection whose open transaction holds
        the lock (do the protected database work on it); None in session mode.
    :ivar acquired_at: when the lock was taken (UTC).
    :ivar fencing_token: this acquisition's fencing token (``fencing=True``), else None.
    :ivar period: the ``once_per`` period being done, else None.
    """

    def __init__(
        self,
        held: HeldLock,
        lost_reason: Callable[[], str | None],
        *,
        fencing_token: int | None = None,
        period: str | None = None,
    ) -> None:
        self._held = held
        self.fencing_token = fencing_token
        self.period = period
        self._lost_reason = lost_reason
        self.key: LockKey = held.key
        self.mode: Scope = held.scope
        self.shared: bool = held.shared
        self.acquired_at: dt.datetime = held.acquired_at
        self.database: str = held.server.database
        self.server: str = held.server.server
        self.backend_pid: int = held.server.backend_pid
        self.connection: psycopg.Connection[Any] | None = held.connection if held.scope == "transaction" else None
        self._keys = LockSet(held.connection, lost_reason, reserved=held.key, can_wait=held.scope == "session")

    # Sub-keys on the task's own connection, covered by its heartbeat (see lock_set.LockSet).

    def try_lock(self, key: AnyKey, shared: bool = False) -> contextlib.AbstractContextManager[SubLock | None]:
        """Try once to take another key (e.g. a tenant) for a ``with`` block; None when busy."""
        return self._keys.try_lock(key, shared)

    def lock(
        self, key: AnyKey, *, timeout: float, shared: bool = False
    ) -> contextlib.AbstractContextManager[SubLock | None]:
        """Wait at most ``timeout`` seconds (server-side) for another key; None if it ran out."""
        return self._keys.lock(key, timeout=timeout, shared=shared)

    def try_lock_many(self, keys: Iterable[AnyKey], shared: bool = False) -> list[SubLock]:
        """Try many keys in one round trip; the ones taken (held until released or the task ends)."""
        return self._keys.try_lock_many(keys, shared)

    def release(self, *locks: SubLock | AnyKey) -> bool:
        """Release sub-keys taken through this handle; whether each was still held."""
        return self._keys.release(*locks)

    def held(self) -> list[LockKey]:
        """The sub-keys held now (not the task's own key)."""
        return self._keys.held()

    def release_all(self) -> bool:
        """Release every sub-key held now (one round trip; the task's own key stays held)."""
        return self._keys.release_all()

    @property
    def lost(self) -> str | None:
        """Why the lock was lost, or None while it is held (as of the last heartbeat)."""
        return self._lost_reason()

    def check(self) -> None:
        """Raise LockLostError if the heartbeat found the lock lost."""
        reason = self.lost
        if reason is not None:
            raise LockLostError(f"lost {self.key.describe()}: {reason}", self.key, reason)

    def __repr__(self) -> str:
        return f"LockHandle({self.key.describe()}, mode={self.mode}, shared={self.shared})"


def busy_error(
    hook: AdvisoryLockHook, key: LockKey, timeout: float | None, logger: Any, slots: int = 1
) -> LockBusyError:
    """The refusal for a busy key (or full pool), naming who holds it (as far as the server can still tell)."""
    try:
        holders = hook.holders(key, slots=slots)
    except (PgLockError, psycopg.Error) as error:
        logger.warning("pglock could not read the holders of %s: %s", key.describe(), error)
        holders = []
    who = describe_holders(holders, dt.datetime.now(dt.timezone.utc), nobody="a session that released it since")
    waited = f" after waiting {timeout:g} s" if timeout is not None else ""
    if slots == 1:
        return LockBusyError(f"{key.describe()} is held by {who}{waited}", key, holders)
    return LockBusyError(f"all {slots} slots of the pool {key.describe()} are held, by {who}{waited}", key, holders)


class LockGuard:
    """Hold ``key`` around a ``with`` block according to ``policy``.

    ``__enter__`` acquires (or raises LockBusyError / a connection or set-up error, after
    logging the outcome) and returns a :class:`LockHandle`. ``__exit__`` stops the
    heartbeat, releases (or commits / rolls back in transaction mode), closes the
    connection and logs exactly one outcome line. A lock lost during the block raises
    LockLostError (``on_lost="fail"``), also when the block itself succeeded.

    While the block runs, a heartbeat thread probes the lock every ``lease / 3`` s. With
    ``on_lost="fail"`` a loss interrupts the block: :class:`LockLostInterrupt` is raised in
    the guarded thread (at once in the main thread, via a signal; at its next Python
    bytecode in another thread). :meth:`run` is the airtight form of the ``with`` block.

    :param hook: the hook that opens the dedicated connection.
    :param key: the key to hold.
    :param policy: what to do when busy, lost, ...
    :param application_name: names the holder in ``pg_stat_activity``.
    :param logger: where the acquisition and outcome lines go.
    :param rules: once_per / min_interval / fencing, checked and recorded under the lock.
    :param identity: the Airflow task instance, recorded with a completion.
    """

    def __init__(
        self,
        hook: AdvisoryLockHook,
        key: LockKey,
        policy: LockPolicy,
        *,
        application_name: str | None = None,
        logger: logging.Logger | Any | None = None,
        rules: RunRules | None = None,
        identity: TaskIdentity | None = None,
    ) -> None:
        self.hook = hook
        self.rules = rules or RunRules()
        check_not_shared(self.rules, policy.shared)
        self.identity = identity
        self.key = key
        self.policy = policy
        self.application_name = application_name
        self.log = logger or log
        self.held: HeldLock | None = None
        self.fencing_token: int | None = None
        #: the busy / already-done refusal this guard raised itself (an adapter turns only
        #: that one into a skip; the same error raised by the work is a failure).
        self.refusal: LockBusyError | AlreadyDoneError | None = None
        self.interruption = Interruption(key.describe())
        self._stop = threading.Event()
        self._heartbeat: Heartbeat | None = None
        self._outcome = OutcomeLine(
            self.log,
            OutcomeContext(
                key, policy.mode, policy.shared, policy.on_busy, application_name, self._target_text, policy.slots
            ),
        )
        self._started = 0.0
        self._wait_seconds = 0.0
        self._handle: LockHandle | None = None

    @property
    def outcome(self) -> str | None:
        """``completed``, ``skipped``, ``failed`` or ``lost`` once logged, else None."""
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
            self._report(self.policy.busy_outcome(), detail=f"busy: {busy}")
            raise
        except (PgLockError, psycopg.Error) as error:
            self._report("failed", detail=f"{type(error).__name__}: {error}")
            raise
        # From here on the lock is held: one try, so that nothing (an error, Airflow's task
        # timeout, Ctrl-C) can leave the lock connection open with no outcome line.
        try:
            self._wait_seconds = time.monotonic() - self._started
            self._log_acquired(self.held)
            record_acquisition(self.held, self.application_name, self.log, self.policy.slots)  # written at release
            if self.rules.active:
                self.fencing_token = check_before_work(self.rules, self.held, self.application_name)
            self.interruption.arm(interrupt=self.policy.on_lost == "fail")
            self._heartbeat = Heartbeat(self.hook, self.held, self._lose, self.interruption.lost, self._stop)
            self._heartbeat.start()
            self._handle = LockHandle(
                self.held, lambda: self.lost, fencing_token=self.fencing_token, period=self.rules.period
            )
            return self._handle
        except BaseException as error:
            self._abandon()
            if isinstance(error, AlreadyDoneError):
                self.refusal = error
                self._report("skipped", detail=f"done: {error}")
            else:
                self._report("failed", detail=f"{type(error).__name__}: {error}")
            raise

    def _acquire(self) -> HeldLock:
        timeout = self.policy.wait_timeout if self.policy.on_busy == "wait" else None
        held = self.hook.acquire_lock(
            self.key,
            shared=self.policy.shared,
            scope=self.policy.mode,
            timeout=timeout,
            application_name=self.application_name,
            slots=self.policy.slots,
        )
        if held is not None:
            if self.policy.slots > 1:  # a slot of a pool: the outcome line names the slot taken
                slot = slot_keys(self.key, self.policy.slots).index(held.key) + 1
                self._outcome.context = dataclasses.replace(self._outcome.context, key=held.key, slot=slot)
                self.interruption.label = held.key.describe()
            return held
        raise busy_error(self.hook, self.key, timeout, self.log, self.policy.slots)

    def _log_acquired(self, held: HeldLock) -> None:
        self.log.info(
            "pglock acquired %s (%s, %s) database=%r server=%s pid=%s in %.3fs",
            held.key.describe(),
            self.policy.mode,
            "shared" if self.policy.shared else "exclusive",
            held.server.database,
            held.server.server,
            held.server.backend_pid,
            self._wait_seconds,
        )

    # --------------------------------------------------------------------- loss

    def _lose(self, reason: str, ask_server: bool) -> None:
        """From the heartbeat: record the loss and interrupt the work at once; then refine the
        reason if the server can tell more; keep the interruption pending until taken."""
        self.interruption.lost(reason)
        if ask_server:
            assert self.held is not None
            self.interruption.refine(
                loss.refine_with_server_start(reason, self.hook.server_started_at(), self.held.server.started_at)
            )
        held_key = self.held.key if self.held is not None else self.key  # a pool's slot: the slot
        self.log.error("pglock LOST %s: %s", held_key.describe(), self.lost)
        self.interruption.keep_pending(self._stop)

    def _abandon(self) -> None:
        """Stop everything and close the lock connection (ends the session, and a transaction
        lock's transaction, so the lock goes with it). Safe to call more than once."""
        self._stop.set()
        self.interruption.disarm()
        if self.held is not None:
            self.held.close()

    # ----------------------------------------------------------------- release

    def run(self, work: Callable[[LockHandle], T]) -> T:
        """Hold the lock around ``work(handle)``: the airtight form of the ``with`` block.

        Same outcomes as ``with guard as handle: work(handle)``; in addition, an
        interruption that lands between the end of ``work`` and the release is absorbed
        here rather than escaping the clean-up.

        :param work: the protected function; it receives the :class:`LockHandle`.
        """
        handle = self.__enter__()
        error: BaseException | None = None
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
        if error is not None:
            self.__exit__(type(error), error, error.__traceback__)
            raise error
        self.__exit__(None, None, None)
        return result

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        held = self.held
        assert held is not None
        lost: str | None = None
        commit_error: BaseException | None = None
        note: str | None = None
        try:
            self.interruption.disarm_absorbing()
            self._stop_heartbeat()
            lost = self.lost
            record = lambda: record_success(self.rules, held, self.identity, self.fencing_token)  # noqa: E731
            if lost is None and self._handle is not None and not held.connection.closed:
                self._handle.release_all()  # free now; the closed session would free them only when its backend ends
            if lost is None and held.scope == "transaction":
                lost, commit_error, note = finish_transaction(held, exc_type is None, record, self._describe_error)
            elif lost is None and not held.connection.closed:
                lost, commit_error, note = finish_session(
                    held,
                    exc_type is None,
                    record,
                    self._describe_error,
                    records_completion=self.rules.records_completion,
                )
            elif lost is None:
                lost = loss.CLOSED_AT_RELEASE
        except BaseException as interrupted:  # an asynchronous exception during the clean-up
            self._abandon()
            detail = f"the clean-up was interrupted: {type(interrupted).__name__}"
            self._report("failed", detail=detail, held=held.held_seconds)
            raise
        finally:
            self._abandon()  # also rolls back a transaction lock's open transaction
        if lost is not None:
            self.interruption.refine(lost)
        held_for = held.held_seconds
        if lost is not None:
            # In transaction mode the lock's transaction is gone with it: nothing the work wrote
            # on its connection was committed, so even on_lost="warn" cannot report success.
            transaction = held.scope == "transaction"
            if self.policy.on_lost == "fail" or transaction:
                self._report("lost", detail=lost, held=held_for)
                message = loss.lost_message(held.key.describe(), lost, transaction=transaction)
                raise LockLostError(message, held.key, lost) from exc
            self._report("lost", detail=loss.warned(lost), held=held_for)
            return
        if commit_error is not None:
            self._report(
                "failed", detail=f"finishing failed (commit or completion record): {commit_error}", held=held_for
            )
            raise commit_error
        if exc_type is not None:
            self._report("failed", detail=f"{exc_type.__name__}: {exc}", held=held_for)
        else:
            self._report("completed", detail=note, held=held_for)

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def _describe_error(self, error: psycopg.Error) -> str:
        if self._heartbeat is not None:
            return self._heartbeat.describe_error(error)[0]
        text = str(error).strip().splitlines()
        detail = text[0] if text else type(error).__name__
        state = getattr(error, "sqlstate", None) or ""
        return loss.session_end_reason(state, detail, type(error).__name__, self.hook.liveness.lease)[0]

    # ----------------------------------------------------------------- outcome

    def _report(self, outcome: str, *, detail: str | None = None, held: float | None = None) -> None:
        waited = self._wait_seconds if self.held is not None else time.monotonic() - self._started
        server = self.held.server if self.held is not None else None
        self._outcome.report(outcome, server=server, waited=waited, detail=detail, held=held)

    def _target_text(self) -> str:
        try:
            return self.hook.describe_target()
        except Exception:  # the connection itself may be what is wrong; the error says why
            return f"conn id {self.hook.postgres_conn_id!r}"


protect_clean_up(LockGuard.__exit__, LockGuard._abandon, finish_transaction, finish_session)
