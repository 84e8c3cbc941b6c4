"""The lock calls kept as text for tight loops say exactly what their composed forms say."""

from __future__ import annotations

import itertools

from airflow_pglock.keys import LockKey
from airflow_pglock.pg.sql import call, call_text, lock_function


def test_every_call_as_text_is_its_composed_form() -> None:
    for base, shared, scope, pair in itertools.product(
        ("try", "wait", "unlock"), (False, True), ("session", "transaction"), (False, True)
    ):
        function = lock_function(base, shared=shared, scope=scope)  # type: ignore[arg-type]
        key = LockKey.from_pair(1, 2) if pair else LockKey.from_int(5)
        assert call_text(function, pair) == call(function, key).as_string(None)
