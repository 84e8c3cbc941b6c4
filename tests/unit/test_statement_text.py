"""The lock calls kept as text say exactly what they say composed with psycopg's own quoting."""

from __future__ import annotations

import itertools

from psycopg import sql

from airflow_pglock.keys import LockKey
from airflow_pglock.pg.sql import call, call_text, lock_function


def test_every_call_as_text_is_its_composed_form() -> None:
    for base, shared, scope, pair in itertools.product(
        ("try", "wait", "unlock"), (False, True), ("session", "transaction"), (False, True)
    ):
        function = lock_function(base, shared=shared, scope=scope)  # type: ignore[arg-type]
        casts = [sql.SQL("%s::integer")] * 2 if pair else [sql.SQL("%s::bigint")]
        composed = sql.SQL("SELECT {}({})").format(sql.Identifier("pg_catalog", function), sql.SQL(", ").join(casts))
        key = LockKey.from_pair(1, 2) if pair else LockKey.from_int(5)
        assert call_text(function, pair) == composed.as_string(None) == call(function, key).as_string(None)
