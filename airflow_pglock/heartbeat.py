"""The heartbeat of every way to hold a lock: a daemon thread that probes it every ``lease / 3`` s.

It keeps a guarded task's lock (a :class:`~airflow_pglock.pg.held.HeldLock`)
and a lock session (``hook.lock_session()``, whose keys can end only with its session or
by its own unlock: its probe asks only whether the session is alive) the same way.

It keeps a healthy session from looking idle to the server (which ends a session silent
for the lease) and notices a lost lock: the session ended, the key is gone, the server
does not answer in time. It says so once, through ``on_loss``, and stops.

Between probes it watches the session's socket: a server that ends the session
(``pg_terminate_backend``, a shutdown, a crash restart, a pooler closing it) says so on
the socket at once, so that loss is noticed within moments, without a round trip. The
probes stay for what only they can see: a silent network, a lock gone on a live session.
"""

from __future__ import annotations

import _thread
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import psycopg

from airflow_pglock import forks, loss
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.database import LockDatabase
from airflow_pglock.pg.probe import ProbeResult
from airflow_pglock.server_rules import Scope, ServerInfo

#: ``on_loss(reason, ask_server)``: the lock is lost; ``ask_server``: the server may tell more.
OnLoss = Callable[[str, bool], None]


#: Seconds between two looks from a side connection that could not be made, after a probe of a
#: transaction lock was answered with an error (such a probe does not wait: without a pause the
#: heartbeat would open connections in a loop).
SIDE_LOOK_PAUSE = 0.25


class KeptAlive(Protocol):
    """What a heartbeat keeps alive: a lock on its session (``HeldLock``), or a lock session."""

    @property
    def connection(self) -> psycopg.Connection[Any]: ...
    @property
    def server(self) -> ServerInfo: ...
    @property
    def key(self) -> LockKey | None:
        """The key the session must hold; None: only the session must live."""

    @property
    def scope(self) -> Scope: ...
    @property
    def answered_monotonic(self) -> float:
        """``time.monotonic()`` when the session last answered before the heartbeat started."""

    def probe(
        self, timeout: float, before_giving_up: Callable[[], None] | None = None, answer_by: float | None = None
    ) -> ProbeResult: ...

    def seen_from_aside(self, side: psycopg.Connection[Any]) -> bool:
        """Whether it still holds (lives), asked on another session ``side``."""


class Heartbeat:
    """Probe ``held`` every ``lease / 3`` s until stopped or the lock is found lost.

    :param database: the lock database (its liveness settings, its side connections).
    :param held: the lock, or the lock session.
    :param on_loss: called once, from the heartbeat thread, when the lock is lost.
    :param first_alarm: called with the reason *before* an unanswered connection is closed
        (closing lets the server release the lock: the work must be interrupted first).
    :param stop: set to stop the heartbeat.
    """

    def __init__(
        self,
        database: LockDatabase,
        held: KeptAlive,
        on_loss: OnLoss,
        first_alarm: Callable[[str], None],
        stop: threading.Event,
    ) -> None:
        self.database = database
        self.held = held
        self.on_loss = on_loss
        self.first_alarm = first_alarm
        self.stop_event = stop
        self.server_notice: tuple[str, str] | None = None  # (sqlstate, message) of a 57P.. notice
        self._wake_read, self._wake_write = os.pipe()  # stop() wakes the socket watch at once
        self._wake_lock = threading.Lock()
        # The thread's life: "new" -> "starting" -> "running" -> "ended", or "starting" ->
        # "cancelled" when stopped before it ran a line of its loop (it then touches nothing);
        # "forked" in a child process forked meanwhile (see airflow_pglock.forks).
        self._state = "new"
        self._state_lock = threading.Lock()
        self._ended = threading.Lock()  # held from the start until the thread is done with the session
        self._ident: int | None = None
        self._reported = False  # on_loss was called (once at most)

    def start(self) -> None:
        # A server that ends every session (crash, immediate shutdown) says why in a notice
        # just before it hangs up; the error the client then sees does not.
        self.held.connection.add_notice_handler(self._on_notice)
        forks.after_fork_in_child(self, Heartbeat._forked)
        self._ended.acquire()
        self._state = "starting"
        # A low-level thread: threading.Thread.start() waits until the new thread runs, which on
        # a busy machine costs a guarded execution more than its work (docs/benchmarks.md).
        # stop() joins it through ``_ended``; if it has not begun, stop() cancels it instead.
        try:
            _thread.start_new_thread(self._run, ())
        except BaseException:  # no thread, or one not to run: an interrupt can land after it was made
            with self._state_lock:
                cancelled = self._state == "starting"
                if cancelled:
                    self._state = "cancelled"  # a thread that exists returns at once and frees ``_ended``
            if cancelled:
                self._close_wake()
            raise

    def stop(self) -> None:
        if self._state == "forked":
            return  # no thread here; the stop event's lock may have been held when the process forked
        self.stop_event.set()
        with self._wake_lock:
            if self._wake_write >= 0:
                os.write(self._wake_write, b"x")
        with self._state_lock:
            state = self._state
            if state == "starting":
                self._state = "cancelled"  # it will return at once: the wake pipe is ours to close
        if state in ("new", "starting"):
            self._close_wake()
        elif (
            state == "running"
            and self._ident != _thread.get_ident()
            # Every step of the heartbeat is bounded: a probe by the loss deadline, a server
            # check by its 2 s connect timeout.
            and self._ended.acquire(timeout=self.database.liveness.loss_deadline + 5)
        ):
            self._ended.release()
        forks.forget(self)

    def _forked(self) -> None:
        """In a child forked while this heartbeat lived: its thread is not in this process, and any
        of its locks may have been held at the fork."""
        self._state_lock, self._ended, self._wake_lock = threading.Lock(), threading.Lock(), threading.Lock()
        self._state = "forked"
        # Left open (close-on-exec): the parent's thread may have been closing them at the fork,
        # and closing a number again could close what has reused it.
        self._wake_read = self._wake_write = -1

    @property
    def alive(self) -> bool:
        return self._state == "running" and self._ended.locked()

    def _run(self) -> None:
        try:
            with self._state_lock:
                if self._state != "starting":
                    return  # stopped before it began
                self._state = "running"
                self._ident = _thread.get_ident()
            try:
                self._loop()
            except BaseException as error:  # a heartbeat that dies unheard would leave the work unwatched
                if not self._reported and not self.stop_event.is_set():
                    self._report(f"the heartbeat failed ({type(error).__name__}: {error})", False)
            finally:
                self._state = "ended"
        finally:
            self._ended.release()

    def _report(self, reason: str, ask_server: bool) -> None:
        self._reported = True
        self.on_loss(reason, ask_server)

    def _on_notice(self, diagnostic: psycopg.errors.Diagnostic) -> None:
        # A FATAL read by the socket watch (the server ending an idle session: terminated, the
        # lease's timeout) comes as a notice too: libpq hands errors on an idle connection there.
        if (diagnostic.sqlstate or "").startswith("57P") or diagnostic.severity_nonlocalized in ("FATAL", "PANIC"):
            self.server_notice = (diagnostic.sqlstate or "", diagnostic.message_primary or "")

    def describe_error(self, error: psycopg.Error) -> tuple[str, bool]:
        """Why the session ended, as far as the error (or the notice before it) tells."""
        return loss.error_reason(error, self.database.liveness.lease, self.server_notice)

    def _watch(self, seconds: float) -> bool:
        """Wait ``seconds`` for the next probe, watching the session's socket; True when stopped.

        Raises the connection's error when the server ended the session. Data on an idle
        session's socket is a message the server sent unasked (the FATAL before it hangs up,
        a notice, a parameter change): it is read, which hands a notice to ``_on_notice``.
        While the work uses the connection (transaction mode, a pipeline) its data is the
        work's: left alone, and looked at again a moment later.
        """
        deadline = time.monotonic() + seconds
        while not self.stop_event.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            poller = select.poll()
            poller.register(self._wake_read, select.POLLIN)
            conn = self.held.connection
            if not conn.closed:
                poller.register(conn.pgconn.socket, select.POLLIN)
            ready = poller.poll(remaining * 1000)
            if self.stop_event.is_set():
                break
            if ready:
                self._read_unasked()  # raises when the server ended the session
                # Then a pause, whoever's data it was: on a connection the work uses in a tight
                # loop (a lock session's keys, one statement after another) every reply wakes us.
                if self.stop_event.wait(min(0.2, remaining)):
                    break
        return True

    def _read_unasked(self) -> bool:
        """Read what the server sent on the idle session; False when the work is using it."""
        conn = self.held.connection
        if not conn.lock.acquire(blocking=False):
            return False
        try:
            if conn.closed:
                raise psycopg.OperationalError("the lock session's connection is closed")
            pgconn = conn.pgconn
            if pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
                return False
            try:
                pgconn.consume_input()
                pgconn.is_busy()  # parses what was read: a message sent unasked goes to the notice handler
            except psycopg.Error as error:
                raise psycopg.OperationalError(str(error).strip() or "the server closed the lock session") from error
            if pgconn.status == psycopg.pq.ConnStatus.BAD:
                raise psycopg.OperationalError("the server closed the lock session")
            return True
        finally:
            conn.lock.release()

    def _close_wake(self) -> None:
        with self._wake_lock:
            if self._wake_read >= 0:
                os.close(self._wake_read)
                os.close(self._wake_write)
                self._wake_read = self._wake_write = -1

    def _loop(self) -> None:
        try:
            self._beat()
        finally:
            self._close_wake()

    def _beat(self) -> None:
        """A probe must be answered within ``2 * lease / 3`` s of the last confirmed one (or
        within a short grace when this process itself stalled past that, never past the
        answer cutoff), so the holder gives its lock up for lost before the server can
        release it (``lease`` s of silence). See :meth:`Liveness.probe_budget`.
        """
        held = self.held
        liveness = self.database.liveness
        interval = liveness.heartbeat_interval
        # The lock statement, then the checks before the work, were answered: the session was not idle before
        confirmed = held.answered_monotonic

        def no_answer() -> str:
            return loss.no_answer_reason(time.monotonic() - confirmed, held.server.server, liveness.lease)

        while True:
            try:
                if self._watch(max(0.0, confirmed + interval - time.monotonic())):
                    return
            except psycopg.Error as error:  # the server ended the session and said so on the socket
                self._report(*self.describe_error(error))
                return
            started = time.monotonic()
            answered_with_error = False
            try:
                result = held.probe(
                    liveness.probe_budget(started - confirmed),
                    before_giving_up=lambda: self.first_alarm(no_answer()),  # interrupt, then close
                    answer_by=confirmed + liveness.answer_cutoff,
                )
            except psycopg.Error as error:
                if held.connection.closed or not loss.is_ordinary_error(getattr(error, "sqlstate", None)):
                    self._report(*self.describe_error(error))
                    return
                if held.scope == "session":
                    confirmed = started  # the session answered (its transaction is aborted): its lock outlives that
                    continue
                # A transaction lock goes with its transaction, which an error outside a savepoint
                # (the work's, or a cancel of this probe) ends at once: its ROLLBACK comes later.
                answered_with_error, result = True, "busy"
            except Exception as error:  # never let the heartbeat die silently: a silent heartbeat loses the lock
                self._report(f"the heartbeat failed ({type(error).__name__}: {error})", False)
                return
            if result == "busy":
                # Or the work is using the connection (a statement, COPY, a stream, a pipeline), and
                # has been since the last answer, at least one interval ago. Neither is proof that
                # the session still holds the lock: ask the server from a side connection.
                seen = self.database.holds_seen_aside(held)
                if seen is None:  # the server cannot be reached either: silent, as a probe without answer
                    since = time.monotonic() - confirmed
                    if since >= liveness.loss_deadline:
                        self._report(loss.unverified_after_error(since) if answered_with_error else no_answer(), False)
                        return
                    if answered_with_error:  # such a probe is answered at once: look again after a pause
                        try:
                            if self._watch(min(SIDE_LOOK_PAUSE, liveness.loss_deadline - since)):
                                return
                        except psycopg.Error as error:
                            self._report(*self.describe_error(error))
                            return
                    continue
                if not seen:
                    if answered_with_error:
                        self._report(loss.ABORTED_BY_AN_ERROR, False)
                    else:
                        self._report(
                            loss.NOT_HELD_SEEN_ASIDE if held.key is not None else loss.SESSION_GONE_SEEN_ASIDE, True
                        )
                    return
                result = "held"
            if result == "held":
                confirmed = started
            elif result == "not held":
                self._report(loss.not_held_reason(held.scope), False)
                return
            else:
                self._report(no_answer(), False)
                return
