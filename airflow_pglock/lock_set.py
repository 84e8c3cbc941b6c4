"""Many keys on one lock connection: a lock session's keys, or the sub-keys of a guarded task.

PostgreSQL counts advisory locks per session: ``pg_try_advisory_lock`` succeeds again for a
key the session already holds. A :class:`LockSet` therefore tracks what its session holds
and answers "busy" for such a key, and runs its operations one at a time under its own
lock: two threads sharing it never both hold one key. Its locks are session locks, which end
when released or with the session; beside a transaction lock (``mode="transaction"``) they
are transaction locks, which end with the lock's transaction: given back, a key stays busy to
others until then, so what was written under it is committed before anyone else can take it.

:class:`LockSession` is a set on a dedicated connection of its own, with the lease and the
heartbeat every lock has (``AdvisoryLockHook.lock_session``). Inside a guarded task the ``lock`` handle
offers the same operations on the task's own connection, covered by the task's heartbeat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from airflow_pglock import forks, loss
from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError, LockLostError, PgLockError
from airflow_pglock.heartbeat import Heartbeat
from airflow_pglock.keys import AnyKey, LockKey
from airflow_pglock.pg import scopes, statements
from airflow_pglock.pg.database import LockDatabase
from airflow_pglock.pg.probe import ProbeResult, probe
from airflow_pglock.pg.release import unlock
from airflow_pglock.policy import check_shared
from airflow_pglock.server_rules import Scope, ServerInfo

log = logging.getLogger("airflow_pglock")


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
        #: Set once its release was asked (by the caller): from then on its with block no longer owns it.
        self.given_back = False
        #: Whether an open ``with`` block holds it: only that block, or this SubLock's own
        #: :meth:`release`, gives it back (not a release by key, nor ``release_all``).
        self.in_block = False

    @property
    def lost(self) -> str | None:
        """Why the session (and with it this key) was lost, or None."""
        return self._owner.lost

    def release(self) -> bool:
        """Give the key back; whether it was still held (False once released or lost)."""
        return self._owner.release(self)

    def __repr__(self) -> str:
        return f"SubLock({self.key.describe()}, shared={self.shared})"


class HoldForBlock:
    """The ``with`` block of :meth:`LockSet.try_lock` or :meth:`LockSet.lock`: the key is taken as
    the block begins (its :class:`SubLock`, or None when busy) and released as it ends, also when
    it fails. At a normal end, a key the session no longer held raises
    :class:`~airflow_pglock.exceptions.LockLostError`: the block ran at least partly without it.

    One block only, as a generator-based context manager. A class rather than one: a lock
    session takes keys in tight loops, where ``contextlib``'s machinery cost a few microseconds
    a key (docs/benchmarks.md, "Many keys, one session").
    """

    __slots__ = ("_entered", "_key", "_owner", "_shared", "_sub", "_timeout")

    def __init__(self, owner: LockSet, key: LockKey, shared: bool, timeout: float | None) -> None:
        self._owner = owner
        self._key = key
        self._shared = shared
        self._timeout = timeout
        self._sub: SubLock | None = None
        self._entered = False

    def __enter__(self) -> SubLock | None:
        if self._entered:
            raise LockConfigurationError(
                f"the with block of {self._key.describe()} was entered already: each try_lock/lock call "
                "is for one with block"
            )
        self._entered = True
        taken = self._owner._take([self._key], self._shared, self._timeout, for_block=True)
        self._sub = taken[0] if taken else None
        return self._sub

    def __exit__(self, error_type: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        self._owner._end_of_block(self._sub, failed=error_type is not None)

    def __bool__(self) -> bool:
        # `if lock.try_lock(key):` would always be true and run the work with nothing taken.
        raise LockConfigurationError(
            f"try_lock()/lock() of {self._key.describe()} returns a context manager, not whether the key "
            "was taken: use `with lock.try_lock(key) as sub:` and check `sub is None` (busy)"
        )


class LockSet:
    """Advisory locks on one connection, tracked, one operation at a time (thread-safe).

    :param connection: the connection whose session holds the keys.
    :param lost_reason: why that session was lost, or None while it lives.
    :param reserved: a key the connection holds already for someone else (a guarded task's
        own key): always busy here, never released here.
    :param can_wait: whether :meth:`lock` may wait (not on a connection inside a transaction).
    :param scopes: whether the lock scopes' tables are there (None: asked at the first named key).
        A named key that another run's lock scope holds between its tasks is busy here too.
    :param scope: ``"session"``: session locks; ``"transaction"``: transaction locks, on a
        connection whose open transaction holds a transaction lock. They end with it: a release
        only checks that the transaction still holds them (a ``ROLLBACK TO SAVEPOINT`` ends those
        taken after the savepoint, an error that aborts the transaction every one; in a failed
        transaction it raises InFailedSqlTransaction), and announces them; the work's
        ``pg_advisory_unlock_all()`` leaves them alone.
    """

    def __init__(
        self,
        connection: psycopg.Connection[Any],
        lost_reason: Callable[[], str | None],
        *,
        reserved: LockKey | None = None,
        can_wait: bool = True,
        scopes: bool | None = None,
        scope: Scope = "session",
    ) -> None:
        self._scopes = scopes
        self._scope: Scope = scope
        #: Transaction locks: the first key found ended before its transaction (a savepoint's
        #: rollback, an error, the work's own COMMIT) when it was given back, or None. It stays
        #: set, so that the task ends lost even when the work caught the error or ignored the answer.
        self.ended_early: LockKey | None = None
        self.connection = connection
        self._statement_cursor: psycopg.Cursor[Any] | None = None
        self._lost_reason = lost_reason
        self._reserved = reserved.numbers if reserved is not None else None
        self._can_wait = can_wait
        self._mutex = threading.RLock()
        self._held: dict[tuple[int, ...], SubLock] = {}
        # Keys the session may hold although nobody holds them through this set: those of a
        # take or a release whose statement failed part-way (cancelled, out of shared memory).
        # Busy to take (PostgreSQL would count them twice); released at the next chance.
        self._unsettled: dict[tuple[int, ...], tuple[LockKey, bool]] = {}
        self._ended: str | None = None
        self._holder_pid = os.getpid()
        forks.after_fork_in_child(self, LockSet._forked)

    @property
    def _cursor(self) -> psycopg.Cursor[Any]:
        """One cursor for the single-key statements, which a lock session runs in tight loops (a
        cursor per statement costs a few microseconds a key); used under ``_mutex`` only. Made at
        the first statement, inside its session-error guard: on a connection closed by then it
        raises as the statement would (a lost session, not a construction error)."""
        if self._statement_cursor is None:
            self._statement_cursor = self.connection.cursor()
        return self._statement_cursor

    def _forked(self) -> None:
        """In a child forked while the set lived: its keys are the parent's. Every operation in
        the child raises LockLostError saying so, and touches none of them (its copy of the
        connection no longer reaches the server)."""
        self._mutex = threading.RLock()  # may have been held by a thread of the parent
        self._ended = forks.forked_reason(self._holder_pid)

    @property
    def lost(self) -> str | None:
        """Why the session was lost (every key with it), or None while it lives."""
        return self._ended or self._lost_reason()

    def held(self) -> list[LockKey]:
        """The keys held now, in the order they were taken (none once the session is lost)."""
        with self._mutex:
            return [] if self.lost else [sub.key for sub in self._held.values()]

    def try_lock(self, key: AnyKey, shared: bool = False) -> HoldForBlock:
        """Try once to take ``key`` for the ``with`` block; None when busy, also when this session
        holds it already (PostgreSQL would count it twice)."""
        lock_key = LockKey.coerce(key)
        check_shared(shared)
        return HoldForBlock(self, lock_key, shared, None)

    def lock(self, key: AnyKey, *, timeout: float | dt.timedelta, shared: bool = False) -> HoldForBlock:
        """Wait at most ``timeout`` (seconds or a ``timedelta``, server-side) for ``key``; None if it ran out."""
        lock_key = LockKey.coerce(key)
        check_shared(shared)
        timeout = statements.wait_seconds(timeout)
        if not self._can_wait:
            raise LockConfigurationError(
                "lock(key, timeout=...) cannot wait on a connection inside the task's transaction "
                "(mode='transaction'); use try_lock or try_lock_many"
            )
        return HoldForBlock(self, lock_key, shared, timeout)

    def take_for_scope(self, key: LockKey) -> SubLock | None:
        """Try once to take ``key`` exclusively for the holder of its lock scope row (the triggerer's
        hold of a deferred task), which the caller checks and renews under it: no scope row makes
        it busy here. None when busy, also when this session holds it already."""
        taken = self._take([key], False, None, see_scopes=False)
        return taken[0] if taken else None

    def try_lock_many(self, keys: Iterable[AnyKey], shared: bool = False) -> list[SubLock]:
        """Try every key at once (one round trip per 5,000 keys); the ones taken, in order.

        Every key is checked first: one bad key refuses the whole batch before anything is
        taken. A key given twice, or held by this session already, is not taken again.
        They stay held until :meth:`release` or the end of the session. A batch whose
        statement fails (cancelled, out of shared memory) raises the driver's error and
        holds none of its keys: those it took before the error are released.
        """
        batch = [LockKey.coerce(key) for key in _batch(keys)]
        check_shared(shared)
        return self._take(batch, shared, None)

    def release(self, *locks: SubLock | AnyKey) -> bool:
        """Release keys this set holds (SubLocks or keys; one round trip); whether every one
        of them was held until now. Keys it does not hold are left alone. A release whose
        statement fails raises the driver's error; its keys are released all the same (at
        once, or at the set's next operation), never left held and forgotten. On a lost
        session it raises :class:`~airflow_pglock.exceptions.LockLostError`, as every other call."""
        with self._mutex:
            # A SubLock releases its own hold only: once released, the same key taken again is
            # another SubLock's (a stale one must not free it); a key releases whoever holds it here.
            # A key an open with block holds is that block's: released by key, the block would run
            # on without it and end as a success. Refused before anything is released.
            found: dict[tuple[int, ...], SubLock] = {}
            unheld = False  # one of them was not held here (a key named twice is one key)
            for item in locks:
                if isinstance(item, SubLock):
                    if self._held.get(item.key.numbers) is item:
                        found[item.key.numbers] = item
                    else:
                        unheld = True
                    continue
                if isinstance(item, list):
                    raise InvalidLockKeyError(
                        f"release() takes each key or sub-lock as an argument of its own, got the list {item!r}: "
                        "pass release(*items), or a tuple for one (int32, int32) pair"
                    )
                numbers = LockKey.coerce(item).numbers
                holder = self._held.get(numbers)
                if holder is not None and holder.in_block:
                    raise LockConfigurationError(
                        f"{holder.key.describe()} is held by an open with block (try_lock/lock), which "
                        "releases it as it ends: to give it back sooner, release the block's sub-lock "
                        "(sub.release())"
                    )
                if holder is not None:
                    found[numbers] = holder
                else:
                    unheld = True
            subs = list(found.values())
            reason = self.lost
            if not subs:
                if reason is not None:  # dropped with the session: never a quiet False
                    raise LockLostError(f"the lock session was lost: {reason}", _first_key(locks), reason)
                return False
            for sub in subs:
                sub.given_back = True
            if reason is not None or self.connection.closed:
                for sub in subs:
                    self._held.pop(sub.key.numbers, None)
                if reason is not None:  # as every other call on a lost session: never a quiet False
                    raise LockLostError(f"the lock session was lost: {reason}", subs[0].key, reason)
                return False
            self._settle()
            try:
                gone = self._unlock(subs)
            except BaseException as error:
                self._unsettle_after(error, [(sub.key, sub.shared) for sub in subs])
                raise
            finally:
                for sub in subs:
                    self._held.pop(sub.key.numbers, None)
            return not unheld and not gone

    def release_all(self) -> bool:
        """Release every key this set holds, and those a failed statement may have left, best
        effort (before its session closes: closing frees them too, but only once the server has
        ended the backend). Whether all were held (transaction locks: until now, see :meth:`release`).
        A key an open ``with`` block holds stays held: the block releases it as it ends."""
        try:
            with self._mutex:
                held = [] if self.lost else [sub for sub in self._held.values() if not sub.in_block]
                self._settle()
            return self.release(*held) if held else True
        except (PgLockError, psycopg.Error):  # the session is gone, or the release will be settled
            return False

    def _end_of_block(self, sub: SubLock | None, failed: bool) -> None:
        """What the end of a ``with`` block of :meth:`try_lock` or :meth:`lock` does with its key."""
        with self._mutex:  # no release by key between the block's end and its own release
            if sub is not None:
                sub.in_block = False
            self._end_block_holding_the_mutex(sub, failed)

    def _end_block_holding_the_mutex(self, sub: SubLock | None, failed: bool) -> None:
        if failed:
            if sub is not None:
                with contextlib.suppress(PgLockError, psycopg.Error):  # the block's own error is the one to see
                    self.release(sub)
            return
        if sub is None or sub.given_back:
            return  # busy, or released inside the block: the key may be another SubLock's now
        if self._held.get(sub.key.numbers) is not sub:
            # Dropped without a release: its session was lost (a statement found it ended, maybe
            # another thread's) or closed while the block ran, which ran at least partly without it.
            reason = self.lost or "the lock session was closed while the block ran"
            raise LockLostError(f"lost {sub.key.describe()}: {reason}", sub.key, reason)
        if not self.release(sub) and self.lost is None:
            # The session lives but no longer held the key (an unlock on its connection; a transaction
            # lock: a savepoint's rollback, an error or the work's own COMMIT): the block ran at least
            # partly without it.
            if self._scope == "transaction":
                reason = loss.found_at_release(f"the lock's transaction no longer held {sub.key.describe()} ({_ENDED})")
            else:
                reason = loss.found_at_release(f"the session no longer held {sub.key.describe()}")
            raise LockLostError(f"lost {sub.key.describe()}: {reason}", sub.key, reason)

    def _take(
        self,
        keys: list[LockKey],
        shared: bool,
        timeout: float | None,
        *,
        see_scopes: bool = True,
        for_block: bool = False,
    ) -> list[SubLock]:
        with self._mutex:
            reason = self.lost
            if reason is not None and keys:
                raise LockLostError(f"the lock session was lost: {reason}", keys[0], reason)
            self._settle()
            fresh: dict[tuple[int, ...], LockKey] = {}
            for key in keys:
                if (
                    key.numbers not in self._held
                    and key.numbers not in self._unsettled
                    and key.numbers != self._reserved
                ):
                    # A key given twice is taken once, as its named copy if any: a name is what
                    # lock scopes hold, and the number alone reads no scope row.
                    known = fresh.get(key.numbers)
                    if known is None or (known.name is None and key.name is not None):
                        fresh[key.numbers] = key
            wanted = list(fresh.values())
            if not wanted:
                return []
            seeing = see_scopes and self._scopes is not False and any(key.name is not None for key in wanted)
            try:
                with self._session_errors(wanted[0]):
                    if seeing and self._scopes is None:
                        self._scopes = statements.scopes_installed(self.connection)
                    seeing = seeing and bool(self._scopes)
                    live = seeing
                    conn, scope = self.connection, self._scope
                    if timeout is not None:  # a wait: any scope may have begun meanwhile
                        got = [statements.wait_lock(self.connection, wanted[0], timeout, shared=shared)]
                    elif seeing:
                        *got, live = statements.try_lock_seeing_scopes(
                            self.connection, wanted, shared=shared, scope=scope
                        )
                    elif len(wanted) == 1:
                        got = [statements.try_lock(conn, wanted[0], shared=shared, scope=scope, cursor=self._cursor)]
                    else:
                        got = statements.try_lock_many(self.connection, wanted, shared=shared, scope=scope)
                    if live and any(got):
                        got = self._outside_scopes(wanted, got, shared)
            except BaseException as error:  # it may have taken some of them before the error (or the interrupt)
                self._unsettle_after(error, [(key, shared) for key in wanted])
                raise
            taken = [SubLock(self, key, shared) for key, ok in zip(wanted, got, strict=True) if ok]
            for sub in taken:  # under the mutex: no release by key can come before it is the block's
                sub.in_block = for_block
            self._held.update((sub.key.numbers, sub) for sub in taken)
            return taken

    def _outside_scopes(self, wanted: list[LockKey], got: list[bool], shared: bool) -> list[bool]:
        """Give back the keys just taken that another run's lock scope holds (busy, as a guard finds them)."""
        named = [key for key, ok in zip(wanted, got, strict=True) if ok and key.name is not None]
        scoped = scopes.live_among(self.connection, named) if named else set()
        if not scoped:
            return got
        refused = [key for key in named if key.numbers in scoped]
        if self._scope == "transaction":
            # A transaction lock cannot be given back: busy here, it stays taken until the
            # transaction ends (the scope's next task finds the key busy until then).
            log.warning(
                "pglock: %d sub-key(s) held by another run's lock scope were taken by this transaction and "
                "stay taken, unused, until it ends, e.g. %s",
                len(refused),
                refused[0].describe(),
            )
        else:
            statements.unlock_many(self.connection, refused, shared=shared)
        return [ok and key.numbers not in scoped for key, ok in zip(wanted, got, strict=True)]

    def _unlock(self, subs: list[SubLock]) -> list[SubLock]:
        """Unlock ``subs`` (one statement per mode); those the session no longer held."""
        if self._scope == "transaction":
            return self._give_back(subs)
        if len(subs) == 1:
            sub = subs[0]
            held = self._answered(
                sub.key, lambda: unlock(self.connection, sub.key, shared=sub.shared, cursor=self._cursor)
            )
            return [] if held else [sub]
        gone: list[SubLock] = []
        with self._session_errors(subs[0].key):  # a batch may stop part-way: its error stands
            for shared in (False, True):
                group = [sub for sub in subs if sub.shared is shared]
                if len(group) == 1:
                    answers = [unlock(self.connection, group[0].key, shared=shared)]
                elif group:
                    answers = statements.unlock_many(self.connection, [sub.key for sub in group], shared=shared)
                else:
                    continue
                gone += [sub for sub, held in zip(group, answers, strict=True) if not held]
        return gone

    def _answered(self, key: LockKey, statement: Callable[[], bool]) -> bool:
        """One key's unlock ``statement``, sent once more when a cancel (a foreign
        ``pg_cancel_backend()``, a ``statement_timeout``) stopped it on a session that lives on with no
        transaction open: its answer then decides, as for the guard's own key
        (``HeldLock.unlock_again_after``). In a transaction (the work's own, on this connection) the
        error stands, and the transaction is the work's to end."""
        with self._session_errors(key):
            try:
                return statement()
            except psycopg.errors.QueryCanceled:
                with self.connection.lock:
                    idle = self.connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
                if self.connection.closed or not idle:
                    raise
                return statement()

    def _give_back(self, subs: list[SubLock]) -> list[SubLock]:
        """Transaction locks: no statement ends one before its transaction does. Check that the
        transaction still held each (one statement per mode, which announces them too); those it
        no longer held. After the work ended the transaction, every one. In a failed transaction
        the statement raises InFailedSqlTransaction: whether a key is held then cannot be told (an
        error in a savepoint ends only the keys taken inside it), and the caller sees that error."""
        with self.connection.lock:  # not while another thread's statement runs (a heartbeat's probe)
            status = self.connection.info.transaction_status
        gone: list[SubLock] = []
        if status == psycopg.pq.TransactionStatus.IDLE:
            gone = list(subs)
        else:
            with self._session_errors(subs[0].key):
                for shared in (False, True):
                    group = [sub for sub in subs if sub.shared is shared]
                    if group:
                        answers = statements.given_back(self.connection, [sub.key for sub in group], shared=shared)
                        gone += [sub for sub, held in zip(group, answers, strict=True) if not held]
        if gone and self.ended_early is None:
            self.ended_early = gone[0].key
        return gone

    def _unsettle_after(self, error: BaseException, keys: list[tuple[LockKey, bool]]) -> None:
        """:meth:`_unsettle` after a failed statement; after an interrupt (KeyboardInterrupt, a
        timeout's exception: psycopg cancels the query first) nothing may replace the interrupt."""
        if isinstance(error, psycopg.Error):
            self._unsettle(keys)
            return
        try:
            self._unsettle(keys)
        except Exception as settling:  # the set is marked lost if its session broke: nothing is untracked
            log.warning("pglock could not release the keys of an interrupted statement yet: %s", settling)

    def _unsettle(self, keys: list[tuple[LockKey, bool]]) -> None:
        """A statement on these keys failed part-way: the session may hold any of them. Released
        now if the connection can run a statement, else at the next operation."""
        if self.lost is not None or self.connection.closed:
            return  # the session is gone, its keys with it
        if self._scope == "transaction":
            return  # the error aborted the transaction (or its savepoint), whose rollback ends them
        self._unsettled.update((key.numbers, (key, shared)) for key, shared in keys)
        self._settle()

    def _settle(self) -> None:
        """Release what the session still holds of the unsettled keys, when it can: not in a
        failed transaction (nothing runs there until it ends), nor while its session ends."""
        if not self._unsettled or self.connection.closed:
            return
        if self.connection.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            return
        entries = list(self._unsettled.values())
        for attempt in range(_SETTLE_ATTEMPTS):
            try:
                with self._session_errors(entries[0][0]):
                    for shared in (False, True):
                        keys = [key for key, mode in entries if mode is shared]
                        if keys:
                            statements.unlock_held_among(self.connection, keys, shared=shared)
            except psycopg.errors.QueryCanceled as error:  # a cancel as well: once more, as an unlock is sent again
                if attempt + 1 < _SETTLE_ATTEMPTS and self.lost is None and not self.connection.closed:
                    continue
                log.warning("pglock could not release %d keys of a failed statement yet: %s", len(entries), error)
                return
            except psycopg.Error as error:  # they stay busy, tried again next time
                log.warning("pglock could not release %d keys of a failed statement yet: %s", len(entries), error)
                return
            break
        self._unsettled.clear()

    def _session_errors(self, key: LockKey) -> _SessionErrors:
        """A ``with`` block whose driver error that ends the session (terminated, timed out,
        broken) loses every key: LockLostError instead, about ``key``."""
        return _SessionErrors(self, key)

    def _lose(self, error: psycopg.Error) -> None:
        text = str(error).strip().splitlines()
        detail = text[0] if text else type(error).__name__
        self._ended = self._ended or f"the session ended ({type(error).__name__}: {detail})"
        self._held.clear()
        self._unsettled.clear()


#: How many times the release of a failed statement's keys is sent when a cancel stops it.
_SETTLE_ATTEMPTS = 2

_ENDED = (
    "a ROLLBACK TO SAVEPOINT ends a sub-key taken after the savepoint; an error that aborts the transaction, "
    "or its end, ends them all"
)


def _batch(keys: Iterable[AnyKey]) -> Iterable[AnyKey]:
    """``keys`` for :meth:`LockSet.try_lock_many`, refused when it is one key rather than keys
    (a name would be taken letter by letter)."""
    one_pair = isinstance(keys, tuple) and len(keys) == 2 and all(isinstance(k, int) for k in keys)
    if isinstance(keys, str | bytes | int | LockKey) or one_pair:
        raise InvalidLockKeyError(
            f"try_lock_many() takes an iterable of keys, got one key {keys!r} ({type(keys).__name__}): pass "
            f"[{keys!r}], or use try_lock"
        )
    return keys


def _first_key(locks: tuple[SubLock | AnyKey, ...]) -> LockKey | None:
    """The key of the first of ``locks`` (for an error about them), or None if there is none."""
    if not locks:
        return None
    first = locks[0]
    return first.key if isinstance(first, SubLock) else LockKey.coerce(first)


class _SessionErrors:
    """:meth:`LockSet._session_errors` (a class: it wraps every statement of a tight loop)."""

    __slots__ = ("_key", "_owner")

    def __init__(self, owner: LockSet, key: LockKey) -> None:
        self._owner = owner
        self._key = key

    def __enter__(self) -> None:
        return None

    def __exit__(self, error_type: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        if not isinstance(error, psycopg.OperationalError):
            return
        owner = self._owner
        if not owner.connection.closed and loss.is_ordinary_error(getattr(error, "sqlstate", None)):
            return
        owner._lose(error)
        reason = owner.lost or "the session ended"
        raise LockLostError(f"the lock session was lost: {reason}", self._key, reason) from error


@dataclasses.dataclass(frozen=True)
class _SessionKeptAlive:
    """A lock session as its heartbeat sees it: its keys end only with it, or by its own
    unlock, so the probe asks only whether the session is alive."""

    connection: psycopg.Connection[Any]
    server: ServerInfo
    answered_monotonic: float
    key: LockKey | None = None
    scope: Scope = "session"

    def probe(
        self, timeout: float, before_giving_up: Callable[[], None] | None = None, answer_by: float | None = None
    ) -> ProbeResult:
        return probe(self.connection, None, False, timeout, before_giving_up=before_giving_up, answer_by=answer_by)

    def seen_from_aside(self, side: psycopg.Connection[Any]) -> bool:
        return statements.session_alive_seen_from_aside(side, self.server.backend_pid)


class LockSession(LockSet):
    """A :class:`LockSet` on a dedicated connection of its own, kept alive by a heartbeat.

    Made by ``AdvisoryLockHook.lock_session()``: same lease, liveness settings, refusals
    and ``application_name`` as a guarded task's lock connection, and the same heartbeat
    (:class:`~airflow_pglock.heartbeat.Heartbeat`): it asks the server every ``lease / 3`` s
    whether the session is alive (its locks can end only with it or by its own unlock) and
    watches the session's socket in between, so a session the server ends is noticed within
    moments. Once it is lost, every key is lost: the next operation raises
    :class:`~airflow_pglock.exceptions.LockLostError`, and so does the end of the ``with``
    block, also when only the final release found it (see :meth:`close`).

    :param connection: the session's dedicated connection (from ``open_lock_session``).
    :param server: what the connection found at the other end.
    :param database: the lock database that opened it (the lease, side connections for the heartbeat).
    """

    def __init__(self, connection: psycopg.Connection[Any], server: ServerInfo, database: LockDatabase) -> None:
        super().__init__(connection, lambda: None)
        self.server = server
        self._database = database
        self._opened = time.monotonic()
        self._opened_clock = loss.held_clock()
        self._heartbeat = Heartbeat(
            database,
            _SessionKeptAlive(connection, server, self._opened),
            self._found_lost,
            self._losing,
            threading.Event(),
        )
        self._heartbeat.start()

    def close(self) -> None:
        """Stop the heartbeat, release every key, close the connection.

        The release checks each key: when the session turns out lost there (ended, or a key
        no longer held), :attr:`lost` says why, as it does for a loss the heartbeat found.
        """
        try:
            self._heartbeat.stop()  # inside: an interrupt during its join must still close the connection
            with self._mutex:
                self._release_at_end()
        finally:
            with self._mutex:
                self._held.clear()
                self._unsettled.clear()
                self.connection.close()
            forks.forget(self)

    def _release_at_end(self) -> None:
        if self.lost is None and not self.connection.closed:
            # What a failed statement may have left (tracked nowhere else): the close alone frees it
            # only once the backend exits, or never through a session pooler that resets nothing.
            with contextlib.suppress(LockLostError):  # the session ended: _lose said why
                self._settle()
        subs = list(self._held.values())
        if self.lost is not None or not subs:
            return
        if self.connection.closed:
            self._found_at_release(loss.CLOSED_AT_RELEASE)
            return
        try:
            gone = self._unlock(subs)
        except LockLostError:
            return  # the session ended: _lose said why
        except psycopg.Error as error:
            detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
            self._found_at_release(
                loss.found_at_release(
                    f"the unlock failed ({type(error).__name__}: {detail}), so the keys are not "
                    "known to have been held to the end"
                )
            )
            return
        if gone:
            named = ", ".join(sub.key.describe() for sub in gone[:3]) + (", ..." if len(gone) > 3 else "")
            self._found_at_release(
                loss.found_at_release(f"the session no longer held {len(gone)} of its {len(subs)} keys ({named})")
            )

    def _found_at_release(self, reason: str) -> None:
        self._ended = self._ended or reason
        log.error("pglock lock session (pid %s) LOST: %s", self.server.backend_pid, self._ended)

    def _losing(self, reason: str) -> None:
        """The heartbeat got no answer and is about to close the connection."""
        self._ended = self._ended or reason

    def _found_lost(self, reason: str, ask_server: bool) -> None:
        """From the heartbeat: the session is lost (every key with it)."""
        if self._ended is None:
            self._ended = reason
            if ask_server:
                server_start = self._database.server_start()
                self._ended = loss.refine_with_server_start(
                    reason, server_start, self._opened_clock, self.server.server
                )
        log.error("pglock lock session (pid %s) LOST: %s", self.server.backend_pid, self._ended)
