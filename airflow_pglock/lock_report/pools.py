"""Pools of slots (``slots=N``) in a lock report: each pool one row, its slots named."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_pglock.keys import MAX_SLOTS, SLOT_SEPARATOR, LockKey, names_a_slot, slot_keys
from airflow_pglock.lock_report.entries import LockEntry

if TYPE_CHECKING:
    from airflow_pglock.pg.key_names import RegisteredName


@dataclass(frozen=True)
class PoolUsage:
    """A pool of slots (``slots=N``) as one row: how many of its slots are held, and by whom.

    :param name: the pool's key name.
    :param slots: how many slots it has: as given (``--pool NAME --slots N``), or as the
        key-name registry recorded it when a guarded execution took one of its slots.
    :param entries: the sessions holding or waiting for one of its slots (a waiter shows here
        only while the server queues it: a pool's wait tries its slots again and again).
    :param source: where ``slots`` comes from: ``given`` or ``registry``.
    :param recorded: the registry's sizes for the held slots (several: deployments disagree
        on N; ``slots`` is the largest).
    :param scoped: the slots (1 to ``slots``) a live lock scope's row holds, between its tasks
        or while one of them holds the slot's key too (docs/scopes.md).
    """

    name: str
    slots: int
    entries: tuple[LockEntry, ...]
    source: str = "given"
    recorded: tuple[int, ...] = ()
    scoped: tuple[int, ...] = ()

    @property
    def key(self) -> LockKey:
        """The pool's key: slot 1."""
        return LockKey.from_name(self.name)

    @property
    def held(self) -> int:
        """Slots held by a session or by a lock scope's row (each counted once), as a guard finds them busy."""
        by_sessions = {entry.key.pg_locks for entry in self.entries if entry.holder.granted}
        by_scopes = {key.pg_locks for number, key in enumerate(self._keys, start=1) if number in self.scoped}
        return len(by_sessions | by_scopes)

    @property
    def waiting(self) -> int:
        return sum(1 for entry in self.entries if not entry.holder.granted)

    @functools.cached_property
    def _keys(self) -> list[LockKey]:
        return slot_keys(self.key, self.slots)

    @functools.cached_property
    def _numbers(self) -> dict[tuple[int, int, int], int]:
        return {key.pg_locks: number for number, key in enumerate(self._keys, start=1)}

    def with_scopes(self, scope_keys: Iterable[LockKey]) -> PoolUsage:
        """This pool, its slots among ``scope_keys`` (live lock scopes' keys) counted as held."""
        held = {key.numbers for key in scope_keys}
        scoped = tuple(number for number, key in enumerate(self._keys, start=1) if key.numbers in held)
        return dataclasses.replace(self, scoped=scoped)

    def slot_of(self, entry: LockEntry) -> int | None:
        """The slot number (1 to ``slots``) of the key ``entry`` holds or awaits."""
        return self._numbers.get(entry.key.pg_locks)

    def describe(self) -> str:
        text = f"{self.held} of {self.slots} held"
        if self.scoped:
            text += f" ({len(self.scoped)} by lock scopes)"
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
            "scoped_slots": list(self.scoped),
            "summary": self.describe(),
            "holders": [member(entry) for entry in self.entries if entry.holder.granted],
            "waiting": [member(entry) for entry in self.entries if not entry.holder.granted],
        }


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
    base, _, number = registered.name.rpartition(SLOT_SEPARATOR)
    is_slot = names_a_slot(registered.name) and int(number) <= size
    pool = base if is_slot else registered.name
    if names_a_slot(pool):
        return None  # a pool may not have such a name: a row written before that was refused
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
