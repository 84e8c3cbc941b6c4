"""``airflow-pglock doctor`` against unsafe set-ups: a hot standby, and PgBouncer in between.

Both run for real: a standby made with ``pg_basebackup -R`` from a throwaway primary
(devtools.standby), and Debian's PgBouncer in transaction pooling (devtools.pgbouncer).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from devtools.pgbouncer import PgBouncer, PgBouncerUnavailableError
from devtools.pgcluster import Cluster
from devtools.standby import start_standby
from tests.ops_helpers import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def primary() -> Iterator[Cluster]:
    cluster = Cluster().init().start()
    try:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE doctor_db")
        yield cluster
    finally:
        cluster.destroy()


def _checks(result: Any) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in result.json()["checks"]}


def test_doctor_flags_a_standby(primary: Cluster, capsys: Any) -> None:
    standby = start_standby(primary)
    try:
        with psycopg.connect(standby.dsn_for("doctor_db"), autocommit=True) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
        result = run_cli("doctor", "--dsn", standby.dsn_for("doctor_db"), "--output", "json", capsys=capsys)
        assert result.code == 1, result.out
        checks = _checks(result)
        assert checks["recovery"]["status"] == "problem"
        assert "standby in recovery" in checks["recovery"]["summary"]
        assert "target_session_attrs=read-write" in checks["recovery"]["fix"]
        assert checks["pooler"]["status"] == "ok" and checks["connection"]["status"] == "ok"
        table = run_cli("doctor", "--dsn", standby.dsn_for("doctor_db"), capsys=capsys)
        assert table.code == 1 and "[PROBLEM] recovery" in table.out and "result: problem" in table.out
        # `locks` on a standby: no lock of the primary's sessions is there, and it says so.
        listed = run_cli("locks", "--dsn", standby.dsn_for("doctor_db"), "--output", "json", capsys=capsys)
        assert listed.json()["in_recovery"] is True and "standby in recovery" in listed.json()["warning"]
        shown = run_cli("locks", "--dsn", standby.dsn_for("doctor_db"), capsys=capsys).out
        assert "WARNING: this server is a standby in recovery" in shown, shown
    finally:
        standby.destroy()
    primary_result = run_cli("doctor", "--dsn", primary.dsn_for("doctor_db"), "--output", "json", capsys=capsys)
    assert _checks(primary_result)["recovery"]["status"] == "ok"
    on_primary = run_cli("locks", "--dsn", primary.dsn_for("doctor_db"), "--output", "json", capsys=capsys).json()
    assert (on_primary["in_recovery"], on_primary["warning"]) == (False, None)


_LIVENESS_SETTINGS = (
    "SELECT current_setting('idle_session_timeout'), current_setting('idle_in_transaction_session_timeout'),"
    " current_setting('tcp_keepalives_idle'), current_setting('statement_timeout')"
)


def test_doctor_flags_pgbouncer_in_transaction_pooling(primary: Cluster, capsys: Any) -> None:
    """Also: doctor leaves nothing on the pooler's server connection. Transaction pooling never
    resets one, so a session-level SET would reach the next client of the pool (its idle
    transactions then killed after the lease)."""
    try:
        bouncer = PgBouncer(primary.port, pool_mode="transaction", pool_size=1).start()
    except PgBouncerUnavailableError as error:
        pytest.skip(f"PgBouncer is not available here: {error}")
    try:
        result = run_cli("doctor", "--dsn", bouncer.dsn_for("doctor_db"), "--output", "json", capsys=capsys)
        assert result.code == 1, result.out
        checks = _checks(result)
        assert checks["pooler"]["status"] == "problem"
        assert "connection pooler is in between" in checks["pooler"]["summary"]
        assert "mode='transaction'" in checks["pooler"]["fix"]
        assert checks["recovery"]["status"] == "ok"
        with psycopg.connect(primary.dsn_for("doctor_db"), autocommit=True) as direct:
            defaults = direct.execute(_LIVENESS_SETTINGS).fetchone()
        with psycopg.connect(bouncer.dsn_for("doctor_db"), autocommit=True, prepare_threshold=None) as after:
            inherited = after.execute(_LIVENESS_SETTINGS).fetchone()  # the pool's one server connection
        assert inherited == defaults, f"doctor left its settings on the pooler's server connection: {inherited}"
        # `locks` still works through the pooler (it only reads).
        listed = run_cli("locks", "--dsn", bouncer.dsn_for("doctor_db"), "--output", "json", capsys=capsys)
        assert listed.code == 0 and listed.json()["locks"] == []
    finally:
        bouncer.stop()


def test_doctor_accepts_session_pooling_declared_with_pool_mode(primary: Cluster, capsys: Any) -> None:
    """A DSN has no connection extra: ``--pool-mode session`` declares a session pooler, as the
    extra ``pool_mode`` does; a bad value is a configuration error naming it."""
    try:
        bouncer = PgBouncer(primary.port, pool_mode="session").start()
    except PgBouncerUnavailableError as error:
        pytest.skip(f"PgBouncer is not available here: {error}")
    try:
        dsn = bouncer.dsn_for("doctor_db")
        undeclared = run_cli("doctor", "--dsn", dsn, "--output", "json", capsys=capsys)
        assert undeclared.code == 1 and _checks(undeclared)["pooler"]["status"] == "problem"
        declared = run_cli("doctor", "--dsn", dsn, "--pool-mode", "session", "--output", "json", capsys=capsys)
        pooler = _checks(declared)["pooler"]
        assert pooler["status"] == "warning" and "declares pool_mode=session" in pooler["summary"], declared.out
        bad = run_cli("doctor", "--dsn", dsn, "--pool-mode", "sesion", capsys=capsys)
        assert bad.code == 3 and "'sesion'" in bad.err
    finally:
        bouncer.stop()


def _issue_a_token(dsn: str) -> None:
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.keys import LockKey
    from airflow_pglock.pg import schema
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.run_rules import RunRules

    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.migrate(conn)
    guard = LockGuard(
        AdvisoryLockHook(dsn=dsn).database, LockKey.from_name("fenced"), LockPolicy(), rules=RunRules(fencing=True)
    )
    assert guard.run(lambda handle: handle.fencing_token) is not None


def test_doctor_warns_when_fencing_tokens_have_no_synchronous_standby(primary: Cluster, capsys: Any) -> None:
    from devtools.campaign.servers import FailoverPair

    dsn = primary.dsn_for("doctor_db")
    before = _checks(run_cli("doctor", "--dsn", dsn, "--output", "json", capsys=capsys))
    assert "fencing" not in before  # no token issued yet: nothing to say
    _issue_a_token(dsn)
    fencing = _checks(run_cli("doctor", "--dsn", dsn, "--output", "json", capsys=capsys))["fencing"]
    assert fencing["status"] == "warning" and "replication is asynchronous" in fencing["summary"], fencing
    assert "docs/safety.md" in fencing["fix"]
    pair = FailoverPair().start()  # a primary with a synchronous standby
    try:
        _issue_a_token(pair.primary_dsn())
        fencing = _checks(run_cli("doctor", "--dsn", pair.primary_dsn(), "--output", "json", capsys=capsys))["fencing"]
        assert fencing["status"] == "ok" and "1 synchronous standby" in fencing["summary"], fencing
    finally:
        pair.destroy()
