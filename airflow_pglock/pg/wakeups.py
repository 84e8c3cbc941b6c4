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

from airflow_pglock.holder import EXCLUSIVE_MODE
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.sql import IN_RECOVERY, advisory_here, refuse_a_standby

#: The channel a released key is announced on.
RELEASED_CHANNEL = "pglock_released"

Coordinates = tuple[int, int, int]


def payload(key: LockKey) -> str:
    """The announcement of ``key``: its ``pg_locks`` coordinates, ``classid/objid/objsubid``."""
    classid, objid, objsubid = key.pg_locks
    return f"{classid}/{objid}/{objsubid}"


#: The largest ``classid`` / ``objid`` (unsigned 32-bit oids); an advisory key's ``objsubid``.
MAX_OID = 2**32 - 1
ADVISORY_OBJSUBIDS = (1, 2)
#: The longest announcement :func:`payload` writes: ``4294967295/4294967295/2``.
LONGEST_PAYLOAD = 2 * len(str(MAX_OID)) + 3


def coordinates(text: str) -> Coordinates | None:
    """The coordinates in an announcement; None for any other payload. Never raises.

    Anyone who may connect can NOTIFY the channel, so only what :func:`payload` writes is
    read: three ASCII decimal numbers without signs, spaces or leading zeros, an oid each
    and an advisory key's ``objsubid`` (1 or 2) last.
    """
    if len(text) > LONGEST_PAYLOAD or not text.isascii():
        return None
    parts = text.split("/")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):  # ASCII: isdigit() is 0-9 only
        return None
    classid, objid, objsubid = (int(part) for part in parts)
    if classid > MAX_OID or objid > MAX_OID or objsubid not in ADVISORY_OBJSUBIDS:
        return None
    if f"{classid}/{objid}/{objsubid}" != text:  # leading zeros: not how a guard writes it
        return None
    return classid, objid, objsubid


async def alisten(conn: psycopg.AsyncConnection[Any]) -> None:
    """Start listening for released keys on ``conn`` (autocommit); a standby in recovery is refused
    (:class:`~airflow_pglock.exceptions.UnsafeSetupError`): it cannot LISTEN, and its pg_locks
    holds none of the primary's locks."""
    row = await (await conn.execute(IN_RECOVERY)).fetchone()
    refuse_a_standby(conn.info, bool(row and row[0]))
    await conn.execute(f"LISTEN {RELEASED_CHANNEL}")


async def aheld(conn: psycopg.AsyncConnection[Any], keys: Collection[Coordinates]) -> dict[Coordinates, bool]:
    """For each held key among ``keys``: True when some session holds it exclusively or waits
    for it exclusively (a new shared request queues behind that one: not free for a shared lock).

    One statement for all the keys; a key absent from the result is free. Reads
    ``pg_locks`` only (takes nothing).
    """
    if not keys:
        return {}
    classids, objids, objsubids = (list(column) for column in zip(*keys, strict=True))
    # Whether the server is a standby travels with the read (a row of NULLs when no key is held).
    cursor = await conn.execute(
        "SELECT h.*, r.standby FROM (SELECT pg_catalog.pg_is_in_recovery() AS standby) r LEFT JOIN LATERAL ("
        "SELECT l.classid::bigint, l.objid::bigint, l.objsubid::int, pg_catalog.bool_or(l.mode = %s)"
        " FROM pg_catalog.pg_locks l"
        " JOIN ROWS FROM (pg_catalog.unnest(%s::bigint[]), pg_catalog.unnest(%s::bigint[]),"
        " pg_catalog.unnest(%s::int[])) AS k(classid, objid, objsubid)"
        " ON l.classid::bigint = k.classid AND l.objid::bigint = k.objid AND l.objsubid::int = k.objsubid"
        " WHERE (l.granted OR l.mode = %s) AND " + advisory_here("l.") + " GROUP BY 1, 2, 3) h ON true",
        [EXCLUSIVE_MODE, classids, objids, objsubids, EXCLUSIVE_MODE],
    )
    rows = await cursor.fetchall()
    held = {(row[0], row[1], row[2]): bool(row[3]) for row in rows if row[0] is not None}
    if len(held) < len(set(keys)):  # a key is free: only a primary may say so
        refuse_a_standby(conn.info, bool(rows[0][4]))
    return held
