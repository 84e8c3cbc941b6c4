"""Lock scopes: one hold over several tasks, kept between them by a lease row.

Hook-level module (SQL lives here). The table comes from migration 5 of
:mod:`airflow_pglock.pg.schema` (``airflow-pglock init-db``): ``pglock.scopes`` has one
row per key that a scope holds or held. A row is live while ``lease_until`` (the database
clock) is in the future.

Every statement here runs on a session that holds the key's advisory lock exclusively:
a scope's setup, its tasks and its teardown take the key before they touch its row, and
every other guard of a named key takes the key before it reads the row. So the row is
written and read under the lock, and a writer never races a reader.

The scope horizon spares the guards of keys without a scope that read: the sequence
``pglock.scope_horizon`` holds a UNIX time no earlier than the end of every live lease. A
writer raises it after its row, before it releases the key; a guard's lock statement reads it
(non-transactional, so never stale) after taking its key, and reads its key's row only when
the horizon has not passed. A teardown lowers it to the latest lease still live.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from airflow_pglock.display import printable
from airflow_pglock.exceptions import LockConfigurationError, ScopeHorizonBusyError
from airflow_pglock.holder import describe_holders
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.holders import read_holders
from airflow_pglock.pg.sql import LIFT_TRANSACTION_TIMEOUT, TRANSACTION_TIMEOUT_VERSION, execute_contained

MIGRATION_STATEMENTS: tuple[str, ...] = (
    """
    CREATE TABLE pglock.scopes (
        objsubid smallint NOT NULL CHECK (objsubid IN (1, 2)),
        classid bigint NOT NULL,
        objid bigint NOT NULL,
        key_name text,
        holder text NOT NULL,
        run text NOT NULL,
        task_now text,
        token bigint,
        acquired_at timestamptz NOT NULL,
        lease_until timestamptz NOT NULL,
        PRIMARY KEY (objsubid, classid, objid)
    )
    """,
    "COMMENT ON TABLE pglock.scopes IS 'airflow-pglock: lock scopes (one hold over several tasks); a row is "
    "held while lease_until is in the future'",
    # Every guard of a named key reads its scope row, whatever its role: a role that could not
    # would have to fail (it cannot tell whether a scope holds the key). Reading shows key
    # names and DAG runs, as pg_locks and pg_stat_activity already do; writing needs --grant.
    "GRANT USAGE ON SCHEMA pglock TO PUBLIC",
    "GRANT SELECT ON pglock.scopes TO PUBLIC",
    "CREATE SEQUENCE pglock.scope_horizon MINVALUE 0 START 0",
    "COMMENT ON SEQUENCE pglock.scope_horizon IS 'airflow-pglock: a UNIX time no earlier than the end of every "
    "live lock scope (guards of named keys read their scope row only until then)'",
    "GRANT SELECT ON SEQUENCE pglock.scope_horizon TO PUBLIC",
)

GRANTS: tuple[str, ...] = (
    "GRANT SELECT, INSERT, UPDATE, DELETE ON pglock.scopes TO {role}",
    "GRANT UPDATE ON SEQUENCE pglock.scope_horizon TO {role}",
)

#: Serializes the writers of the horizon (a transaction-level lock: gone at the transaction's end).
HORIZON_LOCK_KEY = LockKey.from_name("airflow-pglock/scope-horizon")
#: A writer tries the horizon's lock and sleeps between tries (the first pause, doubling up to
#: the longest); it never waits for it on the server. A writer frozen while its
#: statement waited there would keep its session, and the key it holds, until the lock's holder
#: let go (a frozen holder: its whole lease) and then for its own lease: about twice the dead-holder
#: bound. Between tries its session is idle, so the lease bounds it as it bounds any holder.
HORIZON_FIRST_PAUSE_SECONDS = 0.002
HORIZON_LONGEST_PAUSE_SECONDS = 0.05
#: The longest a writer tries the horizon's lock when its session's ``lock_timeout`` and
#: ``statement_timeout`` allow longer (or are off, as on a scope's sessions): a writer holds it for
#: one write and its commit, but any session of the database may take the key and keep it.
HORIZON_WAIT_SECONDS = 10.0
# The session's lock_timeout and statement_timeout in ms (0: none), which bound the tries as they
# would bound a wait on the server.
_TIMEOUTS_MS = ", ".join(
    f"extract(epoch FROM pg_catalog.current_setting('{name}')::interval) * 1000"
    for name in ("lock_timeout", "statement_timeout")
)


@dataclass(frozen=True)
class ScopeRow:
    """A row of ``pglock.scopes``.

    :param holder: the acquisition's id (the setup's, shared by the scope's tasks).
    :param run: who holds it, for people: the deployment, DAG and run.
    :param task_now: the task of the scope that runs now, or None between tasks.
    :param token: the scope's fencing token, or None.
    :param lease_until: when the scope ends if no task of it renews it (database clock).
    :param live: whether ``lease_until`` was in the future when read.
    :param seconds_left: how long until ``lease_until`` when read, on the database clock (a
        worker's or a triggerer's clock may differ from it).
    """

    holder: str
    run: str
    task_now: str | None
    token: int | None
    lease_until: dt.datetime
    live: bool
    seconds_left: float = 0.0

    def describe(self) -> str:
        """Who holds the key by this row, for a message (its texts are any writer's: shown escaped)."""
        until = self.lease_until.isoformat(timespec="seconds")
        run, task_now = printable(self.run), printable(self.task_now) if self.task_now else None
        if task_now and task_now.endswith(DEFERRED_SUFFIX):
            task = task_now.removesuffix(DEFERRED_SUFFIX)
            return f"the deferred task {task} of {run} (held by the triggerer, lease until {until})"
        if task_now and task_now.endswith(RESUMING_SUFFIX):
            task = task_now.removesuffix(RESUMING_SUFFIX)
            return f"the deferred task {task} of {run} (resuming on a worker, lease until {until})"
        now = f", task {task_now} running now" if task_now else ", between its tasks"
        return f"the lock scope of {run}{now}, lease until {until}"


#: The ``task_now`` suffix of a deferred guarded operator's hold (``scope_rules.hand_over``).
DEFERRED_SUFFIX = " (deferred, held by the triggerer)"


#: The ``task_now`` suffix of such a hold between the trigger's event and the task's resumption.
RESUMING_SUFFIX = " (deferred, resuming on a worker)"


def deferred_task(task: str | None) -> str:
    """The ``task_now`` of a row whose hold waits in the triggerer."""
    return f"{task or '?'}{DEFERRED_SUFFIX}"


def resuming_task(task: str | None) -> str:
    """The ``task_now`` of a deferred hold handed back to a worker, until the task resumes."""
    return f"{task or '?'}{RESUMING_SUFFIX}"


def is_deferred_hold(task_now: str | None) -> bool:
    """Whether a row's ``task_now`` marks the hold of a deferred guarded operator."""
    return task_now is not None and task_now.endswith((DEFERRED_SUFFIX, RESUMING_SUFFIX))


_COLUMNS = (
    "holder, run, task_now, token, lease_until, lease_until > pg_catalog.clock_timestamp(),"
    " extract(epoch FROM lease_until - pg_catalog.clock_timestamp())::float8"
)
_WHERE = "objsubid = %(objsubid)s AND classid = %(classid)s AND objid = %(objid)s"


_PUBLIC_MAY_READ = (
    "pg_catalog.has_schema_privilege('public', 'pglock', 'USAGE')"
    " AND pg_catalog.has_table_privilege('public', 'pglock.scopes', 'SELECT')"
    " AND pg_catalog.has_sequence_privilege('public', 'pglock.scope_horizon', 'SELECT')"
)


def _coordinates(key: LockKey) -> dict[str, Any]:
    classid, objid, objsubid = key.pg_locks
    return {"objsubid": objsubid, "classid": classid, "objid": objid}


def missing_table_error() -> LockConfigurationError:
    return LockConfigurationError(
        "a lock scope needs airflow-pglock's table pglock.scopes (schema version 5 or newer), which is missing "
        "in this database: run `airflow-pglock init-db --conn-id <your lock connection>` once (see docs/scopes.md)"
    )


def _run(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> Any:
    """One statement; in a savepoint inside a transaction (an error must not abort the lock's transaction).

    :raises LockConfigurationError: the table is missing (init-db), or this role may not use it.
    """
    try:
        return execute_contained(conn, statement, params, "pglock_scope")
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
        raise missing_table_error() from None
    except psycopg.errors.InsufficientPrivilege as error:
        raise LockConfigurationError(
            f"this role may not use pglock.scopes ({error.diag.message_primary}), so no guard of a named key can "
            "tell whether a lock scope holds it: run `airflow-pglock init-db --grant <this role>` as the schema's "
            "owner (see docs/howto-least-privilege.md)"
        ) from None


def _row(found: Any) -> ScopeRow | None:
    return None if found is None else ScopeRow(*found)


def read(conn: psycopg.Connection[Any], key: LockKey) -> ScopeRow | None:
    """The scope row of ``key`` (live or not), if any."""
    return _row(_run(conn, f"SELECT {_COLUMNS} FROM pglock.scopes WHERE {_WHERE}", _coordinates(key)).fetchone())


def live_scope(conn: psycopg.Connection[Any], key: LockKey) -> ScopeRow | None:
    """The live scope of ``key``, for a reader that holds nothing (the sensor): None also before init-db 5."""
    return live_scopes_of(conn, [key]).get(key)


def live_scopes_of(conn: psycopg.Connection[Any], keys: list[LockKey]) -> dict[LockKey, ScopeRow]:
    """The live scopes among ``keys`` (a pool's slots), for a reader that holds nothing: none also
    before init-db 5."""
    try:
        cursor = conn.execute(
            f"SELECT objsubid, classid, objid, {_COLUMNS} FROM pglock.scopes WHERE (objsubid, classid, objid) IN"
            " (SELECT * FROM ROWS FROM (pg_catalog.unnest(%(objsubid)s::smallint[]),"
            " pg_catalog.unnest(%(classid)s::bigint[]), pg_catalog.unnest(%(objid)s::bigint[])))"
            " AND lease_until > pg_catalog.clock_timestamp()",
            _coordinate_arrays(keys),
        )
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
        return {}
    found = {(row[0], row[1], row[2]): ScopeRow(*row[3:]) for row in cursor.fetchall()}
    by_key = {key: found.get((key.pg_locks[2], key.pg_locks[0], key.pg_locks[1])) for key in keys}
    return {key: row for key, row in by_key.items() if row is not None}


def _coordinate_arrays(keys: list[LockKey]) -> dict[str, list[int]]:
    coordinates = [key.pg_locks for key in keys]
    return {
        "objsubid": [c[2] for c in coordinates],
        "classid": [c[0] for c in coordinates],
        "objid": [c[1] for c in coordinates],
    }


def enter(
    conn: psycopg.Connection[Any],
    key: LockKey,
    holder: str,
    run: str,
    lease_seconds: float,
    *,
    task: str | None = None,
    lineage: str | None = None,
) -> tuple[bool, ScopeRow | None]:
    """Take the scope of ``key`` for ``holder`` unless another one's row is live.

    :param task: the row's ``task_now`` (a deferred operator's hold: its task, marked deferred).
    :param lineage: a live row whose holder id starts with it is taken over too (an earlier try of
        the same setup in the same DAG run: :attr:`~airflow_pglock.scope_rules.ScopeRole.lineage`).

    :returns: ``(True, the row)`` when taken (new, lapsed, ``holder``'s own again, or its lineage's);
        ``(False, the live row of another holder)`` when busy.
    :raises LockConfigurationError: PUBLIC may not read the scopes (every guard of a named key
        must, whatever its role: a scope it cannot see would not exclude it).
    """
    if lineage == "":
        raise LockConfigurationError("a scope's lineage must not be empty: it would take over every live row")
    readable = _run(conn, f"SELECT {_PUBLIC_MAY_READ}", {}).fetchone()
    if not (readable and readable[0]):
        raise LockConfigurationError(
            "a lock scope needs every role to be able to read it (USAGE on schema pglock, SELECT on pglock.scopes "
            "and pglock.scope_horizon, granted to PUBLIC by `airflow-pglock init-db`); one of them was revoked. "
            "Grant them again: GRANT USAGE ON SCHEMA pglock TO PUBLIC; GRANT SELECT ON pglock.scopes, "
            "pglock.scope_horizon TO PUBLIC"
        )
    with _with_its_horizon(conn):
        cursor = _run(
            conn,
            "INSERT INTO pglock.scopes AS s (objsubid, classid, objid, key_name, holder, run, task_now, token,"
            " acquired_at, lease_until)"
            " VALUES (%(objsubid)s, %(classid)s, %(objid)s, %(name)s, %(holder)s, %(run)s, %(task)s, NULL,"
            " pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => %(lease)s))"
            " ON CONFLICT (objsubid, classid, objid) DO UPDATE SET key_name = excluded.key_name,"
            " holder = excluded.holder, run = excluded.run, task_now = excluded.task_now,"
            " token = CASE WHEN s.holder = excluded.holder THEN s.token END,"
            " acquired_at = CASE WHEN s.holder = excluded.holder THEN s.acquired_at ELSE excluded.acquired_at END,"
            " lease_until = excluded.lease_until"
            " WHERE s.holder = excluded.holder OR s.lease_until <= pg_catalog.clock_timestamp()"
            " OR pg_catalog.left(s.holder, pg_catalog.length(%(lineage)s::text)) = %(lineage)s::text"
            f" RETURNING {_COLUMNS}",
            {
                **_coordinates(key),
                "name": key.name,
                "holder": holder,
                "run": run,
                "task": task,
                "lease": lease_seconds,
                "lineage": lineage,
            },
        )
        taken = _row(cursor.fetchone())
        if taken is not None:
            raise_horizon(conn, taken.lease_until)
    if taken is not None:
        return True, taken
    return False, read(conn, key)


def set_token(conn: psycopg.Connection[Any], key: LockKey, holder: str, token: int) -> bool:
    """Record the scope's fencing token (issued once per acquisition); whether ``holder`` still has the row."""
    cursor = _run(
        conn,
        f"UPDATE pglock.scopes SET token = %(token)s WHERE {_WHERE} AND holder = %(holder)s",
        {**_coordinates(key), "holder": holder, "token": token},
    )
    return bool(cursor.rowcount == 1)


def rejoin(
    conn: psycopg.Connection[Any],
    key: LockKey,
    holder: str,
    task: str | None,
    lease_seconds: float,
    *,
    require_live: bool = True,
) -> ScopeRow | None:
    """A task of the scope starts (or ends: ``task`` None): renew ``holder``'s row.

    :param require_live: a task that starts needs the row live; one that ends held the key
        throughout, so nobody could take the scope meanwhile, and renews it lapsed or not.
    :returns: the renewed row; None when ``holder`` has no (live) row: the scope is lost.
    """
    live = " AND lease_until > pg_catalog.clock_timestamp()" if require_live else ""
    with _with_its_horizon(conn):
        cursor = _run(
            conn,
            "UPDATE pglock.scopes SET task_now = %(task)s,"
            " lease_until = greatest(lease_until, pg_catalog.clock_timestamp() +"
            " pg_catalog.make_interval(secs => %(lease)s))"
            f" WHERE {_WHERE} AND holder = %(holder)s{live}"
            f" RETURNING {_COLUMNS}",
            {**_coordinates(key), "holder": holder, "task": task, "lease": lease_seconds},
        )
        row = _row(cursor.fetchone())
        if row is not None:
            raise_horizon(conn, row.lease_until)
    return row


def leave(conn: psycopg.Connection[Any], key: LockKey, holder: str, *, lower: bool = True) -> ScopeRow | None:
    """Free ``holder``'s scope of ``key``: the row as it was (``live`` False: it had lapsed), or None when gone.

    :param lower: lower the horizon afterwards (else the caller does, see :func:`lower_horizon`).
    """
    cursor = _run(
        conn,
        f"DELETE FROM pglock.scopes WHERE {_WHERE} AND holder = %(holder)s RETURNING {_COLUMNS}",
        {**_coordinates(key), "holder": holder},
    )
    freed = _row(cursor.fetchone())
    if lower:
        with contextlib.suppress(ScopeHorizonBusyError):  # the row is gone: a horizon left high only makes
            lower_horizon(conn)  # guards read the rows a while longer
    return freed


@contextlib.contextmanager
def one_transaction(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """One READ COMMITTED transaction around several writes (a teardown's record and delete)."""
    with _read_committed(conn, "pglock_scope_teardown"):
        yield


@contextlib.contextmanager
def _read_committed(conn: psycopg.Connection[Any], savepoint: str) -> Iterator[None]:
    """A transaction (a savepoint inside one) whose every statement sees what was committed
    before it began, whatever the database's default isolation."""
    with conn.lock:  # a lock session's heartbeat probe in flight holds it (the status would read ACTIVE)
        in_transaction = conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
    if in_transaction:
        with conn.transaction(savepoint_name=savepoint):
            yield
        return
    # The isolation goes in psycopg's BEGIN: a probe run between a plain BEGIN and a SET TRANSACTION
    # would be the transaction's first statement, and under a REPEATABLE READ default its snapshot
    # would be taken before the locks that the statements here take.
    previous = conn.isolation_level
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    try:
        with conn.transaction():
            # Its own transaction on a session lock's connection, bounded by its own timeouts (the
            # horizon's tries, HORIZON_WAIT_SECONDS): a shorter transaction_timeout would end the
            # session, and its locks, instead. One more round trip, on servers that have it only.
            if conn.info.server_version >= TRANSACTION_TIMEOUT_VERSION:
                conn.execute(f"SELECT {LIFT_TRANSACTION_TIMEOUT}")
            yield
    finally:
        if not conn.closed:
            with contextlib.suppress(psycopg.Error):
                conn.isolation_level = previous


@contextlib.contextmanager
def _with_its_horizon(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """One transaction for a row and the horizon it raises: the commit, which waits for a
    synchronous standby, follows the horizon's WAL record (a setval alone never waits), so a
    promoted standby has both or neither; a failed raise rolls the row back."""
    with _read_committed(conn, "pglock_scope_write"):
        yield


def raise_horizon(conn: psycopg.Connection[Any], lease_until: dt.datetime) -> None:
    """Make the horizon no earlier than ``lease_until`` (after the row is written, before the key
    is released), under the horizon's lock."""
    _under_horizon_lock(
        conn,
        "pg_catalog.setval('pglock.scope_horizon',"
        " greatest(coalesce(pg_catalog.pg_sequence_last_value('pglock.scope_horizon'), 0),"
        " pg_catalog.ceil(extract(epoch FROM %(until)s::timestamptz))::bigint))",
        {"until": lease_until},
    )


def lower_horizon(conn: psycopg.Connection[Any]) -> None:
    """Bring the horizon down to the latest lease still live (0: none), read after the horizon's lock.

    Two statements in one transaction: the second one's snapshot is taken once the lock is
    held, so it sees every row whose writer raised the horizon before (rows are written first).
    """
    with _read_committed(conn, "pglock_horizon"):
        _under_horizon_lock(conn, "NULL", {})
        _run(
            conn,
            "SELECT pg_catalog.setval('pglock.scope_horizon',"
            " coalesce(pg_catalog.max(pg_catalog.ceil(extract(epoch FROM lease_until)))::bigint, 0))"
            " FROM pglock.scopes WHERE lease_until > pg_catalog.clock_timestamp()",
            {},
        )


def _under_horizon_lock(conn: psycopg.Connection[Any], when_locked: str, params: dict[str, Any]) -> None:
    """Try the horizon's lock, and evaluate ``when_locked`` in the statement that took it; try
    again, after a pause, until one does (:data:`HORIZON_FIRST_PAUSE_SECONDS`, doubling).

    Unlike a wait on the server, the tries keep no order among writers, and a ``pg_cancel_backend``
    ends one only if it comes while a try runs. Neither matters much: a writer holds the lock for
    its own write and commit; the session's timeouts still bound the tries.

    :raises ScopeHorizonBusyError: the lock stayed busy past the session's
        ``lock_timeout`` or ``statement_timeout`` or :data:`HORIZON_WAIT_SECONDS`, whichever is
        shortest (its message names the lock's holders).
    """
    statement = (
        f"SELECT locked, CASE WHEN locked THEN {when_locked} END, {_TIMEOUTS_MS}"
        " FROM (SELECT pg_catalog.pg_try_advisory_xact_lock(%(lock)s) AS locked OFFSET 0) AS serialized"
    )
    params = {**params, "lock": HORIZON_LOCK_KEY.int64}
    pause = HORIZON_FIRST_PAUSE_SECONDS
    started = time.monotonic()
    while True:
        locked, _, *timeouts_ms = _run(conn, statement, params).fetchone()
        if locked:
            return
        session_bound_ms = min((float(ms) for ms in timeouts_ms if ms), default=None)
        bound_ms = min(HORIZON_WAIT_SECONDS * 1000, session_bound_ms or HORIZON_WAIT_SECONDS * 1000)
        if (time.monotonic() - started) * 1000 >= bound_ms:
            which = (
                "this session's lock_timeout or statement_timeout"
                if session_bound_ms is not None and session_bound_ms <= HORIZON_WAIT_SECONDS * 1000
                else f"the longest a scope's write tries it (HORIZON_WAIT_SECONDS = {HORIZON_WAIT_SECONDS:g})"
            )
            try:
                holders = describe_holders(read_holders(conn, HORIZON_LOCK_KEY), dt.datetime.now(dt.timezone.utc))
            except psycopg.Error as error:
                holders = f"a session not read ({type(error).__name__}: {error})"
            raise ScopeHorizonBusyError(
                f"the scope horizon's lock ({HORIZON_LOCK_KEY.describe()}) stayed busy for {bound_ms:.0f} ms, "
                f"{which}: held by {holders} (a scope's write holds it for a moment; a session that keeps it "
                "blocks every lock scope of the database)"
            )
        time.sleep(pause)
        pause = min(HORIZON_LONGEST_PAUSE_SECONDS, pause * 2)


def live_among(conn: psycopg.Connection[Any], keys: list[LockKey]) -> set[tuple[int, ...]]:
    """The numbers of those of ``keys`` that a live scope holds (read under their locks)."""
    cursor = _run(
        conn,
        "SELECT objsubid, classid, objid FROM pglock.scopes WHERE (objsubid, classid, objid) IN"
        " (SELECT * FROM ROWS FROM (pg_catalog.unnest(%(objsubid)s::smallint[]),"
        " pg_catalog.unnest(%(classid)s::bigint[]), pg_catalog.unnest(%(objid)s::bigint[])))"
        " AND lease_until > pg_catalog.clock_timestamp()",
        _coordinate_arrays(keys),
    )
    found = {(row[0], row[1], row[2]) for row in cursor.fetchall()}
    return {key.numbers for key in keys if (key.pg_locks[2], key.pg_locks[0], key.pg_locks[1]) in found}


def live_scopes(conn: psycopg.Connection[Any]) -> list[tuple[LockKey, ScopeRow]]:
    """Every live scope (for ``locks`` and the UI page)."""
    cursor = _run(
        conn,
        f"SELECT objsubid, classid, objid, key_name, {_COLUMNS} FROM pglock.scopes"
        " WHERE lease_until > pg_catalog.clock_timestamp() ORDER BY acquired_at",
        {},
    )
    found = []
    for objsubid, classid, objid, name, *rest in cursor.fetchall():
        key = LockKey.from_pg_locks(classid, objid, objsubid)
        found.append((LockKey(name=name, numbers=key.numbers) if name else key, ScopeRow(*rest)))
    return found


@dataclass(frozen=True)
class ScopeAccess:
    """What ``doctor`` says of the lock scopes.

    :param public_read: every role may read them (USAGE on the schema, SELECT on the table and the sequence).
    :param role_write: this role may take them (INSERT, UPDATE, DELETE on the table, UPDATE on the sequence).
    :param live: how many scopes are live now.
    """

    public_read: bool
    role_write: bool
    live: int


def scope_access(conn: psycopg.Connection[Any]) -> ScopeAccess | None:
    """The lock scopes' grants and how many are live; None before init-db version 5."""
    installed = conn.execute("SELECT pg_catalog.to_regclass('pglock.scopes') IS NOT NULL").fetchone()
    if not (installed and installed[0]):
        return None
    row = conn.execute(
        f"SELECT ({_PUBLIC_MAY_READ}),"
        " pg_catalog.has_table_privilege('pglock.scopes', 'INSERT, UPDATE, DELETE')"
        " AND pg_catalog.has_sequence_privilege('pglock.scope_horizon', 'UPDATE'),"
        " CASE WHEN pg_catalog.has_table_privilege('pglock.scopes', 'SELECT')"
        " THEN (SELECT pg_catalog.count(*) FROM pglock.scopes WHERE lease_until > pg_catalog.clock_timestamp()) END"
    ).fetchone()
    assert row is not None
    return ScopeAccess(public_read=bool(row[0]), role_write=bool(row[1]), live=int(row[2] or 0))
