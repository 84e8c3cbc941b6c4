"""The triggerer's hubs (wake-ups, deferred holds) run outside the context of the trigger that
started them: Airflow sends a trigger's log lines to its task's log by context variables, and a
hub serves every trigger, so its lines belong in the triggerer's own log."""

from __future__ import annotations

import asyncio
import contextvars
import inspect

from airflow_pglock.triggers import holds, wakeups
from airflow_pglock.triggers.wakeups import start_apart

TASK_LOG: contextvars.ContextVar[str | None] = contextvars.ContextVar("task_log", default=None)


def test_a_hub_task_started_by_a_trigger_does_not_inherit_its_context() -> None:
    seen: list[str | None] = []

    async def hub() -> None:
        seen.append(TASK_LOG.get())

    async def trigger() -> None:
        TASK_LOG.set("the log of the task whose trigger came first")
        await start_apart(hub(), "hub")
        assert TASK_LOG.get() is not None  # the trigger's own context is untouched

    asyncio.run(trigger())
    assert seen == [None]


def test_both_hubs_start_their_task_apart() -> None:
    for module in (wakeups, holds):
        source = inspect.getsource(module)
        assert "start_apart(self._serve()" in source and "create_task(self._serve()" not in source, module.__name__
