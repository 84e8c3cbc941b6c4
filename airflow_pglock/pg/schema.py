"""airflow-pglock's own tables: a versioned, forward-only schema in the ``pglock`` schema.

The SQL of ``airflow-pglock init-db`` (the key-name registry's own statements are in
``pg/key_names.py``).
Nothing here is needed to take a plain lock; every table is optional and created only by
an explicit ``airflow-pglock init-db``. Version 1 is the key-name registry, version 2 the
ledger of ``once_per`` / ``min_interval`` completions and fencing tokens (its SQL is in
``pg/ledger.py``), version 4 the registry's ``slots`` column (the size of the pool a
name is a slot of, so ``locks`` can show a pool as one row), version 5 the lock scopes'
lease rows (``pg/scopes.py``).

Adding a table means appending a :class:`Migration` to :data:`MIGRATIONS` with the next
version number. Never edit or
reorder a released migration: databases that already applied it will not run it again.

:func:`migrate` is idempotent and safe when run concurrently: it runs in one transaction
that first takes a transaction-level advisory lock on :data:`MIGRATION_LOCK_KEY`, so a
second ``init-db`` waits, then finds nothing left to do. A failure rolls everything back.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from airflow_pglock.exceptions import PgLockError
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.ledger import MIGRATION_STATEMENTS as LEDGER_STATEMENTS
from airflow_pglock.pg.ledger import STRICT_FENCING_STATEMENTS, TOKEN_NEVER_DOWN_STATEMENTS
from airflow_pglock.pg.scopes import GRANTS as SCOPE_GRANTS
from airflow_pglock.pg.scopes import MIGRATION_STATEMENTS as SCOPE_STATEMENTS

SCHEMA = "pglock"
VERSION_TABLE = "schema_version"
REGISTRY_TABLE = "key_names"

#: Serializes concurrent ``init-db`` runs (a transaction-level lock: gone at commit/rollback).
MIGRATION_LOCK_KEY = LockKey.from_name("airflow-pglock/init-db")


@dataclass(frozen=True)
class Migration:
    """One forward-only schema step.

    :param version: its number; versions are applied in increasing order, each once.
    :param description: one line saying what it adds (stored in the version table).
    :param statements: SQL run in order, in the migration transaction. Schema-qualify
        every object with ``pglock.``.
    :param grants: what a role that tasks connect as needs on this migration's objects,
        as ``GRANT ... TO {role}`` statements (``init-db --grant ROLE`` runs them, with
        ``{role}`` quoted as an identifier). Least privilege: never ``CREATE``.
    """

    version: int
    description: str
    statements: tuple[str, ...]
    grants: tuple[str, ...] = ()


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        version=1,
        description="key-name registry: which names were used for which advisory lock key",
        statements=(
            # objsubid/classid/objid are the key's pg_locks coordinates (objsubid 1 = int64 key,
            # 2 = int32 pair), so `locks` can join pg_locks to names without arithmetic.
            """
            CREATE TABLE pglock.key_names (
                objsubid smallint NOT NULL CHECK (objsubid IN (1, 2)),
                classid bigint NOT NULL CHECK (classid BETWEEN 0 AND 4294967295),
                objid bigint NOT NULL CHECK (objid BETWEEN 0 AND 4294967295),
                name text NOT NULL CHECK (name <> ''),
                first_recorded_at timestamptz NOT NULL DEFAULT now(),
                first_recorded_by text,
                PRIMARY KEY (objsubid, classid, objid, name)
            )
            """,
            "COMMENT ON TABLE pglock.key_names IS 'airflow-pglock: names recorded for advisory lock keys "
            "(two rows for one key = a collision: two names share one lock)'",
        ),
        grants=("GRANT SELECT, INSERT ON pglock.key_names TO {role}",),
    ),
    Migration(
        version=2,
        description="once_per / min_interval completions and fencing tokens (see pg/ledger.py)",
        statements=LEDGER_STATEMENTS,
        grants=(  # as docs/once-per-period.md lists them
            "GRANT SELECT, INSERT, UPDATE ON pglock.completions, pglock.fencing_tokens TO {role}",
            "GRANT USAGE ON SEQUENCE pglock.fencing_token_seq TO {role}",
            "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA pglock TO {role}",
        ),
    ),
    Migration(
        version=3,
        description="fencing: refuse a token for a key that was never issued one (a typo in the key name)",
        statements=STRICT_FENCING_STATEMENTS,
    ),
    Migration(
        version=4,
        description="key-name registry: the slot count of a pool (slots=N), so `locks` shows a pool as one row",
        statements=(
            # NULL: a plain key (or recorded before this version). N: the name is slot 1 (the
            # pool's own name) or `<pool>#slot<i>` of a pool of N slots, as last taken.
            "ALTER TABLE pglock.key_names ADD COLUMN slots integer CHECK (slots IS NULL OR slots >= 2)",
            "COMMENT ON COLUMN pglock.key_names.slots IS 'airflow-pglock: the size of the pool this name is a slot "
            "of, as the last guarded execution that took it said (NULL: not a pool)'",
        ),
        grants=("GRANT UPDATE (slots) ON pglock.key_names TO {role}",),
    ),
    Migration(
        version=5,
        description="lock scopes: one hold over several tasks, kept between them by a lease row (see pg/scopes.py)",
        statements=SCOPE_STATEMENTS,
        grants=SCOPE_GRANTS,
    ),
    Migration(
        version=6,
        description="fencing: a key's recorded token never goes down, whoever updates its row",
        statements=TOKEN_NEVER_DOWN_STATEMENTS,
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version


@dataclass(frozen=True)
class AppliedMigration:
    """A row of ``pglock.schema_version``."""

    version: int
    description: str
    applied_at: dt.datetime


@dataclass(frozen=True)
class SchemaStatus:
    """What ``init-db`` has done on a database.

    :param installed: the highest applied version, or None when ``init-db`` never ran.
    :param latest: the highest version this airflow-pglock knows.
    """

    installed: int | None
    latest: int
    applied: tuple[AppliedMigration, ...]

    @property
    def pending(self) -> tuple[Migration, ...]:
        current = self.installed or 0
        return tuple(m for m in MIGRATIONS if m.version > current)

    @property
    def newer_than_code(self) -> bool:
        return self.installed is not None and self.installed > self.latest


@dataclass(frozen=True)
class MigrationResult:
    """What one :func:`migrate` call did.

    :param before: the version found (None: no schema yet).
    :param after: the version left.
    :param applied: the migrations this call applied (empty when already up to date).
    """

    before: int | None
    after: int | None
    applied: tuple[Migration, ...]


def _check_migrations(migrations: Sequence[Migration]) -> None:
    versions = [m.version for m in migrations]
    if versions != list(range(1, len(versions) + 1)):
        raise PgLockError(f"airflow-pglock migrations must be numbered 1, 2, 3, ... in order; got {versions}")


def _version_table() -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(SCHEMA), sql.Identifier(VERSION_TABLE))


def table_exists(conn: psycopg.Connection[Any], table: str) -> bool:
    # Every guarded run asks this on a fresh session: the catalog-cache lookups below cost a
    # fresh backend ~1 ms less than planning a catalog query (docs/benchmarks.md). They
    # answer NULL only when the role lacks USAGE on the schema (to_regclass() would raise
    # then); the catalog, readable by everyone, tells in that case.
    row = conn.execute(
        "SELECT CASE WHEN n IS NULL THEN false WHEN pg_catalog.has_schema_privilege(n, 'USAGE')"
        " THEN pg_catalog.to_regclass(pg_catalog.format('%%I.%%I', %s::text, %s::text)) IS NOT"
        " NULL END FROM pg_catalog.to_regnamespace(%s) AS n",
        [SCHEMA, table, SCHEMA],
    ).fetchone()
    if row is not None and row[0] is not None:
        return bool(row[0])
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s)",
        [SCHEMA, table],
    ).fetchone()
    return bool(row and row[0])


def schema_status(conn: psycopg.Connection[Any]) -> SchemaStatus:
    """Read the applied versions (no lock taken, nothing written)."""
    if not table_exists(conn, VERSION_TABLE):
        return SchemaStatus(installed=None, latest=LATEST_VERSION, applied=())
    rows = conn.execute(
        sql.SQL("SELECT version, description, applied_at FROM {} ORDER BY version").format(_version_table())
    ).fetchall()
    applied = tuple(AppliedMigration(version=r[0], description=r[1], applied_at=r[2]) for r in rows)
    installed = max((a.version for a in applied), default=None)
    return SchemaStatus(installed=installed, latest=LATEST_VERSION, applied=applied)


def migrate(conn: psycopg.Connection[Any], migrations: Sequence[Migration] = MIGRATIONS) -> MigrationResult:
    """Apply the pending migrations in one transaction, serialized by an advisory lock.

    :param conn: an autocommit connection (the transaction is opened here).
    :param migrations: the migration list (the default is the real one).
    """
    _check_migrations(migrations)
    with conn.transaction():
        conn.execute("SELECT pg_catalog.pg_advisory_xact_lock(%s::bigint)", MIGRATION_LOCK_KEY.numbers)
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(SCHEMA)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (version integer PRIMARY KEY, description text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT pg_catalog.now(), applied_by text NOT"
                " NULL DEFAULT current_user)"
            ).format(_version_table())
        )
        row = conn.execute(sql.SQL("SELECT pg_catalog.max(version) FROM {}").format(_version_table())).fetchone()
        before: int | None = row[0] if row else None
        pending = [m for m in migrations if m.version > (before or 0)]
        for migration in pending:
            for statement in migration.statements:
                conn.execute(statement)  # type: ignore[arg-type]  # static SQL from this module
            conn.execute(
                sql.SQL("INSERT INTO {} (version, description) VALUES (%s, %s)").format(_version_table()),
                [migration.version, migration.description],
            )
    after = pending[-1].version if pending else before
    return MigrationResult(before=before, after=after, applied=tuple(pending))


def missing_roles(conn: psycopg.Connection[Any], roles: list[str]) -> list[str]:
    """The names in ``roles`` that are no role of the cluster (exact names, as :func:`grant_usage`
    quotes them)."""
    if not roles:
        return []
    rows = conn.execute(
        "SELECT name FROM pg_catalog.unnest(%s::text[]) WITH ORDINALITY AS given(name, n) "
        "WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = given.name) ORDER BY n",
        [roles],
    ).fetchall()
    return [row[0] for row in rows]


def grant_usage(conn: psycopg.Connection[Any], role: str) -> list[str]:
    """Let ``role`` (a role tasks connect as) use every installed table: each applied
    migration's :attr:`Migration.grants`, plus USAGE on the schema and SELECT on the
    version table. Returns the statements run.

    :param role: an existing role name (quoted as an identifier, never interpolated).
    """
    status = schema_status(conn)
    statements = [
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(SCHEMA), sql.Identifier(role)),
        sql.SQL("GRANT SELECT ON {} TO {}").format(_version_table(), sql.Identifier(role)),
    ]
    for migration in MIGRATIONS:
        if migration.version <= (status.installed or 0):
            statements += [sql.SQL(grant).format(role=sql.Identifier(role)) for grant in migration.grants]
    with conn.transaction():
        for statement in statements:
            conn.execute(statement)
    return [statement.as_string(conn) for statement in statements]
