"""Pools of slots (``slots=N``) in SQL: the size check every holder of a pool runs in its lock
statement, the markers a pool's holder holds, and the refusal of a holder whose size disagrees.

A pool's size is checked at run time by ``pg_locks`` alone, so deployments that share only
the lock database agree on it (docs/howto-slots.md).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg

from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.holder import SHARED_MODE, describe_holders
from airflow_pglock.keys import LockKey, pool_presence_marker, pool_size_marker
from airflow_pglock.pg.holders import read_holders
from airflow_pglock.pg.sql import advisory_here

# The size of a pool is checked at run time, in its lock statement, by pg_locks alone (it works
# without the registry, across deployments that share only the lock database): every holder of
# a pool of N slots holds, in shared mode, the pool's size marker (classid: a hash of the name,
# objid: N) and its presence marker (objid 0), taken BEFORE it looks; it looks for a size marker
# with another N, and for a holder of the pool's key (slot 1) without a presence marker (a plain
# key of that name, or an older airflow-pglock); only if there is none does it try a slot. Of two
# holders that disagree, the one that looks second sees the other's marker: both may refuse,
# never both pass. A failed marker try is a refusal too: the presence marker held exclusively is
# a plain key of the name being taken right now; a size marker held exclusively is somebody
# else's key (an int64 of another program that happens to be the marker). The answer is NULL, or
# ARRAY[kind, other N, pid]; the refused statement takes no slot, and its session is closed.
POOL_CHECK = (
    "CASE WHEN NOT {shared_try}(%(presence)s::bigint) THEN ARRAY['plain', '0', '0']"
    " WHEN NOT {shared_try}(%(size_marker)s::bigint) THEN ARRAY['marker', '0', '0']"
    " ELSE (WITH held AS (SELECT pid, classid::bigint AS c, objid::bigint AS o FROM pg_catalog.pg_locks"
    " WHERE granted AND objsubid = 1 AND " + advisory_here() + ")"
    " SELECT ARRAY[kind, n::text, pid::text] FROM ("
    "SELECT 1 AS rank, 'size' AS kind, o AS n, pid FROM held"
    " WHERE c = %(marker_class)s AND o BETWEEN 2 AND {max_slots} AND o <> %(pool_size)s"
    " UNION ALL SELECT 2, 'plain', 1, pid FROM held h WHERE c = %(pool_class)s AND o = %(pool_objid)s"
    " AND NOT EXISTS (SELECT 1 FROM held m WHERE m.pid = h.pid AND m.c = %(marker_class)s AND m.o = 0)"
    ") found ORDER BY rank, pid LIMIT 1) END"
)
# A plain key of a name (slots=1) takes its key first, then asks whether a pool of that name is in
# use: its presence marker, tried exclusively and given back at once (a session-level try in
# either scope, so that it ends now). Key first, marker second: a pool that looks after the marker
# try sees the key held in pg_locks. The try also fails while another plain user of the name makes
# the same momentary try: only a marker held in shared mode (by a pool), read in pg_locks, refuses.
# The lock statement does not read pg_locks itself: a statement that names it costs a fresh
# backend ~1.8 ms to plan (measured; every guarded run is a fresh backend), CASE or not. It answers
# 1: taken; 0: busy; 2 / -2: taken / busy, but the marker was busy: pool_in_use settles it in a
# second statement, as after a wait. The plain key stays held (or was busy) meanwhile, so a pool
# that comes later sees it and refuses, and a pool that held its marker and is still there is seen.
_POOL_SEEN = (
    f"EXISTS (SELECT 1 FROM pg_catalog.pg_locks WHERE granted AND mode = '{SHARED_MODE}'"
    " AND objsubid = 1 AND classid::bigint = %(marker_class)s AND objid::bigint = 0 AND " + advisory_here() + ")"
)
_NO_POOL = (
    "CASE WHEN pg_catalog.pg_try_advisory_lock(%(presence)s::bigint) THEN"
    " pg_catalog.pg_advisory_unlock(%(presence)s::bigint)"
    " ELSE NOT " + _POOL_SEEN + " END"
)
_MARKER_FREE = (
    "CASE WHEN pg_catalog.pg_try_advisory_lock(%(presence)s::bigint) THEN"
    " pg_catalog.pg_advisory_unlock(%(presence)s::bigint) END"
)
PLAIN_CHECK = (
    "CASE WHEN {attempt} THEN (CASE WHEN " + _MARKER_FREE + " THEN 1 ELSE 2 END)"
    " ELSE (CASE WHEN " + _MARKER_FREE + " THEN 0 ELSE -2 END) END"
)
#: PLAIN_CHECK's answers when the presence marker was busy (taken, busy): ask pool_in_use.
MARKER_BUSY = {2: True, -2: False}
_PRESENCE_CHECK = "SELECT " + _NO_POOL


def pool_params(pool: LockKey, slots: int) -> dict[str, Any]:
    """The parameters of :data:`POOL_CHECK` / :data:`PLAIN_CHECK` for the pool named ``pool``."""
    presence = pool_presence_marker(pool)
    classid, objid, _ = pool.pg_locks
    return {
        "presence": presence.int64,
        "size_marker": pool_size_marker(pool, slots).int64 if slots > 1 else None,
        "marker_class": presence.pg_locks[0],
        "pool_size": slots,
        "pool_class": classid,
        "pool_objid": objid,
    }


def pool_markers(pool: LockKey, slots: int) -> tuple[LockKey, ...]:
    """The markers a holder of a pool of ``slots`` slots holds in shared mode (none for a plain key)."""
    return () if slots == 1 else (pool_presence_marker(pool), pool_size_marker(pool, slots))


def pool_in_use(conn: psycopg.Connection[Any], key: LockKey) -> bool:
    """Whether a pool named as ``key`` is held now (its presence marker is held): asked by a plain
    key after a wait that took it."""
    presence = pool_presence_marker(key)
    params = {"presence": presence.int64, "marker_class": presence.pg_locks[0]}
    row = conn.execute(_PRESENCE_CHECK, params).fetchone()  # type: ignore[arg-type]  # static SQL from this module
    return not (row and row[0])


def pool_conflict_error(
    conn: psycopg.Connection[Any], pool: LockKey, slots: int, conflict: tuple[str, int, int]
) -> LockConfigurationError:
    """The refusal of a pool whose size disagrees with another holder's, or of a plain key on a
    pool's name (and the other way round), naming the pool, both sizes and who holds the other.
    Nothing is held past it: the caller gives back what the statement took (markers, the key) and
    closes the session."""
    kind, other_size, pid = conflict
    size = "a plain key (slots=1)" if slots == 1 else f"a pool of slots={slots}"
    if kind == "size":
        who_keys = [pool_size_marker(pool, other_size)]
        other = f"a pool of slots={other_size}"
    elif kind == "marker":
        who_keys = [pool_size_marker(pool, slots)]
        other = "another program whose own int64 key is this pool's size marker"
    elif kind == "plain":
        who_keys = [pool, pool_presence_marker(pool)]
        other = "a plain key of that name (slots=1), or an airflow-pglock too old to check pool sizes"
    else:  # a plain key refused: a pool of the name is in use
        who_keys = [pool_presence_marker(pool)]
        other = "a pool of that name (slots=2 or more)"
    try:
        holders = [h for h in read_holders(conn, who_keys[0], *who_keys[1:]) if h.pid != conn.info.backend_pid]
        if pid:
            holders = [h for h in holders if h.pid == pid] or holders
        who = describe_holders(holders, dt.datetime.now(dt.timezone.utc), nobody=f"pid {pid or 'unknown'}")
    except psycopg.Error as error:
        who = f"pid {pid or 'unknown'} (its details could not be read: {type(error).__name__})"
    return LockConfigurationError(
        f"pglock refused {size} on {pool.describe()}: it is in use right now as {other}, held by {who}. "
        "Every user of a pool's name must say the same slots=N (a plain key of the name is slot 1 of every pool "
        "of that name): give them one size, or another key name; nothing was taken (docs/howto-slots.md)"
    )
