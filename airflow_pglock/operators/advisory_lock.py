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

import contextlib
import dataclasses
import datetime as dt
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from airflow_pglock.compat import (
    AIRFLOW_VERSION,
    HAS_LOCK_SCOPE,
    KILLS_CLEARED_TRIGGERS,
    TRIGGER_FAILED,
    AirflowTaskTimeout,
    BaseOperator,
    Context,
    MappedOperator,
    TaskDeferred,
    is_deferral_timeout,
    rendered_task,
)
from airflow_pglock.exceptions import LockConfigurationError, LockLostError
from airflow_pglock.options import LockOptions, LockSpec
from airflow_pglock.scope_rules import DEFAULT_SCOPE_LEASE_SECONDS, OUTSIDE, HandOver, ScopeRole
from airflow_pglock.task_guard import (
    GUARD_ATTRIBUTE,
    RESUME_METHOD,
    fail_for_configuration,
    refuse_unholdable,
    render_lock_options,
    resume_deadline,
    run_guarded,
    run_label,
    stop_external_work,
    task_identity,
    task_instance_digest,
    trigger_error,
    unholdable_endings_refused,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from airflow_pglock.handle import LockHandle

OperatorT = TypeVar("OperatorT", bound=BaseOperator)

#: The method a guarded operator resumes with after its own deferral (the hold went to the triggerer).
DEFERRED_RESUME_METHOD = "pglock_resume_deferred"
#: The deferral's kwarg that carries the hold to the resumed task.
DEFERRAL_KWARG = "pglock_deferral"
#: Seconds the resumed task waits for its key (held a moment by another guard reading the row).
RESUME_WAIT_SECONDS = 60.0
#: The shortest ``deferral_lease``: a hand-over takes seconds (the scheduler, the triggerer's loop).
MIN_DEFERRAL_LEASE = 30.0


@dataclass(frozen=True)
class OperatorGuard:
    """The lock options of one guarded operator; its :meth:`execute` replaces the operator's.

    :param spec: the lock options, checked (templated ones rendered at run time).
    :param deferral_lease: seconds the hold of a deferred operator outlives the last process
        that held it (the hand-overs between a worker and the triggerer, a triggerer's restart);
        None: the operator may not defer while guarded (see :func:`deferral_refused`).
    """

    spec: LockSpec
    deferral_lease: float | None = None

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
        return self._execute(context, {}, deadline=resume_deadline(event, deadline), failed_wait=trigger_error(event))

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        """Where the task runner resumes the operator (replaces ``operator.resume_execution``): the
        resume of an ``on_busy="defer"`` wait maps its outcome as the first try did (a sensor's own
        ``resume_execution`` would turn every error into a skip under ``soft_fail``); any other
        resume is the operator's own.
        """
        if next_method == RESUME_METHOD:
            return self.resume(context, **(next_kwargs or {}))
        task = rendered_task(context)
        if next_method != TRIGGER_FAILED:
            return type(task).resume_execution(task, next_method, next_kwargs, context)
        # Airflow's own: a trigger failed (it raised, or the triggerer could not build it) or
        # Airflow's deferral timeout. A hold this task handed over is re-entered and freed, the
        # external work stopped; and an error is no skip, whatever a sensor's soft_fail says.
        error = str((next_kwargs or {}).get("error") or "unknown")
        if self.deferral_lease is not None and (deferral := self._handed_over_hold(context, task)) is not None:
            from airflow_pglock.triggers.guarded import ERROR

            event = {"pglock": ERROR, "error": f"Airflow resumed the task with {TRIGGER_FAILED} ({error})"}
            return self.resume_deferred(context, event, **{DEFERRAL_KWARG: deferral})
        try:
            return BaseOperator.resume_execution(task, next_method, next_kwargs, context)
        except Exception as failed:
            if not is_deferral_timeout(failed):
                raise
        return type(task).resume_execution(task, next_method, next_kwargs, context)  # its own timeout, as unguarded

    def _handed_over_hold(self, context: Context, task: BaseOperator) -> dict[str, Any] | None:
        """The hold this task instance handed to the triggerer, if its row is still live."""
        from airflow_pglock.task_guard import resolve_key

        identity = task_identity(context)
        try:
            rendered = render_lock_options(self.spec, context)
            key = resolve_key(rendered["key"], rendered.get("tenant"), identity.dag_id, identity.task_id)
            row = self.spec.hook().scope(key) if key.name is not None else None
        except Exception as error:  # the failure Airflow resumed with is the error to report
            task.log.warning("pglock: could not look for the hold of task %s: %s", task.task_id, error)
            return None
        holder = _holder_of(context)
        if row is None or row.holder != holder:
            return None
        return {"holder": holder, "key_name": key.name, "method": TRIGGER_FAILED, "lease": self.deferral_lease}

    def _earlier_try_still_holds(self, context: Context, rendered: dict[str, Any], holder: str) -> bool:
        """Whether a live hold row of this task instance is there (read without the key): an earlier
        try's, left in the triggerer. Any error: False (the guard meets it itself)."""
        from airflow_pglock.task_guard import resolve_key

        identity = task_identity(context)
        try:
            key = resolve_key(rendered["key"], rendered.get("tenant"), identity.dag_id, identity.task_id)
            row = self.spec.hook().scope(key) if key.name is not None else None
        except Exception:
            return False
        return row is not None and row.live and row.holder == holder

    def resume_deferred(self, context: Context, event: Any = None, **kwargs: Any) -> Any:
        """Resume after the operator's own deferral (``pglock_resume_deferred``): re-enter the hold
        the triggerer handed back, then run the operator's resume method under it.

        Whatever keeps the task from re-entering its hold (lost while deferred, the key busy, the
        lock database unreachable, the operator's trigger failed) calls the operator's ``on_kill()``
        and raises :class:`~airflow_pglock.exceptions.LockLostError`: never a skip, also for a sensor
        with ``soft_fail`` (its external work ran).

        :param context: the task context.
        :param event: the :class:`~airflow_pglock.triggers.guarded.GuardedTrigger`'s event.
        :param kwargs: ``pglock_deferral``: the hold and the operator's own resume method and kwargs.
        """
        from airflow_pglock.triggers.guarded import ERROR, HELD

        task = rendered_task(context)
        payload = event if isinstance(event, Mapping) else {}
        deferral = kwargs.get(DEFERRAL_KWARG) or payload.get("resume")
        if not isinstance(deferral, Mapping) or not deferral.get("holder") or not deferral.get("method"):
            _lost(task, "?", f"the task resumed without its hold ({DEFERRAL_KWARG}={deferral!r}, event {event!r})")
        assert isinstance(deferral, Mapping)
        key = str(deferral.get("key_name") or "")
        status = payload.get("pglock")
        if status not in (HELD, ERROR) or not key:
            _lost(task, key or "?", str(payload.get("reason") or f"the trigger's event carried no hold ({event!r})"))
        role = ScopeRole(
            kind="resume",
            holder=str(deferral["holder"]),
            run=run_label(task_identity(context)),
            task=task.task_id,
            lease=float(deferral.get("lease") or DEFAULT_SCOPE_LEASE_SECONDS),
            hands_over=True,
        )
        policy = dataclasses.replace(
            _failing(self.spec),
            on_busy="wait",
            wait_timeout=RESUME_WAIT_SECONDS,
            on_wait_timeout="fail",
            defer_after=0.0,
            on_lost="fail",
        )
        # The key as the deferral held it (not rendered again); the fencing token is the hold's, in its row.
        spec = dataclasses.replace(self.spec, policy=policy, fencing=False)
        stage: list[str] = []
        method, method_kwargs = str(deferral["method"]), dict(deferral.get("kwargs") or {})

        def work(handle: LockHandle) -> Any:
            if status == ERROR:  # re-entered only to free the hold (the guard's end frees its row)
                raise _TriggerFailedError(str(payload.get("error") or "the operator's trigger failed"))
            stage.append("started")
            arguments = {**method_kwargs, "event": payload.get("event")}
            result = self._run_deferrable(task, lambda: _call(task, method, context, arguments), handle)
            if isinstance(result, HandOver):
                stage.append("handing over")
            return result

        try:
            result = run_guarded(spec, context, work, task.log, scope=role, key=key, tenant=None)
        except LockLostError:
            stop_external_work(task)
            raise
        except _TriggerFailedError as failed:
            stop_external_work(task)
            raise LockLostError(
                f"the trigger of task {task.task_id!r} failed while it held {key!r}: {failed}", None, str(failed)
            ) from None
        except BaseException as error:
            if stage == ["started"]:
                raise  # the operator's own resume method failed: its own outcome, as unguarded
            _lost(task, key, f"the task could not re-enter its hold ({type(error).__name__}: {error})", error)
        return self._defer_again_or_return(task, context, {"key": key, "tenant": None}, role, result)

    def _execute(
        self, context: Context, kwargs: dict[str, Any], deadline: float | None, failed_wait: str | None = None
    ) -> Any:
        task = rendered_task(context)  # the copy the task runner executes, template fields rendered
        try:
            rendered = render_lock_options(self.spec, context)
        except LockConfigurationError as error:
            fail_for_configuration(self.spec, error, task.log)
        role, spec = OUTSIDE, self.spec
        if self.deferral_lease is not None:
            role = ScopeRole(
                holder=_holder_of(context),
                run=run_label(task_identity(context)),
                task=task.task_id,
                lease=self.deferral_lease,
                hands_over=True,
            )
            if KILLS_CLEARED_TRIGGERS and self._earlier_try_still_holds(context, rendered, role.holder or ""):
                # Cleared while deferred: its earlier try's trigger holds the key until the triggerer
                # cancels it, a moment later, and calls its on_kill() before it lets the key go (the
                # external job stops first). Not a busy key to skip: wait for it, as a resume does.
                # (Before Airflow 3.3 nothing calls on_kill() there: the earlier job would go on.)
                task.log.info("pglock: the earlier try of this task still holds its key in the triggerer: waiting")
                asked = self.spec.policy
                policy = dataclasses.replace(
                    asked,
                    on_busy="wait",
                    wait_timeout=max(RESUME_WAIT_SECONDS, asked.wait_timeout or 0.0)
                    if asked.on_busy == "wait"
                    else RESUME_WAIT_SECONDS,  # a deferring task's long wait would hold a worker slot
                    on_wait_timeout="fail",
                    defer_after=0.0,
                )
                spec, deadline = dataclasses.replace(self.spec, policy=policy), None
        handing: list[bool] = []

        def work(handle: LockHandle) -> Any:
            result = self._run_deferrable(task, lambda: type(task).execute(task, context, **kwargs), handle)
            if isinstance(result, HandOver):
                handing.append(True)
            return result

        try:
            result = run_guarded(
                spec, context, work, task.log, deadline=deadline, scope=role, trigger_error=failed_wait, **rendered
            )
        except LockLostError:
            stop_external_work(task)
            raise
        except BaseException as error:
            if handing:  # the hand-over failed: nothing holds the key while the external work goes on
                _lost(task, str(rendered.get("key")), f"the hold could not pass to the triggerer: {error}", error)
            raise
        return self._defer_again_or_return(task, context, rendered, role, result)

    def _run_deferrable(self, task: BaseOperator, call: Any, handle: LockHandle | None = None) -> Any:
        try:
            with stopped_under_the_key(task, handle), unholdable_endings_refused(task, handle.key if handle else None):
                return call()
        except TaskDeferred as deferral:
            if self.deferral_lease is None:
                # The lock lives on this worker's connection; a deferred task has no worker.
                stop_external_work(task)
                raise LockConfigurationError(deferral_refused(task, handle, _why_no_hand_over(self.spec))) from None
            return HandOver(deferral)

    def _defer_again_or_return(
        self, task: BaseOperator, context: Context, rendered: dict[str, Any], role: ScopeRole, result: Any
    ) -> Any:
        """The guard ended: the operator's result, or its deferral, raised again around its hold."""
        if not isinstance(result, HandOver):
            return result
        from airflow_pglock.task_guard import resolve_key
        from airflow_pglock.triggers.advisory_lock import worker_resume_hold
        from airflow_pglock.triggers.guarded import GuardedTrigger

        deferral = result.deferral
        identity = task_identity(context)
        key = resolve_key(rendered["key"], rendered.get("tenant"), identity.dag_id, identity.task_id)
        trigger_classpath, trigger_kwargs = deferral.trigger.serialize()
        assert key.name is not None and role.holder is not None
        resume = {
            "holder": role.holder,
            "lease": role.lease,
            "key": key.describe(),
            "key_name": key.name,
            "method": deferral.method_name,
            "kwargs": deferral.kwargs or {},
        }
        trigger = GuardedTrigger(
            trigger_classpath=trigger_classpath,
            trigger_kwargs=trigger_kwargs,
            key_name=key.name,
            key_numbers=list(key.numbers),
            postgres_conn_id=self.spec.postgres_conn_id,
            holder=role.holder,
            task=f"{identity.dag_id}.{identity.task_id} {identity.run_id}",
            lease=role.lease,
            deferred_at=time.time(),
            resume=resume,
            resume_hold=worker_resume_hold(),
        )
        task.log.info(
            "pglock: %s deferred to %s; the triggerer holds %s until it fires (lease %g s)",
            task.task_id,
            trigger_classpath,
            key.describe(),
            role.lease,
        )
        kwargs = {DEFERRAL_KWARG: resume}
        raise TaskDeferred(trigger=trigger, method_name=DEFERRED_RESUME_METHOD, kwargs=kwargs, timeout=deferral.timeout)


#: The ends that come to the operator from outside while it runs under the key: Airflow's
#: execution timeout, and the signals Python turns into exceptions (SIGINT; a SIGTERM handler
#: that exits). Airflow calls ``on_kill()`` after a timeout only once the exception has left the
#: guard, that is after the release: the external job would run on with the key free.
INTERRUPTIONS: tuple[type[BaseException], ...] = (AirflowTaskTimeout, KeyboardInterrupt, SystemExit)


@contextlib.contextmanager
def stopped_under_the_key(task: BaseOperator, handle: LockHandle | None) -> Iterator[None]:
    """Around an operator's own method under a guard: interrupted (:data:`INTERRUPTIONS`), call its
    ``on_kill()`` while the key is still held, so that its external job (a pod, a remote run, a
    child process) is stopped before another holder can start; then let the interruption go on.
    Airflow's own ``on_kill()`` call after a timeout is then skipped once (the job is stopped)."""
    _OnKillDone.forget(task)  # an earlier execution's, never Airflow's call after this one
    try:
        yield
    except INTERRUPTIONS as interrupted:
        if isinstance(interrupted, SystemExit) and interrupted.code in (0, None):
            raise  # a clean exit (Airflow 2 counts it a success): nothing to stop
        why = f"{type(interrupted).__name__} ({interrupted})" if str(interrupted) else type(interrupted).__name__
        held = handle.key.describe() if handle is not None else "its key"
        task.log.warning(
            "pglock: %s interrupted task %s: its on_kill() runs while it still holds %s", why, task.task_id, held
        )
        stop_external_work(task, why)
        setattr(task, "on_kill", _OnKillDone(task, why))  # noqa: B010 (mypy: a method cannot be assigned)
        raise


class _OnKillDone:
    """Stands in for the operator's ``on_kill()`` once the guard called it under the key: the next
    call (Airflow's, after its timeout) is skipped, and the operator's own method is back after it."""

    def __init__(self, task: BaseOperator, why: str) -> None:
        self.task = task
        self.why = why
        self.own = vars(task).get("on_kill")  # an on_kill set on the instance itself, if any

    def __call__(self) -> None:
        self.restore()
        self.task.log.info(
            "pglock: on_kill() of task %s ran already, under its key, after %s", self.task.task_id, self.why
        )

    def restore(self) -> None:
        if vars(self.task).get("on_kill") is not self:
            return
        if self.own is None:
            delattr(self.task, "on_kill")
        else:
            setattr(self.task, "on_kill", self.own)  # noqa: B010

    @staticmethod
    def forget(task: BaseOperator) -> None:
        done = vars(task).get("on_kill")
        if isinstance(done, _OnKillDone):
            done.restore()


def deferral_refused(task: BaseOperator, handle: LockHandle | None, why: str | None) -> str:
    held = f" by {handle.key.describe()}" if handle is not None else ""
    return (
        f"task {task.task_id!r} tried to defer while guarded{held}, and its hold cannot pass to the triggerer: "
        f"{why}. Run the operator with deferrable=False, or change those options"
    )


class _TriggerFailedError(Exception):
    """The operator's trigger raised in the triggerer: the resumed task frees its hold, then fails."""


def _lost(task: BaseOperator, key: str, reason: str, cause: BaseException | None = None) -> NoReturn:
    """The hold is gone (or cannot be re-entered): stop the external work, fail as lost."""
    stop_external_work(task)
    message = f"lost the hold of {key} of task {task.task_id!r} across its deferral: {reason}"
    raise LockLostError(message, None, reason) from cause


def _holder_of(context: Context) -> str:
    """The hold's id: :func:`~airflow_pglock.task_guard.task_instance_digest` (a retry, or the task
    cleared while deferred, takes over the row an earlier try left: a deferral timeout, a trigger
    cancelled); random when the run's start is unknown."""
    return task_instance_digest(context) or uuid.uuid4().hex


def _failing(spec: LockSpec) -> Any:
    """A resumed task never turns an error into a skip: its external work ran."""
    return dataclasses.replace(spec.policy, on_error="fail")


def _call(task: BaseOperator, method: str, context: Context, kwargs: dict[str, Any]) -> Any:
    """The operator's own method (its class's: ``execute`` on the instance is the guard's)."""
    function = getattr(type(task), method, None)
    if function is None:
        raise LockConfigurationError(f"task {task.task_id!r} has no method {method!r} to resume with")
    return function(task, context, **kwargs)


def guarded(
    operator: OperatorT, *, deferral_lease: float | dt.timedelta | None = None, **options: Unpack[LockOptions]
) -> OperatorT:
    """Run ``operator`` only while it holds its advisory lock; returns the same operator.

    ``guarded(BashOperator(task_id="vacuum", bash_command="..."), key="maintenance")``.
    Options (:class:`~airflow_pglock.options.LockOptions`), outcome lines and Airflow
    outcomes are those of ``@task.advisory_lock``: busy -> skipped (``on_busy``), lock
    database error -> failed (``on_error``), lock lost mid-run -> the operator's
    ``on_kill()`` is called and the task fails (``on_lost``). An execution timeout (or
    Ctrl-C) calls ``on_kill()`` while the key is still held, before the release (Airflow's own
    call after the timeout comes after it: :func:`stopped_under_the_key`). ``key``, ``tenant``
    and ``once_per`` are Jinja templates rendered at run time.

    A deferrable operator (Airflow 3) keeps its hold while it is deferred: the triggerer holds
    the key while the operator's trigger waits, and the task re-enters the hold before its
    resume method runs (docs/deferrable-operators.md). A hold lost meanwhile calls ``on_kill()``
    and fails the task.

    :param operator: any BaseOperator (BashOperator, SQLExecuteQueryOperator, a deferrable operator...).
    :param deferral_lease: seconds (or a timedelta) the hold of a deferred operator outlives the
        last process that held it: the hand-overs between a worker and the triggerer, and a
        triggerer restarted mid-wait (default 600).
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
    refuse_unholdable(operator)
    for flag in ("start_from_trigger", "end_from_trigger"):
        if getattr(operator, flag, False) is True:
            raise LockConfigurationError(
                f"task {operator.task_id!r} has {flag}=True: it starts or ends in the triggerer, where no guarded "
                f"worker holds its key before or after. Create it with {flag}=False to guard it"
            )
    spec = LockSpec.from_options(options, declaration=LockOptions, caller="guarded")
    lease = _deferral_lease(operator, spec, deferral_lease)
    guard = OperatorGuard(spec=spec, deferral_lease=lease)
    setattr(operator, GUARD_ATTRIBUTE, guard)
    operator.execute = guard.execute  # type: ignore[method-assign]
    setattr(operator, RESUME_METHOD, guard.resume)  # where a task deferred by on_busy="defer" resumes
    setattr(operator, DEFERRED_RESUME_METHOD, guard.resume_deferred)  # where it resumes after its own deferral
    operator.resume_execution = guard.resume_execution  # type: ignore[method-assign]
    return operator


def _deferral_lease(operator: BaseOperator, spec: LockSpec, lease: Any) -> float | None:
    """The lease of the hold while the operator is deferred; None where the hold cannot pass to the
    triggerer (refused now when the operator says it is deferrable, else when it defers)."""
    if lease is None:
        lease = DEFAULT_SCOPE_LEASE_SECONDS
    elif isinstance(lease, dt.timedelta):
        lease = lease.total_seconds()
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not MIN_DEFERRAL_LEASE <= lease <= 86400:
        raise LockConfigurationError(
            f"deferral_lease must be a timedelta or a number of seconds from {MIN_DEFERRAL_LEASE:g} to 86400 (it "
            f"bridges the hand-overs between a worker and the triggerer, which take seconds), got {lease!r}"
        )
    why = _why_no_hand_over(spec)
    if why is None:
        return float(lease)
    if getattr(operator, "deferrable", False) is True:
        raise LockConfigurationError(
            f"task {operator.task_id!r} is deferrable, and its hold cannot pass to the triggerer: {why}. Create it "
            "with deferrable=False, or change those options"
        )
    return None


def _why_no_hand_over(spec: LockSpec) -> str | None:
    if not HAS_LOCK_SCOPE:
        return f"that needs Airflow 3.0 or newer (this is {'.'.join(map(str, AIRFLOW_VERSION))})"
    policy = spec.policy
    if policy.mode != "session" or policy.shared or policy.slots != 1:
        given = f"mode={policy.mode!r}, shared={policy.shared!r}, slots={policy.slots!r}"
        return f"it needs an exclusive session lock on one key ({given})"
    if spec.templated.get("once_per") is not None or spec.min_interval is not None:
        return "once_per and min_interval are not kept across a deferral"
    if policy.on_lost != "fail":
        return f"a hold lost while deferred always fails the task (on_lost={policy.on_lost!r})"
    key = spec.templated.get("key")
    if key is not None and not isinstance(key, str):
        return f"it needs a named key (a string), got {key!r}"
    return None
