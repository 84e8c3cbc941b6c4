"""Keys: golden vectors, range checks, pg_locks coordinates (pure, no database)."""

from __future__ import annotations

import re

import pytest

from airflow_pglock.exceptions import InvalidLockKeyError
from airflow_pglock.keys import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, LockKey, int64_from_name, slot_keys

# Computed independently with: printf %s NAME | sha256sum, first 16 hex digits as signed int64.
GOLDEN = {
    "refresh-forecasts": 1804337156659552117,
    "héllo": 4343819824053979717,
}


@pytest.mark.parametrize(("name", "expected"), sorted(GOLDEN.items()))
def test_golden_vectors(name: str, expected: int) -> None:
    assert int64_from_name(name) == expected
    assert LockKey.from_name(name).numbers == (expected,)


def test_name_hash_is_sha256_prefix_big_endian_signed() -> None:
    import hashlib

    digest = hashlib.sha256(b"tenant/42").hexdigest()[:16]
    unsigned = int(digest, 16)
    signed = unsigned - 2**64 if unsigned >= 2**63 else unsigned
    assert int64_from_name("tenant/42") == signed


def test_int64_and_pair_pass_through_unchanged() -> None:
    assert LockKey.from_int(INT64_MIN).numbers == (INT64_MIN,)
    assert LockKey.from_int(INT64_MAX).numbers == (INT64_MAX,)
    assert LockKey.from_pair(INT32_MIN, INT32_MAX).numbers == (INT32_MIN, INT32_MAX)
    assert LockKey.coerce(42).numbers == (42,)
    assert LockKey.coerce((42, 1001)).numbers == (42, 1001)
    assert LockKey.coerce([42, 1001]).numbers == (42, 1001)


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        (INT64_MAX + 1, str(INT64_MAX + 1)),
        (INT64_MIN - 1, str(INT64_MIN - 1)),
        ((INT32_MAX + 1, 0), str(INT32_MAX + 1)),
        ((0, INT32_MIN - 1), str(INT32_MIN - 1)),
        ("", "''"),
        ("   ", "'   '"),
        (3.5, "3.5"),
        (True, "True"),
        ((1, 2, 3), "(1, 2, 3)"),
        (("a", 1), "'a'"),
        (None, "None"),
    ],
)
def test_bad_keys_name_the_value(bad: object, fragment: str) -> None:
    with pytest.raises(InvalidLockKeyError) as error:
        LockKey.coerce(bad)
    assert fragment in str(error.value)


def test_pg_locks_coordinates() -> None:
    # As PostgreSQL 15 shows them for pg_try_advisory_lock(-5) and pg_try_advisory_lock(-1, -2).
    assert LockKey.from_int(-5).pg_locks == (4294967295, 4294967291, 1)
    assert LockKey.from_pair(-1, -2).pg_locks == (4294967295, 4294967294, 2)
    assert LockKey.from_int(2**32 + 7).pg_locks == (1, 7, 1)
    assert LockKey.from_pair(42, 1001).pg_locks == (42, 1001, 2)


def test_task_keys() -> None:
    assert LockKey.for_task("dag", "task").name == "dag/task"
    assert LockKey.for_task("dag", "task", "7").name == "dag/task/7"
    assert LockKey.for_task("dag", "task", "acme", base="export").name == "export/acme"
    with pytest.raises(InvalidLockKeyError, match="tenant"):
        LockKey.for_task("dag", "task", " ")


def test_describe_and_sql() -> None:
    key = LockKey.from_name("it's")
    assert key.describe() == f'key "it\'s" (int64 {key.numbers[0]})'
    assert "'it''s'" in key.sql
    assert LockKey.from_pair(1, 2).sql == "1, 2"
    assert LockKey.from_int(5).describe() == "key (int64 5)"


@pytest.mark.parametrize(
    "key", [LockKey.from_int(-5), LockKey.from_int(INT64_MAX), LockKey.from_int(INT64_MIN), LockKey.from_pair(-1, 2)]
)
def test_pg_locks_coordinates_round_trip(key: LockKey) -> None:
    assert LockKey.from_pg_locks(*key.pg_locks).numbers == key.numbers


def test_a_pool_name_that_reads_as_another_pools_slot_is_refused_before_any_connection() -> None:
    """``jobs#slot2`` with ``slots=3`` would be slot 2 of the pool ``jobs`` and lend it its slots:
    ``locks`` showed it as pool ``jobs``. Refused wherever a pool is given, before any I/O."""
    from datetime import datetime, timezone

    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.lock_report.pools import pool_of
    from airflow_pglock.options import FunctionLockOptions, LockSpec
    from airflow_pglock.pg.key_names import RegisteredName

    message = "a pool's name may not end in '#slot<number>'"
    for name in ("jobs#slot2", "acme/jobs#slot10"):
        with pytest.raises(InvalidLockKeyError, match=re.escape(message)):
            slot_keys(LockKey.from_name(name), 3)
    with pytest.raises(InvalidLockKeyError, match=re.escape(message)):  # before the connection id is looked up
        AdvisoryLockHook(postgres_conn_id="pglock_no_such_connection").acquire("jobs#slot2", slots=3)
    with pytest.raises(InvalidLockKeyError, match=re.escape(message)):  # when the DAG is parsed
        LockSpec.from_options({"key": "jobs#slot2", "slots": 3}, declaration=FunctionLockOptions, caller="test")
    LockSpec.from_options({"key": "{{ params.k }}#slot2", "slots": 3}, declaration=FunctionLockOptions, caller="test")
    assert slot_keys(LockKey.from_name("jobs#slot2"), 1) == [LockKey.from_name("jobs#slot2")]  # a plain key: that slot
    for fine in ("jobs#slot1", "jobs#slot02", "jobs#slotx", "#slot2"):
        assert len(slot_keys(LockKey.from_name(fine), 3)) == 3
    assert [key.name for key in slot_keys(LockKey.from_name("jobs"), 3)][1:] == ["jobs#slot2", "jobs#slot3"]

    def row(name: str, size: int) -> RegisteredName:
        classid, objid, objsubid = LockKey.from_name(name).pg_locks
        return RegisteredName(classid, objid, objsubid, name, datetime.now(timezone.utc), None, size)

    assert pool_of(row("jobs#slot2", 3)) == "jobs"
    assert pool_of(row("jobs#slot7", 3)) is None  # written before such pool names were refused
