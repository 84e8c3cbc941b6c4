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
from airflow_pglock.run_rules import RunRules, check_before_work, record_success

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

    # ------------------------------------------------------------------ acquire

    def __enter__(self) -> LockHandle:
        self._started = time.monotonic()
        try:
            self.held = self._acquire()
        except LockBusyError as busy:
            outcome = "failed" if self.policy.on_busy == "fail" else "skipped"
            self._log_outcome(outcome, detail=f"busy: {busy}")
            raise
        except (PgLockError, psycopg.Error) as error:
            self._log_outcome("failed", detail=f"{type(error).__name__}: {error}")
            raise
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
        try:
            record_acquisition(self.held, self.application_name, self.log)  # optional key-name registry
            self._apply_run_rules()
            self._start_heartbeat()
        except BaseException:  # e.g. Airflow's task timeout: never leave the lock connection open
            self._stop.set()
            self.held.released = True
            self.held.connection.close()
            raise
        return LockHandle(self.held, lambda: self._lost, fencing_token=self.fencing_token, period=self.rules.period)

    def _apply_run_rules(self) -> None:
        """once_per / min_interval / fencing, under the lock; on a skip or error nothing is left held."""
        if not self.rules.active:
            return
        assert self.held is not None
        try:
            self.fencing_token = check_before_work(self.rules, self.held, self.application_name)
        except BaseException as error:
            self.held.released = True
            self.held.connection.close()  # ends the session (and a transaction lock's transaction)
            if isinstance(error, AlreadyDoneError):
                self._log_outcome("skipped", detail=f"done: {error}")
            else:
                self._log_outcome("failed", detail=f"{type(error).__name__}: {error}")
            raise

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
        now = dt.datetime.now(dt.timezone.utc)
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
        while not self._stop.wait(max(0.0, confirmed + interval - time.monotonic())):
            started = time.monotonic()
            budget = max(confirmed + liveness.loss_deadline - started, grace)
            try:
                result = self.hook.probe(held.connection, self.key, self.policy.shared, budget)
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
            if result == "held":
                confirmed = started
            elif result == "busy":
                confirmed = time.monotonic()  # the work is running a statement on it: the session is not idle
            elif result == "not held":
                self._lose(self._not_held_reason(), ask_server=False)
                return
            else:
                silent = time.monotonic() - confirmed
                self._lose(
                    f"no answer from the lock database for {silent:.1f} s (the network to {held.server.server} is "
                    "cut, or the server or this process was frozen); the server releases the lock of a session "
                    f"silent for the lease ({liveness.lease:g} s), so it is given up for lost now",
                    ask_server=False,
                )
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
                "connection releases a transaction-level lock)"
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
            result = work(handle)
        except BaseException as raised:
            error = raised
        while True:
            try:
                self._disarm()
                break
            except LockLostInterrupt as late:
                error = error or late
        if error is not None:
            self.__exit__(type(error), error, error.__traceback__)
            raise error
        self.__exit__(None, None, None)
        return result

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._disarm_absorbing()
        self._stop_heartbeat()
        held = self.held
        assert held is not None
        lost = self._lost
        commit_error: BaseException | None = None
        try:
            if held.scope == "transaction":
                if lost is None and held.connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                    lost = (
                        "the work ended the lock's transaction itself (COMMIT or ROLLBACK on lock.connection): "
                        "the lock ended with it, and what ran afterwards ran without the lock"
                    )
                elif lost is None and exc_type is None:
                    try:
                        record_success(self.rules, held, self.identity, self.fencing_token)  # same transaction
                        self.hook.commit(held.connection)
                    except (psycopg.Error, PgLockError) as error:
                        commit_error = error
            elif lost is None and not held.connection.closed:
                if exc_type is None:
                    try:
                        record_success(self.rules, held, self.identity, self.fencing_token)
                    except (psycopg.Error, PgLockError) as error:
                        commit_error = error
                try:
                    still_held = self.hook.unlock(held.connection, self.key, shared=self.policy.shared)
                except psycopg.Error as error:
                    still_held = False
                    lost = self._describe_error(error)[0]
                if not still_held:
                    lost = f"found at release: {lost or 'the session no longer held the key'}"
            elif lost is None:
                lost = "found at release: the lock connection was closed"
        finally:
            held.released = True
            held.connection.close()  # also rolls back a transaction lock's open transaction
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
    if frame is not None and frame.f_code in _NO_INTERRUPT_CODE:
        return
    for guard in reversed(_armed_in_main):
        reason = guard._take_interrupt()
        if reason is not None:
            raise LockLostInterrupt(f"lost {guard.key.describe()}: {reason}")
    if callable(_chained_handler):
        _chained_handler(signum, frame)


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
        LockGuard._disarm,
        LockGuard._disarm_absorbing,
        _disarm_main_thread,
    )
)
