"""Metrics of guarded executions, sent through Airflow's own Stats (StatsD / OpenTelemetry).

One call per guarded execution, when it ends (:func:`record_outcome`, from the outcome
line of :class:`airflow_pglock.guard.LockGuard`, given the metrics client by whoever made
the guard: the hook and the Airflow adapters pass ``compat.get_stats``). Names (Airflow adds its
``[metrics] statsd_prefix``, ``airflow.`` by default):

========================  =======  ==========================================================
``pglock.acquired``       counter  the lock was taken (whatever happened next)
``pglock.completed``      counter  the protected work finished with the lock held throughout
``pglock.skipped``        counter  the key was busy: the task was skipped
``pglock.busy``           counter  the key was busy and ``on_busy='fail'``: the task failed
``pglock.failed``         counter  the lock could not be taken (database down, bad settings,
                                   unsafe set-up, the triggerer's wait for it failed): the
                                   task failed (or skipped, ``on_error``)
``pglock.work_failed``    counter  the run failed while holding the lock (the work raised,
                                   or the transaction-mode commit failed)
``pglock.work_skipped``   counter  the work skipped its task itself while holding the lock
                                   (``AirflowSkipException``)
``pglock.rescheduled``    counter  the work (a sensor in ``mode="reschedule"``) asked to be
                                   rescheduled while holding the lock; it was given back
``pglock.lost``           counter  the lock was lost while held
``pglock.wait``           timer    time to take the lock, or to give up (every execution)
``pglock.hold``           timer    time the lock was held (executions that took it)
``pglock.pool_in_use``    gauge    a pool of slots (``slots=N``): how many of its slots were
                                   held at least, as this execution found them: the slot
                                   number it took (slots are tried in order, so every lower
                                   one was held), or N when the pool was full
========================  =======  ==========================================================

Tags, each of bounded cardinality: ``dag_id`` and ``task_id`` (as Airflow's own task
metrics, read from the lock session's application_name, so a very long id is shortened
with ``~``; absent outside Airflow tasks), ``mode`` (session / transaction), ``shared``
(true / false), ``on_busy`` (skip / fail / wait / defer: the task's own, on every try of a
deferred wait), ``slots`` (a pool's size; only with ``slots`` greater than 1). Never the run
id, the tenant or the key name (a key name may contain a tenant). Plain StatsD drops tags
unless ``[metrics] statsd_influxdb_enabled``; Datadog and OpenTelemetry keep them.

Metrics never break a task: any error while sending is logged at debug level and dropped.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from airflow_pglock.identity import parse_application_name

log = logging.getLogger(__name__)

PREFIX = "pglock"
COUNTERS = ("acquired", "completed", "skipped", "busy", "failed", "work_failed", "work_skipped", "rescheduled", "lost")
TIMERS = ("wait", "hold")
GAUGES = ("pool_in_use",)

#: guard outcome -> counter, for executions that never took the lock / that took it.
_NOT_HELD = {"skipped": "skipped", "busy": "busy", "failed": "failed"}
_HELD = {
    "completed": "completed",
    "failed": "work_failed",
    "work_skipped": "work_skipped",
    "rescheduled": "rescheduled",
    "lost": "lost",
}


def metric_tags(
    *, application_name: str | None, mode: str, shared: bool, on_busy: str, slots: int = 1
) -> dict[str, str]:
    """The tags of one execution (bounded cardinality: see the module docstring)."""
    tags = {"mode": mode, "shared": "true" if shared else "false", "on_busy": on_busy}
    if slots > 1:
        tags["slots"] = str(slots)
    holder = parse_application_name(application_name)
    if holder is not None:
        tags["dag_id"] = holder.dag_id
        tags["task_id"] = holder.task_id
    return tags


def metric_names(outcome: str, *, acquired: bool) -> list[str]:
    """The counters one execution increments (without the ``pglock.`` prefix)."""
    counter = (_HELD if acquired else _NOT_HELD).get(outcome)
    names = ["acquired"] if acquired else []
    if counter is not None:
        names.append(counter)
    return names


def record_outcome(
    stats: Callable[[], Any],
    outcome: str,
    *,
    acquired: bool,
    waited: float,
    held: float | None,
    tags: dict[str, str],
    pool_in_use: int | None = None,
) -> None:
    """Send the counters and timers of one guarded execution.

    :param stats: gives the metrics client (Airflow's ``Stats``: ``compat.get_stats``).
    :param outcome: the guard's outcome (completed, skipped, rescheduled, deferred, busy, failed, lost), or
        ``work_skipped`` for a work that skipped its task itself.
    :param acquired: whether the lock was taken.
    :param waited: seconds spent taking the lock or giving up.
    :param held: seconds the lock was held (None if it was not taken).
    :param tags: from :func:`metric_tags`.
    :param pool_in_use: a pool of slots: how many were held at least (the ``pool_in_use`` gauge).
    """
    try:
        client: Any = stats()
        for name in metric_names(outcome, acquired=acquired):
            client.incr(f"{PREFIX}.{name}", tags=tags)
        client.timing(f"{PREFIX}.wait", dt.timedelta(seconds=waited), tags=tags)
        if acquired and held is not None:
            client.timing(f"{PREFIX}.hold", dt.timedelta(seconds=held), tags=tags)
        if pool_in_use is not None:
            client.gauge(f"{PREFIX}.pool_in_use", pool_in_use, tags=tags)
    except Exception:  # metrics must never fail or skip a task
        log.debug("pglock could not send metrics for outcome=%s", outcome, exc_info=True)
