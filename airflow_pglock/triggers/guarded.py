"""GuardedTrigger: a deferred guarded operator's own trigger, waited for while the triggerer holds its key.

``guarded(operator, key=...)`` wraps the trigger a deferrable operator defers with. In the
triggerer the wrapper first takes the hold its deferral handed over
(:mod:`~airflow_pglock.triggers.holds`: the key on the triggerer's one lock session, the lease
row renewed under it), then runs the operator's trigger. When that trigger fires, the hold is
handed back to a worker (the row renewed, the key released) and the event goes on, wrapped:
``{"pglock": "held", "event": <the operator's event>}``. A hold lost meanwhile ends the wait
at once with ``{"pglock": "lost", "reason": ...}``: the task resumes, calls the operator's
``on_kill()`` and fails.

Imported on the triggerer's event loop: nothing heavy at import time (see ``advisory_lock.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from airflow_pglock.compat import BaseTrigger, TriggerEvent, is_user_action_cancel, trigger_on_kill_timeout
from airflow_pglock.keys import LockKey
from airflow_pglock.triggers.advisory_lock import CONNECT_TIMEOUT, RESUME_HOLD_SECONDS, _log, checked_resume_hold

#: ``event["pglock"]`` values: the hold goes back to a worker (``error``: with the operator's
#: trigger's error, which the task raises once it freed its hold), or it was lost.
HELD, LOST, ERROR = "held", "lost", "error"
#: What the triggerer sets on a trigger before it runs, passed on to the operator's trigger.
_RUNNER_ATTRIBUTES = ("trigger_id", "task_instance", "triggerer_job_id", "timeout_after", "asset_state_store")


class GuardedTrigger(BaseTrigger):
    """Run ``trigger_classpath(**trigger_kwargs)`` while the triggerer holds the task's key.

    :param trigger_classpath: the operator's trigger (its ``serialize()``).
    :param trigger_kwargs: its kwargs.
    :param key_name: the key's name (a deferred hold needs a named key).
    :param key_numbers: the key's numbers.
    :param postgres_conn_id: the Airflow connection of the lock database (resolved in the triggerer).
    :param holder: the hold's id (its row's holder), the same for the whole task.
    :param task: the task, for people.
    :param lease: seconds the row keeps the hold when nobody renews it.
    :param deferred_at: UNIX time of the deferral (an event fires no sooner than
        ``resume_hold`` after it: apache/airflow#72716).
    :param resume_hold: seconds after the deferral before the task may resume
        (``RESUME_HOLD_SECONDS``; the deferring worker passes its ``worker_resume_hold()``).
    :param resume: what the task resumes with (the hold, the operator's resume method and its
        kwargs), carried in every event too: ``dag.test()`` on Airflow 3 drops a deferral's kwargs.
    :param connect_timeout: seconds to wait for a connection.
    """

    def __init__(
        self,
        *,
        trigger_classpath: str,
        trigger_kwargs: dict[str, Any],
        key_name: str,
        key_numbers: Sequence[int],
        postgres_conn_id: str,
        holder: str,
        task: str,
        lease: float,
        deferred_at: float,
        resume: dict[str, Any] | None = None,
        connect_timeout: int = CONNECT_TIMEOUT,
        resume_hold: float = RESUME_HOLD_SECONDS,
    ) -> None:
        super().__init__()
        self.trigger_classpath = trigger_classpath
        self.trigger_kwargs = dict(trigger_kwargs)
        numbers = list(key_numbers)
        self.key = (
            LockKey.from_pair(numbers[0], numbers[1], name=key_name)
            if len(numbers) == 2
            else LockKey.from_int(numbers[0], name=key_name)
        )
        self.postgres_conn_id = postgres_conn_id
        self.holder = holder
        self.task_label = task
        self.lease = float(lease)
        self.deferred_at = float(deferred_at)
        self.resume = dict(resume or {})
        self.connect_timeout = connect_timeout
        self.resume_hold = checked_resume_hold(resume_hold)
        self._operator_trigger: BaseTrigger | None = None
        self._started: float | None = None  # when it began to run in the triggerer (monotonic)
        self._killed = False  # the operator's trigger's on_kill() ran under the hold already
        self._fired: Any = None  # the operator's trigger's event, handed back

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Class path and kwargs: the operator's trigger, the key, the connection *id* (no secret), the hold.

        ``resume_hold`` only when not the default: a triggerer still on an older provider
        version then runs the trigger a newer worker deferred with.
        """
        kwargs: dict[str, Any] = {
            "trigger_classpath": self.trigger_classpath,
            "trigger_kwargs": self.trigger_kwargs,
            "key_name": self.key.name,
            "key_numbers": list(self.key.numbers),
            "postgres_conn_id": self.postgres_conn_id,
            "holder": self.holder,
            "task": self.task_label,
            "lease": self.lease,
            "deferred_at": self.deferred_at,
            "resume": self.resume,
            "connect_timeout": self.connect_timeout,
        }
        if self.resume_hold != RESUME_HOLD_SECONDS:
            kwargs["resume_hold"] = self.resume_hold
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    def _inner(self) -> BaseTrigger:
        module, _, name = self.trigger_classpath.rpartition(".")
        trigger: BaseTrigger = getattr(importlib.import_module(module), name)(**self.trigger_kwargs)
        for attribute in _RUNNER_ATTRIBUTES:  # what the triggerer set on this one
            if attribute in vars(self):
                setattr(trigger, attribute, getattr(self, attribute))
        return trigger

    async def on_kill(self) -> None:
        """The task is killed while deferred (marked, cleared; Airflow 3.3+ calls it): the operator's
        trigger hears it too, and cancels its external job where it can. Once only: :meth:`run`
        calls it first, while it still holds the key."""
        if self._killed:
            return
        self._killed = True
        trigger = self._operator_trigger
        if trigger is None:  # killed before the hold was taken: the operator's trigger hears it all the same
            try:
                trigger = await asyncio.to_thread(self._inner)  # its module may import a driver
            except Exception as error:
                await _log(self.log.warning, "pglock: the trigger of %s could not be built: %s", self.task_label, error)
                return
        kill = getattr(trigger, "on_kill", None)
        if callable(kill):
            result = kill()
            if inspect.isawaitable(result):
                await result

    async def cleanup(self) -> None:
        """The trigger stops, however: the operator's trigger cleans up too."""
        trigger = self._operator_trigger
        if trigger is not None:
            await trigger.cleanup()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Take the hold, run the operator's trigger, hand the hold back with its first event (or report the loss)."""
        self._started = time.monotonic()
        holds = await asyncio.to_thread(importlib.import_module, "airflow_pglock.triggers.holds")
        hub = holds.hub_for(self.postgres_conn_id, self.connect_timeout)
        hold = holds.DeferredHold(self.key, self.holder, self.task_label, self.lease)
        async with hub.holding(hold):
            try:
                async with contextlib.aclosing(self._under_the_hold(hub, hold)) as under:
                    async for event in under:
                        yield event
                        return
            except asyncio.CancelledError as cancelled:
                if is_user_action_cancel(cancelled):
                    # Cleared or marked while deferred: the triggerer calls on_kill() only once the
                    # key is let go, and the task's next try may take it at once; the operator's
                    # trigger stops its external job first, under the hold.
                    await self._kill_now()
                raise
        yield TriggerEvent({"pglock": HELD, "event": self._fired, "resume": self.resume})

    async def _kill_now(self) -> None:
        try:
            await asyncio.wait_for(self.on_kill(), timeout=trigger_on_kill_timeout())
        except Exception as error:  # its timeout (a TimeoutError) too
            await _log(self.log.warning, "pglock: on_kill() of the trigger of %s: %r", self.task_label, error)

    async def _under_the_hold(self, hub: Any, hold: Any) -> AsyncGenerator[TriggerEvent, None]:
        """What :meth:`run` does under the hold: an event ends it there (lost, failed, the task ended
        in the triggerer); none: the operator's trigger fired, its event handed back (``_fired``)."""
        await hold.settled.wait()
        if hold.reason is not None:
            yield await self._lost(hold.reason)
            return
        try:  # under the hold: a trigger that cannot be built here resumes the task to free it and fail
            inner = await asyncio.to_thread(self._inner)  # its module may import a driver
        except Exception as unbuilt:
            yield await self._failed(hub, hold, "could not be built in the triggerer", unbuilt)
            return
        self._operator_trigger = inner
        await _log(
            self.log.info,
            "pglock: the triggerer holds %s for the deferred task %s (lease %g s, renewed every %g s)",
            self.key.describe(),
            self.task_label,
            self.lease,
            self.lease / 3,
        )
        events = inner.run()
        fired = asyncio.ensure_future(events.__anext__())
        lost = asyncio.ensure_future(hold.lost.wait())
        try:
            await asyncio.wait({fired, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not fired.done():
                fired.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await fired  # the generator can be closed only once its step has ended
        if fired.cancelled():
            await events.aclose()
            # The key may be another's already: the operator's trigger stops its external job now,
            # not once the task has resumed on a worker (the resume's on_kill() comes seconds later).
            await self._kill_now()
            yield await self._lost(hold.reason)
            return
        failed = fired.exception()
        await events.aclose()
        if failed is not None:
            yield await self._failed(hub, hold, "failed", failed)
            return
        event = fired.result()
        if type(event) is not TriggerEvent:  # a task-end event: the task ends here, no worker resumes
            if not await hub.end(hold):
                yield await self._lost(hold.reason)
                return
            yield event
            return
        await self._hold_back_the_resume()
        if not await hub.hand_back(hold):
            yield await self._lost(hold.reason)
            return
        self._fired = event.payload

    async def _failed(self, hub: Any, hold: Any, what: str, failed: BaseException) -> TriggerEvent:
        """The operator's trigger failed: the task resumes, frees its hold under the key, stops the
        external work and fails (or the hold was lost meanwhile)."""
        error = f"{type(failed).__name__}: {failed}"
        await _log(self.log.error, "pglock: the trigger of %s %s: %s", self.task_label, what, error)
        await self._hold_back_the_resume()
        if not await hub.hand_back(hold):
            return await self._lost(hold.reason)
        return TriggerEvent({"pglock": ERROR, "error": error, "resume": self.resume})

    async def _hold_back_the_resume(self) -> None:
        """Whatever the event, the task resumes no sooner than ``resume_hold`` after its deferral
        (apache/airflow#72716: a sooner resume may be failed by the executor's late report, before
        it could free its hold and stop the external work). Counted from the deferral on the worker's
        clock, and at least from this trigger's start on the triggerer's (a worker's clock behind the
        triggerer's would shorten it)."""
        held_back = resume_held_back(self.deferred_at, time.time(), self.resume_hold)
        if self._started is not None:
            held_back = max(held_back, self._started + self.resume_hold - time.monotonic())
        if held_back > 0:
            await asyncio.sleep(held_back)

    async def _lost(self, reason: str | None) -> TriggerEvent:
        await self._hold_back_the_resume()
        reason = reason or "the hold was lost"
        message = f"lost the hold of {self.key.describe()} while task {self.task_label} was deferred: {reason}"
        await _log(self.log.error, "pglock: %s", message)
        return TriggerEvent({"pglock": LOST, "reason": reason, "message": message, "resume": self.resume})


def resume_held_back(deferred_at: float, now: float, hold: float = RESUME_HOLD_SECONDS) -> float:
    """Seconds an event waits, so that the task resumes no sooner than ``hold`` after its deferral
    (apache/airflow#72716). ``deferred_at`` is the worker's clock, ``now`` the triggerer's: never
    more than ``hold``, however far ahead the worker's clock is.
    """
    return min(hold, deferred_at + hold - now)
