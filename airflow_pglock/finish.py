"""How a guarded execution ends: the commit or the unlock, and what either found.

Each returns ``(loss, error)``: why the lock turned out lost (None if it was held to the
end), and an error in finishing (the commit, the completion record) to raise when the
lock was not lost. The guard runs them with interruptions deferred.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from airflow_pglock import loss
from airflow_pglock.exceptions import PgLockError
from airflow_pglock.hooks.lock_session import HeldLock

#: (why the lock was lost, or None; the error in finishing, or None)
Finished = tuple[str | None, BaseException | None]


def finish_transaction(
    held: HeldLock, succeeded: bool, record: Callable[[], bool], describe_error: Callable[[psycopg.Error], str]
) -> Finished:
    """Transaction mode: commits only if the work succeeded and the session is still in the
    lock's transaction, holding the key; ``record()`` runs first, inside it."""
    if not held.transaction_open:
        return loss.ENDED_BY_WORK, None
    if not succeeded:
        return None, None  # closing the connection rolls the work back
    try:
        if not held.commit_if_held(record):
            return loss.ENDED_BY_WORK, None
    except psycopg.Error as error:
        if held.connection.closed or not loss.is_ordinary_error(getattr(error, "sqlstate", None)):
            return loss.found_at_commit(describe_error(error)), None
        return None, error
    except PgLockError as error:
        return None, error
    return None, None


def finish_session(
    held: HeldLock, succeeded: bool, record: Callable[[], bool], describe_error: Callable[[psycopg.Error], str]
) -> Finished:
    """Session mode: record the completion (only while the key is held), then unlock."""
    commit_error: BaseException | None = None
    lost: str | None = None
    if succeeded:
        try:
            if not record():
                lost = loss.NOT_HELD_AT_COMPLETION
        except (psycopg.Error, PgLockError) as error:
            commit_error = error
    try:
        still_held = held.unlock_checked()
    except psycopg.Error as error:
        still_held = False
        lost = describe_error(error)
    if not still_held:
        lost = loss.found_at_release(lost)
    return lost, (None if lost is not None else commit_error)
