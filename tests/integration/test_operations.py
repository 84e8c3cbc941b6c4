"""Operating airflow-pglock on a real PostgreSQL: init-db, the key-name registry, `locks`, `key`, `doctor`.

Each test that installs the schema gets a database of its own (``scratch_database``), so
the shared test database never has the optional tables other tests may not expect.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import PgLockError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.identity import TaskIdentity, parse_application_name, run_digest
from airflow_pglock.keys import NAME_TO_KEY_SQL, LockKey, int64_from_name
from airflow_pglock.lock_report import UNKNOWN_NAME_REASONS, collect_lock_report
from airflow_pglock.pg.key_names import registered_names
from airflow_pglock.pg.schema import LATEST_VERSION, MIGRATIONS, Migration, grant_usage, migrate, schema_status
from airflow_pglock.policy import LockPolicy
from tests.helpers import advisory_locks, held_lock
from tests.ops_helpers import hold, run_cli, scratch_database, with_user

ENTRY_KEYS = {
    "database",
    "key",
    "state",
    "mode",
    "pid",
    "application_name",
    "deployment",
    "host",
    "airflow",
    "user",
    "client_addr",
    "client",
    "client_port",
    "backend_type",
    "session_state",
    "since",
    "since_basis",
    "seconds",
    "waiters",
    "blocked_by",
}
KEY_KEYS = {"name", "names", "name_source", "collision", "kind", "numbers", "pg_locks", "name_unknown_reason"}
REPORT_KEYS = {
    "database",
    "server",
    "server_time",
    "all_databases",
    "registry",
    "in_recovery",
    "warning",
    "filters",
    "locks",
    "pools",
    "scopes",
}


@pytest.fixture
def ops_dsn(pg_server: str) -> Iterator[str]:
    with scratch_database(pg_server) as dsn:
        yield dsn


@pytest.fixture
def ops_db(ops_dsn: str) -> Iterator[str]:
    """A scratch database with ``init-db`` done."""
    with psycopg.connect(ops_dsn, autocommit=True) as conn:
        migrate(conn)
    yield ops_dsn


def _guard(dsn: str, key: LockKey, logger: logging.Logger, app: str = "pglock d t manual__x") -> LockGuard:
    return LockGuard(AdvisoryLockHook(dsn=dsn).database, key, LockPolicy(), application_name=app, logger=logger)


# ------------------------------------------------------------------ init-db


def test_init_db_is_idempotent_and_versioned(ops_dsn: str, capsys: Any) -> None:
    first = run_cli("init-db", "--dsn", ops_dsn, "--output", "json", capsys=capsys)
    assert first.code == 0, first.err
    assert first.json() == {
        "schema": "pglock",
        "before": None,
        "after": LATEST_VERSION,
        "applied": [{"version": m.version, "description": m.description} for m in MIGRATIONS],
        "granted": [],
    }
    second = run_cli("init-db", "--dsn", ops_dsn, capsys=capsys)
    assert second.code == 0 and "already at version" in second.out
    status = run_cli("init-db", "--status", "--dsn", ops_dsn, "--output", "json", capsys=capsys).json()
    assert status["installed"] == LATEST_VERSION and status["pending"] == []
    assert [row["version"] for row in status["applied"]] == [m.version for m in MIGRATIONS]


def test_init_db_refuses_a_bad_grant_before_changing_anything(ops_dsn: str, capsys: Any) -> None:
    """Review -57: --grant "" (or a role that does not exist) failed as a database error after
    every migration was applied; --grant with --status was ignored, and exited 0."""
    for argv, code, said in [
        (["--grant", ""], 3, "--grant '' is empty"),
        (["--grant", "no_such_role_anywhere", "--grant", "postgres"], 3, "no role 'no_such_role_anywhere'"),
        (["--grant", "Postgres"], 3, "no role 'Postgres'"),  # as GRANT quotes it: case-sensitive
        (["--status", "--grant", "postgres"], 2, "give --grant without --status"),
    ]:
        refused = run_cli("init-db", "--dsn", ops_dsn, *argv, capsys=capsys)
        assert (refused.code, said in refused.err) == (code, True), (argv, refused.err)
    status = run_cli("init-db", "--status", "--dsn", ops_dsn, "--output", "json", capsys=capsys).json()
    assert status["installed"] is None, "a refused init-db changed the schema"
    granted = run_cli("init-db", "--dsn", ops_dsn, "--grant", "postgres", "--output", "json", capsys=capsys)
    assert granted.code == 0 and granted.json()["granted"] == ["postgres"], granted.err


def test_key_refuses_verify_with_slots(capsys: Any) -> None:
    """It printed the slot keys and exited 0 without verifying anything (no connection was even tried)."""
    refused = run_cli("key", "pool", "--slots", "3", "--verify", "--dsn", "host=nowhere.invalid", capsys=capsys)
    assert refused.code == 2 and "--verify checks one key" in refused.err, refused.err


def test_an_empty_conn_id_is_refused_never_the_default(capsys: Any) -> None:
    """--conn-id "$UNSET" read postgres_default (init-db migrated it, locks read it)."""
    for empty in ("", "  "):
        refused = run_cli("locks", "--conn-id", empty, capsys=capsys)
        assert refused.code == 3 and "--conn-id is empty" in refused.err, refused.err


def test_concurrent_init_db_applies_each_migration_once(ops_dsn: str) -> None:
    results: list[Any] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def run() -> None:
        try:
            with psycopg.connect(ops_dsn, autocommit=True) as conn:
                start.wait()
                results.append(migrate(conn))
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sorted(len(r.applied) for r in results) == [0] * 5 + [len(MIGRATIONS)]
    with psycopg.connect(ops_dsn, autocommit=True) as conn:
        assert [a.version for a in schema_status(conn).applied] == [m.version for m in MIGRATIONS]


def test_later_migrations_apply_forward_only_and_atomically(ops_db: str) -> None:
    extra = Migration(LATEST_VERSION + 1, "test table", ("CREATE TABLE pglock.later_table (id int)",))
    broken = Migration(LATEST_VERSION + 2, "broken", ("CREATE TABLE pglock.half (id int)", "SELECT no_such_fn()"))
    with psycopg.connect(ops_db, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UndefinedFunction):
            migrate(conn, (*MIGRATIONS, extra, broken))
        # one transaction: the good step before the broken one is rolled back too
        assert schema_status(conn).installed == LATEST_VERSION
        assert conn.execute("SELECT to_regclass('pglock.later_table'), to_regclass('pglock.half')").fetchone() == (
            None,
            None,
        )
        result = migrate(conn, (*MIGRATIONS, extra))
        assert [m.version for m in result.applied] == [extra.version]
        assert migrate(conn, (*MIGRATIONS, extra)).applied == ()
        with pytest.raises(PgLockError, match="numbered 1, 2, 3"):
            migrate(conn, (extra,))


# ------------------------------------------------------------------ registry


def test_registry_records_names_and_reports_a_collision(ops_db: str, capsys: Any, caplog: Any) -> None:
    alpha = LockKey.from_name("alpha")
    # An explicit int64 that happens to be alpha's number, under another name: two names, one lock.
    beta = LockKey.from_int(int64_from_name("alpha"), name="beta")
    logger = logging.getLogger("pglock-test-registry")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        with _guard(ops_db, alpha, logger):
            pass
        assert "COLLISION" not in caplog.text
        # A name is recorded with the release of its first hold (no round trip of its own):
        # during that hold the registry knows the names recorded before.
        with _guard(ops_db, beta, logger):
            [entry] = collect_lock_report(AdvisoryLockHook(dsn=ops_db), key="alpha").entries
            assert entry.names == ("alpha",) and not entry.collision
            assert "COLLISION" not in caplog.text
        assert "KEY COLLISION" in caplog.text and "'alpha'" in caplog.text and "'beta'" in caplog.text
        caplog.clear()
        with _guard(ops_db, beta, logger):
            report = collect_lock_report(AdvisoryLockHook(dsn=ops_db), key="alpha")
            [entry] = report.entries
            assert entry.names == ("alpha", "beta") and entry.collision and entry.name_source == "registry"
            table = run_cli("locks", "--dsn", ops_db, capsys=capsys)
            assert "alpha | beta (COLLISION)" in table.out
        assert "KEY COLLISION" in caplog.text  # at every release of either name
    with psycopg.connect(ops_db, autocommit=True) as conn:
        rows = registered_names(conn)
        assert rows is not None
        assert {(r.name, (r.classid, r.objid, r.objsubid)) for r in rows} == {
            ("alpha", alpha.pg_locks),
            ("beta", alpha.pg_locks),
        }
        assert rows[0].first_recorded_by == "pglock d t manual__x"
    doctor = run_cli("doctor", "--dsn", ops_db, "--output", "json", capsys=capsys)
    assert doctor.code == 1, doctor.out
    [registry] = [c for c in doctor.json()["checks"] if c["name"] == "registry"]
    assert registry["status"] == "problem" and "'alpha', 'beta' share one key" in registry["summary"]


def test_registry_in_transaction_mode_keeps_the_work_transaction(ops_db: str) -> None:
    hook = AdvisoryLockHook(dsn=ops_db)
    guard = LockGuard(hook.database, LockKey.from_name("tx-name"), LockPolicy(mode="transaction"))
    with guard as handle:
        assert handle.connection is not None
        handle.connection.execute("CREATE TABLE work_done (id int)")
    with psycopg.connect(ops_db, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('work_done')").fetchone() == ("work_done",)
        assert [r.name for r in registered_names(conn) or []] == ["tx-name"]


@pytest.mark.parametrize("version", [3, LATEST_VERSION])
def test_a_pool_in_transaction_mode_keeps_the_work_transaction(ops_dsn: str, version: int) -> None:
    """Before version 4 the pool's statement fails inside its savepoint and the name alone is
    recorded; either way the work's transaction (the lock's) commits."""
    with psycopg.connect(ops_dsn, autocommit=True) as conn:
        migrate(conn, MIGRATIONS[:version])
    guard = LockGuard(
        AdvisoryLockHook(dsn=ops_dsn).database, LockKey.from_name("tx-pool"), LockPolicy(mode="transaction", slots=2)
    )
    with guard as handle:
        assert handle.connection is not None
        handle.connection.execute("CREATE TABLE work_done (id int)")
    with psycopg.connect(ops_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('work_done')").fetchone() == ("work_done",)
        expected = None if version < 4 else 2
        assert [(r.name, r.slots) for r in registered_names(conn) or []] == [("tx-pool", expected)]


def test_without_registry_or_privileges_the_lock_still_works(ops_dsn: str, ops_db_role: str, caplog: Any) -> None:
    logger = logging.getLogger("pglock-test-optional")
    with caplog.at_level(logging.DEBUG, logger=logger.name), _guard(ops_dsn, LockKey.from_name("plain"), logger):
        pass
    assert "WARNING" not in caplog.text  # no registry: nothing to say
    with psycopg.connect(ops_dsn, autocommit=True) as conn:
        migrate(conn)
    caplog.clear()
    role_dsn = with_user(ops_dsn, ops_db_role)
    with (
        caplog.at_level(logging.WARNING, logger=logger.name),
        _guard(role_dsn, LockKey.from_name("plain"), logger),
        psycopg.connect(ops_dsn, autocommit=True) as conn,
    ):
        assert len(advisory_locks(conn)) == 1  # held although the name could not be recorded
    assert "could not record the name" in caplog.text and "InsufficientPrivilege" in caplog.text


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_registry_write_that_fails_at_release_is_reported_and_the_release_goes_on(
    ops_dsn: str, ops_db_role: str, caplog: Any, mode: str
) -> None:
    """The write travels with the release; refused there (the role lost INSERT during the hold),
    it is tried on its own, its error logged, and the lock released (in transaction mode, the
    work committed) all the same."""
    logger = logging.getLogger("pglock-test-release-write")
    with psycopg.connect(ops_dsn, autocommit=True) as admin:
        migrate(admin)
        grant_usage(admin, ops_db_role)
        admin.execute(f"CREATE TABLE work_done (id int); GRANT INSERT ON work_done TO {ops_db_role}")
        policy = LockPolicy(mode="transaction") if mode == "transaction" else LockPolicy()
        hook = AdvisoryLockHook(dsn=with_user(ops_dsn, ops_db_role))
        guard = LockGuard(hook.database, LockKey.from_name("revoked"), policy, logger=logger)
        with caplog.at_level(logging.WARNING, logger=logger.name), guard as handle:
            if handle.connection is not None:
                handle.connection.execute("INSERT INTO work_done VALUES (1)")
            admin.execute(f"REVOKE INSERT ON pglock.key_names FROM {ops_db_role}")
        assert guard.outcome == "completed"
        assert "could not record the name of key 'revoked'" in caplog.text and "InsufficientPrivilege" in caplog.text
        assert advisory_locks(admin) == []
        assert registered_names(admin) == []
        committed = admin.execute("SELECT count(*) FROM work_done").fetchone()
        assert committed == ((1,) if mode == "transaction" else (0,))


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_name_with_quotes_percent_and_semicolons_is_recorded_as_given(ops_db: str, mode: str) -> None:
    """The write travels bound client-side in a multi-statement query: nothing in the name may
    end it, quote out of it or be read as a placeholder."""
    name = f"50% off; it's {{x}} $1 %s -- {mode}"
    policy = LockPolicy(mode="transaction") if mode == "transaction" else LockPolicy()
    with LockGuard(AdvisoryLockHook(dsn=ops_db).database, LockKey.from_name(name), policy) as handle:
        assert handle.backend_pid > 0
    with psycopg.connect(ops_db, autocommit=True) as conn:
        assert [r.name for r in registered_names(conn) or []] == [name]
        assert advisory_locks(conn) == []


def _slot(dsn: str, pool: LockKey, logger: logging.Logger) -> LockGuard:
    return LockGuard(AdvisoryLockHook(dsn=dsn).database, pool, LockPolicy(slots=2), logger=logger)


def test_pool_sizes_are_recorded_from_version_4_once_the_role_may(
    ops_dsn: str, ops_db_role: str, capsys: Any, caplog: Any
) -> None:
    """Version 4 adds the registry's ``slots`` column. Before it a pool's slot names are still
    recorded (and `locks` shows no pool); a role granted before it needs a new --grant,
    which doctor names; after it, `locks` groups the pool without being told N."""
    logger = logging.getLogger("pglock-test-pool-sizes")
    pool = LockKey.from_name("exports")
    role_dsn = with_user(ops_dsn, ops_db_role)
    with psycopg.connect(ops_dsn, autocommit=True) as conn:  # what an older release's init-db --grant did
        migrate(conn, MIGRATIONS[:3])
        grant_usage(conn, ops_db_role)
    for _ in range(2):  # the names are recorded as the first holds end; the second holds show them
        with (
            caplog.at_level(logging.WARNING, logger=logger.name),
            _slot(role_dsn, pool, logger),
            _slot(role_dsn, pool, logger) as second,
        ):
            assert second.key.name == "exports#slot2"
            before = run_cli("locks", "--dsn", ops_dsn, "--output", "json", capsys=capsys).json()
    assert "WARNING" not in caplog.text  # version 3: the names alone, silently
    assert before["pools"] == [] and sorted(e["key"]["name"] for e in before["locks"]) == ["exports", "exports#slot2"]

    with psycopg.connect(ops_dsn, autocommit=True) as conn:
        assert [m.version for m in migrate(conn, MIGRATIONS[:4]).applied] == [4]
    doctor = run_cli("doctor", "--dsn", role_dsn, "--output", "json", capsys=capsys).json()
    [registry] = [c for c in doctor["checks"] if c["name"] == "registry" and c["status"] == "warning"]
    assert "lacks UPDATE (slots)" in registry["summary"] and registry["fix"].endswith(f"--grant {ops_db_role}")
    caplog.clear()
    plain = LockKey.from_name("plain")
    with (
        caplog.at_level(logging.WARNING, logger=logger.name),
        LockGuard(AdvisoryLockHook(dsn=role_dsn).database, plain, LockPolicy(), logger=logger),
    ):
        pass
    assert "WARNING" not in caplog.text  # a plain key never needs UPDATE (slots)
    with caplog.at_level(logging.WARNING, logger=logger.name), _slot(role_dsn, pool, logger):
        pass
    assert "could not record the name" in caplog.text and "InsufficientPrivilege" in caplog.text

    granted = run_cli("init-db", "--dsn", ops_dsn, "--grant", ops_db_role, capsys=capsys)
    assert f'GRANT UPDATE (slots) ON pglock.key_names TO "{ops_db_role}";' in granted.out
    caplog.clear()
    for _ in range(2):  # the sizes are recorded as the first holds end; the second holds show the pool
        with (
            caplog.at_level(logging.WARNING, logger=logger.name),
            _slot(role_dsn, pool, logger),
            _slot(role_dsn, pool, logger),
        ):
            after = run_cli("locks", "--dsn", ops_dsn, "--output", "json", capsys=capsys).json()
    assert "WARNING" not in caplog.text
    assert [(p["name"], p["summary"], p["slots_source"]) for p in after["pools"]] == [
        ("exports", "2 of 2 held", "registry")
    ]
    with psycopg.connect(ops_dsn, autocommit=True) as conn:
        rows = {r.name: r.slots for r in registered_names(conn) or []}
        assert rows == {"exports": 2, "exports#slot2": 2, "plain": None}  # a plain key has no size
    doctor = run_cli("doctor", "--dsn", role_dsn, "--output", "json", capsys=capsys).json()
    assert {c["name"]: c["status"] for c in doctor["checks"]}["registry"] == "ok"


@pytest.fixture
def ops_db_role(ops_dsn: str) -> Iterator[str]:
    """A LOGIN role with no privilege beyond connecting (and no pg_read_all_stats)."""
    role = "pglock_nopriv_" + psycopg.conninfo.conninfo_to_dict(ops_dsn)["dbname"].rsplit("_", 1)[-1]
    with psycopg.connect(ops_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
    try:
        yield role
    finally:
        with psycopg.connect(ops_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role])
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


# ------------------------------------------------------------------ locks


def test_locks_lists_plain_sessions_waiters_and_filters(ops_dsn: str, capsys: Any) -> None:
    holder = hold(ops_dsn, (42,))
    pair_holder = hold(ops_dsn, (-1, 7), application_name="")
    waiter = psycopg.connect(ops_dsn, autocommit=True, application_name="waiting app")
    blocked = threading.Thread(target=lambda: waiter.execute("SELECT pg_advisory_lock(42)"), daemon=True)
    try:
        blocked.start()
        _wait_for(lambda: any(not granted for *_, granted in advisory_locks(holder)))
        result = run_cli("locks", "--dsn", ops_dsn, "--output", "json", capsys=capsys)
        assert result.code == 0, result.err
        data = result.json()
        assert set(data) == REPORT_KEYS and data["registry"] == "not installed"
        assert data["pools"] == []  # no registry: no pool is known (and none is held here)
        assert data["filters"] == {"dag": None, "key": None} and data["all_databases"] is False
        by_state = {
            (e["key"]["numbers"][0] if len(e["key"]["numbers"]) == 1 else tuple(e["key"]["numbers"]), e["state"]): e
            for e in data["locks"]
        }
        assert set(by_state) == {(42, "holding"), (42, "waiting"), ((-1, 7), "holding")}
        for entry in data["locks"]:
            assert set(entry) == ENTRY_KEYS and set(entry["key"]) == KEY_KEYS
        held = by_state[(42, "holding")]
        assert held["pid"] == holder.info.backend_pid and held["application_name"] == "psql"
        assert held["airflow"] is None and held["waiters"] == 1 and held["mode"] == "exclusive"
        assert held["key"] == {
            "name": None,
            "names": [],
            "name_source": None,
            "collision": False,
            "kind": "int64",
            "numbers": [42],
            "pg_locks": {"classid": 0, "objid": 42, "objsubid": 1},
            "name_unknown_reason": UNKNOWN_NAME_REASONS["not installed"],
        }
        assert held["deployment"] is None and held["host"] is None  # not an airflow-pglock session
        assert held["client_addr"] == "127.0.0.1" and held["since"] is not None and held["seconds"] >= 0
        assert held["since_basis"].startswith("session start")
        waiting = by_state[(42, "waiting")]
        assert waiting["blocked_by"] == [holder.info.backend_pid] and waiting["application_name"] == "waiting app"
        assert by_state[((-1, 7), "holding")]["key"]["pg_locks"] == {
            "classid": 2**32 - 1,
            "objid": 7,
            "objsubid": 2,
        }
        only_pair = run_cli("locks", "--dsn", ops_dsn, "--key=-1,7", "--output", "json", capsys=capsys).json()
        assert [e["pid"] for e in only_pair["locks"]] == [pair_holder.info.backend_pid]
        as_in_pg_locks = run_cli("locks", "--dsn", ops_dsn, "--key", "4294967295,7", "--output", "json", capsys=capsys)
        assert [e["pid"] for e in as_in_pg_locks.json()["locks"]] == [pair_holder.info.backend_pid]
        for numbers in ("99999999999999999999", "1,2,3", "4294967296,7"):  # found nothing: it said nothing
            noted = run_cli("locks", "--dsn", ops_dsn, "--key", numbers, "--output", "json", capsys=capsys)
            assert noted.code == 0 and noted.json()["locks"] == []
            assert f"--key {numbers!r} is numbers but no advisory key" in noted.err, noted.err
            assert "looked up as a key name only" in noted.json()["warning"]
        # ... and a key *name* made of digits is still found by its name (a date, say).
        dated = hold(ops_dsn, LockKey.from_name("2024,01,15").numbers, application_name="dated job")
        try:
            found = run_cli("locks", "--dsn", ops_dsn, "--key", "2024,01,15", "--output", "json", capsys=capsys)
            assert [e["pid"] for e in found.json()["locks"]] == [dated.info.backend_pid] and found.err == ""
        finally:
            dated.close()
        only_42 = run_cli("locks", "--dsn", ops_dsn, "--key", "42", "--output", "json", capsys=capsys).json()
        assert sorted(e["state"] for e in only_42["locks"]) == ["holding", "waiting"]
        table = run_cli("locks", "--dsn", ops_dsn, capsys=capsys)
        assert "3 advisory lock session(s)" in table.out and f"behind {holder.info.backend_pid}" in table.out
        # A key without a name says why in its row, and the footnote says what to do.
        rows = [line for line in table.out.splitlines() if line.startswith("?*  ")]
        assert len(rows) == 3, table.out
        footnote = "?* = name unknown: run 'airflow-pglock init-db' once; names are recorded when a hold ends"
        assert footnote in table.out.splitlines(), table.out
    finally:
        holder.close()
        blocked.join(10)
        waiter.close()
        pair_holder.close()


def test_locks_says_hidden_where_the_role_may_not_see_the_client_and_finds_a_shortened_dag_id(
    ops_dsn: str, ops_db_role: str, capsys: Any
) -> None:
    """A role without pg_read_all_stats sees another role's session but not its address: the CLIENT
    column says `hidden`, not `local` (a Unix socket). A DAG id too long for application_name is
    shown shortened with `~`; `--dag` with the whole id still finds its sessions."""
    identity = TaskIdentity("customer_billing_reconciliation_nightly_export", "reconcile_ledgers", "manual__2026")
    shown = parse_application_name(identity.application_name())
    assert shown is not None and shown.dag_id.endswith("~"), "the id is long enough to be shortened"
    holder = hold(ops_dsn, (77,), application_name=identity.application_name())
    try:
        as_superuser = run_cli("locks", "--dsn", ops_dsn, "--output", "json", capsys=capsys).json()
        assert [e["client"] for e in as_superuser["locks"]] == ["127.0.0.1"]
        role_dsn = with_user(ops_dsn, ops_db_role)
        as_role = run_cli("locks", "--dsn", role_dsn, "--output", "json", capsys=capsys).json()
        [entry] = as_role["locks"]
        assert (entry["user"], entry["client_addr"], entry["client"]) == ("postgres", None, "hidden"), entry
        table = run_cli("locks", "--dsn", role_dsn, capsys=capsys).out
        assert " hidden " in table and " local " not in table, table
        by_dag = run_cli("locks", "--dsn", ops_dsn, "--dag", identity.dag_id, "--output", "json", capsys=capsys)
        assert [e["pid"] for e in by_dag.json()["locks"]] == [holder.info.backend_pid]
        other = run_cli("locks", "--dsn", ops_dsn, "--dag", "customer_billing", "--output", "json", capsys=capsys)
        assert other.json()["locks"] == [], "a prefix of the shown id is another DAG"
    finally:
        holder.close()
    # A DAG id with other than ASCII characters: application_name shows them as '?' (review -60:
    # `--dag` with the real id found nothing)
    unicode_dag = TaskIdentity("données_jour", "export", "manual__2026")
    holder = hold(ops_dsn, (78,), application_name=unicode_dag.application_name())
    try:
        by_dag = run_cli("locks", "--dsn", ops_dsn, "--dag", "données_jour", "--output", "json", capsys=capsys)
        assert [e["pid"] for e in by_dag.json()["locks"]] == [holder.info.backend_pid]
    finally:
        holder.close()


def test_locks_never_hides_a_foreign_holder_whose_shared_locks_look_like_pool_markers(
    ops_dsn: str, capsys: Any
) -> None:
    """A pool holder's two shared markers (objid 0 and objid N of one classid) are left out of the
    report. Another program's shared locks 0 and 2 have that look: they stay in, with whoever
    waits for them, and so does a pool holder's pair that someone waits for."""
    billing = psycopg.connect(ops_dsn, autocommit=True, application_name="billing-service")
    billing.execute("SELECT pg_advisory_lock_shared(0), pg_advisory_lock_shared(2)")
    billing.execute("SELECT pg_advisory_lock(42)")  # an exclusive lock of its own does not make it a pool
    writer = psycopg.connect(ops_dsn, autocommit=True, application_name="other-writer")
    blocked = threading.Thread(target=lambda: writer.execute("SELECT pg_advisory_lock(2)"), daemon=True)
    try:
        shown = run_cli("locks", "--dsn", ops_dsn, "--output", "json", capsys=capsys).json()["locks"]
        assert sorted(e["key"]["numbers"][0] for e in shown if e["pid"] == billing.info.backend_pid) == [0, 2, 42]
        blocked.start()
        _wait_for(lambda: any(not granted for *_, granted in advisory_locks(billing)))
        only = run_cli("locks", "--dsn", ops_dsn, "--key", "2", "--output", "json", capsys=capsys).json()["locks"]
        assert sorted((e["state"], e["application_name"]) for e in only) == [
            ("holding", "billing-service"),
            ("waiting", "other-writer"),
        ], only
    finally:
        billing.close()
        blocked.join(10)
        writer.close()


def test_locks_marks_since_as_the_session_start_for_a_lock_session_holding_several_keys(
    ops_dsn: str, capsys: Any
) -> None:
    """A task's lock session takes keys after its own (`lock.try_lock`): the session's start is
    not when those were taken, so their SINCE is marked `~`, as another program's is."""
    identity = TaskIdentity("exports", "per_tenant", "manual__2026-12-06")
    hook = AdvisoryLockHook(dsn=ops_dsn)
    with (
        LockGuard(
            hook.database, LockKey.from_name("exports/all"), LockPolicy(), application_name=identity.application_name()
        ) as handle,
        handle.try_lock("exports/acme") as sub,
    ):
        assert sub is not None
        data = run_cli("locks", "--dsn", ops_dsn, "--output", "json", capsys=capsys).json()
        table = run_cli("locks", "--dsn", ops_dsn, capsys=capsys).out
    bases = {tuple(e["key"]["numbers"]): e["since_basis"] for e in data["locks"]}
    assert set(bases) == {LockKey.from_name(name).numbers for name in ("exports/all", "exports/acme")}, bases
    assert all(basis.startswith("session start") for basis in bases.values()), bases
    assert "or a lock session that holds several keys" in table and " ~20" in table, table


def test_locks_names_a_task_default_key_from_its_application_name(ops_dsn: str, capsys: Any) -> None:
    identity = TaskIdentity(
        "nightly_settlement", "settle", "scheduled__2026-01-01T02:00:00+00:00", deployment="eu", host="w1"
    )
    key = LockKey.for_task(identity.dag_id, identity.task_id)
    held = AdvisoryLockHook(dsn=ops_dsn).acquire(key, application_name=identity.application_name())
    assert held is not None
    other = hold(ops_dsn, LockKey.from_name("something-else").numbers, application_name="pglock other_dag t run1")
    try:
        data = run_cli("locks", "--dsn", ops_dsn, "--dag", "nightly_settlement", "--output", "json", capsys=capsys)
        [entry] = data.json()["locks"]
        run_shown = parse_application_name(identity.application_name()).run_id  # type: ignore[union-attr]
        assert entry["key"]["name"] == "nightly_settlement/settle" and entry["key"]["name_source"] == "application_name"
        assert entry["airflow"] == {
            "dag_id": "nightly_settlement",
            "task_id": "settle",
            "run_id": run_shown,
            "map_index": -1,
        }
        # shortened past 63 bytes: the run id's start, then its digest, so it stays unique
        assert run_shown == f"scheduled__20260101T020~{run_digest(identity.run_id)}"
        assert entry["pid"] == held.server.backend_pid and entry["since_basis"] == "lock session start"
        assert (entry["deployment"], entry["host"]) == ("eu", "w1")
        by_name = run_cli("locks", "--dsn", ops_dsn, "--key", "nightly_settlement/settle", capsys=capsys)
        assert f"nightly_settlement / settle / {run_shown}" in by_name.out
        assert "DEPLOYMENT @ HOST" in by_name.out and " eu @ w1 " in by_name.out
        assert "other_dag" not in by_name.out
    finally:
        held.release()
        other.close()


def test_hook_locks_name_the_provider_and_the_process(ops_db: str, capsys: Any) -> None:
    """A lock taken through the hook without an application_name is not anonymous: `locks` shows
    an airflow-pglock hook session of this process, and the registry gives its key's name."""
    import os
    import socket

    password_dsn = ops_db + " password=s3cret-pw"  # trust auth ignores it; it must not show anywhere
    first = AdvisoryLockHook(dsn=password_dsn).acquire("billing/close-month")
    assert first is not None and first.release()  # the first hold's release records the name
    held = AdvisoryLockHook(dsn=password_dsn).acquire("billing/close-month")
    assert held is not None
    try:
        result = run_cli("locks", "--dsn", ops_db, "--key", "billing/close-month", "--output", "json", capsys=capsys)
        [entry] = result.json()["locks"]
        assert entry["pid"] == held.server.backend_pid
        assert entry["key"]["name"] == "billing/close-month" and entry["key"]["name_source"] == "registry"
        application_name = entry["application_name"]
        assert application_name.startswith("pglock-hook:") and f"pid {os.getpid()}" in application_name
        assert socket.gethostname()[:8] in application_name and "s3cret" not in application_name
        assert entry["since_basis"] == "lock session start"  # one session per lock: its start is the lock's
        table = run_cli("locks", "--dsn", ops_db, "--key", "billing/close-month", capsys=capsys)
        assert "billing/close-month" in table.out and application_name in table.out
        assert "not an airflow-pglock session" not in table.out
    finally:
        held.release()
    for which in ("first", "second"):  # the name is recorded as the first hold ends
        with held_lock(AdvisoryLockHook(dsn=ops_db), "explicit", application_name="billing close-month") as named:
            assert named is not None
            [entry] = run_cli("locks", "--dsn", ops_db, "--key", "explicit", "--output", "json", capsys=capsys).json()[
                "locks"
            ]
            assert entry["application_name"] == "billing close-month"
            assert entry["key"]["name"] == (None if which == "first" else "explicit")


def test_key_coordinates_roundtrip() -> None:
    for key in (LockKey.from_int(-5), LockKey.from_int(2**63 - 1), LockKey.from_pair(-(2**31), 2**31 - 1)):
        assert LockKey.from_pg_locks(*key.pg_locks).numbers == key.numbers


# ------------------------------------------------------------------ key


@pytest.mark.parametrize(
    "argv",
    [
        ("billing",),
        ("tenant-export", "--tenant", "Zürich"),
        ("--dag", "nightly", "--task", "settle"),
        ("--dag", "nightly", "--task", "settle", "--tenant", "acme"),
        ("it's 北京 🚀",),
        ("--int", "-9223372036854775808"),
        ("--pair", "-1", "2147483647"),
    ],
)
def test_key_output_is_what_postgresql_computes_and_locks(dsn: str, capsys: Any, argv: tuple[str, ...]) -> None:
    result = run_cli("key", *argv, "--dsn", dsn, "--verify", "--output", "json", capsys=capsys)
    assert result.code == 0, result.err
    data = result.json()
    assert set(data) == {"name", "kind", "numbers", "pg_locks", "sql", "verified"}
    assert set(data["sql"]) == {"key", "try_lock", "unlock", "holders"}
    with psycopg.connect(dsn, autocommit=True, application_name="other app") as conn:
        if data["name"] is not None:
            assert conn.execute(f"SELECT {NAME_TO_KEY_SQL}", [data["name"]]).fetchone() == (data["numbers"][0],)
            assert data["verified"] == {"server_int64": data["numbers"][0], "matches": True}
        assert conn.execute(f"SELECT {data['sql']['key']}").fetchone() == tuple(data["numbers"])
        # Another application takes the lock with the printed SQL: the coordinates are the printed ones.
        assert conn.execute(data["sql"]["try_lock"]).fetchone() == (True,)
        [(pid, classid, objid, objsubid, _granted)] = advisory_locks(conn)
        assert {"classid": classid, "objid": objid, "objsubid": objsubid} == data["pg_locks"]
        assert conn.execute(data["sql"]["holders"]).fetchall() == [(pid, True, "ExclusiveLock")]
        assert conn.execute(data["sql"]["unlock"]).fetchone() == (True,)
    if argv[0] == "--dag":
        expected = "/".join([argv[1], argv[3], *argv[5:6]])
        assert data["name"] == expected and data["numbers"] == [int64_from_name(expected)]


def test_key_table_and_usage_errors(capsys: Any) -> None:
    table = run_cli("key", "billing", "--tenant", "acme", capsys=capsys)
    assert table.code == 0 and "'billing/acme'" in table.out and str(int64_from_name("billing/acme")) in table.out
    assert run_cli("key", capsys=capsys).code == 2
    assert run_cli("key", "x", "--int", "5", capsys=capsys).code == 2
    assert run_cli("key", "--dag", "d", capsys=capsys).code == 2
    too_big = run_cli("key", "--int", str(2**63), capsys=capsys)
    assert too_big.code == 3 and "between" in too_big.err
    not_int = run_cli("key", "--pair", "1", "x", capsys=capsys)
    assert not_int.code == 3 and "'x'" in not_int.err
    assert run_cli("key", "   ", capsys=capsys).code == 3
    assert run_cli("no-such-command", capsys=capsys).code == 2


# ------------------------------------------------------------------ doctor and errors


def test_doctor_on_a_healthy_primary(ops_db: str, capsys: Any) -> None:
    result = run_cli("doctor", "--dsn", ops_db, "--output", "json", capsys=capsys)
    assert result.code == 0, result.out
    data = result.json()
    assert set(data) == {"target", "status", "checks"}
    checks = {c["name"]: c for c in data["checks"]}
    for check in data["checks"]:
        assert set(check) == {"name", "status", "summary", "fix"}
    assert list(checks) == [
        "connection",
        "server",
        "recovery",
        "pooler",
        "liveness",
        "privileges",
        "probe",
        "capacity",
        "connections",
        "schema",
        "registry",
        "scopes",
    ]
    # The tests connect as a superuser: it works, and doctor points to the least-privilege set-up.
    assert {name: c["status"] for name, c in checks.items()} == {**dict.fromkeys(checks, "ok"), "privileges": "note"}
    assert "is a superuser" in checks["privileges"]["summary"]
    assert "docs/howto-least-privilege.md" in checks["privileges"]["fix"]
    assert "idle_session_timeout=30000ms" in checks["liveness"]["summary"]
    assert "max_locks_per_transaction" in checks["capacity"]["summary"]
    assert "connection slots in use" in checks["connections"]["summary"]
    lease = run_cli("doctor", "--dsn", ops_db, "--lease", "12", "--output", "json", capsys=capsys).json()
    assert "idle_session_timeout=12000ms" in {c["name"]: c for c in lease["checks"]}["liveness"]["summary"]
    table = run_cli("doctor", "--dsn", ops_db, capsys=capsys)
    assert table.code == 0 and "[OK     ] recovery" in table.out and table.out.rstrip().endswith("result: note")
    assert "[NOTE   ] privileges" in table.out and "fix: connect tasks as a least-privilege role" in table.out


def test_doctor_flags_a_role_without_privileges(ops_db: str, ops_db_role: str, capsys: Any) -> None:
    result = run_cli("doctor", "--dsn", with_user(ops_db, ops_db_role), "--output", "json", capsys=capsys)
    assert result.code == 0, result.out  # warnings only: the locks themselves work
    checks = {c["name"]: c for c in result.json()["checks"]}
    assert checks["privileges"]["status"] == "note"
    assert checks["privileges"]["fix"] == f"GRANT pg_read_all_stats TO {ops_db_role};"
    assert checks["registry"]["status"] == "warning" and "lacks SELECT, INSERT" in checks["registry"]["summary"]
    assert checks["probe"]["status"] == "ok"
    strict = run_cli("doctor", "--dsn", with_user(ops_db, ops_db_role), "--strict", capsys=capsys)
    assert strict.code == 1 and "fix: GRANT pg_read_all_stats" in strict.out
    # The fix doctor names works: after it, the role records names.
    granted = run_cli("init-db", "--dsn", ops_db, "--grant", ops_db_role, capsys=capsys)
    assert granted.code == 0 and f'GRANT SELECT, INSERT ON pglock.key_names TO "{ops_db_role}";' in granted.out
    with psycopg.connect(ops_db, autocommit=True) as conn:  # every migration's grants, not only the registry's
        for migration in MIGRATIONS:
            for grant in migration.grants:
                assert grant.format(role=f'"{ops_db_role}"') in granted.out
        assert conn.execute("SELECT has_table_privilege(%s, 'pglock.key_names', 'INSERT')", [ops_db_role]).fetchone()
        assert not conn.execute("SELECT has_schema_privilege(%s, 'pglock', 'CREATE')", [ops_db_role]).fetchone()[0]
    after = run_cli("doctor", "--dsn", with_user(ops_db, ops_db_role), "--output", "json", capsys=capsys).json()
    assert {c["name"]: c for c in after["checks"]}["registry"]["status"] == "ok"


def test_doctor_strict_passes_the_least_privilege_role_of_the_how_to(ops_dsn: str, capsys: Any) -> None:
    """docs/howto-least-privilege.md's role, created with the how-to's own SQL, is ready: --strict exits 0.

    Missing pg_read_all_stats and no registry are notes (optional extras); `init-db` without
    `--grant` for the role is a set-up left halfway: a warning, and --strict exits 1.
    """
    import re
    from pathlib import Path

    howto = (Path(__file__).resolve().parents[2] / "docs" / "howto-least-privilege.md").read_text()
    role_sql = re.search(r"```sql\n(CREATE ROLE airflow_locks.*?)```", howto, re.DOTALL)
    assert role_sql is not None, "the how-to's role SQL block moved"
    database = psycopg.conninfo.conninfo_to_dict(ops_dsn)["dbname"]
    role = "pglock_lp_" + database.rsplit("_", 1)[-1]
    statements = role_sql[1].replace("airflow_locks", role).replace("DATABASE locks", f"DATABASE {database}")
    with psycopg.connect(ops_dsn, autocommit=True) as conn:
        conn.execute(statements.replace("'...'", "'lp-secret'"))  # type: ignore[arg-type]  # the how-to's SQL
    role_dsn = with_user(ops_dsn, role)
    try:
        with held_lock(AdvisoryLockHook(dsn=role_dsn), "least-privilege") as held:  # "that is enough"
            assert held is not None
        ready = run_cli("doctor", "--dsn", role_dsn, "--strict", "--output", "json", capsys=capsys)
        assert ready.code == 0, ready.out
        checks = {c["name"]: c for c in ready.json()["checks"]}
        assert checks["privileges"]["status"] == "note" and checks["registry"]["status"] == "note"
        assert ready.json()["status"] == "note"
        assert {c["status"] for c in checks.values()} <= {"ok", "note"}
        table = run_cli("doctor", "--dsn", role_dsn, "--strict", capsys=capsys)
        assert table.code == 0 and "[NOTE   ] privileges" in table.out and "fix: GRANT pg_read_all_stats" in table.out
        assert run_cli("init-db", "--dsn", ops_dsn, capsys=capsys).code == 0  # installed, but not granted yet
        halfway = run_cli("doctor", "--dsn", role_dsn, "--strict", "--output", "json", capsys=capsys)
        assert halfway.code == 1 and {c["name"]: c for c in halfway.json()["checks"]}["registry"]["status"] == "warning"
        assert run_cli("init-db", "--dsn", ops_dsn, "--grant", role, capsys=capsys).code == 0  # the how-to's next step
        assert run_cli("doctor", "--dsn", role_dsn, "--strict", capsys=capsys).code == 0
    finally:
        with psycopg.connect(ops_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role])
            conn.execute(f"DROP OWNED BY {role}")  # type: ignore[arg-type]
            conn.execute(f"DROP ROLE {role}")  # type: ignore[arg-type]


def test_doctor_without_registry_notes_it(ops_dsn: str, capsys: Any) -> None:
    result = run_cli("doctor", "--dsn", ops_dsn, "--output", "json", capsys=capsys)
    assert result.code == 0
    [registry] = [c for c in result.json()["checks"] if c["name"] == "registry"]
    assert registry["status"] == "note" and "init-db" in registry["fix"]


def test_clear_errors_and_exit_codes(ops_dsn: str, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    bad_dsn = run_cli("locks", "--dsn", "host=127.0.0.1 port=notaport dbname", capsys=capsys)
    assert bad_dsn.code == 3 and "invalid DSN" in bad_dsn.err
    unknown = run_cli("locks", "--conn-id", "no_such_conn_here", capsys=capsys)
    assert unknown.code == 3 and "'no_such_conn_here' was not found" in unknown.err
    monkeypatch.setenv("AIRFLOW_CONN_NOT_POSTGRES", "http://example.invalid")
    wrong_type = run_cli("doctor", "--conn-id", "not_postgres", capsys=capsys)
    assert wrong_type.code == 3 and "conn_type 'http'" in wrong_type.err
    unreachable = "postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=2"
    down = run_cli("locks", "--dsn", unreachable, capsys=capsys)
    assert down.code == 4 and "cannot connect" in down.err
    assert down.err.count("\n") == 1, f"an error is one line (libpq's span several): {down.err!r}"
    doctor_down = run_cli("doctor", "--dsn", unreachable, "--output", "json", capsys=capsys)
    assert doctor_down.code == 4
    assert doctor_down.json()["checks"][0]["name"] == "connection"
    assert doctor_down.json()["checks"][0]["status"] == "problem"
    both = run_cli("locks", "--dsn", ops_dsn, "--conn-id", "x", capsys=capsys)
    assert both.code == 2 and "not both" in both.err
    no_create = run_cli("init-db", "--dsn", with_user(ops_dsn, "pglock_no_such_role"), capsys=capsys)
    assert no_create.code == 4 and "pglock_no_such_role" in no_create.err


def _wait_for(condition: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
