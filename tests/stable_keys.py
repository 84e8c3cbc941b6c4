"""The "same key on every Python" table: inputs, the key names they must render to, and the numbers.

The rows (inputs and expected names) are written here by hand; their numbers were computed
once by PostgreSQL, not by Python: ``python -m tests.stable_keys --write DSN`` runs
``NAME_TO_KEY_SQL`` (and the ``pg_locks`` arithmetic) on the server and writes
``tests/stable_keys.json``, which is checked in. ``tests/unit/test_stable_keys.py`` checks
every row on every matrix leg (each Python); ``tests/integration/test_stable_keys_sql.py``
checks the table against PostgreSQL again, by taking each key and reading ``pg_locks``.
"""

from __future__ import annotations

import enum
import json
import sys
import uuid
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("stable_keys.json")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
ACCOUNT = "12345678-1234-5678-1234-567812345678"


class Tenant(enum.IntEnum):
    ACME = 1


class Perm(enum.IntFlag):
    READ = 1
    WRITE = 2


class Shop(str, enum.Enum):
    ACME = "acme"


class Region(enum.Enum):
    EU = "eu-west"
    US = 7


class Plain(int, enum.Enum):
    ONE = 1


def _str_enum() -> type[enum.Enum]:
    return enum.StrEnum("Color", {"RED": "red"})  # type: ignore[attr-defined,no-any-return]


#: tenant type -> (the oldest Python that has it, how to build the value from the table's JSON)
TENANT_TYPES: dict[str, tuple[tuple[int, int], Any]] = {
    "str": ((3, 10), str),
    "int": ((3, 10), int),
    "UUID": ((3, 10), uuid.UUID),
    "IntEnum": ((3, 10), Tenant),
    "IntFlag": ((3, 10), Perm),
    "str-mixin Enum": ((3, 10), Shop),
    "StrEnum": ((3, 11), lambda value: _str_enum()(value)),
    "Enum with a str value": ((3, 10), Region),
    "Enum with an int value": ((3, 10), Region),
    "int-mixin Enum": ((3, 10), Plain),
}

_LONG_ASCII = "abcdefghij" * 100
_LONGEST = "🙂" * 512  # 2048 UTF-8 bytes: keys.MAX_KEY_NAME_BYTES

NAMES = [
    "refresh-forecasts",
    "héllo",
    "tenant-export/Zürich",
    "北京/导出",
    "emoji 🚀 key 🙂",
    'it\'s a "quoted" \\ name',
    "tab\tand\nnewline",
    "x",
    _LONG_ASCII,
    _LONGEST,
]

# (tenant type, value as JSON, the key name it renders to)
TENANTS: list[tuple[str, Any, str]] = [
    ("str", "acme", "exports/export_one/acme"),
    ("str", "müller", "exports/export_one/müller"),
    ("str", "🙂", "exports/export_one/🙂"),
    ("int", 7, "exports/export_one/7"),
    ("int", 0, "exports/export_one/0"),
    ("int", -3, "exports/export_one/-3"),
    ("int", 10**20, "exports/export_one/100000000000000000000"),
    ("UUID", ACCOUNT, f"exports/export_one/{ACCOUNT}"),
    ("IntEnum", 1, "exports/export_one/1"),
    ("IntFlag", 2, "exports/export_one/2"),
    ("IntFlag", 3, "exports/export_one/3"),
    ("str-mixin Enum", "acme", "exports/export_one/acme"),
    ("StrEnum", "red", "exports/export_one/red"),
    ("Enum with a str value", "eu-west", "exports/export_one/eu-west"),
    ("Enum with an int value", 7, "exports/export_one/7"),
    ("int-mixin Enum", 1, "exports/export_one/1"),
]

POOLS = [("exports", 3), ("käse-pool", 2), ("solo", 1)]
INT64S = [INT64_MIN, -1, 0, 1, 4242, INT64_MAX]
PAIRS = [(INT32_MIN, INT32_MAX), (0, 5), (-1, -1), (42, 1001)]


def spec() -> list[dict[str, Any]]:
    """The rows without their numbers."""
    rows: list[dict[str, Any]] = [{"kind": "name", "name": name} for name in NAMES]
    rows.append({"kind": "task", "dag_id": "exports", "task_id": "export_one", "name": "exports/export_one"})
    rows += [
        {
            "kind": "task",
            "dag_id": "exports",
            "task_id": "export_one",
            "tenant_type": kind,
            "tenant": value,
            "name": name,
        }
        for kind, value, name in TENANTS
    ]
    rows.append(
        {"kind": "task", "dag_id": "d", "task_id": "t", "base": "tenant-data", "tenant_type": "int", "tenant": 42,
         "name": "tenant-data/42"}
    )  # fmt: skip
    rows += [
        {
            "kind": "pool",
            "name": name,
            "slots": slots,
            "slot_names": [name] + [f"{name}#slot{i}" for i in range(2, slots + 1)],
        }
        for name, slots in POOLS
    ]
    rows += [{"kind": "int64", "int64": value} for value in INT64S]
    rows += [{"kind": "pair", "pair": list(pair)} for pair in PAIRS]
    return rows


def load() -> list[dict[str, Any]]:
    return json.loads(TABLE.read_text(encoding="utf-8"))["rows"]  # type: ignore[no-any-return]


def row_id(row: dict[str, Any]) -> str:
    if row["kind"] == "task" and "tenant_type" in row:
        return f"tenant {row['tenant_type']} {row['tenant']!r}"
    if row["kind"] in ("name", "pool"):
        name = row["name"]
        return f"{row['kind']} {name[:24]!r}{'...' if len(name) > 24 else ''}"
    return f"{row['kind']} {row.get('int64', row.get('pair'))}"


def tenant_of(row: dict[str, Any]) -> Any:
    """The row's tenant as the DAG author would pass it (an int, a UUID, an enum member...)."""
    return TENANT_TYPES[row["tenant_type"]][1](row["tenant"])


def supported(row: dict[str, Any]) -> bool:
    """Whether this Python has the row's tenant type (StrEnum appeared in 3.11)."""
    return "tenant_type" not in row or sys.version_info[:2] >= TENANT_TYPES[row["tenant_type"]][0]


def computed(row: dict[str, Any]) -> dict[str, Any]:
    """What this Python computes for the row: ``name`` (None for a numeric key), ``numbers``, ``pg_locks``."""
    from airflow_pglock.keys import LockKey, slot_keys

    if row["kind"] == "pool":
        slots = slot_keys(LockKey.from_name(row["name"]), row["slots"])
        return {
            "name": [key.name for key in slots],
            "numbers": [list(key.numbers) for key in slots],
            "pg_locks": [list(key.pg_locks) for key in slots],
        }
    if row["kind"] == "name":
        key = LockKey.from_name(row["name"])
    elif row["kind"] == "task":
        tenant = tenant_of(row) if "tenant_type" in row else None
        key = LockKey.for_task(row["dag_id"], row["task_id"], tenant, base=row.get("base"))
    elif row["kind"] == "int64":
        key = LockKey.coerce(row["int64"])
    else:
        key = LockKey.coerce(tuple(row["pair"]))
    return {"name": key.name, "numbers": list(key.numbers), "pg_locks": list(key.pg_locks)}


def expected(row: dict[str, Any]) -> dict[str, Any]:
    """What the table says for the row, in the shape of :func:`computed`."""
    name = row["slot_names"] if row["kind"] == "pool" else row.get("name")
    return {"name": name, "numbers": row["numbers"], "pg_locks": row["pg_locks"]}


def _check() -> int:
    """Check the table with this interpreter and ``airflow_pglock.keys`` alone (no pytest, no Airflow)."""
    rows = [row for row in load() if supported(row)]
    wrong = 0
    for row in rows:
        want = expected(row)
        try:
            got = computed(row)
        except Exception as error:  # a refused input is a mismatch too
            got = {"name": f"{type(error).__name__}: {error}", "numbers": None}
        if got != want:
            wrong += 1
            shown = f"computed {got['name']!r} {got['numbers']}, table {want['name']!r} {want['numbers']}"
            print(f"MISMATCH {row_id(row)}: {shown}")
    version = ".".join(map(str, sys.version_info[:3]))
    absent = len(load()) - len(rows)
    print(f"Python {version}: {len(rows) - wrong} of {len(rows)} rows match ({absent} not on this Python)")
    return 1 if wrong else 0


def _write(dsn: str) -> None:
    import psycopg

    from airflow_pglock.keys import NAME_TO_KEY_SQL

    def numbers_of_names(conn: psycopg.Connection[Any], names: list[str]) -> list[list[int]]:
        return [[conn.execute(f"SELECT {NAME_TO_KEY_SQL}", [name]).fetchone()[0]] for name in names]  # type: ignore[index]

    def coordinates(conn: psycopg.Connection[Any], numbers: list[int]) -> list[int]:
        if len(numbers) == 1:
            query = "SELECT ((%s::bigint >> 32) & 4294967295), (%s::bigint & 4294967295), 1"
            return list(conn.execute(query, [numbers[0], numbers[0]]).fetchone())  # type: ignore[arg-type]
        query = "SELECT (%s::bigint & 4294967295), (%s::bigint & 4294967295), 2"
        return list(conn.execute(query, numbers).fetchone())  # type: ignore[arg-type]

    rows = spec()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for row in rows:
            if row["kind"] == "pool":
                row["numbers"] = numbers_of_names(conn, row["slot_names"])
            elif row["kind"] in ("name", "task"):
                row["numbers"] = numbers_of_names(conn, [row["name"]])[0]
            elif row["kind"] == "int64":
                row["numbers"] = [row["int64"]]
            else:
                row["numbers"] = row["pair"]
            if row["kind"] == "pool":
                row["pg_locks"] = [coordinates(conn, numbers) for numbers in row["numbers"]]
            else:
                row["pg_locks"] = coordinates(conn, row["numbers"])
    document = {
        "about": "Key numbers computed by PostgreSQL (NAME_TO_KEY_SQL) with `python -m tests.stable_keys --write DSN`; "
        "checked on every Python by tests/unit/test_stable_keys.py. Do not edit by hand.",
        "rows": rows,
    }
    lines = ",\n".join(json.dumps(row, ensure_ascii=False) for row in rows)  # one row a line: readable diffs
    TABLE.write_text(f'{{"about": {json.dumps(document["about"])},\n"rows": [\n{lines}\n]}}\n', encoding="utf-8")
    print(f"wrote {len(rows)} rows to {TABLE}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        sys.exit(_check())
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit("usage: python -m tests.stable_keys --write DSN | --check")
    _write(sys.argv[2])
