"""Errors raised by airflow-pglock. Pure: no Airflow, no database driver, nothing of
the package (a leaf: every other module may import it; a key or a holder an error carries is
typed ``Any`` for that reason).

Every error the provider raises is a :class:`PgLockError` (``except PgLockError`` catches
them all); the ones about a bad value are also ``ValueError``. Two things are not errors
of this family on purpose: :class:`LockLostInterrupt` (a BaseException, see there) and
the ``AirflowSkipException`` / ``AirflowFailException`` that the Airflow adapters turn
outcomes into.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "AlreadyDoneError",
    "InvalidLockKeyError",
    "LockBusyError",
    "LockConfigurationError",
    "LockConnectionError",
    "LockLostError",
    "LockLostInterrupt",
    "PgLockError",
    "ScopeHorizonBusyError",
    "StandbyServerError",
    "UnknownLockOptionError",
    "UnsafeSetupError",
]


class PgLockError(Exception):
    """Base class of every airflow-pglock error."""


class InvalidLockKeyError(PgLockError, ValueError):
    """A key (name, number, pair or tenant) that cannot be an advisory lock key."""


class LockConfigurationError(PgLockError, ValueError):
    """A setting the DAG author or operator must fix (connection, parameter, key template)."""


class UnknownLockOptionError(LockConfigurationError, TypeError):
    """A keyword argument that is not a lock option (a TypeError, as Python raises for any call)."""


class UnsafeSetupError(PgLockError):
    """The database set-up cannot give mutual exclusion (standby, pooler, not PostgreSQL)."""


class StandbyServerError(UnsafeSetupError):
    """The lock database answered as a standby in recovery: advisory locks are not replicated, so
    it holds none of the primary's locks. Often a moment of a failover (an address that still
    leads to the demoted server, or to a standby not yet promoted), so a guarded task fails with
    it and Airflow's retries apply, as for a database that cannot be reached; the other unsafe
    set-ups fail without a retry."""


class LockConnectionError(PgLockError):
    """The lock database could not be reached or refused the login (or could not make a fencing
    token durable: its synchronous standby did not confirm it)."""


class ScopeHorizonBusyError(PgLockError):
    """A lock scope's write could not take the scopes' horizon lock in time: another session kept
    it (a writer whose commit waits for a synchronous standby, or a foreign client holding the
    advisory key ``airflow-pglock/scope-horizon``). The database and the session are fine; the
    write was rolled back. The message names the sessions that held it."""


class LockBusyError(PgLockError):
    """Another session holds the key (or the bounded wait for it ran out).

    :ivar key: the :class:`~airflow_pglock.keys.LockKey` asked for.
    :ivar holders: the :class:`~airflow_pglock.holder.LockHolder` s that hold it, as far as known.
    :ivar retry_after: seconds until trying again makes sense, when the refusal knows (another
        run's lock scope: until its lease ends, unless its teardown frees it sooner); else None.
    """

    def __init__(self, message: str, key: Any, holders: Sequence[Any] = (), retry_after: float | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.holders = tuple(holders)
        self.retry_after = retry_after


class LockLostError(PgLockError):
    """The lock was lost while the protected work ran: another worker may run it now.

    :ivar key: the :class:`~airflow_pglock.keys.LockKey` that was held.
    :ivar cause: why it was lost.
    """

    def __init__(self, message: str, key: Any, cause: str) -> None:
        super().__init__(message)
        self.key = key
        self.cause = cause


class LockLostInterrupt(BaseException):
    """Raised *inside* the protected work when its lock is lost (``on_lost="fail"``).

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` in the work does
    not swallow it. When the work ends, the guard replaces it by :class:`LockLostError`
    (the task fails, even if the work caught the interruption). Catch it only to clean up,
    then re-raise it; the lock is no longer held when it is raised.
    """


class AlreadyDoneError(PgLockError):
    """The work is already done: ``once_per`` period completed, or within ``min_interval``."""

    def __init__(self, message: str, key: Any, completion: object) -> None:
        super().__init__(message)
        self.key = key
        self.completion = completion
