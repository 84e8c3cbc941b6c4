"""The Airflow side of a guarded task, shared by every adapter (decorators, operator guard).

``LockSpec`` is what a DAG author wrote (checked when the DAG is parsed); ``run_guarded``
renders the key from the task context, runs the work under a :class:`LockGuard` and turns
its outcome into Airflow's: busy -> skipped (or failed), error -> failed (or skipped when
the author asked), lost -> failed.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from airflow_pglock.compat import AirflowFailException, AirflowSkipException
from airflow_pglock.exceptions import (
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
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import DEFAULT_LEASE_SECONDS, Liveness

T = TypeVar("T")

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
    """

    postgres_conn_id: str
    policy: LockPolicy
    lease: float
    tenant_arg: str | None = None

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
        return cls(postgres_conn_id=postgres_conn_id, policy=policy, lease=float(lease), tenant_arg=tenant_arg)

    def hook(self) -> AdvisoryLockHook:
        return AdvisoryLockHook(self.postgres_conn_id, liveness=Liveness(self.lease))


def check_key_spec(key: KeySpec, tenant: Any) -> None:
    """Parse-time check of the key options (templates are checked when rendered)."""
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


def resolve_key(key: KeySpec, tenant: Any, dag_id: str, task_id: str) -> LockKey:
    """The key of one task instance, from the rendered ``key`` and ``tenant`` options."""
    if isinstance(key, str) and not key.strip():
        raise InvalidLockKeyError(f"the key template of task {task_id!r} rendered to an empty name ({key!r})")
    if tenant is not None and isinstance(tenant, str) and not tenant.strip():
        raise InvalidLockKeyError(f"the tenant of task {task_id!r} rendered to an empty value ({tenant!r})")
    if key is None:
        return LockKey.for_task(dag_id, task_id, None if tenant is None else str(tenant))
    if isinstance(key, str):
        return LockKey.for_task(dag_id, task_id, None if tenant is None else str(tenant), base=key)
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
) -> T:
    """Run ``work`` while holding the key of this task instance; map each outcome to Airflow's.

    :param key: the rendered ``key`` option (None: the DAG id and task id).
    :param tenant: the rendered tenant (or the ``tenant_arg`` value), or None.
    """
    identity = task_identity(context)
    guard: LockGuard | None = None
    try:
        lock_key = resolve_key(key, tenant, identity.dag_id, identity.task_id)
        guard = LockGuard(
            spec.hook(), lock_key, spec.policy, application_name=identity.application_name(), logger=logger
        )
        with guard as handle:
            return work(handle)
    except LockBusyError as busy:
        if spec.policy.on_busy == "fail":
            raise AirflowFailException(f"{busy} (on_busy='fail')") from busy
        raise AirflowSkipException(f"skipped: {busy}") from busy
    except LockLostError:
        raise
    except (InvalidLockKeyError, LockConfigurationError, UnsafeSetupError) as error:
        _skip_if_asked(spec, error, logger)
        raise AirflowFailException(f"{type(error).__name__}: {error}") from error
    except (PgLockError, psycopg.OperationalError) as error:
        if guard is None or guard.held is None:  # the lock could not be taken: the lock database is the problem
            _skip_if_asked(spec, error, logger)
        raise


def _skip_if_asked(spec: LockSpec, error: BaseException, logger: Any) -> None:
    if spec.policy.on_error == "skip":
        logger.warning(
            "pglock on_error='skip': skipping instead of failing because of %s: %s", type(error).__name__, error
        )
        raise AirflowSkipException(f"skipped because of an error (on_error='skip'): {error}") from error
