"""Bad input fails the task (never skips it), names the problem, and leaves nothing behind."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from airflow_pglock.compat import AIRFLOW_VERSION
from devtools.pgcluster import free_port
from tests.helpers import advisory_locks, run_dag

pytestmark = pytest.mark.airflow

BAD_DAG = """
import pendulum
from airflow.sdk import dag, task


@dag(dag_id="bad_input", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"empty": "", "tenant": ""})
def bad_input():
    @task.advisory_lock(postgres_conn_id="no_such_conn")
    def unknown_conn():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="not_pg")
    def not_postgres():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="unreachable")
    def unreachable():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="unreachable", on_error="skip")
    def unreachable_but_skip_asked():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="bad_role")
    def wrong_credentials():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ params.empty }}")
    def renders_empty():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ params.empty }}", on_error="skip")
    def renders_empty_but_skip_asked():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_test", once_per="{{ params.empty }}", on_error="skip")
    def period_renders_empty_but_skip_asked():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_test", tenant="{{ params.tenant }}")
    def tenant_renders_empty():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ params.no_such_param }}")
    def unknown_param():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_test", tenant="{{ params.no_such_tenant }}")
    def unknown_tenant_param():
        raise AssertionError("must not run")

    # a URI pasted into the Host field, a keyword string into Schema (Airflow masks only Password)
    @task.advisory_lock(postgres_conn_id="uri_in_host")
    def uri_in_host():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="uri_in_schema")
    def uri_in_schema():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pool_mode_typo")
    def pool_mode_typo():
        raise AssertionError("must not run")

    for t in (unknown_conn, not_postgres, unreachable, unreachable_but_skip_asked, wrong_credentials,
              renders_empty, renders_empty_but_skip_asked, period_renders_empty_but_skip_asked,
              tenant_renders_empty, unknown_param, unknown_tenant_param, uri_in_host,
              uri_in_schema, pool_mode_typo):
        t()


bad_input_dag = bad_input()
"""

NATIVE_DAG = """
import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock
from airflow_pglock.operators.advisory_lock import guarded


@dag(dag_id="bad_native_keys", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     render_template_as_native_obj=True,
     params={"big": 2 ** 63, "fraction": 3.5, "pair": [1, 2 ** 31], "nothing": None})
def bad_native_keys():
    @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ params.big }}")
    def int_out_of_range():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ params.fraction }}")
    def wrong_type():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ params.pair }}")
    def pair_out_of_range():
        raise AssertionError("must not run")

    # rendered to None: the key would be the task's own, the tenant dropped, once_per off
    @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ params.nothing }}")
    def key_none():
        print("RAN key_none")  # the task succeeds if it runs: the test sees it

    @task.advisory_lock(postgres_conn_id="pglock_test", tenant="{{ params.nothing }}")
    def tenant_none():
        print("RAN tenant_none")  # the task succeeds if it runs: the test sees it

    @task.advisory_lock(postgres_conn_id="pglock_test", key="once", once_per="{{ params.nothing }}")
    def once_per_none():
        print("RAN once_per_none")  # the task succeeds if it runs: the test sees it

    @task
    @advisory_lock(postgres_conn_id="pglock_test", key="shared-name", tenant="{{ params.nothing }}")
    def composable_tenant_none():
        print("RAN composable_tenant_none")  # the task succeeds if it runs: the test sees it

    guarded(EmptyOperator(task_id="guarded_key_none"), postgres_conn_id="pglock_test", key="{{ params.nothing }}")

    int_out_of_range()
    wrong_type()
    pair_out_of_range()
    key_none()
    tenant_none()
    once_per_none()
    composable_tenant_none()


bad_native_keys_dag = bad_native_keys()
"""

NONE_TEXT_DAG = """
import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import dag, task

from airflow_pglock.decorators.advisory_lock import advisory_lock
from airflow_pglock.operators.advisory_lock import guarded


# Airflow's default (non-native) templating writes a None value as the text 'None'.
@dag(dag_id="none_text_templates", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"nothing": None})
def none_text_templates():
    @task.advisory_lock(postgres_conn_id="pglock_test", key="{{ params.nothing }}")
    def key_none():
        print("RAN key_none")  # the task succeeds if it runs (key 'None'): the test sees it

    @task.advisory_lock(postgres_conn_id="pglock_test", key="job", tenant="{{ params.nothing }}")
    def tenant_none():
        print("RAN tenant_none")  # the task succeeds if it runs (key 'job/None')

    @task.advisory_lock(postgres_conn_id="pglock_test", key="once", once_per="{{ params.nothing }}")
    def once_per_none():
        print("RAN once_per_none")  # the task succeeds if it runs (period 'None', then skipped for ever)

    @task
    @advisory_lock(postgres_conn_id="pglock_test", key="shared-name", tenant="{{ params.nothing }}")
    def composable_tenant_none():
        print("RAN composable_tenant_none")

    guarded(EmptyOperator(task_id="guarded_key_none"), postgres_conn_id="pglock_test", key="{{ params.nothing }}")

    # A key named 'None' written without a template is a name like any other.
    @task.advisory_lock(postgres_conn_id="pglock_test", key="None")
    def literal_none():
        print("RAN literal_none")

    key_none()
    tenant_none()
    once_per_none()
    composable_tenant_none()
    literal_none()


none_text_templates_dag = none_text_templates()
"""

TENANT_DAG = """
import datetime as dt

import pendulum
from airflow.sdk import dag, task


@dag(dag_id="bad_tenants", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     default_args={"retries": 2, "retry_delay": dt.timedelta(0)})
def bad_tenants():
    @task.advisory_lock(postgres_conn_id="pglock_test", tenant_arg="tenant")
    def export_one(tenant):
        raise AssertionError("must not run")

    export_one.expand(tenant=[None, "", {"id": 1}])


bad_tenants_dag = bad_tenants()
"""


@pytest.fixture
def bad_connections(dsn: str) -> Any:
    names = {
        "AIRFLOW_CONN_NOT_PG": "mysql://user:s3cret-pw@127.0.0.1:3306/db",
        "AIRFLOW_CONN_UNREACHABLE": f"postgresql://postgres:s3cret-pw@127.0.0.1:{free_port()}/postgres?connect_timeout=2",
        "AIRFLOW_CONN_BAD_ROLE": os.environ["AIRFLOW_CONN_PGLOCK_TEST"].replace("postgres@", "no_such_role@"),
        "AIRFLOW_CONN_URI_IN_HOST": json.dumps(
            {"conn_type": "postgres", "host": "postgresql://app:s3cret-pw@db.invalid:5432/locks", "login": "app"}
        ),
        "AIRFLOW_CONN_URI_IN_SCHEMA": json.dumps(
            {
                "conn_type": "postgres",
                "host": "127.0.0.1",
                "port": free_port(),
                "schema": "host=x password=s3cret-pw",
                "login": "postgres",
                "extra": {"connect_timeout": 2},
            }
        ),
        "AIRFLOW_CONN_POOL_MODE_TYPO": f"postgresql://postgres:s3cret-pw@127.0.0.1:{free_port()}/postgres"
        "?pool_mode=transactoin",
    }
    os.environ.update(names)
    yield
    for name in names:
        os.environ.pop(name, None)


def test_bad_input_fails_with_a_clear_message(
    airflow_db: Any, admin: Any, bad_connections: Any, capfd: Any, caplog: Any
) -> None:
    result = run_dag(BAD_DAG, "bad_input")
    # Airflow's own errors (a template that does not render) reach the output, or the log capture
    # when an earlier test of the session configured logging.
    log = "".join(capfd.readouterr()) + caplog.text

    expected_failures = [
        "unknown_conn",
        "not_postgres",
        "unreachable",
        "wrong_credentials",
        "renders_empty",
        "tenant_renders_empty",
        "unknown_param",
        "unknown_tenant_param",
        "uri_in_host",
        "uri_in_schema",
        "pool_mode_typo",
    ]
    assert {task: result.state(task) for task in expected_failures} == dict.fromkeys(expected_failures, "failed")
    assert result.state("unreachable_but_skip_asked") == "skipped"
    # on_error="skip" covers a setting that renders wrong too (README's table says so), with its warning.
    assert result.state("renders_empty_but_skip_asked") == "skipped"
    assert result.state("period_renders_empty_but_skip_asked") == "skipped"
    assert "once_per of task 'period_renders_empty_but_skip_asked' rendered to an empty period" in log

    assert "Airflow connection 'no_such_conn' was not found" in log
    assert "has conn_type 'mysql'" in log
    assert "cannot connect to the lock database" in log and "refused" in log
    assert "on_error='skip'" in log
    assert "no_such_role" in log
    assert "rendered to an empty name" in log
    assert "tenant of task 'tenant_renders_empty' rendered to an empty value" in log
    assert "no_such_param" in log
    # The option as the DAG author wrote it (tenant=), not an internal attribute name.
    assert "lock_tenant" not in log, [line for line in log.splitlines() if "lock_tenant" in line]
    assert "field 'tenant'" in log and "no_such_tenant" in log, log[-3000:]
    assert "on ***@db.invalid:5432/locks:5432 as 'app'" in log and "'host=x password=***'" in log
    assert "has extra pool_mode 'transactoin'" in log
    leaked = [line for line in _outside_airflow_3_0s_own(log) if "s3cret-pw" in line]
    assert leaked == [], f"a password reached the task log: {leaked}"
    assert advisory_locks(admin) == []


def _outside_airflow_3_0s_own(log: str) -> list[str]:
    """The lines of ``log`` but one Airflow 3.0 prints itself with the password: its in-process
    dag.test() logs, at debug level, the request that registers the password for masking
    (``MaskSecret(value=...)``). Its pretty console also prints a failed task's traceback with
    each frame's local variables: none of the provider's may hold the password (nor psycopg's,
    which the provider's connection error leaves out)."""
    return [line for line in log.splitlines() if AIRFLOW_VERSION != (3, 0) or "MaskSecret(value=" not in line]


#: The tasks of both None-value DAGs, by the option whose template gives no value.
NONE_VALUE_TASKS = [
    ("key", "key_none"),
    ("tenant", "tenant_none"),
    ("once_per", "once_per_none"),
    ("tenant", "composable_tenant_none"),
    ("key", "guarded_key_none"),
]


def test_bad_native_keys_fail_naming_the_value(airflow_db: Any, admin: Any, capfd: Any) -> None:
    result = run_dag(NATIVE_DAG, "bad_native_keys")
    log = "".join(capfd.readouterr())
    assert result.states == {
        ("int_out_of_range", -1): "failed",
        ("wrong_type", -1): "failed",
        ("pair_out_of_range", -1): "failed",
        ("key_none", -1): "failed",
        ("tenant_none", -1): "failed",
        ("once_per_none", -1): "failed",
        ("composable_tenant_none", -1): "failed",
        ("guarded_key_none", -1): "failed",
    }
    for option, task_id in NONE_VALUE_TASKS:
        assert f"the {option} template '{{{{ params.nothing }}}}' of task {task_id!r} rendered to None" in log, task_id
    assert "RAN " not in log
    assert str(2**63) in log and "between" in log
    assert "3.5" in log and "(float)" in log
    assert str(2**31) in log
    assert advisory_locks(admin) == []


def test_templates_rendering_a_none_value_as_the_text_none_fail_naming_the_option(
    airflow_db: Any, scopes_db: Any, capfd: Any
) -> None:
    """Key 'None' (one key for every DAG whose value is missing), tenant 'None' (every tenant one key),
    period 'None' (done once, then skipped for ever): each refused before connecting, no retry."""
    result = run_dag(NONE_TEXT_DAG, "none_text_templates")
    log = "".join(capfd.readouterr())
    refused = ["key_none", "tenant_none", "once_per_none", "composable_tenant_none", "guarded_key_none"]
    assert {task: result.state(task) for task in refused} == dict.fromkeys(refused, "failed"), result.states
    assert result.state("literal_none") == "success"
    assert "RAN literal_none" in log
    for option, task_id in NONE_VALUE_TASKS:
        assert (
            f"the {option} template '{{{{ params.nothing }}}}' of task {task_id!r} rendered to the text 'None'" in log
        ), task_id
        assert f"RAN {task_id}" not in log, task_id
    assert "where a period was expected" in log and "where a tenant was expected" in log
    assert "where a key name was expected" in log
    assert result.tries is not None and result.tries[("key_none", -1)] == 1, "a setting to fix is not retried"
    # Refused before any connection: nothing recorded, nothing held.
    assert scopes_db.execute("SELECT count(*) FROM pglock.completions").fetchone()[0] == 0
    assert advisory_locks(scopes_db) == []


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"on_busy": "sometimes"}, "on_busy must be one of 'skip', 'fail', 'wait', 'defer'; got 'sometimes'"),
        ({"on_busy": "defer"}, "on_busy='defer' needs wait_timeout"),
        ({"on_wait_timeout": "retry"}, "on_wait_timeout must be one of 'skip', 'fail'; got 'retry'"),
        ({"mode": "global"}, "mode must be one of 'session', 'transaction'; got 'global'"),
        ({"on_busy": "wait"}, "on_busy='wait' needs wait_timeout"),
        ({"wait_timeout": 5}, "only applies with on_busy='wait'"),
        ({"key": 2**63}, str(2**63)),
        ({"key": 3.5}, "3.5"),
        ({"key": (1, 2, 3)}, "(1, 2, 3)"),
        ({"key": 7, "tenant": "acme"}, "cannot be combined with the numeric key 7"),
        ({"tenant_arg": "customer"}, "tenant_arg='customer' is not an argument of work()"),
        (
            {"tenant": {"a": 1}},
            "tenant must be a str, an int or a UUID (a value with one stable text form), got {'a': 1} (dict)",
        ),
        ({"lease": 1}, "lease must be a number of seconds, at least 3 s"),
        ({"lease": 100_000, "on_error": "skip"}, "at most 98,301 s"),  # was: an OS error at connect, then a skip
        ({"on_busy": "wait", "wait_timeout": float("inf")}, "the longest is 2,147,483 s"),
        ({"on_busy": "defer", "wait_timeout": 3e6}, "got 3000000.0; the longest is 2,147,483 s"),
        ({"on_busy": "defer", "wait_timeout": 60, "defer_after": -1}, "defer_after must be 0 (defer at once)"),
        ({"on_busy": "defer", "wait_timeout": 60, "defer_after": "2"}, "before deferring, got '2'"),
        ({"on_busy": "defer", "wait_timeout": 60, "defer_after": True}, "got True"),
        ({"on_busy": "wait", "wait_timeout": 60, "defer_after": 5}, "defer_after=5 only applies with on_busy='defer'"),
        ({"defer_after": 0}, "before deferring); on_busy is 'skip'"),
        ({"key": "a\ud800b"}, "lock key name must be UTF-8 text"),
        ({"key": "k" * 2049}, "lock key name is 2049 bytes in UTF-8; a key name is at most 2048 bytes"),
        ({"tenant": 1.5}, "tenant must be a str, an int or a UUID"),
        ({"postgres_conn_id": ""}, "postgres_conn_id must be a non-empty string"),
        ({"shared": "yes"}, "shared must be True or False"),
        # review -57: refused only when the task ran (a blank key as "rendered to an empty name")
        ({"key": "   "}, "lock key name must be non-empty text, got '   '"),
        ({"key": "a\x00b"}, "lock key name must not contain NUL characters, got 'a\\x00b'"),
        ({"key": "k", "tenant": "a\x00b"}, "lock key name must not contain NUL characters, got 'a\\x00b'"),
        ({"tenant_arg": "lock"}, "tenant_arg='lock' names the argument that receives the lock handle"),
        # review -87: periods the ledger cannot store, refused when written literally too
        ({"once_per": "p" * 2049}, "once_per rendered to a period of 2049 bytes in UTF-8; a period is at most 2048"),
        ({"once_per": "2026\x0012"}, "once_per must render to a period without NUL characters"),
        ({"once_per": "a\udc80b"}, "once_per must render to UTF-8 text, got 'a\\udc80b'"),
    ],
)
def test_bad_options_are_refused_when_the_dag_is_parsed(options: dict[str, Any], fragment: str) -> None:
    from tests.sdk import DAG, task

    with DAG("parse_errors", schedule=None), pytest.raises(ValueError) as error:

        @task.advisory_lock(**options)
        def work(tenant_id: int = 0) -> None: ...

        work()
    assert fragment in str(error.value)


def test_bad_tenant_values_fail_without_retries(airflow_db: Any, admin: Any, capfd: Any) -> None:
    """None, "" and a dict from tenant_arg are settings to fix: each fails on its first try, never retried."""
    result = run_dag(TENANT_DAG, "bad_tenants")
    log = "".join(capfd.readouterr())
    bad = [("export_one", 0), ("export_one", 1), ("export_one", 2)]
    assert result.states == dict.fromkeys(bad, "failed")
    assert result.tries == dict.fromkeys(bad, 1), "a configuration error was retried"
    assert "tenant_arg 'tenant' has no value in this task instance (got None)" in log
    assert "tenant of task 'export_one' rendered to an empty value" in log
    assert "{'id': 1} (dict)" in log
    assert advisory_locks(admin) == []


@pytest.mark.parametrize("pool_mode", ["Session", "sesion", ""])
def test_a_connection_extra_pool_mode_that_is_no_pooling_mode_is_refused_naming_it(
    pool_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo in the extra would read as "no pooler declared": refused, naming it, before connecting."""
    from airflow_pglock.exceptions import LockConfigurationError
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    extra = {"pool_mode": pool_mode}
    conn = {"conn_type": "postgres", "host": "nowhere.invalid", "login": "postgres", "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_PGLOCK_BAD_POOL_MODE", json.dumps(conn))
    with pytest.raises(LockConfigurationError, match=f"extra pool_mode {pool_mode!r}"):
        AdvisoryLockHook("pglock_bad_pool_mode").resolve_settings()


def test_a_connection_that_cannot_be_read_now_is_a_connection_error_not_a_missing_one() -> None:
    """Only Airflow's "not found" is a setting to fix (a failure without retries); a secrets
    backend or API server failing now is a connection error, which the task's retries cover."""
    from airflow_pglock.exceptions import LockConfigurationError, LockConnectionError
    from airflow_pglock.hooks import connection

    class AirflowNotFoundException(Exception):  # noqa: N818  # the name Airflow's class has on every line
        pass

    def backend_down(conn_id: str) -> Any:
        raise TimeoutError("the secrets backend did not answer")

    def missing(conn_id: str) -> Any:
        raise AirflowNotFoundException(f"The conn_id `{conn_id}` isn't defined")

    with pytest.raises(LockConnectionError, match=r"'pglock_x' could not be read.*TimeoutError"):
        connection.from_airflow("pglock_x", backend_down)
    with pytest.raises(LockConfigurationError, match="'pglock_x' was not found"):
        connection.from_airflow("pglock_x", missing)
