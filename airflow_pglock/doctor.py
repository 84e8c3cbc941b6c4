"""``airflow-pglock doctor``: connect the way a task does and say what is right and what is not.

Each check ends as ``ok``, ``note`` (an optional extra is not set up: the provider works
as documented without it), ``warning`` (works, but something an operator should fix: a
set-up left halfway, a guarantee weakened) or ``problem`` (a guarded task would fail, or
the lock would not exclude anybody), with the fix. *Ready* means no warning and no
problem: ``doctor --strict`` exits 0 for the least-privilege role of
docs/howto-least-privilege.md (CONNECT only, no ``pg_read_all_stats``, no ``init-db``).
No SQL here: the lock database (``pg/inspection.py``, ``pg/schema.py``, ``pg/key_names.py``) reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg

from airflow_pglock.exceptions import LockConnectionError, PgLockError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.pg.holders import WAITSTART_VERSION
from airflow_pglock.pg.inspection import PROBE_KEY, ServerFacts, probe_advisory_lock, server_facts
from airflow_pglock.pg.key_names import registry_collisions, registry_privileges
from airflow_pglock.pg.ledger import fencing_replication
from airflow_pglock.pg.schema import SchemaStatus, schema_status
from airflow_pglock.pg.scopes import scope_access
from airflow_pglock.pg.server import inspect_server
from airflow_pglock.server_rules import ServerInfo, Violation, violations

#: Where the least-privilege set-up is described (the superuser note points there).
LEAST_PRIVILEGE_DOC = "docs/howto-least-privilege.md"

Status = Literal["ok", "note", "warning", "problem"]
STATUSES: tuple[Status, ...] = ("ok", "note", "warning", "problem")  # from best to worst

#: application_name of doctor's session (it looks like a lock session, holds nothing).
DOCTOR_APPLICATION_NAME = "pglock-cli doctor"

#: Share of the lock table in use from which doctor warns, and from which it calls it a problem.
CAPACITY_WARNING = 0.5
CAPACITY_PROBLEM = 0.8

#: Below this server version pg_locks has no waitstart: ``locks`` cannot say since when a session waits.


@dataclass(frozen=True)
class Check:
    """One verdict.

    :param name: short id of the check (stable: scripts may match on it).
    :param status: ``ok``, ``note``, ``warning`` or ``problem``.
    :param summary: what was found, one line.
    :param fix: what to do about it (None when there is nothing to do).
    """

    name: str
    status: Status
    summary: str
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "summary": self.summary, "fix": self.fix}


@dataclass
class DoctorReport:
    """Every check, in the order they ran."""

    target: str
    checks: list[Check] = field(default_factory=list)

    @property
    def status(self) -> Status:
        return STATUSES[max((STATUSES.index(c.status) for c in self.checks), default=0)]

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "status": self.status, "checks": [c.to_json() for c in self.checks]}


def run_doctor(hook: AdvisoryLockHook) -> DoctorReport:
    """Connect as a guarded task would (same connection settings and liveness) and check.

    Raises LockConfigurationError for a bad DSN or an unknown conn id (nothing to check).
    A connection that fails is reported as a ``connection`` problem.

    :param hook: the lock database, with the lease the tasks use.
    """
    settings = hook.resolve_settings()
    target = settings.describe()
    report = DoctorReport(target=target)
    started = time.perf_counter()
    try:
        conn = hook.database.connect(DOCTOR_APPLICATION_NAME, settings)
    except LockConnectionError as error:
        report.checks.append(
            Check(
                "connection",
                "problem",
                str(error),
                "check host, port, database, user and password of the connection (and pg_hba.conf on the "
                "server); tasks guarded by this connection fail until it connects",
            )
        )
        return report
    with conn:
        elapsed = (time.perf_counter() - started) * 1000
        report.checks.append(Check("connection", "ok", f"connected to {target} in {elapsed:.0f} ms"))
        info = inspect_server(conn)
        report.checks.extend(_server_checks(info, settings.pool_mode))
        report.checks.append(_guarded(conn, "liveness", lambda: _liveness_check(hook, conn, info)))
        facts = server_facts(conn)
        report.checks.append(_privileges_check(facts))
        report.checks.append(_guarded(conn, "probe", lambda: _probe_check(conn)))
        report.checks.append(_capacity_check(facts))
        report.checks.append(_connections_check(facts))
        report.checks.extend(_registry_checks(conn, facts))
        scopes = _guarded(conn, "scopes", lambda: _scopes_check(conn, facts))
        if scopes.summary:
            report.checks.append(scopes)
        fencing = _guarded(conn, "fencing", lambda: _fencing_check(conn))
        if fencing.summary:
            report.checks.append(fencing)
    return report


def _guarded(conn: psycopg.Connection[Any], name: str, check: Callable[[], Check]) -> Check:
    try:
        return check()
    except (psycopg.Error, PgLockError) as error:
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            conn.rollback()
        return Check(name, "problem", f"{type(error).__name__}: {str(error).strip()}", _FIXES.get(name))


_FIXES = {
    "liveness": "a lock session must be able to set idle_session_timeout (PostgreSQL 14+) and the TCP keepalive "
    "settings; upgrade the server or remove what forbids SET for this role",
    "probe": "the role must be allowed to call pg_try_advisory_lock (GRANT EXECUTE ON FUNCTION ... if it was revoked)",
}


def _server_checks(info: ServerInfo, pool_mode: str | None) -> list[Check]:
    """The server rules (``server_rules.py``) for a session lock: one check per rule group."""
    found: dict[str, Violation] = {}
    for violation in violations(info, "session", pool_mode):
        found.setdefault(violation.check, violation)
    checks: list[Check] = []
    server, recovery, pooler = found.get("server"), found.get("recovery"), found.get("pooler")
    if server is not None:
        checks.append(Check("server", "problem", server.problem, server.fix))
    elif info.version_num < WAITSTART_VERSION:
        checks.append(
            Check(
                "server",
                "warning",
                info.version,
                "PostgreSQL 14+ records when a session started waiting (pg_locks.waitstart); "
                "before it, `airflow-pglock locks` cannot say since when a task waits",
            )
        )
    else:
        checks.append(Check("server", "ok", info.version))
    if recovery is not None:
        checks.append(Check("recovery", "problem", recovery.problem, recovery.fix))
    else:
        checks.append(Check("recovery", "ok", f"{info.database!r} at {info.server} is a primary (not in recovery)"))
    if not info.behind_pooler:
        checks.append(
            Check("pooler", "ok", f"direct connection: the server's backend pid {info.backend_pid} is the one reported")
        )
    elif pooler is not None:
        checks.append(Check("pooler", "problem", pooler.problem, pooler.fix))
    elif server is None:
        checks.append(
            Check(
                "pooler",
                "warning",
                f"a connection pooler is in between (reported pid {info.reported_pid}, server pid "
                f"{info.backend_pid}); the connection declares pool_mode=session",
                "make sure the pooler really runs session pooling for this database; in transaction pooling "
                "use mode='transaction' locks",
            )
        )
    return checks


def _liveness_check(hook: AdvisoryLockHook, conn: psycopg.Connection[Any], info: ServerInfo) -> Check:
    expected = hook.liveness.server_settings(transaction=False, server_version_num=info.version_num)
    # The lock session's values, set and read back in one transaction: set for the session, they would
    # stay on a pooler's server connection (transaction pooling never resets one) for its next client.
    with conn.transaction():
        hook.database.apply_liveness(conn, local=True, server_version_num=info.version_num, session_lock=True)
        facts = server_facts(conn, settings=list(expected))
    over_tcp = not conn.info.host.startswith("/")  # a Unix socket's "host" is its directory
    in_force: list[str] = []
    wrong: list[str] = []
    for name, wanted in expected.items():
        if name not in facts.settings:
            wrong.append(f"{name} unknown to the server")
            continue
        value, unit = facts.settings[name]
        in_force.append(f"{name}={value}{unit or ''}")
        wanted_value = int(wanted.removesuffix("ms"))
        if value != wanted_value and not (name.startswith("tcp_") and value == 0 and not over_tcp):
            wrong.append(f"{name} is {value}{unit or ''}, the lock session asked for {wanted}")
    summary = f"lease {hook.liveness.lease:g} s: " + ", ".join(in_force)
    if wrong:
        return Check(
            "liveness",
            "warning",
            summary + "; " + "; ".join(wrong),
            "something between the task and the server (a pooler, a proxy, a role setting) overrides the lock "
            "session's liveness settings: a dead holder may keep its lock longer than the lease",
        )
    if not over_tcp:
        summary += " (Unix socket: the TCP settings do not apply)"
    return Check("liveness", "ok", summary)


def _privileges_check(facts: ServerFacts) -> Check:
    if facts.superuser:  # works, and sees everything; but a guarded task needs none of its powers
        return Check(
            "privileges",
            "note",
            f"role {facts.user!r} is a superuser: `locks` sees every session, but tasks need far less "
            "(a superuser's tasks can also end any session, and use superuser_reserved_connections)",
            f"connect tasks as a least-privilege role (CONNECT only, plus pg_read_all_stats for `locks`): "
            f"see {LEAST_PRIVILEGE_DOC}",
        )
    if facts.reads_all_stats:
        return Check(
            "privileges", "ok", f"role {facts.user!r} has pg_read_all_stats: `locks` sees every holder's details"
        )
    return Check(  # optional: with one role for every lock session, nothing is hidden
        "privileges",
        "note",
        f"role {facts.user!r} lacks pg_read_all_stats: for other roles' sessions `locks` and busy-skip messages "
        "show no client address, session start or state",
        f"GRANT pg_read_all_stats TO {facts.user};",
    )


def _probe_check(conn: psycopg.Connection[Any]) -> Check:
    taken, seconds = probe_advisory_lock(conn)
    if not taken:
        return Check(
            "probe",
            "warning",
            f"the test key {PROBE_KEY.describe()} is held by another session (another doctor running?)",
            "run doctor again",
        )
    return Check("probe", "ok", f"took and released a transaction-level test lock in {seconds * 1000:.1f} ms")


def _capacity_check(facts: ServerFacts) -> Check:
    capacity = facts.lock_capacity
    used = facts.lock_table_entries
    share = used / capacity if capacity else 1.0
    summary = (
        f"{facts.advisory_locks} advisory lock(s); {used} of {capacity} shared lock-table entries in use "
        f"({share:.0%}); capacity = max_locks_per_transaction {facts.max_locks_per_transaction} x "
        f"(max_connections {facts.max_connections} + max_prepared_transactions {facts.max_prepared_transactions})"
    )
    fix = (
        "when the lock table is full every new lock fails with 'out of shared memory': raise "
        "max_locks_per_transaction (needs a restart), or find who holds so many locks (`airflow-pglock locks`)"
    )
    return _by_share("capacity", share, summary, fix)


def _connections_check(facts: ServerFacts) -> Check:
    usable = facts.max_connections - facts.superuser_reserved_connections
    share = facts.client_connections / usable if usable > 0 else 1.0
    summary = (
        f"{facts.client_connections} of {usable} connection slots in use, {facts.free_connections} free "
        f"(max_connections {facts.max_connections} - superuser_reserved_connections "
        f"{facts.superuser_reserved_connections}); every running guarded task holds one"
    )
    fix = (
        "guarded tasks fail to start when no slot is free: raise max_connections (needs a restart), cap the "
        "lock role (ALTER ROLE ... CONNECTION LIMIT) or the concurrency of guarded tasks (pools, "
        "max_active_tis_per_dag)"
    )
    return _by_share("connections", share, summary, fix)


def _by_share(name: str, share: float, summary: str, fix: str) -> Check:
    """A capacity check: a problem from :data:`CAPACITY_PROBLEM` in use, a warning from :data:`CAPACITY_WARNING`."""
    if share >= CAPACITY_PROBLEM:
        return Check(name, "problem", summary, fix)
    if share >= CAPACITY_WARNING:
        return Check(name, "warning", summary, fix)
    return Check(name, "ok", summary)


def _registry_checks(conn: psycopg.Connection[Any], facts: ServerFacts) -> list[Check]:
    privileges = registry_privileges(conn)  # None: not installed
    if privileges is None:
        return [
            Check(  # optional: init-db is an explicit choice
                "registry",
                "note",
                "the key-name registry is not installed: `locks` names only keys that a holder's DAG/task explains",
                "airflow-pglock init-db (optional; creates schema pglock; see docs/operations.md)",
            )
        ]
    missing = [p.upper() for p in ("usage", "select", "insert") if not privileges[p]]
    effect = "names are not recorded or read"
    if privileges["usage"] and not privileges["update_slots"]:  # init-db 4 without a new --grant
        missing.append("UPDATE (slots)")
        if len(missing) == 1:
            effect = "the names of a pool's slots (slots=N) are not recorded, so `locks` cannot show it as one row"
    lacking = Check(
        "registry",
        "warning",
        f"role {facts.user!r} lacks {', '.join(missing)} on the key-name registry: {effect}",
        f"airflow-pglock init-db --grant {facts.user}",
    )
    if not privileges["select"]:
        return [lacking]  # cannot even read the schema version
    checks = [_schema_check(schema_status(conn))]
    if missing:
        return [*checks, lacking]
    collisions = registry_collisions(conn) or []
    if collisions:
        described = "; ".join(
            f"{', '.join(repr(r.name) for r in group)} share one key (pg_locks {group[0].classid}, "
            f"{group[0].objid}, {group[0].objsubid})"
            for group in collisions
        )
        checks.append(
            Check(
                "registry",
                "problem",
                f"key collision: {described}",
                "give one of the jobs another key name (or numeric key): today they exclude each other",
            )
        )
    else:
        checks.append(Check("registry", "ok", "key-name registry installed; no two names share a key"))
    return checks


def _scopes_check(conn: psycopg.Connection[Any], facts: ServerFacts) -> Check:
    """Lock scopes (docs/scopes.md): every role must be able to read them; an empty summary: not installed."""
    access = scope_access(conn)
    if access is None:
        return Check("scopes", "ok", "")
    if not access.public_read:
        return Check(
            "scopes",
            "problem",
            "PUBLIC may not read the lock scopes (a grant of init-db was revoked): setups are refused, and a guard "
            "that cannot read a live scope fails",
            "GRANT USAGE ON SCHEMA pglock TO PUBLIC; GRANT SELECT ON pglock.scopes, pglock.scope_horizon TO PUBLIC",
        )
    live = f"{access.live} lock scope(s) live"
    if not access.role_write:
        return Check(
            "scopes",
            "note",
            f"{live}; role {facts.user!r} may not take lock scopes (advisory_lock_scope): its setups fail",
            f"airflow-pglock init-db --grant {facts.user} (only if its DAGs use lock scopes)",
        )
    return Check("scopes", "ok", f"{live}; every role can see them, role {facts.user!r} can take them")


def _fencing_check(conn: psycopg.Connection[Any]) -> Check:
    """Fencing tokens survive a failover only under synchronous replication (docs/safety.md);
    an empty summary: no token was ever issued here (nothing to say)."""
    replication = fencing_replication(conn)
    if replication is None:
        return Check("fencing", "ok", "")
    if replication.synchronous_standbys >= 1:
        return Check(
            "fencing",
            "ok",
            f"fencing tokens are in use; {replication.synchronous_standbys} synchronous standby(s) keep them "
            "across a failover",
        )
    names = replication.synchronous_standby_names
    found = (
        f"synchronous_standby_names is {names!r} but no standby is connected as synchronous (or this role may not "
        "read pg_stat_replication)"
        if names
        else "replication is asynchronous (synchronous_standby_names is empty)"
    )
    return Check(
        "fencing",
        "warning",
        f"fencing tokens are in use and {found}: after a failover to a standby that missed the newest tokens, a "
        "token can go backwards and a stale holder's write be accepted",
        "fail over only to a synchronous standby (synchronous_standby_names, or storage-level synchronous "
        "replication such as a managed service's multi-zone mode); docs/safety.md",
    )


def _schema_check(status: SchemaStatus) -> Check:
    if status.newer_than_code:
        return Check(
            "schema",
            "warning",
            f"schema pglock is at version {status.installed}, newer than this airflow-pglock knows ({status.latest})",
            "upgrade airflow-provider-pglock on this machine",
        )
    if status.pending:
        return Check(
            "schema",
            "warning",
            f"schema pglock is at version {status.installed}; {len(status.pending)} migration(s) pending",
            "airflow-pglock init-db",
        )
    return Check("schema", "ok", f"schema pglock is at version {status.installed} (latest)")
