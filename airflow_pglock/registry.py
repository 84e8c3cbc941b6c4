"""Record a key's name when a guarded execution takes it, and report collisions.

The key-name registry (``pglock.key_names``, created by ``airflow-pglock init-db``) is
optional: when it is missing, or the role may not write it, the task goes on exactly as
without it. What "a collision is reported" means:

* the acquisition logs a WARNING naming both names, the key's numbers and what to do
  (the task still runs: the two names already shared one lock before anyone looked);
* ``airflow-pglock locks`` and the UI page show every name of the key and mark it;
* ``airflow-pglock doctor`` reports a ``registry`` problem (exit code 1).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.errors import InsufficientPrivilege

from airflow_pglock.hooks.advisory_lock import HeldLock
from airflow_pglock.hooks.lock_session import pipelined
from airflow_pglock.hooks.schema import (
    REGISTRY_NO_ACCESS,
    REGISTRY_READY,
    other_names_from,
    record_key_name,
    record_key_name_statement,
)
from airflow_pglock.keys import LockKey

log = logging.getLogger("airflow_pglock")


def record_acquisition(
    held: HeldLock, application_name: str | None, logger: logging.Logger | Any = None, slots: int = 1
) -> None:
    """Record the name of ``held.key`` on its own connection; warn of a collision.

    The lock statement said whether the registry is there (``held.registry``): when it is
    not (the default), nothing happens and no statement runs; when the role may not use it,
    a warning says so, without a statement either. Only an installed, usable registry costs
    a round trip: the write (in a savepoint in transaction mode, so that an error cannot
    abort the lock's transaction). Never raises: the registry is optional.

    :param held: the lock just taken (its connection runs the insert).
    :param application_name: recorded as who used the name first.
    :param logger: where the collision warning goes (the task log).
    :param slots: the size of the pool ``held.key`` is a slot of (1: a plain key), recorded
        with the name so that ``locks`` can show the pool as one row.
    """
    logger = logger or log
    if held.key.name is None or held.registry is None or held.registry == "absent":
        return
    key = held.key

    def report(outcome: list[str] | BaseException) -> None:
        _report(key, outcome, logger)

    if held.registry in REGISTRY_NO_ACCESS:
        problem = f"the registry is installed, but this role has {REGISTRY_NO_ACCESS[held.registry]}"
        report(InsufficientPrivilege(problem))  # what the write would have raised, without a statement
    elif held.registry != REGISTRY_READY:
        report(ValueError(f"unknown registry state {held.registry!r}"))
    else:
        try:
            others = record_key_name(held.connection, key, application_name, slots, installed=True)
        except Exception as error:  # the registry is optional: never fail a task that holds its lock
            report(error)
        else:
            report(others or [])


def record_acquisition_later(
    held: HeldLock, application_name: str | None, logger: logging.Logger | Any = None, slots: int = 1
) -> PendingName | None:
    """As :func:`record_acquisition`, but the write (if any) is left for off the work's path.

    Returns the pending write, or None when there is none (no name, no registry, no access:
    the warning is logged now, as ever). Two cases write now, as :func:`record_acquisition`:
    a transaction lock (in a savepoint: the work may use the connection inside its
    transaction, and a write overlapping it could not stay out of it), and a slot of a pool
    (``slots`` > 1: its write records the pool's size, and needs a second statement on a
    registry older than version 4).
    """
    if held.scope == "transaction" or slots > 1 or held.key.name is None or held.registry != REGISTRY_READY:
        record_acquisition(held, application_name, logger, slots)
        return None
    return PendingName(held, application_name, logger or log)


class PendingName:
    """The registry write of a session lock just taken: done exactly once, either by the
    heartbeat thread as its first act (:meth:`write_aside`, overlapping the work) or, when
    it had not, in the same flight as the unlock (:meth:`unlock`). Never raises an error
    of its own: a failure is a warning in the task log, as with :func:`record_acquisition`."""

    def __init__(self, held: HeldLock, application_name: str | None, logger: logging.Logger | Any) -> None:
        self.held = held
        self.application_name = application_name
        self.logger = logger
        self._claim_lock = threading.Lock()
        #: who does the write: ``"heartbeat"``, ``"unlock"`` or ``"nobody"`` (connection closed first)
        self.done_by: str | None = None
        self.written = threading.Event()  # set once the outcome (recorded, or the warning) is logged
        self.tried_aside = threading.Event()  # set once the heartbeat's first act is over, whatever it did

    def _claim(self, by: str) -> bool:
        with self._claim_lock:
            if self.done_by is not None:
                return False
            self.done_by = by
            return True

    def _statement(self) -> bytes:
        return record_key_name_statement(self.held.connection, self.held.key, self.application_name)

    def _report(self, result: psycopg.pq.abc.PGresult | BaseException | None) -> None:
        try:
            if isinstance(result, BaseException):
                raise result
            if result is None:
                raise psycopg.OperationalError("no answer")
            if result.status != psycopg.pq.ExecStatus.TUPLES_OK:
                raise psycopg.errors.error_from_result(result, encoding=self.held.connection.info.encoding)
            outcome: list[str] | BaseException = other_names_from(result.get_value(0, 0))
        except Exception as error:
            outcome = error
        _report(self.held.key, outcome, self.logger)
        self.written.set()

    def write_aside(self, deadline: float, before_giving_up: Callable[[], None]) -> bool:
        """The heartbeat's first act: the write, if the connection is free now (the work is not
        using it) and nobody did it yet. Returns False when the server did not answer by
        ``deadline``: as a probe without answer, ``before_giving_up()`` is called, then the
        connection closed. Raises ``psycopg.Error`` when the session broke."""
        try:
            return self._write_aside(deadline, before_giving_up)
        finally:
            self.tried_aside.set()

    def _write_aside(self, deadline: float, before_giving_up: Callable[[], None]) -> bool:
        conn = self.held.connection
        if not conn.lock.acquire(blocking=False):
            return True  # the work is using the connection: the release writes it
        try:
            if conn.closed:
                raise psycopg.OperationalError("the lock connection is closed")
            idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            if conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF or not idle or not self._claim("heartbeat"):
                return True
            try:
                answers = pipelined(conn, [self._statement()], deadline)
            except psycopg.Error as error:  # the session broke: said here, the loss by the heartbeat
                self._report(error)
                raise
            if answers is None:
                before_giving_up()
                conn.close()  # the write is still in flight: this connection can never be used again
        finally:
            conn.lock.release()
        if answers is None:
            self._report(None)
            return False
        self._report(answers[0])
        return True

    def unlock(self) -> bool:
        """Session scope: the unlock, with the write in the same flight when it is still to do."""
        if not self._claim("unlock"):
            return self.held.unlock_checked()
        conn = self.held.connection
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            # The work left a transaction open: a write now would join it. Said, not lost silently.
            _report(self.held.key, RuntimeError("the work left a transaction open on the lock connection"), self.logger)
            self.written.set()
            return self.held.unlock_checked()
        try:
            still_held, result = self.held.unlock_after(self._statement())
        except psycopg.Error as error:  # the session broke: said here, the loss by the caller
            self._report(error)
            raise
        self._report(result)
        return still_held

    def abandon(self) -> None:
        """The lock connection is closed without an unlock: a write still to do is reported as not done."""
        if self._claim("nobody"):
            _report(self.held.key, RuntimeError("the lock connection closed before the write"), self.logger)
            self.written.set()


def _report(key: LockKey, outcome: list[str] | BaseException, logger: logging.Logger | Any) -> None:
    if isinstance(outcome, BaseException):
        logger.warning(
            "pglock could not record the name of %s in the key-name registry (%s: %s); the lock is held and the "
            "task goes on. Grant the role access with `airflow-pglock init-db --grant <role>`",
            key.describe(),
            type(outcome).__name__,
            str(outcome).strip(),
        )
        return
    if outcome:
        logger.warning(
            "pglock KEY COLLISION: %s is also used under the name(s) %s (pg_locks %s): these jobs share one lock "
            "and exclude each other. Give one of them another key name",
            key.describe(),
            ", ".join(repr(name) for name in outcome),
            ", ".join(str(part) for part in key.pg_locks),
        )
