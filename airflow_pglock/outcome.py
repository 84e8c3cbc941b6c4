"""The one outcome line (and metric) of a guarded execution.

``pglock outcome=<completed|skipped|deferred|failed|lost> <key> mode=... database=... server=...
pid=... waited=...s held=...s - <detail>``: exactly one per execution, whatever happens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from airflow_pglock.hooks.advisory_lock import ServerInfo
from airflow_pglock.keys import LockKey
from airflow_pglock.metrics import metric_tags, record_outcome


@dataclass(frozen=True)
class OutcomeContext:
    """What every outcome line of one guarded execution says.

    :param target: describes the lock database when no connection was made (called lazily).
    :param slots: the size of the pool ``key`` names (1: a plain lock).
    :param slot: the slot taken (1 to ``slots``), once one is.
    """

    key: LockKey
    mode: str
    shared: bool
    on_busy: str
    application_name: str | None
    target: Callable[[], str]
    slots: int = 1
    slot: int | None = None


class OutcomeLine:
    """Logs the first outcome reported and ignores the rest (``outcome`` holds it)."""

    def __init__(self, log: logging.Logger | Any, context: OutcomeContext) -> None:
        self.log = log
        self.context = context
        self.outcome: str | None = None

    def report(
        self,
        outcome: str,
        *,
        server: ServerInfo | None,
        waited: float,
        detail: str | None = None,
        held: float | None = None,
    ) -> None:
        """Log ``outcome`` once.

        :param server: the lock session's server, or None when no lock was taken.
        :param waited: seconds spent acquiring.
        :param held: seconds the lock was held, once released.
        """
        if self.outcome is not None:
            return
        self.outcome = outcome
        context = self.context
        parts = [f"pglock outcome={outcome}", context.key.describe(), f"mode={context.mode}"]
        if server is not None:
            parts += [
                f"database={server.database!r}",
                f"server={server.server}",
                f"pid={server.backend_pid}",
                f"waited={waited:.3f}s",
            ]
        else:
            parts.append(f"target={context.target()}")
            parts.append(f"waited={waited:.3f}s")
        if held is not None:
            parts.append(f"held={held:.3f}s")
        if detail:
            parts.append(f"- {detail}")
        line = " ".join(part for part in parts if part)
        if (outcome == "completed" and not detail) or outcome in {"skipped", "deferred"}:
            self.log.info(line)
        else:
            self.log.error(line) if outcome in {"failed", "lost"} else self.log.warning(line)
        busy = server is None and bool(detail and detail.startswith("busy"))
        in_use = None  # a pool: how many slots were held at least (slots are tried in order)
        if context.slots > 1:
            in_use = context.slot if server is not None else (context.slots if busy else None)
        record_outcome(
            "busy" if busy and outcome == "failed" else outcome,
            acquired=server is not None,
            waited=waited,
            held=held,
            tags=metric_tags(
                application_name=context.application_name,
                mode=context.mode,
                shared=context.shared,
                on_busy=context.on_busy,
                slots=context.slots,
            ),
            pool_in_use=in_use,
        )
