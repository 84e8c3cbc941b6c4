"""AdvisoryLockTrigger: wait in the triggerer until an advisory lock key is free.

It only reads ``pg_locks`` (through the hook's async holders query), never takes the
key, and holds no connection between two polls. It carries no secret: its kwargs name
the Airflow connection, which is resolved in the triggerer. Its deadline is absolute, so
a trigger that is restarted or runs twice (triggerer failover) neither extends the
wait nor changes the outcome.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import psycopg

from airflow_pglock.compat import BaseTrigger, TriggerEvent
from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError, PgLockError
from airflow_pglock.hooks.advisory_lock import DEFAULT_CONNECT_TIMEOUT, AdvisoryLockHook
from airflow_pglock.hooks.holders import blocking_holders, describe_holders
from airflow_pglock.keys import LockKey

#: ``event["status"]`` values.
FREE, TIMEOUT, ERROR = "free", "timeout", "error"


class AdvisoryLockTrigger(BaseTrigger):
    """Fire once the key has no holder, or at the deadline, or on an error.

    Events: ``{"status": "free"}``; ``{"status": "timeout", "holders": ...}`` when the
    key is still held at ``deadline``; ``{"status": "error", "error_type": ...}`` when
    the lock database cannot be read. Each event has a ``message`` naming the key.

    :param key_name: the key's human name (None for a bare numeric key).
    :param key_numbers: the key's numbers: ``[int64]`` or ``[int32, int32]``.
    :param postgres_conn_id: the Airflow connection of the lock database (resolved in the triggerer).
    :param poll_interval: seconds between two reads of ``pg_locks``.
    :param deadline: UNIX time after which a still-held key ends the wait (None: no deadline).
    :param shared: wait only for exclusive holders to go (the key is free for a shared lock).
    :param connect_timeout: seconds to wait for each connection.
    """

    def __init__(
        self,
        *,
        key_name: str | None,
        key_numbers: Sequence[int],
        postgres_conn_id: str,
        poll_interval: float = 60.0,
        deadline: float | None = None,
        shared: bool = False,
        connect_timeout: int = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        super().__init__()
        numbers = list(key_numbers)
        if len(numbers) == 2:
            self.key = LockKey.from_pair(numbers[0], numbers[1], name=key_name)
        elif len(numbers) == 1:
            self.key = LockKey.from_int(numbers[0], name=key_name)
        else:
            raise InvalidLockKeyError(f"key_numbers must be [int64] or [int32, int32], got {key_numbers!r}")
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, int | float) or not poll_interval > 0:
            raise LockConfigurationError(f"poll_interval must be a positive number of seconds, got {poll_interval!r}")
        if deadline is not None and (isinstance(deadline, bool) or not math.isfinite(deadline)):
            raise LockConfigurationError(f"deadline must be a UNIX time or None, got {deadline!r}")
        self.postgres_conn_id = postgres_conn_id
        self.poll_interval = float(poll_interval)
        self.deadline = None if deadline is None else float(deadline)
        self.shared = bool(shared)
        self.connect_timeout = connect_timeout

    @classmethod
    def for_key(
        cls,
        key: LockKey,
        *,
        postgres_conn_id: str,
        poll_interval: float,
        deadline: float | None,
        shared: bool = False,
    ) -> AdvisoryLockTrigger:
        """The trigger that waits for ``key``.

        :param key: the key to wait for.
        :param postgres_conn_id: the Airflow connection of the lock database.
        :param poll_interval: seconds between two reads.
        :param deadline: UNIX time of the deadline, or None.
        :param shared: wait only for exclusive holders to go.
        """
        return cls(
            key_name=key.name,
            key_numbers=list(key.numbers),
            postgres_conn_id=postgres_conn_id,
            poll_interval=poll_interval,
            deadline=deadline,
            shared=shared,
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Class path and kwargs: the key, the connection *id* (never its secrets), the deadline."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "key_name": self.key.name,
                "key_numbers": list(self.key.numbers),
                "postgres_conn_id": self.postgres_conn_id,
                "poll_interval": self.poll_interval,
                "deadline": self.deadline,
                "shared": self.shared,
                "connect_timeout": self.connect_timeout,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll ``pg_locks`` until the key is free, the deadline passes or the database fails."""
        hook = AdvisoryLockHook(self.postgres_conn_id, connect_timeout=self.connect_timeout)
        key = self.key.describe()
        while True:
            try:
                holders = await hook.aholders(self.key)
            except (PgLockError, psycopg.Error, OSError) as error:
                message = f"could not read who holds {key} ({type(error).__name__}: {error})"
                self.log.error("pglock trigger: %s", message)
                yield TriggerEvent({"status": ERROR, "error_type": type(error).__name__, "message": message})
                return
            now = dt.datetime.now(dt.timezone.utc)
            if not blocking_holders(holders, self.shared):
                yield TriggerEvent({"status": FREE, "message": f"{key} is free"})
                return
            who = describe_holders(holders, now)
            remaining = None if self.deadline is None else self.deadline - time.time()
            if remaining is not None and remaining <= 0:
                message = f"{key} is still held by {who} at the sensor's deadline"
                yield TriggerEvent({"status": TIMEOUT, "holders": who, "message": message})
                return
            self.log.info("pglock waiting: %s is held by %s", key, who)
            await asyncio.sleep(self.poll_interval if remaining is None else min(self.poll_interval, remaining))
