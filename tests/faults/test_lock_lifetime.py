"""The lock guard's promises over the lock's whole lifetime, on a real PostgreSQL.

Never two holders inside the protected section; a lost lock never reported as success; an
error never a silent skip; nothing left behind (the ``fault_admin`` fixture checks
``pg_stat_activity`` and ``pg_locks`` after each test). One test (or a few) per way these
promises used to break (issue 19), each failing on the code before its fix.
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import AlreadyDoneError, LockConfigurationError, LockLostError, LockLostInterrupt
from airflow_pglock.guard import LockGuard
from airflow_pglock.handle import LockHandle
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.options import LockOptions, LockSpec
from airflow_pglock.pg import schema
from airflow_pglock.pg import statements as lock_statements
from airflow_pglock.pg.held import HeldLock
from airflow_pglock.pg.probe import probe, results_before
from airflow_pglock.policy import LockPolicy
from airflow_pglock.run_rules import RunRules
from tests.faults.conftest import FaultServer, assert_nothing_left
from tests.helpers import advisory_locks_once_exited, relayed

pytestmark = [pytest.mark.faults, pytest.mark.slow]

PERIOD = "2026-11-30"


def _hook(server: FaultServer, lease: float = 3, dsn: str | None = None) -> AdvisoryLockHook:
    return AdvisoryLockHook(dsn=dsn or server.dsn, liveness=Liveness(lease))


def _guard(
    server: FaultServer,
    key: str,
    *,
    lease: float = 3,
    rules: RunRules | None = None,
    dsn: str | None = None,
    **policy: Any,
) -> LockGuard:
    return LockGuard(_hook(server, lease, dsn).database, LockKey.from_name(key), LockPolicy(**policy), rules=rules)


@pytest.fixture
def ledger(fault_server: FaultServer, fault_admin: Any) -> Iterator[Any]:
    """The fault database with airflow-pglock's tables and an empty side-effect table."""
    schema.migrate(fault_admin)
    fault_admin.execute("TRUNCATE pglock.completions, pglock.fencing_tokens")
    fault_admin.execute("DROP TABLE IF EXISTS effects; CREATE TABLE effects (note text)")
    yield fault_admin
    fault_admin.execute("DROP TABLE IF EXISTS effects")


def _completions(admin: Any) -> list[str]:
    return [row[0] for row in admin.execute("SELECT period FROM pglock.completions ORDER BY period").fetchall()]


# ------------------------------------------------ 1: the work ends the lock's transaction


@pytest.mark.parametrize("retake", [False, True], ids=["commit-begin", "commit-begin-retake"])
def test_work_that_commits_and_begins_on_the_lock_connection_is_lost_not_completed(
    fault_server: FaultServer, ledger: Any, retake: bool
) -> None:
    """COMMIT then BEGIN on ``lock.connection`` ends the lock (a contender gets it): the run is
    lost, and no completion is recorded, even when the work takes the key again afterwards."""
    contender_got_it: list[bool] = []
    guard = _guard(fault_server, "commit-begin", mode="transaction", rules=RunRules(period=PERIOD))

    def work(lock: LockHandle) -> str:
        assert lock.connection is not None
        lock.connection.execute("INSERT INTO effects VALUES ('before commit')")
        lock.connection.execute("COMMIT")
        lock.connection.execute("BEGIN")
        other = _hook(fault_server).acquire(lock.key)
        contender_got_it.append(other is not None)
        if other is not None:
            other.release()
        if retake:  # the same key again, in a transaction the guard never saw
            lock.connection.execute("SELECT pg_advisory_xact_lock(%s::bigint)", lock.key.numbers)
        lock.connection.execute("INSERT INTO effects VALUES ('after commit')")
        return "ok"

    with pytest.raises(LockLostError, match="ended the lock's transaction"):
        guard.run(work)
    assert contender_got_it == [True]
    assert guard.outcome == "lost"
    assert _completions(ledger) == []
    assert [r[0] for r in ledger.execute("SELECT note FROM effects").fetchall()] == ["before commit"]


def test_heartbeat_notices_a_lock_retaken_in_another_transaction(fault_server: FaultServer, fault_admin: Any) -> None:
    """The heartbeat checks the lock's transaction, not only the key: a key held again in a
    new transaction on the same connection is not the lock the guard took."""

    def work(lock: LockHandle) -> None:
        assert lock.connection is not None
        lock.connection.execute("COMMIT")
        lock.connection.execute("BEGIN")
        lock.connection.execute("SELECT pg_advisory_xact_lock(%s::bigint)", lock.key.numbers)
        time.sleep(10)  # interrupted by the heartbeat (every L/3 = 1 s)

    started = time.monotonic()
    with pytest.raises(LockLostError) as error:
        _guard(fault_server, "retaken", mode="transaction").run(work)
    assert time.monotonic() - started < 6
    assert isinstance(error.value.__cause__, LockLostInterrupt)


def test_session_ended_between_the_completion_and_the_unlock_is_a_completion(
    fault_server: FaultServer, ledger: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Session mode, once_per: the completion's statement finds the key held after the work,
    so a session terminated just before the unlock has not lost anything. The run completes
    (the outcome line says the unlock failed), the completion stays recorded, and the ended
    session leaves no lock behind."""
    from airflow_pglock.pg.held import HeldLock

    unlock = HeldLock.unlock_checked
    terminated: list[int] = []

    def terminate_then_unlock(held: HeldLock) -> bool:
        pid = held.server.backend_pid
        ledger.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])  # waits until it is gone
        terminated.append(pid)
        return unlock(held)

    monkeypatch.setattr(HeldLock, "unlock_checked", terminate_then_unlock)
    guard = _guard(fault_server, "terminated-before-unlock", rules=RunRules(period=PERIOD))
    with caplog.at_level("WARNING", logger="airflow_pglock"):
        assert guard.run(lambda lock: "done") == "done"
    assert len(terminated) == 1
    assert guard.outcome == "completed"
    assert _completions(ledger) == [PERIOD]
    assert "the unlock failed after the completion was recorded" in caplog.text
    assert assert_nothing_left(ledger) == ([], [])


def test_session_ended_after_the_work_before_the_completion_is_lost(
    fault_server: FaultServer, ledger: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the boundary above: a session terminated after the work but before
    the completion's statement leaves nothing proven. The run is lost and nothing is recorded."""
    from airflow_pglock import guard as guard_module

    record = guard_module.record_success

    def terminate_then_record(rules: RunRules, held: Any, *args: Any) -> bool:
        ledger.execute("SELECT pg_terminate_backend(%s, 5000)", [held.server.backend_pid])
        return record(rules, held, *args)

    monkeypatch.setattr(guard_module, "record_success", terminate_then_record)
    guard = _guard(fault_server, "terminated-before-record", rules=RunRules(period=PERIOD))
    with pytest.raises(LockLostError):
        guard.run(lambda lock: "done")
    assert guard.outcome == "lost"
    assert _completions(ledger) == []
    assert assert_nothing_left(ledger) == ([], [])


# ------------------------------------------------ 2: shared locks with run rules


def _spec(**options: Any) -> LockSpec:
    return LockSpec.from_options(options, declaration=LockOptions, caller="test")


def test_shared_with_run_rules_is_refused_when_the_dag_is_parsed() -> None:
    with pytest.raises(LockConfigurationError, match="shared"):
        _spec(shared=True, fencing=True)
    with pytest.raises(LockConfigurationError, match="shared"):
        _spec(shared=True, min_interval=60)
    with pytest.raises(LockConfigurationError, match="shared"):
        _spec(shared=True, once_per="{{ ds }}")
    _spec(once_per="{{ ds }}")  # exclusive: fine


def test_on_lost_warn_with_once_per_or_min_interval_is_refused_when_the_dag_is_parsed_and_before_any_io() -> None:
    """A run that lost its lock goes on under "warn" and succeeds without a record: the period's
    work would run again (or twice at once). Fencing with "warn" stays allowed (the fenced
    resource refuses the stale token)."""
    for options in ({"once_per": "{{ ds }}"}, {"min_interval": 60}):
        with pytest.raises(LockConfigurationError, match="on_lost='warn'"):
            _spec(on_lost="warn", **options)
    _spec(on_lost="warn", fencing=True)
    hook = AdvisoryLockHook(dsn="postgresql://nobody@127.0.0.1:1/none")  # never contacted
    for rules in (RunRules(period=PERIOD), RunRules(min_interval=5)):
        with pytest.raises(LockConfigurationError, match="on_lost='warn'"):
            LockGuard(hook.database, LockKey.from_name("warned-rules"), LockPolicy(on_lost="warn"), rules=rules)


def test_shared_guard_with_once_per_is_refused_before_any_io(fault_server: FaultServer, fault_admin: Any) -> None:
    hook = AdvisoryLockHook(dsn="postgresql://nobody@127.0.0.1:1/none")  # never contacted
    for rules in (RunRules(period=PERIOD), RunRules(min_interval=5), RunRules(fencing=True)):
        with pytest.raises(LockConfigurationError, match="shared"):
            LockGuard(hook.database, LockKey.from_name("shared-rules"), LockPolicy(shared=True), rules=rules)


# ------------------------------------------------ 3: isolation level of the lock transaction


def test_transaction_mode_reads_after_the_lock_under_a_repeatable_read_default(
    fault_server: FaultServer, ledger: Any
) -> None:
    """With default_transaction_isolation = repeatable read, a waiter's once_per check must
    still see the completion the previous holder committed while it waited."""
    rr_dsn = psycopg.conninfo.make_conninfo(
        fault_server.dsn, options="-c default_transaction_isolation=repeatable\\ read"
    )
    ran: list[str] = []
    outcomes: dict[str, str | None] = {}
    isolation: list[str] = []

    def one(name: str, delay: float) -> None:
        time.sleep(delay)
        guard = _guard(
            fault_server,
            "rr-once",
            dsn=rr_dsn,
            mode="transaction",
            on_busy="wait",
            wait_timeout=20,
            rules=RunRules(period=PERIOD),
        )

        def work(lock: LockHandle) -> None:
            assert lock.connection is not None
            isolation.append(lock.connection.execute("SHOW transaction_isolation").fetchone()[0])
            ran.append(name)
            lock.connection.execute("INSERT INTO effects VALUES (%s)", [name])
            time.sleep(1.0)

        try:
            guard.run(work)
        except AlreadyDoneError:
            pass
        except BaseException as error:
            outcomes[name + " error"] = repr(error)
        outcomes[name] = guard.outcome

    threads = [threading.Thread(target=one, args=(n, d)) for n, d in (("A", 0), ("B", 0.4))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert ran == ["A"], outcomes
    assert outcomes == {"A": "completed", "B": "skipped"}
    assert isolation == ["read committed"]
    assert [r[0] for r in ledger.execute("SELECT note FROM effects").fetchall()] == ["A"]


# ------------------------------------------------ 5: work that holds the connection (COPY)


def test_loss_during_copy_is_noticed_from_a_side_connection(fault_server: FaultServer, fault_admin: Any) -> None:
    """While the work is inside ``cursor.copy()`` the heartbeat cannot use the lock's
    connection; a terminated session must still interrupt the work and fail it as lost."""
    fault_admin.execute("DROP TABLE IF EXISTS copy_target; CREATE TABLE copy_target (x int)")
    guard = _guard(fault_server, "copy-loss", mode="transaction")
    steps: list[str | None] = []

    def work(lock: LockHandle) -> None:
        assert lock.connection is not None
        with lock.connection.cursor().copy("COPY copy_target FROM STDIN") as copy:
            copy.write_row((1,))
            time.sleep(0.3)
            with fault_server.admin() as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", [lock.backend_pid])
            for _ in range(20):  # e.g. side effects outside the database, 10 s in all
                time.sleep(0.5)
                steps.append(lock.lost)

    started = time.monotonic()
    with pytest.raises(LockLostError) as error:
        guard.run(work)
    assert "terminated" in error.value.cause or "side connection" in error.value.cause
    # heartbeat (1 s) + one busy interval (1 s) + the side check + scheduling noise
    assert time.monotonic() - started < 6, steps
    assert guard.outcome == "lost"
    assert len(steps) < 12
    assert fault_admin.execute("SELECT count(*) FROM copy_target").fetchone() == (0,)
    fault_admin.execute("DROP TABLE copy_target")


def test_long_copy_of_a_healthy_holder_is_not_a_loss(fault_server: FaultServer, fault_admin: Any) -> None:
    fault_admin.execute("DROP TABLE IF EXISTS copy_ok; CREATE TABLE copy_ok (x int)")

    def work(lock: LockHandle) -> str | None:
        assert lock.connection is not None
        with lock.connection.cursor().copy("COPY copy_ok FROM STDIN") as copy:
            for i in range(8):  # 2.4 s with the connection busy: longer than one heartbeat interval
                copy.write_row((i,))
                time.sleep(0.3)
        return lock.lost

    guard = _guard(fault_server, "copy-ok", mode="transaction")
    assert guard.run(work) is None
    assert guard.outcome == "completed"
    assert fault_admin.execute("SELECT count(*) FROM copy_ok").fetchone() == (8,)
    fault_admin.execute("DROP TABLE copy_ok")


# ------------------------------------------------ 6: a pipeline on the lock's connection


def test_pipeline_on_the_lock_connection_is_busy_not_a_network_cut(fault_server: FaultServer, fault_admin: Any) -> None:
    fault_admin.execute("DROP TABLE IF EXISTS piped; CREATE TABLE piped (x int)")

    def work(lock: LockHandle) -> str:
        assert lock.connection is not None
        with lock.connection.pipeline():
            for i in range(12):  # 2.4 s: the heartbeat (every 1 s) probes during the pipeline
                lock.connection.execute("INSERT INTO piped VALUES (%s)", [i])
                time.sleep(0.2)
        return "ok"

    guard = _guard(fault_server, "pipeline", mode="transaction")
    assert guard.run(work) == "ok"
    assert guard.outcome == "completed"
    assert fault_admin.execute("SELECT count(*) FROM piped").fetchone() == (12,)
    fault_admin.execute("DROP TABLE piped")


# ------------------------------------------------ 7: a reply already in the socket


def test_probe_reads_a_reply_that_arrived_while_its_thread_was_stalled(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    with psycopg.connect(fault_server.dsn, autocommit=True) as conn:
        pgconn = conn.pgconn
        pgconn.send_query_params(b"SELECT true", None)
        pgconn.flush()
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        assert poller.poll(5000)  # the reply is in the socket...
        deadline = time.monotonic() - 0.001  # ...but the reading thread comes back after its deadline
        results = results_before(pgconn, deadline)
        assert results is not None and results[-1].get_value(0, 0) == b"t"


class _StallAfterAcquire:
    """The connection's lock, with the probing thread stalled right after it took it (a C call
    holding the GIL, CPU starvation): the probe sends its question only after its deadline."""

    def __init__(self, inner: Any, stall: float) -> None:
        self.inner, self.stall = inner, stall

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = bool(self.inner.acquire(blocking, timeout))
        time.sleep(self.stall)
        return got

    def release(self) -> None:
        self.inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_probe_sent_after_its_deadline_still_waits_for_the_answer(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    """A heartbeat stalled between taking the connection and sending its question: the answer
    cannot be in the socket yet, and giving up at once would close a healthy lock session
    (the likely way CI's run of 1.8 s GIL-holding calls lost its lock). The answer gets up to
    LATE_PROBE_GRACE after a late send, within the heartbeat's ``answer_by``."""
    with psycopg.connect(fault_server.dsn, autocommit=True) as conn:
        conn.lock = _StallAfterAcquire(conn.lock, stall=0.6)  # type: ignore[assignment]
        assert probe(conn, None, False, timeout=0.3, answer_by=time.monotonic() + 5) == "held"
        assert not conn.closed


@pytest.mark.parametrize("answer_by", [1.2, 0.4])
def test_a_late_probe_on_a_silent_network_gives_up_by_its_answer_by(
    fault_server: FaultServer, fault_admin: Any, answer_by: float
) -> None:
    """The wait after a late send never passes ``answer_by`` (the heartbeat's: before the server
    may end the silent session): a silent network is given up at ``answer_by``, and a question
    sent after it is given up at once, as before."""
    with relayed(fault_server.dsn) as (relay, dsn), psycopg.connect(dsn, autocommit=True) as conn:
        relay.delay = 60.0  # from now on nothing passes: a silent network
        conn.lock = _StallAfterAcquire(conn.lock, stall=0.6)  # type: ignore[assignment]
        alarms: list[float] = []
        started = time.monotonic()
        result = probe(
            conn,
            None,
            False,
            timeout=1.0,
            answer_by=started + answer_by,
            before_giving_up=lambda: alarms.append(time.monotonic() - started),
        )
        assert result == "no answer" and conn.closed
        assert len(alarms) == 1
        assert max(answer_by, 0.6) <= alarms[0] < max(answer_by, 0.6) + 0.3, alarms


def test_a_probe_sent_just_before_its_deadline_still_gets_time_for_the_answer(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    """The question leaves 50 ms before the probe's deadline (its thread, or the work's
    statement, had the connection until then) on a network with a 0.1 s round trip: the
    answer gets LATE_PROBE_GRACE, not what was left of the deadline."""
    with relayed(fault_server.dsn, delay=0.05) as (_, dsn), psycopg.connect(dsn, autocommit=True) as conn:
        conn.lock = _StallAfterAcquire(conn.lock, stall=0.25)  # type: ignore[assignment]
        assert probe(conn, None, False, timeout=0.3, answer_by=time.monotonic() + 5) == "held"
        assert not conn.closed


_GIL_STALLS = """
import ctypes, sys, threading, time
from airflow_pglock.guard import LockGuard
from airflow_pglock.policy import LockPolicy
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness

libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call

class Preempted:
    # The lock connection's lock: the heartbeat thread loses the GIL right after it took it.

    def __init__(self, inner):
        self.inner = inner

    def acquire(self, blocking=True, timeout=-1):
        got = self.inner.acquire(blocking, timeout)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.01)  # the work's next 1.8 s call takes the GIL meanwhile
        return got

    def release(self):
        self.inner.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()

def work(lock):
    if sys.argv[2] == "preempted":
        lock._held.connection.lock = Preempted(lock._held.connection.lock)
    for _ in range(4):
        libc.usleep(1_800_000)
    return lock.lost

database = AdvisoryLockHook(dsn=sys.argv[1], liveness=Liveness(6)).database
guard = LockGuard(database, LockKey.from_name("gil-stall"), LockPolicy())
print("lost:", guard.run(work), "outcome:", guard.outcome)
"""


@pytest.mark.parametrize("heartbeat", ["on time", "preempted"])
def test_gil_holding_stalls_shorter_than_the_lease_are_not_a_loss(
    fault_server: FaultServer, fault_admin: Any, heartbeat: str
) -> None:
    """C calls that hold the GIL for 1.8 s each, back to back, on a 6 s lease (heartbeat 2 s,
    holder deadline 4 s): the session stays alive on the server, so the lock is not lost.

    Run in a fresh interpreter: in the whole suite's process the heartbeat may lose GIL turns
    to earlier tests' threads and garbage. ``preempted``: the heartbeat thread loses the GIL
    right after it took the connection (the OS took its core within the 5 ms it has between
    two calls), so its question leaves one 1.8 s call later, after its deadline; it used to
    give up at once (the likely cause of CI's failure of this test in a fresh interpreter)."""
    run = subprocess.run(
        [sys.executable, "-c", _GIL_STALLS, fault_server.dsn, heartbeat],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "lost: None outcome: completed" in run.stdout, run.stdout + run.stderr[-3000:]


# ------------------------------------------------ 8: nested guards on the main thread


def test_outer_interrupt_is_kept_pending_through_the_inner_guards_clean_up(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    outer = _guard(fault_server, "nested-pending-outer")
    inner = _guard(fault_server, "nested-pending-inner")
    steps: list[int] = []

    def outer_work(lock: LockHandle) -> None:
        def inner_work(handle: LockHandle) -> None:
            def hold_inner_state() -> None:
                # The inner guard's clean-up waits for its state lock while the outer lock is lost,
                # so the outer guard's interrupt arrives inside the inner guard's clean-up (the outer
                # loss is seen at once: the session is ended once the inner work has returned).
                with inner.interruption.lock:
                    time.sleep(0.8)
                    with fault_server.admin() as admin:
                        admin.execute("SELECT pg_terminate_backend(%s)", [lock.backend_pid])
                    time.sleep(1.7)

            threading.Thread(target=hold_inner_state, daemon=True).start()
            time.sleep(0.2)

        inner.run(inner_work)
        for step in range(12):
            time.sleep(0.5)  # a delivered interruption lands here at once
            steps.append(step)

    with pytest.raises(LockLostError, match="nested-pending-outer") as error:
        outer.run(outer_work)
    assert isinstance(error.value.__cause__, LockLostInterrupt)
    assert inner.outcome == "completed" and outer.outcome == "lost"
    assert len(steps) < 4, steps


# ------------------------------------------------ 9: asynchronous exceptions at the edges


class _InterruptedLogger:
    """Raises KeyboardInterrupt (as Ctrl-C or Airflow's execution_timeout would) while the
    guard logs the line that starts with ``when``."""

    def __init__(self, when: str) -> None:
        self.when = when
        self.lines: list[str] = []

    def _line(self, message: str, *args: Any) -> None:
        self.lines.append(message % args if args else message)
        if message.startswith(self.when):
            raise KeyboardInterrupt(f"arrived while logging {self.when!r}")

    info = warning = error = _line


def test_interrupt_while_logging_the_acquisition_leaves_nothing(fault_server: FaultServer, fault_admin: Any) -> None:
    logger = _InterruptedLogger("pglock acquired")
    guard = LockGuard(
        _hook(fault_server, lease=30).database, LockKey.from_name("enter-leak"), LockPolicy(), logger=logger
    )
    with pytest.raises(KeyboardInterrupt):
        guard.__enter__()
    assert guard.held is not None and guard.held.connection.closed
    assert guard.outcome == "failed"
    assert any(line.startswith("pglock outcome=failed") for line in logger.lines)


def test_interrupt_while_naming_the_pool_slot_taken_leaves_nothing(fault_server: FaultServer, fault_admin: Any) -> None:
    """The last step of taking a pool's slot names it for the outcome line and the interruption's
    message. An interrupt there left the slot and its markers held by a connection nobody closed
    (until the exception's frames were freed, or the lease)."""
    from airflow_pglock.interruption import Interruption

    guard = _guard(fault_server, "slot-leak", lease=30, slots=2)

    class InterruptedWhileNamed(Interruption):
        @property
        def label(self) -> str:
            return str(self.__dict__["label"])

        @label.setter
        def label(self, value: str) -> None:
            raise KeyboardInterrupt("arrived while naming the slot taken")

    guard.interruption.__class__ = InterruptedWhileNamed
    with pytest.raises(KeyboardInterrupt) as raised:
        guard.__enter__()
    assert "naming the slot" in str(raised.value)  # the frames stay alive with it meanwhile
    assert guard.held is not None and guard.held.connection.closed
    assert guard.outcome == "failed"
    assert advisory_locks_once_exited(fault_admin) == []


def test_interrupt_at_the_start_of_exit_leaves_nothing(fault_server: FaultServer, fault_admin: Any) -> None:
    guard = _guard(fault_server, "exit-leak", lease=30)
    handle = guard.__enter__()
    stop = guard._stop_heartbeat

    def interrupted() -> None:
        stop()
        raise KeyboardInterrupt("arrived while stopping the heartbeat")

    guard._stop_heartbeat = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        guard.__exit__(None, None, None)
    assert handle.key == guard.key and guard.held is not None and guard.held.connection.closed
    assert guard.outcome is not None


def test_interrupt_while_closing_after_the_release_still_logs_one_outcome(
    fault_server: FaultServer, fault_admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C or execution_timeout landing in the last step of the clean-up, the close of the
    lock connection after the key was given back: it escaped with no outcome line at all."""
    logger = _InterruptedLogger("never")
    guard = LockGuard(_hook(fault_server).database, LockKey.from_name("close-interrupted"), LockPolicy(), logger=logger)
    guard.__enter__()
    close = HeldLock.close

    def interrupted(held: HeldLock) -> None:
        close(held)
        raise KeyboardInterrupt("arrived while closing the lock connection")

    monkeypatch.setattr(HeldLock, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        guard.__exit__(None, None, None)
    assert guard.held is not None and guard.held.connection.closed
    assert guard.outcome == "failed"
    outcomes = [line for line in logger.lines if line.startswith("pglock outcome=")]
    assert len(outcomes) == 1, outcomes
    assert "the clean-up was interrupted after the lock was given back: KeyboardInterrupt" in outcomes[0], outcomes
    assert advisory_locks_once_exited(fault_admin) == []


def test_interrupt_right_after_the_take_before_the_work_still_logs_one_outcome(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    """Airflow's execution_timeout (or Ctrl-C) landing as ``__enter__`` returns in ``run``, before
    its ``try``: the connection stayed open, with no outcome line, until the process ended."""
    logger = _InterruptedLogger("never")
    guard = LockGuard(_hook(fault_server).database, LockKey.from_name("run-enter"), LockPolicy(), logger=logger)
    enter = guard.__enter__

    def interrupted() -> LockHandle:
        enter()
        raise KeyboardInterrupt("arrived as __enter__ returned")

    guard.__enter__ = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        guard.run(lambda lock: pytest.fail("the work must not start"))
    assert guard.held is not None and guard.held.connection.closed
    assert guard.outcome == "failed"
    outcomes = [line for line in logger.lines if line.startswith("pglock outcome=")]
    assert len(outcomes) == 1 and "KeyboardInterrupt" in outcomes[0], outcomes
    assert advisory_locks_once_exited(fault_admin) == []


def test_interrupt_while_run_disarms_leaves_nothing(fault_server: FaultServer, fault_admin: Any) -> None:
    guard = _guard(fault_server, "disarm-leak", lease=30)
    disarm = guard.interruption.disarm
    calls: list[int] = []

    def interrupted() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt("arrived while disarming")
        disarm()

    guard.interruption.disarm = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        guard.run(lambda lock: "done")
    assert guard.held is not None and guard.held.connection.closed
    assert guard._heartbeat is not None and guard._heartbeat._state in ("ended", "cancelled")  # joined or never ran
    assert guard.outcome == "failed"


# ------------------------------------------------ 10: fencing in transaction mode


def test_transaction_mode_fencing_token_is_visible_to_other_sessions_at_once(
    fault_server: FaultServer, ledger: Any
) -> None:
    first = _guard(fault_server, "fenced-tx", mode="transaction", rules=RunRules(fencing=True))
    first.run(lambda lock: None)
    stale = first.fencing_token
    assert stale is not None

    def work(lock: LockHandle) -> None:
        with fault_server.admin() as other:
            newest = other.execute("SELECT pglock.current_fencing_token('fenced-tx')").fetchone()[0]
            assert newest == lock.fencing_token
            with pytest.raises(psycopg.errors.CheckViolation, match="stale fencing token"):
                other.execute("SELECT pglock.assert_fencing_token('fenced-tx', %s::bigint)", [stale])

    _guard(fault_server, "fenced-tx", mode="transaction", rules=RunRules(fencing=True)).run(work)


@pytest.mark.parametrize("meanwhile", ["held", "unlocked"])
def test_a_cancel_that_lands_on_a_sub_keys_unlock_is_settled_by_a_second_unlock(
    fault_server: FaultServer, fault_admin: Any, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """The guard's own key got a second unlock after a foreign cancel; a key its lock session took
    (`lock.try_lock`) did not: the block that held it to its end raised QueryCanceled. The session
    answered, so the unlock is sent again and its answer decides; a key the work unlocked itself
    on that session is still a loss."""
    from airflow_pglock import lock_set

    cancelled: list[str] = []
    sub_key = LockKey.from_name(f"cancelled-sub-unlock/{meanwhile}/tenant")  # the block's unlock meets the cancel
    monkeypatch.setattr(lock_set, "unlock", _unlock_cancelled_once(lock_set.unlock, fault_admin, cancelled, sub_key))
    guard = _guard(fault_server, f"cancelled-sub-unlock/{meanwhile}", lease=30)  # no heartbeat meanwhile

    def work(lock: LockHandle) -> None:
        with lock.try_lock(sub_key) as sub:
            assert sub is not None
            if meanwhile == "unlocked":
                guard.held.connection.execute("SELECT pg_advisory_unlock(%s)", [sub_key.int64])  # type: ignore[union-attr]

    if meanwhile == "held":
        guard.run(work)
        assert guard.outcome == "completed"
    else:
        with pytest.raises(
            LockLostError, match="the session no longer held key 'cancelled-sub-unlock/unlocked/tenant'"
        ):
            guard.run(work)
    assert cancelled and "canceling statement" in cancelled[0]
    assert advisory_locks_once_exited(fault_admin) == []


@pytest.mark.parametrize("kind", ["in the work's transaction", "a batch"])
def test_a_cancelled_sub_key_unlock_is_not_sent_again_where_that_would_not_be_the_truth(
    fault_server: FaultServer, fault_admin: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Sent once more, the unlock would roll back the work's own transaction on the session's
    connection (or end it as a success without its writes), and a batch may stop part-way (the keys
    it unlocked before the cancel would read as lost): there the cancel's error stands, as before,
    the work's transaction is left to the work, and no key stays held (review -56)."""
    from airflow_pglock import lock_set

    cancelled: list[str] = []
    hook = AdvisoryLockHook(dsn=fault_server.dsn)
    first, second = (LockKey.from_name(f"cancelled-unlock/{kind}/{n}") for n in (1, 2))
    with pytest.raises(psycopg.errors.QueryCanceled), hook.lock_session() as session:
        if kind == "a batch":
            monkeypatch.setattr(
                lock_set.statements,
                "unlock_many",
                _unlock_cancelled_once(lock_set.statements.unlock_many, fault_admin, cancelled),
            )
            taken = session.try_lock_many([first, second])
            assert len(taken) == 2
            session.release(*taken)
        else:
            monkeypatch.setattr(
                lock_set, "unlock", _unlock_cancelled_once(lock_set.unlock, fault_admin, cancelled, first)
            )
            session.connection.execute("BEGIN")
            try:
                with session.try_lock(first) as sub:
                    assert sub is not None
            finally:
                status = session.connection.info.transaction_status
                session.connection.rollback()  # the work ends its transaction
    assert cancelled and "canceling statement" in cancelled[0]
    if kind != "a batch":
        assert status == psycopg.pq.TransactionStatus.INERROR, "the work's transaction is the work's to end"
    assert advisory_locks_once_exited(fault_admin) == []


# ------------------------------------------------ found correct: keep them so


def test_release_that_finds_the_key_gone_is_lost_and_records_nothing(fault_server: FaultServer, ledger: Any) -> None:
    guard = _guard(fault_server, "unlocked-under-us", rules=RunRules(period=PERIOD))

    def work(lock: LockHandle) -> None:
        assert guard.held is not None
        guard.held.connection.execute("SELECT pg_advisory_unlock_all()")  # before any heartbeat

    with pytest.raises(LockLostError, match="found at release"):
        guard.run(work)
    assert _completions(ledger) == []


def _unlock_cancelled_once(
    real_unlock: Callable[..., bool], fault_admin: Any, cancelled: list[str], only: LockKey | None = None
) -> Callable[..., bool]:
    """``real_unlock``, whose first call (on ``only``, else any key) is held up on the server and
    meets a foreign ``pg_cancel_backend()`` (sent once the backend is active: a cancel that reaches
    an idle backend is ignored); the cancel's message goes to ``cancelled``."""

    def cancel_once_active(pid: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = fault_admin.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
            if state == ("active",):
                fault_admin.execute("SELECT pg_cancel_backend(%s)", [pid])
                return
            time.sleep(0.01)

    def unlock(conn: Any, key: LockKey, **kwargs: Any) -> bool:
        if not cancelled and (only is None or key == only):
            cancel = threading.Thread(target=cancel_once_active, args=(conn.info.backend_pid,))
            cancel.start()
            try:
                conn.execute("SELECT pg_sleep(30)")
            except psycopg.errors.QueryCanceled as error:
                cancelled.append(str(error))
                raise
            finally:
                cancel.join()
        return real_unlock(conn, key, **kwargs)

    return unlock


@pytest.mark.parametrize(
    ("path", "meanwhile"),
    [("hook.lock", "held"), ("hook.acquire", "held"), ("LockGuard", "unlocked"), ("hook.acquire", "unlocked")],
)
def test_a_cancel_that_lands_on_the_unlock_of_a_session_lock_is_settled_by_a_second_unlock(
    fault_server: FaultServer, fault_admin: Any, monkeypatch: pytest.MonkeyPatch, path: str, meanwhile: str
) -> None:
    """A foreign pg_cancel_backend() (a DBA's script, a monitoring tool) that landed on the unlock
    failed a clean run as lost, "the connection to the lock database broke" (hook.acquire: release()
    said False), and Airflow would run the work again. The session answered, so the unlock is sent
    again and its answer decides, as the first one's would have: a key the work unlocked itself on
    that session (and a contender took) is still a loss."""
    from airflow_pglock.pg import held as held_module

    cancelled: list[str] = []
    monkeypatch.setattr(held_module, "unlock", _unlock_cancelled_once(held_module.unlock, fault_admin, cancelled))
    hook = AdvisoryLockHook(dsn=fault_server.dsn)
    key = LockKey.from_name(f"cancelled-unlock/{path}/{meanwhile}")

    def contender_takes_the_key_the_work_unlocked(connection: Any) -> None:
        connection.execute("SELECT pg_advisory_unlock_all()")
        with psycopg.connect(fault_server.dsn, autocommit=True) as contender:
            assert contender.execute("SELECT pg_try_advisory_lock(%s)", [key.int64]).fetchone() == (True,)

    if path == "hook.lock":
        with hook.lock(key) as handle:
            assert handle is not None
    elif path == "hook.acquire":
        acquired = hook.acquire(key)
        assert acquired is not None
        if meanwhile == "unlocked":
            contender_takes_the_key_the_work_unlocked(acquired.connection)
        assert acquired.release() is (meanwhile == "held")
    else:
        guard = _guard(fault_server, key.name or "", lease=30)  # no heartbeat before the release
        with pytest.raises(LockLostError, match="found at release"):
            guard.run(lambda lock: contender_takes_the_key_the_work_unlocked(guard.held.connection))  # type: ignore[union-attr]
    assert cancelled and "canceling statement" in cancelled[0]
    assert advisory_locks_once_exited(fault_admin) == []


def test_a_transaction_the_caller_left_aborted_does_not_make_a_held_lock_look_lost(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    """hook.acquire(): the caller's own transaction on the lock's connection, aborted by an error,
    made the unlock fail (InFailedSqlTransaction) and release() say False although the session held
    the key throughout; a session lock outlives the transaction's rollback."""
    acquired = AdvisoryLockHook(dsn=fault_server.dsn).acquire(LockKey.from_name("aborted-by-the-caller"))
    assert acquired is not None
    acquired.connection.execute("BEGIN")
    with pytest.raises(psycopg.errors.DivisionByZero):
        acquired.connection.execute("SELECT 1/0")
    assert acquired.release() is True
    assert advisory_locks_once_exited(fault_admin) == []


def test_a_lost_transaction_session_cannot_commit(fault_server: FaultServer, ledger: Any) -> None:
    """The session ends between the last heartbeat and the commit: lost, nothing committed."""
    guard = _guard(fault_server, "lost-before-commit", lease=30, mode="transaction", rules=RunRules(period=PERIOD))

    def work(lock: LockHandle) -> None:
        assert lock.connection is not None
        lock.connection.execute("INSERT INTO effects VALUES ('uncommitted')")
        with fault_server.admin() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [lock.backend_pid])
        time.sleep(0.2)

    with pytest.raises(LockLostError):
        guard.run(work)
    assert _completions(ledger) == []
    assert ledger.execute("SELECT count(*) FROM effects").fetchone() == (0,)


def test_an_interrupt_after_the_work_returned_is_absorbed(fault_server: FaultServer, fault_admin: Any) -> None:
    """A loss signalled after the work returned still fails the run, as LockLostError (never
    as a stray LockLostInterrupt out of the clean-up)."""
    guard = _guard(fault_server, "late-interrupt")

    def work(lock: LockHandle) -> str:
        guard.interruption.lost("simulated: found lost just as the work returned")
        return "done"

    with pytest.raises(LockLostError, match="simulated"):
        guard.run(work)
    assert guard.outcome == "lost"


# ------------------------------------------------ a batch statement that fails part-way (round two, row 7)


def _held_by(admin: Any, pid: int) -> set[tuple[int, int, int]]:
    """(classid, objid, objsubid) of every advisory lock ``pid`` holds."""
    rows = admin.execute(
        "SELECT classid::bigint, objid::bigint, objsubid FROM pg_locks WHERE locktype = 'advisory' AND pid = %s"
        " AND granted",
        [pid],
    ).fetchall()
    return {(row[0], row[1], row[2]) for row in rows}


def _overflowing_batch(admin: Any) -> list[LockKey]:
    """More keys than the server's shared lock table holds: a batch of them fails part-way with
    "out of shared memory", after taking the keys that fitted (the table's nominal size is
    max_locks_per_transaction x (max_connections + auxiliary processes); it grows a little
    past that into spare shared memory)."""
    row = admin.execute(
        "SELECT current_setting('max_locks_per_transaction')::int * (current_setting('max_connections')::int"
        " + current_setting('max_prepared_transactions')::int + 64)"
    ).fetchone()
    assert row is not None
    return [LockKey.from_int(50_000_000 + n) for n in range(3 * row[0])]


@pytest.mark.parametrize("holder", ["lock-session", "guarded-task"])
def test_a_batch_that_fails_part_way_leaves_no_key_held_untracked(
    fault_server: FaultServer, fault_admin: Any, holder: str
) -> None:
    """try_lock_many fails part-way (out of shared memory): the keys it took before the error
    must not stay held without the set knowing. Untracked, one of them was granted again by
    try_lock (PostgreSQL counts it twice) and stayed held after that block released it."""
    keys = _overflowing_batch(fault_admin)
    hook = _hook(fault_server, lease=30)

    def check(keys_set: Any, pid: int, own: set[tuple[int, int, int]]) -> None:
        with pytest.raises(psycopg.errors.OutOfMemory):
            keys_set.try_lock_many(keys)
        assert _held_by(fault_admin, pid) - own == {key.pg_locks for key in keys_set.held()}
        with keys_set.try_lock(keys[0]) as sub:
            assert sub is not None
        assert keys[0].pg_locks not in _held_by(fault_admin, pid)  # released for good
        assert own <= _held_by(fault_admin, pid)  # a guarded task's own key stays held

    if holder == "lock-session":
        with hook.lock_session() as session:
            check(session, session.server.backend_pid, set())
    else:
        with LockGuard(hook.database, LockKey.from_name("batch-owner"), LockPolicy()) as lock:
            check(lock, lock.backend_pid, {LockKey.from_name("batch-owner").pg_locks})


def test_a_batch_cancelled_part_way_holds_none_of_its_keys(
    fault_server: FaultServer, fault_admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """try_lock_many cancelled by statement_timeout (40,000 keys in one statement take far longer
    than its 10 ms): the keys it took before the cancel stayed held but untracked, and try_lock
    of one was granted again (PostgreSQL counts it twice) and stayed held after its block. A
    failed batch must hold none of its keys."""
    monkeypatch.setattr(lock_statements, "MANY_KEYS_PER_STATEMENT", 100_000)
    keys = [LockKey.from_int(80_000_000 + n) for n in range(40_000)]
    with _hook(fault_server, lease=30).lock_session() as session:
        pid = session.server.backend_pid
        session.connection.execute("SET statement_timeout = '10ms'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            session.try_lock_many(keys)
        session.connection.execute("RESET statement_timeout")
        assert session.held() == []
        assert _held_by(fault_admin, pid) == set()
        with session.try_lock(keys[0]) as again:
            assert again is not None
        assert _held_by(fault_admin, pid) == set()


def test_a_release_cancelled_part_way_leaves_no_key_held_and_forgotten(
    fault_server: FaultServer, fault_admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """release() cancelled by statement_timeout (40,000 keys in one statement take far longer
    than its 10 ms): the keys it forgot were still held, and one of them was granted again by
    try_lock and stayed held after that block. The release must finish the job instead."""
    monkeypatch.setattr(lock_statements, "MANY_KEYS_PER_STATEMENT", 100_000)
    keys = [LockKey.from_int(70_000_000 + n) for n in range(40_000)]
    with _hook(fault_server, lease=30).lock_session() as session:
        pid = session.server.backend_pid
        taken = session.try_lock_many(keys)
        assert len(taken) == len(keys)
        session.connection.execute("SET statement_timeout = '10ms'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            session.release(*taken)
        session.connection.execute("RESET statement_timeout")
        assert session.held() == []
        with session.try_lock(keys[0]) as again:
            assert again is not None
        assert _held_by(fault_admin, pid) == set()


def test_a_release_in_an_aborted_savepoint_raises_and_the_key_stays_the_transactions(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    """Transaction mode: the work's statement failed inside a savepoint, so the sub-key's release
    cannot check the key (InFailedSqlTransaction, raised to the work). The key was taken before the
    savepoint, so it is still the transaction's after ROLLBACK TO SAVEPOINT: taken again in a block,
    given back, held until the commit, and the task completes (no false loss)."""
    key = LockKey.from_name("aborted-release")
    with _guard(fault_server, "aborted-release-owner", mode="transaction") as lock:
        assert lock.connection is not None
        [sub] = lock.try_lock_many([key])
        lock.connection.execute("SAVEPOINT work")
        with pytest.raises(psycopg.errors.DivisionByZero):
            lock.connection.execute("SELECT 1 / 0")
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            lock.release(sub)
        assert lock.held() == []
        lock.connection.execute("ROLLBACK TO SAVEPOINT work")
        with lock.try_lock(key) as again:
            assert again is not None
        assert key.pg_locks in _held_by(fault_admin, lock.backend_pid)  # a transaction lock: until the commit
        assert LockKey.from_name("aborted-release-owner").pg_locks in _held_by(fault_admin, lock.backend_pid)
        assert lock.sub_key_ended_early is None


def test_interrupt_while_giving_the_key_back_still_logs_one_outcome(
    fault_server: FaultServer, ledger: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Airflow's execution_timeout (or Ctrl-C) that lands while a skipping guard gives its key
    back: the connection is closed and one outcome line says so."""
    rules = RunRules(period="2026-12-05")
    _guard(fault_server, "give-back-interrupted", rules=rules).run(lambda lock: None)
    give_back = HeldLock.give_back

    def interrupted(held: HeldLock) -> None:
        give_back(held)
        raise KeyboardInterrupt("arrived while giving the key back")

    monkeypatch.setattr(HeldLock, "give_back", interrupted)
    logger = _InterruptedLogger("never")
    guard = LockGuard(
        _hook(fault_server).database,
        LockKey.from_name("give-back-interrupted"),
        LockPolicy(),
        rules=rules,
        logger=logger,
    )
    with pytest.raises(KeyboardInterrupt):
        guard.__enter__()
    assert guard.held is not None and guard.held.connection.closed
    assert guard.outcome == "failed"
    outcomes = [line for line in logger.lines if line.startswith("pglock outcome=")]
    assert len(outcomes) == 1 and "giving the key back was interrupted: KeyboardInterrupt" in outcomes[0], outcomes


def test_interrupt_while_waiting_for_the_key_logs_one_outcome(fault_server: FaultServer, fault_admin: Any) -> None:
    """Ctrl-C (or Airflow's execution_timeout) while the guard waits for a busy key: nothing was
    held yet, and one outcome line says the wait was interrupted. The KeyboardInterrupt comes from
    a handler of this test's own signal: SIGINT may be ignored where the suite runs (a background
    job's), and a test run elsewhere may have replaced its handler."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("arrived while waiting for the key")

    previous = signal.signal(signal.SIGUSR1, interrupt)
    holder = _hook(fault_server, lease=600).acquire(LockKey.from_name("wait-interrupted"))
    assert holder is not None
    logger = _InterruptedLogger("never")
    guard = LockGuard(
        _hook(fault_server).database,
        LockKey.from_name("wait-interrupted"),
        LockPolicy(on_busy="wait", wait_timeout=10),
        logger=logger,
    )
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            guard.__enter__()
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
        if guard.held is not None:  # entered after all: leave nothing to the next tests
            guard.__exit__(None, None, None)
        holder.release()
    assert guard.held is None and guard.outcome == "failed"
    outcomes = [line for line in logger.lines if line.startswith("pglock outcome=")]
    assert len(outcomes) == 1 and "interrupted while taking the lock: KeyboardInterrupt" in outcomes[0], outcomes
