"""Lock scopes over a pool (``slots=N``) on a real PostgreSQL: at most N scopes at once, each in
one slot that its tasks and its teardown re-enter; every other guard of the pool passes over the
slots that scopes hold between their tasks (scope_rules through LockGuard and the hook)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import pytest

from airflow_pglock.exceptions import LockBusyError, LockConfigurationError, LockLostError
from airflow_pglock.guard import LockGuard
from airflow_pglock.keys import LockKey, slot_keys
from airflow_pglock.policy import LockPolicy
from airflow_pglock.scope_rules import ScopeRole
from tests.helpers import advisory_locks_left

POOL = LockKey.from_name("scopes/pool")
SLOTS = 2


def _role(kind: str, holder: str, slot: int | None = None) -> ScopeRole:
    return ScopeRole(kind=kind, holder=holder, run=f"dep: dag {holder[:6]}", task="t", lease=300.0, slot=slot)  # type: ignore[arg-type]


def _policy(**more: Any) -> LockPolicy:
    return LockPolicy(slots=SLOTS, **more)


def _enter(hook: Any, holder: str, **policy: Any) -> int:
    with LockGuard(hook.database, POOL, _policy(**policy), scope=_role("enter", holder)) as handle:
        assert handle.slot is not None
        return handle.slot


def _rows(admin: Any) -> dict[str, str]:
    return dict(admin.execute("SELECT key_name, holder FROM pglock.scopes").fetchall())


def test_at_most_n_scopes_hold_a_pool_each_in_its_own_slot(hook: Any, scopes_db: Any) -> None:
    first, second, third = (uuid.uuid4().hex for _ in range(3))
    assert _enter(hook, first) == 1
    assert _enter(hook, second) == 2, "the second scope passes over the slot the first holds between its tasks"
    assert _rows(scopes_db) == {"scopes/pool": first, "scopes/pool#slot2": second}
    with pytest.raises(
        LockBusyError, match=r"all 2 slots of the pool .* are held, 2 by lock scopes \(slot 1: .*slot 2"
    ):
        _enter(hook, third)
    assert advisory_locks_left(scopes_db) == 0, "between their tasks the scopes hold no session"
    assert _enter(hook, first) == 1, "a setup run again for the same holder takes its own slot again"


def test_members_and_the_teardown_reenter_their_own_slot_only(hook: Any, scopes_db: Any) -> None:
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    _enter(hook, first)
    _enter(hook, second)
    with LockGuard(hook.database, POOL, _policy(), scope=_role("member", second, slot=2)) as handle:
        assert handle.key == slot_keys(POOL, SLOTS)[1]
        task_now = scopes_db.execute("SELECT task_now FROM pglock.scopes WHERE holder = %s", (second,)).fetchone()
        assert task_now == ("t",)
    with (
        pytest.raises(LockLostError, match="took the scope"),
        LockGuard(hook.database, POOL, _policy(), scope=_role("member", first, slot=2)),
    ):
        pytest.fail("a task re-entered a slot another scope holds")
    with LockGuard(hook.database, POOL, _policy(), scope=_role("leave", first, slot=1)):
        pass
    assert _rows(scopes_db) == {"scopes/pool#slot2": second}, "the teardown frees its own slot, nothing else"
    with pytest.raises(LockConfigurationError, match="re-enters the slot its setup took"):
        LockGuard(hook.database, POOL, _policy(), scope=_role("member", second))


def test_a_member_waits_for_its_slot_held_a_moment_by_another_guard(hook: Any, scopes_db: Any) -> None:
    _enter(hook, uuid.uuid4().hex)
    holder = uuid.uuid4().hex
    assert _enter(hook, holder) == 2
    # As another guard of the pool does a moment while it reads the slot's row.
    reader = hook.database.acquire_lock(
        slot_keys(POOL, SLOTS), shared=False, scope="session", timeout=None, application_name="a reader", candidates=[1]
    )
    assert reader is not None and reader.slot == 2
    threading.Timer(0.5, reader.release).start()
    started = time.monotonic()
    policy = _policy(on_busy="wait", wait_timeout=30)
    with LockGuard(hook.database, POOL, policy, scope=_role("member", holder, slot=2)) as handle:
        assert handle.slot == 2
    assert time.monotonic() - started >= 0.4, "the member took its slot, not another free one"


def test_other_guards_of_the_pool_pass_over_scoped_slots_and_are_busy_when_all_are(hook: Any, scopes_db: Any) -> None:
    first = uuid.uuid4().hex
    _enter(hook, first)
    with LockGuard(hook.database, POOL, _policy()) as handle:
        assert handle.slot == 2, "a pool guard takes the slot no scope holds"
    held = hook.acquire(POOL, slots=SLOTS)
    assert held is not None and held.slot == 2, "hook.acquire passes over the scoped slot too"
    held.release()
    _enter(hook, uuid.uuid4().hex)
    with (
        pytest.raises(LockBusyError, match="2 by lock scopes") as busy,
        LockGuard(hook.database, POOL, _policy()),
    ):
        pytest.fail("a slot ran inside a scope")
    assert busy.value.retry_after is not None and busy.value.retry_after > 200, "a deferred retry waits for the rows"
    assert hook.acquire(POOL, slots=SLOTS) is None
    assert set(hook.scopes(POOL, slots=SLOTS)) == set(slot_keys(POOL, SLOTS))
    with LockGuard(hook.database, POOL, _policy(), scope=_role("leave", first, slot=1)):
        pass
    with LockGuard(hook.database, POOL, _policy()) as handle:
        assert handle.slot == 1, "the freed slot is free for everyone"
    assert advisory_locks_left(scopes_db) == 0


def test_a_pool_guard_that_waits_takes_a_slot_once_a_scope_frees_it(hook: Any, scopes_db: Any) -> None:
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    _enter(hook, first)
    _enter(hook, second)

    def teardown() -> None:
        with LockGuard(hook.database, POOL, _policy(), scope=_role("leave", second, slot=2)):
            pass

    threading.Timer(1.5, teardown).start()
    with LockGuard(hook.database, POOL, _policy(on_busy="wait", wait_timeout=30)) as handle:
        assert handle.slot == 2
        assert _rows(scopes_db) == {"scopes/pool": first}


@pytest.mark.parametrize("found", ["gone", "lapsed"])
def test_a_teardown_that_finds_its_slots_scope_gone_or_lapsed_names_that_slot(
    hook: Any, scopes_db: Any, caplog: Any, found: str
) -> None:
    """The teardown re-checks the row of the slot its setup took: a warning about what it found
    names that slot, not the pool's key (slot 1, whose row is another scope's here)."""
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    _enter(hook, first)
    assert _enter(hook, second) == 2
    if found == "gone":
        scopes_db.execute("DELETE FROM pglock.scopes WHERE holder = %s", [second])
    else:
        scopes_db.execute(
            "UPDATE pglock.scopes SET lease_until = clock_timestamp() - interval '1 second' WHERE holder = %s",
            [second],
        )
    quiet = logging.getLogger("pglock-test-pool-teardown")
    with (
        caplog.at_level(logging.WARNING, logger=quiet.name),
        LockGuard(hook.database, POOL, _policy(), scope=_role("leave", second, slot=2), logger=quiet),
    ):
        pass
    [line] = [
        record.getMessage()
        for record in caplog.records
        if "before its teardown" in record.getMessage() or "was already gone" in record.getMessage()
    ]
    assert slot_keys(POOL, SLOTS)[1].describe() in line, line
    assert POOL.describe() not in line, line
    assert _rows(scopes_db) == {"scopes/pool": first}, "slot 1 is the other scope's, untouched"
    assert advisory_locks_left(scopes_db) == 0


def test_a_running_task_of_a_pool_scope_holds_the_pools_size_markers(hook: Any, scopes_db: Any) -> None:
    holder = uuid.uuid4().hex
    _enter(hook, holder)
    with (
        LockGuard(hook.database, POOL, _policy(), scope=_role("member", holder, slot=1)),
        pytest.raises(LockConfigurationError, match="in use right now as a pool of slots=2"),
        LockGuard(hook.database, POOL, LockPolicy(slots=3)),
    ):
        pytest.fail("a pool of another size ran beside the scope's task")
    assert advisory_locks_left(scopes_db) == 0


class _FailsOnAcquired(logging.LoggerAdapter):  # type: ignore[type-arg]
    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        if str(msg).startswith("pglock acquired"):
            raise RuntimeError("the log handler failed")
        super().info(msg, *args, **kwargs)


@pytest.mark.parametrize("slots", [1, SLOTS])
def test_a_setup_that_fails_after_taking_the_scope_frees_it_under_the_lock(
    hook: Any, scopes_db: Any, slots: int
) -> None:
    logger = _FailsOnAcquired(logging.getLogger("tests.scope_pools"), {})
    guard = LockGuard(
        hook.database, POOL, LockPolicy(slots=slots), scope=_role("enter", uuid.uuid4().hex), logger=logger
    )
    with pytest.raises(RuntimeError, match="the log handler failed"), guard:
        pytest.fail("the setup's work ran")
    assert _rows(scopes_db) == {}, "the scope a failed setup took is freed, not held until its lease ends"
    assert advisory_locks_left(scopes_db) == 0


def test_hook_acquire_comes_back_to_a_slot_a_scope_frees_while_it_waits(hook: Any, scopes_db: Any) -> None:
    holder = uuid.uuid4().hex
    _enter(hook, holder)  # slot 1: a scope between its tasks
    other = hook.acquire(POOL, slots=SLOTS)  # slot 2: a session
    assert other is not None and other.slot == 2

    def teardown() -> None:
        with LockGuard(hook.database, POOL, _policy(), scope=_role("leave", holder, slot=1)):
            pass

    threading.Timer(1.0, teardown).start()
    try:
        held = hook.acquire(POOL, slots=SLOTS, timeout=20)
        assert held is not None and held.slot == 1, "the wait tries the slot it passed over again"
        held.release()
    finally:
        other.release()


def test_a_full_pool_names_the_scopes_and_the_sessions_that_hold_it(hook: Any, scopes_db: Any) -> None:
    _enter(hook, uuid.uuid4().hex)
    other = hook.acquire(POOL, slots=SLOTS, application_name="the other holder")
    assert other is not None
    try:
        with (
            pytest.raises(LockBusyError) as busy,
            LockGuard(hook.database, POOL, _policy()),
        ):
            pytest.fail("ran in a full pool")
    finally:
        other.release()
    message = str(busy.value)
    assert "are held, 1 by lock scopes (slot 1: " in message and "; the other 1 by pid " in message, message
    assert "the other holder" in message and message.count("slots of the pool") == 1, message


def test_locks_counts_the_slots_scopes_hold_and_lists_every_slots_scope(
    hook: Any, scopes_db: Any, dsn: str, capsys: Any
) -> None:
    """A guard finds a slot busy while a scope's row holds it: `locks` counts it as held too, and
    `--pool` / `--key` of the pool list the scopes of all its slots, not slot 1's alone."""
    from tests.ops_helpers import run_cli

    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    assert _enter(hook, first) == 1
    session = hook.acquire(POOL, slots=SLOTS)
    assert session is not None and session.slot == 2, "it passed over the scope's slot"
    try:
        for args in (("--pool", POOL.name, "--slots", str(SLOTS)), ()):
            data = run_cli("locks", "--dsn", dsn, *args, "--output", "json", capsys=capsys).json()
            [pool] = data["pools"]
            assert (pool["held"], pool["scoped_slots"]) == (2, [1]), pool
            assert pool["summary"] == "2 of 2 held (1 by lock scopes)"
        table = run_cli("locks", "--dsn", dsn, "--pool", POOL.name, "--slots", str(SLOTS), capsys=capsys)
        assert f"pool {POOL.name!r}: 2 of 2 held (1 by lock scopes)" in table.out, table.out
    finally:
        session.release()
    assert _enter(hook, second) == 2
    for args in (("--pool", POOL.name, "--slots", str(SLOTS)), ("--key", str(POOL.name))):
        data = run_cli("locks", "--dsn", dsn, *args, "--output", "json", capsys=capsys).json()
        assert sorted(scope["key"]["name"] for scope in data["scopes"]) == [POOL.name, f"{POOL.name}#slot2"], args
    pool = run_cli("locks", "--dsn", dsn, "--pool", POOL.name, "--slots", "2", "--output", "json", capsys=capsys)
    assert pool.json()["pool"]["summary"] == "2 of 2 held (2 by lock scopes)"
    # --dag lists one DAG's scopes, and still counts every scope's slot as held (a guard finds it busy).
    other = run_cli(
        "locks",
        "--dsn",
        dsn,
        "--pool",
        POOL.name,
        "--slots",
        "2",
        "--dag",
        "another_dag",
        "--output",
        "json",
        capsys=capsys,
    ).json()
    assert other["pool"]["summary"] == "2 of 2 held (2 by lock scopes)" and other["scopes"] == []
