"""The release announcement's payload: what a guard writes, and what the triggerer's hub accepts
(pure, no database). Anyone who may connect can NOTIFY the channel: every other payload is
ignored, and reading one never raises."""

from __future__ import annotations

import pytest

from airflow_pglock.keys import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, LockKey
from airflow_pglock.pg.wakeups import coordinates, payload

KEYS = [
    LockKey.from_name("exports"),
    LockKey.from_int(0),
    LockKey.from_int(INT64_MIN),
    LockKey.from_int(INT64_MAX),
    LockKey.from_int(-1),
    LockKey.from_pair(0, 0),
    LockKey.from_pair(INT32_MIN, INT32_MAX),
    LockKey.from_pair(-1, -1),
]

FOREIGN = [
    "",  # pg_notify's default payload
    "hello",
    "/",
    "//",
    "1/2",
    "1/2/1/4",
    "1//1",
    " 1/2/1",  # whitespace, signs
    "1/2/1 ",
    "1/2/1\n",
    "1/ 2/1",
    "+1/2/1",
    "-1/2/1",
    "1/-2/1",
    "1.0/2/1",
    "1e3/2/1",
    "0x1/2/1",
    "1_000/2/1",
    "²/0/1",  # str.isdigit() but not int(): the payload that stopped the hub
    "0/²/1",
    "0/0/²",
    "①/0/1",
    "٣/0/1",  # digits int() reads, but not ASCII
    "\uff11/0/1",  # FULLWIDTH DIGIT ONE
    "0/0/٢",
    "4294967296/0/1",  # past an oid
    "0/4294967296/1",
    "99999999999999999999/0/1",
    "0/0/0",  # not an advisory key's objsubid
    "0/0/3",
    "0/0/11",
    "01/2/1",  # not how a guard writes it
    "1/02/1",
    "1/2/01",
    "9" * 5000,  # int() refuses more than 4,300 digits
    "/".join(["9" * 5000, "0", "1"]),
    "/".join(["0" * 5000 + "1", "0", "1"]),
    "1/2/1\x00",
    "\udcff/0/1",  # a lone surrogate (a payload that was not UTF-8)
]


@pytest.mark.parametrize("key", KEYS, ids=lambda key: str(key.numbers))
def test_an_announcement_reads_back_as_its_key(key: LockKey) -> None:
    assert coordinates(payload(key)) == key.pg_locks
    assert LockKey.from_pg_locks(*key.pg_locks).numbers == key.numbers


def test_the_largest_coordinates_are_read() -> None:
    assert coordinates("4294967295/4294967295/1") == (4294967295, 4294967295, 1)
    assert coordinates("4294967295/4294967295/2") == (4294967295, 4294967295, 2)
    assert coordinates("0/0/1") == (0, 0, 1)


@pytest.mark.parametrize("text", FOREIGN, ids=lambda text: ascii(text[:24]) + f"_len{len(text)}")
def test_any_other_payload_is_ignored(text: str) -> None:
    assert coordinates(text) is None
