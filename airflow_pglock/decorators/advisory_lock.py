"""``@task.advisory_lock``: a Python task that runs only while it holds its advisory lock."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_pglock.compat import Context, DecoratedOperator, PythonOperator, TaskDecorator, task_decorator_factory
from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.options import TEMPLATED, FunctionLockOptions, LockSpec, declared, signature_with_options
from airflow_pglock.task_guard import (
    check_callable,
    check_rendered,
    fail_for_configuration,
    guard_callable,
    hand_over_lock,
    refuse_lock_argument,
    resume_deadline,
    run_guarded,
    tenant_from_arguments,
    trigger_error,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _AdvisoryLockDecoratedOperator(DecoratedOperator, PythonOperator):
    """Runs the decorated function while holding a PostgreSQL advisory lock.

    Takes the lock options of :class:`~airflow_pglock.options.FunctionLockOptions` (its
    templated ones are template fields under the names the DAG author wrote: ``key``,
    ``tenant``, ``once_per``, so a template error names the option) and every ``@task`` /
    PythonOperator argument.

    :param python_callable: the function to guard.
    :param op_args: its positional arguments.
    :param op_kwargs: its keyword arguments.
    """

    template_fields: Sequence[str] = (*PythonOperator.template_fields, *TEMPLATED)
    template_fields_renderers = {**PythonOperator.template_fields_renderers, **dict.fromkeys(TEMPLATED, "py")}
    custom_operator_name: str = "@task.advisory_lock"

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        options = {name: kwargs.pop(name) for name in declared(FunctionLockOptions) if name in kwargs}
        self.lock_spec = LockSpec.from_options(options, declaration=FunctionLockOptions, caller="@task.advisory_lock")
        check_callable(python_callable, self.lock_spec)
        function = hand_over_lock(python_callable)
        if function is not python_callable:
            refuse_lock_argument(getattr(python_callable, "__name__", repr(python_callable)), op_kwargs or {})
        for name, value in self.lock_spec.templated.items():
            setattr(self, name, value)
        super().__init__(
            kwargs_to_upstream={"python_callable": function, "op_args": op_args, "op_kwargs": op_kwargs},
            python_callable=function,
            op_args=op_args,
            op_kwargs=op_kwargs,
            **kwargs,
        )

    # Airflow fills the arguments its signature names from the DAG's default_args: name the options there.
    __init__.__signature__ = signature_with_options(__init__, FunctionLockOptions)  # type: ignore[attr-defined]

    def execute(self, context: Context) -> Any:
        return self._execute_guarded(context, deadline=None)

    def pglock_resume(self, context: Context, event: Any = None, deadline: float | None = None) -> Any:
        """Resume after ``on_busy="defer"``: try the key again (the trigger's ``event`` says why it fired).

        :param context: the task context.
        :param event: the trigger's event (free, timeout or error: the new try finds out itself).
        :param deadline: the UNIX time the whole wait ends.
        """
        return self._execute_guarded(context, resume_deadline(event, deadline), trigger_error(event))

    def _execute_guarded(self, context: Context, deadline: float | None, failed_wait: str | None = None) -> Any:
        rendered = {name: getattr(self, name) for name in TEMPLATED}
        try:
            check_rendered(self.lock_spec, rendered, self.task_id)
            if self.lock_spec.tenant_arg is not None:
                rendered["tenant"] = tenant_from_arguments(
                    self.python_callable, self.lock_spec.tenant_arg, self.op_args, self.op_kwargs
                )
        except LockConfigurationError as error:  # a setting to fix: no retry
            fail_for_configuration(self.lock_spec, error, self.log)
        return run_guarded(
            self.lock_spec,
            context,
            lambda _: self._execute_function(context),
            self.log,
            deadline=deadline,
            trigger_error=failed_wait,
            **rendered,
        )

    def _execute_function(self, context: Context) -> Any:
        return super().execute(context)


def advisory_lock_task(
    python_callable: Callable[..., Any] | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """``@task.advisory_lock(...)``: run the function only while holding its advisory lock.

    Takes the lock options of :class:`~airflow_pglock.options.FunctionLockOptions` and
    every ``@task`` parameter.

    :param python_callable: the function to guard.
    :param multiple_outputs: unroll a returned dict into several XComs.
    """
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_AdvisoryLockDecoratedOperator,
        **kwargs,
    )


def advisory_lock(python_callable: Callable[..., Any] | None = None, **options: Unpack[FunctionLockOptions]) -> Any:
    """``@advisory_lock(...)``: guard a function that another task flavour runs.

    Put it *under* ``@task``, ``@task.branch``, ``@task.short_circuit`` (any flavour that
    runs the function in the worker process)::

        @task.branch
        @advisory_lock(key="nightly-export")
        def choose(): ...

    Same options (:class:`~airflow_pglock.options.FunctionLockOptions`), key rendering,
    outcome lines and busy/error mapping as ``@task.advisory_lock`` (one code path:
    ``task_guard.run_guarded``). ``key``, ``tenant`` and ``once_per`` may be Jinja
    templates, rendered with the task's context at run time.

    :param python_callable: the function (when used as ``@advisory_lock`` without arguments).
    :param options: the lock options (:class:`~airflow_pglock.options.FunctionLockOptions`).
    """
    spec = LockSpec.from_options(options, declaration=FunctionLockOptions, caller="advisory_lock")
    if spec.policy.on_busy == "defer":
        raise LockConfigurationError(
            "@advisory_lock(on_busy='defer') cannot defer: the task flavour above it (@task, @task.branch...) "
            "owns the task and has no way to resume it. Use @task.advisory_lock(on_busy='defer', ...) or "
            "guarded(operator, on_busy='defer', ...), or on_busy='wait' here"
        )

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        if hasattr(function, "operator_class") or not callable(function):  # a @task-decorated function
            raise LockConfigurationError(
                f"@advisory_lock must be applied to a plain function, below the @task decorator "
                f"(@task... on top, @advisory_lock(...) under it), got {function!r}"
            )
        return guard_callable(function, spec)

    return decorate if python_callable is None else decorate(python_callable)
