"""Many keys on one lock connection: a lock session's keys, or the sub-keys of a guarded task.

PostgreSQL counts advisory locks per session: ``pg_try_advisory_lock`` succeeds again for a
key the session already holds. A :class:`LockSet` therefore tracks what its session holds
and answers "busy" for such a key, and runs its operations one at a time under its own
lock: two threads sharing it never both hold one key. Its locks are session locks; they end
when released, or with the session.

:class:`LockSession` is a set on a dedicated connection of its own, with the lease and a
heartbeat (``AdvisoryLockHook.lock_session``). Inside a guarded task the ``lock`` handle
offers the same operations on the task's own connection, covered by the task's heartbeat.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg

from airflow_pglock import loss
from airflow_pglock.exceptions import LockConfigurationError, LockLostError, PgLockError
from airflow_pglock.hooks import lock_session as statements
from airflow_pglock.hooks.server import ServerInfo
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness

AnyKey = LockKey | str | int | tuple[int, int]


class SubLock:
    """One key held in a :class:`LockSet`, until :meth:`release` or the end of its session.

    :param owner: the set that holds it.
    :param key: the key.
    :param shared: whether it is held shared.
    :ivar acquired_at: when it was taken (UTC).
    """

    def __init__(self, owner: LockSet, key: LockKey, shared: bool) -> None:
        self.key = key
        self.shared = shared
        self.acquired_at = dt.datetime.now(dt.timezone.utc)
        self._owner = owner

    @property
    def lost(self) -> str | None:
        """Why the session (and with it this key) was lost, or None."""
        return self._owner.lost

    def release(self) -> bool:
        """Give the key back; whether it was still held (False once released or lost)."""
        return self._owner.release(self)

    def __repr__(self) -> str:
        return f"SubLock({self.key.describe()}, shared={self.shared})"


class LockSet:
    """Session locks on one connection, tracked, one operation at a time (thread-safe).

    :param connection: the connection whose session holds the keys.
    :param lost_reason: why that session was lost, or None while it lives.
    :param reserved: a key the connection holds already for someone else (a guarded task's
        own key): always busy here, never released here.
    :param can_wait: whether :meth:`lock` may wait (not on a connection inside a transaction).
    """

    def __init__(
        self,
        connection: psycopg.Connection[Any],
        lost_reason: Callable[[], str | None],
        *,
        reserved: LockKey | None = None,
        can_wait: bool = True,
    ) -> None:
        self.connection = connection
        self._lost_reason = lost_reason
        self._reserved = reserved.numbers if reserved is not None else None
        self._can_wait = can_wait
        self._mutex = threading.RLock()
        self._held: dict[tuple[int, ...], SubLock] = {}
        self._ended: str | None = None

    @property
    def lost(self) -> str | None:
        """Why the session was lost (every key with it), or None while it lives."""
        return self._ended or self._lost_reason()

    def held(self) -> list[LockKey]:
        """The keys held now, in the order they were taken (none once the session is lost)."""
        with self._mutex:
            return [] if self.lost else [sub.key for sub in self._held.values()]

    @contextlib.contextmanager
    def try_lock(self, key: AnyKey, shared: bool = False) -> Iterator[SubLock | None]:
        """Try once to take ``key`` for the ``with`` block; None when busy, also when this session
        holds it already (PostgreSQL would count it twice)."""
        lock_key = LockKey.coerce(key)
        taken = self._take([lock_key], shared, None)
        yield from self._hold(taken)

    @contextlib.contextmanager
    def lock(self, key: AnyKey, *, timeout: float, shared: bool = False) -> Iterator[SubLock | None]:
        """Wait at most ``timeout`` seconds (server-side) for ``key``; None if it ran out."""
        lock_key = LockKey.coerce(key)
        statements.check_wait_timeout(timeout)
        if not self._can_wait:
            raise LockConfigurationError(
                "lock(key, timeout=...) cannot wait on a connection inside the task's transaction "
                "(mode='transaction'); use try_lock or try_lock_many"
            )
        taken = self._take([lock_key], shared, timeout)
        yield from self._hold(taken)

    def try_lock_many(self, keys: Iterable[AnyKey], shared: bool = False) -> list[SubLock]:
        """Try every key at once (one round trip per 5,000 keys); the ones taken, in order.

        Every key is checked first: one bad key refuses the whole batch before anything is
        taken. A key given twice, or held by this session already, is not taken again.
        They stay held until :meth:`release` or the end of the session.
        """
        return self._take([LockKey.coerce(key) for key in keys], shared, None)

    def release(self, *locks: SubLock | AnyKey) -> bool:
        """Release keys this set holds (SubLocks or keys; one round trip); whether every one
        of them was held until now. Keys it does not hold are left alone."""
        wanted = [item.key if isinstance(item, SubLock) else LockKey.coerce(item) for item in locks]
        with self._mutex:
            subs = [self._held.pop(key.numbers) for key in wanted if key.numbers in self._held]
            if not subs or self.lost or self.connection.closed:
                return False
            by_mode = {mode: [sub.key for sub in subs if sub.shared is mode] for mode in (False, True)}
            answers: list[bool] = []
            with self._session_errors(subs[0].key):
                for shared, keys in by_mode.items():
                    if len(keys) == 1:
                        answers.append(statements.unlock(self.connection, keys[0], shared=shared))
                    elif keys:
                        answers += statements.unlock_many(self.connection, keys, shared=shared)
            return len(subs) == len(wanted) and all(answers)

    def release_all(self) -> bool:
        """Release every key this set holds, best effort (before its session closes: closing
        frees them too, but only once the server has ended the backend). Whether all were held."""
        held = self.held()
        if not held:
            return True
        try:
            return self.release(*held)
        except (PgLockError, psycopg.Error):  # the session is gone: its keys went with it
            return False

    def _hold(self, taken: list[SubLock]) -> Iterator[SubLock | None]:
        sub = taken[0] if taken else None
        try:
            yield sub
        finally:
            if sub is not None:
                self.release(sub)

    def _take(self, keys: list[LockKey], shared: bool, timeout: float | None) -> list[SubLock]:
        with self._mutex:
            reason = self.lost
            if reason is not None and keys:
                raise LockLostError(f"the lock session was lost: {reason}", keys[0], reason)
            fresh: dict[tuple[int, ...], LockKey] = {}
            for key in keys:
                if key.numbers not in self._held and key.numbers != self._reserved:
                    fresh.setdefault(key.numbers, key)
            wanted = list(fresh.values())
            if not wanted:
                return []
            with self._session_errors(wanted[0]):
                if timeout is not None:
                    got = [statements.wait_lock(self.connection, wanted[0], timeout, shared=shared)]
                elif len(wanted) == 1:
                    got = [statements.try_lock(self.connection, wanted[0], shared=shared)]
                else:
                    got = statements.try_lock_many(self.connection, wanted, shared=shared)
            taken = [SubLock(self, key, shared) for key, ok in zip(wanted, got, strict=True) if ok]
            self._held.update((sub.key.numbers, sub) for sub in taken)
            return taken

    @contextlib.contextmanager
    def _session_errors(self, key: LockKey) -> Iterator[None]:
        """A driver error that ends the session (terminated, timed out, broken) loses every key."""
        try:
            yield
        except psycopg.OperationalError as error:
            if not self.connection.closed and loss.is_ordinary_error(getattr(error, "sqlstate", None)):
                raise
            self._lose(error)
            reason = self.lost or "the session ended"
            raise LockLostError(f"the lock session was lost: {reason}", key, reason) from error

    def _lose(self, error: psycopg.Error) -> None:
        text = str(error).strip().splitlines()
        detail = text[0] if text else type(error).__name__
        self._ended = self._ended or f"the session ended ({type(error).__name__}: {detail})"
        self._held.clear()


class LockSession(LockSet):
    """A :class:`LockSet` on a dedicated connection of its own, kept alive by a heartbeat.

    Made by ``AdvisoryLockHook.lock_session()``: same lease, liveness settings, refusals
    and ``application_name`` as a guarded task's lock connection. The heartbeat asks the
    server every ``lease / 3`` s whether the session is alive (its locks can end only with
    it or by its own unlock); when it is not, every key is lost and the next operation,
    and the end of the ``with`` block, raise :class:`~airflow_pglock.exceptions.LockLostError`.

    :param connection: the session's dedicated connection (from ``open_lock_session``).
    :param server: what the connection found at the other end.
    :param liveness: the lease: heartbeat interval and loss deadline.
    """

    def __init__(self, connection: psycopg.Connection[Any], server: ServerInfo, liveness: Liveness) -> None:
        super().__init__(connection, lambda: None)
        self.server = server
        self._liveness = liveness
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name=f"pglock-session-heartbeat-{server.backend_pid}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the heartbeat and close the connection: every key is released with the session."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._liveness.loss_deadline + 5)
        self.release_all()
        with self._mutex:
            self._held.clear()
            self.connection.close()

    def _beat(self) -> None:
        confirmed = time.monotonic()
        while not self._stop.wait(self._liveness.heartbeat_interval):
            budget = max(confirmed + self._liveness.loss_deadline - time.monotonic(), 1.0)
            try:
                result = statements.probe(self.connection, None, False, budget)
            except psycopg.Error as error:
                if self._stop.is_set():
                    return
                with self._mutex:
                    self._lose(error)
                return
            if result == "no answer":
                silent = time.monotonic() - confirmed
                self._ended = loss.no_answer_reason(silent, self.server.server, self._liveness.lease)
                return
            confirmed = time.monotonic()
