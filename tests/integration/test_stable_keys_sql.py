"""The "same key on every Python" table (tests/stable_keys.json) against PostgreSQL: each
name's number is NAME_TO_KEY_SQL's, and each key, taken on a real session, shows in pg_locks
at the table's coordinates."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_pglock.keys import NAME_TO_KEY_SQL
from tests import stable_keys
from tests.helpers import advisory_locks

ROWS = stable_keys.load()


def _keys(row: dict[str, Any]) -> list[tuple[str | None, list[int], list[int]]]:
    """(name, numbers, pg_locks) of each key of a row (a pool has one per slot)."""
    if row["kind"] == "pool":
        return list(zip(row["slot_names"], row["numbers"], row["pg_locks"], strict=True))
    return [(row.get("name"), row["numbers"], row["pg_locks"])]


@pytest.mark.parametrize("row", ROWS, ids=[stable_keys.row_id(row) for row in ROWS])
def test_postgresql_computes_the_tables_numbers_and_coordinates(admin: Any, dsn: str, row: dict[str, Any]) -> None:
    import psycopg

    for name, numbers, coordinates in _keys(row):
        if name is not None:
            assert admin.execute(f"SELECT {NAME_TO_KEY_SQL}", [name]).fetchone() == (numbers[0],)
        casts = "%s::integer, %s::integer" if len(numbers) == 2 else "%s::bigint"
        with psycopg.connect(dsn, autocommit=True) as holder:
            holder.execute(f"SELECT pg_advisory_lock({casts})", numbers)
            # This holder's lock only: the previous slot's holder was closed, but its backend exits
            # a moment later (on a loaded machine its lock was still listed: CI, 2.11 leg).
            pid = holder.info.backend_pid
            [(classid, objid, objsubid, granted)] = [row[1:] for row in advisory_locks(admin) if row[0] == pid]
            assert [classid, objid, objsubid] == coordinates and granted
