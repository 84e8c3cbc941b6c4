"""``@task.advisory_lock``: a Python task that runs only while it holds its advisory lock."""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from airflow_pglock.compat import Context, DecoratedOperator, PythonOperator, TaskDecorator, task_decorator_factory
from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.guard import LockHandle, OnBusy, OnError, OnLost
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook, Scope
from airflow_pglock.liveness import DEFAULT_LEASE_SECONDS
from airflow_pglock.task_guard import (
    LOCK_HANDLE_PARAM,
    KeySpec,
    LockSpec,
    check_callable,
    check_key_spec,
    check_once_per,
    fail_for_configuration,
    guard_callable,
    run_guarded,
    tenant_from_arguments,
)


def _signature_parameters(python_callable: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(python_callable).parameters


class _AdvisoryLockDecoratedOperator(DecoratedOperator, PythonOperator):
    """Runs the decorated function while holding a PostgreSQL advisory lock.

    :param key: the lock key (templated): a name, an int64 or an (int32, int32) pair.
        Default: ``<dag_id>/<task_id>``.
    :param tenant: a tenant appended to the key name (templated): ``<key>/<tenant>``.
    :param tenant_arg: name of the function argument that holds the tenant (for mapped tasks).
    :param postgres_conn_id: the Airflow Postgres connection of the lock database.
    :param mode: ``"session"`` (default) or ``"transaction"``.
    :param shared: take a shared lock instead of an exclusive one.
    :param on_busy: ``"skip"`` (default), ``"fail"`` or ``"wait"`` (then ``wait_timeout``).
    :param wait_timeout: seconds (or timedelta) to wait with ``on_busy="wait"``.
    :param on_lost: ``"fail"`` (default) or ``"warn"`` when the lock is lost mid-run.
    :param on_error: ``"fail"`` (default) or ``"skip"`` when the lock database cannot be used.
    :param lease: seconds (or timedelta) a dead holder may keep the lock (default 30).
    :param once_per: a period (templated, e.g. ``"{{ ds }}"``): skip when this key already
        completed that period (recorded in the lock database; needs ``airflow-pglock init-db``).
    :param min_interval: seconds or timedelta: skip while the key's last completion is more
        recent, on the database clock (needs ``init-db``).
    :param fencing: give each acquisition a fencing token that only grows (``lock.fencing_token``
        and the XCom ``pglock_fencing_token``; needs ``init-db``).
    """

    template_fields: Sequence[str] = (*PythonOperator.template_fields, "lock_key", "lock_tenant", "lock_once_per")
    template_fields_renderers = {
        **PythonOperator.template_fields_renderers,
        "lock_key": "py",
        "lock_tenant": "py",
        "lock_once_per": "py",
    }
    custom_operator_name: str = "@task.advisory_lock"

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        key: KeySpec = None,
        tenant: Any = None,
        tenant_arg: str | None = None,
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
        **kwargs: Any,
    ) -> None:
        self.lock_spec = LockSpec.build(
            postgres_conn_id=postgres_conn_id,
            mode=mode,
            shared=shared,
            on_busy=on_busy,
            wait_timeout=wait_timeout,
            on_lost=on_lost,
            on_error=on_error,
            lease=lease,
            tenant_arg=tenant_arg,
            min_interval=min_interval,
            fencing=fencing,
        )
        check_key_spec(key, tenant)
        check_once_per(once_per)
        self.lock_once_per = once_per
        name = getattr(python_callable, "__name__", repr(python_callable))
        op_kwargs = dict(op_kwargs or {})
        if check_callable(python_callable, tenant=tenant, tenant_arg=tenant_arg):
            if LOCK_HANDLE_PARAM in op_kwargs:
                raise LockConfigurationError(
                    f"{name}() argument {LOCK_HANDLE_PARAM!r} receives the held lock; do not pass it yourself"
                )
            op_kwargs[LOCK_HANDLE_PARAM] = None  # a placeholder, replaced by the LockHandle at run time
        self.lock_key = key
        self.lock_tenant = tenant
        self._lock_handle: LockHandle | None = None
        super().__init__(
            kwargs_to_upstream={"python_callable": python_callable, "op_args": op_args, "op_kwargs": op_kwargs},
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            **kwargs,
        )

    def _tenant_from_args(self) -> Any:
        tenant_arg = self.lock_spec.tenant_arg
        assert tenant_arg is not None
        return tenant_from_arguments(self.python_callable, tenant_arg, self.op_args, self.op_kwargs)

    def execute(self, context: Context) -> Any:
        try:
            tenant = self.lock_tenant if self.lock_spec.tenant_arg is None else self._tenant_from_args()
        except LockConfigurationError as error:  # a setting to fix: no retry
            fail_for_configuration(self.lock_spec, error, self.log)
        return run_guarded(
            self.lock_spec,
            context,
            lambda handle: self._execute_holding(handle, context),
            self.log,
            key=self.lock_key,
            tenant=tenant,
            once_per=self.lock_once_per,
        )

    def _execute_holding(self, handle: LockHandle, context: Context) -> Any:
        self._lock_handle = handle
        try:
            return super().execute(context)
        finally:
            self._lock_handle = None

    def execute_callable(self) -> Any:
        if LOCK_HANDLE_PARAM in _signature_parameters(self.python_callable):
            self.op_kwargs = {**self.op_kwargs, LOCK_HANDLE_PARAM: self._lock_handle}  # type: ignore[has-type]
        return super().execute_callable()


def advisory_lock_task(
    python_callable: Callable[..., Any] | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """``@task.advisory_lock(...)``: run the function only while holding its advisory lock.

    Takes the parameters of ``_AdvisoryLockDecoratedOperator`` (key, tenant, tenant_arg,
    postgres_conn_id, mode, shared, on_busy, wait_timeout, on_lost, on_error, lease,
    once_per, min_interval, fencing) and every ``@task`` parameter.

    :param python_callable: the function to guard.
    :param multiple_outputs: unroll a returned dict into several XComs.
    """
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_AdvisoryLockDecoratedOperator,
        **kwargs,
    )


def advisory_lock(
    python_callable: Callable[..., Any] | None = None,
    *,
    key: KeySpec = None,
    tenant: Any = None,
    tenant_arg: str | None = None,
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
) -> Any:
    """``@advisory_lock(...)``: guard a function that another task flavour runs.

    Put it *under* ``@task``, ``@task.branch``, ``@task.short_circuit`` (any flavour that
    runs the function in the worker process)::

        @task.branch
        @advisory_lock(key="nightly-export")
        def choose(): ...

    Same options, key rendering, outcome lines and busy/error mapping as
    ``@task.advisory_lock`` (one code path: ``task_guard.run_guarded``). ``key`` and
    ``tenant`` may be Jinja templates, rendered with the task's context at run time.

    :param python_callable: the function (when used as ``@advisory_lock`` without arguments).
    :param key: the lock key: a name, an int64 or an (int32, int32) pair. Default: ``<dag_id>/<task_id>``.
    :param tenant: a tenant appended to the key name: ``<key>/<tenant>``.
    :param tenant_arg: name of the function argument that holds the tenant.
    :param postgres_conn_id: the Airflow Postgres connection of the lock database.
    :param mode: ``"session"`` (default) or ``"transaction"``.
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
    :param fencing: give each acquisition a fencing token that only grows (``lock.fencing_token``
        and the XCom ``pglock_fencing_token``; needs ``init-db``).
    """
    spec = LockSpec.build(
        postgres_conn_id=postgres_conn_id,
        mode=mode,
        shared=shared,
        on_busy=on_busy,
        wait_timeout=wait_timeout,
        on_lost=on_lost,
        on_error=on_error,
        lease=lease,
        tenant_arg=tenant_arg,
        min_interval=min_interval,
        fencing=fencing,
    )

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        if hasattr(function, "operator_class") or not callable(function):  # a @task-decorated function
            raise LockConfigurationError(
                f"@advisory_lock must be applied to a plain function, below the @task decorator "
                f"(@task... on top, @advisory_lock(...) under it), got {function!r}"
            )
        return guard_callable(function, spec, key=key, tenant=tenant, once_per=once_per)

    return decorate if python_callable is None else decorate(python_callable)
