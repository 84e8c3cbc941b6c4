"""How guarded work ends when it raises Airflow's own signals: not failures of the lock.

A work that skips its task itself (``AirflowSkipException``), a sensor that asks to be
rescheduled (``mode="reschedule"``) and a branch or short-circuit that skips its downstream
tasks (Airflow 3 raises ``DownstreamTasksSkipped`` for the task runner, which then marks the
task a success) held the lock and ended as they chose: the outcome line says so, and a branch
that succeeded records its completion. An operator that parks awaiting human input (Airflow
3.3+, no trigger) cannot keep a hold while it waits: it is refused, never resumed unguarded.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from airflow_pglock.compat import AIRFLOW_VERSION
from tests.helpers import advisory_locks_once_exited, run_dag

pytestmark = pytest.mark.airflow

SELF_SKIP_DAG = """
import os

import pendulum
import psycopg
from airflow.sdk import dag, task

try:
    from airflow.sdk.exceptions import AirflowSkipException
except ImportError:  # Airflow 3.0, 3.1
    from airflow.exceptions import AirflowSkipException

CONN = "pglock_test"


@dag(dag_id="self_skip", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def self_skip():
    @task.advisory_lock(postgres_conn_id=CONN, key="self-skip")
    def nothing_new():
        raise AirflowSkipException("no new files")

    @task.advisory_lock(postgres_conn_id=CONN, key="self-skip-tx", mode="transaction")
    def nothing_new_after_writing(lock):
        lock.connection.execute("INSERT INTO skipped_writes VALUES ('written before the skip')")
        raise AirflowSkipException("nothing to publish")

    nothing_new()
    nothing_new_after_writing()


self_skip_dag = self_skip()
"""


@pytest.fixture
def scratch_table(admin: Any) -> Any:
    admin.execute("DROP TABLE IF EXISTS skipped_writes; CREATE TABLE skipped_writes (note text)")
    yield admin
    admin.execute("DROP TABLE skipped_writes")


@pytest.mark.matrix("work-signals")
def test_a_work_that_skips_its_task_reports_skipped_not_failed(airflow_db: Any, scratch_table: Any, capfd: Any) -> None:
    capfd.readouterr()
    result = run_dag(SELF_SKIP_DAG, "self_skip")
    log = "".join(capfd.readouterr())
    assert result.state("nothing_new") == "skipped"
    assert result.state("nothing_new_after_writing") == "skipped"
    assert re.search(
        r"pglock outcome=skipped key 'self-skip' .* held=\d+\.\d+s .* - the work skipped the task: no new files", log
    ), log[-3000:]
    assert re.search(
        r"pglock outcome=skipped key 'self-skip-tx' .* - the work skipped the task: nothing to publish", log
    )
    assert "pglock outcome=failed" not in log, log[-3000:]
    # Transaction mode commits only a work that succeeded: a skip rolls back what it wrote.
    assert scratch_table.execute("SELECT count(*) FROM skipped_writes").fetchone()[0] == 0
    assert advisory_locks_once_exited(scratch_table) == []


BRANCH_DAG = """
import pendulum
from airflow.sdk import dag
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.providers.standard.operators.python import BranchPythonOperator, ShortCircuitOperator

from airflow_pglock.operators.advisory_lock import guarded

CONN = "pglock_test"


@dag(dag_id="guarded_branch", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     params={"period": "2026-12-01"})
def guarded_branch():
    choose = guarded(
        BranchPythonOperator(task_id="choose", python_callable=lambda: "left"),
        postgres_conn_id=CONN, key="branch-once", once_per="{{ params.period }}",
    )
    gate = guarded(
        ShortCircuitOperator(task_id="gate", python_callable=lambda: False),
        postgres_conn_id=CONN, key="gate-once", once_per="{{ params.period }}", mode="transaction",
    )
    choose >> [EmptyOperator(task_id="left"), EmptyOperator(task_id="right")]
    gate >> EmptyOperator(task_id="after_gate")


guarded_branch_dag = guarded_branch()
"""


@pytest.mark.matrix("work-signals")
def test_a_guarded_branch_or_short_circuit_completes_and_records_its_completion(
    airflow_db: Any, scopes_db: Any, capfd: Any
) -> None:
    capfd.readouterr()
    first = run_dag(BRANCH_DAG, "guarded_branch")
    log = "".join(capfd.readouterr())
    assert first.state("choose") == "success" and first.state("gate") == "success"
    assert first.state("left") == "success"
    assert first.state("right") == "skipped" and first.state("after_gate") == "skipped"
    assert re.search(r"pglock outcome=completed key 'branch-once' ", log), log[-3000:]
    assert re.search(r"pglock outcome=completed key 'gate-once' .*mode=transaction", log), log[-3000:]
    assert "pglock outcome=failed" not in log, log[-3000:]
    recorded = scopes_db.execute("SELECT key_name FROM pglock.completions WHERE period = '2026-12-01' ORDER BY 1")
    assert [row[0] for row in recorded.fetchall()] == ["branch-once", "gate-once"]

    second = run_dag(BRANCH_DAG, "guarded_branch")
    log = "".join(capfd.readouterr())
    assert second.state("choose") == "skipped" and second.state("gate") == "skipped", "done for the period"
    assert "already done for period '2026-12-01'" in log
    assert advisory_locks_once_exited(scopes_db) == []


RESCHEDULE_DAG = """
import os

import pendulum
from airflow.sdk import dag
from airflow.providers.standard.sensors.python import PythonSensor

from airflow_pglock.operators.advisory_lock import guarded

CONN = "pglock_test"
POKES = os.environ["PGLOCK_POKES_FILE"]


def ready():
    with open(POKES, "a") as pokes:
        pokes.write("poke\\n")
    with open(POKES) as pokes:
        return len(pokes.readlines()) >= 2


@dag(dag_id="guarded_reschedule", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def guarded_reschedule():
    guarded(
        PythonSensor(task_id="wait_for_file", python_callable=ready, mode="reschedule", poke_interval=1, timeout=120),
        postgres_conn_id=CONN, key="reschedule-me",
    )


guarded_reschedule_dag = guarded_reschedule()
"""


@pytest.mark.matrix("work-signals")
def test_a_guarded_sensor_in_reschedule_mode_reports_each_reschedule(
    airflow_db: Any, admin: Any, capfd: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGLOCK_POKES_FILE", str(tmp_path / "pokes"))
    capfd.readouterr()
    result = run_dag(RESCHEDULE_DAG, "guarded_reschedule")
    log = "".join(capfd.readouterr())
    assert result.state("wait_for_file") == "success"
    outcomes = re.findall(r"pglock outcome=(\w+) key 'reschedule-me' .*?(?: - (.*))?$", log, re.MULTILINE)
    assert [outcome for outcome, _ in outcomes] == ["rescheduled", "completed"], log[-3000:]
    assert outcomes[0][1].startswith("the work asked to be rescheduled at "), outcomes
    assert advisory_locks_once_exited(admin) == []


AWAITING_INPUT_DAG = """
import os

import pendulum
from airflow.sdk import BaseOperator, dag, task
from airflow.sdk.exceptions import TaskAwaitingInput

from airflow_pglock.operators.advisory_lock import guarded

CONN = "pglock_test"


class AsksAHuman(BaseOperator):
    def execute(self, context):
        raise TaskAwaitingInput(method_name="execute_complete")

    def execute_complete(self, context, event=None):
        with open(os.environ["PGLOCK_RESUMED_FILE"], "w") as resumed:
            resumed.write("resumed without the lock")

    def on_kill(self):
        with open(os.environ["PGLOCK_KILLED_FILE"], "w") as killed:
            killed.write("stopped")


@dag(dag_id="awaiting_input", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def awaiting_input():
    guarded(AsksAHuman(task_id="ask", retries=0), postgres_conn_id=CONN, key="ask-a-human")

    @task.advisory_lock(postgres_conn_id=CONN, key="ask-from-a-function", retries=0)
    def ask_from_a_function():
        raise TaskAwaitingInput(method_name="execute_complete")

    ask_from_a_function()


awaiting_input_dag = awaiting_input()
"""


@pytest.mark.matrix("work-signals")
@pytest.mark.skipif(
    AIRFLOW_VERSION < (3, 3), reason="TaskAwaitingInput (Human-in-the-loop without a trigger) is Airflow 3.3+"
)
def test_an_operator_parking_for_human_input_is_refused_not_resumed_unguarded(
    airflow_db: Any, admin: Any, capfd: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGLOCK_RESUMED_FILE", str(tmp_path / "resumed"))
    monkeypatch.setenv("PGLOCK_KILLED_FILE", str(tmp_path / "killed"))
    capfd.readouterr()
    result = run_dag(AWAITING_INPUT_DAG, "awaiting_input")
    log = "".join(capfd.readouterr())
    assert result.state("ask") == "failed", log[-3000:]
    assert result.state("ask_from_a_function") == "failed", log[-3000:]
    assert "task 'ask' parked awaiting input (Human-in-the-loop, Airflow 3.3+) while holding key 'ask-a-human'" in log
    assert "task 'ask_from_a_function' parked awaiting input" in log, log[-3000:]
    assert (tmp_path / "killed").exists(), "on_kill() stops what the operator started"
    assert not (tmp_path / "resumed").exists()
    assert advisory_locks_once_exited(admin) == []


@pytest.mark.matrix("work-signals")
@pytest.mark.skipif(AIRFLOW_VERSION < (3, 3), reason="the Human-in-the-loop operators park without a trigger on 3.3+")
def test_guarded_refuses_a_human_in_the_loop_operator_when_the_dag_is_parsed() -> None:
    from airflow.providers.standard.operators.hitl import ApprovalOperator

    from airflow_pglock.exceptions import LockConfigurationError
    from airflow_pglock.operators.advisory_lock import guarded

    with pytest.raises(LockConfigurationError, match=r"'approve' parked awaiting input"):
        guarded(ApprovalOperator(task_id="approve", subject="deploy?"), postgres_conn_id="pglock_test", key="deploy")

    from airflow.sdk import DAG

    from airflow_pglock.operators.scope import advisory_lock_scope

    refused = pytest.raises(LockConfigurationError, match=r"'g.approve' parked")
    with DAG("hitl_in_a_scope", schedule=None), refused, advisory_lock_scope("g", key="deploy"):
        ApprovalOperator(task_id="approve", subject="deploy?")


SCOPED_BRANCH_DAG = """
import pendulum
from airflow.sdk import dag
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.providers.standard.operators.python import BranchPythonOperator

from airflow_pglock.operators.scope import advisory_lock_scope


@dag(dag_id="scoped_branch", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def scoped_branch():
    with advisory_lock_scope("publish", key="scoped-branch", postgres_conn_id="pglock_test", once_per="2026-12-01"):
        BranchPythonOperator(task_id="choose", python_callable=lambda: "publish.left") >> [
            EmptyOperator(task_id="left"),
            EmptyOperator(task_id="right"),
        ]


scoped_branch_dag = scoped_branch()
"""


@pytest.mark.matrix("work-signals")
@pytest.mark.skipif(AIRFLOW_VERSION < (3, 0), reason="lock scopes are Airflow 3")
def test_a_branch_inside_a_lock_scope_counts_as_a_task_that_succeeded(airflow_db: Any, scopes_db: Any) -> None:
    first = run_dag(SCOPED_BRANCH_DAG, "scoped_branch")
    assert first.state("publish.choose") == "success" and first.state("publish.right") == "skipped"
    assert first.state("publish.pglock_scope_exit") == "success"
    periods = scopes_db.execute("SELECT period, task_id FROM pglock.completions").fetchall()
    assert periods == [("2026-12-01", "publish.pglock_scope_exit")], "the branch pushed its success marker"
    assert run_dag(SCOPED_BRANCH_DAG, "scoped_branch").state("publish.pglock_scope_enter") == "skipped"
    assert advisory_locks_once_exited(scopes_db) == []


@pytest.mark.skipif(AIRFLOW_VERSION < (3, 0), reason="the task runner triggers the DAG run on Airflow 3")
def test_a_lock_scope_refuses_a_trigger_dag_run_operator_when_the_dag_is_parsed() -> None:
    """Its task runner triggers the run, and waits or defers, after execute() returned and the
    task's hold was given back; its guard logged the hand-off as failed and pushed no success marker."""
    from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
    from airflow.sdk import DAG

    from airflow_pglock.exceptions import LockConfigurationError
    from airflow_pglock.operators.scope import advisory_lock_scope

    refused = pytest.raises(LockConfigurationError, match=r"task 'g.start' is a TriggerDagRunOperator")
    with DAG("trigger_in_a_scope", schedule=None), refused, advisory_lock_scope("g", key="deploy"):
        TriggerDagRunOperator(task_id="start", trigger_dag_id="other")


HANDS_OFF_DAG = """
import pendulum
from airflow.sdk import BaseOperator, dag

try:
    from airflow.sdk.exceptions import DagRunTriggerException
except ImportError:  # Airflow 3.0, 3.1
    from airflow.exceptions import DagRunTriggerException

from airflow_pglock.operators.advisory_lock import guarded
from airflow_pglock.operators.scope import advisory_lock_scope

CONN = "pglock_test"


class StartsARunLater(BaseOperator):
    \"\"\"Not named TriggerDagRunOperator, so no parse-time check knows it: it asks the task runner to
    trigger a run after execute() returned, as TriggerDagRunOperator does.\"\"\"

    def execute(self, context):
        raise DagRunTriggerException(
            trigger_dag_id="some_other_dag", dag_run_id="handed_off", conf=None, logical_date=None,
            reset_dag_run=False, skip_when_already_exists=False, wait_for_completion=False,
            allowed_states=["success"], failed_states=["failed"], poke_interval=1, deferrable=False,
        )


@dag(dag_id="hands_off", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def hands_off():
    guarded(StartsARunLater(task_id="alone", retries=0), postgres_conn_id=CONN, key="hands-off-alone")
    with advisory_lock_scope("scoped", key="hands-off-scope", postgres_conn_id=CONN, once_per="2026-12-01"):
        StartsARunLater(task_id="start", retries=0)


hands_off_dag = hands_off()
"""


@pytest.mark.matrix("work-signals")
@pytest.mark.skipif(AIRFLOW_VERSION < (3, 0), reason="the task runner triggers the DAG run on Airflow 3")
def test_work_that_hands_a_dag_run_to_the_task_runner_fails_at_run_time(
    airflow_db: Any, scopes_db: Any, capfd: Any
) -> None:
    """An operator the parse-time check cannot know (another name) that raises the task runner's
    DagRunTriggerException, under guarded() and inside a lock scope: the run would be triggered
    after the hold was given back, so the task fails with the refusal (without it, the
    exception went on to the task runner) and the scope records no completion."""
    capfd.readouterr()
    result = run_dag(HANDS_OFF_DAG, "hands_off")
    log = "".join(capfd.readouterr())
    assert result.state("alone") == "failed", log[-3000:]
    assert result.state("scoped.start") == "failed", log[-3000:]
    for task_id in ("alone", "scoped.start"):
        assert f"task {task_id!r} is a TriggerDagRunOperator: on Airflow 3 the task runner triggers" in log, task_id
    assert scopes_db.execute("SELECT count(*) FROM pglock.completions").fetchone() == (0,)
    assert advisory_locks_once_exited(scopes_db) == []


BRANCH_LAST_IN_SCOPE_DAG = """
import pendulum
from airflow.sdk import dag
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.providers.standard.operators.python import BranchPythonOperator, PythonOperator

from airflow_pglock.operators.scope import advisory_lock_scope

CONN = "pglock_test"


@dag(dag_id="branch_last_in_scope", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def branch_last_in_scope():
    # The scope as a whole before what the branch chooses (Airflow wires its last tasks to them)...
    with advisory_lock_scope("refresh", key="branch-last", postgres_conn_id=CONN, once_per="2026-12-01") as group:
        work = PythonOperator(task_id="work", python_callable=lambda: "done")
        choose = BranchPythonOperator(task_id="choose", python_callable=lambda: "publish")
        work >> choose
    group >> [EmptyOperator(task_id="publish"), EmptyOperator(task_id="notify_failure")]

    # ...and the branch itself before them.
    with advisory_lock_scope("tidy", key="branch-last-direct", postgres_conn_id=CONN, once_per="2026-12-01"):
        pick = BranchPythonOperator(task_id="pick", python_callable=lambda: "keep")
    pick >> [PythonOperator(task_id="keep", python_callable=lambda: "kept"), EmptyOperator(task_id="drop")]


branch_last_in_scope_dag = branch_last_in_scope()
"""


@pytest.mark.matrix("work-signals")
@pytest.mark.skipif(AIRFLOW_VERSION < (3, 0), reason="lock scopes are Airflow 3")
def test_a_branch_as_the_last_task_of_a_lock_scope_does_not_skip_its_teardown(airflow_db: Any, scopes_db: Any) -> None:
    """Airflow's branching skips every direct downstream task it does not follow; the scope's
    teardown, wired after its last tasks, was one of them: skipped, it never freed the scope, and
    the key stayed held until scope_lease (review helper-40). The branch's choice still runs, with
    the scope's group wired before it as with the branch itself (a first fix put a task between the
    branch and the teardown: the group's wiring then hung the chosen task on it, and skipped it)."""
    result = run_dag(BRANCH_LAST_IN_SCOPE_DAG, "branch_last_in_scope")
    assert result.state("refresh.choose") == "success" and result.state("tidy.pick") == "success"
    assert result.state("publish") == "success" and result.state("notify_failure") == "skipped"
    assert result.state("keep") == "success" and result.state("drop") == "skipped"
    assert result.state("refresh.pglock_scope_exit") == "success"
    assert result.state("tidy.pglock_scope_exit") == "success"
    assert scopes_db.execute("SELECT count(*) FROM pglock.scopes").fetchone() == (0,), "the scopes were freed"
    periods = scopes_db.execute("SELECT period, task_id FROM pglock.completions ORDER BY task_id").fetchall()
    assert periods == [("2026-12-01", "refresh.pglock_scope_exit"), ("2026-12-01", "tidy.pglock_scope_exit")]
    assert advisory_locks_once_exited(scopes_db) == []
