"""AdvisoryLockSensor: wait until an advisory lock key is free, without ever taking it.

A sensor that tried the lock to see whether it is free would, for that instant, hold it,
and a real contender trying at the same instant would skip. So this sensor only reads
``pg_locks`` (who holds the key, since when), in every mode: poke, reschedule, deferrable.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from airflow_pglock.compat import (
    AirflowFailException,
    AirflowSensorTimeout,
    AirflowSkipException,
    BaseSensorOperator,
    Context,
    conf,
    is_deferral_timeout,
)
from airflow_pglock.exceptions import (
    InvalidLockKeyError,
    LockConfigurationError,
    LockConnectionError,
    PgLockError,
    StandbyServerError,
    UnsafeSetupError,
)
from airflow_pglock.hooks import DEFAULT_CONN_ID
from airflow_pglock.keys import LockKey, slot_keys
from airflow_pglock.options import KeySpec, LockOptions, LockSpec, declared
from airflow_pglock.task_guard import held_around, refuse_rendered_none, resolve_key

if TYPE_CHECKING:  # the hook, psycopg and the trigger load when the sensor runs, not when a DAG is parsed
    from airflow_pglock.holder import LockHolder

#: The lock options a sensor takes; their declaration says which are templated and checks them.
SENSOR_OPTIONS = ("key", "tenant", "shared", "postgres_conn_id", "slots")

_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (LockConfigurationError, LockConnectionError, UnsafeSetupError, StandbyServerError, InvalidLockKeyError)
}


class AdvisoryLockSensor(BaseSensorOperator):
    """Succeed when no session holds ``key``; while it is held, log who holds it and for how long.

    The sensor never takes the key, not even for an instant (it reads ``pg_locks``), so it
    cannot make a task that wants the key skip. Modes: ``poke`` (default), ``reschedule``
    (frees the worker slot between checks) and ``deferrable=True`` (waits in the
    triggerer). ``soft_fail=True`` turns a timeout into a skip, in every mode; an error
    (unreachable database, missing connection, bad key) fails the task even then.

    :param key: the key to wait for (templated): a name, an int64 or an (int32, int32)
        pair. The key of a ``@task.advisory_lock`` task with the default key is
        ``"<dag_id>/<task_id>"``.
    :param tenant: a tenant appended to the key name (templated): ``<key>/<tenant>``.
    :param shared: wait only until no session holds the key *exclusively* (shared holders
        do not count): for a task that then takes the key with ``shared=True``.
    :param postgres_conn_id: the Airflow Postgres connection of the lock database.
    :param slots: the key names a pool of this many slots: succeed when at least one is free.
    :param deferrable: wait in the triggerer instead of a worker slot.
    """

    template_fields: Sequence[str] = tuple(name for name in SENSOR_OPTIONS if declared(LockOptions)[name].templated)
    template_fields_renderers = dict.fromkeys(template_fields, "py")
    ui_color = "#c6e0f5"

    def __init__(
        self,
        *,
        key: KeySpec,
        tenant: Any = None,
        shared: bool = False,
        postgres_conn_id: str = DEFAULT_CONN_ID,
        slots: int = 1,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if key is None:
            raise LockConfigurationError(
                f"AdvisoryLockSensor {self.task_id!r} needs key=: the key to wait for (a name, an int64 or an "
                "(int32, int32) pair); a @task.advisory_lock task with the default key uses '<dag_id>/<task_id>'"
            )
        options = {"key": key, "tenant": tenant, "shared": shared, "postgres_conn_id": postgres_conn_id, "slots": slots}
        LockSpec.from_options(options, declaration=LockOptions, caller=type(self).__name__)  # checks them
        self.key = key
        self.tenant = tenant
        #: key and tenant as written: Airflow renders the template fields in place
        self._written_key = key
        self._written_tenant = tenant
        self.shared = shared
        self.postgres_conn_id = postgres_conn_id
        self.slots = slots
        if not isinstance(deferrable, bool):
            raise LockConfigurationError(
                f"AdvisoryLockSensor {self.task_id!r}: deferrable must be True or False, got {deferrable!r}"
            )
        self.deferrable = deferrable
        if deferrable and not self.poke_interval > 0:  # the trigger re-reads the key every poke_interval
            raise LockConfigurationError(
                f"AdvisoryLockSensor {self.task_id!r} with deferrable=True needs poke_interval above 0 seconds "
                f"(the trigger reads the key again every poke_interval), got {self.poke_interval!r}"
            )
        self._lock_key: LockKey | None = None
        self._last_holders: str | None = None

    # ------------------------------------------------------------------ checks

    def lock_key(self) -> LockKey:
        """The key of this task instance, from the rendered ``key`` and ``tenant``."""
        if self._lock_key is None:
            # a template whose value is None (rendered None, or the text 'None'): the sensor would
            # watch the key 'None' (or the key without its tenant), free, instead of the intended one
            refuse_rendered_none("key", self._written_key, self.key, self.task_id, optional=False)
            refuse_rendered_none("tenant", self._written_tenant, self.tenant, self.task_id)
            self._lock_key = resolve_key(self.key, self.tenant, self.dag_id, self.task_id)
        return self._lock_key

    def poke(self, context: Context) -> bool:
        """One look at ``pg_locks`` on a short connection of its own: True when the key is free.

        :param context: the task context (unused: the key is rendered before ``execute``).
        """
        from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

        key = self.lock_key()
        hook = AdvisoryLockHook(self.postgres_conn_id)
        holders = hook.holders(key, slots=self.slots)
        if self.slots > 1:
            return self._free(key, holders, hook.scopes(key, slots=self.slots))
        return self._free(key, holders) and self._scope(hook, key) is None

    def _scope(self, hook: Any, key: LockKey) -> Any:
        """The lock scope that holds the named key between its tasks (docs/scopes.md), or None."""
        scope = hook.scope(key) if key.name is not None else None
        if scope is not None:
            self._last_holders = scope.describe()
            self.log.info("pglock waiting: %s is held by %s", key.describe(), self._last_holders)
        return scope

    def _free(self, key: LockKey, holders: Sequence[LockHolder], scoped: Mapping[LockKey, Any] | None = None) -> bool:
        """Whether the key (a pool: a slot of it) is free; ``scoped``: a pool's slots held by lock
        scopes between their tasks (their keys are free in pg_locks, their rows hold them)."""
        from airflow_pglock.holder import blocking_holders, describe_holders

        blocking = blocking_holders(holders, self.shared)
        if self.slots > 1:
            used = {holder.coordinates for holder in blocking} | {slot.pg_locks for slot in scoped or {}}
            if len(used) < self.slots:
                self.log.info("pglock sensor: a slot of the pool %s (%d slots) is free", key.describe(), self.slots)
                return True
            if scoped:
                by_scopes = "; ".join(f"{slot.describe()}: {row.describe()}" for slot, row in scoped.items())
                self._last_holders = f"{describe_holders(holders, dt.datetime.now(dt.timezone.utc))}; {by_scopes}"
                self.log.info("pglock waiting: every slot of %s is held: %s", key.describe(), self._last_holders)
                return False
        if self.slots == 1 and not blocking:
            self.log.info("pglock sensor: %s is free%s", key.describe(), " for a shared lock" if self.shared else "")
            return True
        self._last_holders = describe_holders(holders, dt.datetime.now(dt.timezone.utc))
        self.log.info("pglock waiting: %s is held by %s", key.describe(), self._last_holders)
        return False

    # --------------------------------------------------------------- execution

    def execute(self, context: Context) -> Any:
        try:
            key = self.lock_key()
            self._refuse_own_hold(key)  # guarded by that key (or in its lock scope): it would wait for itself
        except (InvalidLockKeyError, LockConfigurationError) as error:
            # Outside poke(): a bad key fails the task, soft_fail or not (soft_fail is for timeouts).
            raise AirflowFailException(f"{type(error).__name__}: {error}") from error
        if self.deferrable:
            return self._execute_deferrable(context, key)
        try:
            return super().execute(context)
        except AirflowSensorTimeout as timeout:
            raise AirflowSensorTimeout(self._timeout_message(key, timeout)) from timeout
        except AirflowSkipException as skip:
            if self._last_holders is None or "timed out" not in str(skip):
                raise
            raise AirflowSkipException(self._timeout_message(key, skip) + " (soft_fail=True)") from skip

    def _refuse_own_hold(self, key: LockKey) -> None:
        """Fail at once when the sensor's own task holds every key the sensor reads: ``guarded()``
        around the sensor, or the lock scope it is a task of, on the key it waits for. Every check
        would count the task's own hold (deferred: the triggerer's hold of it) as another's, and a key
        the task holds is never free before the sensor ends: it would wait until its timeout. A pool
        sensor whose task holds one of its slots may still find another free (it counts its own as one
        in use), and a shared hold is no holder to a shared sensor: both run."""
        around = [handle for handle in held_around() if not (handle.shared and self.shared)]
        if not around:
            return
        read = {slot.numbers for slot in slot_keys(key, self.slots)}
        own = [handle for handle in around if handle.key.numbers in read]
        if not own or {handle.key.numbers for handle in own} != read:
            return
        handle = own[0]
        since = handle.acquired_at.isoformat(timespec="seconds")
        waits = f"waits for {key.describe()}" if self.slots == 1 else f"waits for a slot of the pool {key.describe()}"
        raise AirflowFailException(
            f"AdvisoryLockSensor {self.task_id!r} {waits}, which its own task already holds (its guard's session, "
            f"pid {handle.backend_pid}, since {since}{', shared' if handle.shared else ''}): guarded() around the "
            "sensor, or the lock scope it is a task of, holds that key while the sensor runs, so every check "
            "would count the sensor's own task as a holder, until its timeout. Wait for the key in a task before "
            "the guarded one (or before the scope), or guard the sensor with another key"
        )

    def _timeout_message(self, key: LockKey, error: BaseException) -> str:
        return f"{key.describe()} is still held by {self._last_holders} after the sensor's timeout: {error}"

    def _execute_deferrable(self, context: Context, key: LockKey) -> None:
        from airflow_pglock.triggers.advisory_lock import AdvisoryLockTrigger

        if self.poke(context):
            return None
        trigger = AdvisoryLockTrigger.for_key(
            key,
            postgres_conn_id=self.postgres_conn_id,
            poll_interval=self.poke_interval,
            deadline=time.time() + self.timeout,
            shared=self.shared,
            slots=self.slots,
        )
        # No Airflow deferral timeout: it would fail the task even with soft_fail; the
        # trigger's own deadline ends the wait with an event execute_complete maps.
        self.defer(trigger=trigger, method_name="execute_complete")

    def _defer_behind_scope(self, key: LockKey, seconds_left: float, event: dict[str, Any]) -> None:
        """The key is free but a lock scope holds it: wait again, rechecking at the lease's end at the latest."""
        from airflow_pglock.task_guard import SCOPE_RECHECK_SECONDS
        from airflow_pglock.triggers.advisory_lock import AdvisoryLockTrigger, worker_resume_hold

        deadline = event.get("deadline")
        deadline = float(deadline) if isinstance(deadline, int | float) else time.time() + self.timeout
        if time.time() >= deadline:  # deferring again would fire at once, again and again
            self._timed_out(f"{key.describe()} is still held by {self._last_holders} at the sensor's deadline")
        trigger = AdvisoryLockTrigger.for_key(
            key,
            postgres_conn_id=self.postgres_conn_id,
            poll_interval=self.poke_interval,
            deadline=deadline,
            shared=self.shared,
            slots=self.slots,
            resume_hold=max(
                worker_resume_hold(),
                min(SCOPE_RECHECK_SECONDS, seconds_left),  # on the database clock, as the lease
            ),
        )
        self.defer(trigger=trigger, method_name="execute_complete")

    def _timed_out(self, message: str) -> NoReturn:
        """The deadline passed with the key held: the timeout, or the skip under ``soft_fail``."""
        message = f"{message} (timeout {self.timeout:g} s)"
        if self.soft_fail:
            raise AirflowSkipException(f"{message} (soft_fail=True)")
        raise AirflowSensorTimeout(message)

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        """Resume after the trigger fired; ``execute_complete`` maps the event itself.

        :param next_method: the method to resume with (``execute_complete``, or Airflow's ``__fail__``).
        :param next_kwargs: its keyword arguments (the trigger's event).
        :param context: the task context.
        """
        if next_method == "execute_complete":
            # BaseSensorOperator.resume_execution would replace our skip reason (key, holder)
            # by "Skipping due to soft_fail", and turn errors into skips under soft_fail.
            return self.execute_complete(context, **(next_kwargs or {}))
        try:  # Airflow's __fail__: the trigger failed (it raised, or the triggerer could not build it)
            return super(BaseSensorOperator, self).resume_execution(next_method, next_kwargs, context)
        except Exception as error:
            if not is_deferral_timeout(error):
                raise  # an error, as an ERROR event is: never a skip, whatever soft_fail says
            self._timed_out(f"Airflow's deferral timeout ended the wait for {self.lock_key().describe()}")

    def execute_complete(self, context: Context, event: dict[str, Any]) -> None:
        """Map the trigger's event: free -> success, timeout -> failed or skipped, error -> failed.

        :param context: the task context.
        :param event: the trigger's event payload.
        """
        from airflow_pglock.triggers.advisory_lock import ERROR, FREE, TIMEOUT

        status, message = event.get("status"), str(event.get("message", event))
        if status == FREE:
            from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

            key = self.lock_key()
            hook = AdvisoryLockHook(self.postgres_conn_id)
            if self.slots > 1:  # a free slot may be one a lock scope holds between its tasks
                scoped = hook.scopes(key, slots=self.slots)
                if scoped and not self._free(key, hook.holders(key, slots=self.slots), scoped):
                    self._defer_behind_scope(key, min(row.seconds_left for row in scoped.values()), event)
            else:
                scope = self._scope(hook, key)
                if scope is not None:
                    self._defer_behind_scope(key, scope.seconds_left, event)
            self.log.info("pglock sensor: %s", message)
            return
        if status == TIMEOUT:
            self._timed_out(message)
        # An error fails the task even with soft_fail (that is for timeouts), as in poke mode.
        default: type[Exception] = LockConnectionError if status == ERROR else PgLockError
        error_class = _ERRORS.get(str(event.get("error_type")), default)
        raise error_class(f"AdvisoryLockSensor {self.task_id!r}: {message}")
