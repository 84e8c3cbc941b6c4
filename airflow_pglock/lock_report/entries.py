"""The entries of a lock report: each advisory lock held or awaited, its key named and its
holder explained (DAG / task / run from the ``application_name``, pid, client, since when).

A key's name comes from, in order: the key-name registry (``airflow-pglock init-db``),
or the default key of the DAG / task named by a holder's or waiter's application_name
(``<dag_id>/<task_id>`` hashes to the key). Otherwise it is unknown (None).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_pglock.exceptions import InvalidLockKeyError
from airflow_pglock.identity import holder_where, is_provider_session, name_token, parse_application_name
from airflow_pglock.keys import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_SLOTS,
    SLOT_SEPARATOR,
    LockKey,
    names_a_slot,
    pool_presence_marker,
)

if TYPE_CHECKING:
    from airflow_pglock.holder import LockHolder, LockSnapshot
    from airflow_pglock.pg.key_names import RegisteredName


_NUMBERS = re.compile(r"\s*-?\d+\s*(,\s*-?\d+\s*)*")
#: pg_locks shows a pair key's two int32 as unsigned oids (``-1`` as 4294967295).
_OID_SPAN = 2**32


def parse_key_filter(text: str) -> list[LockKey]:
    """The keys a ``--key`` value may mean: the name, and also the int64 or ``A,B`` pair it spells.

    A pair may be copied from ``pg_locks`` (classid, objid): unsigned oids, read back as int32.
    Numbers that are no key (out of range, three of them) leave the name alone: a key name may
    be made of digits (``2024,01,15``); :func:`key_filter_note` says so when nothing matched.
    """
    candidates = [LockKey.from_name(text)]
    numbers = _numbers_key(text)
    if numbers is not None:
        candidates.append(numbers)
    return candidates


def key_filter_note(text: str) -> str | None:
    """Why ``--key`` numbers found nothing as numbers: they are no advisory key (read as a name only)."""
    if not _NUMBERS.fullmatch(text):
        return None
    try:
        _numbers_key(text, strict=True)
    except InvalidLockKeyError as error:
        return (
            f"--key {text!r} is numbers but no advisory key ({error}), so it was looked up as a key name only: "
            f"an int64 is {INT64_MIN} to {INT64_MAX}, a pair 'A,B' two int32 (as pg_locks shows them, "
            f"classid,objid: 0 to {_OID_SPAN - 1} also)"
        )
    return None


def _numbers_key(text: str, *, strict: bool = False) -> LockKey | None:
    if not _NUMBERS.fullmatch(text):
        return None
    numbers = [int(part) for part in text.split(",")]
    try:
        if len(numbers) == 1:
            return LockKey.from_int(numbers[0])
        if len(numbers) == 2:
            first, second = (n - _OID_SPAN if INT32_MAX < n < _OID_SPAN else n for n in numbers)
            return LockKey.from_pair(first, second)
        raise InvalidLockKeyError(f"{len(numbers)} numbers")
    except InvalidLockKeyError:
        if strict:
            raise
        return None


@dataclass(frozen=True)
class AirflowHolder:
    """The Airflow task instance a lock session's application_name names (``~`` = shortened).

    :param deployment: its deployment (the host when unnamed); None: an older provider version.
    :param host: the host it runs on; None: an older provider version.
    """

    dag_id: str
    task_id: str
    run_id: str
    map_index: int
    deployment: str | None = None
    host: str | None = None


@dataclass(frozen=True)
class LockEntry:
    """One session holding or waiting for one key, named and explained, ready to show.

    :param key: the key, from the holder's ``pg_locks`` coordinates.
    :param names: every name recorded or derived for the key (two or more: a collision).
    :param name_source: ``registry``, ``application_name`` or None (name unknown).
    :param holder: the session, as the holders query read it.
    :param airflow: the task instance its application_name names, if any.
    :param since: holders: when the lock session started (airflow-pglock opens one per
        lock) or, for other sessions, when the session started (the lock may be younger);
        waiters: when the wait started (PostgreSQL 14+).
    :param since_basis: which of those ``since`` is.
    :param seconds: how long, on the server clock, up to the snapshot.
    """

    key: LockKey
    names: tuple[str, ...]
    name_source: str | None
    holder: LockHolder
    airflow: AirflowHolder | None
    since: dt.datetime | None
    since_basis: str | None
    seconds: float | None

    @property
    def name(self) -> str | None:
        return self.names[0] if self.names else None

    @property
    def collision(self) -> bool:
        return len(self.names) > 1

    @property
    def deployment(self) -> str | None:
        """The holder's deployment, as its application_name names it (the host when unnamed)."""
        return holder_where(self.holder.application_name)[0]

    @property
    def host(self) -> str | None:
        """The holder's host, as its application_name names it; None for other applications."""
        return holder_where(self.holder.application_name)[1]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; its keys are a stable interface (documented in docs/operations.md)."""
        holder = self.holder
        return {
            "database": holder.database,
            "key": {
                "name": self.name,
                "names": list(self.names),
                "name_source": self.name_source,
                "collision": self.collision,
                "kind": "pair" if self.key.is_pair else "int64",
                "numbers": list(self.key.numbers),
                "pg_locks": dict(zip(("classid", "objid", "objsubid"), self.key.pg_locks, strict=True)),
            },
            "state": "holding" if holder.granted else "waiting",
            "mode": "shared" if holder.shared else "exclusive",
            "pid": holder.pid,
            "application_name": holder.application_name,
            "deployment": self.deployment,
            "host": self.host,
            "airflow": None
            if self.airflow is None
            else {
                "dag_id": self.airflow.dag_id,
                "task_id": self.airflow.task_id,
                "run_id": self.airflow.run_id,
                "map_index": self.airflow.map_index,
            },
            "user": holder.user,
            "client_addr": holder.client_addr,
            "client": holder.client,
            "client_port": holder.client_port,
            "backend_type": holder.backend_type,
            "session_state": holder.state,
            "since": self.since.isoformat() if self.since else None,
            "since_basis": self.since_basis,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "waiters": holder.waiters if holder.granted else 0,
            "blocked_by": list(holder.blocked_by),
        }


def _airflow_holder(application_name: str | None) -> AirflowHolder | None:
    parsed = parse_application_name(application_name)
    if parsed is None:
        return None
    return AirflowHolder(parsed.dag_id, parsed.task_id, parsed.run_id, parsed.map_index, parsed.deployment, parsed.host)


def _derived_name(key: LockKey, rows: Sequence[LockHolder]) -> str | None:
    for row in rows:
        holder = _airflow_holder(row.application_name)
        if holder is None:
            continue
        candidate = LockKey.for_task(holder.dag_id, holder.task_id)
        if candidate.pg_locks == key.pg_locks:
            return candidate.name
    return None


def _since(row: LockHolder, holder: AirflowHolder | None, keys_held: int) -> tuple[dt.datetime | None, str | None]:
    """When ``row``'s hold began, as far as pg_stat_activity tells, and on what basis.

    :param keys_held: how many keys ``row``'s session holds: more than one, it is a lock session
        whose later keys (``lock.try_lock``) are younger than the session.
    """
    if not row.granted:
        return row.waiting_since, "wait start" if row.waiting_since else None
    if row.since is None:
        return None, None
    if keys_held > 1:
        return row.since, "session start (a key this lock session took later is younger)"
    if holder is not None or is_provider_session(row.application_name):  # one session per lock
        return row.since, "lock session start"
    return row.since, "session start (the lock may be younger)"


def pool_marker_classes(names: Iterable[str]) -> frozenset[int]:
    """The pg_locks classids of the markers of pools with these names (``keys.pool_size_marker``)."""
    return frozenset(pool_presence_marker(LockKey.from_name(name)).pg_locks[0] for name in names)


def _pool_markers(rows: Sequence[LockHolder], known: frozenset[int]) -> set[int]:
    """The rows (by ``id``) that are a pool holder's two markers (``keys.pool_size_marker``): not
    locks of their own, left out of the report. A session holds them in shared mode as a pair, one
    classid with objid 0 (presence) and objid 2..MAX_SLOTS (size), which is what is looked for.

    Any program may hold such a pair of its own: it is left out only when its classid is that of
    a pool the report knows (``known``: from the registry, or ``--pool``), or its session is an
    airflow-pglock one, and nobody waits for either marker (a pool's own checks only try them,
    never wait). A foreign holder is never hidden behind the look of a marker."""
    shared: dict[tuple[str, int | None, int], dict[int, LockHolder]] = {}
    for row in rows:
        if row.granted and row.shared and row.objsubid == 1 and (row.objid == 0 or 2 <= row.objid <= MAX_SLOTS):
            shared.setdefault((row.database, row.pid, row.classid), {})[row.objid] = row
    found: set[int] = set()
    for (_, _, classid), by_objid in shared.items():
        sizes = [objid for objid in by_objid if objid != 0]
        if 0 not in by_objid or len(sizes) != 1:
            continue
        pair = (by_objid[0], by_objid[sizes[0]])
        if any(row.waiters for row in pair):
            continue
        if classid in known or is_provider_session(pair[0].application_name):
            found |= {id(row) for row in pair}
    return found


def build_entries(
    snapshot: LockSnapshot, registered: Sequence[RegisteredName] | None, pools: Iterable[str] = ()
) -> tuple[LockEntry, ...]:
    """Name and explain every row of ``snapshot``.

    :param registered: the registry's names for the snapshot's keys (None: no registry).
    :param pools: names of pools known otherwise (``--pool``), whose markers are left out too.
    """
    by_key: dict[tuple[str, tuple[int, int, int]], list[LockHolder]] = {}
    pool_names = set(pools)
    for recorded in registered or ():
        if recorded.slots is not None and recorded.slots > 1:  # a slot of a pool: the name, or its base
            name = recorded.name
            pool_names.add(name.rpartition(SLOT_SEPARATOR)[0] if names_a_slot(name) else name)
    markers = _pool_markers(snapshot.rows, pool_marker_classes(pool_names))
    for row in snapshot.rows:
        if id(row) not in markers:
            by_key.setdefault((row.database, row.coordinates), []).append(row)
    keys_held: dict[tuple[str, int | None], int] = {}
    for rows_of_key in by_key.values():
        for row in rows_of_key:
            if row.granted:
                keys_held[(row.database, row.pid)] = keys_held.get((row.database, row.pid), 0) + 1
    names_by_coordinates: dict[tuple[int, int, int], list[str]] = {}
    for registered_name in registered or ():
        coordinates = (registered_name.classid, registered_name.objid, registered_name.objsubid)
        names_by_coordinates.setdefault(coordinates, []).append(registered_name.name)

    entries: list[LockEntry] = []
    for (database, coordinates), rows in by_key.items():
        key = LockKey.from_pg_locks(*coordinates)
        # The registry lives in one database: its names only describe that database's keys.
        names = list(names_by_coordinates.get(coordinates, [])) if database == snapshot.database else []
        source: str | None = "registry" if names else None
        if not names:
            derived = _derived_name(key, rows)
            if derived is not None:
                names, source = [derived], "application_name"
        for row in rows:
            holder = _airflow_holder(row.application_name)
            since, basis = _since(row, holder, keys_held.get((row.database, row.pid), 0))
            entries.append(
                LockEntry(
                    key=key,
                    names=tuple(names),
                    name_source=source,
                    holder=row,
                    airflow=holder,
                    since=since,
                    since_basis=basis,
                    seconds=None if since is None else max(0.0, (snapshot.taken_at - since).total_seconds()),
                )
            )
    return tuple(entries)


def filter_entries(
    entries: Sequence[LockEntry], *, dag: str | None = None, key: str | None = None
) -> tuple[LockEntry, ...]:
    """Entries of keys that a session of DAG ``dag`` holds or awaits, and/or of key ``key``.

    A key matches ``key`` when one of its names equals it, or when its numbers are what
    the text means as a name, an int64 or an ``A,B`` pair. All sessions of a matching key
    are kept (holders and waiters), so the answer shows who blocks whom.
    """
    selected = list(entries)
    if key is not None:
        wanted = {candidate.pg_locks for candidate in parse_key_filter(key)}
        selected = [e for e in selected if e.key.pg_locks in wanted or key in e.names]
    if dag is not None:
        keys_of_dag = {
            (e.holder.database, e.key.pg_locks) for e in selected if e.airflow and _shows_dag(e.airflow.dag_id, dag)
        }
        selected = [e for e in selected if (e.holder.database, e.key.pg_locks) in keys_of_dag]
    return tuple(selected)


def _shows_dag(shown: str, dag: str) -> bool:
    """Whether the DAG id an ``application_name`` shows is ``dag``: spelt as a name token (ASCII:
    another character as ``?``; a space or ``@`` as ``_``), and a long id shortened, ending in
    ``~`` (:mod:`airflow_pglock.identity`)."""
    spelt = name_token(dag)
    return shown == spelt or (shown.endswith("~") and spelt.startswith(shown[:-1]))
