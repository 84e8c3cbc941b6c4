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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_pglock.compat import BaseOperator, Context, MappedOperator, TaskDeferred, rendered_task
from airflow_pglock.exceptions import LockConfigurationError, LockLostError
from airflow_pglock.options import LockOptions, LockSpec
from airflow_pglock.task_guard import (
    GUARD_ATTRIBUTE,
    RESUME_METHOD,
    fail_for_configuration,
    render_lock_options,
    resume_deadline,
    run_guarded,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from airflow_pglock.handle import LockHandle

OperatorT = TypeVar("OperatorT", bound=BaseOperator)


@dataclass(frozen=True)
class OperatorGuard:
    """The lock options of one guarded operator; its :meth:`execute` replaces the operator's.

    :param spec: the lock options, checked (templated ones rendered at run time).
    """

    spec: LockSpec

    def execute(self, context: Context, **kwargs: Any) -> Any:
        """Run the operator's own ``execute`` while holding the key (replaces ``operator.execute``).

        :param context: the task context; its ``task`` is the operator copy to run.
        :param kwargs: passed on to the operator's ``execute`` (Airflow 2's task runner adds a marker).
        """
        return self._execute(context, kwargs, deadline=None)

    def resume(self, context: Context, event: Any = None, deadline: float | None = None) -> Any:
        """Resume after ``on_busy="defer"`` (the operator's ``pglock_resume``): try the key again.

        :param context: the task context.
        :param event: the trigger's event (free, timeout or error: the new try finds out itself).
        :param deadline: the UNIX time the whole wait ends.
        """
        return self._execute(context, {}, deadline=resume_deadline(event, deadline))

    def _execute(self, context: Context, kwargs: dict[str, Any], deadline: float | None) -> Any:
        task = rendered_task(context)  # the copy the task runner executes, template fields rendered
        try:
            rendered = render_lock_options(self.spec, context)
        except LockConfigurationError as error:
            fail_for_configuration(self.spec, error, task.log)
        try:
            return run_guarded(
                self.spec,
                context,
                lambda handle: self._run(task, handle, context, kwargs),
                task.log,
                deadline=deadline,
                **rendered,
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


def guarded(operator: OperatorT, **options: Unpack[LockOptions]) -> OperatorT:
    """Run ``operator`` only while it holds its advisory lock; returns the same operator.

    ``guarded(BashOperator(task_id="vacuum", bash_command="..."), key="maintenance")``.
    Options (:class:`~airflow_pglock.options.LockOptions`), outcome lines and Airflow
    outcomes are those of ``@task.advisory_lock``: busy -> skipped (``on_busy``), lock
    database error -> failed (``on_error``), lock lost mid-run -> the operator's
    ``on_kill()`` is called and the task fails (``on_lost``). ``key``, ``tenant`` and
    ``once_per`` are Jinja templates rendered at run time.

    :param operator: any non-deferrable BaseOperator (BashOperator, SQLExecuteQueryOperator...).
    :param options: the lock options (:class:`~airflow_pglock.options.LockOptions`).
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
    guard = OperatorGuard(spec=LockSpec.from_options(options, declaration=LockOptions, caller="guarded"))
    setattr(operator, GUARD_ATTRIBUTE, guard)
    operator.execute = guard.execute  # type: ignore[method-assign]
    setattr(operator, RESUME_METHOD, guard.resume)  # where a task deferred by on_busy="defer" resumes
    return operator


def _stop_external_work(task: BaseOperator) -> None:
    """The lock was lost: stop what the operator started (a subprocess, a query), as on a timeout."""
    try:
        task.on_kill()
    except Exception as error:  # the work may already have ended; losing the lock is the error to report
        task.log.warning("pglock: on_kill() after the lock was lost raised %s: %s", type(error).__name__, error)
