"""The same key on every Python: each row of tests/stable_keys.json (numbers computed by
PostgreSQL) renders to the same name and the same numbers here. A matrix test: every leg
(each Python the package admits) runs it."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests import stable_keys

ROWS = stable_keys.load()


@pytest.mark.matrix("stable-keys")
@pytest.mark.parametrize("row", ROWS, ids=[stable_keys.row_id(row) for row in ROWS])
def test_every_python_computes_the_tables_keys(row: dict[str, Any]) -> None:
    if not stable_keys.supported(row):
        pytest.skip(f"{row['tenant_type']} does not exist on Python {sys.version_info[0]}.{sys.version_info[1]}")
    assert stable_keys.computed(row) == stable_keys.expected(row)


def test_the_table_covers_every_tenant_type_and_key_kind() -> None:
    kinds = {row["kind"] for row in ROWS}
    assert kinds == {"name", "task", "pool", "int64", "pair"}
    assert {row["tenant_type"] for row in ROWS if "tenant_type" in row} == set(stable_keys.TENANT_TYPES)
    assert [row for row in ROWS if row["kind"] != "pool" and "name" in row] and any(
        len(row["name"].encode()) == 2048 for row in ROWS if row["kind"] == "name"
    )
    assert [{key: value for key, value in row.items() if key not in ("numbers", "pg_locks")} for row in ROWS] == (
        stable_keys.spec()
    ), "the table is out of date with tests/stable_keys.py: regenerate it (python -m tests.stable_keys --write DSN)"
