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
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_pglock.identity import is_provider_session, parse_application_name
from airflow_pglock.keys import MAX_SLOTS, SLOT_SEPARATOR, LockKey, slot_keys

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
    :param slots: how many slots it has: as given (``--pool NAME --slots N``), or as the
        key-name registry recorded it when a guarded execution took one of its slots.
    :param entries: the sessions holding or waiting for one of its slots.
    :param source: where ``slots`` comes from: ``given`` or ``registry``.
    :param recorded: the registry's sizes for the held slots (several: deployments disagree
        on N; ``slots`` is the largest).
    """

    name: str
    slots: int
    entries: tuple[LockEntry, ...]
    source: str = "given"
    recorded: tuple[int, ...] = ()

    @property
    def key(self) -> LockKey:
        """The pool's key: slot 1."""
        return LockKey.from_name(self.name)

    @property
    def held(self) -> int:
        return len({entry.key.pg_locks for entry in self.entries if entry.holder.granted})

    @property
    def waiting(self) -> int:
        return sum(1 for entry in self.entries if not entry.holder.granted)

    @functools.cached_property
    def _numbers(self) -> dict[tuple[int, int, int], int]:
        return {key.pg_locks: number for number, key in enumerate(slot_keys(self.key, self.slots), start=1)}

    def slot_of(self, entry: LockEntry) -> int | None:
        """The slot number (1 to ``slots``) of the key ``entry`` holds or awaits."""
        return self._numbers.get(entry.key.pg_locks)

    def describe(self) -> str:
        text = f"{self.held} of {self.slots} held"
        if len(self.recorded) > 1:
            sizes = ", ".join(map(str, self.recorded))
            text += f" (deployments recorded different sizes: {sizes}; keep N the same everywhere)"
        return text

    def to_json(self) -> dict[str, Any]:
        def member(entry: LockEntry) -> dict[str, Any]:
            return {**entry.to_json(), "slot": self.slot_of(entry)}

        return {
            "name": self.name,
            "slots": self.slots,
            "slots_source": self.source,
            "slots_recorded": list(self.recorded),
            "held": self.held,
            "summary": self.describe(),
            "holders": [member(entry) for entry in self.entries if entry.holder.granted],
            "waiting": [member(entry) for entry in self.entries if not entry.holder.granted],
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
    pools: tuple[PoolUsage, ...] = ()

    @functools.cached_property
    def _pooled(self) -> frozenset[int]:
        return frozenset(id(member) for pool in self.pools for member in pool.entries)

    def pooled(self, entry: LockEntry) -> bool:
        """Whether ``entry`` holds or awaits a slot of one of :attr:`pools` (shown in its pool's row)."""
        return id(entry) in self._pooled

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
            "pools": [usage.to_json() for usage in self.pools],
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

    Without ``pool``, the slots of every pool the registry knows (a guarded execution that
    took a slot recorded the pool's size) are grouped into ``report.pools``.

    :param hook: where the lock database is.
    :param dag: keep only keys that a task of this DAG holds or awaits.
    :param key: keep only this key (a name, an int64 or ``A,B``; a pool's name keeps all its slots).
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
    everything = build_entries(snapshot, registered)
    usage = None
    if pool is not None and pool_keys is not None:
        entries = pool_entries(filter_entries(everything, dag=dag, key=key), pool_keys, snapshot.database)
        usage = PoolUsage(pool, slots, entries)
        pools: tuple[PoolUsage, ...] = (usage,)
    else:
        everything, pools = group_pools(everything, registered, snapshot.database)
        entries = filter_entries(everything, dag=dag, key=key)
        kept = {id(entry) for entry in entries}
        pools = tuple(p for p in pools if p.name == key or any(id(member) in kept for member in p.entries))
        if key is not None and any(p.name == key for p in pools):  # --key POOL: every slot of it
            kept |= {id(member) for p in pools if p.name == key for member in p.entries}
            entries = tuple(e for e in everything if id(e) in kept)
    return LockReport(
        database=snapshot.database,
        server=server,
        taken_at=snapshot.taken_at,
        all_databases=all_databases,
        registry=registry,
        filters={"dag": dag, "key": key},
        entries=entries,
        pool=usage,
        pools=pools,
    )


def pool_entries(entries: Sequence[LockEntry], slots: Sequence[LockKey], database: str) -> tuple[LockEntry, ...]:
    """The entries of a pool's slots in ``database``, each named after its slot when nothing else named it."""
    named = with_slot_names(entries, slots, database)
    coordinates = {slot.pg_locks for slot in slots}
    return tuple(e for e in named if e.key.pg_locks in coordinates and e.holder.database == database)


def with_slot_names(entries: Sequence[LockEntry], slots: Sequence[LockKey], database: str) -> tuple[LockEntry, ...]:
    """``entries``; those of a slot in ``database`` that have no name get the slot's (name source ``pool``)."""
    by_coordinates = {slot.pg_locks: slot for slot in slots}
    named = []
    for entry in entries:
        slot = by_coordinates.get(entry.key.pg_locks)
        if slot is not None and entry.holder.database == database and not entry.names and slot.name is not None:
            entry = dataclasses.replace(entry, names=(slot.name,), name_source="pool")
        named.append(entry)
    return tuple(named)


def pool_of(registered: RegisteredName) -> str | None:
    """The pool a registry row names a slot of (the row recorded a size), or None.

    ``<pool>#slot<i>`` (2 <= i <= the size) is slot ``i`` of ``<pool>``; any other name with
    a size is slot 1, the pool's own key. The name must hash to the row's key (an explicit
    numeric key recorded under a name is no slot).
    """
    size = registered.slots
    if size is None or size < 2:
        return None
    base, separator, number = registered.name.rpartition(SLOT_SEPARATOR)
    is_slot = bool(separator and base) and number.isdigit() and 2 <= int(number) <= size
    pool = base if is_slot else registered.name
    coordinates = (registered.classid, registered.objid, registered.objsubid)
    return pool if LockKey.from_name(registered.name).pg_locks == coordinates else None


def group_pools(
    entries: Sequence[LockEntry], registered: Sequence[RegisteredName] | None, database: str
) -> tuple[tuple[LockEntry, ...], tuple[PoolUsage, ...]]:
    """The pools whose slots ``entries`` hold or await, as the registry knows them; and the
    entries again, every slot of those pools named after its slot.

    A pool is found when one of its held (or awaited) slots has a registry row with a size
    (``slots`` column, init-db 4+, written when a guarded execution takes a slot). Without
    the registry nothing is grouped: ``locks --pool NAME --slots N`` still is.

    :param registered: the registry rows of the snapshot's keys (None: no registry).
    :param database: the database the registry describes (the snapshot's).
    """
    sizes: dict[str, set[int]] = {}
    for row in registered or ():
        pool = pool_of(row)
        if pool is not None and row.slots is not None:
            sizes.setdefault(pool, set()).add(row.slots)
    layouts = {name: slot_keys(LockKey.from_name(name), min(max(found), MAX_SLOTS)) for name, found in sizes.items()}
    named = tuple(entries)
    for keys in layouts.values():
        named = with_slot_names(named, keys, database)
    pools = []
    for name in sorted(layouts):
        coordinates = {key.pg_locks for key in layouts[name]}
        members = tuple(e for e in named if e.key.pg_locks in coordinates and e.holder.database == database)
        if members:
            size = len(layouts[name])
            pools.append(PoolUsage(name, size, members, source="registry", recorded=tuple(sorted(sizes[name]))))
    return named, tuple(pools)
