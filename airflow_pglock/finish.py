"""How a guarded execution ends: the commit or the unlock, and what either found.

Each returns ``Finished(lost, error, note)``: why the lock turned out lost (None if it was
held to the end), an error in finishing (the commit, the completion record) to raise when
the lock was not lost, and what the outcome line should add to a completion. The guard
runs them with interruptions deferred.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import psycopg

from airflow_pglock import loss
from airflow_pglock.exceptions import PgLockError
from airflow_pglock.pg.held import HeldLock


class Finished(NamedTuple):
    lost: str | None = None  # why the lock was lost, or None
    error: BaseException | None = None  # the error in finishing, or None
    note: str | None = None  # said with a completion (e.g. the unlock failed after it)


class Ending(NamedTuple):
    """How a guarded execution ends, as :func:`finish` needs it.

    :param held: the lock, not found lost so far.
    :param succeeded: whether the work succeeded (only then is anything committed or recorded).
    :param record: records the completion (a statement that checks the key is held) and says
        whether it found it held; in transaction mode it runs inside the lock's transaction.
    :param describe_error: says why a driver error ended the session.
    :param commit_status: transaction mode: reads, on a side connection, what the server says
        of a transaction id (``txid_status``), or None; asked after a COMMIT whose answer was lost.
    :param records_completion: whether ``record()`` writes a completion (once_per /
        min_interval). Its statement checks that the session holds the key, after the work:
        once it is recorded, the work is known to have run under the lock to its end, and a
        session that ends before the unlock only frees the key sooner.
    :param seen_aside: transaction mode: whether the session still holds the key in the lock's
        transaction, asked on a side connection (None: cannot be asked); asked when the work
        succeeded in a transaction an error aborted.
    """

    held: HeldLock
    succeeded: bool
    record: Callable[[], bool]
    describe_error: Callable[[psycopg.Error], str]
    records_completion: bool = False
    commit_status: Callable[[int], str | None] | None = None
    seen_aside: Callable[[], bool | None] | None = None


def finish(ending: Ending) -> Finished:
    """End a guarded execution whose lock was not found lost: :func:`finish_transaction` or
    :func:`finish_session` by the lock's scope (a session whose connection is closed is lost)."""
    if ending.held.scope == "transaction":
        return finish_transaction(ending)
    if ending.held.connection.closed:
        return Finished(lost=loss.CLOSED_AT_RELEASE)
    return finish_session(ending)


def finish_transaction(ending: Ending) -> Finished:
    """Transaction mode: commits only if the work succeeded and the session is still in the
    lock's transaction, holding the key; ``record()`` runs first, inside it."""
    held = ending.held
    if not held.transaction_open:
        return Finished(lost=loss.ENDED_BY_WORK)
    if not ending.succeeded:
        held.roll_back()  # the work is undone and the key free before the outcome is reported
        return Finished()
    if held.connection.closed:  # not a COMMIT whose answer was lost: none is sent
        return Finished(lost=loss.CLOSED_BEFORE_COMMIT)
    if held.transaction_aborted and ending.seen_aside is not None and ending.seen_aside() is False:
        # An error the work caught, outside a savepoint: the key went at the error (a failed
        # savepoint keeps it, and the COMMIT below then fails as before).
        held.roll_back()
        return Finished(lost=loss.ABORTED_BY_AN_ERROR)
    try:
        if not held.commit_if_held(ending.record):
            return Finished(lost=loss.ENDED_BY_WORK)
    except psycopg.Error as error:
        if held.connection.closed or not loss.is_ordinary_error(getattr(error, "sqlstate", None)):
            # The session ended during the checked COMMIT: it may have run. Never "nothing committed".
            status_of = ending.commit_status
            said = status_of(held.xact_id) if status_of is not None and held.xact_id is not None else None
            return Finished(lost=loss.commit_unknown(ending.describe_error(error), said))
        return Finished(error=error)
    except PgLockError as error:
        return Finished(error=error)
    return Finished()


def finish_session(ending: Ending) -> Finished:
    """Session mode: record the completion (only while the key is held), then unlock."""
    held, records_completion, describe_error = ending.held, ending.records_completion, ending.describe_error
    commit_error: BaseException | None = None
    lost: str | None = None
    recorded = False
    if ending.succeeded:
        try:
            held_at_completion = ending.record()
            if records_completion and not held_at_completion:
                lost = loss.NOT_HELD_AT_COMPLETION
            # Committed, not just written: a session in a transaction would roll the record back.
            idle = held.connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            recorded = records_completion and held_at_completion and idle
        except (psycopg.Error, PgLockError) as error:
            commit_error = error
    try:
        still_held = held.unlock_checked()
    except psycopg.Error as error:
        if recorded:
            return Finished(note=loss.unlock_failed_after_completion(describe_error(error)))
        if held.unlock_again_after(error):  # a foreign pg_cancel_backend() that landed on the unlock, say
            note = loss.unlock_failed_while_held(error)
            return Finished(lost=lost, error=None if lost is not None else commit_error, note=note)
        still_held = False
        lost = describe_error(error)
    if not still_held:
        lost = loss.found_at_release(lost)
    return Finished(lost=lost, error=None if lost is not None else commit_error)
