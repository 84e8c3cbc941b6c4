"""How a guarded execution stands to a lock scope on its key: outside it, entering it, one of
its tasks, or leaving it (policy only; the SQL is in :mod:`airflow_pglock.pg.scopes`).

A scope holds a named key over several tasks. While a task of it runs, that task holds the
advisory key itself; between its tasks a lease row keeps it. Every check here runs while
the execution holds the advisory key exclusively, so it reads and writes the row under the
lock (see ``pg/scopes.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from airflow_pglock.display import printable
from airflow_pglock.exceptions import LockBusyError, LockConfigurationError, LockLostError

if TYPE_CHECKING:  # the SQL loads when a scope is checked, not when a DAG is parsed
    from airflow_pglock.keys import LockKey
    from airflow_pglock.pg.held import HeldLock
    from airflow_pglock.pg.scopes import ScopeRow

ScopeKind = Literal["outside", "enter", "member", "leave", "resume"]

#: Seconds a scope stays held after its last task started or ended, unless renewed.
DEFAULT_SCOPE_LEASE_SECONDS = 600.0


@dataclass(frozen=True)
class ScopeRole:
    """How one guarded execution stands to the scope of its key.

    :param kind: ``outside`` (any other guard: refused while another's scope is live),
        ``enter`` (a scope's setup: takes it), ``member`` (a task of the scope: re-enters
        the scope its setup took), ``leave`` (the teardown: frees it).
    :param holder: the acquisition's id (from the setup), for every kind but ``outside``.
    :param run: who holds the scope, for people (the deployment, DAG and run).
    :param task: the task id of this execution (shown while it runs).
    :param lease: seconds the scope stays held after a task of it starts or ends.
    :param fencing: issue one fencing token per scope acquisition (at ``enter``).
    :param slot: a scope over a pool (``slots=N``): the slot its setup took (1 to N), which its
        tasks and its teardown re-enter; None for the setup and for a scope over one key.
    :param hands_over: a guarded deferrable operator (``outside``, or ``resume`` after a deferral):
        when its work returns a :class:`HandOver`, the hold passes to the triggerer under a lease row.
    :param lineage: a setup (``enter``): the start of its holder id that every try of this setup in
        this DAG run shares. A live row an earlier try left is taken over (a task of the scope cleared
        while its scope is live runs the setup again) with a new holder id and token: the setup holds
        the key, so no task of that acquisition holds it, and they find another holder id from then on
        (lost). A task of it frozen past its lease (its session ended by the server) may still believe
        it holds, as after any lease: its stale fenced writes are refused (the new token).

    ``resume``: a guarded deferrable operator resumes after its trigger fired. It re-enters the
    hold its deferral handed over (like ``member``); its end frees the row, or hands the hold
    over again when the operator defers again.
    """

    kind: ScopeKind = "outside"
    holder: str | None = None
    run: str | None = None
    task: str | None = None
    lease: float = DEFAULT_SCOPE_LEASE_SECONDS
    fencing: bool = False
    slot: int | None = None
    hands_over: bool = False
    lineage: str | None = None

    def __post_init__(self) -> None:
        if (self.kind != "outside" or self.hands_over) and not self.holder:
            raise LockConfigurationError(f"a scope's {self.kind} needs the scope's holder id, got {self.holder!r}")
        if self.lineage is not None and (
            not self.lineage
            or self.kind != "enter"
            or not self.holder
            or len(self.holder) <= len(self.lineage)
            or not self.holder.startswith(self.lineage)
        ):
            raise LockConfigurationError(
                f"a lineage {self.lineage!r} is a setup's, and starts its holder id (got {self.kind}, {self.holder!r})"
            )


OUTSIDE = ScopeRole()


@dataclass(frozen=True)
class HandOver:
    """What the work of a guarded deferrable operator returns when the operator defers: the guard
    writes the lease row (under the key, before its release) that carries the hold to the triggerer.

    :param deferral: the adapter's record of the deferral (Airflow's ``TaskDeferred``), raised again
        once the guard has ended.
    """

    deferral: Any


def hand_over(role: ScopeRole, key: LockKey, held: HeldLock, token: int | None) -> ScopeRow:
    """The work deferred: write (or renew) the lease row that keeps the hold until the trigger
    holds the key, still under the lock. The fencing token goes with it, the same for the whole task.

    :raises LockLostError: another holder's scope is live (nothing is handed over: the hold would
        not be this task's while it waits).
    """
    from airflow_pglock.pg import scopes

    assert role.holder is not None
    if key.name is None:
        raise LockConfigurationError(f"a deferred guarded operator needs a named key, got {key.describe()}")
    from airflow_pglock.pg.key_names import scopes_installed

    if not scopes_installed(held.registry):
        raise scopes.missing_table_error()
    with scopes.one_transaction(held.connection):  # the row and its token, or neither (a failover between)
        taken, row = scopes.enter(
            held.connection, key, role.holder, role.run or role.holder, role.lease, task=scopes.deferred_task(role.task)
        )
        if not taken:
            assert row is not None
            cause = f"{row.describe()} took the key's scope, so the hold cannot pass to the triggerer"
            raise LockLostError(f"lost {key.describe()} at the deferral: {cause}", key, cause)
        assert row is not None
        if token is not None and row.token != token:
            scopes.set_token(held.connection, key, role.holder, token)
    return row


def end_deferred_hold(role: ScopeRole, key: LockKey, held: HeldLock, logger: logging.Logger | Any) -> None:
    """A resumed deferrable operator ended (done or failed) still holding the key: free its row.
    Best effort: its lease ends it otherwise."""
    from airflow_pglock.pg import scopes

    assert role.holder is not None
    try:
        scopes.leave(held.connection, key, role.holder)
    except Exception as error:
        logger.warning("pglock could not free the deferral hold of %s: %s", key.describe(), error)


def check_before_work(
    role: ScopeRole, key: LockKey, held: HeldLock, application_name: str | None, *, records: bool = False
) -> tuple[int | None, ScopeRow | None]:
    """Check (and for ``enter``, take; for ``leave``, free) the scope of ``key`` under the held lock.

    :param key: the key held (a pool's slot: a scope over a pool holds one slot, whose row is its own).
    :param records: a ``leave`` that records a completion: the scope must still be its own and
        live; it is freed with the record (:func:`record_and_free`), not here.
    :returns: the scope's fencing token (``enter``, ``member``, a recording ``leave``), and the row as found.
    :raises LockBusyError: another holder's scope is live (``outside``, ``enter``).
    :raises LockLostError: a member found its scope gone, lapsed or taken; a recording
        ``leave`` found it gone or lapsed (nothing is recorded then).
    """
    from airflow_pglock.pg import scopes
    from airflow_pglock.pg.key_names import SCOPES_LIVE, scopes_installed

    conn: Any = held.connection
    if role.kind == "outside":
        if key.name is None or held.registry != SCOPES_LIVE:
            return None, None  # no table, or no scope live anywhere (the horizon passed): nothing to read
        row = scopes.read(conn, key)
        held.answered()
        if row is not None and row.live and role.hands_over and row.holder == role.holder:
            # The hold an earlier try of this task instance left (a deferral timeout, a trigger
            # cancelled): that try is over; this one starts without it.
            scopes.leave(conn, key, role.holder)
            held.answered()  # its commit may wait for a standby, its horizon's lock be tried: not idle
            return None, None
        if row is not None and row.live:
            raise _busy(key, row)
        return None, row
    if key.name is None:
        raise LockConfigurationError(f"a lock scope needs a named key, got {key.describe()}")
    if not scopes_installed(held.registry):
        raise scopes.missing_table_error()
    checked = _check_own_scope(role, key, held, application_name, records)
    held.answered()  # each path ran its statements on the lock's session (a commit may wait for a standby)
    return checked


def _check_own_scope(
    role: ScopeRole, key: LockKey, held: HeldLock, application_name: str | None, records: bool
) -> tuple[int | None, ScopeRow | None]:
    """:func:`check_before_work` of a task of the scope (``enter``, ``member``, ``resume``, ``leave``)."""
    import psycopg

    from airflow_pglock.pg import scopes

    conn: Any = held.connection
    assert role.holder is not None
    if role.kind == "enter":
        taken, row = scopes.enter(conn, key, role.holder, role.run or role.holder, role.lease, lineage=role.lineage)
        if not taken:
            assert row is not None
            raise _busy(key, row)
        assert row is not None
        token = row.token
        if role.fencing and token is None:
            token = _issue_token(held, application_name)
            scopes.set_token(conn, key, role.holder, token)
        return token, row
    if role.kind in ("member", "resume"):
        row = scopes.rejoin(conn, key, role.holder, role.task, role.lease)
        if row is None:
            cause = _why_lost(scopes.read(conn, key), role)
            what = "the deferred hold of" if role.kind == "resume" else "the lock scope of"
            raise LockLostError(f"lost {what} {key.describe()}: {cause}", key, cause)
        return row.token, row
    if not records:
        return None, scopes.leave(conn, key, role.holder)
    # Another guard may have run in a gap after the scope lapsed: nothing may be recorded for it.
    row = scopes.read(conn, key)
    if row is None or row.holder != role.holder or not row.live:
        cause = _why_lost(row, role) + "; no completion recorded"
        if row is not None and row.holder == role.holder:  # its own row, lapsed: not left behind
            try:
                scopes.leave(conn, key, role.holder)
            except psycopg.Error as error:
                cause += f" (its lapsed row could not be deleted: {type(error).__name__})"
        raise LockLostError(f"lost the lock scope of {key.describe()} before its teardown: {cause}", key, cause)
    return row.token, row


def record_and_free(
    role: ScopeRole, key: LockKey, held: HeldLock, record: Callable[[], bool], logger: logging.Logger | Any
) -> bool:
    """The teardown of a scope that records a completion: ``record()`` and the row's delete in one
    transaction, still under the lock, so that the completion is committed exactly when the scope
    is freed (a failed delete rolls the record back; the row then keeps the scope and a retry of the
    teardown finds it). Lowering the horizon follows, best effort: a horizon left too high only
    makes guards read scope rows a while longer.

    :param record: records the completion (its statement checks the key is held).
    :returns: False when ``record()`` found the key not held (nothing recorded, nothing freed).
    """
    from airflow_pglock.pg import scopes

    assert role.holder is not None
    with scopes.one_transaction(held.connection):
        if not record():
            return False
        scopes.leave(held.connection, key, role.holder, lower=False)
    try:
        scopes.lower_horizon(held.connection)
    except Exception as error:  # the unlock that follows finds a session that ended
        logger.warning("pglock could not lower the scope horizon after freeing %s: %s", key.describe(), error)
    return True


def free_after_failed_enter(role: ScopeRole, key: LockKey, held: HeldLock, logger: logging.Logger | Any) -> None:
    """A setup that took the scope failed before its work ran: free it now, still under the
    lock (its operator could not tell which slot of a pool it took). Best effort: the lease ends it."""
    from airflow_pglock.pg import scopes

    assert role.holder is not None
    try:
        scopes.leave(held.connection, key, role.holder)
    except Exception as error:
        logger.warning("pglock could not free the lock scope of %s after its setup failed: %s", key.describe(), error)


def end_member_task(role: ScopeRole, key: LockKey, held: HeldLock, logger: logging.Logger | Any) -> None:
    """A task of the scope ends, still holding the key: renew the scope for the next task.

    The row may have lapsed while the task ran longer than the lease: nobody could take the
    scope meanwhile (the task held the key), so it is renewed whatever its lease said.
    """
    from airflow_pglock.pg import scopes

    assert role.holder is not None
    try:
        row = scopes.rejoin(held.connection, key, role.holder, None, role.lease, require_live=False)
    except Exception as error:  # the session may be gone: the release finds and reports that
        logger.warning("pglock could not renew the lock scope of %s: %s", key.describe(), error)
        return
    if row is None:
        logger.warning(
            "pglock: the lock scope of %s was no longer there when task %s ended (its row was deleted)",
            key.describe(),
            role.task,
        )


def _busy(key: LockKey, row: ScopeRow) -> LockBusyError:
    return LockBusyError(f"{key.describe()} is held by {row.describe()}", key, retry_after=max(0.0, row.seconds_left))


def _issue_token(held: HeldLock, application_name: str | None) -> int:
    from airflow_pglock import loss
    from airflow_pglock.pg import ledger

    token = ledger.issue_fencing_token(held.connection, held.key, application_name)
    if token is None:
        message = loss.lost_message(held.key.describe(), loss.NOT_HELD_AT_FENCING, transaction=False)
        raise LockLostError(message, held.key, loss.NOT_HELD_AT_FENCING)
    return token


def _why_lost(row: ScopeRow | None, role: ScopeRole) -> str:
    if row is None and role.kind == "resume":
        return "the hold was freed (its row was deleted) while the task was deferred"
    if row is None:
        return f"the scope was freed (its teardown ran, or its row was deleted) before {_this(role)} started"
    if row.holder != role.holder and role.kind == "resume":
        return f"its lease ran out while the task was deferred and {printable(row.run)} took the key"
    if row.holder != role.holder:
        return f"its lease ran out between tasks and {printable(row.run)} took the scope"
    return (
        f"its lease ran out at {row.lease_until.isoformat(timespec='seconds')} (database clock) before {_this(role)} "
        "started: another guard of the key may have run in the gap"
    )


def _this(role: ScopeRole) -> str:
    if role.kind == "resume":
        return "the task resumed"
    return "its teardown" if role.kind == "leave" else "this task"
