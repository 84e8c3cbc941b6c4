"""``airflow-pglock key --dag D --task T`` prints the key that task really takes (its DAG file parsed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from airflow_pglock.keys import LockKey
from tests.helpers import for_this_airflow
from tests.ops_helpers import run_cli

pytestmark = pytest.mark.airflow

KEYS_DAG = """
import pendulum
from airflow.sdk import dag, task
from airflow.providers.standard.operators.bash import BashOperator

from airflow_pglock.decorators.advisory_lock import advisory_lock
from airflow_pglock.operators.advisory_lock import guarded


@dag(dag_id="key_cli", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def key_cli():
    @task.advisory_lock(postgres_conn_id="pglock_test", key="nightly-export")
    def own_key():
        pass

    @task.advisory_lock(postgres_conn_id="pglock_test")
    def default_key():
        pass

    @task.advisory_lock(postgres_conn_id="pglock_test", key="billing", tenant="acme")
    def with_tenant():
        pass

    @task.advisory_lock(postgres_conn_id="pglock_test", key="exports", tenant="{{ params.tenant }}")
    def templated_tenant():
        pass

    @task
    @advisory_lock(postgres_conn_id="pglock_test", key="report/daily")
    def composed():
        pass

    @task
    def unguarded():
        pass

    vacuum = guarded(
        BashOperator(task_id="vacuum", bash_command="true"), key="maintenance", postgres_conn_id="pglock_test"
    )
    for t in (own_key(), default_key(), with_tenant(), templated_tenant(), composed(), unguarded()):
        t >> vacuum


key_cli()
"""


@pytest.fixture
def dags_folder(tmp_path: Path) -> str:
    (tmp_path / "key_cli.py").write_text(for_this_airflow(KEYS_DAG))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("task", "extra", "expected"),
    [
        ("own_key", (), "nightly-export"),
        ("default_key", (), "key_cli/default_key"),
        ("with_tenant", (), "billing/acme"),
        ("templated_tenant", ("--tenant", "zurich"), "exports/zurich"),
        ("composed", (), "report/daily"),
        ("vacuum", (), "maintenance"),
    ],
)
def test_key_of_a_task_is_the_key_it_takes(
    airflow_db: Any, dags_folder: str, capsys: Any, task: str, extra: tuple[str, ...], expected: str
) -> None:
    argv = ("key", "--dag", "key_cli", "--task", task, "--dags-folder", dags_folder, *extra, "--output", "json")
    result = run_cli(*argv, capsys=capsys)
    assert result.code == 0, result.err
    data = result.json()
    assert data["name"] == expected and data["numbers"] == list(LockKey.from_name(expected).numbers)


def test_key_of_a_task_says_what_it_cannot_know(airflow_db: Any, dags_folder: str, capsys: Any) -> None:
    common = ("--dags-folder", dags_folder)
    templated = run_cli("key", "--dag", "key_cli", "--task", "templated_tenant", *common, capsys=capsys)
    assert templated.code == 2 and "the template '{{ params.tenant }}'" in templated.err and "--tenant" in templated.err
    unguarded = run_cli("key", "--dag", "key_cli", "--task", "unguarded", *common, capsys=capsys)
    assert unguarded.code == 3 and "is not guarded by airflow-pglock" in unguarded.err
    missing = run_cli("key", "--dag", "key_cli", "--task", "nope", *common, capsys=capsys)
    assert missing.code == 3 and "has no task 'nope'" in missing.err and "own_key" in missing.err
    elsewhere = run_cli("key", "--dag", "not_here", "--task", "t", *common, capsys=capsys)
    assert elsewhere.code == 0 and "DEFAULT key" in elsewhere.err and "'not_here/t'" in elsewhere.out
