"""Out-of-range inputs are refused clearly before connecting, never as a driver, OS or database
error (which on_error="skip" would turn into a skip); the longest accepted key name is one the
key-name registry can always store."""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import MAX_KEY_NAME_BYTES, MAX_SLOTS, SLOT_SEPARATOR, LockKey, slot_keys
from airflow_pglock.liveness import MAX_LEASE_SECONDS, Liveness
from airflow_pglock.policy import MAX_WAIT_TIMEOUT_SECONDS, LockPolicy
from tests.helpers import advisory_locks, held_lock


def _busy(admin: Any, name: str) -> None:
    admin.execute("SELECT pg_advisory_lock(%s)", LockKey.from_name(name).numbers)


def test_a_lease_the_os_cannot_set_is_refused_before_connecting(dsn: str, admin: Any) -> None:
    """Was: setsockopt(TCP_KEEPIDLE) failed, reported as a LockConnectionError (a database
    problem: on_error="skip" skipped the task)."""
    with pytest.raises(LockConfigurationError, match=f"{MAX_LEASE_SECONDS:,}") as error:
        hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=100_000))
        policy = LockPolicy(on_error="skip")
        with LockGuard(hook.database, LockKey.from_name("edge-lease"), policy, application_name="pglock-tests lease"):
            pass
    assert "100000" in str(error.value)
    assert advisory_locks(admin) == []


def test_the_longest_lease_connects_and_holds(dsn: str, admin: Any) -> None:
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=MAX_LEASE_SECONDS))
    with hook.lock("edge-lease-max", mode="transaction") as handle:
        assert handle is not None and handle.connection is not None
        [(pid, *_)] = advisory_locks(admin)
        assert pid == handle.backend_pid
        assert handle.connection.execute("SHOW tcp_keepalives_idle").fetchone() == ("32767",)


@pytest.mark.parametrize("timeout", [float("inf"), 3e6, float("nan"), -1.0])
def test_a_wait_timeout_out_of_range_is_refused_before_connecting(
    hook: AdvisoryLockHook, admin: Any, timeout: float
) -> None:
    """Was: inf -> OverflowError after connecting; 3e6 s -> lock_timeout out of range from the server."""
    _busy(admin, "edge-wait")
    longest = f"{MAX_WAIT_TIMEOUT_SECONDS:,}"
    with pytest.raises(LockConfigurationError, match=longest), hook.lock("edge-wait", timeout=timeout):
        pass
    with (
        pytest.raises(LockConfigurationError, match=longest),
        held_lock(hook, "edge-wait", timeout=timeout),
    ):
        pass
    with hook.lock_session() as session:
        refused = pytest.raises(LockConfigurationError, match=longest)
        with refused, session.lock("edge-wait", timeout=timeout):
            pass
    assert len(advisory_locks(admin)) == 1  # only the admin's


def test_the_longest_wait_timeout_is_one_the_server_takes(hook: AdvisoryLockHook, admin: Any) -> None:
    with held_lock(hook, "edge-wait-max", timeout=MAX_WAIT_TIMEOUT_SECONDS) as held:
        assert held is not None  # free: taken at once, with lock_timeout at its largest


def test_a_name_that_is_not_utf8_text_is_refused_before_connecting(hook: AdvisoryLockHook, admin: Any) -> None:
    """Was: UnicodeEncodeError from the hash."""
    with pytest.raises(InvalidLockKeyError, match="UTF-8"), hook.lock("a\ud800b"):
        pass
    with hook.lock_session() as session:
        with pytest.raises(InvalidLockKeyError, match="UTF-8"):
            session.try_lock_many(["fine", "a\ud800b"])
        assert session.held() == []
    assert advisory_locks(admin) == []


def _incompressible(size: int, seed: int) -> str:
    """Exactly ``size`` UTF-8 bytes that pglz cannot shrink (the registry's worst case)."""
    rng = random.Random(seed)
    cjk = "".join(chr(0x4E00 + rng.randrange(20000)) for _ in range(size // 3))
    return cjk + "".join(chr(0x21 + rng.randrange(90)) for _ in range(size - 3 * len(cjk)))


@pytest.fixture
def registry_dsn(pg_server: str) -> Iterator[str]:
    from airflow_pglock.pg.schema import migrate
    from tests.ops_helpers import scratch_database

    with scratch_database(pg_server, prefix="pglock_key_limits") as scratch:
        with psycopg.connect(scratch, autocommit=True) as conn:
            migrate(conn)
        yield scratch


def test_the_registry_stores_the_longest_names_a_key_or_pool_may_have(registry_dsn: str, caplog: Any) -> None:
    """Was: a name past the registry's index limit failed its write at every release (and the
    release's NOTIFY with it); now every name a key may have is stored, and longer ones are refused."""
    longest = _incompressible(MAX_KEY_NAME_BYTES, seed=1)
    suffix = f"{SLOT_SEPARATOR}{MAX_SLOTS}"
    pool = _incompressible(MAX_KEY_NAME_BYTES - len(suffix), seed=2)
    last_slot = slot_keys(LockKey.from_name(pool), MAX_SLOTS)[-1]
    assert len(last_slot.name.encode()) == MAX_KEY_NAME_BYTES  # type: ignore[union-attr]
    hook = AdvisoryLockHook(dsn=registry_dsn)
    with caplog.at_level(logging.WARNING, logger="airflow_pglock"):
        for key in (LockKey.from_name(longest), last_slot):
            held = hook.acquire(key, application_name="pglock-tests longest name")
            assert held is not None and held.release()
    assert "could not record" not in caplog.text
    with psycopg.connect(registry_dsn, autocommit=True) as conn:
        names = {row[0] for row in conn.execute("SELECT name FROM pglock.key_names")}
    assert names == {longest, last_slot.name}
    with pytest.raises(InvalidLockKeyError, match=f"at most {MAX_KEY_NAME_BYTES}"):
        LockKey.from_name(_incompressible(MAX_KEY_NAME_BYTES + 1, seed=3))


class _Shard(int, enum.Enum):  # an int-valued enum as a key: LockKey takes any int
    PLUS = 7
    MINUS = -7


EXTREME_KEYS = [
    LockKey.from_int(_Shard.PLUS),
    LockKey.from_pair(_Shard.MINUS, _Shard.PLUS),
    LockKey.from_int(-(2**63)),
    LockKey.from_int(2**63 - 1),
    LockKey.from_pair(0, -(2**31)),
    LockKey.from_pair(-(2**31), 5),
    LockKey.from_pair(-(2**31), -(2**31)),
]


@pytest.mark.parametrize("mode", ["session", "transaction"])
@pytest.mark.parametrize("key", EXTREME_KEYS, ids=[key.describe() for key in EXTREME_KEYS])
def test_the_smallest_and_largest_explicit_keys_lock_in_every_mode(
    hook: AdvisoryLockHook, admin: Any, key: LockKey, mode: str
) -> None:
    """Was: a transaction lock on -2**63, or on a pair with -2**31 in it, failed with "integer out of
    range": its statements travel inlined, and `-2147483648::integer` is `-(2147483648::integer)`. An
    int-valued enum's member is inlined by its number, not its name (review -85)."""
    classid, objid, objsubid = key.pg_locks
    seen = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s AND objsubid = %s"
    policy = LockPolicy(mode=mode)  # type: ignore[arg-type]
    assert "_Shard" not in key.describe()  # an enum member is its number in the key
    with LockGuard(hook.database, key, policy, application_name="pglock-tests extreme keys") as handle:
        assert handle.key == key
        assert admin.execute(seen, [classid, objid, objsubid]).fetchone() == (1,)
        with held_lock(hook, key) as other:
            assert other is None, f"{key.describe()} was taken twice"
    assert advisory_locks(admin) == []
