"""The Airflow side of a guarded task, shared by every adapter (decorators, operator guard).

``LockSpec`` is what a DAG author wrote (checked when the DAG is parsed); ``run_guarded``
renders the key from the task context, runs the work under a :class:`LockGuard` and turns
its outcome into Airflow's: busy -> skipped (or failed), error -> failed (or skipped when
the author asked), lost -> failed.
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import jinja2
import psycopg

from airflow_pglock.compat import AirflowFailException, AirflowSkipException, get_current_context
from airflow_pglock.exceptions import (
    AlreadyDoneError,
    InvalidLockKeyError,
    LockBusyError,
    LockConfigurationError,
    LockLostError,
    PgLockError,
    UnsafeSetupError,
)
from airflow_pglock.guard import LockGuard, LockHandle, LockPolicy, OnBusy, OnError, OnLost
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook, Scope
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.keys import LockKey, tenant_text
from airflow_pglock.liveness import DEFAULT_LEASE_SECONDS, Liveness
from airflow_pglock.run_rules import RunRules, seconds

T = TypeVar("T")

#: XCom key under which a guarded task publishes its fencing token (``fencing=True``).
FENCING_TOKEN_XCOM_KEY = "pglock_fencing_token"

#: A protected function that declares a parameter with this name receives the LockHandle.
LOCK_HANDLE_PARAM = "lock"

KeySpec = str | int | tuple[int, int] | list[int] | LockKey | None


@dataclass(frozen=True)
class LockSpec:
    """The lock options of a guarded task (everything but the templated key parts).

    :param postgres_conn_id: Airflow connection of the lock database.
    :param policy: mode, shared, on_busy, wait_timeout, on_lost, on_error.
    :param lease: seconds a dead holder may keep the lock on the server.
    :param tenant_arg: name of the function argument whose value is the tenant.
    :param min_interval: seconds; skip while the key's last completion is more recent.
    :param fencing: issue a fencing token per acquisition (handle and XCom).
    """

    postgres_conn_id: str
    policy: LockPolicy
    lease: float
    tenant_arg: str | None = None
    min_interval: float | None = None
    fencing: bool = False

    @classmethod
    def build(
        cls,
        *,
        postgres_conn_id: str = AdvisoryLockHook.default_conn_name,
        mode: Scope = "session",
        shared: bool = False,
        on_busy: OnBusy = "skip",
        wait_timeout: float | dt.timedelta | None = None,
        on_lost: OnLost = "fail",
        on_error: OnError = "fail",
        lease: float | dt.timedelta = DEFAULT_LEASE_SECONDS,
        tenant_arg: str | None = None,
        min_interval: float | dt.timedelta | None = None,
        fencing: bool = False,
    ) -> LockSpec:
        if not isinstance(postgres_conn_id, str) or not postgres_conn_id.strip():
            raise LockConfigurationError(f"postgres_conn_id must be a non-empty string, got {postgres_conn_id!r}")
        if tenant_arg is not None and (not isinstance(tenant_arg, str) or not tenant_arg.isidentifier()):
            raise LockConfigurationError(f"tenant_arg must be the name of a function argument, got {tenant_arg!r}")
        if isinstance(wait_timeout, dt.timedelta):
            wait_timeout = wait_timeout.total_seconds()
        if isinstance(lease, dt.timedelta):
            lease = lease.total_seconds()
        policy = LockPolicy(
            mode=mode, shared=shared, on_busy=on_busy, wait_timeout=wait_timeout, on_lost=on_lost, on_error=on_error
        )
        try:
            Liveness(lease)
        except ValueError as error:
            raise LockConfigurationError(str(error)) from None
        interval = seconds(min_interval, "min_interval")
        RunRules(min_interval=interval, fencing=fencing)  # checks both now, when the DAG is parsed
        return cls(
            postgres_conn_id=postgres_conn_id,
            policy=policy,
            lease=float(lease),
            tenant_arg=tenant_arg,
            min_interval=interval,
            fencing=fencing,
        )

    def hook(self) -> AdvisoryLockHook:
        return AdvisoryLockHook(self.postgres_conn_id, liveness=Liveness(self.lease))


def check_key_spec(key: KeySpec, tenant: Any) -> None:
    """Parse-time check of the key options (templates are checked when rendered)."""
    if tenant is not None and not isinstance(tenant, str):
        tenant_text(tenant)  # a dict or an object has no stable text form
    if key is None or isinstance(key, str | LockKey):
        return
    if isinstance(key, int | tuple | list):
        LockKey.coerce(tuple(key) if isinstance(key, list) else key)
        if tenant is not None:
            raise LockConfigurationError(
                f"tenant={tenant!r} cannot be combined with the numeric key {key!r}: a tenant is appended to a "
                "key *name*; use key='<name>' or encode the tenant in the numbers yourself"
            )
        return
    raise InvalidLockKeyError(
        f"key must be a name (str), an int64 or an (int32, int32) pair, got {key!r} ({type(key).__name__})"
    )


def check_once_per(once_per: Any) -> None:
    """Parse-time check of the ``once_per`` option (a template is checked when rendered)."""
    if once_per is not None and (not isinstance(once_per, str) or not once_per.strip()):
        raise LockConfigurationError(
            f"once_per must be a non-empty period or template, e.g. '{{{{ ds }}}}'; got {once_per!r}"
        )


def resolve_key(key: KeySpec, tenant: Any, dag_id: str, task_id: str) -> LockKey:
    """The key of one task instance, from the rendered ``key`` and ``tenant`` options."""
    if isinstance(key, str) and not key.strip():
        raise InvalidLockKeyError(f"the key template of task {task_id!r} rendered to an empty name ({key!r})")
    if tenant is not None and isinstance(tenant, str) and not tenant.strip():
        raise InvalidLockKeyError(f"the tenant of task {task_id!r} rendered to an empty value ({tenant!r})")
    if key is None:
        return LockKey.for_task(dag_id, task_id, tenant)
    if isinstance(key, str):
        return LockKey.for_task(dag_id, task_id, tenant, base=key)
    if tenant is not None:
        check_key_spec(key, tenant)
    return LockKey.coerce(tuple(key) if isinstance(key, list) else key)


def task_identity(context: Mapping[str, Any]) -> TaskIdentity:
    ti = context["ti"]
    return TaskIdentity(
        dag_id=ti.dag_id,
        task_id=ti.task_id,
        run_id=ti.run_id,
        map_index=getattr(ti, "map_index", -1) if getattr(ti, "map_index", -1) is not None else -1,
    )


def run_guarded(
    spec: LockSpec,
    context: Mapping[str, Any],
    work: Callable[[LockHandle], T],
    logger: Any,
    *,
    key: KeySpec,
    tenant: Any,
    once_per: Any = None,
) -> T:
    """Run ``work`` while holding the key of this task instance; map each outcome to Airflow's.

    :param key: the rendered ``key`` option (None: the DAG id and task id).
    :param tenant: the rendered tenant (or the ``tenant_arg`` value), or None.
    :param once_per: the rendered ``once_per`` period, or None.
    """
    identity = task_identity(context)
    guard: LockGuard | None = None

    def work_with_token(handle: LockHandle) -> T:
        if handle.fencing_token is not None:
            context["ti"].xcom_push(key=FENCING_TOKEN_XCOM_KEY, value=handle.fencing_token)
        return work(handle)

    try:
        lock_key = resolve_key(key, tenant, identity.dag_id, identity.task_id)
        if isinstance(once_per, str) and not once_per.strip():
            raise LockConfigurationError(f"once_per of task {identity.task_id!r} rendered to an empty period")
        rules = RunRules(
            period=None if once_per is None else str(once_per), min_interval=spec.min_interval, fencing=spec.fencing
        )
        guard = LockGuard(
            spec.hook(),
            lock_key,
            spec.policy,
            application_name=identity.application_name(),
            logger=logger,
            rules=rules,
            identity=identity,
        )
        return guard.run(work_with_token)  # the airtight form of `with guard as handle: work(handle)`
    except AlreadyDoneError as done:
        raise AirflowSkipException(f"skipped: {done}") from done
    except LockBusyError as busy:
        if spec.policy.on_busy == "fail":
            raise AirflowFailException(f"{busy} (on_busy='fail')") from busy
        raise AirflowSkipException(f"skipped: {busy}") from busy
    except LockLostError:
        raise
    except (InvalidLockKeyError, LockConfigurationError, UnsafeSetupError) as error:
        if guard is not None and guard.held is not None:  # raised after the lock was taken: never a skip
            raise AirflowFailException(f"{type(error).__name__}: {error}") from error
        fail_for_configuration(spec, error, logger)
    except (PgLockError, psycopg.OperationalError) as error:
        if guard is None or guard.held is None:  # the lock could not be taken: the lock database is the problem
            _skip_if_asked(spec, error, logger)
        raise


def fail_for_configuration(spec: LockSpec, error: BaseException, logger: Any) -> NoReturn:
    """A setting to fix (bad key, connection, unsafe set-up): fail without retrying (or skip if asked)."""
    _skip_if_asked(spec, error, logger)
    raise AirflowFailException(f"{type(error).__name__}: {error}") from error


def _skip_if_asked(spec: LockSpec, error: BaseException, logger: Any) -> None:
    if spec.policy.on_error == "skip":
        logger.warning(
            "pglock on_error='skip': skipping instead of failing because of %s: %s", type(error).__name__, error
        )
        raise AirflowSkipException(f"skipped because of an error (on_error='skip'): {error}") from error


# ------------------------------------------------------------ guarded Python callables
# Shared by @task.advisory_lock and the composable @advisory_lock decorator.


def check_callable(python_callable: Callable[..., Any], *, tenant: Any, tenant_arg: str | None) -> bool:
    """Parse-time checks of a guarded function's options; True if it takes the lock handle.

    :param python_callable: the function to guard.
    :param tenant: the ``tenant`` option (exclusive with ``tenant_arg``).
    :param tenant_arg: name of the function argument holding the tenant, or None.
    """
    parameters = inspect.signature(python_callable).parameters
    if tenant_arg is not None:
        name = getattr(python_callable, "__name__", repr(python_callable))
        if tenant is not None:
            raise LockConfigurationError(f"give either tenant={tenant!r} or tenant_arg={tenant_arg!r}, not both")
        if tenant_arg not in parameters:
            raise LockConfigurationError(
                f"tenant_arg={tenant_arg!r} is not an argument of {name}(); its arguments are {list(parameters)}"
            )
    return LOCK_HANDLE_PARAM in parameters


def tenant_from_arguments(
    python_callable: Callable[..., Any], tenant_arg: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """The value of argument ``tenant_arg`` in one call of ``python_callable``."""
    bound = inspect.signature(python_callable).bind_partial(*args, **kwargs)
    value = bound.arguments.get(tenant_arg)
    if value is None:
        raise LockConfigurationError(f"tenant_arg {tenant_arg!r} has no value in this task instance (got None)")
    return value


def render_lock_option(value: Any, context: Mapping[str, Any], *, option: str) -> Any:
    """Render a string ``key``/``tenant`` option with the task's Jinja environment.

    Used where the option is not one of the operator's ``template_fields`` (guarded
    operators, the composable decorator). Rendered from a string, never loaded as a
    template file, whatever the operator's ``template_ext`` says.

    :param value: the option as the DAG author wrote it.
    :param context: the task's template context.
    :param option: ``"key"`` or ``"tenant"`` (for the error message).
    """
    if not isinstance(value, str):
        return value
    task = context["task"]
    try:
        return task.get_template_env().from_string(value).render(context)
    except jinja2.TemplateError as error:
        raise LockConfigurationError(
            f"the {option} template {value!r} of task {task.task_id!r} cannot be rendered: "
            f"{type(error).__name__}: {error}"
        ) from None


def guard_callable(
    python_callable: Callable[..., T],
    spec: LockSpec,
    *,
    key: KeySpec = None,
    tenant: Any = None,
    once_per: str | None = None,
) -> Callable[..., T]:
    """Wrap a Python callable so that each call runs while holding its advisory lock.

    The wrapper finds its task instance with ``get_current_context()`` when called, so
    it composes with any in-process task flavour (``@task``, ``@task.branch``,
    ``@task.short_circuit``...). Key, tenant and outcomes are those of
    ``@task.advisory_lock``: both go through :func:`run_guarded`.

    :param python_callable: the function to guard.
    :param spec: the lock options (from :meth:`LockSpec.build`).
    :param key: the key option (a Jinja template string is rendered at run time).
    :param tenant: the tenant option (rendered at run time).
    :param once_per: the period option (rendered at run time), or None.
    """
    check_key_spec(key, tenant)
    check_once_per(once_per)
    wants_handle = check_callable(python_callable, tenant=tenant, tenant_arg=spec.tenant_arg)
    name = getattr(python_callable, "__name__", repr(python_callable))
    signature = inspect.signature(python_callable)

    @functools.wraps(python_callable)
    def guarded_call(*args: Any, **kwargs: Any) -> T:
        if wants_handle and LOCK_HANDLE_PARAM in kwargs:
            raise LockConfigurationError(
                f"{name}() argument {LOCK_HANDLE_PARAM!r} receives the held lock; do not pass it yourself"
            )
        context = _current_context(name)
        task = context["task"]
        try:
            rendered_key = render_lock_option(key, context, option="key")
            if spec.tenant_arg is not None:
                rendered_tenant = tenant_from_arguments(python_callable, spec.tenant_arg, args, kwargs)
            else:
                rendered_tenant = render_lock_option(tenant, context, option="tenant")
            rendered_once_per = render_lock_option(once_per, context, option="once_per")
        except LockConfigurationError as error:
            fail_for_configuration(spec, error, task.log)

        def work(handle: LockHandle) -> T:
            if wants_handle:
                return python_callable(*args, **{**kwargs, LOCK_HANDLE_PARAM: handle})
            return python_callable(*args, **kwargs)

        return run_guarded(
            spec, context, work, task.log, key=rendered_key, tenant=rendered_tenant, once_per=rendered_once_per
        )

    if wants_handle:  # the task flavour on top must not ask for (or inject into) the lock argument
        guarded_call.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[p for p in signature.parameters.values() if p.name != LOCK_HANDLE_PARAM]
        )
    return guarded_call


def _current_context(name: str) -> Mapping[str, Any]:
    try:
        return get_current_context()  # type: ignore[no-any-return]
    except Exception as error:  # Airflow raises a RuntimeError-like error whose type differs by version
        raise LockConfigurationError(
            f"{name}() is guarded by @advisory_lock but was called outside a running Airflow task "
            f"({type(error).__name__}: {error}). Put a task decorator that runs the function in the worker "
            "process on top of it (@task, @task.branch, @task.short_circuit); for @task.virtualenv, "
            "@task.docker and other out-of-process flavours, guard the task with @task.advisory_lock instead"
        ) from None
