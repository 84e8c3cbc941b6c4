"""The one place that knows where Airflow keeps things (Task SDK on 3.x, core on 2.x)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any


def _airflow_version() -> tuple[int, int]:
    # A DAG file or a task has imported Airflow already: its __version__ costs nothing, while
    # importlib.metadata scans the installed distributions (milliseconds at every DAG file parse).
    text = getattr(sys.modules.get("airflow"), "__version__", None)
    if not isinstance(text, str):
        from importlib.metadata import version

        text = version("apache-airflow")
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


AIRFLOW_VERSION: tuple[int, int] = _airflow_version()
AIRFLOW_V_3_PLUS = AIRFLOW_VERSION >= (3, 0)

#: ``airflow pglock ...``: Airflow reads a provider's ``cli`` entry from 3.2 on (older lines ignore it).
PROVIDER_CLI_SINCE = (3, 2)
#: The "Advisory locks" UI page: an api-server plugin with ``external_views``, Airflow 3.1+.
UI_PAGE_SINCE = (3, 1)
HAS_PROVIDER_CLI = AIRFLOW_VERSION >= PROVIDER_CLI_SINCE
HAS_UI_PAGE = AIRFLOW_VERSION >= UI_PAGE_SINCE
#: Lock scopes (advisory_lock_scope) need the Task SDK's XCom and setup / teardown semantics of Airflow 3.
LOCK_SCOPE_SINCE = (3, 0)
HAS_LOCK_SCOPE = AIRFLOW_VERSION >= LOCK_SCOPE_SINCE

if AIRFLOW_V_3_PLUS:
    from airflow.sdk import BaseOperator, BaseSensorOperator, Context, TaskGroup, get_current_context
    from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    if AIRFLOW_VERSION >= (3, 1):
        from airflow.sdk import BaseHook
    else:  # Airflow 3.0: hooks still live in core
        from airflow.hooks.base import BaseHook  # type: ignore[no-redef]
    if AIRFLOW_VERSION >= (3, 2):
        from airflow.sdk.configuration import conf
        from airflow.sdk.exceptions import (
            AirflowFailException,
            AirflowRescheduleException,
            AirflowSensorTimeout,
            AirflowSkipException,
            AirflowTaskTimeout,
            DownstreamTasksSkipped,
            TaskDeferred,
        )
    else:  # Airflow 3.0, 3.1: no airflow.sdk.configuration; the task runner catches core's exceptions
        from airflow.configuration import conf  # type: ignore[no-redef]
        from airflow.exceptions import (  # type: ignore[no-redef]
            AirflowFailException,
            AirflowRescheduleException,
            AirflowSensorTimeout,
            AirflowSkipException,
            AirflowTaskTimeout,
            DownstreamTasksSkipped,
            TaskDeferred,
        )
else:  # Airflow 2.x
    from airflow.configuration import conf  # type: ignore[no-redef]
    from airflow.decorators.base import (  # type: ignore[no-redef]
        DecoratedOperator,
        TaskDecorator,
        task_decorator_factory,
    )
    from airflow.exceptions import (  # type: ignore[no-redef]
        AirflowFailException,
        AirflowRescheduleException,
        AirflowSensorTimeout,
        AirflowSkipException,
        AirflowTaskTimeout,
        TaskDeferred,
    )

    class DownstreamTasksSkipped(Exception):  # type: ignore[no-redef]  # noqa: N818 (Airflow's name)
        """Airflow 2 has none: a branch or short-circuit writes its skips itself. Never raised."""

    from airflow.hooks.base import BaseHook  # type: ignore[no-redef]
    from airflow.models.baseoperator import BaseOperator  # type: ignore[no-redef]
    from airflow.models.mappedoperator import MappedOperator  # type: ignore[no-redef]
    from airflow.operators.python import get_current_context  # type: ignore[no-redef]
    from airflow.sensors.base import BaseSensorOperator  # type: ignore[no-redef]
    from airflow.utils.context import Context  # type: ignore[no-redef]
    from airflow.utils.task_group import TaskGroup  # type: ignore[no-redef]

#: The triggerer cancels the trigger of a task cleared or marked while deferred with this message,
#: and then calls the trigger's ``on_kill()``, from this line on (earlier lines call no ``on_kill()``).
KILLS_CLEARED_TRIGGERS_SINCE = (3, 3)
KILLS_CLEARED_TRIGGERS = AIRFLOW_VERSION >= KILLS_CLEARED_TRIGGERS_SINCE
_USER_ACTION_CANCEL = "__airflow_user_action__"


def is_user_action_cancel(cancelled: BaseException) -> bool:
    """Whether a trigger's ``CancelledError`` is the triggerer's for a task cleared or marked while
    deferred (which calls ``on_kill()`` next), not a shutdown's or a timeout's."""
    return KILLS_CLEARED_TRIGGERS and bool(cancelled.args) and cancelled.args[0] == _USER_ACTION_CANCEL


def trigger_on_kill_timeout() -> float:
    """How long the triggerer lets a trigger's ``on_kill()`` run (``[triggerer] on_kill_timeout``)."""
    try:
        return float(conf.getint("triggerer", "on_kill_timeout", fallback=30))
    except Exception:  # an unreadable setting: Airflow's default
        return 30.0


#: Human-in-the-loop operators park the task awaiting input, with no trigger, from this line on.
AWAITING_INPUT_SINCE = (3, 3)
try:
    from airflow.sdk.exceptions import TaskAwaitingInput
except ImportError:  # before Airflow 3.3 a task never parks awaiting input (a HITL operator defers)

    class TaskAwaitingInput(BaseException):  # type: ignore[no-redef]
        """Never raised on this Airflow line."""


def parks_awaiting_input(operator: Any) -> bool:
    """Whether ``operator`` is a Human-in-the-loop operator that parks its task awaiting input
    (``TaskAwaitingInput``, Airflow 3.3+ with a standard provider that uses it) rather than
    deferring to a trigger: its module imports the exception only where it raises it."""
    for cls in type(operator).__mro__:
        if cls.__name__ == "HITLOperator":
            return getattr(sys.modules.get(cls.__module__), "TaskAwaitingInput", None) is not None
    return False


def hands_off_to_task_runner(operator: Any) -> bool:
    """Whether ``operator`` is Airflow 3's TriggerDagRunOperator, whose task runner (not the
    operator) triggers its DAG run, and waits or defers, after ``execute`` returned."""
    return AIRFLOW_V_3_PLUS and any(cls.__name__ == "TriggerDagRunOperator" for cls in type(operator).__mro__)


def is_task_runner_handoff(error: BaseException) -> bool:
    """Whether ``error`` is what Airflow 3's TriggerDagRunOperator raises from ``execute`` for its
    task runner (``DagRunTriggerException``; core and Task SDK each have one)."""
    return type(error).__name__ == "DagRunTriggerException"


try:
    from airflow.providers.standard.operators.python import PythonOperator
except ImportError:  # Airflow 2.x without the standard provider
    from airflow.operators.python import PythonOperator  # type: ignore[no-redef]


def skipmixin_xcom() -> tuple[str, str]:
    """The XCom key a branching task records what it followed under, and that record's field (the
    scheduler skips a direct downstream task the record does not name)."""
    try:
        from airflow.providers.standard.utils.skipmixin import XCOM_SKIPMIXIN_FOLLOWED, XCOM_SKIPMIXIN_KEY
    except ImportError:  # lock scopes need Airflow 3, whose standard provider has them: Airflow's own names
        return "skipmixin_key", "followed"
    return XCOM_SKIPMIXIN_KEY, XCOM_SKIPMIXIN_FOLLOWED


if TYPE_CHECKING:
    from airflow.triggers.base import BaseTrigger, TriggerEvent  # triggers stay in core: the triggerer runs them


def __getattr__(name: str) -> Any:
    """``BaseTrigger`` and ``TriggerEvent``, loaded on first use (a sensor defers, the triggerer
    runs a trigger): ``airflow.triggers.base`` would otherwise be half the provider's cost of
    parsing a DAG file, which never needs it."""
    if name in ("BaseTrigger", "TriggerEvent"):
        from airflow.triggers import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_stats() -> Any:
    """Airflow's metrics facade (``incr`` / ``timing``), as the deployment configured it.

    On Airflow 3 the task runner sets the Task SDK's Stats up from ``[metrics]``; where
    nothing did (``dag.test()``, a plain script), it is set up here the same way, so
    metrics go where the deployment's StatsD / OpenTelemetry settings say.
    """
    try:
        from airflow.sdk._shared.observability.metrics import stats as sdk_stats
        from airflow.sdk.observability.metrics import stats_utils
    except ImportError:  # Airflow 2.x, 3.0, 3.1: core's Stats sets itself up lazily
        from airflow.stats import Stats

        return Stats
    if getattr(sdk_stats, "_factory", None) is None:
        sdk_stats.initialize(
            factory=stats_utils.get_stats_factory(),
            export_legacy_names=conf.getboolean("metrics", "legacy_names_on", fallback=True),
        )
    return sdk_stats.Stats


def rendered_task(context: Any) -> Any:
    """The operator the task runner executes: the copy whose template fields were rendered.

    Airflow 3.0 builds the context before it copies the task for execution and renders the
    copy, so there ``context["task"]`` is the unrendered parse-time object and only
    ``context["ti"].task`` is the one that runs. Elsewhere both are that copy.
    """
    if AIRFLOW_VERSION == (3, 0):
        return context["ti"].task
    return context["task"]


#: Where the deployment's name is set: ``[pglock] deployment`` (also ``AIRFLOW__PGLOCK__DEPLOYMENT``).
DEPLOYMENT_OPTION = ("pglock", "deployment")
#: Airflow's own name for the instance, used when ``[pglock] deployment`` is unset.
INSTANCE_NAME_OPTION = ("api", "instance_name") if AIRFLOW_V_3_PLUS else ("webserver", "instance_name")


def task_supervisor_wait() -> float | None:
    """Seconds the Task SDK's supervisor may wait before it notices that its task process exited
    (``[workers] min_heartbeat_interval``, the longest wait of its loop); None on Airflow 2 (no
    supervisor) or when it cannot be read. Read on the worker, which shares its supervisor's config."""
    if not AIRFLOW_V_3_PLUS:
        return None
    try:
        value = conf.getfloat("workers", "min_heartbeat_interval", fallback=None)
    except Exception:  # a broken value: the supervisor itself would not start with it
        return None
    return value if isinstance(value, float) and value >= 0 else None


def deployment_name() -> str | None:
    """This deployment's name, for the holder identity of its lock sessions; None: unnamed.

    ``[pglock] deployment`` if set, else Airflow's instance name (``[api] instance_name`` on
    3.x, ``[webserver] instance_name`` on 2.x) if set; unnamed, the host name stands for the
    deployment. Read when a lock session opens, never when a DAG file is parsed.
    """
    for section, option in (DEPLOYMENT_OPTION, INSTANCE_NAME_OPTION):
        try:
            value = conf.get(section, option, fallback=None)
        except Exception:  # a broken config must not keep a lock from being named
            value = None
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def load_dag(dag_id: str, dags_folder: str | None = None) -> tuple[Any, str]:
    """The DAG ``dag_id`` parsed from the DAG files (None if no file defines it), and the folder read.

    Parses the files as the DAG processor does (``DagBag``), without the metadata database.

    :param dags_folder: where the DAG files are (default: ``[core] dags_folder``).
    """
    folder = dags_folder or conf.get("core", "dags_folder")
    try:
        from airflow.dag_processing.dagbag import DagBag  # Airflow 3.1+
    except ImportError:  # Airflow 2.x, 3.0
        from airflow.models.dagbag import DagBag  # type: ignore[no-redef,attr-defined]
    kwargs: dict[str, Any] = {"dag_folder": folder}
    if not AIRFLOW_V_3_PLUS:
        kwargs["include_examples"] = False
    bag = DagBag(**kwargs)
    return bag.dags.get(dag_id), folder


def run_task_states(ti: Any, task_ids: list[str]) -> dict[str, str] | None:
    """The states of ``task_ids`` in ``ti``'s DAG run, as strings, or None where the Task SDK
    cannot tell (no ``RuntimeTaskInstance.get_task_states``, or a call that differs)."""
    get_task_states = getattr(ti, "get_task_states", None)
    if get_task_states is None:
        return None
    try:
        states = get_task_states(dag_id=ti.dag_id, task_ids=task_ids, run_ids=[ti.run_id])
    except TypeError:
        return None
    of_run = states.get(ti.run_id, {}) if isinstance(states, dict) else {}
    return {task_id: str(getattr(state, "value", state)) for task_id, state in of_run.items()}  # an enum or its value


#: The method Airflow resumes a task with when its trigger failed, or Airflow's deferral timed out.
TRIGGER_FAILED = "__fail__"


def is_deferral_timeout(error: BaseException) -> bool:
    """Whether ``error`` is Airflow's deferral timeout (``TaskDeferralTimeout``: a ``__fail__``
    resume for a timeout), by name: its module differs by line (core, Task SDK)."""
    return type(error).__name__ == "TaskDeferralTimeout"


def is_connection_not_found(error: BaseException) -> bool:
    """Whether ``error`` is Airflow's "no such connection" (``AirflowNotFoundException``; core and
    Task SDK each have one)."""
    return any(cls.__name__ == "AirflowNotFoundException" for cls in type(error).__mro__)


def use_server_connections() -> None:
    """Let connection look-ups outside a task also read the metadata database.

    Outside a task the Task SDK reads connections from environment variables and secrets
    backends only; Airflow's own ``airflow connections get`` declares the process a
    "server" process so the metadata database is read too. The pglock CLI does the same
    (only if nothing set the context already).
    """
    if AIRFLOW_V_3_PLUS:
        import os

        os.environ.setdefault("_AIRFLOW_PROCESS_CONTEXT", "server")


__all__ = [
    "AIRFLOW_VERSION",
    "AIRFLOW_V_3_PLUS",
    "AWAITING_INPUT_SINCE",
    "DEPLOYMENT_OPTION",
    "HAS_LOCK_SCOPE",
    "HAS_PROVIDER_CLI",
    "HAS_UI_PAGE",
    "INSTANCE_NAME_OPTION",
    "KILLS_CLEARED_TRIGGERS",
    "KILLS_CLEARED_TRIGGERS_SINCE",
    "PROVIDER_CLI_SINCE",
    "TRIGGER_FAILED",
    "UI_PAGE_SINCE",
    "AirflowFailException",
    "AirflowRescheduleException",
    "AirflowSensorTimeout",
    "AirflowSkipException",
    "AirflowTaskTimeout",
    "BaseHook",
    "BaseOperator",
    "BaseSensorOperator",
    "BaseTrigger",
    "Context",
    "DecoratedOperator",
    "DownstreamTasksSkipped",
    "MappedOperator",
    "PythonOperator",
    "TaskAwaitingInput",
    "TaskDecorator",
    "TaskDeferred",
    "TaskGroup",
    "TriggerEvent",
    "conf",
    "deployment_name",
    "get_current_context",
    "get_stats",
    "hands_off_to_task_runner",
    "is_connection_not_found",
    "is_deferral_timeout",
    "is_task_runner_handoff",
    "is_user_action_cancel",
    "load_dag",
    "parks_awaiting_input",
    "rendered_task",
    "run_task_states",
    "skipmixin_xcom",
    "task_decorator_factory",
    "task_supervisor_wait",
    "trigger_on_kill_timeout",
    "use_server_connections",
]
