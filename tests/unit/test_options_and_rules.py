"""The lock options are declared once and every adapter follows the declaration; the
server safety rules are pure functions whose messages the hook raises and doctor lists."""

from __future__ import annotations

import dataclasses
import datetime as dt
import inspect
import re

import pytest

from airflow_pglock.exceptions import UnsafeSetupError
from airflow_pglock.options import TEMPLATED, FunctionLockOptions, LockOptions, LockSpec, declared
from airflow_pglock.server_rules import RULES, ServerInfo, check_server, violations

PRIMARY = ServerInfo(
    backend_pid=7,
    reported_pid=7,
    version_num=160002,
    version="PostgreSQL 16.2 on x86_64",
    database="locks",
    server_addr="10.0.0.1",
    server_port=5432,
    in_recovery=False,
    started_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
)


def test_every_adapter_takes_the_declared_options() -> None:
    from airflow_pglock.decorators.advisory_lock import _AdvisoryLockDecoratedOperator, advisory_lock
    from airflow_pglock.operators.advisory_lock import guarded

    function_options, operator_options = set(declared(FunctionLockOptions)), set(declared(LockOptions))
    assert function_options == operator_options | {"tenant_arg"}
    # The typed signatures (IDE completion, mypy) come from the declaration.
    assert inspect.signature(advisory_lock).parameters["options"].annotation == "Unpack[FunctionLockOptions]"
    assert inspect.signature(guarded).parameters["options"].annotation == "Unpack[LockOptions]"
    # The decorated operator names every option in its signature (Airflow fills them from default_args).
    parameters = inspect.signature(_AdvisoryLockDecoratedOperator.__init__).parameters
    assert function_options <= set(parameters)
    assert {name: parameters[name].default for name in function_options} == {
        name: option.default for name, option in declared(FunctionLockOptions).items()
    }
    assert TEMPLATED == ("key", "tenant", "once_per")
    assert set(TEMPLATED) <= set(_AdvisoryLockDecoratedOperator.template_fields)  # named as the options


def test_defaults_apply_and_unknown_options_are_refused() -> None:
    spec = LockSpec.from_options({"key": "k", "lease": dt.timedelta(seconds=12)}, declaration=LockOptions, caller="x")
    assert spec.lease == 12.0 and spec.policy.on_busy == "skip" and spec.postgres_conn_id == "postgres_default"
    assert spec.templated == {"key": "k", "tenant": None, "once_per": None}
    with pytest.raises(TypeError, match=r"guarded\(\) got an unexpected keyword argument 'tenant_arg'"):
        LockSpec.from_options({"tenant_arg": "t"}, declaration=LockOptions, caller="guarded")


@pytest.mark.parametrize(
    ("change", "scope", "pool_mode", "check", "fragment"),
    [
        ({"version": "CockroachDB CCL v23"}, "session", None, "server", "does not look like PostgreSQL"),
        ({"version": "1.18.0/bouncer"}, "transaction", None, "server", "does not look like PostgreSQL"),
        ({"version": "11.2-YB-2.18.0.0-b0"}, "transaction", None, "server", "does not look like PostgreSQL"),
        ({"version_num": 110000}, "transaction", None, "server", "too old"),
        ({"version_num": 130010}, "session", None, "server", "no idle_session_timeout"),
        ({"in_recovery": True}, "transaction", None, "recovery", "standby in recovery"),
        ({"reported_pid": 99}, "session", None, "pooler", "connection pooler is in between"),
    ],
)
def test_each_rule_is_one_message_for_the_hook_and_doctor(
    change: dict[str, object], scope: str, pool_mode: str | None, check: str, fragment: str
) -> None:
    info = dataclasses.replace(PRIMARY, **change)  # type: ignore[arg-type]
    [violation] = violations(info, scope, pool_mode)  # type: ignore[arg-type]
    assert violation.check == check and fragment in violation.problem and violation.fix
    with pytest.raises(UnsafeSetupError) as error:
        check_server(info, scope, pool_mode)  # type: ignore[arg-type]
    assert str(error.value) == f"{violation.problem}; {violation.fix}"


def test_a_standby_is_retried_and_comes_after_the_settings_to_fix() -> None:
    """A standby is a StandbyServerError (a failover under way, often: retried); a standby that is
    also behind a transaction pooler fails with the pooler, which no retry mends."""
    from airflow_pglock.exceptions import StandbyServerError

    standby = dataclasses.replace(PRIMARY, in_recovery=True)
    with pytest.raises(StandbyServerError):
        check_server(standby, "session", None)
    pooled_standby = dataclasses.replace(standby, reported_pid=99)
    assert [v.check for v in violations(pooled_standby, "session", None)] == ["pooler", "recovery"]
    with pytest.raises(UnsafeSetupError, match="connection pooler is in between") as error:
        check_server(pooled_standby, "session", None)
    assert not isinstance(error.value, StandbyServerError)


def test_rules_pass_a_primary_and_what_is_safe() -> None:
    assert len(RULES) == 5
    assert violations(PRIMARY, "session", None) == []
    behind_pooler = dataclasses.replace(PRIMARY, reported_pid=99)
    assert violations(behind_pooler, "transaction", None) == []  # transaction locks work through PgBouncer
    assert violations(behind_pooler, "session", "session") == []  # declared session pooling
    assert violations(dataclasses.replace(PRIMARY, version_num=130010), "transaction", None) == []


@pytest.mark.parametrize(
    ("server_version", "crdb_version", "postgresql"),
    [
        ("16.2", None, True),
        ("15.20 (Debian 15.20-0+deb12u1)", None, True),
        ("17beta1", None, True),
        ("18devel", None, True),
        ("1.18.0/bouncer", None, False),  # PgBouncer's admin console
        ("11.2-YB-2.18.0.0-b0", None, False),  # YugabyteDB
        ("13.0.0", "CockroachDB CCL v23.1.0", False),  # CockroachDB claims PostgreSQL 13
        ("", None, False),
    ],
)
def test_the_handshake_tells_postgresql_from_look_alikes(
    server_version: str, crdb_version: str | None, postgresql: bool
) -> None:
    from airflow_pglock.server_rules import HANDSHAKE_RULES, from_handshake

    info = from_handshake(
        reported_pid=7,
        version_num=160002,
        server_version=server_version,
        crdb_version=crdb_version,
        database="locks",
        host="/var/run/postgresql",
        port=5432,
    )
    assert info.server == "local socket" and info.started_at is None
    found = [v.check for v in violations(info, "transaction", None, HANDSHAKE_RULES)]
    assert found == ([] if postgresql else ["server"])


def test_dag_default_args_reach_the_lock_options() -> None:
    from tests.sdk import DAG, task

    with DAG("default_args_options", schedule=None, default_args={"postgres_conn_id": "locks_db", "on_busy": "fail"}):

        @task.advisory_lock(key="k")
        def work() -> None: ...

        operator = work().operator
    assert operator.lock_spec.postgres_conn_id == "locks_db" and operator.lock_spec.policy.on_busy == "fail"


@pytest.mark.parametrize("tenant", ["", " "])
def test_an_empty_tenant_is_refused_when_the_dag_is_parsed(tenant: str) -> None:
    """It was refused only when the task ran (a scope's setup: skipped under on_error="skip")."""
    from airflow_pglock.exceptions import LockConfigurationError

    with pytest.raises(LockConfigurationError, match=re.escape(f"tenant={tenant!r} is empty")):
        LockSpec.from_options({"key": "k", "tenant": tenant}, declaration=LockOptions, caller="guarded")
