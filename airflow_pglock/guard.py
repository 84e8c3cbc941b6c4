"""A guarded execution: one lock held around one piece of work, from acquisition to outcome.

The lifetime object between the Airflow adapters and the hook. It owns the policy (what
to do when the key is busy, when the lock is lost), the heartbeat that keeps a healthy
session alive and notices a lost one, and the single outcome line each execution logs.
It raises plain airflow-pglock errors; the adapters turn them into Airflow outcomes.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Literal, TypeVar

import psycopg

from airflow_pglock.exceptions import (
    AlreadyDoneError,
    LockBusyError,
    LockConfigurationError,
    LockLostError,
    LockLostInterrupt,
    PgLockError,
)
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook, HeldLock, LockHolder, Scope
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.keys import LockKey
from airflow_pglock.metrics import metric_tags, record_outcome
from airflow_pglock.registry import record_acquisition
from airflow_pglock.run_rules import RunRules, check_before_work, check_not_shared, record_success

T = TypeVar("T")
OnBusy = Literal["skip", "fail", "wait"]
OnLost = Literal["fail", "warn"]
OnError = Literal["fail", "skip"]

ON_BUSY_CHOICES: tuple[str, ...] = ("skip", "fail", "wait")
ON_LOST_CHOICES: tuple[str, ...] = ("fail", "warn")
ON_ERROR_CHOICES: tuple[str, ...] = ("fail", "skip")
MODE_CHOICES: tuple[str, ...] = ("session", "transaction")

log = logging.getLogger("airflow_pglock")

# Delivered to the guarded thread when its lock is lost; Airflow's supervisor uses
# SIGUSR2, so pick a real-time signal where the platform has one.
LOST_SIGNAL: int = getattr(signal, "SIGRTMIN", signal.SIGUSR1) + (7 if hasattr(signal, "SIGRTMIN") else 0)
# Seconds between two sends of an interruption the main thread has not taken yet.
_PENDING_INTERRUPT_REPEAT = 0.05
# Errors with which the server ends a session (its locks end with it).
_SESSION_ENDED_STATES = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03"})


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LockConfigurationError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


@dataclass(frozen=True)
class LockPolicy:
    """What a guarded execution does in each situation.

    :param mode: ``"session"`` (the lock spans any work) or ``"transaction"`` (the work
        runs inside the transaction that holds the lock, on the lock's connection).
    :param shared: take a shared lock (readers) instead of an exclusive one.
    :param on_busy: ``"skip"``, ``"fail"`` or ``"wait"`` (up to ``wait_timeout``, then skip).
    :param wait_timeout: seconds ``on_busy="wait"`` waits, enforced by the server.
    :param on_lost: ``"fail"`` (interrupt the work, fail) or ``"warn"`` (log and go on).
    :param on_error: ``"fail"`` or ``"skip"`` when the lock database cannot be used.
    """

    mode: Scope = "session"
    shared: bool = False
    on_busy: OnBusy = "skip"
    wait_timeout: float | None = None
    on_lost: OnLost = "fail"
    on_error: OnError = "fail"

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODE_CHOICES)
        _check_choice("on_busy", self.on_busy, ON_BUSY_CHOICES)
        _check_choice("on_lost", self.on_lost, ON_LOST_CHOICES)
        _check_choice("on_error", self.on_error, ON_ERROR_CHOICES)
        if not isinstance(self.shared, bool):
            raise LockConfigurationError(f"shared must be True or False, got {self.shared!r}")
        if self.on_busy == "wait":
            timeout = self.wait_timeout
            if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
                raise LockConfigurationError(
                    "on_busy='wait' needs wait_timeout, a positive number of seconds (the wait is bounded); "
                    f"got {timeout!r}"
                )
        elif self.wait_timeout is not None:
            raise LockConfigurationError(f"wait_timeout={self.wait_timeout!r} only applies with on_busy='wait'")


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
        self.fencing_token: int | None = None
        self.key = key
        self.policy = policy
        self.application_name = application_name
        self.log = logger or log
        self.held: HeldLock | None = None
        self.outcome: str | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self._armed = False  # the work runs and may be interrupted
        self._interrupt_sent = False
        self._interrupt_delivered = False
        self._guarded_thread: threading.Thread | None = None
        self._server_notice: tuple[str, str] | None = None  # (sqlstate, message) of a 57P.. notice
        self._started = 0.0
        self._wait_seconds = 0.0
        #: the busy / already-done refusal this guard raised itself (an adapter turns only
        #: that one into a skip; the same error raised by the work is a failure).
        self.refusal: LockBusyError | AlreadyDoneError | None = None

    # ------------------------------------------------------------------ acquire

    def __enter__(self) -> LockHandle:
        self._started = time.monotonic()
        try:
            self.held = self._acquire()
        except LockBusyError as busy:
            outcome = "failed" if self.policy.on_busy == "fail" else "skipped"
            self.refusal = busy
            self._log_outcome(outcome, detail=f"busy: {busy}")
            raise
        except (PgLockError, psycopg.Error) as error:
            self._log_outcome("failed", detail=f"{type(error).__name__}: {error}")
            raise
        # From here on the lock is held: one try, so that nothing (an error, Airflow's task
        # timeout, Ctrl-C) can leave the lock connection open with no outcome line.
        try:
            self._wait_seconds = time.monotonic() - self._started
            info = self.held.server
            self.log.info(
                "pglock acquired %s (%s, %s) database=%r server=%s pid=%s in %.3fs",
                self.key.describe(),
                self.policy.mode,
                "shared" if self.policy.shared else "exclusive",
                info.database,
                info.server,
                info.backend_pid,
                self._wait_seconds,
            )
            record_acquisition(self.held, self.application_name, self.log)  # optional key-name registry
            if self.rules.active:
                self.fencing_token = check_before_work(self.rules, self.held, self.application_name)
            self._start_heartbeat()
            return LockHandle(self.held, lambda: self._lost, fencing_token=self.fencing_token, period=self.rules.period)
        except BaseException as error:
            self._abandon()
            if isinstance(error, AlreadyDoneError):
                self.refusal = error
                self._log_outcome("skipped", detail=f"done: {error}")
            else:
                self._log_outcome("failed", detail=f"{type(error).__name__}: {error}")
            raise

    def _abandon(self) -> None:
        """Stop everything and close the lock connection (ends the session, and a transaction
        lock's transaction, so the lock goes with it). Safe to call more than once."""
        self._stop.set()
        with self._state_lock:
            self._armed = False
        _disarm_main_thread(self)
        if self.held is not None:
            self.held.released = True
            self.held.connection.close()

    def _acquire(self) -> HeldLock:
        timeout = self.policy.wait_timeout if self.policy.on_busy == "wait" else None
        held = self.hook.acquire_lock(
            self.key,
            shared=self.policy.shared,
            scope=self.policy.mode,
            timeout=timeout,
            application_name=self.application_name,
        )
        if held is not None:
            return held
        holders = self._holders_or_empty()
        raise LockBusyError(self._busy_message(holders, timeout), self.key, holders)

    def _holders_or_empty(self) -> list[LockHolder]:
        try:
            return self.hook.holders(self.key)
        except (PgLockError, psycopg.Error) as error:
            self.log.warning("pglock could not read the holders of %s: %s", self.key.describe(), error)
            return []

    def _busy_message(self, holders: list[LockHolder], timeout: float | None) -> str:
        now = dt.datetime.now(dt.UTC)
        granted = [h for h in holders if h.granted]
        who = "; ".join(h.describe(now) for h in granted) if granted else "a session that released it since"
        waited = f" after waiting {timeout:g} s" if timeout is not None else ""
        return f"{self.key.describe()} is held by {who}{waited}"

    # ---------------------------------------------------------------- heartbeat

    def _start_heartbeat(self) -> None:
        assert self.held is not None
        self._guarded_thread = threading.current_thread()
        if self.policy.on_lost == "fail":
            with self._state_lock:
                self._armed = True
            if self._guarded_thread is threading.main_thread():
                _arm_main_thread(self)
        # A server that ends every session (crash, immediate shutdown) says why in a notice
        # just before it hangs up; the error the client then sees does not.
        self.held.connection.add_notice_handler(self._on_notice)
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name=f"pglock-heartbeat-{self.held.server.backend_pid}", daemon=True
        )
        self._heartbeat.start()

    def _on_notice(self, diagnostic: psycopg.errors.Diagnostic) -> None:
        if (diagnostic.sqlstate or "").startswith("57P"):
            self._server_notice = (diagnostic.sqlstate or "", diagnostic.message_primary or "")

    def _heartbeat_loop(self) -> None:
        """Probe every ``lease / 3`` s; on loss, interrupt the work (``on_lost="fail"``) and stop.

        A probe must be answered within ``2 * lease / 3`` s of the last confirmed one (or
        within a short grace when this process itself stalled past that), so the holder
        gives its lock up for lost before the server can release it (``lease`` s of silence).
        """
        held = self.held
        assert held is not None
        liveness = self.hook.liveness
        interval = liveness.heartbeat_interval
        grace = min(interval, 1.0)
        confirmed = held.acquired_monotonic  # the lock statement was answered: the session is not idle before

        def no_answer_reason() -> str:
            silent = time.monotonic() - confirmed
            return (
                f"no answer from the lock database for {silent:.1f} s (the network to {held.server.server} is "
                "cut, or the server or this process was frozen); the server releases the lock of a session "
                f"silent for the lease ({liveness.lease:g} s), so it is given up for lost now"
            )

        while not self._stop.wait(max(0.0, confirmed + interval - time.monotonic())):
            started = time.monotonic()
            budget = max(confirmed + liveness.loss_deadline - started, grace)
            try:
                result = self.hook.probe(
                    held.connection,
                    self.key,
                    self.policy.shared,
                    budget,
                    xact_id=held.xact_id,
                    before_giving_up=lambda: self._on_lost(no_answer_reason()),  # interrupt, then close
                )
            except psycopg.Error as error:
                if not held.connection.closed and self._is_ordinary_error(error):
                    confirmed = started  # the session answered (e.g. the work's transaction is aborted): alive
                    continue
                reason, ask_server = self._describe_error(error)
                self._lose(reason, ask_server=ask_server)
                return
            except Exception as error:  # never let the heartbeat die silently: a silent heartbeat loses the lock
                self._lose(f"the heartbeat failed ({type(error).__name__}: {error})", ask_server=False)
                return
            if result == "busy":
                # The work is using the connection (a statement, COPY, a stream, a pipeline), and has
                # been since the last answer, at least one interval ago. A busy connection is no proof
                # that the session still holds the lock: ask the server from a side connection.
                seen = self.hook.holds_seen_from_aside(held)
                if seen is None:  # the server cannot be reached either: silent, as a probe without answer
                    if time.monotonic() - confirmed >= liveness.loss_deadline:
                        self._lose(no_answer_reason(), ask_server=False)
                        return
                    continue
                if not seen:
                    self._lose(
                        "the lock session no longer holds the key (seen from a side connection while the work kept "
                        "the lock's connection busy: the session was terminated, or its transaction ended)",
                        ask_server=True,
                    )
                    return
                result = "held"
            if result == "held":
                confirmed = started
            elif result == "not held":
                self._lose(self._not_held_reason(), ask_server=False)
                return
            else:
                self._lose(self._lost or no_answer_reason(), ask_server=False)
                return

    @staticmethod
    def _is_ordinary_error(error: psycopg.Error) -> bool:
        """An error the session survives, with its locks (e.g. a statement in an aborted transaction)."""
        state = getattr(error, "sqlstate", None) or ""
        return bool(state) and state[:2] != "08" and state not in _SESSION_ENDED_STATES

    def _describe_error(self, error: psycopg.Error) -> tuple[str, bool]:
        """Why the session ended, as far as the error tells; and whether asking the server may tell more."""
        state = getattr(error, "sqlstate", None) or ""
        text = str(error).strip().splitlines()
        detail = text[0] if text else type(error).__name__
        if not state and self._server_notice is not None:
            state, detail = self._server_notice
        lease = self.hook.liveness.lease
        if state == "57P01":
            return "the session was terminated (pg_terminate_backend() or a server shutdown)", True
        if state in {"57P02", "57P03"}:
            return f"the PostgreSQL server crashed or is shutting down ({detail})", True
        if state == "57P05":
            return (
                f"the server ended the session after the lease ({lease:g} s) without a heartbeat "
                "(idle_session_timeout): this process was frozen, stalled or cut off from the server for longer "
                "than the lease",
                False,
            )
        if state == "25P03":
            return (
                f"the server ended the session after the lease ({lease:g} s) idle in its transaction "
                "(idle_in_transaction_session_timeout): this process was frozen, stalled or cut off for longer "
                "than the lease",
                False,
            )
        return f"the connection to the lock database broke ({type(error).__name__}: {detail})", True

    def _not_held_reason(self) -> str:
        if self.policy.mode == "transaction":
            return (
                "the transaction holding the lock ended while the work ran (a COMMIT or ROLLBACK on the lock's "
                "connection releases a transaction-level lock; a session that ended takes it along)"
            )
        return "the session is alive but no longer holds the key (something on this connection unlocked it)"

    def _explain_with_server(self, reason: str) -> str:
        """Refine a vague loss reason by asking the server (fresh connection, 2 s connect timeout)."""
        assert self.held is not None
        started = self.hook.server_started_at()
        if started is None:
            return (
                "the PostgreSQL server shut down, crashed or is restarting: it does not accept connections now "
                f"(the lock session ended with: {reason})"
            )
        if started > self.held.server.started_at:
            when = started.isoformat(timespec="seconds")
            return f"the PostgreSQL server restarted at {when} (the lock session ended with it)"
        if reason.startswith("the session was terminated"):
            return (
                "the session was terminated by pg_terminate_backend() (an administrator or a tool ended it; "
                "the server did not restart)"
            )
        return reason

    def _lose(self, reason: str, *, ask_server: bool) -> None:
        """Record the loss and interrupt the work at once; then refine the reason if the server can tell more."""
        self._on_lost(reason)
        if ask_server:
            refined = self._explain_with_server(reason)
            with self._state_lock:
                self._lost = refined
        self.log.error("pglock LOST %s: %s", self.key.describe(), self._lost)
        self._keep_interrupt_pending()

    def _keep_interrupt_pending(self) -> None:
        """Main thread: send the interruption again until it is delivered or the guard disarms.

        The signal handler does not raise inside a guard's own clean-up (e.g. an inner
        guard's release, when guards nest); the signal is consumed then, so it is repeated.
        """
        while not self._stop.wait(_PENDING_INTERRUPT_REPEAT):
            with self._state_lock:
                if not self._armed or self._interrupt_delivered or self._guarded_thread is not threading.main_thread():
                    return
                signal.pthread_kill(self._guarded_thread.ident or 0, LOST_SIGNAL)

    def _on_lost(self, reason: str) -> None:
        with self._state_lock:
            if self._lost is None:
                self._lost = reason
            if not self._armed or self._interrupt_sent or self._guarded_thread is None:
                return
            self._interrupt_sent = True
            ident = self._guarded_thread.ident or 0
            if self._guarded_thread is threading.main_thread():
                signal.pthread_kill(ident, LOST_SIGNAL)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(LockLostInterrupt))

    def _take_interrupt(self) -> str | None:
        """Called by the signal handler in the guarded (main) thread: the reason to raise, once."""
        if not self._armed or self._lost is None or self._interrupt_delivered:
            return None
        self._interrupt_delivered = True
        return self._lost

    def _disarm(self) -> None:
        """No interruption from now on (idempotent); an undelivered one is cancelled."""
        with self._state_lock:
            if not self._armed:
                return
            self._armed = False
            if self._interrupt_sent and self._guarded_thread is not threading.main_thread():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._guarded_thread.ident or 0), None)  # type: ignore[union-attr]
        _disarm_main_thread(self)

    def _disarm_absorbing(self) -> None:
        # An interruption raised while disarming (it may land at any bytecode until then) is absorbed.
        while True:
            try:
                self._disarm()
                return
            except LockLostInterrupt:
                continue

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        heartbeat = self._heartbeat
        if heartbeat is not None and heartbeat is not threading.current_thread():
            # Every step of the heartbeat is bounded: a probe by the loss deadline, a server
            # check by its 2 s connect timeout.
            heartbeat.join(timeout=self.hook.liveness.loss_deadline + 5)

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
                    self._disarm()
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
        try:
            self._disarm_absorbing()
            self._stop_heartbeat()
            lost = self._lost
            if held.scope == "transaction":
                if lost is None:
                    lost, commit_error = self._finish_transaction(held, exc_type is None)
            elif lost is None and not held.connection.closed:
                lost, commit_error = self._finish_session(held, exc_type is None)
            elif lost is None:
                lost = "found at release: the lock connection was closed"
        except BaseException as interrupted:  # an asynchronous exception during the clean-up
            self._abandon()
            self._log_outcome(
                "failed", detail=f"the clean-up was interrupted: {type(interrupted).__name__}", held=held.held_seconds
            )
            raise
        finally:
            self._abandon()  # also rolls back a transaction lock's open transaction
        if lost is not None:
            with self._state_lock:
                self._lost = lost
        held_for = held.held_seconds
        if lost is not None:
            # In transaction mode the lock's transaction is gone with it: nothing the work wrote
            # on its connection was committed, so even on_lost="warn" cannot report success.
            if self.policy.on_lost == "fail" or held.scope == "transaction":
                self._log_outcome("lost", detail=lost, held=held_for)
                rolled_back = " (transaction mode: nothing written on the lock's connection was committed)"
                message = (
                    f"lost {self.key.describe()} while the task ran: {lost}. Another worker may now run the same "
                    "work; this run is marked failed instead of successful"
                    + (rolled_back if held.scope == "transaction" else "")
                )
                raise LockLostError(message, self.key, lost) from exc
            warned = f"{lost} (on_lost='warn': the work went on without the lock)"
            self._log_outcome("lost", detail=warned, held=held_for)
            return
        if commit_error is not None:
            self._log_outcome(
                "failed", detail=f"finishing failed (commit or completion record): {commit_error}", held=held_for
            )
            raise commit_error
        if exc_type is not None:
            self._log_outcome("failed", detail=f"{exc_type.__name__}: {exc}", held=held_for)
        else:
            self._log_outcome("completed", held=held_for)

    def _finish_transaction(self, held: HeldLock, succeeded: bool) -> tuple[str | None, BaseException | None]:
        """Transaction mode: (loss found, error in finishing). Commits only if the work
        succeeded and the session is still in the lock's transaction, holding the key."""
        ended_by_work = (
            "the work ended the lock's transaction itself (COMMIT or ROLLBACK on lock.connection): the lock ended "
            "with it, and what ran afterwards ran without the lock"
        )
        status = held.connection.info.transaction_status
        if status == psycopg.pq.TransactionStatus.IDLE:
            return ended_by_work, None
        if not succeeded:
            return None, None  # closing the connection rolls the work back
        try:
            if status == psycopg.pq.TransactionStatus.INTRANS and not self.hook.is_held(
                held.connection, self.key, self.policy.shared, held.xact_id
            ):
                return ended_by_work, None
            if not record_success(self.rules, held, self.identity, self.fencing_token):  # same transaction
                return ended_by_work, None
            self.hook.commit(held.connection)
        except psycopg.Error as error:
            if held.connection.closed or not self._is_ordinary_error(error):
                return f"found at commit: {self._describe_error(error)[0]}", None
            return None, error
        except PgLockError as error:
            return None, error
        return None, None

    def _finish_session(self, held: HeldLock, succeeded: bool) -> tuple[str | None, BaseException | None]:
        """Session mode: record the completion (only while the key is held), then unlock."""
        commit_error: BaseException | None = None
        lost: str | None = None
        if succeeded:
            try:
                if not record_success(self.rules, held, self.identity, self.fencing_token):
                    lost = "found at completion: the session no longer held the key (nothing recorded)"
            except (psycopg.Error, PgLockError) as error:
                commit_error = error
        try:
            still_held = self.hook.unlock(held.connection, self.key, shared=self.policy.shared)
        except psycopg.Error as error:
            still_held = False
            lost = self._describe_error(error)[0]
        if not still_held:
            lost = f"found at release: {lost or 'the session no longer held the key'}"
        return lost, (None if lost is not None else commit_error)

    # ----------------------------------------------------------------- logging

    def _target_text(self) -> str:
        try:
            return self.hook.describe_target()
        except Exception:  # the connection itself may be what is wrong; the error says why
            return f"conn id {self.hook.postgres_conn_id!r}"

    def _log_outcome(self, outcome: str, *, detail: str | None = None, held: float | None = None) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        parts = [f"pglock outcome={outcome}", self.key.describe(), f"mode={self.policy.mode}"]
        waited = self._wait_seconds if self.held is not None else time.monotonic() - self._started
        if self.held is not None:
            parts += [
                f"database={self.held.server.database!r}",
                f"server={self.held.server.server}",
                f"pid={self.held.server.backend_pid}",
                f"waited={waited:.3f}s",
            ]
        else:
            parts.append(f"target={self._target_text()}")
            parts.append(f"waited={waited:.3f}s")
        if held is not None:
            parts.append(f"held={held:.3f}s")
        if detail:
            parts.append(f"- {detail}")
        line = " ".join(part for part in parts if part)
        if (outcome == "completed" and not detail) or outcome == "skipped":
            self.log.info(line)
        else:
            self.log.error(line) if outcome in {"failed", "lost"} else self.log.warning(line)
        busy = self.held is None and bool(detail and detail.startswith("busy"))
        record_outcome(
            "busy" if busy and outcome == "failed" else outcome,
            acquired=self.held is not None,
            waited=waited,
            held=held,
            tags=metric_tags(
                application_name=self.application_name,
                mode=self.policy.mode,
                shared=self.policy.shared,
                on_busy=self.policy.on_busy,
            ),
        )


# ------------------------------------------------------- interrupting the main thread
# One handler for LOST_SIGNAL, installed the first time a guard is armed in the main
# thread and left in place (it does nothing when no guard claims the signal; restoring
# SIG_DFL could let a late signal kill the process). Guards may nest: each armed guard is
# on this stack; a lost one raises LockLostInterrupt in whatever the main thread runs,
# except inside the guard's own clean-up.
_armed_in_main: list[LockGuard] = []
_chained_handler: Any = None
_handler_installed = False


def _lost_signal_handler(signum: int, frame: FrameType | None) -> None:
    if _in_guard_clean_up(frame):
        return  # the heartbeat sends it again (see LockGuard._keep_interrupt_pending)
    for guard in reversed(_armed_in_main):
        reason = guard._take_interrupt()
        if reason is not None:
            raise LockLostInterrupt(f"lost {guard.key.describe()}: {reason}")
    if callable(_chained_handler):
        _chained_handler(signum, frame)


def _in_guard_clean_up(frame: FrameType | None) -> bool:
    """Whether the main thread is inside some guard's clean-up (anywhere down the stack)."""
    while frame is not None:
        if frame.f_code in _NO_INTERRUPT_CODE:
            return True
        frame = frame.f_back
    return False


def _arm_main_thread(guard: LockGuard) -> None:
    global _chained_handler, _handler_installed
    if not _handler_installed:
        _chained_handler = signal.signal(LOST_SIGNAL, _lost_signal_handler)
        _handler_installed = True
    _armed_in_main.append(guard)


def _disarm_main_thread(guard: LockGuard) -> None:
    if guard in _armed_in_main:
        _armed_in_main.remove(guard)


_NO_INTERRUPT_CODE = frozenset(
    function.__code__
    for function in (
        LockGuard.__exit__,
        LockGuard._abandon,
        LockGuard._finish_transaction,
        LockGuard._finish_session,
        LockGuard._disarm,
        LockGuard._disarm_absorbing,
        _disarm_main_thread,
    )
)
