"""Every advisory lock in the database, named and explained: what ``locks`` and the UI page show.

The hook reads who holds what (``hooks/holders.py``: one query, one ``LockHolder``
record) and the registry's names (``hooks/schema.py``); this module turns them into
entries a person can act on (what invariant 6 of docs/architecture.md asks of whatever a
person sees): the key by its human name and numbers, the holder by DAG / task / run (from
its ``application_name``), pid, client and since when, and how many wait behind it. It
writes no SQL; :func:`collect_lock_report` only asks the hook.

A key's name comes from, in order: the key-name registry (``airflow-pglock init-db``),
or the default key of the DAG / task named by a holder's or waiter's application_name
(``<dag_id>/<task_id>`` hashes to the key). Otherwise it is unknown (None).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_pglock.identity import is_provider_session, parse_application_name
from airflow_pglock.keys import LockKey, slot_keys

if TYPE_CHECKING:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.hooks.holders import LockHolder, LockSnapshot
    from airflow_pglock.hooks.schema import RegisteredName

#: application_name of the sessions ``locks`` / the UI open to read (they hold no lock).
INSPECT_APPLICATION_NAME = "pglock-cli locks"

REGISTRY_INSTALLED = "installed"
REGISTRY_MISSING = "not installed"
REGISTRY_NO_ACCESS = "no access"


def parse_key_filter(text: str) -> list[LockKey]:
    """The keys a ``--key`` value may mean: the name, and also the int64 or ``A,B`` pair it spells."""
    candidates = [LockKey.from_name(text)]
    stripped = text.strip()
    try:
        if "," in stripped:
            first, second = (int(part) for part in stripped.split(","))
            candidates.append(LockKey.from_pair(first, second))
        else:
            candidates.append(LockKey.from_int(int(stripped)))
    except ValueError:  # not numbers (or out of range): a name only
        pass
    return candidates


@dataclass(frozen=True)
class AirflowHolder:
    """The Airflow task instance a lock session's application_name names (``~`` = shortened)."""

    dag_id: str
    task_id: str
    run_id: str
    map_index: int


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
            "client_port": holder.client_port,
            "backend_type": holder.backend_type,
            "session_state": holder.state,
            "since": self.since.isoformat() if self.since else None,
            "since_basis": self.since_basis,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "waiters": holder.waiters if holder.granted else 0,
            "blocked_by": list(holder.blocked_by),
        }


@dataclass(frozen=True)
class PoolUsage:
    """A pool of slots (``slots=N``) as one row: how many of its slots are held, and by whom.

    :param name: the pool's key name.
    :param slots: how many slots it has (as the reader says: the database does not know N).
    :param entries: the sessions holding or waiting for one of its slots.
    """

    name: str
    slots: int
    entries: tuple[LockEntry, ...]

    @property
    def held(self) -> int:
        return len({entry.key.pg_locks for entry in self.entries if entry.holder.granted})

    def describe(self) -> str:
        return f"{self.held} of {self.slots} held"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "slots": self.slots,
            "held": self.held,
            "summary": self.describe(),
            "holders": [entry.to_json() for entry in self.entries if entry.holder.granted],
        }


@dataclass(frozen=True)
class LockReport:
    """A snapshot of every (matching) advisory lock.

    :param registry: ``"installed"``, ``"not installed"`` or ``"no access"`` (the role
        may not read ``pglock.key_names``).
    """

    database: str
    server: str
    taken_at: dt.datetime
    all_databases: bool
    registry: str
    filters: Mapping[str, str | None]
    entries: tuple[LockEntry, ...] = field(default_factory=tuple)
    pool: PoolUsage | None = None

    def to_json(self) -> dict[str, Any]:
        pool = {} if self.pool is None else {"pool": self.pool.to_json()}  # only when a pool was asked for
        return {
            **pool,
            "database": self.database,
            "server": self.server,
            "server_time": self.taken_at.isoformat(),
            "all_databases": self.all_databases,
            "registry": self.registry,
            "filters": dict(self.filters),
            "locks": [entry.to_json() for entry in self.entries],
        }


def _airflow_holder(application_name: str | None) -> AirflowHolder | None:
    parsed = parse_application_name(application_name)
    if parsed is None:
        return None
    return AirflowHolder(parsed.dag_id, parsed.task_id, parsed.run_id, parsed.map_index)


def _derived_name(key: LockKey, rows: Sequence[LockHolder]) -> str | None:
    for row in rows:
        holder = _airflow_holder(row.application_name)
        if holder is None:
            continue
        candidate = LockKey.for_task(holder.dag_id, holder.task_id)
        if candidate.pg_locks == key.pg_locks:
            return candidate.name
    return None


def _since(row: LockHolder, holder: AirflowHolder | None) -> tuple[dt.datetime | None, str | None]:
    if not row.granted:
        return row.waiting_since, "wait start" if row.waiting_since else None
    if row.since is None:
        return None, None
    if holder is not None or is_provider_session(row.application_name):  # one session per lock
        return row.since, "lock session start"
    return row.since, "session start (the lock may be younger)"


def build_entries(snapshot: LockSnapshot, registered: Sequence[RegisteredName] | None) -> tuple[LockEntry, ...]:
    """Name and explain every row of ``snapshot``.

    :param registered: the registry's names for the snapshot's keys (None: no registry).
    """
    by_key: dict[tuple[str, tuple[int, int, int]], list[LockHolder]] = {}
    for row in snapshot.rows:
        by_key.setdefault((row.database, row.coordinates), []).append(row)
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
            since, basis = _since(row, holder)
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
        keys_of_dag = {(e.holder.database, e.key.pg_locks) for e in selected if e.airflow and e.airflow.dag_id == dag}
        selected = [e for e in selected if (e.holder.database, e.key.pg_locks) in keys_of_dag]
    return tuple(selected)


def collect_lock_report(
    hook: AdvisoryLockHook,
    *,
    dag: str | None = None,
    key: str | None = None,
    all_databases: bool = False,
    pool: str | None = None,
    slots: int = 1,
) -> LockReport:
    """Open one short connection, read every advisory lock and the registry's names, close.

    :param hook: where the lock database is.
    :param dag: keep only keys that a task of this DAG holds or awaits.
    :param key: keep only this key (a name, an int64 or ``A,B``).
    :param all_databases: also list other databases' advisory locks.
    :param pool: keep only the slots of this pool (a key name), summed up in ``report.pool``.
    :param slots: how many slots ``pool`` has.
    """
    import psycopg

    from airflow_pglock.hooks.holders import advisory_locks
    from airflow_pglock.hooks.schema import registered_names

    if key is not None:
        parse_key_filter(key)  # a bad key is a usage error before any connection
    pool_keys = None if pool is None else slot_keys(LockKey.from_name(pool), slots)
    with hook.connect(INSPECT_APPLICATION_NAME) as conn:
        snapshot = advisory_locks(conn, all_databases=all_databases)
        coordinates = sorted({row.coordinates for row in snapshot.rows if row.database == snapshot.database})
        registry = REGISTRY_INSTALLED
        try:
            registered = registered_names(conn, coordinates)
        except psycopg.errors.InsufficientPrivilege:
            registered, registry = None, REGISTRY_NO_ACCESS
        if registered is None and registry == REGISTRY_INSTALLED:
            registry = REGISTRY_MISSING
        server = hook.describe_target()
    entries = filter_entries(build_entries(snapshot, registered), dag=dag, key=key)
    usage = None
    if pool is not None and pool_keys is not None:
        entries = pool_entries(entries, pool_keys, snapshot.database)
        usage = PoolUsage(pool, slots, entries)
    return LockReport(
        database=snapshot.database,
        server=server,
        taken_at=snapshot.taken_at,
        all_databases=all_databases,
        registry=registry,
        filters={"dag": dag, "key": key},
        entries=entries,
        pool=usage,
    )


def pool_entries(entries: Sequence[LockEntry], slots: Sequence[LockKey], database: str) -> tuple[LockEntry, ...]:
    """The entries of a pool's slots in ``database``, each named after its slot when nothing else named it."""
    by_coordinates = {slot.pg_locks: slot for slot in slots}
    selected = []
    for entry in entries:
        slot = by_coordinates.get(entry.key.pg_locks)
        if slot is None or entry.holder.database != database:
            continue
        if not entry.names and slot.name is not None:
            entry = dataclasses.replace(entry, names=(slot.name,), name_source="pool")
        selected.append(entry)
    return tuple(selected)
