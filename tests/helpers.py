"""Helpers shared by the tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import re
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from devtools.relay import Relay

TEST_CONN_ID = "pglock_test"
T = TypeVar("T")


@contextlib.contextmanager
def held_lock(hook: Any, key: Any, *, mode: str = "session", **options: Any) -> Iterator[Any]:
    """``hook.acquire(key, ...)`` around a ``with`` block, the manual form's documented pattern:
    yields the ``HeldLock`` (None when busy); at the end a transaction lock commits (rolls back
    if the block raised), a session lock is released, and a release that finds the lock gone
    raises ``LockLostError`` when the block itself succeeded."""
    import psycopg

    from airflow_pglock.exceptions import LockLostError

    held = hook.acquire(key, mode=mode, **options)
    if held is None:
        yield None
        return
    try:
        yield held
        if mode == "transaction":
            held.commit()
        elif not held.released and not held.release():
            reason = "the session no longer held it when the block ended (lease expired or session ended)"
            raise LockLostError(f"lost {held.key.describe()}: {reason}", held.key, reason)
    finally:
        if mode == "session":
            held.release()
        else:
            if not held.connection.closed and held.transaction_open:
                with contextlib.suppress(psycopg.Error):
                    held.connection.execute("ROLLBACK")
            held.close()


def allow_connections(server: Any, database: str, allowed: bool) -> None:
    """Let ``database`` take new connections or refuse every one, superusers' too (its sessions
    stay); ``server`` is a connection to another database: none may refuse its own."""
    from psycopg import sql

    server.execute(
        sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(sql.Identifier(database), sql.Literal(allowed))
    )


def other_sessions(conn: Any) -> list[tuple[int, str]]:
    """Client sessions on this database other than ``conn``'s own."""
    rows = conn.execute(
        "SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend' ORDER BY pid"
    ).fetchall()
    return [(row[0], row[1]) for row in rows]


def advisory_locks(conn: Any) -> list[tuple[int, int, int, int, bool]]:
    """(pid, classid, objid, objsubid, granted) of every advisory lock in this database."""
    rows = conn.execute(
        "SELECT pid, classid::bigint, objid::bigint, objsubid, granted FROM pg_locks"
        " WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchall()
    return [tuple(row) for row in rows]


def once_exited(read: Callable[[], T], timeout: float) -> T:
    """``read()`` once it finds nothing (0, an empty list), or when ``timeout`` passed: what a
    closed session held goes a moment after its close, when its backend exits (polled)."""
    deadline = time.monotonic() + timeout
    while (found := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def advisory_locks_once_exited(conn: Any, timeout: float = 10.0) -> list[tuple[int, int, int, int, bool]]:
    """:func:`advisory_locks` once closed sessions' backends have exited: a guard whose lock was
    lost closes its connection without an unlock (one that gives up before its work, or is refused
    for a pool's size, frees what it took first: tests/integration/test_give_up.py)."""
    return once_exited(lambda: advisory_locks(conn), timeout)


def advisory_locks_left(conn: Any, timeout: float = 10.0) -> int:
    """How many advisory locks remain once closed sessions' backends have exited (a moment after the close)."""
    return once_exited(
        lambda: int(conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0]), timeout
    )


def wait_until_no_sessions(conn: Any, timeout: float = 5.0) -> list[tuple[int, str]]:
    """Poll until no other session remains (a closed client's backend exits asynchronously)."""
    return once_exited(lambda: other_sessions(conn), timeout)


@dataclass
class DagResult:
    states: dict[tuple[str, int], str]
    run_id: str
    tries: dict[tuple[str, int], int] | None = None  # try_number of each task instance

    def state(self, task_id: str, map_index: int = -1) -> str:
        return self.states[(task_id, map_index)]


# The test DAG sources are written for Airflow 3. On Airflow 2 (2.11) the same names live
# elsewhere: write_dag() rewrites those imports, so one test runs on both lines.
AIRFLOW_2_HOMES: dict[str, dict[str, str] | str] = {
    "airflow.sdk": {
        "dag": "airflow.decorators",
        "task": "airflow.decorators",
        "DAG": "airflow.models.dag",
        "BaseOperator": "airflow.models.baseoperator",
        "chain": "airflow.models.baseoperator",
        "Param": "airflow.models.param",
        "Variable": "airflow.models.variable",
        "get_current_context": "airflow.operators.python",
    },
    "airflow.sdk.exceptions": "airflow.exceptions",
    "airflow.providers.standard.operators.bash": "airflow.operators.bash",
    "airflow.providers.standard.operators.empty": "airflow.operators.empty",
    "airflow.providers.standard.operators.python": "airflow.operators.python",
    "airflow.providers.standard.sensors.python": "airflow.sensors.python",
    "airflow.providers.standard.triggers.temporal": "airflow.triggers.temporal",
}
_FROM_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)from (?P<module>[\w.]+) import (?P<names>\([^)]*\)|[^\n]+)$", re.MULTILINE
)


def for_this_airflow(source: str) -> str:
    """``source`` with Airflow 3 imports moved to their Airflow 2 homes when running on 2.x."""
    from airflow_pglock.compat import AIRFLOW_V_3_PLUS

    if AIRFLOW_V_3_PLUS:
        return source

    def rewrite(match: re.Match[str]) -> str:
        homes = AIRFLOW_2_HOMES.get(match["module"])
        if homes is None:
            return match[0]
        names = [name.strip() for name in match["names"].strip("()").split(",") if name.strip()]
        lines = []
        for name in names:
            home = homes if isinstance(homes, str) else homes.get(name.split(" as ")[0].strip())
            if home is None:
                raise AssertionError(f"no Airflow 2 home for {match['module']}.{name}: add it to AIRFLOW_2_HOMES")
            lines.append(f"{match['indent']}from {home} import {name}")
        return "\n".join(lines)

    return _FROM_IMPORT.sub(rewrite, source)


def write_dag(source: str, dag_id: str) -> Path:
    from tests.conftest import DAGS_FOLDER

    path = DAGS_FOLDER / f"{dag_id}.py"
    path.write_text(for_this_airflow(textwrap.dedent(source)))
    return path


#: Airflow 3.0's dag.test() prints a failed task's exception only as a boxed traceback wrapped at
#: the terminal's width (``COLUMNS``): wide enough, each message stays on one line.
_UNWRAPPED_COLUMNS = "4000"


def assert_unknown_param_reported(log: str) -> None:
    """The task ``unknown_param`` (key template ``{{ params.no_such_param }}``) failed naming the
    template and why."""
    assert (
        "the key template '{{ params.no_such_param }}' of task 'unknown_param' cannot be rendered: "
        "UndefinedError: 'dict object' has no attribute 'no_such_param'"
    ) in log


def _one_in_process_api_server() -> None:
    """Build dag.test()'s in-process execution API once per test process, as Airflow 3.3 does.

    Before 3.3 (``in_process_api_server`` gained ``functools.lru_cache(maxsize=1)`` there), dag.test()
    builds the whole execution API app for every task: Cadwyn's versioned routers, ~1.8 s a task
    (measured with py-spy on 3.2: most of the 3.1 and 3.2 matrix legs' time). The app holds no state
    of a run; the cache changes when it is built, not what a task sees.
    """
    try:
        from airflow.sdk.execution_time import supervisor
    except ImportError:  # Airflow 2: no execution API
        return
    build = getattr(supervisor, "in_process_api_server", None)
    if build is not None and not hasattr(build, "cache_info"):
        supervisor.in_process_api_server = functools.lru_cache(maxsize=1)(build)  # type: ignore[attr-defined]


@contextlib.contextmanager
def _task_log_printed_once() -> Iterator[None]:
    """The dag.test() of Airflow 2 and 3.0 adds a stdout handler to ``airflow.task``, which also
    propagates to the root console handler: every task log line would reach stdout twice
    (Airflow 3.1+ prints once). There: no propagation during the run, and the handler (bound
    to this test's stdout) is removed afterwards so that the next run adds a fresh one.
    """
    from airflow_pglock.compat import AIRFLOW_VERSION

    task_logger = logging.getLogger("airflow.task")
    propagate, handlers = task_logger.propagate, list(task_logger.handlers)
    if AIRFLOW_VERSION < (3, 1):
        task_logger.propagate = False
    try:
        yield
    finally:
        task_logger.propagate = propagate
        for handler in task_logger.handlers[:]:
            if handler not in handlers:
                task_logger.removeHandler(handler)


def run_dag(source: str, dag_id: str, conf: dict[str, Any] | None = None) -> DagResult:
    """Write a DAG file into the dags folder, load it and run it with ``dag.test()``."""
    path = write_dag(source, dag_id)
    module_name = f"pglock_test_dag_{dag_id}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    dags = [
        value for value in vars(module).values() if getattr(value, "dag_id", None) == dag_id and hasattr(value, "test")
    ]
    assert dags, f"no DAG {dag_id!r} in {path}"
    _one_in_process_api_server()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _UNWRAPPED_COLUMNS
    try:
        with _task_log_printed_once():
            dag_run = dags[0].test(run_conf=conf)
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    states = {
        (ti.task_id, ti.map_index): str(ti.state.value if hasattr(ti.state, "value") else ti.state)
        for ti in dag_run.get_task_instances()
    }
    tries = {(ti.task_id, ti.map_index): ti.try_number for ti in dag_run.get_task_instances()}
    return DagResult(states=states, run_id=dag_run.run_id, tries=tries)


def pglock_env() -> dict[str, str]:
    return dict(os.environ)


@contextlib.contextmanager
def relayed(dsn: str, delay: float = 0.0) -> Iterator[tuple[Relay, str]]:
    """A :class:`devtools.relay.Relay` in front of ``dsn``'s server, and the DSN that goes through it."""
    import psycopg

    from devtools.relay import Relay

    params = psycopg.conninfo.conninfo_to_dict(dsn)
    with Relay(int(params.get("port") or 5432), str(params.get("host") or "127.0.0.1"), delay=delay) as relay:
        params.update(host="127.0.0.1", port=relay.port)
        yield relay, psycopg.conninfo.make_conninfo(**params)
