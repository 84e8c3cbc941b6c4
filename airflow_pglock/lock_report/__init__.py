"""Every advisory lock in the database, named and explained: what ``locks`` and the UI page show.

The lock database says who holds what (``pg/holders.py``: one query, one ``LockHolder``
record) and the registry's names (``pg/schema.py``); this package turns them into entries
a person can act on (what invariant 6 of docs/architecture.md asks of whatever a person
sees): the key by its human name and numbers (``entries.py``), the holder by DAG / task /
run (from its ``application_name``), pid, client and since when, how many wait behind it,
and each pool of slots as one row (``pools.py``). It writes no SQL:
:func:`collect_lock_report` only calls the lock database's functions.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_pglock.keys import SLOT_SEPARATOR, LockKey, names_a_slot, slot_keys
from airflow_pglock.lock_report.entries import (
    LockEntry,
    build_entries,
    filter_entries,
    key_filter_note,
    parse_key_filter,
)
from airflow_pglock.lock_report.pools import PoolUsage, group_pools, pool_entries

if TYPE_CHECKING:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

#: application_name of the sessions ``locks`` / the UI open to read (they hold no lock).
INSPECT_APPLICATION_NAME = "pglock-cli locks"

REGISTRY_INSTALLED = "installed"
REGISTRY_MISSING = "not installed"
REGISTRY_NO_ACCESS = "no access"

#: Why a key has no name, by the registry's state (shown next to every ``?``).
UNKNOWN_NAME_REASONS = {
    REGISTRY_MISSING: "name unknown: run 'airflow-pglock init-db' once; names are recorded when a hold ends",
    REGISTRY_NO_ACCESS: "name unknown: this role may not read pglock.key_names "
    "(airflow-pglock init-db --grant ROLE, as the schema's owner)",
    REGISTRY_INSTALLED: "name unknown: not recorded yet (names are recorded when a hold ends, "
    "a hold of airflow-pglock's since init-db) or taken by another application by its numbers",
}


@dataclass(frozen=True)
class ScopeEntry:
    """A live lock scope (docs/scopes.md): held by a lease row, between or during its tasks; or
    the hold of a deferred guarded operator, its ``task_now`` marked deferred (the triggerer
    holds the key; the row keeps it across the hand-overs).

    :param key: the scope's key (with its name).
    :param run: who holds it: the deployment, DAG and run.
    :param task_now: the task of the scope running now, or None between its tasks.
    :param lease_until: when it ends unless a task of it renews it (database clock).
    :param token: its fencing token, or None.
    """

    key: LockKey
    run: str
    task_now: str | None
    lease_until: dt.datetime
    token: int | None

    @property
    def deferred(self) -> bool:
        """The hold of a deferred guarded operator (docs/deferrable-operators.md), not a task group's scope."""
        from airflow_pglock.pg.scopes import is_deferred_hold

        return is_deferred_hold(self.task_now)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": {"name": self.key.name, "numbers": list(self.key.numbers)},
            "run": self.run,
            "task_now": self.task_now,
            "deferred": self.deferred,
            "lease_until": self.lease_until.isoformat(),
            "fencing_token": self.token,
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
    scopes: tuple[ScopeEntry, ...] = ()
    in_recovery: bool = False
    key_note: str | None = None

    @property
    def warning(self) -> str | None:
        """What the reader must know first: a standby's empty answer, or ``--key`` numbers that are no key."""
        return self.standby_warning or self.key_note

    @property
    def standby_warning(self) -> str | None:
        """What to say when the server read is a standby: its locks are not the primary's."""
        if not self.in_recovery:
            return None
        return (
            "this server is a standby in recovery: advisory locks are not replicated, so it shows none of the "
            "primary's holders; point the connection at the primary"
        )

    @functools.cached_property
    def _pooled(self) -> frozenset[int]:
        return frozenset(id(member) for pool in self.pools for member in pool.entries)

    @property
    def unknown_name_reason(self) -> str:
        """Why a key of this report has no name (what to do about it), by the registry's state."""
        return UNKNOWN_NAME_REASONS.get(self.registry, UNKNOWN_NAME_REASONS[REGISTRY_MISSING])

    def pooled(self, entry: LockEntry) -> bool:
        """Whether ``entry`` holds or awaits a slot of one of :attr:`pools` (shown in its pool's row)."""
        return id(entry) in self._pooled

    def _entry_json(self, entry: LockEntry) -> dict[str, Any]:
        data = entry.to_json()
        data["key"]["name_unknown_reason"] = None if entry.names else self.unknown_name_reason
        return data

    def to_json(self) -> dict[str, Any]:
        pool = {} if self.pool is None else {"pool": self.pool.to_json()}  # only when a pool was asked for
        return {
            **pool,
            "database": self.database,
            "server": self.server,
            "server_time": self.taken_at.isoformat(),
            "all_databases": self.all_databases,
            "registry": self.registry,
            "in_recovery": self.in_recovery,
            "warning": self.warning,
            "filters": dict(self.filters),
            "locks": [self._entry_json(entry) for entry in self.entries],
            "pools": [usage.to_json() for usage in self.pools],
            "scopes": [scope.to_json() for scope in self.scopes],
        }


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

    from airflow_pglock.pg.holders import advisory_locks
    from airflow_pglock.pg.key_names import registered_names

    if key is not None:
        parse_key_filter(key)  # a bad name is a usage error before any connection
    pool_keys = None if pool is None else slot_keys(LockKey.from_name(pool), slots)
    with hook.database.connect(INSPECT_APPLICATION_NAME) as conn:
        snapshot = advisory_locks(conn, all_databases=all_databases)
        # Every role may read the scopes (init-db grants PUBLIC), whatever it may read of the registry.
        # All of them count in their pools ("K of N held"), whatever --dag lists.
        scopes = _live_scopes(conn)
        coordinates = sorted(
            {row.coordinates for row in snapshot.rows if row.database == snapshot.database}
            | {scope.key.pg_locks for scope in scopes}  # a pool whose slot a scope holds: its size
        )
        registry = REGISTRY_INSTALLED
        try:
            registered = registered_names(conn, coordinates)
        except psycopg.errors.InsufficientPrivilege:
            registered, registry = None, REGISTRY_NO_ACCESS
        if registered is None and registry == REGISTRY_INSTALLED:
            registry = REGISTRY_MISSING
        server = hook.database.describe_target()
    everything = build_entries(snapshot, registered, pools=() if pool is None else (pool,))
    scope_keys = [scope.key for scope in scopes]
    if dag is not None:
        scopes = tuple(scope for scope in scopes if f": {dag} " in scope.run)
    usage = None
    if pool is not None and pool_keys is not None:
        entries = pool_entries(filter_entries(everything, dag=dag, key=key), pool_keys, snapshot.database)
        usage = PoolUsage(pool, slots, entries).with_scopes(scope_keys)
        pools: tuple[PoolUsage, ...] = (usage,)
        slot_numbers = {slot.numbers for slot in pool_keys}
        scopes = tuple(scope for scope in scopes if scope.key.numbers in slot_numbers)
    else:
        everything, pools = group_pools(everything, registered, snapshot.database)
        pools = tuple(p.with_scopes(scope_keys) for p in pools)
        entries = filter_entries(everything, dag=dag, key=key)
        kept = {id(entry) for entry in entries}
        pools = tuple(p for p in pools if p.name == key or any(id(member) in kept for member in p.entries))
        if key is not None and any(p.name == key for p in pools):  # --key POOL: every slot of it
            kept |= {id(member) for p in pools if p.name == key for member in p.entries}
            entries = tuple(e for e in everything if id(e) in kept)
        if key is not None:
            scopes = _scopes_of_key(scopes, key)
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
        scopes=scopes,
        in_recovery=snapshot.in_recovery,
        key_note=None if key is None or entries or scopes else key_filter_note(key),
    )


def _scopes_of_key(scopes: tuple[ScopeEntry, ...], key: str) -> tuple[ScopeEntry, ...]:
    """The scopes of ``key`` (``--key``): of its numbers, and of every slot of a pool of that name."""
    wanted = {k.numbers for k in parse_key_filter(key)}
    return tuple(
        scope
        for scope in scopes
        if scope.key.numbers in wanted
        or (
            scope.key.name is not None
            and names_a_slot(scope.key.name)
            and scope.key.name.rpartition(SLOT_SEPARATOR)[0] == key
        )
    )


def _live_scopes(conn: Any) -> tuple[ScopeEntry, ...]:
    """The live lock scopes (none before init-db version 5, or when this role may not read them)."""
    from airflow_pglock.exceptions import LockConfigurationError
    from airflow_pglock.pg.scopes import live_scopes

    try:
        found = live_scopes(conn)
    except LockConfigurationError:
        return ()
    return tuple(ScopeEntry(key, row.run, row.task_now, row.lease_until, row.token) for key, row in found)
