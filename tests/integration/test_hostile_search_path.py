"""The provider's statements call PostgreSQL's own functions, whatever the search_path (review -86).

A function of the same name elsewhere on the search_path would otherwise be called: a schema put
ahead of ``pg_catalog`` (a role's ``search_path`` setting, or the connection's ``options``), or,
with the default search_path, an exact match of the arguments' types in ``public``, where
PostgreSQL 14 and older let everyone create (the CVE-2018-1058 pattern). A ``public.to_timestamp(bigint)``
made the lock scopes' horizon look passed, so a guard entered a key that a lock scope held between
its tasks; a ``shadow.pg_try_advisory_lock(bigint)`` answering true let two holders in at once.

Here every built-in function the SQL layer names is shadowed, in a schema ahead of ``pg_catalog``,
by a function that raises; and the known implicit-cast cases are shadowed in ``public`` for a role
with the default search_path. Each way to hold a lock then runs as usual.
"""

from __future__ import annotations

import ast
import io
import re
import time
import tokenize
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_pglock.exceptions import LockBusyError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg import schema
from airflow_pglock.policy import LockPolicy
from airflow_pglock.run_rules import RunRules
from airflow_pglock.scope_rules import ScopeRole
from tests.helpers import advisory_locks_left
from tests.ops_helpers import scratch_database

SQL_LAYER = Path(__file__).resolve().parents[2] / "airflow_pglock" / "pg"
#: The statements init-db runs once (their functions' bodies are the installed schema's, not a lock's).
_MIGRATIONS = {
    "MIGRATIONS",
    "MIGRATION_STATEMENTS",
    "STRICT_FENCING_STATEMENTS",
    "TOKEN_NEVER_DOWN_STATEMENTS",
    "GRANTS",
}
#: Syntax that PostgreSQL's grammar itself maps to pg_catalog's function (``EXTRACT(field FROM ...)``).
_SYNTAX = {"extract", "position", "substring", "overlay", "trim", "normalize"}
_CALL = re.compile(r"(?<![.\w$])([a-z_][a-z0-9_]*)\(")
_QUALIFIED_CALL = re.compile(r'(?:pg_catalog|"pg_catalog")\."?([a-z_][a-z0-9_]*)"?\(')
ROLE = "pglock_hostile"


def _statement_strings() -> Iterator[tuple[str, int, str]]:
    """(file, line, text) of every string literal of the SQL layer but docstrings and migrations."""
    for path in sorted(SQL_LAYER.glob("*.py")):
        source = path.read_text()
        skipped: list[tuple[int, int]] = []
        for node in ast.walk(ast.parse(source)):
            body = getattr(node, "body", None)
            first = body[0] if isinstance(body, list) and body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                skipped.append((first.lineno, first.end_lineno or first.lineno))
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(target, ast.Name) and target.id in _MIGRATIONS for target in targets):
                    skipped.append((node.lineno, node.end_lineno or node.lineno))
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.STRING and not any(a <= token.start[0] <= b for a, b in skipped):
                yield path.name, token.start[0], token.string


def _builtin_functions(admin: Any) -> set[str]:
    rows = admin.execute(
        "SELECT DISTINCT proname FROM pg_catalog.pg_proc WHERE pronamespace = 'pg_catalog'::regnamespace"
    )
    return {row[0] for row in rows}


def test_every_builtin_function_the_sql_layer_calls_is_named_by_its_schema(admin: Any) -> None:
    builtins = _builtin_functions(admin)
    unqualified = [
        f"{name}:{line}: {match.group(1)}("
        for name, line, text in _statement_strings()
        for match in _CALL.finditer(text)
        if match.group(1) in builtins - _SYNTAX
    ]
    assert unqualified == [], "call these as pg_catalog.<name>(...): " + ", ".join(unqualified)
    relations = {
        row[0]
        for row in admin.execute(
            "SELECT relname FROM pg_catalog.pg_class WHERE relnamespace = 'pg_catalog'::regnamespace"
        )
    }
    unqualified_relations = [
        f"{name}:{line}: {match.group(1)}"
        for name, line, text in _statement_strings()
        for match in re.finditer(r"\b(?:FROM|JOIN)\s+([a-z_][a-z0-9_]*)\b", text)
        if match.group(1) in relations
    ]
    assert unqualified_relations == [], "name these pg_catalog.<name>: " + ", ".join(unqualified_relations)
    # unnest(a, b, c) is the grammar's shorthand for ROWS FROM (unnest(a), ...): qualified, it is
    # a call of a function that does not exist.
    zipped = [
        f"{name}:{line}" for name, line, text in _statement_strings() if re.search(r"pg_catalog\.unnest\([^()]*,", text)
    ]
    assert zipped == [], "write these as ROWS FROM (pg_catalog.unnest(a), pg_catalog.unnest(b), ...): " + ", ".join(
        zipped
    )


@pytest.fixture(scope="module")
def hostile(pg_server: str) -> Iterator[dict[str, str]]:
    """A database where every built-in function the SQL layer calls is shadowed by one that raises,
    for a role (not a superuser) whose search_path puts that schema ahead of pg_catalog; and the
    implicit-cast cases shadowed in public for a second role with the default search_path.
    Yields the DSNs by role."""
    roles = (ROLE, f"{ROLE}_default")
    with psycopg.connect(pg_server, autocommit=True) as conn:
        for role in roles:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        with scratch_database(pg_server, "pglock_hostile") as admin_dsn:
            database = psycopg.conninfo.conninfo_to_dict(admin_dsn)["dbname"]

            def dsn(user: str) -> str:
                return psycopg.conninfo.make_conninfo(admin_dsn, user=user)

            _shadow_everything(admin_dsn, str(database))
            yield {"shadow": dsn(ROLE), "default": dsn(f"{ROLE}_default"), "admin": admin_dsn}
    finally:
        with psycopg.connect(pg_server, autocommit=True) as conn:
            for role in roles:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def _shadow_everything(admin_dsn: str, database: str) -> None:
    """Every built-in function the SQL layer names, shadowed by one that raises in a schema ahead of
    pg_catalog for ROLE; the implicit-cast cases shadowed in public for the default search_path."""
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        schema.migrate(admin)
        for role in (ROLE, f"{ROLE}_default"):
            for statement in schema.grant_usage(admin, role):
                admin.execute(statement)  # type: ignore[arg-type]  # the provider's own grants
        admin.execute("CREATE SCHEMA shadow")
        admin.execute(f"GRANT USAGE ON SCHEMA shadow TO {ROLE}")
        named = {
            match.group(1)
            for _, _, text in _statement_strings()
            for pattern in (_CALL, _QUALIFIED_CALL)
            for match in pattern.finditer(text)
        }
        named |= {"pg_try_advisory_lock", "pg_try_advisory_xact_lock", "pg_advisory_unlock"}  # composed names
        called = named & _builtin_functions(admin) - _SYNTAX
        functions = admin.execute(
            "SELECT proname, pg_catalog.pg_get_function_arguments(oid), pg_catalog.pg_get_function_result(oid)"
            " FROM pg_catalog.pg_proc WHERE pronamespace = 'pg_catalog'::regnamespace AND prokind = 'f'"
            " AND proname = ANY(%s)",
            [sorted(called)],
        ).fetchall()
        shadowed = 0
        for name, arguments, result in functions:
            body = f"BEGIN RAISE EXCEPTION 'shadow.{name} was called'; END"
            try:
                with admin.transaction():
                    admin.execute(
                        sql.SQL("CREATE FUNCTION shadow.{}({}) RETURNS {} LANGUAGE plpgsql AS {}").format(
                            sql.Identifier(name), sql.SQL(arguments), sql.SQL(result), sql.Literal(body)
                        )
                    )
                shadowed += 1
            except psycopg.Error:
                pass  # a type plpgsql cannot take ("any", internal)
        assert shadowed > 40, f"only {shadowed} functions shadowed"
        admin.execute(f"ALTER ROLE {ROLE} IN DATABASE {database} SET search_path = shadow, pg_catalog")
        # PostgreSQL 14 and older let everyone create in public; exact matches of the arguments'
        # types the provider passed (a bigint to to_timestamp, a literal to setval) won there.
        admin.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        for signature in ("to_timestamp(bigint)", "setval(text, bigint)", "make_interval(secs integer)"):
            admin.execute(
                f"CREATE FUNCTION public.{signature} RETURNS timestamptz LANGUAGE plpgsql"
                f" AS $$ BEGIN RAISE EXCEPTION 'public.{signature} was called'; END $$"
            )


@pytest.mark.parametrize("role", ["shadow-ahead-of-pg_catalog", "default-search_path"])
def test_every_way_to_hold_a_lock_calls_postgresqls_own_functions(hostile: dict[str, str], role: str) -> None:
    dsn = hostile["shadow" if role == "shadow-ahead-of-pg_catalog" else "default"]
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3.0))  # a heartbeat every second
    with psycopg.connect(dsn, autocommit=True) as conn:
        if role == "shadow-ahead-of-pg_catalog":
            assert conn.execute("SHOW search_path").fetchone() == ("shadow, pg_catalog",)
            with pytest.raises(psycopg.errors.RaiseException, match=r"shadow\.pg_backend_pid"):
                conn.execute("SELECT pg_backend_pid()")  # the shadows are live for this role
    key = LockKey.from_name(f"hostile/{role}")

    def busy(policy: LockPolicy) -> bool:
        try:
            with LockGuard(hook.database, key, policy):
                return False
        except LockBusyError:
            return True

    for mode in ("session", "transaction"):
        with LockGuard(hook.database, key, LockPolicy(mode=mode)) as held:
            assert busy(LockPolicy(mode=mode)), f"{mode}: a second holder got in"
            assert busy(LockPolicy(on_busy="wait", wait_timeout=0.5)), f"{mode}: a wait got in"
            assert [holder.pid for holder in hook.holders(key)] == [held.backend_pid]
            time.sleep(1.5)  # past a heartbeat
            held.check()
    with LockGuard(hook.database, key, LockPolicy(shared=True)), LockGuard(hook.database, key, LockPolicy(shared=True)):
        assert busy(LockPolicy()), "an exclusive guard got in beside shared holders"
    pool = LockKey.from_name(f"hostile/{role}/pool")
    with (
        LockGuard(hook.database, pool, LockPolicy(slots=2)),
        LockGuard(hook.database, pool, LockPolicy(slots=2)),
        pytest.raises(LockBusyError),
        LockGuard(hook.database, pool, LockPolicy(slots=2)),
    ):
        pytest.fail("a third holder got into a pool of two")
    with hook.lock_session() as session:
        taken = session.try_lock_many([f"hostile/{role}/{n}" for n in range(3)])
        assert len(taken) == 3 and session.release_all()
    tokens = []
    for _ in range(2):
        rules = RunRules(period=None, fencing=True)
        with LockGuard(hook.database, key, LockPolicy(), rules=rules) as handle:
            tokens.append(handle.fencing_token)
    assert tokens[0] is not None and tokens[1] is not None and tokens[1] > tokens[0]
    with LockGuard(hook.database, key, LockPolicy(), rules=RunRules(period="2026-12-07")):
        pass
    holder = uuid.uuid4().hex
    with LockGuard(hook.database, key, LockPolicy(), scope=ScopeRole(kind="enter", holder=holder, run="r", lease=60)):
        pass
    assert busy(LockPolicy()), "a guard entered a key that a lock scope holds between its tasks"
    with LockGuard(hook.database, key, LockPolicy(), scope=ScopeRole(kind="leave", holder=holder, run="r", lease=60)):
        pass
    assert not busy(LockPolicy())
    with psycopg.connect(hostile["admin"], autocommit=True) as admin:
        assert advisory_locks_left(admin) == 0
