"""The lock options, declared once: name, type, default, templated or not, documentation.

``LockOptions`` (and ``FunctionLockOptions``, which adds ``tenant_arg``) is
the one declaration. Each option is a ``TypedDict`` key whose type is
``Annotated[<type>, Option(default, templated=...)]`` followed by its documentation. The
adapters are built from it: ``@task.advisory_lock``, ``@advisory_lock`` and
``guarded()`` take ``**options: Unpack[...]`` (typed: IDE completion and mypy see every
option), their template fields / run-time rendering come from ``TEMPLATED``, and
``LockSpec.from_options`` applies the defaults and checks every value when the DAG
is parsed. Adding an option means adding it here (and to the docs), nothing else.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypedDict

from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError, UnknownLockOptionError
from airflow_pglock.hooks import DEFAULT_CONN_ID
from airflow_pglock.keys import LockKey, slot_keys, tenant_text
from airflow_pglock.liveness import DEFAULT_LEASE_SECONDS, Liveness
from airflow_pglock.policy import DEFAULT_DEFER_AFTER_SECONDS, LockPolicy, OnBusy, OnError, OnLost, check_defer_after
from airflow_pglock.run_rules import RunRules, check_not_pooled, check_not_shared, check_not_warned, seconds
from airflow_pglock.server_rules import Scope

if TYPE_CHECKING:  # the hook (psycopg) loads when a task runs, not when a DAG file is parsed
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

KeySpec = str | int | tuple[int, int] | list[int] | LockKey | None
Seconds = float | dt.timedelta


@dataclass(frozen=True)
class Option:
    """How one lock option behaves (the ``Annotated`` metadata of its declaration).

    :param default: the value when the DAG author leaves the option out.
    :param templated: rendered with Jinja and the task context at run time.
    """

    default: Any
    templated: bool = False


class LockOptions(TypedDict, total=False):
    """The lock options of every guarded task (``guarded()`` takes exactly these)."""

    key: Annotated[KeySpec, Option(None, templated=True)]
    """The lock key (Jinja template): a name, an int64 or an (int32, int32) pair.
    Default: ``<dag_id>/<task_id>``."""
    tenant: Annotated[Any, Option(None, templated=True)]
    """A tenant appended to the key name (Jinja template): ``<key>/<tenant>``."""
    postgres_conn_id: Annotated[str, Option(DEFAULT_CONN_ID)]
    """The Airflow Postgres connection of the lock database (default ``postgres_default``)."""
    mode: Annotated[Scope, Option("session")]
    """``"session"`` (default) or ``"transaction"`` (the lock lives in an open transaction on
    the lock's own connection: PgBouncer transaction pooling)."""
    shared: Annotated[bool, Option(False)]
    """Take a shared lock instead of an exclusive one."""
    slots: Annotated[int, Option(1)]
    """The key names a pool of this many slots, shared by every deployment on the lock database:
    at most ``slots`` runs hold it at once (each holds any one free slot). 1 (default): a plain
    lock. Needs a key name; exclusive only; not with ``once_per``, ``min_interval`` or ``fencing``."""
    on_busy: Annotated[OnBusy, Option("skip")]
    """``"skip"`` (default), ``"fail"``, ``"wait"`` (hold a worker slot and wait) or ``"defer"`` (free the
    worker slot and wait in the triggerer; woken when the key is released): both need ``wait_timeout``."""
    wait_timeout: Annotated[Seconds | None, Option(None)]
    """Seconds (or timedelta) to wait with ``on_busy="wait"`` or ``"defer"`` (the whole wait). No default:
    required with those two (a wait is always bounded), refused with ``"skip"`` and ``"fail"``."""
    on_wait_timeout: Annotated[Literal["skip", "fail"], Option("skip")]
    """``"skip"`` (default) or ``"fail"`` when the key is still busy after ``wait_timeout``."""
    defer_after: Annotated[Seconds, Option(DEFAULT_DEFER_AFTER_SECONDS)]
    """With ``on_busy="defer"``: seconds (or timedelta) a busy try first waits on the worker (server-side,
    as ``"wait"``) before deferring (default 2; 0: defer at once). A key freed within it is taken at once;
    a longer wait frees the worker slot. Part of ``wait_timeout``; refused with other ``on_busy``."""
    on_lost: Annotated[OnLost, Option("fail")]
    """``"fail"`` (default) or ``"warn"`` when the lock is lost mid-run."""
    on_error: Annotated[OnError, Option("fail")]
    """``"fail"`` (default) or ``"skip"`` when the lock database cannot be used."""
    lease: Annotated[Seconds, Option(DEFAULT_LEASE_SECONDS)]
    """Seconds (or timedelta) a dead holder may keep the lock (default 30)."""
    once_per: Annotated[str | None, Option(None, templated=True)]
    """A period (Jinja template, e.g. ``"{{ ds }}"``): skip when this key already completed
    for it (recorded in the lock database; needs ``airflow-pglock init-db``)."""
    min_interval: Annotated[Seconds | None, Option(None)]
    """Seconds or timedelta: skip while the key's last completion is more recent, on the
    database clock (needs ``init-db``)."""
    fencing: Annotated[bool, Option(False)]
    """Give each acquisition a fencing token that only grows (``lock.fencing_token`` and the
    XCom ``pglock_fencing_token``; needs ``init-db``)."""


class FunctionLockOptions(LockOptions, total=False):
    """The lock options of a guarded Python function (the two decorators): all of
    :class:`LockOptions`, and ``tenant_arg``."""

    tenant_arg: Annotated[str | None, Option(None)]
    """Name of the function argument that holds the tenant (for mapped tasks)."""


@functools.cache
def declared(options: type) -> Mapping[str, Option]:
    """Option name -> :class:`Option`, in declaration order, of ``LockOptions`` or ``FunctionLockOptions``."""
    hints = typing.get_type_hints(options, include_extras=True)
    return {name: next(m for m in hint.__metadata__ if isinstance(m, Option)) for name, hint in hints.items()}


#: The options rendered with Jinja at run time (template fields of the decorated operator).
TEMPLATED: tuple[str, ...] = tuple(name for name, option in declared(FunctionLockOptions).items() if option.templated)


def signature_with_options(function: Callable[..., Any], declaration: type) -> inspect.Signature:
    """The signature of ``function(..., **kwargs)`` with each declared option as a keyword argument."""
    signature = inspect.signature(function)
    *named, var_keyword = signature.parameters.values()
    options = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option.default)
        for name, option in declared(declaration).items()
    ]
    return signature.replace(parameters=[*named, *options, var_keyword])


@dataclass(frozen=True)
class LockSpec:
    """The lock options of one guarded task, defaults applied and checked at parse time.

    :param postgres_conn_id: Airflow connection of the lock database.
    :param policy: mode, shared, on_busy, wait_timeout, on_lost, on_error.
    :param lease: seconds a dead holder may keep the lock on the server.
    :param tenant_arg: name of the function argument whose value is the tenant.
    :param min_interval: seconds; skip while the key's last completion is more recent.
    :param fencing: issue a fencing token per acquisition (handle and XCom).
    :param templated: the options rendered at run time (key, tenant, once_per), as written.
    """

    postgres_conn_id: str
    policy: LockPolicy
    lease: float
    tenant_arg: str | None = None
    min_interval: float | None = None
    fencing: bool = False
    templated: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, declaration: type, caller: str) -> LockSpec:
        """Apply the defaults of ``declaration`` to ``options`` and check every value.

        :param options: the options the DAG author gave.
        :param declaration: :class:`LockOptions` or :class:`FunctionLockOptions`.
        :param caller: the adapter's name, for the error on an unknown option.
        """
        known = declared(declaration)
        for name in options:
            if name not in known:
                raise UnknownLockOptionError(f"{caller}() got an unexpected keyword argument {name!r}")
        given = {name: options.get(name, option.default) for name, option in known.items()}
        postgres_conn_id, tenant_arg = given["postgres_conn_id"], given.get("tenant_arg")
        if not isinstance(postgres_conn_id, str) or not postgres_conn_id.strip():
            raise LockConfigurationError(f"postgres_conn_id must be a non-empty string, got {postgres_conn_id!r}")
        if tenant_arg is not None and (not isinstance(tenant_arg, str) or not tenant_arg.isidentifier()):
            raise LockConfigurationError(f"tenant_arg must be the name of a function argument, got {tenant_arg!r}")
        if tenant_arg == "lock":
            raise LockConfigurationError(
                "tenant_arg='lock' names the argument that receives the lock handle, not a tenant: name the "
                "function argument that holds the tenant"
            )
        wait_timeout, lease = given["wait_timeout"], given["lease"]
        if isinstance(wait_timeout, dt.timedelta):
            wait_timeout = wait_timeout.total_seconds()
        if isinstance(lease, dt.timedelta):
            lease = lease.total_seconds()
        defer_after = given["defer_after"]
        if isinstance(defer_after, dt.timedelta):
            defer_after = defer_after.total_seconds()
        check_defer_after(defer_after)
        policy = LockPolicy(
            mode=given["mode"],
            shared=given["shared"],
            on_busy=given["on_busy"],
            wait_timeout=wait_timeout,
            on_lost=given["on_lost"],
            on_error=given["on_error"],
            slots=given["slots"],
            on_wait_timeout=given["on_wait_timeout"],
            defer_after=float(defer_after) if given["on_busy"] == "defer" else 0.0,
        )
        if "defer_after" in options and policy.on_busy != "defer":
            raise LockConfigurationError(
                f"defer_after={options['defer_after']!r} only applies with on_busy='defer' (the wait on the worker "
                f"before deferring); on_busy is {policy.on_busy!r}"
            )
        try:
            Liveness(lease)
        except ValueError as error:
            raise LockConfigurationError(str(error)) from None
        if given["on_wait_timeout"] != "skip" and policy.on_busy not in ("wait", "defer"):
            raise LockConfigurationError("on_wait_timeout only applies with on_busy='wait' or on_busy='defer'")
        interval = seconds(given["min_interval"], "min_interval")
        check_key_spec(given["key"], given["tenant"])
        key = given["key"]
        if policy.slots > 1 and isinstance(key, int | tuple | list | LockKey):
            slot_keys(LockKey.coerce(tuple(key) if isinstance(key, list) else key), policy.slots)
        if policy.slots > 1 and isinstance(key, str) and not _is_template(key) and given["tenant"] is None:
            slot_keys(LockKey.from_name(key), policy.slots)  # a name that reads as another pool's slot
        check_once_per(given["once_per"])
        # checks min_interval and fencing now, when the DAG is parsed, and refuses them with a shared lock
        rules = RunRules(period=given["once_per"], min_interval=interval, fencing=given["fencing"])
        check_not_shared(rules, policy.shared)
        check_not_warned(rules, policy.on_lost)
        check_not_pooled(rules, policy.slots)
        return cls(
            postgres_conn_id=postgres_conn_id,
            policy=policy,
            lease=float(lease),
            tenant_arg=tenant_arg,
            min_interval=interval,
            fencing=given["fencing"],
            templated={name: _without_enum(name, given[name]) for name in TEMPLATED},
        )

    @property
    def on_wait_timeout(self) -> str:
        """``"skip"`` or ``"fail"`` when the key is still busy after ``wait_timeout`` (in the policy)."""
        return self.policy.on_wait_timeout

    def hook(self) -> AdvisoryLockHook:
        from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

        return AdvisoryLockHook(self.postgres_conn_id, liveness=Liveness(self.lease))


def check_key_spec(key: KeySpec, tenant: Any) -> None:
    """Parse-time check of the key options (templates are checked when rendered)."""
    if tenant is not None and not isinstance(tenant, str):
        tenant_text(tenant)  # a dict or an object has no stable text form
    if isinstance(tenant, str) and not tenant.strip():
        raise LockConfigurationError(
            f"tenant={tenant!r} is empty: give the tenant's name or id (or a template), or leave tenant out"
        )
    for text in (key, tenant):
        if isinstance(text, str) and not _is_template(text):
            # non-empty UTF-8 text without NUL within the name length (the whole name is checked when built)
            LockKey.from_name(text)
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


def _without_enum(option: str, value: Any) -> Any:
    """An enum member as its value's plain form: a template field renders a str-mixin member by its
    *name* (Jinja spells it with ``str()``), and ``str()`` of an ``IntEnum`` differs between Pythons."""
    if not isinstance(value, enum.Enum):
        return value
    if option == "tenant":
        return tenant_text(value)
    if isinstance(value, str):
        return str.__str__(value)
    return int(value) if isinstance(value, int) else value


def _is_template(text: str) -> bool:
    return any(marker in text for marker in ("{{", "{%", "{#"))


def check_once_per(once_per: Any) -> None:
    """Parse-time check of the ``once_per`` option (a template is checked when rendered)."""
    if once_per is not None and (not isinstance(once_per, str) or not once_per.strip()):
        raise LockConfigurationError(
            f"once_per must be a non-empty period or template, e.g. '{{{{ ds }}}}'; got {once_per!r}"
        )
