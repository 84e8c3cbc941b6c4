"""One lock over several tasks: ``with advisory_lock_scope("publish", key="openverse/audio"):``.

A task group whose tasks run as one hold of a named key, across deployments and DAGs. Built
on Airflow's setup / teardown tasks:

* ``pglock_scope_enter`` (a setup task) takes the scope before any task of the group starts:
  it holds the key, finds no other run's live scope row, writes its own (the scope lease,
  database clock) and releases the key. Busy: ``on_busy`` says skip (the group's tasks are
  skipped), fail or wait.
* every task of the group holds the key itself while it runs (its own connection, heartbeat
  and loss detection, as a guarded task) after checking that the row is still its run's, and
  renews the lease when it starts and when it ends;
* ``pglock_scope_exit`` (its teardown) frees the scope once every task of the group has
  ended, whatever their states.

Between tasks only the row keeps the scope: every guard of a named key in this provider
reads it under the key before its work and refuses while another run's scope is live. A run
whose deployment died frees the scope when its lease runs out. See docs/scopes.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from airflow_pglock.compat import (
    AIRFLOW_VERSION,
    HAS_LOCK_SCOPE,
    BaseOperator,
    Context,
    DownstreamTasksSkipped,
    MappedOperator,
    PythonOperator,
    TaskDeferred,
    TaskGroup,
    rendered_task,
    run_task_states,
    skipmixin_xcom,
)
from airflow_pglock.exceptions import AlreadyDoneError, LockBusyError, LockConfigurationError, LockLostError
from airflow_pglock.options import LockOptions, LockSpec
from airflow_pglock.policy import longest_wait_text, wait_timeout_problem
from airflow_pglock.scope_rules import DEFAULT_SCOPE_LEASE_SECONDS, ScopeKind, ScopeRole
from airflow_pglock.task_guard import (
    GUARD_ATTRIBUTE,
    RESUME_METHOD,
    fail_for_configuration,
    lock_spec_of,
    refuse_unholdable,
    render_lock_options,
    resolve_key,
    resume_deadline,
    run_guarded,
    run_label,
    stop_external_work,
    task_begins,
    task_identity,
    task_instance_digest,
    trigger_error,
    unholdable_endings_refused,
)

if TYPE_CHECKING:
    from airflow_pglock.handle import LockHandle

ENTER_TASK_ID = "pglock_scope_enter"
#: The setup's XCom with the scope's holder id and fencing token (pushed while it holds the key).
SCOPE_XCOM_KEY = "pglock_scope"
#: A task of the scope that succeeded pushes the scope's holder id under this key (its teardown
#: records a once_per / min_interval completion only when every task of the scope did).
SUCCEEDED_XCOM_KEY = "pglock_scope_succeeded"
EXIT_TASK_ID = "pglock_scope_exit"
#: How long a task of the scope (and its teardown) waits for the key, held a moment by another
#: guard that reads the scope row, before it fails: a longer holder ignores the scope.
DEFAULT_MEMBER_WAIT_SECONDS = 60.0
_SCOPE_ATTRIBUTE = "_pglock_scope"


@dataclass(frozen=True)
class ScopeSpec:
    """A lock scope's options, checked at parse time.

    :param key: the key option as written (a name, templated; required).
    :param tenant: the tenant option as written (templated), or None.
    :param enter: the setup's lock options (on_busy, wait_timeout, lease...).
    :param scope_lease: seconds the scope stays held after a task of it starts or ends.
    :param fencing: one fencing token per scope acquisition, the same for every task of it.
    :param member_wait: seconds a task of the scope or its teardown waits for the key.
    :param enter_task_id: the setup's task id (its XCom carries the scope's holder id).
    """

    key: str
    tenant: Any
    enter: LockSpec
    scope_lease: float
    fencing: bool
    member_wait: float
    enter_task_id: str

    @property
    def exit_task_id(self) -> str:
        """The teardown's task id (the setup's, in the same task group)."""
        return self.enter_task_id.removesuffix(ENTER_TASK_ID) + EXIT_TASK_ID

    @property
    def has_run_rules(self) -> bool:
        """once_per or min_interval: checked by the setup, recorded by the teardown."""
        return self.enter.templated.get("once_per") is not None or self.enter.min_interval is not None

    def member_spec(self, *, record_rules: bool = False) -> LockSpec:
        """The lock options of a task of the scope (and of its teardown): wait briefly, then fail.

        Neither ever turns an error into a skip (``on_error="fail"``, whatever the setup's): a
        task skipped after the scope's earlier tasks started external work would let the
        teardown free the scope while that work goes on, silently; a skipped teardown would
        leave the scope held until its lease ends.

        :param record_rules: keep once_per / min_interval (the teardown, when every task succeeded).
        """
        policy = dataclasses.replace(
            self.enter.policy,
            on_busy="wait",
            wait_timeout=self.member_wait,
            on_wait_timeout="fail",
            defer_after=0.0,
            on_error="fail",
        )
        if record_rules:
            return dataclasses.replace(self.enter, policy=policy)
        templated = {**self.enter.templated, "once_per": None}
        return dataclasses.replace(self.enter, policy=policy, min_interval=None, templated=templated)

    def role(self, kind: ScopeKind, context: Context) -> ScopeRole:
        """This task's role in the scope; a member and the teardown find the holder id in the setup's XCom."""
        identity = task_identity(context)
        run = run_label(identity)
        lineage = task_instance_digest(context) if kind == "enter" else None
        holder: str | None = (lineage or "") + uuid.uuid4().hex
        slot = None
        if kind != "enter":
            entered = context["ti"].xcom_pull(task_ids=self.enter_task_id, key=SCOPE_XCOM_KEY)
            holder = entered.get("holder") if isinstance(entered, dict) else None
            if not holder:
                raise LockConfigurationError(
                    f"task {identity.task_id!r} belongs to a lock scope whose setup ({self.enter_task_id}) did not "
                    "take it in this run (no holder id in its XCom)"
                )
            slot = _entered_slot(entered, self.enter.policy.slots)
        return ScopeRole(
            kind=kind,
            holder=holder,
            run=run,
            task=identity.task_id,
            lease=self.scope_lease,
            fencing=self.fencing,
            slot=slot,
            lineage=lineage,
        )


def _entered_slot(entered: dict[str, Any], slots: int) -> int | None:
    """The slot a scope over a pool took (its setup's XCom); None for a scope over one key."""
    slot = entered.get("slot")
    if slots == 1:
        if slot is not None:  # the setup took a slot of a pool: this key is not the one it holds
            raise LockConfigurationError(
                f"the lock scope's setup took slot {slot!r} of a pool, but the scope now says slots=1: was slots= "
                "changed while this run was in flight? Clear the whole scope (its setup too) to take it again"
            )
        return None
    if isinstance(slot, bool) or not isinstance(slot, int) or not 1 <= slot <= slots:
        raise LockConfigurationError(
            f"the lock scope's setup stored no slot of its pool of slots={slots} (got {slot!r}): was slots= changed "
            "while this run was in flight? Clear the whole scope (its setup too) to take it again"
        )
    return slot


#: The longest ``scope_lease``: how long a run that died can keep the key.
MAX_SCOPE_LEASE_SECONDS = 10 * 365.25 * 86400


def _seconds(value: Any, option: str) -> float:
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise LockConfigurationError(f"{option} must be a positive timedelta or number of seconds, got {value!r}")
    return float(value)


def _scope_spec(group_prefix: str, options: dict[str, Any]) -> ScopeSpec:
    if not HAS_LOCK_SCOPE:
        raise LockConfigurationError(
            f"advisory_lock_scope needs Airflow 3.0 or newer (this is {'.'.join(map(str, AIRFLOW_VERSION))}): a scope "
            "hands its holder id from its setup to its tasks and relies on Airflow 3's setup / teardown clearing"
        )
    scope_lease = _seconds(options.pop("scope_lease", DEFAULT_SCOPE_LEASE_SECONDS), "scope_lease")
    if scope_lease > MAX_SCOPE_LEASE_SECONDS:  # surely a mistake; and the database's timestamps end
        raise LockConfigurationError(
            f"scope_lease={scope_lease:g} s is too long: at most {MAX_SCOPE_LEASE_SECONDS:,.0f} s (10 years), how "
            "long a run that died keeps the key"
        )
    member_wait = _seconds(options.pop("member_wait", DEFAULT_MEMBER_WAIT_SECONDS), "member_wait")
    if wait_timeout_problem(member_wait) is not None:  # the tasks' wait: PostgreSQL's lock_timeout bounds it
        raise LockConfigurationError(f"member_wait={member_wait:g} s is too long: {longest_wait_text()}")
    fencing = options.pop("fencing", False)
    if not isinstance(fencing, bool):
        raise LockConfigurationError(f"fencing must be True or False, got {fencing!r}")
    for refused, why in (
        ("mode", "a scope holds session locks"),
        ("shared", "a scope is exclusive"),
        ("on_lost", "a task that loses the scope always fails"),
    ):
        if refused in options:
            raise LockConfigurationError(f"advisory_lock_scope() does not take {refused}= ({why})")
    if fencing and options.get("slots", 1) != 1:
        raise LockConfigurationError(
            f"advisory_lock_scope() cannot combine fencing=True with slots={options['slots']!r}: a fencing token "
            "orders the holders of one key, and the slots of a pool are held at once"
        )
    key = options.get("key")
    if not isinstance(key, str) or not key.strip():
        raise LockConfigurationError(
            f"advisory_lock_scope() needs key= a non-empty name (a Jinja template), got {key!r}"
        )
    enter = LockSpec.from_options(options, declaration=LockOptions, caller="advisory_lock_scope")
    return ScopeSpec(
        key=key,
        tenant=options.get("tenant"),
        enter=enter,
        scope_lease=scope_lease,
        fencing=fencing,
        member_wait=member_wait,
        enter_task_id=f"{group_prefix}{ENTER_TASK_ID}",
    )


def _run_scope_task(
    spec: ScopeSpec,
    kind: Literal["enter", "leave"],
    context: Context,
    deadline: float | None = None,
    members: tuple[str, ...] = (),
    failed_wait: str | None = None,
) -> dict[str, Any] | None:
    task = rendered_task(context)
    lock_spec = spec.enter if kind == "enter" else spec.member_spec()  # the teardown's errors never skip
    try:
        role = spec.role(kind, context)
        if kind == "leave":
            record, period = (False, None)
            if spec.has_run_rules:
                record, period = _completion_to_record(spec, members, role, context, task.log)
            lock_spec = spec.member_spec(record_rules=record)
        rendered = render_lock_options(lock_spec, context)
        if kind == "leave" and rendered.get("once_per") is not None:
            rendered["once_per"] = period  # the period the setup checked, not one rendered again now
    except LockConfigurationError as error:
        fail_for_configuration(lock_spec, error, task.log)

    held: list[str] = []  # the key the scope's row is of, as logs name it: with its tenant, a pool's slot

    def done(handle: LockHandle) -> dict[str, Any]:
        nonlocal role
        held.append(handle.key.describe())
        entered = {"holder": role.holder, "token": handle.fencing_token, "period": rendered.get("once_per")}
        if handle.slot is not None:  # a scope over a pool: the slot its tasks and teardown re-enter
            entered["slot"] = handle.slot
            role = dataclasses.replace(role, slot=handle.slot)
        if kind == "enter":  # stored while the key is held: a failure here frees the scope below
            context["ti"].xcom_push(key=SCOPE_XCOM_KEY, value=entered)
        return entered

    try:
        result = run_guarded(
            lock_spec, context, done, task.log, deadline=deadline, scope=role, trigger_error=failed_wait, **rendered
        )
    except BaseException as error:
        if kind == "enter" and not _refused(error):  # it may have taken the scope (a skip too: on_error="skip")
            _free_after_failed_setup(spec, role, context, rendered, task.log)
        raise
    described = held[-1] if held else rendered.get("key")
    if kind == "enter":
        task.log.info("pglock: took the lock scope of %s (holder %s)", described, role.holder)
        return result
    task.log.info("pglock: the lock scope of %s is no longer held by holder %s", described, role.holder)
    return None


def _refused(error: BaseException) -> bool:
    """The setup took nothing: it was busy, deferred, or found the period done (also as the skip
    or failure that says so: on_busy="skip" / "fail", on_wait_timeout, a wait the triggerer lost)."""
    seen: BaseException | None = error
    while seen is not None:  # on_error="skip" after a lost trigger wait: a skip, from the error, from busy
        if isinstance(seen, TaskDeferred | LockBusyError | AlreadyDoneError):
            return True
        seen = seen.__cause__
    return False


def scope_members(tasks: list[Any]) -> tuple[str, ...]:
    """The tasks whose success marker the teardown waits for: all but those Airflow 3 marks
    success without running them (an EmptyOperator with no callbacks, inlets or outlets)."""
    return tuple(task.task_id for task in tasks if not _never_runs(task))


def _never_runs(task: Any) -> bool:
    return bool(
        getattr(task, "inherits_from_empty_operator", False)
        and not getattr(task, "on_execute_callback", None)
        and not getattr(task, "on_success_callback", None)
        and not getattr(task, "outlets", None)
        and not getattr(task, "inlets", None)
    )


def _completion_to_record(
    spec: ScopeSpec, members: tuple[str, ...], role: ScopeRole, context: Context, logger: Any
) -> tuple[bool, Any]:
    """Whether the teardown records a completion, and the period its setup checked.

    Only when every task of the scope (but those that never run: EmptyOperator) pushed its
    success marker with this acquisition's holder id, and none of them is known to have failed
    after it. Anything unreadable records nothing: the teardown must still free the scope.
    """
    ti = context["ti"]
    try:
        entered = ti.xcom_pull(task_ids=spec.enter_task_id, key=SCOPE_XCOM_KEY)
        period = entered.get("period") if isinstance(entered, dict) else None
        missing = [
            task_id for task_id in members if ti.xcom_pull(task_ids=task_id, key=SUCCEEDED_XCOM_KEY) != role.holder
        ]
        missing += [task_id for task_id in _failed_tasks(context, members) if task_id not in missing]
    except Exception as error:  # e.g. the execution API unreachable: free the scope, record nothing
        logger.warning("pglock: no completion recorded for the lock scope: its tasks' outcomes unreadable: %s", error)
        return False, None
    if spec.enter.templated.get("once_per") is not None and period is None:
        logger.warning("pglock: no completion recorded for the lock scope: its setup's XCom holds no period")
        return False, None
    if missing:
        logger.info(
            "pglock: no completion recorded for the lock scope (once_per / min_interval): task(s) %s did not succeed",
            ", ".join(missing),
        )
    return not missing, period


def _failed_tasks(context: Context, members: tuple[str, ...]) -> list[str]:
    """Tasks of the scope whose state is not success although they pushed their marker (e.g. their
    return value could not be stored afterwards), where the Task SDK can tell."""
    states = run_task_states(context["ti"], list(members)) if members else None
    return [task_id for task_id, state in (states or {}).items() if task_id in members and state != "success"]


def _free_after_failed_setup(
    spec: ScopeSpec, role: ScopeRole, context: Context, rendered: dict[str, Any], logger: Any
) -> None:
    """The setup failed, perhaps after it took the scope (Airflow then skips the teardown): free what
    this setup may have taken, so the key is not held until the scope's lease ends. Best effort."""
    if spec.enter.policy.slots > 1 and role.slot is None:
        # It failed before it learnt its slot (its guard frees it under the lock, unless its session
        # was gone): find the slot whose row is this acquisition's, if any.
        try:
            role = dataclasses.replace(role, slot=_slot_of(spec, role, context, rendered))
        except Exception as error:
            logger.warning("pglock: could not find the slot of the lock scope after its setup failed: %s", error)
            return
        if role.slot is None:
            return
    leave = dataclasses.replace(role, kind="leave")
    freeing = {**rendered, "once_per": None}  # frees only: no task of the scope ran, so no period is done
    try:
        run_guarded(spec.member_spec(), context, lambda handle: None, logger, scope=leave, **freeing)
    except BaseException as error:  # the setup's own error is the one to report
        logger.warning("pglock: could not free the lock scope after its setup failed: %s", error)


def _slot_of(spec: ScopeSpec, role: ScopeRole, context: Context, rendered: dict[str, Any]) -> int | None:
    """The slot of the pool whose live row is ``role``'s acquisition (read without a lock: the
    row is this acquisition's until it is freed, and only under the slot's lock)."""
    from airflow_pglock.keys import slot_keys

    identity = task_identity(context)
    pool = resolve_key(rendered.get("key"), rendered.get("tenant"), identity.dag_id, identity.task_id)
    rows = spec.enter.hook().scopes(pool, slots=spec.enter.policy.slots)
    slots = slot_keys(pool, spec.enter.policy.slots)
    return next((slots.index(key) + 1 for key, row in rows.items() if row.holder == role.holder), None)


@dataclass(frozen=True)
class ScopeMemberGuard:
    """Replaces the ``execute`` of a task of the scope: hold the key, re-enter the scope, run."""

    spec: ScopeSpec

    def execute(self, context: Context, **kwargs: Any) -> Any:
        task = rendered_task(context)
        lock_spec = self.spec.member_spec()
        try:
            rendered = render_lock_options(lock_spec, context)
            role = self.spec.role("member", context)
        except LockConfigurationError as error:
            fail_for_configuration(lock_spec, error, task.log)

        # The task's own guard (another key) runs first in its execute, and may skip it as outside
        # the scope; a task without one runs its own code at once: a guard it calls is nested.
        begins = task_begins if lock_spec_of(task) is not None else contextlib.nullcontext

        def work(handle: LockHandle) -> Any:
            try:
                with begins(), unholdable_endings_refused(task, handle.key):
                    return type(task).execute(task, context, **kwargs)
            except TaskDeferred:  # deferrable without a `deferrable` flag (e.g. an operator that calls self.defer())
                stop_external_work(task, "it deferred")
                raise LockConfigurationError(
                    f"task {task.task_id!r} of the lock scope on {self.spec.key!r} deferred: a deferred task holds "
                    "no lock, and its resumed method would run outside the scope. Run it without deferring"
                ) from None

        succeeded_with: DownstreamTasksSkipped | None = None
        try:
            result = run_guarded(lock_spec, context, work, task.log, scope=role, **rendered)
        except LockLostError:
            stop_external_work(task, "the scope was lost")
            raise
        except DownstreamTasksSkipped as signal:  # a branch or short-circuit: the task succeeds
            succeeded_with = signal
        if self.spec.has_run_rules:  # the work ran under the key to its end: read by the teardown
            context["ti"].xcom_push(key=SUCCEEDED_XCOM_KEY, value=role.holder)
        if succeeded_with is not None:
            sparing = _sparing_the_teardown(succeeded_with, self.spec, task, context)
            if sparing is not None:
                raise sparing
        return result


def _sparing_the_teardown(
    signal: DownstreamTasksSkipped, spec: ScopeSpec, task: Any, context: Context
) -> DownstreamTasksSkipped | None:
    """A branch skips every direct downstream task it does not follow, a teardown too (only
    ShortCircuitOperator spares teardowns): one that is a last task of the scope would skip the
    teardown, which then never freed the scope (the key held until ``scope_lease``). The teardown
    leaves the tasks to skip, and joins what the branch's XCom says it followed (the scheduler
    skips a direct downstream task the XCom does not name). None: nothing else to skip."""
    teardown = spec.exit_task_id

    def task_id_of(entry: Any) -> str:
        return str(entry[0] if isinstance(entry, tuple) else entry)

    skipped = [entry for entry in signal.tasks if task_id_of(entry) != teardown]
    if len(skipped) == len(signal.tasks):
        return signal
    not_followed = {task_id_of(entry) for entry in skipped}
    key, followed = skipmixin_xcom()
    context["ti"].xcom_push(key=key, value={followed: sorted(set(task.downstream_task_ids) - not_followed)})
    return DownstreamTasksSkipped(tasks=skipped) if skipped else None


def _guard_member(task: Any, spec: ScopeSpec) -> None:
    closest = getattr(task, "get_closest_mapped_task_group", None)
    if isinstance(task, MappedOperator) or (closest is not None and closest() is not None):
        raise LockConfigurationError(
            f"task {task.task_id!r} of the lock scope on {spec.key!r} is mapped (.expand()): mapped instances run "
            "at once and cannot share one hold. Put the mapped task outside the scope, or loop inside one task"
        )
    if not isinstance(task, BaseOperator):
        raise LockConfigurationError(f"a lock scope holds operators, got {task!r}")
    if getattr(task, "deferrable", False) is True or getattr(task, "start_from_trigger", False) is True:
        raise LockConfigurationError(
            f"task {task.task_id!r} of the lock scope on {spec.key!r} is deferrable: a deferred task holds no lock. "
            "Create it with deferrable=False"
        )
    refuse_unholdable(task)
    if getattr(task, _SCOPE_ATTRIBUTE, None) is not None:
        raise LockConfigurationError(
            f"task {task.task_id!r} is in two lock scopes ({getattr(task, _SCOPE_ATTRIBUTE).key!r} and "
            f"{spec.key!r}): a scope inside a scope is refused; hold the second key with @task.advisory_lock "
            "on the tasks that need it"
        )
    inner = lock_spec_of(task)
    if getattr(task, GUARD_ATTRIBUTE, None) is not None or "execute" in vars(task):
        raise LockConfigurationError(
            f"task {task.task_id!r} of the lock scope on {spec.key!r} is already guarded (guarded()) or its execute "
            "was replaced: a task of a scope holds the scope's key; guard other keys with @task.advisory_lock"
        )
    if inner is not None and inner.templated.get("key") == spec.key and inner.templated.get("tenant") == spec.tenant:
        raise LockConfigurationError(
            f"task {task.task_id!r} is guarded by {spec.key!r} inside the lock scope on the same key: it would wait "
            "for its own scope. The scope already holds that key for it: drop the task's own guard"
        )
    if inner is not None and inner.policy.on_busy == "defer":
        raise LockConfigurationError(
            f"task {task.task_id!r} of the lock scope on {spec.key!r} has on_busy='defer': a deferred task holds "
            "no lock, and it would resume outside the scope. Use on_busy='wait' (or 'skip') inside a scope"
        )
    guard = ScopeMemberGuard(spec)
    setattr(task, _SCOPE_ATTRIBUTE, spec)
    task.execute = guard.execute


def _wire(tasks: list[Any], spec: ScopeSpec, *, task_group: Any = None, dag: Any = None) -> tuple[Any, Any]:
    """Guard ``tasks`` as the scope's tasks and add its setup and teardown around them."""
    for task in tasks:
        _guard_member(task, spec)
    where: dict[str, Any] = {"task_group": task_group} if task_group is not None else {"dag": dag}
    enter = PythonOperator(
        task_id=ENTER_TASK_ID,
        python_callable=lambda **context: _run_scope_task(spec, "enter", context),
        retries=0,
        **where,
    )
    members = scope_members(tasks)
    leave = PythonOperator(
        task_id=EXIT_TASK_ID,
        python_callable=lambda **context: _run_scope_task(spec, "leave", context, members=members),
        **where,
    )
    # on_busy="defer": the setup resumes here (a new try), as a guarded operator does.
    setattr(
        enter,
        RESUME_METHOD,
        lambda context, event=None, deadline=None: _run_scope_task(
            spec, "enter", context, deadline=resume_deadline(event, deadline), failed_wait=trigger_error(event)
        ),
    )
    enter.as_setup()
    leave.as_teardown(setups=enter)
    inside = {task.task_id for task in tasks}
    roots = [task for task in tasks if not (set(task.upstream_task_ids) & inside)]
    leaves = [task for task in tasks if not (set(task.downstream_task_ids) & inside)]
    for task in roots:
        enter >> task
    for task in leaves:
        task >> leave
    return enter, leave


@contextlib.contextmanager
def advisory_lock_scope(group_id: str, **options: Any) -> Iterator[Any]:
    """A task group whose tasks hold one lock over all of them (see the module's docstring).

    ``with advisory_lock_scope("publish", key="openverse/{{ params.media }}", on_busy="skip"): ...``

    :param group_id: the task group's id.
    :param options: ``key`` (required, a name; Jinja template), ``tenant``, ``postgres_conn_id``,
        ``on_busy`` (``skip``, ``fail``, ``wait``, ``defer``), ``wait_timeout``, ``on_wait_timeout``,
        ``defer_after``, ``on_error``, ``lease`` (a dead task's hold on the server), ``scope_lease``
        (seconds the scope stays held between its tasks, default 600), ``fencing``, ``once_per`` and
        ``min_interval`` (checked by the setup before it takes the scope; the completion recorded by
        the teardown when every task of the scope succeeded), ``member_wait`` (seconds a task of the
        scope waits for a key held a moment by another guard, default 60); any other keyword goes
        to the ``TaskGroup``.
    """
    lock_options = {name: options.pop(name) for name in list(options) if name in _SCOPE_OPTION_NAMES}
    with TaskGroup(group_id, **options) as group:
        spec = _scope_spec(group.child_id(""), lock_options)
        yield group
        _wire([task for task in group.iter_tasks()], spec, task_group=group)


def advisory_lock_dag_scope(dag: Any, **options: Any) -> tuple[Any, Any]:
    """Make the whole DAG run one lock scope: call it after every task of ``dag`` is defined.

    :param dag: the DAG.
    :param options: as :func:`advisory_lock_scope`.
    :returns: the scope's setup and teardown tasks.
    """
    unknown = set(options) - _SCOPE_OPTION_NAMES
    if unknown:
        raise LockConfigurationError(f"advisory_lock_dag_scope() got unexpected options {sorted(unknown)}")
    spec = _scope_spec("", dict(options))
    return _wire(list(dag.tasks), spec, dag=dag)


_SCOPE_OPTION_NAMES = frozenset(
    {
        "key",
        "tenant",
        "postgres_conn_id",
        "on_busy",
        "wait_timeout",
        "on_wait_timeout",
        "on_error",
        "lease",
        "scope_lease",
        "fencing",
        "member_wait",
        "mode",
        "shared",
        "slots",
        "once_per",
        "min_interval",
        "on_lost",
        "defer_after",
    }
)
