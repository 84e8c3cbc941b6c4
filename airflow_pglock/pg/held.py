"""One lock held on its own dedicated connection: :class:`HeldLock`.

It owns its check, its release and, in transaction scope, its commit; the statements are
those of :mod:`~airflow_pglock.pg.statements`, :mod:`~airflow_pglock.pg.release` and
:mod:`~airflow_pglock.pg.probe`.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from airflow_pglock import loss
from airflow_pglock.keys import LockKey
from airflow_pglock.loss import held_clock
from airflow_pglock.pg.probe import ProbeResult, probe
from airflow_pglock.pg.release import WriteAtRelease, commit_if_held, roll_back_within, unlock, unlock_within
from airflow_pglock.pg.statements import commit, held_seen_from_aside, is_held
from airflow_pglock.server_rules import Scope, ServerInfo

log = logging.getLogger("airflow_pglock")

_INERROR = psycopg.pq.TransactionStatus.INERROR
_IN_A_TRANSACTION = (psycopg.pq.TransactionStatus.INTRANS, _INERROR)


@dataclass
class HeldLock:
    """A lock held on its own dedicated connection. Release it (or let a context manager).

    :param key: the key held.
    :param shared: whether the lock is shared (readers) rather than exclusive.
    :param scope: ``"session"`` or ``"transaction"``.
    :param connection: the dedicated connection; in transaction scope, do your database
        work on it: it runs inside the transaction that holds the lock.
    :param server: what the connection found at the other end.
    :param acquired_at: when the lock was taken (UTC).
    :param acquired_monotonic: ``time.monotonic()`` at acquisition, for durations.
    :param acquired_clock: :func:`~airflow_pglock.loss.held_clock` at acquisition: after a loss,
        against the server's uptime (a clock that also counts a suspend of this machine).
    :param released: True once :meth:`release` ran.
    :param xact_id: transaction scope: the id (``txid_current()``) of the transaction that
        holds the lock; every later check verifies the session is still in it.
    :param registry: the key-name registry's state when the lock was taken (for a key
        with a name: ``key_names.REGISTRY_ABSENT`` or ``REGISTRY_PRESENT``), else None.
    :param at_release: a write to send with the release (the unlock, or the commit), once.
    :param markers: session scope, a pool's slot: the pool's markers held in shared mode
        (:func:`~airflow_pglock.pg.pools.pool_markers`), given back by the unlock.
    :param slot: a pool's slot: its number (1 to the pool's size); None for a plain key.
    :param answered_monotonic: ``time.monotonic()`` when the lock's session last answered a
        statement before the work (the lock statement, then the checks: a fencing token's
        commit may wait long for a synchronous standby); the server's idle timers started no
        earlier. The heartbeat counts from it.
    """

    key: LockKey
    shared: bool
    scope: Scope
    connection: psycopg.Connection[Any]
    server: ServerInfo
    acquired_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc))
    acquired_monotonic: float = field(default_factory=time.monotonic)
    acquired_clock: float = field(default_factory=held_clock)
    released: bool = False
    xact_id: int | None = None
    registry: str | None = None
    at_release: WriteAtRelease | None = None
    markers: tuple[LockKey, ...] = ()
    slot: int | None = None
    answered_monotonic: float = field(default_factory=time.monotonic)

    def is_held(self) -> bool:
        """Ask the server whether this session still holds the key (a round trip).

        False once the session has ended (the lease ran out while the connection sat idle,
        the session was terminated, the connection broke): the server released the lock
        with it. The reason is logged as a warning; that error never reaches the caller.

        A cancelled check (a foreign ``pg_cancel_backend()``, a ``statement_timeout``) ended no
        session: a session lock is asked once more (its answer decides; another error is
        raised), and the connection stays open. A transaction your code left aborted on a
        session lock's connection raises the driver's error (the session still holds the key:
        roll that transaction back first).

        Transaction scope: False as well while an error has aborted the lock's transaction (a
        cancelled check too). Outside a savepoint that error released the lock (PostgreSQL
        frees a transaction's locks at the error, not at its later ROLLBACK); inside one the
        lock stays, but the session can answer nothing until the work rolls back to its savepoint.
        """
        if self.connection.closed:
            return False
        if self.scope == "transaction" and self.transaction_aborted:
            log.warning("pglock %s: %s", self.key.describe(), loss.ABORTED_UNLESS_IN_A_SAVEPOINT)
            return False
        try:
            return is_held(self.connection, self.key, self.shared, self.xact_id)
        except psycopg.Error as error:
            if not loss.session_answered(error, self.connection.closed):
                return self._ended(error)
            # A cancel (QueryCanceled), ...: the session lives.
            if self.scope == "transaction":  # the error aborted the lock's transaction
                log.warning("pglock %s: %s", self.key.describe(), loss.ABORTED_UNLESS_IN_A_SAVEPOINT)
                return False
            if self.transaction_aborted:  # the caller's own transaction, which only it may roll back
                raise
        try:  # a cancelled check: asked once more
            return is_held(self.connection, self.key, self.shared, self.xact_id)
        except psycopg.Error as error:
            if not loss.session_answered(error, self.connection.closed):
                return self._ended(error)
            raise

    def _ended(self, error: psycopg.Error) -> bool:
        """is_held()'s answer once its session ended with ``error`` (AdminShutdown, IdleSessionTimeout,
        a broken connection, a transaction lock's idle-in-transaction timeout): False, the reason logged."""
        log.warning(
            "pglock %s is no longer held: its session ended (%s: %s)",
            self.key.describe(),
            type(error).__name__,
            str(error).strip(),
        )
        self.connection.close()
        return False

    def release(self) -> bool:
        """Release the lock and close its connection. Idempotent.

        Returns whether the lock was really held until now (False when it had been lost,
        e.g. the session was terminated, or when it was released already). A transaction
        lock is released by the end of its transaction: here that is a rollback, done before
        this returns.
        """
        if self.released:
            return False
        self.released = True
        was_held = False
        try:
            if self.scope == "session" and not self.connection.closed:
                was_held = unlock(
                    self.connection,
                    self.key,
                    shared=self.shared,
                    at_release=self._take_at_release(),
                    markers=self.markers,
                )
            elif self.scope == "transaction" and not self.connection.closed:
                was_held = is_held(self.connection, self.key, self.shared, self.xact_id)
                self.roll_back()
        except psycopg.Error as error:
            # A cancelled unlock is sent again; otherwise the connection broke, and the server dropped
            # the lock with it.
            was_held = self.scope == "session" and self.unlock_again_after(error)
        finally:
            self.connection.close()
        return was_held

    def answered(self) -> None:
        """Note that the lock's session just answered a statement on :attr:`connection`."""
        self.answered_monotonic = time.monotonic()

    @property
    def held_seconds(self) -> float:
        return time.monotonic() - self.acquired_monotonic

    @property
    def transaction_open(self) -> bool:
        """Transaction scope: False once the lock's transaction was ended on its connection."""
        return self.connection.info.transaction_status != psycopg.pq.TransactionStatus.IDLE

    @property
    def transaction_aborted(self) -> bool:
        """Whether the lock's connection is in a failed transaction block (an error not yet rolled
        back; in a savepoint or not)."""
        return not self.connection.closed and self.connection.info.transaction_status == _INERROR

    def commit_if_held(self, record: Callable[[], bool]) -> bool:
        """Transaction scope: commit the lock's transaction if the session is still in it and
        holds the key; ``record()`` runs first, inside it (e.g. the completion record; it
        returns False when it found the lock not held).

        Returns False, committing nothing, when the lock was not held any more (the work
        ended the transaction, or took the key again in another one). Raises the driver's
        error when the session ended or the transaction was aborted (nothing committed).
        """
        status = self.connection.info.transaction_status
        if status == psycopg.pq.TransactionStatus.IDLE:
            return False
        if status == psycopg.pq.TransactionStatus.INERROR:
            commit(self.connection)  # aborted: PostgreSQL answers ROLLBACK, which raises (nothing committed)
            return False  # it answered COMMIT: a thread of the work ended that transaction and began another
        # In the transaction, or a statement still runs on the connection (a thread of the work that
        # outlived it; it may end the lock's transaction): the check waits for it, then tells.
        if not record():
            return False
        return commit_if_held(self.connection, self.key, self.shared, self.xact_id, self._take_at_release())

    def commit(self) -> None:
        """Transaction scope: commit the lock's transaction (which releases the lock).

        Raises ``NoActiveSqlTransaction`` when the work ended the lock's transaction (whatever
        ran afterwards ran without the lock), ``InFailedSqlTransaction`` when an error had
        aborted it, and the session's end (e.g. ``IdleInTransactionSessionTimeout`` after the
        lease) when it ended: nothing is committed then.
        """
        ended = psycopg.errors.NoActiveSqlTransaction(
            "the lock's transaction was ended on its connection (a COMMIT or ROLLBACK by the work): the lock "
            "ended with it, and whatever ran afterwards ran without the lock; not committed"
        )
        status = self.connection.info.transaction_status
        if status in (psycopg.pq.TransactionStatus.IDLE, psycopg.pq.TransactionStatus.INERROR):
            commit(self.connection)  # raises: no transaction, or an aborted one (PostgreSQL answers ROLLBACK)
            raise ended  # it answered COMMIT: a thread of the work ended the aborted transaction and began another
        # As commit_if_held: a statement still running on the connection is waited for by the check.
        if not commit_if_held(self.connection, self.key, self.shared, self.xact_id, self._take_at_release()):
            raise ended

    def probe(
        self, timeout: float, before_giving_up: Callable[[], None] | None = None, answer_by: float | None = None
    ) -> ProbeResult:
        """The heartbeat's bounded check of this lock (see :func:`~airflow_pglock.pg.probe.probe`)."""
        return probe(
            self.connection,
            self.key,
            self.shared,
            timeout,
            xact_id=self.xact_id,
            before_giving_up=before_giving_up,
            answer_by=answer_by,
        )

    def seen_from_aside(self, side: psycopg.Connection[Any]) -> bool:
        """Whether the session still holds the key, asked on another session ``side`` (while the
        work keeps the lock's own connection busy)."""
        return held_seen_from_aside(side, self.server.backend_pid, self.key, self.shared, self.xact_id)

    def unlock_checked(self) -> bool:
        """Session scope: unlock (the connection stays open); whether the key was still held."""
        return unlock(
            self.connection, self.key, shared=self.shared, at_release=self._take_at_release(), markers=self.markers
        )

    def unlock_again_after(self, error: psycopg.Error) -> bool:
        """Session scope: after the unlock failed with ``error``, whether a second unlock found the
        key still held. Only on a session that answered (an ordinary error, e.g. a cancelled
        statement): its answer is the proof, as the first one's would have been (the work may have
        unlocked the key on this session). An unlock that ran before the error makes it False."""
        if not loss.session_answered(error, self.connection.closed):
            return False
        try:
            if self.connection.info.transaction_status == _INERROR:  # a session lock outlives its rollback
                self.connection.execute("ROLLBACK")
            return unlock(self.connection, self.key, shared=self.shared, markers=self.markers)
        except psycopg.Error:
            return False

    def _take_at_release(self) -> WriteAtRelease | None:
        at_release, self.at_release = self.at_release, None  # sent once, with the first release statement
        return at_release

    def roll_back(self) -> bool:
        """Transaction scope: end the lock's transaction on the server now, so the key is free when
        this returns (a close frees it only once the server has read it and the backend has
        exited). Waits at most :data:`~airflow_pglock.pg.release.ROLLBACK_WAIT_SECONDS` for the
        answer; False when there was none (the connection is closed after that anyway)."""
        return roll_back_within(self.connection)

    def give_back(self) -> None:
        """Its holder gave up before its work (a skip, a refusal, a check that failed): free the key
        on the server now, then close. A close alone frees it only once the server has read the
        close and the backend has exited, a moment later: a run that tries the key at once could
        still find it busy. Nothing is written at release (there was no work). Best effort, and
        bounded (:data:`~airflow_pglock.pg.release.ROLLBACK_WAIT_SECONDS`): when the statement
        cannot run (a broken connection, a statement still in flight) or gets no answer in time,
        the close frees the key."""
        if self.released:
            return
        self.at_release = None
        try:
            closed = self.connection.closed
            status = psycopg.pq.TransactionStatus.UNKNOWN if closed else self.connection.info.transaction_status
            if self.scope == "session" and status == psycopg.pq.TransactionStatus.IDLE:
                unlock_within(self.connection, self.key, shared=self.shared, markers=self.markers)
            elif self.scope == "transaction" and status in _IN_A_TRANSACTION:
                self.roll_back()
        finally:
            self.close()

    def close(self) -> None:
        """Close the connection: the session ends, an open transaction rolls back, the lock goes
        with them. Idempotent; no check (see :meth:`release` for that)."""
        self.released = True
        self.connection.close()
