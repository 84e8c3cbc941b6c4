"""What the protected work sees of its lock: :class:`LockHandle`.

Its sub-key operations run on the task's own connection, covered by the task's heartbeat
(see :class:`~airflow_pglock.lock_set.LockSet`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from airflow_pglock.exceptions import LockLostError
from airflow_pglock.keys import AnyKey, LockKey
from airflow_pglock.lock_set import LockSet, SubLock
from airflow_pglock.pg.held import HeldLock
from airflow_pglock.pg.key_names import scopes_installed
from airflow_pglock.server_rules import Scope


class LockHandle:
    """What the protected work sees of its lock.

    Its sub-keys (:meth:`try_lock`, :meth:`lock`, :meth:`try_lock_many`) are locks of the task's
    mode: session locks in session mode; in transaction mode transaction locks, which end with the
    lock's transaction (a sub-key given back stays busy to others until it commits).

    :ivar key: the key held.
    :ivar connection: in transaction mode, the connection whose open transaction holds
        the lock (do the protected database work on it); None in session mode.
    :ivar acquired_at: when the lock was taken (UTC).
    :ivar fencing_token: this acquisition's fencing token (``fencing=True``), else None.
    :ivar period: the ``once_per`` period being done, else None.
    :ivar slot: a pool (``slots=N``): the number of the slot held (1 to N), else None.
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
        self.slot: int | None = held.slot
        self.mode: Scope = held.scope
        self.shared: bool = held.shared
        self.acquired_at: dt.datetime = held.acquired_at
        self.database: str = held.server.database
        self.server: str = held.server.server
        self.backend_pid: int = held.server.backend_pid
        self.connection: psycopg.Connection[Any] | None = held.connection if held.scope == "transaction" else None
        # The guard's lock statement already said whether the scopes' tables are there (named keys only).
        known = None if held.registry is None else scopes_installed(held.registry)
        self._keys = LockSet(
            held.connection,
            lost_reason,
            reserved=held.key,
            can_wait=held.scope == "session",
            scopes=known,
            scope=held.scope,
        )

    # Sub-keys on the task's own connection, covered by its heartbeat (see lock_set.LockSet).

    def try_lock(self, key: AnyKey, shared: bool = False) -> contextlib.AbstractContextManager[SubLock | None]:
        """Try once to take another key (e.g. a tenant) for a ``with`` block; None when busy."""
        return self._keys.try_lock(key, shared)

    def lock(
        self, key: AnyKey, *, timeout: float, shared: bool = False
    ) -> contextlib.AbstractContextManager[SubLock | None]:
        """Wait at most ``timeout`` seconds (server-side) for another key; None if it ran out."""
        return self._keys.lock(key, timeout=timeout, shared=shared)

    def try_lock_many(self, keys: Iterable[AnyKey], shared: bool = False) -> list[SubLock]:
        """Try many keys in one round trip; the ones taken (held until released or the task ends)."""
        return self._keys.try_lock_many(keys, shared)

    def release(self, *locks: SubLock | AnyKey) -> bool:
        """Release sub-keys taken through this handle; whether each was still held."""
        return self._keys.release(*locks)

    def held(self) -> list[LockKey]:
        """The sub-keys held now (not the task's own key)."""
        return self._keys.held()

    def release_all(self) -> bool:
        """Release every sub-key held now (one round trip; the task's own key stays held), but those
        an open ``with`` block holds: its end releases them."""
        return self._keys.release_all()

    @property
    def sub_key_ended_early(self) -> LockKey | None:
        """Transaction mode: the first sub-key found ended before the lock's transaction when it
        was given back (a ``ROLLBACK TO SAVEPOINT``, an error, the work's own ``COMMIT``), else
        None. The task then ends lost, even if the work caught the ``LockLostError``."""
        return self._keys.ended_early

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
