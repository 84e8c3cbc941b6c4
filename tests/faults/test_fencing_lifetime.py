"""Fencing tokens over a lock's lifetime, on a real PostgreSQL: a holder that lost its key
before its token was issued never gets a token newer than the next holder's.

In transaction mode the token is issued on a side connection. A holder stalled between
its lock and its token (a slow side connect, a GC pause, CPU starvation) for longer than
the lease loses the key (the server ends its idle transaction) and a contender takes it
with the next token; the stalled holder must then get no token at all and fail as lost,
and the contender's token must stay the newest.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockLostError
from airflow_pglock.guard import LockGuard
from airflow_pglock.handle import LockHandle
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg import schema
from airflow_pglock.policy import LockPolicy
from airflow_pglock.run_rules import RunRules
from devtools.pgbouncer import PgBouncer, PgBouncerUnavailableError
from tests.faults.conftest import FAULT_DATABASE, FaultServer

pytestmark = [pytest.mark.faults, pytest.mark.slow]

LEASE = 3.0


class SilentHost:
    """A "host" that accepts TCP connections and never answers: the first host of a
    multi-host DSN that stalls a connect until :meth:`release` (which closes the held
    connections, so that the driver goes on to the next host at once).

    :param pass_first: how many connections to refuse at once (closed on accept, so the
        driver moves on to the next host without waiting) before holding the next ones.
    """

    def __init__(self, pass_first: int) -> None:
        self.pass_first = pass_first
        self.stalled = threading.Event()
        self._released = threading.Event()
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="silent host", daemon=True)

    def __enter__(self) -> SilentHost:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._listener.close()
        self._thread.join(10)

    def _accept(self) -> None:
        accepted = 0
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed by __exit__
                return
            accepted += 1
            with self._lock:
                if accepted <= self.pass_first or self._released.is_set():
                    conn.close()
                    continue
                self._held.append(conn)
            self.stalled.set()

    def release(self) -> None:
        with self._lock:
            self._released.set()
            for conn in self._held:
                conn.close()
            self._held.clear()


def _start_holder_a(guard_a: LockGuard, tokens: list[int | None], errors: list[BaseException]) -> threading.Thread:
    """Holder A's run in a thread of its own: the token its work got, or the error its run raised."""

    def run_a() -> None:
        try:
            guard_a.run(lambda lock: tokens.append(lock.fencing_token))
        except BaseException as error:
            errors.append(error)

    holder_a = threading.Thread(target=run_a, name="holder A", daemon=True)
    holder_a.start()
    return holder_a


@pytest.fixture
def fencing_db(fault_server: FaultServer, fault_admin: Any) -> Iterator[Any]:
    """The fault database with airflow-pglock's tables and no fencing token issued yet."""
    schema.migrate(fault_admin)
    fault_admin.execute("TRUNCATE pglock.fencing_tokens")
    yield fault_admin


def test_transaction_holder_stalled_before_its_token_gets_none_and_is_lost(
    fault_server: FaultServer, fencing_db: Any
) -> None:
    """A holds the key (transaction mode, fencing) and its fencing side connection stalls (the
    first host of its multi-host DSN never answers) past the lease: the server ends A's idle
    transaction, B takes the key and token N. When A's side connection goes through, A must
    get no token (its run fails as lost, its work never runs) and B's token stays the newest,
    so B's fenced writes are accepted."""
    key = LockKey.from_name("fenced-stall")
    a_tokens: list[int | None] = []
    a_error: list[BaseException] = []
    b_seen: dict[str, Any] = {}

    with SilentHost(pass_first=1) as silent:
        slow_dsn = (
            f"host=127.0.0.1,127.0.0.1 port={silent.port},{fault_server.cluster.port}"
            f" user=postgres dbname={FAULT_DATABASE}"
        )
        # connect_timeout: the stall ends when the test releases it, never by the driver's timeout
        hook_a = AdvisoryLockHook(dsn=slow_dsn, connect_timeout=120, liveness=Liveness(LEASE))
        guard_a = LockGuard(
            hook_a.database,
            key,
            LockPolicy(mode="transaction"),
            rules=RunRules(fencing=True),
            application_name="holder A",
        )
        holder_a = _start_holder_a(guard_a, a_tokens, a_error)
        # A's lock connection went through (the silent host refused it at once); its fencing
        # side connection is the one held
        assert silent.stalled.wait(60), "A's fencing side connection never reached the silent host"
        assert guard_a.held is not None, "A's lock should be taken before its token is issued"

        def work_b(lock: LockHandle) -> None:
            b_seen["token"] = lock.fencing_token
            silent.release()  # A's side connection goes on to the real server now
            holder_a.join(60)
            b_seen["a_done"] = not holder_a.is_alive()
            with fault_server.admin() as other:
                b_seen["newest"] = other.execute("SELECT pglock.current_fencing_token('fenced-stall')").fetchone()[0]
                try:
                    other.execute(
                        "SELECT pglock.assert_fencing_token('fenced-stall', %s::bigint)", [lock.fencing_token]
                    )
                    b_seen["write"] = "accepted"
                except psycopg.errors.CheckViolation as refused:
                    b_seen["write"] = f"refused: {refused}"

        # B waits for the key: it gets it when the server ends A's idle transaction at the lease
        guard_b = LockGuard(
            AdvisoryLockHook(dsn=fault_server.dsn, liveness=Liveness(LEASE)).database,
            key,
            LockPolicy(mode="transaction", on_busy="wait", wait_timeout=60),
            rules=RunRules(fencing=True),
            application_name="holder B",
        )
        guard_b.run(work_b)

    assert b_seen["a_done"], "holder A did not finish"
    assert guard_b.outcome == "completed"
    assert a_tokens == [], f"A's work ran with token {a_tokens} after B took the key with {b_seen['token']}: {b_seen}"
    assert b_seen["newest"] == b_seen["token"], "B's token must stay the newest"
    assert b_seen["write"] == "accepted"
    assert len(a_error) == 1 and isinstance(a_error[0], LockLostError), a_error
    assert "fencing token" in str(a_error[0])
    assert guard_a.outcome == "lost"
    assert guard_a.fencing_token is None


@pytest.fixture
def bouncer(fault_server: FaultServer, fencing_db: Any) -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling (stopped before fault_admin checks for leftovers)."""
    try:
        bouncer = PgBouncer(fault_server.cluster.port, pool_mode="transaction", pool_size=4)
    except PgBouncerUnavailableError as error:
        pytest.skip(f"PgBouncer is not available: {error}")
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


def test_transaction_mode_token_through_pgbouncer_checks_the_lock_session(bouncer: PgBouncer, fencing_db: Any) -> None:
    """Through transaction pooling the side connection's statements may run on other server
    sessions than the lock's: the token's check names the lock's own backend (its pid from
    the lock statement), so a healthy holder still gets its token, and the next one a larger."""
    tokens: list[int | None] = []
    dsn = bouncer.dsn_for(FAULT_DATABASE)
    for _ in range(2):
        guard = LockGuard(
            AdvisoryLockHook(dsn=dsn, liveness=Liveness(LEASE)).database,
            LockKey.from_name("fenced-bouncer"),
            LockPolicy(mode="transaction"),
            rules=RunRules(fencing=True),
        )
        guard.run(lambda lock: tokens.append(lock.fencing_token))
        assert guard.outcome == "completed"
    assert tokens[0] is not None and tokens[1] is not None and tokens[1] > tokens[0]
    newest = fencing_db.execute("SELECT pglock.current_fencing_token('fenced-bouncer')").fetchone()[0]
    assert newest == tokens[1]


def test_transaction_holder_whose_token_commit_waits_past_the_lease_never_starts_its_work(
    fault_server: FaultServer, fencing_db: Any
) -> None:
    """A holds the key (transaction mode, fencing); its token's statement on the side connection
    finds A's transaction, then waits past the lease (here a row lock on the key's token row; in
    the fault campaign a synchronous standby not yet reconnected after the primary restarted)
    while A's transaction sits idle, and the server ends it. B takes the key meanwhile. When the
    wait ends, A's token is committed, but A's work must not start: the run fails as lost, its
    token never handed over."""
    key = LockKey.from_name("fenced-commit-wait")
    a_tokens: list[int | None] = []
    a_error: list[BaseException] = []
    b_seen: dict[str, Any] = {}

    def guard(name: str, policy: LockPolicy, rules: RunRules | None) -> LockGuard:
        database = AdvisoryLockHook(dsn=fault_server.dsn, liveness=Liveness(LEASE)).database
        return LockGuard(database, key, policy, rules=rules, application_name=name)

    guard(  # the key's token row exists: a foreign session can then lock it
        "first", LockPolicy(mode="transaction"), RunRules(fencing=True)
    ).run(lambda lock: None)
    with fault_server.admin() as foreign:
        foreign.autocommit = False
        foreign.execute("SELECT token FROM pglock.fencing_tokens WHERE key_name = 'fenced-commit-wait' FOR UPDATE")
        guard_a = guard("holder A", LockPolicy(mode="transaction"), RunRules(fencing=True))
        holder_a = _start_holder_a(guard_a, a_tokens, a_error)

        def work_b(lock: LockHandle) -> None:
            b_seen["taken"] = True
            foreign.rollback()  # A's token statement goes on now
            holder_a.join(60)
            b_seen["a_done"] = not holder_a.is_alive()

        # B waits for the key: it gets it when the server ends A's idle transaction at the lease
        deadline = time.monotonic() + 30
        while guard_a.held is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert guard_a.held is not None, "A's lock should be taken before its token is issued"
        guard("holder B", LockPolicy(mode="transaction", on_busy="wait", wait_timeout=60), None).run(work_b)

    assert b_seen.get("a_done"), f"holder A did not finish: {b_seen}"
    assert a_tokens == [], f"A's work ran with token {a_tokens} after its transaction ended and B took the key"
    assert len(a_error) == 1 and isinstance(a_error[0], LockLostError), a_error
    assert "while the token's commit on the side connection waited" in str(a_error[0])
    assert guard_a.outcome == "lost"


def test_a_token_commit_cut_off_by_its_bound_after_the_lease_is_reported_lost(
    fault_server: FaultServer, fencing_db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the wait outlasts the token's commit bound too (``TOKEN_COMMIT_WAIT_SECONDS``,
    shortened here): the bound's error must not hide that the lock's transaction ended at the lease
    meanwhile: the run is lost (review -78), not an ordinary failure."""
    from airflow_pglock.pg import ledger

    monkeypatch.setattr(ledger, "TOKEN_COMMIT_WAIT_SECONDS", LEASE + 1.5)
    key = LockKey.from_name("fenced-commit-bound")
    a_tokens: list[int | None] = []
    a_error: list[BaseException] = []
    database = AdvisoryLockHook(dsn=fault_server.dsn, liveness=Liveness(LEASE)).database
    LockGuard(database, key, LockPolicy(mode="transaction"), rules=RunRules(fencing=True)).run(lambda lock: None)
    with fault_server.admin() as foreign:
        foreign.autocommit = False
        foreign.execute("SELECT token FROM pglock.fencing_tokens WHERE key_name = 'fenced-commit-bound' FOR UPDATE")
        guard_a = LockGuard(
            database, key, LockPolicy(mode="transaction"), rules=RunRules(fencing=True), application_name="holder A"
        )
        holder_a = _start_holder_a(guard_a, a_tokens, a_error)
        holder_a.join(60)
        foreign.rollback()
    assert not holder_a.is_alive()
    assert a_tokens == []
    assert len(a_error) == 1 and isinstance(a_error[0], LockLostError), a_error
    assert "while the token's commit on the side connection waited" in str(a_error[0])
    assert guard_a.outcome == "lost"


def test_a_deferred_operators_new_try_whose_row_delete_waits_keeps_its_heartbeat_fed(
    fault_server: FaultServer, fencing_db: Any
) -> None:
    """A guarded deferrable operator's new try finds its earlier try's live row and deletes it on the
    lock's own session; the DELETE waits past the lease (here a row lock; a synchronous standby in
    review -78). The session answered, the key stayed held: the work must run to completion, not be
    interrupted as lost by a heartbeat counting from before the DELETE."""
    from airflow_pglock.scope_rules import ScopeRole

    key, holder = LockKey.from_name("handed-over-delete"), "earlier-try"
    database = AdvisoryLockHook(dsn=fault_server.dsn, liveness=Liveness(LEASE)).database
    enter = ScopeRole(kind="enter", holder=holder, run="r", task="setup", lease=600)
    LockGuard(database, key, LockPolicy(), scope=enter).run(lambda lock: None)
    worked: list[str] = []

    def work(lock: LockHandle) -> None:
        worked.append("started")
        time.sleep(LEASE)
        lock.check()
        worked.append("finished")

    with fault_server.admin() as foreign:
        foreign.autocommit = False
        foreign.execute("SELECT holder FROM pglock.scopes WHERE key_name = 'handed-over-delete' FOR UPDATE")
        outside = ScopeRole(kind="outside", holder=holder, run="r", task="t", lease=600, hands_over=True)
        guard = LockGuard(database, key, LockPolicy(), scope=outside, application_name="new try")
        errors: list[BaseException] = []

        def run() -> None:
            try:
                guard.run(work)
            except BaseException as error:
                errors.append(error)

        new_try = threading.Thread(target=run, name="new try", daemon=True)
        new_try.start()
        time.sleep(LEASE + 0.7)  # the DELETE waits on the row lock meanwhile
        foreign.rollback()
        new_try.join(60)
    assert not new_try.is_alive()
    assert errors == [] and guard.outcome == "completed", (errors, guard.outcome)
    assert worked == ["started", "finished"]
