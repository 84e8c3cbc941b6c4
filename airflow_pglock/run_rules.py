"""Rules beyond mutual exclusion, checked and recorded under the lock: once_per, min_interval, fencing.

Policy only; the SQL is in :mod:`airflow_pglock.pg.ledger`. A lock stops two runs at
the *same time*; these rules stop a second run *after* the first one (``once_per``: one
completion per key and period; ``min_interval``: none while the last completion is too
recent, on the database clock) and give each holder a fencing token that only grows.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_pglock.exceptions import (
    AlreadyDoneError,
    LockConfigurationError,
    LockLostError,
    PgLockError,
)
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.keys import MAX_KEY_NAME_BYTES

if TYPE_CHECKING:  # the ledger (SQL, psycopg) loads when a rule runs, not when a DAG is parsed
    from airflow_pglock.pg.database import LockDatabase
    from airflow_pglock.pg.held import HeldLock

#: The longest ``once_per`` period, in UTF-8 bytes: the key names' limit. The period is part of the
#: primary key of ``pglock.completions`` (a btree: index rows of at most 2704 bytes with PostgreSQL's
#: default 8 kB pages); a longer one let the work run, then failed its record at every try (each
#: retry doing the work again).
MAX_PERIOD_BYTES = MAX_KEY_NAME_BYTES


@dataclass(frozen=True)
class RunRules:
    """What to check after acquiring and record after success.

    :param period: the rendered ``once_per`` value (e.g. the data interval start), or None.
    :param min_interval: seconds; skip while the key's last completion is more recent.
    :param fencing: issue a fencing token for each acquisition.
    """

    period: str | None = None
    min_interval: float | None = None
    fencing: bool = False

    def __post_init__(self) -> None:
        check_period(self.period)
        if self.min_interval is not None and (
            isinstance(self.min_interval, bool)
            or not isinstance(self.min_interval, int | float)
            or not math.isfinite(self.min_interval)
            or self.min_interval <= 0
        ):
            raise LockConfigurationError(
                f"min_interval must be a positive timedelta or number of seconds, got {self.min_interval!r}"
            )
        if not isinstance(self.fencing, bool):
            raise LockConfigurationError(f"fencing must be True or False, got {self.fencing!r}")

    @property
    def active(self) -> bool:
        return self.period is not None or self.min_interval is not None or self.fencing

    @property
    def records_completion(self) -> bool:
        return self.period is not None or self.min_interval is not None


def check_period(period: Any) -> None:
    """Refuse a ``once_per`` period the ledger cannot store (before any connection): not non-empty
    text, a NUL (PostgreSQL text cannot hold one), a lone surrogate (no UTF-8 form), or longer than
    :data:`MAX_PERIOD_BYTES`."""
    if period is None:
        return
    if not isinstance(period, str) or not period.strip():
        raise LockConfigurationError(f"once_per must render to a non-empty period, got {period!r}")
    if "\x00" in period:
        raise LockConfigurationError(
            f"once_per must render to a period without NUL characters (PostgreSQL text cannot hold them, so the "
            f"period could be neither looked up nor recorded), got {_shortened(period)}"
        )
    try:
        encoded = period.encode("utf-8")
    except UnicodeEncodeError as error:
        raise LockConfigurationError(
            f"once_per must render to UTF-8 text, got {_shortened(period)} with {period[error.start]!r} at position "
            f"{error.start} (a lone surrogate, e.g. from bytes decoded with errors='surrogateescape')"
        ) from None
    if len(encoded) > MAX_PERIOD_BYTES:
        raise LockConfigurationError(
            f"once_per rendered to a period of {len(encoded)} bytes in UTF-8; a period is at most {MAX_PERIOD_BYTES} "
            "bytes, as a key name (it is part of the primary key of pglock.completions: a longer one would let the "
            f"work run, then fail its record at every try), got {_shortened(period)}. Render a short period that "
            "names it, e.g. '{{ ds }}'"
        )


def _shortened(text: str) -> str:
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"


def seconds(value: float | dt.timedelta | None, option: str) -> float | None:
    """A duration option as seconds (timedelta or number)."""
    if value is None:
        return None
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LockConfigurationError(f"{option} must be a timedelta or a number of seconds, got {value!r}")
    return float(value)


#: How far in the future of the database clock the key's last completion may be dated before
#: ``min_interval`` fails instead of skipping: a completion is dated by the database itself, so
#: only a clock set back (or a promoted standby's clock behind) or a row written by hand puts it
#: there, and beyond a moment it would skip every run until that date.
FUTURE_COMPLETION_TOLERANCE_SECONDS = 60.0


def check_before_work(
    rules: RunRules, held: HeldLock, database: LockDatabase, application_name: str | None
) -> int | None:
    """Skip (AlreadyDoneError) if the period is done or the key too fresh; else issue a token if asked.

    Raises LockLostError when the token could not be issued because the lock was not held
    any more (e.g. the holder stalled past the lease before it): the work must not run.
    """
    from airflow_pglock.pg import ledger

    conn: Any = held.connection
    if rules.period is not None:
        done = ledger.completion_for_period(conn, held.key, rules.period)
        held.answered()
        if done is not None:
            raise AlreadyDoneError(
                f"{held.key.describe()} already done for period {rules.period!r} {done.describe()} (once_per)",
                held.key,
                done,
            )
    if rules.min_interval is not None:
        latest = ledger.last_completion(conn, held.key)
        held.answered()
        if latest is not None and latest.age_seconds < -FUTURE_COMPLETION_TOLERANCE_SECONDS:
            raise PgLockError(
                f"{held.key.describe()}'s last completion is dated {-latest.age_seconds:.0f} s in the future of "
                f"the database clock ({latest.describe()}): the database's clock was set back, or the row in "
                "pglock.completions was written by hand. min_interval cannot be judged from it: delete the row "
                "(or correct its completed_at) to run the task again"
            )
        if latest is not None and latest.age_seconds < rules.min_interval:
            raise AlreadyDoneError(
                f"{held.key.describe()} completed {latest.age_seconds:.1f} s ago, less than "
                f"min_interval={rules.min_interval:g} s: {latest.describe()} (database clock)",
                held.key,
                latest,
            )
    if rules.fencing:
        from airflow_pglock import loss

        transaction = held.scope == "transaction"
        try:
            token = _issue_fencing_token(held, database, application_name)
        except PgLockError as error:
            # A token whose commit wait was cut off (TOKEN_COMMIT_WAIT_SECONDS) may have outlasted the lease
            if transaction and not held.is_held():
                raise _lost_after_fencing(held) from error
            raise
        if token is None:
            message = loss.lost_message(held.key.describe(), loss.NOT_HELD_AT_FENCING, transaction=transaction)
            raise LockLostError(message, held.key, loss.NOT_HELD_AT_FENCING)
        if transaction and time.monotonic() - held.answered_monotonic >= database.liveness.heartbeat_interval:
            # The token's statement found the lock's transaction before its commit, which may then wait
            # (a synchronous standby, a row lock) while that transaction sits idle on its own connection:
            # past the lease the server ends it, and the work must not start. Asked only after a slow
            # token (a round trip): the heartbeat would find the loss only once the work had begun.
            if not held.is_held():
                raise _lost_after_fencing(held)
            held.answered()
        return token
    return None


def _lost_after_fencing(held: HeldLock) -> LockLostError:
    """A transaction lock found ended once its token's commit returned: the work must not start."""
    from airflow_pglock import loss

    message = loss.lost_message(held.key.describe(), loss.NOT_HELD_AFTER_FENCING, transaction=True)
    return LockLostError(message, held.key, loss.NOT_HELD_AFTER_FENCING)


def _issue_fencing_token(held: HeldLock, database: LockDatabase, application_name: str | None) -> int | None:
    """The lock's fencing token, or None when the lock was found not held (nothing issued)."""
    from airflow_pglock.pg import ledger

    if held.scope == "transaction":
        # Issued on a side connection (committed at once, still under the lock): a token issued
        # inside the lock's transaction stays invisible to other sessions until it commits, so
        # they would keep accepting the previous holder's token meanwhile. The statement checks
        # that the lock's session is still in its transaction: a holder stalled past the lease
        # before its token (a slow side connect, a pause) lost the key and must not get one.
        with database.side_connection("pglock fencing", database.connect_timeout) as side:
            return ledger.issue_fencing_token(
                side,
                held.key,
                application_name,
                holder_pid=held.server.backend_pid,
                shared=held.shared,
                xact_id=held.xact_id,
            )
    token = ledger.issue_fencing_token(held.connection, held.key, application_name, shared=held.shared)
    held.answered()  # its commit may have waited long for a synchronous standby: the session was not idle
    return token


def record_success(rules: RunRules, held: HeldLock, identity: TaskIdentity | None, token: int | None) -> bool:
    """Record the completion (in transaction mode, inside the lock's transaction).

    :returns: False when nothing could be recorded because the lock was not held any more
        (the recording statement checks it itself); True otherwise.
    """
    if not rules.records_completion:
        return True
    from airflow_pglock.pg import ledger

    period = rules.period if rules.period is not None else ledger.ROLLING_PERIOD
    return ledger.record_completion(
        held.connection, held.key, period, identity, token, shared=held.shared, xact_id=held.xact_id
    )


def check_not_pooled(rules: RunRules, slots: int) -> None:
    """once_per / min_interval / fencing are records of one key: refused on a pool of several slots."""
    if slots > 1 and rules.active:
        raise LockConfigurationError(
            f"slots={slots} cannot be combined with once_per, min_interval or fencing: those are recorded per key, "
            "and each run of a pool holds a different slot"
        )


def check_not_warned(rules: RunRules, on_lost: str) -> None:
    """Refuse once_per / min_interval with ``on_lost="warn"`` (before any I/O).

    A run whose lock was lost goes on under "warn" and ends as a success, but records nothing
    (the record needs the lock): the period is still not done, so the next run does the work
    again, and while the key was free another run may have done it at the same time.
    """
    used = [
        name
        for name, on in (("once_per", rules.period is not None), ("min_interval", rules.min_interval is not None))
        if on
    ]
    if on_lost == "warn" and used:
        raise LockConfigurationError(
            f"{' / '.join(used)} cannot be combined with on_lost='warn': a run that lost its lock goes on and "
            "succeeds without a record, so the period's work could run again, or twice at once. Use on_lost='fail' "
            "(the default) with these rules"
        )


def check_not_shared(rules: RunRules, shared: bool) -> None:
    """Refuse once_per / min_interval / fencing with a shared lock (before any I/O).

    Shared holders run side by side: two of them would both find the period not done and
    both do its work, and a fencing token means "the newest holder", which several shared
    holders cannot all be.
    """
    if shared and rules.active:
        used = [
            name
            for name, on in (
                ("once_per", rules.period is not None),
                ("min_interval", rules.min_interval is not None),
                ("fencing", rules.fencing),
            )
            if on
        ]
        raise LockConfigurationError(
            f"{' / '.join(used)} cannot be combined with shared=True: shared holders run at the same time, so "
            "the check before the work and the record after it would not be serialized by the lock (two "
            "holders could both run the same period). Use an exclusive lock (shared=False) for these rules"
        )
