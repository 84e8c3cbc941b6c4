"""AdvisoryLockTrigger: wait in the triggerer until an advisory lock key is free.

It only reads ``pg_locks``, never takes the key. All the triggers of a triggerer process
that wait on the same lock database share one connection (:mod:`.wakeups`): it is woken
the moment an airflow-pglock guard releases the key, and re-reads every waiting key once
per ``poll_interval`` (holders that died or are not airflow-pglock). It carries no
secret: its kwargs name the Airflow connection, which is resolved in the triggerer. Its
deadline is absolute, so a trigger that is restarted or runs twice (triggerer failover)
neither extends the wait nor changes the outcome.

This module is imported on the triggerer's event loop: it imports nothing heavy (no
driver, no hook); :meth:`AdvisoryLockTrigger.run` imports those in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow_pglock.compat import BaseTrigger, TriggerEvent, task_supervisor_wait
from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError
from airflow_pglock.keys import LockKey, slot_keys
from airflow_pglock.policy import check_shared

#: ``event["status"]`` values.
FREE, TIMEOUT, ERROR = "free", "timeout", "error"
#: Default seconds between two reads of every waiting key (a release by airflow-pglock wakes at once).
DEFAULT_POLL_INTERVAL = 5.0
#: Seconds to wait for a connection (the hook's ``DEFAULT_CONNECT_TIMEOUT``; not imported, see above).
CONNECT_TIMEOUT = 10
#: A key found free sooner than this after the trigger started is reported this long after its start:
#: Airflow 3's scheduler fails a resumed attempt when it takes the executor's report of the process
#: that deferred only after that attempt started (apache/airflow#72716), and a release announced a
#: moment after the deferral would resume the task within that window. The trigger starts after the
#: deferral, on the triggerer's own clock. The task's supervisor may notice its process's exit only
#: after ``[workers] min_heartbeat_interval`` (5 s by default); with the executor and a scheduler loop,
#: the report came up to 6.4 s after the deferral under load (docs/benchmarks.md, section 10). A
#: 5 s hold let 6 of 600 such wake-ups fail there; with this one, 0 of 600 did. A worker with a
#: longer interval asks for a longer hold (:func:`worker_resume_hold`).
RESUME_HOLD_SECONDS = 8.0
#: The supervisor's wait (``[workers] min_heartbeat_interval``) that ``RESUME_HOLD_SECONDS`` was measured with.
RESUME_HOLD_MEASURED_WAIT = 5.0
#: The longest hold a trigger takes.
MAX_RESUME_HOLD = 3600.0


def resume_hold_for(supervisor_wait: float | None) -> float:
    """The hold of a deferral whose task supervisor may wait ``supervisor_wait`` s before it notices
    its task process exited (None: not known, or no supervisor). ``RESUME_HOLD_SECONDS`` at least;
    a longer wait gets as much beyond it as the measured default one did (3 s), up to an hour."""
    if supervisor_wait is None or not math.isfinite(supervisor_wait) or supervisor_wait <= RESUME_HOLD_MEASURED_WAIT:
        return RESUME_HOLD_SECONDS
    return min(MAX_RESUME_HOLD, supervisor_wait + RESUME_HOLD_SECONDS - RESUME_HOLD_MEASURED_WAIT)


def _finite_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def checked_resume_hold(value: Any) -> float:
    """``value`` as a hold in seconds, or a :class:`LockConfigurationError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_RESUME_HOLD:
        raise LockConfigurationError(f"resume_hold must be from 0 to {MAX_RESUME_HOLD:g} seconds, got {value!r}")
    return float(value)


def worker_resume_hold() -> float:
    """The hold this worker's deferrals ask for: it follows its ``[workers] min_heartbeat_interval``."""
    return resume_hold_for(task_supervisor_wait())


class AdvisoryLockTrigger(BaseTrigger):
    """Fire once the key has no holder, or at the deadline, or on an error.

    Every event carries the ``deadline`` (a deferred task resumes with it even where
    Airflow drops the deferral's own kwargs: ``dag.test()`` on Airflow 3).
    Events: ``{"status": "free"}``; ``{"status": "timeout", "holders": ...}`` when the
    key is still held at ``deadline``; ``{"status": "error", "error_type": ...}`` when
    the lock database cannot be read. Each event has a ``message`` naming the key.

    :param key_name: the key's human name (None for a bare numeric key).
    :param key_numbers: the key's numbers: ``[int64]`` or ``[int32, int32]``.
    :param postgres_conn_id: the Airflow connection of the lock database (resolved in the triggerer).
    :param poll_interval: seconds between two reads of ``pg_locks`` when no release is announced.
    :param deadline: UNIX time after which a still-held key ends the wait (None: no deadline).
    :param shared: wait only for exclusive holders to go (the key is free for a shared lock).
    :param connect_timeout: seconds to wait for each connection.
    :param slots: more than one: the key names a pool; fire once any of its slots is free.
    :param resume_hold: seconds after the trigger started before a ``free`` event may fire
        (:data:`RESUME_HOLD_SECONDS`; 0: at once). Not past the deadline. :meth:`for_key` asks
        :func:`worker_resume_hold` by default.
    """

    def __init__(
        self,
        *,
        key_name: str | None,
        key_numbers: Sequence[int],
        postgres_conn_id: str,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        deadline: float | None = None,
        shared: bool = False,
        connect_timeout: int = CONNECT_TIMEOUT,
        slots: int = 1,
        resume_hold: float = RESUME_HOLD_SECONDS,
    ) -> None:
        super().__init__()
        numbers = list(key_numbers)
        if len(numbers) == 2:
            self.key = LockKey.from_pair(numbers[0], numbers[1], name=key_name)
        elif len(numbers) == 1:
            self.key = LockKey.from_int(numbers[0], name=key_name)
        else:
            raise InvalidLockKeyError(f"key_numbers must be [int64] or [int32, int32], got {key_numbers!r}")
        if not _finite_number(poll_interval) or not poll_interval > 0:
            raise LockConfigurationError(f"poll_interval must be a positive number of seconds, got {poll_interval!r}")
        if deadline is not None and not _finite_number(deadline):
            raise LockConfigurationError(f"deadline must be a UNIX time or None, got {deadline!r}")
        if not isinstance(postgres_conn_id, str) or not postgres_conn_id.strip():
            raise LockConfigurationError(f"postgres_conn_id must be a non-empty string, got {postgres_conn_id!r}")
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, int) or connect_timeout < 1:
            raise LockConfigurationError(
                f"connect_timeout must be a whole number of seconds, 1 or more (0 waits for ever), "
                f"got {connect_timeout!r}"
            )
        check_shared(shared)
        self.postgres_conn_id = postgres_conn_id
        self.poll_interval = float(poll_interval)
        self.deadline = None if deadline is None else float(deadline)
        self.shared = shared
        self.connect_timeout = connect_timeout
        self.slots = slots
        self.slot_keys = slot_keys(self.key, slots)
        self.resume_hold = checked_resume_hold(resume_hold)

    @classmethod
    def for_key(
        cls,
        key: LockKey,
        *,
        postgres_conn_id: str,
        poll_interval: float,
        deadline: float | None,
        shared: bool = False,
        slots: int = 1,
        resume_hold: float | None = None,
    ) -> AdvisoryLockTrigger:
        """The trigger that waits for ``key``.

        :param key: the key to wait for.
        :param postgres_conn_id: the Airflow connection of the lock database.
        :param poll_interval: seconds between two reads.
        :param deadline: UNIX time of the deadline, or None.
        :param shared: wait only for exclusive holders to go.
        :param resume_hold: the hold; None: :func:`worker_resume_hold` (read on the deferring worker).
        """
        return cls(
            key_name=key.name,
            key_numbers=list(key.numbers),
            postgres_conn_id=postgres_conn_id,
            poll_interval=poll_interval,
            deadline=deadline,
            shared=shared,
            slots=slots,
            resume_hold=worker_resume_hold() if resume_hold is None else resume_hold,
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Class path and kwargs: the key, the connection *id* (never its secrets), the deadline.

        ``resume_hold`` only when not the default: a triggerer still on an older provider
        version then runs the trigger a newer worker deferred with.
        """
        kwargs: dict[str, Any] = {
            "key_name": self.key.name,
            "key_numbers": list(self.key.numbers),
            "postgres_conn_id": self.postgres_conn_id,
            "poll_interval": self.poll_interval,
            "deadline": self.deadline,
            "shared": self.shared,
            "connect_timeout": self.connect_timeout,
            "slots": self.slots,
        }
        if self.resume_hold != RESUME_HOLD_SECONDS:
            kwargs["resume_hold"] = self.resume_hold
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Wait until the key is free (woken by its release, or seen at a poll), the deadline or an error."""
        # psycopg and the hook are imported in a worker thread: an import on the loop blocks every trigger.
        started = time.monotonic()
        wakeups = await asyncio.to_thread(importlib.import_module, "airflow_pglock.triggers.wakeups")
        key = self.key.describe() if self.slots == 1 else f"a slot of the pool {self.key.describe()}"
        hub = wakeups.hub_for(self.postgres_conn_id, self.connect_timeout)
        try:
            free, logged = False, False
            while not free:
                async with contextlib.AsyncExitStack() as watching:
                    waiters = [
                        await watching.enter_async_context(
                            hub.watch(slot, shared=self.shared, poll_interval=self.poll_interval)
                        )
                        for slot in self.slot_keys
                    ]
                    remaining = None if self.deadline is None else self.deadline - time.time()
                    if not logged:
                        await _log(
                            self.log.info,
                            "pglock waiting: %s until it is free (woken when it is released; re-read every %g s%s)",
                            key,
                            self.poll_interval,
                            "" if remaining is None else f"; deadline in {max(0.0, remaining):.0f} s",
                        )
                        logged = True
                    free = await _any_free(waiters, remaining)
                if not free:
                    break
                held_back = started + self.resume_hold - time.monotonic()
                if self.deadline is not None:
                    held_back = min(held_back, self.deadline - time.time())
                if held_back > 0:
                    await _log(
                        self.log.info,
                        "pglock: %s is free; the wake-up waits %.1f s more, until the deferral is %g s old "
                        "(apache/airflow#72716: a task resumed sooner may be failed by a late executor report)",
                        key,
                        held_back,
                        self.resume_hold,
                    )
                    await asyncio.sleep(held_back)
                    # Taken again meanwhile? The loop registers the key anew and the hub reads it at
                    # once, on its one connection (holds that end together open no connection each);
                    # the hold is over, so a free read fires, and a held one waits on.
                    free = False
            if free:
                yield TriggerEvent({"status": FREE, "message": f"{key} is free", "deadline": self.deadline})
                return
            who = await self._holders_text()
            if who is None:  # released since the hub's last read (a release that announced nothing)
                yield TriggerEvent({"status": FREE, "message": f"{key} is free", "deadline": self.deadline})
                return
            message = f"{key} is still held by {who} at the sensor's deadline"
            yield TriggerEvent({"status": TIMEOUT, "holders": who, "message": message, "deadline": self.deadline})
        except Exception as error:  # the hub's error (connection, settings): the task reports it
            message = f"could not read who holds {key} ({type(error).__name__}: {error})"
            await _log(self.log.error, "pglock trigger: %s", message)
            event = {"status": ERROR, "error_type": type(error).__name__, "message": message, "deadline": self.deadline}
            yield TriggerEvent(event)

    async def _holders_text(self) -> str | None:
        """Who holds the key now (for the deadline's message), on a short connection of its own;
        None when nothing keeps it (a pool: one of its slots) from being taken.

        Its error is the trigger's: the hub's last read may be older than a partition or a frozen
        server it has not noticed yet, and "still held" must come from a server that answered.
        """
        import datetime as dt

        from airflow_pglock.holder import blocking_holders, describe_holders
        from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

        holders = await AdvisoryLockHook(self.postgres_conn_id, connect_timeout=self.connect_timeout).aholders(
            self.key, slots=self.slots
        )
        busy_slots = {holder.coordinates for holder in blocking_holders(holders, self.shared)}
        if len(busy_slots) < len(self.slot_keys):
            return None
        return describe_holders(holders, dt.datetime.now().astimezone())


async def _log(method: Any, *args: object) -> None:
    """Write a log line from a worker thread.

    In ``airflow triggerer`` a trigger's log line is written to a socket that the
    triggerer's supervisor drains; while it is busy (writing many events to its database,
    or waiting for a core) that write blocks, and on the event loop it would block every
    trigger (measured: Airflow's own ``DateTimeTrigger`` blocked the loop 2 s this way,
    benchmarks section 9). The thread keeps the task's log context (``asyncio.to_thread``
    copies it), so the line still goes to the task's log.
    """
    await asyncio.to_thread(method, *args)


async def _any_free(waiters: Sequence[Any], timeout: float | None) -> bool:
    """True as soon as one waiter's key is free (a pool: any slot); False when none is by ``timeout``."""
    if len(waiters) == 1:
        return bool(await waiters[0].wait(timeout))
    pending = {asyncio.ensure_future(waiter.wait(timeout)) for waiter in waiters}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(task.result() for task in done):
                return True
        return False
    finally:
        for task in pending:
            task.cancel()
