"""The Airflow side of a guarded task, shared by every adapter (decorators, operator guard).

``LockSpec`` is what a DAG author wrote (checked when the DAG is parsed); ``run_guarded``
renders the key from the task context, runs the work under a :class:`LockGuard` and turns
its outcome into Airflow's: busy -> skipped (or failed), error -> failed (or skipped when
the author asked), lost -> failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import hashlib
import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

import jinja2

from airflow_pglock.compat import (
    AirflowFailException,
    AirflowRescheduleException,
    AirflowSkipException,
    DownstreamTasksSkipped,
    TaskAwaitingInput,
    TaskDeferred,
    deployment_name,
    get_current_context,
    get_stats,
    hands_off_to_task_runner,
    is_task_runner_handoff,
    parks_awaiting_input,
)
from airflow_pglock.exceptions import (
    AlreadyDoneError,
    InvalidLockKeyError,
    LockBusyError,
    LockConfigurationError,
    LockConnectionError,
    LockLostError,
    PgLockError,
    StandbyServerError,
    UnsafeSetupError,
)
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.keys import LockKey
from airflow_pglock.options import KeySpec, LockSpec, check_key_spec
from airflow_pglock.run_rules import RunRules
from airflow_pglock.scope_rules import OUTSIDE, ScopeRole

if TYPE_CHECKING:  # the guard and psycopg load when a task runs, not when a DAG file is parsed
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.handle import LockHandle
    from airflow_pglock.outcome import WorkEnding

T = TypeVar("T")

#: XCom key under which a guarded task publishes its fencing token (``fencing=True``).
FENCING_TOKEN_XCOM_KEY = "pglock_fencing_token"

#: A protected function that declares a parameter with this name receives the LockHandle.
LOCK_HANDLE_PARAM = "lock"

#: Seconds a task deferred by another run's lock scope waits at most before it tries again (the
#: triggerer watches the key, not the scope's row: a teardown that frees the scope early is seen then).
SCOPE_RECHECK_SECONDS = 30.0

#: The method a task deferred by ``on_busy="defer"`` resumes with (it tries the key again).
RESUME_METHOD = "pglock_resume"

#: Every guard around the work running in this context, outermost first: its held lock and, when
#: that is a slot of a pool, the pool's key (the name its slots are named after). The innermost
#: one's lock is the one :func:`hand_over_lock` passes on.
_HELD_AROUND: ContextVar[tuple[tuple[LockHandle, LockKey | None], ...]] = ContextVar("pglock_held_around", default=())
#: Whether guarded work has begun in this context: a guard called from it may not skip the task.
_IN_WORK: ContextVar[bool] = ContextVar("pglock_in_work", default=False)


#: Set on the skips a guard maps its own refusal to (busy, done, on_error='skip').
_GUARD_SKIP = "pglock_guard_refusal"
#: Set instead where such a skip is the task's own guard's, under another guard (task_begins).
_OWN_GUARD_SKIP = "pglock_own_guard_refusal"


def _guard_skip(message: str) -> AirflowSkipException:
    skip = AirflowSkipException(message)
    setattr(skip, _GUARD_SKIP, True)
    return skip


@contextlib.contextmanager
def task_begins() -> Iterator[None]:
    """The task's own code starts here, though a guard holds a key around it (a lock scope's
    task): the task's own guard, on another key, may still skip it."""
    begun = _IN_WORK.set(False)
    try:
        yield
    except AirflowSkipException as skip:  # the task's own guard skipped it: a skip of the task, as outside
        if getattr(skip, _GUARD_SKIP, False):
            setattr(skip, _GUARD_SKIP, False)
            setattr(skip, _OWN_GUARD_SKIP, True)
        raise
    finally:
        _IN_WORK.reset(begun)


def work_ending(error: BaseException) -> WorkEnding | None:
    """How the outcome line names an Airflow signal guarded work ended with that is no failure
    (see :class:`~airflow_pglock.guard.LockGuard`'s ``work_ending``); None: a failure."""
    from airflow_pglock.outcome import WorkEnding

    if isinstance(error, AirflowSkipException) and getattr(error, _OWN_GUARD_SKIP, False):
        return WorkEnding("skipped", f"the task's own guard skipped it: {error}", counted_as="skipped")
    if isinstance(error, AirflowSkipException) and not getattr(error, _GUARD_SKIP, False):
        return WorkEnding("skipped", f"the work skipped the task: {error}", counted_as="work_skipped")
    if isinstance(error, AirflowRescheduleException):
        return WorkEnding(
            "rescheduled", f"the work asked to be rescheduled at {error.reschedule_date}", counted_as="rescheduled"
        )
    return None


@dataclasses.dataclass(frozen=True)
class _SucceededWith:
    """Guarded work that succeeded by raising Airflow's signal (a branch or short-circuit skipping
    its downstream tasks): the guard ends it as completed, the signal is raised again after."""

    signal: BaseException


def awaiting_input_refused(task_id: str, key: LockKey | None) -> str:
    """Why a guarded task that parked awaiting human input fails."""
    held = f" while holding {key.describe()}" if key is not None else ""
    return (
        f"task {task_id!r} parked awaiting input (Human-in-the-loop, Airflow 3.3+){held}: no trigger carries a "
        "hold while it waits, and its resumed method would run without the lock. Guard the task that acts on the "
        "answer instead"
    )


def runner_handoff_refused(task_id: str) -> str:
    """Why a guarded TriggerDagRunOperator is refused on Airflow 3."""
    return (
        f"task {task_id!r} is a TriggerDagRunOperator: on Airflow 3 the task runner triggers its DAG run (and "
        "waits for it) after execute() returned, so no guard can hold a key around it. Guard the triggered "
        "DAG's own tasks instead, or wait for its run with a guarded deferrable sensor"
    )


def refuse_unholdable(task: Any) -> None:
    """When the DAG is parsed: refuse a task no guard can hold a key around (it parks awaiting
    input, or the task runner acts for it after ``execute`` returned)."""
    if hands_off_to_task_runner(task):
        raise LockConfigurationError(runner_handoff_refused(task.task_id))
    if parks_awaiting_input(task):
        raise LockConfigurationError(awaiting_input_refused(task.task_id, None))


@contextlib.contextmanager
def unholdable_endings_refused(task: Any, key: LockKey | None) -> Iterator[None]:
    """Around an operator's own ``execute`` under a guard: if it parks awaiting input, stop its
    work (``on_kill()``) and fail; if it asks the task runner to act after it (nothing has run yet:
    the task runner would do it after the guard released the key), fail."""
    try:
        yield
    except TaskAwaitingInput:
        stop_external_work(task, "it parked awaiting input")
        raise LockConfigurationError(awaiting_input_refused(task.task_id, key)) from None
    except Exception as error:
        if not is_task_runner_handoff(error):
            raise
        raise LockConfigurationError(runner_handoff_refused(task.task_id)) from None


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
    """The task instance of ``context``, and the deployment and host it runs on.

    The host is the one Airflow recorded for the task instance (``[core] hostname_callable``),
    else this machine's; the deployment is ``[pglock] deployment`` (see :func:`deployment_name`).
    """
    ti = context["ti"]
    hostname = getattr(ti, "hostname", None)
    return TaskIdentity(
        dag_id=ti.dag_id,
        task_id=ti.task_id,
        run_id=ti.run_id,
        map_index=getattr(ti, "map_index", -1) if getattr(ti, "map_index", -1) is not None else -1,
        deployment=deployment_name(),
        host=hostname if isinstance(hostname, str) and hostname else None,
    )


def task_instance_digest(context: Mapping[str, Any]) -> str | None:
    """32 hex digits, the same for every try of one task instance in one DAG run of one deployment,
    and others in any other deployment (its run started at another moment); None when the run's
    start is unknown. Not the run's ``clear_number``, which a clear raises: a cleared task must
    find what its earlier try left (a deferred hold, a scope's row) as its own."""
    identity = task_identity(context)
    started = getattr(context.get("dag_run"), "start_date", None)
    if not isinstance(started, dt.datetime):
        return None
    parts = [identity.dag_id, identity.task_id, identity.run_id, str(identity.map_index), started.isoformat()]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


def run_label(identity: TaskIdentity) -> str:
    """Who holds a lease row, for people: the deployment (else the host), the DAG and the run."""
    return f"{identity.deployment or identity.host or '?'}: {identity.dag_id} {identity.run_id}"


def run_guarded(
    spec: LockSpec,
    context: Mapping[str, Any],
    work: Callable[[LockHandle], T],
    logger: Any,
    *,
    key: KeySpec,
    tenant: Any,
    once_per: Any = None,
    deadline: float | None = None,
    scope: ScopeRole = OUTSIDE,
    trigger_error: str | None = None,
) -> T:
    """Run ``work`` while holding the key of this task instance; map each outcome to Airflow's.

    With ``on_busy="defer"`` a busy key defers the task to the triggerer until the key is
    released (``TaskDeferred``); the task resumes with :data:`RESUME_METHOD`, which calls
    this again with the same ``deadline``. At the deadline the last try skips (or fails:
    ``on_wait_timeout``).

    :param key: the rendered ``key`` option (None: the DAG id and task id).
    :param tenant: the rendered tenant (or the ``tenant_arg`` value), or None.
    :param once_per: the rendered ``once_per`` period, or None.
    :param deadline: ``on_busy="defer"``: UNIX time the whole wait ends (None: this is the first try).
    :param scope: how this task stands to a lock scope on its key (a scope's setup, task or teardown).
    :param trigger_error: ``on_busy="defer"``: the trigger ended the wait with an error (see
        :func:`trigger_error`); a key still busy then fails the task (retries apply) rather than
        defer again to a triggerer that cannot watch it, at once, over and over.
    """
    import psycopg

    from airflow_pglock.guard import LockGuard

    identity = task_identity(context)
    guard: LockGuard | None = None
    policy = spec.policy
    # Called by another guarded task's work (a function under @advisory_lock called from it):
    # part of that task has run, so nothing here may skip it; a refusal fails it instead.
    nested = _IN_WORK.get()

    def lock_taken() -> bool:
        """Whether this run took the lock (or is part of a guarded work that did): never a skip then."""
        return nested or (guard is not None and guard.took_the_lock)

    if policy.on_busy == "defer":
        deadline = time.time() + float(policy.wait_timeout or 0) if deadline is None else float(deadline)
        remaining = deadline - time.time()
        if remaining <= 0:  # the last try: busy now ends the wait
            policy = dataclasses.replace(
                policy, on_busy="fail" if spec.on_wait_timeout == "fail" else "skip", wait_timeout=None, defer_after=0
            )
        elif policy.defer_after >= remaining:  # the rest of the whole wait fits in the wait on the worker
            policy = dataclasses.replace(policy, on_busy="wait", wait_timeout=remaining, defer_after=0)
    # The trigger could not watch the key: a key still busy now ends the task with its error (or
    # on_error's skip) instead of deferring again, and the outcome line says so.
    failed_wait = trigger_error is not None and policy.on_busy == "defer"
    if failed_wait:
        ends: Literal["skip", "fail"] = "skip" if policy.on_error == "skip" else "fail"
        if policy.defer_after > 0:
            policy = dataclasses.replace(
                policy, on_busy="wait", wait_timeout=policy.defer_after, on_wait_timeout=ends, defer_after=0
            )
        else:
            policy = dataclasses.replace(policy, on_busy=ends, wait_timeout=None, defer_after=0)

    def work_with_token(handle: LockHandle) -> T:
        if handle.fencing_token is not None:
            context["ti"].xcom_push(key=FENCING_TOKEN_XCOM_KEY, value=handle.fencing_token)
        begun = _IN_WORK.set(True)
        around = _HELD_AROUND.set((*_HELD_AROUND.get(), (handle, lock_key if handle.slot is not None else None)))
        try:
            return work(handle)
        except AirflowSkipException as skip:
            if getattr(skip, _GUARD_SKIP, False):  # an inner guard's refusal, seen from another thread too
                cause = skip.__cause__
                if isinstance(cause, Exception):  # busy, done, an error: failures of this work (retries apply)
                    raise cause from None  # its own traceback shows the inner guard (the skip's cause is itself)
                raise AirflowFailException(f"a guard inside the guarded work refused: {skip}") from skip
            raise
        except DownstreamTasksSkipped as succeeded:  # the task runner marks the task a success
            return _SucceededWith(succeeded)  # type: ignore[return-value]
        except TaskAwaitingInput:
            raise LockConfigurationError(awaiting_input_refused(identity.task_id, handle.key)) from None
        except TaskDeferred:  # guarded() hands an operator's deferral over before this; nothing else can
            raise LockConfigurationError(
                f"the guarded work of task {identity.task_id!r} deferred (TaskDeferred) while holding "
                f"{handle.key.describe()}: a deferred task holds no lock, and its resumed method would run "
                "without it. Guard a deferrable operator with guarded(operator, deferral_lease=...), or do not defer"
            ) from None
        finally:
            _IN_WORK.reset(begun)
            _HELD_AROUND.reset(around)

    try:
        lock_key = resolve_key(key, tenant, identity.dag_id, identity.task_id)
        already = _held_around(lock_key, spec.policy.shared)
        if already is not None:
            # In a lock scope (a template the parse-time check could not read) its skip would end
            # the scope early; never a skip, never retried.
            raise AirflowFailException(
                f"the guard of task {identity.task_id!r} takes {lock_key.describe()}, {already}. Guard another "
                "key, or leave the key to the scope"
            )
        if isinstance(once_per, str) and not once_per.strip():
            raise LockConfigurationError(f"once_per of task {identity.task_id!r} rendered to an empty period")
        rules = RunRules(
            period=None if once_per is None else str(once_per),
            min_interval=spec.min_interval,
            fencing=spec.fencing,
        )
        guard = LockGuard(
            spec.hook().database,
            lock_key,
            policy,
            application_name=identity.application_name(),
            logger=logger,
            rules=rules,
            identity=identity,
            stats=get_stats,
            scope=scope,
            work_ending=work_ending,
            asked_on_busy=spec.policy.on_busy,
            busy_counted_as="failed" if failed_wait else None,
        )
        result = guard.run(work_with_token)  # the airtight form of `with guard as handle: work(handle)`
        if isinstance(result, _SucceededWith):
            raise result.signal
        return result
    except (AlreadyDoneError, LockBusyError) as refused:
        if guard is None or refused is not guard.refusal:
            raise  # raised by the work (e.g. an inner guard): a failure of this run, never a skip
        if nested:
            raise  # a failure of the guarded work that called this one (its guard's outcome says so)
        if isinstance(refused, AlreadyDoneError):
            raise _guard_skip(f"skipped: {refused}") from refused
        busy = refused
        if failed_wait:
            failed = LockConnectionError(f"{busy}; the wait for it in the triggerer failed: {trigger_error}")
            failed.__cause__ = busy
            _skip_if_asked(spec, failed, logger)  # the lock database's error, as any other (on_error)
            raise failed from busy
        if policy.on_busy == "defer" and deadline is not None:
            defer_until_released(spec, guard.key, busy, deadline, logger)
        if policy.on_busy == "fail":
            reason = "at the deadline, on_wait_timeout='fail'" if spec.policy.on_busy == "defer" else "on_busy='fail'"
            raise AirflowFailException(f"{busy} ({reason})") from busy
        if policy.on_busy == "wait" and spec.on_wait_timeout == "fail":
            raise AirflowFailException(f"{busy} after wait_timeout (on_wait_timeout='fail')") from busy
        raise _guard_skip(f"skipped: {busy}") from busy
    except LockLostError:
        raise
    except StandbyServerError as error:  # often a failover under way: retried, as a database that is down
        if not lock_taken():
            _skip_if_asked(spec, error, logger)
        raise
    except (InvalidLockKeyError, LockConfigurationError, UnsafeSetupError) as error:
        if lock_taken():  # after the lock was taken: never a skip
            raise AirflowFailException(f"{type(error).__name__}: {error}") from error
        fail_for_configuration(spec, error, logger)
    except (PgLockError, psycopg.OperationalError) as error:
        if not lock_taken():  # not taken: the database's fault
            _skip_if_asked(spec, error, logger)
        raise


def defer_until_released(spec: LockSpec, key: LockKey, busy: LockBusyError, deadline: float, logger: Any) -> NoReturn:
    """Defer the task to the triggerer until ``key`` is released (or the deadline); it resumes with a new try."""
    from airflow_pglock.triggers.advisory_lock import DEFAULT_POLL_INTERVAL, AdvisoryLockTrigger, worker_resume_hold

    logger.info(
        "pglock deferred: %s; waiting in the triggerer (no worker slot) until it is released, at most %.0f s more",
        busy,
        max(0.0, deadline - time.time()),
    )
    hold = worker_resume_hold()
    if busy.retry_after is not None:
        # Another run's lock scope, between its tasks: the key is free, its row holds it. The
        # trigger would fire at once; it fires no sooner than the lease's end, or a recheck.
        hold = max(hold, min(SCOPE_RECHECK_SECONDS, busy.retry_after))
    trigger = AdvisoryLockTrigger.for_key(
        key,
        postgres_conn_id=spec.postgres_conn_id,
        poll_interval=DEFAULT_POLL_INTERVAL,
        deadline=deadline,
        shared=spec.policy.shared,
        slots=spec.policy.slots,
        resume_hold=hold,
    )
    # What task.defer() raises. No Airflow deferral timeout: it would fail the task; the
    # trigger's deadline ends the wait instead.
    raise TaskDeferred(trigger=trigger, method_name=RESUME_METHOD, kwargs={"deadline": deadline})


def stop_external_work(task: Any, why: str = "the lock was lost") -> None:
    """Stop what the operator started (a subprocess, a query, a remote job), as on a timeout:
    its ``on_kill()``; an error there is logged (``why`` it is stopped is the error to report)."""
    try:
        task.on_kill()
    except Exception as error:  # the work may already have ended
        task.log.warning("pglock: on_kill() after %s raised %s: %s", why, type(error).__name__, error)


def trigger_error(event: Any) -> str | None:
    """The error an ``on_busy="defer"`` trigger ended its wait with (its event), else None."""
    from airflow_pglock.triggers.advisory_lock import ERROR

    if isinstance(event, Mapping) and event.get("status") == ERROR:
        return str(event.get("message") or event.get("error_type") or "an error")
    return None


def resume_deadline(event: Any, deadline: float | None) -> float | None:
    """The deadline a deferred task resumes with: its deferral kwargs, else the trigger's event;
    now at the latest when the trigger found it passed (the try is the last one, even where this
    worker's clock is behind the triggerer's: it would defer again, to a timeout at once, until
    its own clock caught up)."""
    from airflow_pglock.triggers.advisory_lock import TIMEOUT

    if deadline is None and isinstance(event, Mapping) and isinstance(event.get("deadline"), int | float):
        deadline = float(event["deadline"])
    if deadline is not None and isinstance(event, Mapping) and event.get("status") == TIMEOUT:
        return min(float(deadline), time.time())
    return deadline


def fail_for_configuration(spec: LockSpec, error: BaseException, logger: Any) -> NoReturn:
    """A setting to fix (bad key, connection, unsafe set-up): fail without retrying (or skip if asked)."""
    _skip_if_asked(spec, error, logger)
    raise AirflowFailException(f"{type(error).__name__}: {error}") from error


def _skip_if_asked(spec: LockSpec, error: BaseException, logger: Any) -> None:
    if spec.policy.on_error == "skip":
        logger.warning(
            "pglock on_error='skip': skipping instead of failing because of %s: %s", type(error).__name__, error
        )
        raise _guard_skip(f"skipped because of an error (on_error='skip'): {error}") from error


# ------------------------------------------------------------ guarded Python callables
# Shared by @task.advisory_lock and the composable @advisory_lock decorator.


def check_callable(python_callable: Callable[..., Any], spec: LockSpec) -> None:
    """Parse-time checks of a guarded function against its options (``tenant_arg``).

    :param python_callable: the function to guard.
    :param spec: its lock options.
    """
    tenant, tenant_arg = spec.templated["tenant"], spec.tenant_arg
    if tenant_arg is not None:
        parameters = inspect.signature(python_callable).parameters
        name = getattr(python_callable, "__name__", repr(python_callable))
        if tenant is not None:
            raise LockConfigurationError(f"give either tenant={tenant!r} or tenant_arg={tenant_arg!r}, not both")
        if tenant_arg not in parameters:
            raise LockConfigurationError(
                f"tenant_arg={tenant_arg!r} is not an argument of {name}(); its arguments are {list(parameters)}"
            )


def hand_over_lock(python_callable: Callable[..., T]) -> Callable[..., T]:
    """The one way a guarded function receives its lock: a parameter named ``lock``.

    Returns ``python_callable`` itself when it has no such parameter. Otherwise returns a
    wrapper whose signature lacks it (so the task flavour neither asks for it nor fills it
    in) and which passes the :class:`LockHandle` of the guard running it (set by
    :func:`run_guarded`). Passing ``lock`` yourself is refused.

    :param python_callable: the function to guard.
    """
    signature = inspect.signature(python_callable)
    if LOCK_HANDLE_PARAM not in signature.parameters:
        return python_callable
    name = getattr(python_callable, "__name__", repr(python_callable))

    @functools.wraps(python_callable)
    def with_lock(*args: Any, **kwargs: Any) -> T:
        refuse_lock_argument(name, kwargs)
        around = _HELD_AROUND.get()
        if not around:
            raise LockConfigurationError(f"{name}() takes the held lock but runs outside its lock guard")
        return python_callable(*args, **{**kwargs, LOCK_HANDLE_PARAM: around[-1][0]})

    with_lock.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for p in signature.parameters.values() if p.name != LOCK_HANDLE_PARAM]
    )
    return with_lock


def held_around() -> tuple[LockHandle, ...]:
    """The locks that the guards around the work running in this context hold (however far out, or
    the task's lock scope), innermost first; empty outside guarded work, and in a thread the work
    starts (a thread starts with an empty context). For a sensor, whose own task may hold the key it
    waits for."""
    return tuple(handle for handle, _ in reversed(_HELD_AROUND.get()))


def _held_around(key: LockKey, shared: bool) -> str | None:
    """Why a guard of ``key`` inside guarded work (or a lock scope's task) cannot run, or None: a
    guard around it, however far out, holds the very key (always busy), or a slot of the pool of
    that name (its own slot busy, the pool's name refused in another size: one rule for every
    slot). Two shared guards of one key are spared. Threads the work starts do not see the guards
    around it (a thread starts with an empty context)."""
    for enclosing, pool in reversed(_HELD_AROUND.get()):
        if enclosing.shared and shared:
            continue
        if pool is not None and key.numbers == pool.numbers:
            return (
                f"the name of the pool whose slot {enclosing.slot} its lock scope or an enclosing guard of the same "
                "task already holds: a guard inside may not take that pool's name again, in any size"
            )
        if key.numbers == enclosing.key.numbers:
            return (
                "which its lock scope or an enclosing guard of the same task already holds, so it would always find "
                "it busy"
            )
    return None


def refuse_lock_argument(name: str, kwargs: Mapping[str, Any]) -> None:
    """The ``lock`` argument is the guard's to fill: refuse a caller that passes it."""
    if LOCK_HANDLE_PARAM in kwargs:
        raise LockConfigurationError(
            f"{name}() argument {LOCK_HANDLE_PARAM!r} receives the held lock; do not pass it yourself"
        )


def tenant_from_arguments(
    python_callable: Callable[..., Any], tenant_arg: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """The value of argument ``tenant_arg`` in one call of ``python_callable``."""
    bound = inspect.signature(python_callable).bind_partial(*args, **kwargs)
    value = bound.arguments.get(tenant_arg)
    if value is None:
        raise LockConfigurationError(f"tenant_arg {tenant_arg!r} has no value in this task instance (got None)")
    return value


def render_lock_options(spec: LockSpec, context: Mapping[str, Any]) -> dict[str, Any]:
    """The templated options (key, tenant, once_per) rendered with the task's Jinja environment.

    Used where the options are not the operator's ``template_fields`` (guarded
    operators, the composable decorator). A string is rendered from the string, never
    loaded as a template file, whatever the operator's ``template_ext`` says.

    :param spec: the lock options; ``spec.templated`` holds them as the DAG author wrote them.
    :param context: the task's template context.
    """
    task = context["task"]
    rendered: dict[str, Any] = {}
    for option, value in spec.templated.items():
        if not isinstance(value, str):
            rendered[option] = value
            continue
        try:
            rendered[option] = task.get_template_env().from_string(value).render(context)
        except jinja2.TemplateError as error:
            raise LockConfigurationError(
                f"the {option} template {value!r} of task {task.task_id!r} cannot be rendered: "
                f"{type(error).__name__}: {error}"
            ) from None
    check_rendered(spec, rendered, task.task_id)
    return rendered


def check_rendered(spec: LockSpec, rendered: Mapping[str, Any], task_id: str) -> None:
    """Refuse an option the DAG author gave whose template rendered a None value: left out, the key
    would be the task's own (no exclusion across DAGs), the tenant dropped (every tenant one key: busy
    runs skip) or once_per off (the work runs again); as the text 'None' (Airflow's default
    templating), the key would be 'None' (shared by every DAG whose value is missing), every tenant
    'None', the period 'None' (done once, then skipped for ever)."""
    for option, written in spec.templated.items():
        refuse_rendered_none(option, written, rendered.get(option), task_id)


#: What each templated option should render to, for the message that refuses a None value.
_EXPECTED = {"key": "a key name", "tenant": "a tenant", "once_per": "a period"}


def refuse_rendered_none(option: str, written: Any, value: Any, task_id: str, *, optional: bool = True) -> None:
    """Refuse (LockConfigurationError, before any connection) the option ``written`` whose rendered
    ``value`` is None, or the text ``'None'`` of a template (``written`` contains ``{{``): a param,
    an XCom or a variable whose value is None, which Airflow's default templating writes as 'None'.
    A name 'None' written without a template is kept.

    :param option: the option's name, as the DAG author wrote it (``key``, ``tenant``, ``once_per``).
    :param written: the option as written (None: not given, nothing to check).
    :param value: the option as rendered.
    :param task_id: the task, for the message.
    :param optional: whether the option may be left out (the message's advice).
    """
    if written is None:
        return
    leave = f", or leave {option} out" if optional else ""
    if value is None:
        raise LockConfigurationError(
            f"the {option} template {written!r} of task {task_id!r} rendered to None (a native template, "
            f"render_template_as_native_obj=True, whose value is None?); give it a value{leave}"
        )
    if isinstance(written, str) and "{{" in written and isinstance(value, str) and value.strip() == "None":
        raise LockConfigurationError(
            f"the {option} template {written!r} of task {task_id!r} rendered to the text 'None' where "
            f"{_EXPECTED.get(option, 'a value')} was expected: the value it names is None (a param, XCom or "
            f"variable without a value), which Airflow's templating writes as 'None'; give it a value{leave}. "
            "(A key or tenant named 'None' is written without a template)"
        )


def guard_callable(python_callable: Callable[..., T], spec: LockSpec) -> Callable[..., T]:
    """Wrap a Python callable so that each call runs while holding its advisory lock.

    The wrapper finds its task instance with ``get_current_context()`` when called, so
    it composes with any in-process task flavour (``@task``, ``@task.branch``,
    ``@task.short_circuit``...). Key, tenant and outcomes are those of
    ``@task.advisory_lock``: both go through :func:`run_guarded`.

    :param python_callable: the function to guard.
    :param spec: the lock options (from :meth:`LockSpec.from_options`).
    """
    check_callable(python_callable, spec)
    function = hand_over_lock(python_callable)
    name = getattr(python_callable, "__name__", repr(python_callable))

    @functools.wraps(function)
    def guarded_call(*args: Any, **kwargs: Any) -> T:
        if function is not python_callable:
            refuse_lock_argument(name, kwargs)
        context = _current_context(name)
        task = context["task"]
        # The task's own function (under @task, or under another guard of the task: stacked) is
        # where the task begins; called from the task's guarded work, it is part of that work.
        begins = task_begins() if _is_the_tasks_function(task, guarded_call) else contextlib.nullcontext()
        with begins:
            try:
                rendered = render_lock_options(spec, context)
                if spec.tenant_arg is not None:
                    rendered["tenant"] = tenant_from_arguments(function, spec.tenant_arg, args, kwargs)
            except LockConfigurationError as error:
                if _IN_WORK.get():
                    raise AirflowFailException(f"{type(error).__name__}: {error}") from error
                fail_for_configuration(spec, error, task.log)
            return run_guarded(spec, context, lambda _: function(*args, **kwargs), task.log, **rendered)

    guarded_call.pglock_spec = spec  # type: ignore[attr-defined]  # lock_spec_of() finds it here
    return guarded_call


def _is_the_tasks_function(task: Any, function: Callable[..., Any]) -> bool:
    callable_: Any = getattr(task, "python_callable", None)
    while callable_ is not None:
        if callable_ is function:
            return True
        callable_ = getattr(callable_, "__wrapped__", None)
    return False


#: Attribute of a function guarded by ``@advisory_lock`` holding its :class:`LockSpec`.
SPEC_ATTRIBUTE = "pglock_spec"
#: Attribute of an operator guarded by ``guarded()`` holding its guard (which has the spec).
GUARD_ATTRIBUTE = "pglock_guard"


def lock_spec_of(task: Any) -> LockSpec | None:
    """The lock options of a parsed task: ``@task.advisory_lock``, ``guarded(operator)`` or a
    function under ``@advisory_lock``; None for a task airflow-pglock does not guard."""
    spec = getattr(task, "lock_spec", None)
    if isinstance(spec, LockSpec):
        return spec
    guard = getattr(task, GUARD_ATTRIBUTE, None)
    if isinstance(getattr(guard, "spec", None), LockSpec):
        return guard.spec  # type: ignore[union-attr,no-any-return]
    spec = getattr(getattr(task, "python_callable", None), SPEC_ATTRIBUTE, None)
    return spec if isinstance(spec, LockSpec) else None


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
