"""The ``deferred`` kind's own operator trigger and its external job, run under the real ``GuardedTrigger``.

A guarded deferrable operator defers with a trigger of its own; ``guarded()`` wraps it in
:class:`~airflow_pglock.triggers.guarded.GuardedTrigger` (its class path and kwargs, from its
``serialize()``), which builds it again in the triggerer once it holds the task's key.
:class:`JobTrigger` is that trigger for the campaign's ``deferred`` worker
(:meth:`devtools.campaign.workers.Worker._in_guarded_trigger`; the worker process is the
triggerer too, so the trigger finds its job by id in :data:`JOBS`). It starts the operator's
external job (:class:`ExternalJob`), waits for it and fires: a plain event (the task resumes on a
worker), or a task-end event (the task ends in the triggerer).

The job writes the fencing register every :data:`~devtools.campaign.workers.STEP` under the
task's token, as a real operator's job runs outside Airflow: cancelling the trigger does not stop
it, only ``on_kill()`` does (the trigger's, which the triggerer calls for a task cleared while
deferred, or the operator's, which a task that resumes with a lost hold calls).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from airflow_pglock.compat import BaseTrigger, TriggerEvent

#: The running jobs of this process, by id (the trigger's only kwarg).
JOBS: dict[str, ExternalJob] = {}


class ExternalJob:
    """An operator's external job: ``steps`` writes, :data:`STEP` apart, until done or killed.

    :param write: one register write (blocking: it runs in a thread); it raises when refused.
    :param steps: how many writes the job makes before it is done.
    :param step: seconds between two writes.
    :param emit: ``emit(event)`` writes a history event of the run (``done``, ``lost``).
    :param ends_there: the job ends the task in the triggerer: its ``done`` comes before the
        trigger fires (the hub then frees the key).
    :param stop_delay: seconds an ``on_kill()`` takes to stop it (cancelling an external job takes a
        while): it goes on writing meanwhile.
    """

    def __init__(
        self,
        write: Callable[[], None],
        steps: int,
        step: float,
        emit: Callable[[str], None],
        *,
        ends_there: bool,
        stop_delay: float = 0.0,
    ) -> None:
        self.write, self.steps, self.step, self.emit, self.ends_there = write, steps, step, emit, ends_there
        self.stop_delay = stop_delay
        self.left = steps  # writes still to make
        self.task: asyncio.Task[None] | None = None
        self.started = asyncio.Event()
        self.killed = False

    def start(self) -> asyncio.Task[None]:
        """Start the job (once; a job killed before it started never starts)."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name="campaign external job")
            self.started.set()
        return self.task

    async def _run(self) -> None:
        if self.killed:
            return
        try:
            for done in range(self.steps):
                self.left = self.steps - done
                writing = asyncio.ensure_future(asyncio.to_thread(self.write))
                try:
                    await asyncio.shield(writing)
                except asyncio.CancelledError:
                    # Killed while a write waits for its answer: the job stops once it has one (the
                    # write may still land: it is part of the job's time, before its lost event).
                    with contextlib.suppress(BaseException):
                        await writing
                    raise
                await asyncio.sleep(self.step)
        except asyncio.CancelledError:
            raise
        except BaseException:
            self.emit("done")  # its work failed: it no longer uses the key (the trigger fails next)
            raise
        self.left = 0
        if self.ends_there:
            self.emit("done")  # the job stops using the key before the hub frees it

    async def kill(self, delay: float | None = None) -> None:
        """``on_kill()``: the job stops after ``delay`` (default :attr:`stop_delay`; a write in flight
        gets its answer first); a ``lost`` event says so when it was running (or had not started: it
        never will)."""
        if self.killed:
            return
        self.killed = True
        task = self.task
        if task is not None and task.done():
            return  # it had ended already: its own events said so
        if task is not None:
            await asyncio.wait({task}, timeout=self.stop_delay if delay is None else delay)  # it goes on meanwhile
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self.emit("lost")


class JobTrigger(BaseTrigger):  # type: ignore[misc]
    """The operator's own trigger: start the job, fire when it is done; ``on_kill()`` kills it."""

    def __init__(self, job: str) -> None:
        super().__init__()
        self.job = job

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"job": self.job}

    async def run(self) -> AsyncIterator[Any]:
        job = JOBS[self.job]
        # Shielded: the trigger's cancellation (its hold lost, the task cleared) does not stop the job.
        await asyncio.shield(job.start())
        if job.ends_there:
            from airflow.triggers.base import TaskSuccessEvent

            yield TaskSuccessEvent()  # a task-end event: no worker resumes, the hub ends the hold
        else:
            yield TriggerEvent({"job": self.job, "finished": True})

    async def on_kill(self) -> None:
        await JOBS[self.job].kill()
