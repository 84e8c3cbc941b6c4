"""The one outcome line (and metric) of a guarded execution.

Exactly one per execution, whatever happens, and always the same fields in the same order
(``-`` where a field has no value; docs/operations.md has the table)::

    pglock outcome=<completed|skipped|rescheduled|deferred|failed|lost> key '<name>' (int64 <n>) mode=<mode>
    deployment=<d> host=<h> conn=<conn id> database=<db> server=<host:port> pid=<pid>
    waited=<s>s held=<s>s holder_pid=<pids> holder_deployment=<ds> holder_host=<hs> - <detail>

(one line; `` - <detail>`` only when there is something to say). :data:`OUTCOME_LINE`
parses every one of them.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_pglock.display import printable
from airflow_pglock.holder import LockHolder
from airflow_pglock.identity import holder_where
from airflow_pglock.keys import LockKey
from airflow_pglock.metrics import metric_tags, record_outcome
from airflow_pglock.pg.database import LockDatabase
from airflow_pglock.pg.settings import shown_param
from airflow_pglock.policy import LockPolicy
from airflow_pglock.server_rules import ServerInfo

#: What a field with no value shows.
NO_VALUE = "-"
#: The fields after the key, in their order.
FIELDS = (
    "mode",
    "deployment",
    "host",
    "conn",
    "database",
    "server",
    "pid",
    "waited",
    "held",
    "holder_pid",
    "holder_deployment",
    "holder_host",
)
_VALUE = r"""(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\S+)"""
#: Parses every outcome line (named groups: ``outcome``, ``key``, each of :data:`FIELDS`, ``detail``).
OUTCOME_LINE = re.compile(
    r"pglock outcome=(?P<outcome>[a-z]+) (?P<key>key .+?) "
    + " ".join(f"{name}=(?P<{name}>{_VALUE})" for name in FIELDS)
    + r"(?: - (?P<detail>.*))?$"
)


def field_value(value: object) -> str:
    """One field's text: ``-`` for none, the text itself when it has no space or quote, else quoted."""
    if value is None or value == "":
        return NO_VALUE
    text = str(value)
    if any(ch.isspace() or ch in "'\"" for ch in text):
        return repr(text)
    return text


@dataclass(frozen=True)
class OutcomeContext:
    """What every outcome line of one guarded execution says.

    :param target: the lock database as configured, ``(database, server)``, for lines with
        no lock session (called lazily; None where it cannot tell).
    :param conn: the Airflow connection id (``dsn`` for a DSN).
    :param slots: the size of the pool ``key`` names (1: a plain lock).
    :param slot: the slot taken (1 to ``slots``), once one is.
    """

    key: LockKey
    mode: str
    shared: bool
    on_busy: str
    application_name: str | None
    target: Callable[[], tuple[str | None, str | None]]
    slots: int = 1
    slot: int | None = None
    conn: str | None = None

    @classmethod
    def of(
        cls,
        key: LockKey,
        policy: LockPolicy,
        application_name: str | None,
        database: LockDatabase,
        asked_on_busy: str | None = None,
    ) -> OutcomeContext:
        """The context of a guarded execution of ``key`` under ``policy`` in ``database``
        (``asked_on_busy``: the task's own ``on_busy``, where ``policy`` replaces it for one try)."""
        target = functools.partial(configured_target, database)
        mode, shared, slots = policy.mode, policy.shared, policy.slots
        on_busy = asked_on_busy or policy.on_busy
        return cls(key, mode, shared, on_busy, application_name, target, slots, conn=database.label)


@dataclass(frozen=True)
class Reported:
    """What one outcome line reports.

    :param outcome: ``completed``, ``skipped``, ``rescheduled``, ``deferred``, ``failed`` or ``lost``.
    :param server: the lock session's server, or None when no lock was taken.
    :param waited: seconds spent acquiring.
    :param detail: said after the fields (`` - <detail>``), if anything.
    :param held: seconds the lock was held, once released.
    :param holders: a busy key's holders (their pid, deployment and host are fields).
    :param counted_as: the outcome the metrics count, where it is not ``outcome`` (a work's own skip).
    """

    outcome: str
    server: ServerInfo | None
    waited: float
    detail: str | None = None
    held: float | None = None
    holders: Sequence[LockHolder] = ()
    counted_as: str | None = None


@dataclass(frozen=True)
class WorkEnding:
    """How guarded work that raised a signal which is no failure ended (an Airflow adapter's skip
    or reschedule): its outcome line's ``outcome`` and ``detail``, and what the metrics count it as
    (``work_skipped``, ``rescheduled``; ``skipped``: nothing beyond ``acquired``)."""

    outcome: str
    detail: str
    counted_as: str


class OutcomeLine:
    """Logs the first outcome reported and ignores the rest (``outcome`` holds it).

    :param log: where the line goes.
    :param context: what every line of the execution says.
    :param stats: gives the metrics client the outcome's metrics go to; None: no metrics.
    """

    def __init__(
        self, log: logging.Logger | Any, context: OutcomeContext, stats: Callable[[], Any] | None = None
    ) -> None:
        self.log = log
        self.context = context
        self.stats = stats
        self.outcome: str | None = None

    def report(self, reported: Reported) -> None:
        """Log ``reported`` if it is the first outcome, and send its metrics."""
        if self.outcome is not None:
            return
        outcome, server, detail = reported.outcome, reported.server, reported.detail
        self.outcome = outcome
        line = self.line(reported)
        if (outcome == "completed" and not detail) or outcome in {"skipped", "rescheduled", "deferred"}:
            self.log.info(line)
        else:
            self.log.error(line) if outcome in {"failed", "lost"} else self.log.warning(line)
        if self.stats is None:
            return
        context = self.context
        busy = server is None and bool(detail and detail.startswith("busy"))
        in_use = None  # a pool: how many slots were held at least (slots are tried in order)
        if context.slots > 1:
            in_use = context.slot if server is not None else (context.slots if busy else None)
        record_outcome(
            self.stats,
            reported.counted_as or ("busy" if busy and outcome == "failed" else outcome),
            acquired=server is not None,
            waited=reported.waited,
            held=reported.held,
            tags=metric_tags(
                application_name=context.application_name,
                mode=context.mode,
                shared=context.shared,
                on_busy=context.on_busy,
                slots=context.slots,
            ),
            pool_in_use=in_use,
        )

    def acquired(self, key: LockKey, server: ServerInfo, waited: float) -> None:
        """The ``pglock acquired`` line: the lock was taken (the outcome line follows when it ends)."""
        context = self.context
        self.log.info(
            "pglock acquired %s (%s, %s) database=%r server=%s pid=%s in %.3fs",
            key.describe(),
            context.mode,
            "shared" if context.shared else "exclusive",
            server.database,
            server.server,
            server.backend_pid,
            waited,
        )

    def line(self, reported: Reported) -> str:
        """The outcome line itself (see the module's docstring)."""
        context, server, held = self.context, reported.server, reported.held
        deployment, host = holder_where(context.application_name)
        database: str | None
        address: str | None
        pid: int | None = None
        if server is not None:
            database, address, pid = server.database, server.server, server.backend_pid
        else:
            database, address = context.target()
        granted = [holder for holder in reported.holders if holder.granted]
        values = {
            "mode": context.mode,
            "deployment": deployment,
            "host": host,
            "conn": context.conn,
            "database": database,
            "server": address,
            "pid": pid,
            "waited": f"{reported.waited:.3f}s",
            "held": None if held is None else f"{held:.3f}s",
            "holder_pid": _joined(h.pid for h in granted),
            "holder_deployment": _joined(h.deployment for h in granted),
            "holder_host": _joined(h.host for h in granted),
        }
        fields = " ".join(f"{name}={field_value(values[name])}" for name in FIELDS)
        line = f"pglock outcome={reported.outcome} {context.key.describe()} {fields}"
        return f"{line} - {_one_line(reported.detail)}" if reported.detail else line


def configured_target(database: LockDatabase) -> tuple[str | None, str | None]:
    """The lock database and server as configured, ``(database, host:port)``: for a line with no
    lock session (none was opened, or none is held); ``(None, None)`` where it cannot tell."""
    try:
        params = database.resolve_settings().params
    except Exception:  # the connection itself may be what is wrong; the error says why
        return None, None
    host = shown_param("host", params.get("host")) or "local socket"
    return shown_param("dbname", params.get("dbname")), f"{host}:{params.get('port') or 5432}"


def _one_line(text: str) -> str:
    """``text`` on one line: libpq's messages carry a newline and an indented hint; any other
    control character (from a message quoting what another session wrote) is shown escaped."""
    return printable(re.sub(r"\s*\n\s*", " ", text.strip()))


def _joined(values: Any) -> str | None:
    """A pool's holders: ``a,b`` (``-`` for one that has no value); None when there are none."""
    texts = [NO_VALUE if value is None else str(value) for value in values]
    return ",".join(texts) if texts and any(text != NO_VALUE for text in texts) else None
