"""slots=N: a key names a pool; each holder holds exactly one slot; never more than N at once."""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import InvalidLockKeyError, LockBusyError, LockConfigurationError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import NAME_TO_KEY_SQL, LockKey, slot_keys
from airflow_pglock.pg import statements
from airflow_pglock.pg.release import unlock
from airflow_pglock.policy import LockPolicy

POOL = LockKey.from_name("race-pool")
SLOTS = 3
PROCESSES = 24
ROUNDS = 300
FREE_RUNNING_SECONDS = 8.0
# How many of the pool's slots are held, in all, and by this session: read from pg_locks.
HELD_SQL = (
    "SELECT count(*) FILTER (WHERE l.pid = pg_backend_pid()), count(*) FROM pg_locks l"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.database = (SELECT oid FROM pg_database"
    " WHERE datname = current_database()) AND (l.classid::bigint, l.objid::bigint, l.objsubid::int)"
    " IN (SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::int[]))"
)


def _coordinates(keys: list[LockKey]) -> list[list[int]]:
    return [[key.pg_locks[i] for key in keys] for i in range(3)]


def _racer(dsn: str, worker: int, seed: int, start: Any, tried: Any, errors: Any) -> None:
    try:
        pool = slot_keys(POOL, SLOTS)
        coordinates = _coordinates(pool)
        rng = random.Random(seed + worker)
        with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as log:
            pid = conn.info.backend_pid

            def hold(phase: str, round_no: int, slot: int) -> None:
                mine, total = conn.execute(HELD_SQL, coordinates).fetchone()  # type: ignore[misc]
                log.execute(
                    "INSERT INTO slot_holds (phase, round, worker, pid, slot, mine, total, entered)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s, clock_timestamp())",
                    [phase, round_no, worker, pid, slot, mine, total],
                )

            def leave(phase: str, round_no: int, slot: int) -> None:
                log.execute(
                    "UPDATE slot_holds SET exited = clock_timestamp() WHERE phase = %s AND round = %s AND worker = %s",
                    [phase, round_no, worker],
                )
                assert unlock(conn, pool[slot]), f"worker {worker} lost slot {slot + 1}"

            for round_no in range(ROUNDS):
                start.wait()
                slot = statements.try_slot(conn, pool)
                if slot is not None:
                    hold("rounds", round_no, slot)
                tried.wait()  # every contender has tried while the holders hold
                if slot is not None:
                    leave("rounds", round_no, slot)
            deadline = time.monotonic() + FREE_RUNNING_SECONDS
            attempt = 0
            while time.monotonic() < deadline:
                attempt += 1
                slot = statements.try_slot(conn, pool)
                if slot is not None:
                    hold("free", attempt, slot)
                    time.sleep(rng.uniform(0, 0.004))
                    leave("free", attempt, slot)
                else:
                    time.sleep(rng.uniform(0, 0.002))
    except BaseException as error:  # report to the parent instead of hanging the barriers
        errors.put(f"worker {worker}: {type(error).__name__}: {error}")
        start.abort()
        tried.abort()


@pytest.mark.slow
def test_racing_processes_never_take_more_than_n_slots_or_two_at_once(dsn: str, admin: Any) -> None:
    seed = int(os.environ.get("PGLOCK_SLOTS_SEED", random.randrange(2**32)))
    print(f"slots race seed: {seed} (PGLOCK_SLOTS_SEED={seed} to repeat)")
    admin.execute(
        "DROP TABLE IF EXISTS slot_holds; CREATE TABLE slot_holds (id serial PRIMARY KEY, phase text, round int,"
        " worker int, pid int, slot int, mine int, total int, entered timestamptz, exited timestamptz)"
    )
    ctx = multiprocessing.get_context("fork")
    start, tried, errors = ctx.Barrier(PROCESSES), ctx.Barrier(PROCESSES), ctx.Queue()
    workers = [ctx.Process(target=_racer, args=(dsn, n, seed, start, tried, errors)) for n in range(PROCESSES)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=120)
    assert errors.empty(), errors.get()
    assert all(process.exitcode == 0 for process in workers)

    # pg_locks, read by each holder while it held: it held exactly one slot, the pool at most N.
    assert admin.execute("SELECT count(*) FROM slot_holds WHERE mine <> 1 OR total > %s", [SLOTS]).fetchone()[0] == 0
    # With every contender trying in the same instant, each round filled the pool exactly, one holder a slot.
    per_round = admin.execute(
        "SELECT round, count(*), count(DISTINCT slot) FROM slot_holds WHERE phase = 'rounds' GROUP BY round"
    ).fetchall()
    assert len(per_round) == ROUNDS
    assert all(count == SLOTS and distinct == SLOTS for _, count, distinct in per_round), per_round
    # The side-effect table: never more than N inside at once, never one slot twice at once.
    rows = admin.execute("SELECT count(*) FROM slot_holds WHERE phase = 'free'").fetchone()[0]
    assert rows > 200, rows
    most = admin.execute(
        "SELECT coalesce(max(inside), 0) FROM (SELECT (SELECT count(*) FROM slot_holds b WHERE b.phase = 'free'"
        " AND b.entered <= a.entered AND b.exited > a.entered) AS inside FROM slot_holds a WHERE a.phase = 'free') x"
    ).fetchone()[0]
    assert 1 <= most <= SLOTS
    same_slot = admin.execute(
        "SELECT count(*) FROM slot_holds a JOIN slot_holds b ON a.id < b.id AND a.phase = 'free' AND b.phase = 'free'"
        " AND a.slot = b.slot AND a.entered < b.exited AND b.entered < a.exited"
    ).fetchone()[0]
    assert same_slot == 0


def test_slot_keys_follow_the_documented_rule_in_sql(admin: Any) -> None:
    pool = slot_keys(LockKey.from_name("exports"), 3)
    assert pool[0] == LockKey.from_name("exports")
    assert [key.name for key in pool] == ["exports", "exports#slot2", "exports#slot3"]
    for key in pool:
        assert admin.execute("SELECT " + NAME_TO_KEY_SQL, [key.name]).fetchone()[0] == key.int64
    assert slot_keys(LockKey.from_int(5), 1) == [LockKey.from_int(5)]
    with pytest.raises(InvalidLockKeyError, match="slots=3 needs a key name"):
        slot_keys(LockKey.from_int(5), 3)
    with pytest.raises(InvalidLockKeyError, match="slots must be an integer from 1"):
        slot_keys(pool[0], 0)


def _holding_pids(admin: Any, keys: list[LockKey]) -> dict[int, int]:
    """slot index -> pid of its holder, from pg_locks."""
    rows = admin.execute(
        "SELECT l.classid::bigint, l.objid::bigint, l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted"
    ).fetchall()
    where = {key.pg_locks[:2]: index for index, key in enumerate(keys)}
    return {where[(c, o)]: pid for c, o, pid in rows if (c, o) in where}


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_full_pool_is_busy_naming_every_holder_and_a_freed_slot_is_taken(
    hook: AdvisoryLockHook, admin: Any, mode: str
) -> None:
    pool = LockKey.from_name(f"exports-{mode}")
    keys = slot_keys(pool, 3)
    policy = LockPolicy(mode=mode, slots=3)  # type: ignore[arg-type]
    guards = [LockGuard(hook.database, pool, policy, application_name=f"exporter-{n}") for n in range(3)]
    handles = [guard.__enter__() for guard in guards]
    try:
        assert sorted(handle.key.name or "" for handle in handles) == sorted(key.name or "" for key in keys)
        assert len(_holding_pids(admin, keys)) == 3
        with pytest.raises(LockBusyError) as busy:
            LockGuard(hook.database, pool, policy, application_name="fourth").__enter__()
        message = str(busy.value)
        assert "all 3 slots of the pool" in message
        for handle in handles:
            assert f"pid {handle.backend_pid} " in message
        assert {holder.pid for holder in busy.value.holders} == {handle.backend_pid for handle in handles}
        freed = handles[1].key
        guards[1].__exit__(None, None, None)
        fourth = LockGuard(hook.database, pool, policy, application_name="fourth")
        with fourth as handle:
            assert handle.key == freed  # the first free slot, the one just released
    finally:
        for guard in (guards[0], guards[2]):
            guard.__exit__(None, None, None)
    assert _holding_pids(admin, keys) == {}


def test_wait_takes_a_slot_freed_during_the_wait(hook: AdvisoryLockHook, dsn: str) -> None:
    pool = LockKey.from_name("exports-wait")
    holders = [hook.acquire(pool, slots=2)]
    holders.append(hook.acquire(pool, slots=2))
    assert all(held is not None for held in holders)
    assert {held.key for held in holders if held} == set(slot_keys(pool, 2))
    started = time.monotonic()
    skipping = LockGuard(hook.database, pool, LockPolicy(on_busy="wait", wait_timeout=0.5, slots=2))
    with pytest.raises(LockBusyError, match=r"after waiting 0\.5 s"):
        skipping.__enter__()
    assert time.monotonic() - started >= 0.5
    assert skipping.outcome == "skipped"
    failing = LockGuard(
        hook.database, pool, LockPolicy(on_busy="wait", wait_timeout=0.2, slots=2, on_wait_timeout="fail")
    )
    with pytest.raises(LockBusyError, match=r"after waiting 0\.2 s"):
        failing.__enter__()
    assert failing.outcome == "failed"  # the task fails: so does its outcome line
    timer = threading.Timer(0.5, holders[0].release)  # type: ignore[union-attr]
    timer.start()
    try:
        with LockGuard(hook.database, pool, LockPolicy(on_busy="wait", wait_timeout=30, slots=2)) as handle:
            assert handle.key == holders[0].key  # type: ignore[union-attr]
    finally:
        timer.join()
        for held in holders:
            held.release()  # type: ignore[union-attr]


def test_slots_1_is_the_plain_lock_on_the_same_key(hook: AdvisoryLockHook) -> None:
    """Slot 1 of a pool is the pool's plain key; while a plain holder holds it, a pool of its name
    is refused before any slot is taken (it used to get slot 2 beside the plain holder)."""
    key = LockKey.from_name("plain-or-pool")
    assert slot_keys(key, 2)[0] == key and slot_keys(key, 1) == [key]
    with LockGuard(hook.database, key, LockPolicy()) as handle:
        assert handle.key == key
        with pytest.raises(LockConfigurationError, match="refused a pool of slots=2 on key 'plain-or-pool'"):
            hook.acquire(key, slots=2)
        with pytest.raises(LockConfigurationError, match="plain key of that name"):
            LockGuard(hook.database, key, LockPolicy(slots=2)).__enter__()
    with LockGuard(hook.database, key, LockPolicy(slots=2)) as handle:  # alone, the pool takes slot 1: the plain key
        assert handle.key == key


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"slots": 0}, "slots must be an integer from 1 to 1000, got 0"),
        ({"slots": True}, "slots must be an integer from 1 to 1000, got True"),
        ({"slots": "3"}, "slots must be an integer from 1 to 1000, got '3'"),
        ({"slots": 2, "shared": True}, "shared=True cannot be combined with slots=2"),
    ],
)
def test_bad_slot_options_are_refused_before_any_io(options: dict[str, Any], message: str) -> None:
    with pytest.raises(LockConfigurationError, match=re.escape(message)):
        LockPolicy(**options)


def test_a_numeric_pool_is_refused_before_any_io() -> None:
    hook = AdvisoryLockHook(dsn="host=/nonexistent-socket-dir dbname=nothing")  # any I/O would fail differently
    with pytest.raises(InvalidLockKeyError, match="slots=2 needs a key name"):
        hook.acquire(7, slots=2)


def test_key_slots_prints_the_slot_keys_and_sql_that_takes_them(admin: Any) -> None:
    import io
    import json

    from airflow_pglock.cli.main import main

    out = io.StringIO()
    assert main(["key", "warehouse-exports", "--slots", "3", "--output", "json"], out) == 0
    data = json.loads(out.getvalue())
    expected = slot_keys(LockKey.from_name("warehouse-exports"), 3)
    assert [slot["name"] for slot in data["slot_keys"]] == [key.name for key in expected]
    assert [slot["numbers"] for slot in data["slot_keys"]] == [list(key.numbers) for key in expected]
    for slot, key in zip(data["slot_keys"], expected, strict=True):
        assert admin.execute("SELECT " + slot["sql"]["key"]).fetchone()[0] == key.int64
    text = io.StringIO()
    assert main(["key", "warehouse-exports", "--slots", "3"], text) == 0
    assert "slot 3  'warehouse-exports#slot3'" in text.getvalue()
    assert main(["key", "--int", "5", "--slots", "2"], io.StringIO()) != 0


def test_the_documented_one_statement_sql_takes_one_slot_each_time(dsn: str, admin: Any) -> None:
    from pathlib import Path

    concepts = (Path(__file__).resolve().parents[2] / "docs" / "concepts.md").read_text()
    [statement] = [block for block in re.findall(r"```sql\n(.*?)```", concepts, re.DOTALL) if "WITH RECURSIVE" in block]
    expected = slot_keys(LockKey.from_name("warehouse-exports"), 3)
    sessions = [psycopg.connect(dsn, autocommit=True) for _ in range(4)]
    try:
        taken = [session.execute(statement).fetchall() for session in sessions]
        assert taken == [[(1,)], [(2,)], [(3,)], []]  # one slot each, then the pool is full
        assert _holding_pids(admin, expected) == {n: sessions[n].info.backend_pid for n in range(3)}
    finally:
        for session in sessions:
            session.close()


def test_locks_shows_a_pool_as_one_row_with_its_holders(dsn: str, holder_hook: AdvisoryLockHook) -> None:
    import io
    import json

    from airflow_pglock.cli.main import main

    held = [holder_hook.acquire("report-pool", application_name=f"exporter {n}", slots=3) for n in range(2)]
    other = holder_hook.acquire("not-in-the-pool")
    try:
        out = io.StringIO()
        assert main(["locks", "--dsn", dsn, "--pool", "report-pool", "--slots", "3", "--output", "json"], out) == 0
        data = json.loads(out.getvalue())
        assert data["pool"]["summary"] == "2 of 3 held" and data["pool"]["slots"] == 3
        assert {h["pid"] for h in data["pool"]["holders"]} == {lock.server.backend_pid for lock in held if lock}
        assert sorted(h["key"]["name"] for h in data["pool"]["holders"]) == ["report-pool", "report-pool#slot2"]
        assert sorted(entry["key"]["name"] for entry in data["locks"]) == ["report-pool", "report-pool#slot2"]
        text = io.StringIO()
        assert main(["locks", "--dsn", dsn, "--pool", "report-pool", "--slots", "3"], text) == 0
        assert "pool 'report-pool': 2 of 3 held" in text.getvalue()
        assert "not-in-the-pool" not in text.getvalue()
        assert main(["locks", "--dsn", dsn, "--slots", "3"], io.StringIO()) != 0  # --slots needs --pool
    finally:
        for lock in [*held, other]:
            if lock is not None:
                lock.release()


@pytest.fixture
def registry_dsn(pg_server: str) -> Any:
    """A database of its own with init-db done (the key-name registry records each pool's size)."""
    from airflow_pglock.pg.schema import migrate
    from tests.ops_helpers import scratch_database

    with scratch_database(pg_server, prefix="pglock_pools") as scratch:
        with psycopg.connect(scratch, autocommit=True) as conn:
            migrate(conn)
        yield scratch


def _guarded_slot(dsn: str, pool: str, slots: int, dag: str) -> LockGuard:
    from airflow_pglock.identity import TaskIdentity

    app = TaskIdentity(dag, "export", "manual__2026-11-30T00:00:00+00:00", -1).application_name()
    guard = LockGuard(
        AdvisoryLockHook(dsn=dsn).database, LockKey.from_name(pool), LockPolicy(slots=slots), application_name=app
    )
    guard.__enter__()
    return guard


def _locks(dsn: str, *args: str) -> Any:
    import io
    import json

    from airflow_pglock.cli.main import main

    out = io.StringIO()
    assert main(["locks", "--dsn", dsn, *args], out) == 0
    return json.loads(out.getvalue()) if "json" in args else out.getvalue()


def _earlier_run(dsn: str, pool: str, slots: int, count: int) -> None:
    """Hold ``count`` slots at once and release them: each release records its slot's name and
    the pool's size in the registry (a size is known to `locks` once a hold that says it ends)."""
    guards = [_guarded_slot(dsn, pool, slots, f"earlier_{n}") for n in range(count)]
    for guard in guards:
        guard.__exit__(None, None, None)


def test_locks_groups_every_registered_pool_into_one_row_without_being_told_n(registry_dsn: str) -> None:
    _earlier_run(registry_dsn, "report-pool", 3, 2)  # slots 1 and 2: slot 3 stays unrecorded
    guards = [_guarded_slot(registry_dsn, "report-pool", 3, dag) for dag in ("exports_eu", "exports_us")]
    # A service outside Airflow takes slot 3 with plain SQL: no registry row of its own.
    cron = psycopg.connect(registry_dsn, autocommit=True, application_name="cron exporter")
    cron.execute("SELECT pg_advisory_lock(%s)", slot_keys(LockKey.from_name("report-pool"), 3)[2].numbers)
    cron4 = psycopg.connect(registry_dsn, autocommit=True, application_name="cron exporter 4")
    waiter = psycopg.connect(registry_dsn, autocommit=True, application_name="reporting job")
    queued: threading.Thread | None = None
    admin = psycopg.connect(registry_dsn, autocommit=True)
    earlier = AdvisoryLockHook(dsn=registry_dsn).acquire("not-in-the-pool")
    assert earlier is not None and earlier.release()  # records its name
    other = AdvisoryLockHook(dsn=registry_dsn).acquire("not-in-the-pool")
    try:
        data = _locks(registry_dsn, "--output", "json")
        [pool] = data["pools"]
        assert pool["name"] == "report-pool" and pool["summary"] == "3 of 3 held"
        assert pool["slots"] == 3 and pool["slots_source"] == "registry" and pool["slots_recorded"] == [3]
        assert sorted((h["slot"], h["key"]["name"], h["application_name"]) for h in pool["holders"]) == [
            (1, "report-pool", guards[0].application_name),
            (2, "report-pool#slot2", guards[1].application_name),
            (3, "report-pool#slot3", "cron exporter"),
        ]
        assert pool["waiting"] == [] and "pool" not in data  # `pool` only with --pool
        assert len(data["locks"]) == 4  # every session is still listed, each slot under its name
        [slot3] = [e for e in data["locks"] if e["application_name"] == "cron exporter"]
        assert slot3["key"]["name"] == "report-pool#slot3" and slot3["key"]["name_source"] == "pool"

        text = _locks(registry_dsn)
        [row] = [line for line in text.splitlines() if "report-pool" in line]  # the pool is one row
        assert "report-pool (pool of 3)" in row and "3 of 3 held" in row
        assert "slot 1: exports_eu / export" in row and "slot 3: cron exporter" in row
        assert str(cron.info.backend_pid) in row
        assert any("not-in-the-pool" in line for line in text.splitlines())

        by_key = _locks(registry_dsn, "--key", "report-pool", "--output", "json")  # the pool's name: all its slots
        assert [p["summary"] for p in by_key["pools"]] == ["3 of 3 held"] and len(by_key["locks"]) == 3
        by_dag = _locks(registry_dsn, "--dag", "exports_us", "--output", "json")
        assert [p["held"] for p in by_dag["pools"]] == [3]  # the dag holds a slot: its pool, whole
        assert [e["key"]["name"] for e in by_dag["locks"]] == ["report-pool#slot2"]
        assert _locks(registry_dsn, "--key", "not-in-the-pool", "--output", "json")["pools"] == []

        # A session queued for slot 1: the pool's row names it and whom it waits behind.
        queued = threading.Thread(
            target=lambda: waiter.execute("SELECT pg_advisory_lock(%s)", [LockKey.from_name("report-pool").int64])
        )
        queued.start()
        queued_by = time.monotonic() + 30
        while not [e for e in _locks(registry_dsn, "--output", "json")["locks"] if e["state"] == "waiting"]:
            assert time.monotonic() < queued_by, "the session never queued for slot 1"
            time.sleep(0.05)
        [row] = [line for line in _locks(registry_dsn).splitlines() if "report-pool" in line]
        behind = guards[0].held.server.backend_pid  # type: ignore[union-attr]
        assert f"1 waiting (pid {waiter.info.backend_pid} behind {behind})" in row, row

        # A deployment that says slots=4 while the pool of 3 is held is refused before any slot.
        with pytest.raises(LockConfigurationError, match="refused a pool of slots=4 on key 'report-pool'"):
            _guarded_slot(registry_dsn, "report-pool", 4, "exports_apac")
        # The registry may still say 4 for a slot (recorded by a hold of another time), here held by
        # a service outside Airflow: `locks` shows the disagreement.
        slot4 = slot_keys(LockKey.from_name("report-pool"), 4)[3]
        admin.execute(
            "INSERT INTO pglock.key_names (objsubid, classid, objid, name, slots) VALUES (%s, %s, %s, %s, 4)",
            [slot4.pg_locks[2], slot4.pg_locks[0], slot4.pg_locks[1], slot4.name],
        )
        cron4.execute("SELECT pg_advisory_lock(%s)", slot4.numbers)
        [pool] = _locks(registry_dsn, "--output", "json")["pools"]
        assert pool["slots"] == 4 and pool["slots_recorded"] == [3, 4] and pool["held"] == 4
        assert pool["summary"].startswith("4 of 4 held (deployments recorded different sizes: 3, 4;")
    finally:
        for guard in guards:
            guard.__exit__(None, None, None)
        if queued is not None:
            queued.join(10)
            waiter.execute("SELECT pg_advisory_unlock_all()")
        waiter.close()
        cron.close()
        cron4.close()
        admin.execute("DELETE FROM pglock.key_names WHERE name = 'report-pool#slot4'")
        admin.close()
        if other is not None:
            other.release()
    # The pool grown to 5: slot 1's row (recorded with 3) now says 5, and so does the row.
    _guarded_slot(registry_dsn, "report-pool", 5, "exports_eu").__exit__(None, None, None)
    resized = _guarded_slot(registry_dsn, "report-pool", 5, "exports_eu")
    try:
        [pool] = _locks(registry_dsn, "--output", "json")["pools"]
        assert (pool["summary"], pool["slots_recorded"]) == ("1 of 5 held", [5])
    finally:
        resized.__exit__(None, None, None)


def test_a_pool_waiter_named_by_its_caller_shows_no_markers_as_locks_of_its_own(registry_dsn: str) -> None:
    """A pool's wait tries its slots again and again, holding the pool's two markers meanwhile.
    With an application_name of the caller's choosing (not an airflow-pglock session name) those
    showed as two unnamed shared locks; the registry knows the pool, so they are its markers."""
    _earlier_run(registry_dsn, "wait-pool", 2, 2)  # the registry learns the pool and its size
    hook = AdvisoryLockHook(dsn=registry_dsn)
    held = [hook.acquire("wait-pool", slots=2) for _ in range(2)]
    assert all(h is not None for h in held)
    waiting = threading.Thread(
        target=lambda: hook.acquire("wait-pool", slots=2, timeout=5, application_name="etl-waiter"), daemon=True
    )
    waiting.start()
    try:
        with psycopg.connect(registry_dsn, autocommit=True) as admin:
            limit = time.monotonic() + 5
            while not admin.execute(
                "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                " WHERE l.locktype = 'advisory' AND a.application_name = 'etl-waiter'"
            ).fetchone():
                assert time.monotonic() < limit, "the waiter never took the pool's markers"
                time.sleep(0.02)
        data = _locks(registry_dsn, "--output", "json")
        assert [e for e in data["locks"] if e["application_name"] == "etl-waiter"] == []
        assert [p["summary"] for p in data["pools"]] == ["2 of 2 held"]
    finally:
        for h in held:
            if h is not None:
                h.release()
        waiting.join(10)


def test_without_the_registry_pool_slots_stay_separate_rows(dsn: str, hook: AdvisoryLockHook) -> None:
    held = [hook.acquire("plain-pool", slots=2) for _ in range(2)]
    try:
        data = _locks(dsn, "--output", "json")
        assert data["registry"] == "not installed" and data["pools"] == []
        mine = {tuple(e["key"]["numbers"]) for e in data["locks"]}
        assert {tuple(k.numbers) for k in slot_keys(LockKey.from_name("plain-pool"), 2)} <= mine
        given = _locks(dsn, "--pool", "plain-pool", "--slots", "2", "--output", "json")  # still: tell N
        assert given["pool"]["summary"] == "2 of 2 held" and [p["slots_source"] for p in given["pools"]] == ["given"]
    finally:
        for lock in held:
            if lock is not None:
                lock.release()


def _terminate_aside(dsn: str, pid: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", [pid])


def test_a_lost_slot_interrupts_the_work_and_names_the_slot(dsn: str, admin: Any) -> None:
    from airflow_pglock.exceptions import LockLostError
    from airflow_pglock.liveness import Liveness

    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    pool = LockKey.from_name("lost-pool")
    other = hook.acquire(pool, slots=2)
    assert other is not None
    started = time.monotonic()
    try:
        with (
            pytest.raises(LockLostError, match="lost-pool#slot2"),
            LockGuard(hook.database, pool, LockPolicy(slots=2)) as handle,
        ):
            assert handle.key.name == "lost-pool#slot2"
            threading.Thread(target=_terminate_aside, args=(dsn, handle.backend_pid), daemon=True).start()
            while time.monotonic() - started < 30:  # the heartbeat interrupts this loop
                time.sleep(0.05)
            raise AssertionError("the lost slot did not interrupt the block")
    finally:
        other.release()


# ------------------------------------------- pool sizes checked at run time (issue round two, row 6)


def _enter(hook: AdvisoryLockHook, key: str, mode: str = "session", slots: int = 1, app: str = "t") -> LockGuard:
    guard = LockGuard(hook.database, LockKey.from_name(key), LockPolicy(mode=mode, slots=slots), application_name=app)  # type: ignore[arg-type]
    guard.__enter__()
    return guard


def _advisory_pids(admin: Any, expected: set[int] | None = None) -> set[int]:
    """The pids holding an advisory lock; with ``expected``, polled until they are those (a closed
    session's backend exits asynchronously) or 10 s passed."""
    deadline = time.monotonic() + 10
    while True:
        rows = admin.execute(
            "SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
        pids = {row[0] for row in rows}
        if expected is None or pids == expected or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_pool_of_another_size_is_refused_before_any_slot_is_taken(
    hook: AdvisoryLockHook, admin: Any, mode: str
) -> None:
    """slots=3 holders, then slots=5 under the same name: the 5 is refused (a configuration error
    naming the pool, both sizes and the holder), not given a fourth slot."""
    holders = [_enter(hook, "sized-exports", mode, 3, app=f"exports-3-{n}") for n in range(2)]
    try:
        pids_before = _advisory_pids(admin)
        for other in (5, 2):
            with pytest.raises(LockConfigurationError) as refused:
                _enter(hook, "sized-exports", mode, other, app=f"exports-{other}")
            message = str(refused.value)
            assert f"refused a pool of slots={other} on key 'sized-exports'" in message
            assert "in use right now as a pool of slots=3" in message
            assert "application_name 'exports-3-" in message and "pid " in message
            assert _advisory_pids(admin, pids_before) == pids_before  # the refused session took nothing, is gone
        third = _enter(hook, "sized-exports", mode, 3, app="exports-3-2")  # the same size still gets its slot
        holders.append(third)
        with pytest.raises(LockBusyError, match="all 3 slots"):  # and a full pool is busy, as before
            _enter(hook, "sized-exports", mode, 3)
    finally:
        for guard in holders:
            guard.__exit__(None, None, None)
    assert _advisory_pids(admin, set()) == set(), "the refused and busy guards' backends have exited"
    with _enter_context(hook, "sized-exports", mode, 5) as handle:  # nobody holds the 3 any more: 5 is fine now
        assert handle.key.name == "sized-exports"


def _enter_context(hook: AdvisoryLockHook, key: str, mode: str, slots: int) -> LockGuard:
    return LockGuard(hook.database, LockKey.from_name(key), LockPolicy(mode=mode, slots=slots))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_plain_key_and_a_pool_of_its_name_refuse_each_other(hook: AdvisoryLockHook, admin: Any, mode: str) -> None:
    """The e7 scenario: a plain ``exports``, then slots=3 and slots=5 pools of that name used to
    make four sessions hold an ``exports`` key at once. Now only the first user of the name holds."""
    plain = _enter(hook, "mixed-exports", mode, app="plain exporter")
    assert plain.held is not None
    pid = plain.held.server.backend_pid
    try:
        for slots in (3, 5):
            with pytest.raises(
                LockConfigurationError, match=rf"refused a pool of slots={slots} .*plain key of that name"
            ):
                _enter(hook, "mixed-exports", mode, slots)
            # The refused guard gives its size marker back before it closes (it once left it to the
            # close, and the next pool was refused for that marker, a moment later, instead).
            assert _advisory_pids(admin, {pid}) == {pid}
        with pytest.raises(LockBusyError):  # another plain holder of the name: busy, as ever
            _enter(hook, "mixed-exports", mode)
        with _enter_context(hook, "mixed-exports#slot2", mode, 1) as handle:  # P and P#slot2 stay distinct
            assert handle.key.name == "mixed-exports#slot2"
        assert _advisory_pids(admin, {pid}) == {pid}
    finally:
        plain.__exit__(None, None, None)
    # The other way round: pool holders first; a plain key of the name is refused, not "busy",
    # whether slot 1 (the plain key itself) is held or free.
    first, second = _enter(hook, "mixed-exports", mode, 3, app="pool-1"), _enter(hook, "mixed-exports", mode, 3)
    try:
        expected = r"refused a plain key .*in use right now as a pool"
        with pytest.raises(LockConfigurationError, match=expected) as refused:
            _enter(hook, "mixed-exports", mode)
        assert "application_name 'pool-1'" in str(refused.value)
        first.__exit__(None, None, None)  # slot 1 is free now, slot 2 still held
        with pytest.raises(LockConfigurationError, match="refused a plain key"):
            _enter(hook, "mixed-exports", mode)
        waiting = LockGuard(
            hook.database, LockKey.from_name("mixed-exports"), LockPolicy(on_busy="wait", wait_timeout=5)
        )
        with pytest.raises(LockConfigurationError, match="refused a plain key"):
            waiting.__enter__()
    finally:
        second.__exit__(None, None, None)
    assert _advisory_pids(admin, set()) == set(), (
        "the refused guards' backends have exited (they took the key, then closed)"
    )
    with _enter_context(hook, "mixed-exports", mode, 1) as handle:  # no pool any more: the plain key is free
        assert handle.key.name == "mixed-exports"


def test_a_foreign_program_holding_a_marker_key_is_a_refusal_and_pairs_do_not_interfere(
    hook: AdvisoryLockHook, admin: Any
) -> None:
    """The markers are int64 keys whose high half is a hash of the pool's name: another program's
    int64 key that happens to be one is named in the refusal; its (int32, int32) pairs, a key
    space of their own, never meet a marker."""
    from airflow_pglock.keys import pool_presence_marker, pool_size_marker

    pool = LockKey.from_name("marker-exports")
    marker = pool_size_marker(pool, 3)
    classid, objid, objsubid = marker.pg_locks
    assert (objid, objsubid) == (3, 1) and pool_presence_marker(pool).pg_locks == (classid, 0, 1)
    first, second = classid - 2**32 if classid > 2**31 - 1 else classid, 3
    with psycopg.connect(admin.info.dsn, autocommit=True, application_name="other program") as other:
        other.execute(
            "SELECT pg_advisory_lock(%s::integer, %s::integer)", [first, second]
        )  # the same numbers, as a pair
        with _enter_context(hook, "marker-exports", "session", 3) as handle:
            assert handle.key == pool
        other.execute("SELECT pg_advisory_unlock_all()")
        other.execute("SELECT pg_advisory_lock(%s::bigint)", [marker.int64])
        with pytest.raises(LockConfigurationError, match="another program whose own int64 key") as refused:
            _enter(hook, "marker-exports", "session", 3)
        assert "application_name 'other program'" in str(refused.value)


def _pool_racer(dsn: str, name: str, slots: int, rounds: int, start: Any, done: Any, out: Any) -> None:
    hook = AdvisoryLockHook(dsn=dsn)
    for round_no in range(rounds):
        start.wait(timeout=120)
        held = None
        try:
            held = hook.acquire(name, slots=slots)
            out.put((round_no, slots, "held" if held is not None else "busy"))
        except LockConfigurationError:
            out.put((round_no, slots, "refused"))
        except Exception as error:  # reported by the test, which then fails
            out.put((round_no, slots, f"error {type(error).__name__}: {error}"))
        done.wait(timeout=120)  # every racer has tried while the holders hold
        if held is not None:
            held.release()


@pytest.mark.slow
def test_racing_pools_of_two_sizes_and_a_plain_key_never_both_pass(dsn: str, admin: Any) -> None:
    """Holders of one name with sizes 2, 3 and 1 (a plain key) start at the same instant, round
    after round: in no round do two different sizes both hold (both may be refused)."""
    rounds = 60
    sizes = [1, 2, 2, 3, 3]
    context = multiprocessing.get_context("spawn")
    start, done, out = context.Barrier(len(sizes)), context.Barrier(len(sizes)), context.Queue()
    racers = [
        context.Process(target=_pool_racer, args=(dsn, "raced-sizes", slots, rounds, start, done, out))
        for slots in sizes
    ]
    for racer in racers:
        racer.start()
    results = [out.get(timeout=300) for _ in range(rounds * len(sizes))]
    for racer in racers:
        racer.join(60)
        assert racer.exitcode == 0
    assert [what for _, _, what in results if what.startswith("error")] == []
    by_round: dict[int, set[int]] = {}
    for round_no, slots, what in results:
        if what == "held":
            by_round.setdefault(round_no, set()).add(slots)
    assert all(len(held_sizes) == 1 for held_sizes in by_round.values()), by_round
    held_counts: dict[tuple[int, int], int] = {}
    for round_no, slots, what in results:
        if what == "held":
            held_counts[(round_no, slots)] = held_counts.get((round_no, slots), 0) + 1
    assert all(count <= slots for (_, slots), count in held_counts.items()), held_counts
    assert any(what == "refused" for _, _, what in results)


@pytest.mark.slow
def test_racing_plain_holders_of_one_name_are_busy_never_refused(dsn: str, admin: Any) -> None:
    """Plain holders of a name check the pool's presence marker with a momentary exclusive try,
    which fails while another plain holder makes the same try: that is never a refusal."""
    rounds = 80
    racers_count = 5
    context = multiprocessing.get_context("spawn")
    start, done, out = context.Barrier(racers_count), context.Barrier(racers_count), context.Queue()
    racers = [
        context.Process(target=_pool_racer, args=(dsn, "raced-plain", 1, rounds, start, done, out))
        for _ in range(racers_count)
    ]
    for racer in racers:
        racer.start()
    results = [out.get(timeout=300) for _ in range(rounds * racers_count)]
    for racer in racers:
        racer.join(60)
        assert racer.exitcode == 0
    assert [what for _, _, what in results if what not in ("held", "busy")] == []
    held = [round_no for round_no, _, what in results if what == "held"]
    assert sorted(held) == list(range(rounds))  # one holder a round


def test_hook_acquire_refuses_a_shared_pool_before_connecting() -> None:
    """A pool's slots are exclusive: shared=True with slots>1 is refused, as by the guard's policy,
    rather than taken exclusively and then reported not held (is_held) and not released."""
    unreachable = AdvisoryLockHook(dsn="postgresql://postgres@127.0.0.1:1/nowhere")
    with pytest.raises(LockConfigurationError, match="shared=True cannot be combined with slots=2"):
        unreachable.acquire("pool/shared", shared=True, slots=2)


def test_a_guard_built_directly_refuses_run_rules_on_a_pool() -> None:
    """once_per / min_interval / fencing are records of one key: a LockGuard refuses them with slots>1
    itself, not only the decorator's options (else each slot would run the period once)."""
    from airflow_pglock.run_rules import RunRules

    unreachable = AdvisoryLockHook(dsn="postgresql://postgres@127.0.0.1:1/nowhere")
    for rules in (RunRules(period="2026-12-03"), RunRules(min_interval=60.0), RunRules(fencing=True)):
        with pytest.raises(LockConfigurationError, match="slots=2 cannot be combined with once_per"):
            LockGuard(unreachable.database, LockKey.from_name("pool/rules"), LockPolicy(slots=2), rules=rules)
