"""Guard any existing operator with an advisory lock: ``guarded(BashOperator(...), key=...)``.

Mechanism, and why (details in docs/sensor-and-operators.md): ``guarded()`` gives the
operator *instance* an ``execute`` attribute that runs the class's own ``execute``
inside :func:`~airflow_pglock.task_guard.run_guarded`. So

* release happens in ``finally`` whatever ``execute`` does (``pre_execute`` /
  ``post_execute`` hooks cannot give that: ``post_execute`` never runs when ``execute``
  raises);
* the operator keeps its class, template fields and task type: DAG serialization sees
  an ordinary BashOperator (the guard is not serialized; the worker re-parses the DAG
  file and applies it again, like any other Python in the file);
* the guarded ``execute`` runs the operator the task runner hands it in the context
  (the copy whose template fields were rendered), not the parse-time object.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, TypeVar

from airflow_pglock.compat import BaseOperator, Context, MappedOperator, TaskDeferred, rendered_task
from airflow_pglock.exceptions import LockConfigurationError, LockLostError
from airflow_pglock.guard import LockHandle, OnBusy, OnError, OnLost
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook, Scope
from airflow_pglock.liveness import DEFAULT_LEASE_SECONDS
from airflow_pglock.task_guard import (
    KeySpec,
    LockSpec,
    check_key_spec,
    check_once_per,
    fail_for_configuration,
    render_lock_option,
    run_guarded,
)

OperatorT = TypeVar("OperatorT", bound=BaseOperator)

#: Attribute of a guarded operator holding its :class:`OperatorGuard`.
GUARD_ATTRIBUTE = "pglock_guard"


@dataclass(frozen=True)
class OperatorGuard:
    """The lock options of one guarded operator; its :meth:`execute` replaces the operator's.

    :param spec: mode, on_busy, on_lost, on_error, lease and connection.
    :param key: the key option (a Jinja template string is rendered at run time).
    :param tenant: the tenant option (rendered at run time).
    :param once_per: the period option (rendered at run time), or None.
    """

    spec: LockSpec
    key: KeySpec
    tenant: Any
    once_per: str | None = None

    def execute(self, context: Context, **kwargs: Any) -> Any:
        """Run the operator's own ``execute`` while holding the key (replaces ``operator.execute``).

        :param context: the task context; its ``task`` is the operator copy to run.
        :param kwargs: passed on to the operator's ``execute`` (Airflow 2's task runner adds a marker).
        """
        task = rendered_task(context)  # the copy the task runner executes, template fields rendered
        try:
            key = render_lock_option(self.key, context, option="key")
            tenant = render_lock_option(self.tenant, context, option="tenant")
            once_per = render_lock_option(self.once_per, context, option="once_per")
        except LockConfigurationError as error:
            fail_for_configuration(self.spec, error, task.log)
        try:
            return run_guarded(
                self.spec,
                context,
                lambda handle: self._run(task, handle, context, kwargs),
                task.log,
                key=key,
                tenant=tenant,
                once_per=once_per,
            )
        except LockLostError:
            _stop_external_work(task)
            raise

    @staticmethod
    def _run(task: BaseOperator, handle: LockHandle, context: Context, kwargs: dict[str, Any]) -> Any:
        try:
            return type(task).execute(task, context, **kwargs)
        except TaskDeferred:
            # The lock lives on this worker's connection; a deferred task has no worker.
            raise LockConfigurationError(
                f"task {task.task_id!r} tried to defer while guarded by {handle.key.describe()}: a deferred task "
                "holds no lock (the worker and its lock connection are gone while the trigger waits). Run the "
                "operator with deferrable=False, or wait for the key with AdvisoryLockSensor(deferrable=True) "
                "and guard only non-deferrable work"
            ) from None


def guarded(
    operator: OperatorT,
    *,
    key: KeySpec = None,
    tenant: Any = None,
    postgres_conn_id: str = AdvisoryLockHook.default_conn_name,
    mode: Scope = "session",
    shared: bool = False,
    on_busy: OnBusy = "skip",
    wait_timeout: float | dt.timedelta | None = None,
    on_lost: OnLost = "fail",
    on_error: OnError = "fail",
    lease: float | dt.timedelta = DEFAULT_LEASE_SECONDS,
    once_per: str | None = None,
    min_interval: float | dt.timedelta | None = None,
    fencing: bool = False,
) -> OperatorT:
    """Run ``operator`` only while it holds its advisory lock; returns the same operator.

    ``guarded(BashOperator(task_id="vacuum", bash_command="..."), key="maintenance")``.
    Options, outcome lines and Airflow outcomes are those of ``@task.advisory_lock``:
    busy -> skipped (``on_busy``), lock database error -> failed (``on_error``), lock lost
    mid-run -> the operator's ``on_kill()`` is called and the task fails (``on_lost``).

    :param operator: any non-deferrable BaseOperator (BashOperator, SQLExecuteQueryOperator...).
    :param key: the lock key (Jinja template, rendered at run time): a name, an int64 or an
        (int32, int32) pair. Default: ``<dag_id>/<task_id>``.
    :param tenant: a tenant appended to the key name (Jinja template): ``<key>/<tenant>``.
    :param postgres_conn_id: the Airflow Postgres connection of the lock database.
    :param mode: ``"session"`` (default) or ``"transaction"`` (the lock lives in an open
        transaction on the lock's own connection: PgBouncer transaction pooling).
    :param shared: take a shared lock instead of an exclusive one.
    :param on_busy: ``"skip"`` (default), ``"fail"`` or ``"wait"`` (then ``wait_timeout``).
    :param wait_timeout: seconds (or timedelta) to wait with ``on_busy="wait"``.
    :param on_lost: ``"fail"`` (default) or ``"warn"`` when the lock is lost mid-run.
    :param on_error: ``"fail"`` (default) or ``"skip"`` when the lock database cannot be used.
    :param lease: seconds (or timedelta) a dead holder may keep the lock (default 30).
    :param once_per: a period (Jinja template, e.g. ``"{{ ds }}"``): skip when this key already
        completed for it (needs ``airflow-pglock init-db``).
    :param min_interval: seconds or timedelta: skip while the key's last completion is more
        recent (database clock; needs ``init-db``).
    :param fencing: give each acquisition a fencing token that only grows (pushed as the XCom
        ``pglock_fencing_token``; needs ``init-db``).
    """
    if isinstance(operator, MappedOperator):
        raise LockConfigurationError(
            f"guarded() cannot guard the mapped task {operator.task_id!r} (.partial().expand()): each mapped "
            "instance is rebuilt on the worker. Guard a @task.advisory_lock(tenant_arg=...) task instead"
        )
    if not isinstance(operator, BaseOperator):
        raise LockConfigurationError(f"guarded() takes an operator (a BaseOperator), got {operator!r}")
    if getattr(operator, GUARD_ATTRIBUTE, None) is not None or "execute" in vars(operator):
        raise LockConfigurationError(
            f"task {operator.task_id!r} is already guarded (or its execute was replaced); guard it once"
        )
    if getattr(operator, "deferrable", False) is True or getattr(operator, "start_from_trigger", False) is True:
        raise LockConfigurationError(
            f"task {operator.task_id!r} is deferrable: a deferred task holds no lock (its worker and the lock "
            "connection are gone while the trigger waits). Create it with deferrable=False to guard it"
        )
    spec = LockSpec.build(
        postgres_conn_id=postgres_conn_id,
        mode=mode,
        shared=shared,
        on_busy=on_busy,
        wait_timeout=wait_timeout,
        on_lost=on_lost,
        on_error=on_error,
        lease=lease,
        min_interval=min_interval,
        fencing=fencing,
    )
    check_key_spec(key, tenant)
    check_once_per(once_per)
    guard = OperatorGuard(spec=spec, key=key, tenant=tenant, once_per=once_per)
    setattr(operator, GUARD_ATTRIBUTE, guard)
    operator.execute = guard.execute  # type: ignore[method-assign]
    return operator


def _stop_external_work(task: BaseOperator) -> None:
    """The lock was lost: stop what the operator started (a subprocess, a query), as on a timeout."""
    try:
        task.on_kill()
    except Exception as error:  # the work may already have ended; losing the lock is the error to report
        task.log.warning("pglock: on_kill() after the lock was lost raised %s: %s", type(error).__name__, error)
