"""The SQL of wake-ups: a released key is announced, waiters listen for it and read what is held.

A guard that releases a key announces it in the unlock statement itself
(``pg_notify`` on :data:`RELEASED_CHANNEL`, payload :func:`payload`): no extra round
trip, and the notification is sent when the statement commits (at once: lock
connections are autocommit). The triggerer's waiters share one connection that
``LISTEN`` s on the channel and reads, in one statement, which of the keys it waits for
are held (:func:`aheld`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import psycopg

from airflow_pglock.keys import LockKey

#: The channel a released key is announced on.
RELEASED_CHANNEL = "pglock_released"

Coordinates = tuple[int, int, int]

EXCLUSIVE_MODE = "ExclusiveLock"


def payload(key: LockKey) -> str:
    """The announcement of ``key``: its ``pg_locks`` coordinates, ``classid/objid/objsubid``."""
    return "/".join(str(number) for number in key.pg_locks)


def coordinates(text: str) -> Coordinates | None:
    """The coordinates in an announcement (None for a payload that is not one)."""
    parts = text.split("/")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


async def alisten(conn: psycopg.AsyncConnection[Any]) -> None:
    """Start listening for released keys on ``conn`` (autocommit)."""
    await conn.execute(f"LISTEN {RELEASED_CHANNEL}")


async def aheld(conn: psycopg.AsyncConnection[Any], keys: Collection[Coordinates]) -> dict[Coordinates, bool]:
    """For each held key among ``keys``: True when some session holds it exclusively.

    One statement for all the keys; a key absent from the result is free. Reads
    ``pg_locks`` only (takes nothing).
    """
    if not keys:
        return {}
    classids, objids, objsubids = (list(column) for column in zip(*keys, strict=True))
    cursor = await conn.execute(
        "SELECT l.classid::bigint, l.objid::bigint, l.objsubid::int, bool_or(l.mode = %s)"
        " FROM pg_catalog.pg_locks l"
        " JOIN unnest(%s::bigint[], %s::bigint[], %s::int[]) AS k(classid, objid, objsubid)"
        " ON l.classid::bigint = k.classid AND l.objid::bigint = k.objid AND l.objsubid::int = k.objsubid"
        " WHERE l.locktype = 'advisory' AND l.granted"
        " AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())"
        " GROUP BY 1, 2, 3",
        [EXCLUSIVE_MODE, classids, objids, objsubids],
    )
    return {(row[0], row[1], row[2]): bool(row[3]) for row in await cursor.fetchall()}
