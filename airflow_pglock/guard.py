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
from types import TracebackType
from typing import Any, Literal

import psycopg

from airflow_pglock.exceptions import LockBusyError, LockConfigurationError, LockLostError, PgLockError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook, HeldLock, LockHolder, Scope
from airflow_pglock.keys import LockKey

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
    """

    def __init__(self, held: HeldLock, lost_reason: Callable[[], str | None]) -> None:
        self._held = held
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


class _LostInterrupt(Exception):  # noqa: N818 - raised asynchronously, carries no message
    """Raised inside the guarded thread when its lock is lost (replaced by LockLostError)."""


class LockGuard:
    """Hold ``key`` around a ``with`` block according to ``policy``.

    ``__enter__`` acquires (or raises LockBusyError / a connection or set-up error, after
    logging the outcome) and returns a :class:`LockHandle`. ``__exit__`` stops the
    heartbeat, releases (or commits / rolls back in transaction mode), closes the
    connection and logs exactly one outcome line. A lock lost during the block raises
    LockLostError (``on_lost="fail"``), also when the block itself succeeded.

    :param hook: the hook that opens the dedicated connection.
    :param key: the key to hold.
    :param policy: what to do when busy, lost, ...
    :param application_name: names the holder in ``pg_stat_activity``.
    :param logger: where the acquisition and outcome lines go.
    """

    def __init__(
        self,
        hook: AdvisoryLockHook,
        key: LockKey,
        policy: LockPolicy,
        *,
        application_name: str | None = None,
        logger: logging.Logger | Any | None = None,
    ) -> None:
        self.hook = hook
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
        self._interruptible = False
        self._interrupt_sent = False
        self._guarded_thread: threading.Thread | None = None
        self._previous_handler: Any = None
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
        self._start_heartbeat()
        return LockHandle(self.held, lambda: self._lost)

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
            with self.hook.connect("pglock inspect") as conn:
                return self.hook.holders_on(conn, self.key)
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
        if self.policy.on_lost == "fail" and self._guarded_thread is threading.main_thread():
            self._previous_handler = signal.signal(LOST_SIGNAL, self._on_lost_signal)
        self._interruptible = True
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name=f"pglock-heartbeat-{self.held.server.backend_pid}", daemon=True
        )
        self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        assert self.held is not None
        interval = self.hook.liveness.heartbeat_interval
        while not self._stop.wait(interval):
            reason = self._check_once()
            if reason is not None:
                self._on_lost(reason)
                return

    def _check_once(self) -> str | None:
        """None while the lock is held; otherwise why it is not."""
        assert self.held is not None
        try:
            if self.hook.is_held(self.held.connection, self.key, self.policy.shared):
                return None
            return "the lock is no longer held by this session (released by another statement on it)"
        except psycopg.errors.InFailedSqlTransaction:
            return None  # transaction mode: the work's own statement failed; the lock is still there
        except psycopg.errors.AdminShutdown:
            if self._server_restarted():
                return "the PostgreSQL server restarted"
            return "the session was terminated (pg_terminate_backend or a server shutdown)"
        except psycopg.errors.IdleSessionTimeout:
            return "the server ended the idle session (idle_session_timeout): the heartbeat was late"
        except psycopg.errors.IdleInTransactionSessionTimeout:
            return "the server ended the idle transaction (idle_in_transaction_session_timeout)"
        except psycopg.Error as error:
            if self._stop.is_set():
                return None
            if self._server_restarted():
                return "the PostgreSQL server restarted"
            return f"the connection to the lock database broke ({type(error).__name__}: {str(error).strip()})"

    def _server_restarted(self) -> bool:
        assert self.held is not None
        started = self.hook.server_started_at()
        return started is not None and started > self.held.server.started_at

    def _on_lost(self, reason: str) -> None:
        with self._state_lock:
            self._lost = reason
            self.log.error("pglock LOST %s: %s", self.key.describe(), reason)
            if self.policy.on_lost != "fail" or not self._interruptible or self._guarded_thread is None:
                return
            self._interrupt_sent = True
            if self._guarded_thread is threading.main_thread():
                signal.pthread_kill(self._guarded_thread.ident or 0, LOST_SIGNAL)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._guarded_thread.ident or 0), ctypes.py_object(_LostInterrupt)
                )

    def _on_lost_signal(self, signum: int, frame: Any) -> None:
        if self._interruptible and self._lost is not None:
            raise _LostInterrupt()

    def _stop_heartbeat(self) -> None:
        with self._state_lock:
            self._interruptible = False
            if self._interrupt_sent and self._guarded_thread is not threading.main_thread() and self._guarded_thread:
                # An asynchronous exception not yet delivered must not fire during clean-up.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._guarded_thread.ident or 0), None)
        self._stop.set()
        if self._previous_handler is not None:
            signal.signal(LOST_SIGNAL, self._previous_handler)
            self._previous_handler = None
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            # A heartbeat blocked on a dead network returns after tcp_user_timeout at most;
            # closing the connection below unblocks it sooner.
            self._heartbeat.join(timeout=0.5)

    # ----------------------------------------------------------------- release

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop_heartbeat()
        held = self.held
        assert held is not None
        lost = self._lost
        commit_error: BaseException | None = None
        try:
            if lost is None and exc_type is None and held.scope == "transaction":
                try:
                    self.hook.commit(held.connection)
                except psycopg.Error as error:
                    commit_error = error
            was_held = held.release() if held.scope == "session" else False
            if held.scope == "session" and lost is None and not was_held and exc_type is None:
                lost = "the lock was no longer held at release"
                self._lost = lost
        finally:
            held.released = True
            held.connection.close()
            if self._heartbeat is not None:
                self._heartbeat.join(timeout=5)
        held_for = held.held_seconds
        if lost is not None:
            self._log_outcome("lost", detail=lost, held=held_for)
            if self.policy.on_lost == "fail":
                message = (
                    f"lost {self.key.describe()} while the task ran: {lost}. Another worker may now run the same "
                    "work; this run is marked failed instead of successful"
                )
                raise LockLostError(message, self.key, lost) from (exc if exc_type is not _LostInterrupt else None)
        if commit_error is not None:
            self._log_outcome("failed", detail=f"commit failed: {commit_error}", held=held_for)
            raise commit_error
        if exc_type is not None:
            self._log_outcome("failed", detail=f"{exc_type.__name__}: {exc}", held=held_for)
        elif lost is None:
            self._log_outcome("completed", held=held_for)
        else:
            self._log_outcome("completed", detail=f"on_lost='warn': lock lost during the run: {lost}", held=held_for)

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
        if self.held is not None:
            parts += [
                f"database={self.held.server.database!r}",
                f"server={self.held.server.server}",
                f"pid={self.held.server.backend_pid}",
                f"waited={self._wait_seconds:.3f}s",
            ]
        else:
            parts.append(f"target={self._target_text()}")
            parts.append(f"waited={time.monotonic() - self._started:.3f}s")
        if held is not None:
            parts.append(f"held={held:.3f}s")
        if detail:
            parts.append(f"- {detail}")
        line = " ".join(part for part in parts if part)
        if (outcome == "completed" and not detail) or outcome == "skipped":
            self.log.info(line)
        else:
            self.log.error(line) if outcome in {"failed", "lost"} else self.log.warning(line)
