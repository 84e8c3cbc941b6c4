"""Why a lock was lost, in words (pure functions: no server needed)."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from airflow_pglock import loss


@pytest.mark.parametrize(
    ("state", "ordinary"),
    [
        ("25P02", True),  # in_failed_sql_transaction: the session lives on
        ("22012", True),
        ("57014", True),  # query_canceled
        ("57P01", False),  # admin_shutdown
        ("57P05", False),  # idle_session_timeout
        ("25P03", False),  # idle_in_transaction_session_timeout
        ("25P04", False),  # transaction_timeout (PostgreSQL 17+): it ends the session
        ("08006", False),  # connection failure
        ("", False),
        (None, False),
    ],
)
def test_ordinary_errors_are_those_the_session_survives(state: str | None, ordinary: bool) -> None:
    assert loss.is_ordinary_error(state) is ordinary


def test_session_end_reasons_name_the_cause_and_whether_to_ask_the_server() -> None:
    assert loss.session_end_reason("57P01", "terminating connection", "AdminShutdown", 3) == (loss.TERMINATED, True)
    crashed, ask = loss.session_end_reason("57P02", "crash of another server process", "CrashShutdown", 3)
    assert "crashed or is shutting down (crash of another server process)" in crashed and ask
    idle, ask = loss.session_end_reason("57P05", "x", "IdleSessionTimeout", 6)
    assert "lease (6 s)" in idle and "idle_session_timeout" in idle and not ask
    idle_tx, ask = loss.session_end_reason("25P03", "x", "IdleInTransactionSessionTimeout", 30)
    assert "lease (30 s)" in idle_tx and "idle_in_transaction_session_timeout" in idle_tx and not ask
    timed_out, ask = loss.session_end_reason("25P04", "x", "TransactionTimeout", 30)
    assert "transaction_timeout" in timed_out and "mode='session'" in timed_out and not ask
    broke, ask = loss.session_end_reason("", "server closed the connection", "OperationalError", 3)
    assert broke == "the connection to the lock database broke (OperationalError: server closed the connection)"
    assert ask


def test_not_held_reason_depends_on_the_mode() -> None:
    assert "COMMIT or ROLLBACK" in loss.not_held_reason("transaction")
    assert "unlocked it" in loss.not_held_reason("session")


def test_no_answer_reason_says_how_long_and_the_lease() -> None:
    text = loss.no_answer_reason(2.04, "10.0.0.5:5432", 3)
    assert text.startswith("no answer from the lock database for 2.0 s (the network to 10.0.0.5:5432 is cut")
    assert "silent for the lease (3 s)" in text


def test_reason_refined_with_the_server_start() -> None:
    started = dt.datetime(2026, 11, 30, 12, 5, tzinfo=dt.timezone.utc)
    acquired = 1000.0  # loss.held_clock() when the lock was taken; asked at 1060, answered at 1060 + late
    lock_server = "10.0.0.5:5432"

    def answer(
        uptime: float, server: str = lock_server, *, standby: bool = False, late: float = 0.0
    ) -> loss.ServerStart:
        addresses = frozenset({server, "10.9.9.9:5432"})  # inet_server_addr() may name it otherwise
        return loss.ServerStart(
            started_at=started,
            uptime=uptime,
            asked_at=acquired + 60,
            seen_at=acquired + 60 + late,
            server=server,
            addresses=addresses,
            in_recovery=standby,
        )

    def refine(reason: str, server: loss.ServerStart | None, lock: str = lock_server) -> str:
        return loss.refine_with_server_start(reason, server, acquired, lock)

    assert refine(loss.TERMINATED, None).startswith("the PostgreSQL server shut down, crashed or is restarting")
    # Up for 5 s of the 60 s the lock was held: it started after the lock was taken.
    assert refine("anything", answer(5.0)) == (
        "the PostgreSQL server restarted at 2026-11-30T12:05:00+00:00 (the lock session ended with it)"
    )
    # Up since before the lock was taken: no restart, whatever the two clocks say the time is.
    up_before = answer(3600.0)
    assert "terminated by pg_terminate_backend()" in refine(loss.TERMINATED, up_before)
    assert "terminated by pg_terminate_backend()" in refine(loss.TERMINATED, up_before, lock="10.9.9.9:5432")
    assert refine("the connection broke", up_before) == "the connection broke"
    # Started (on this machine's clock) after the lock's answer, however little: a restart.
    assert refine(loss.TERMINATED, answer(59.99)).startswith("the PostgreSQL server restarted at")
    # Up since before the lock's answer, but by less than its latency may be: neither claim.
    assert refine(loss.TERMINATED, answer(60.01)) == loss.TERMINATED
    assert "terminated by pg_terminate_backend()" in refine(loss.TERMINATED, answer(60.0 + loss.RESTART_MARGIN + 0.01))
    # An answer read late (the heartbeat thread waited for the GIL): the start is known less well,
    # and no claim is made that it cannot back (here it started between 0.5 s before and after).
    assert refine(loss.TERMINATED, answer(60.5, late=1.0)) == loss.TERMINATED
    assert refine(loss.TERMINATED, answer(59.5, late=1.0)).startswith("the PostgreSQL server restarted at")
    # Another address answers now (a connection string with several hosts): its uptime tells nothing.
    moved = refine(loss.TERMINATED, answer(3600.0, server="10.0.0.6:5432"))
    assert moved == (
        "the connection now leads to another address (10.0.0.6:5432, a primary) than the lock's (10.0.0.5:5432): "
        "a failover or switchover if it is another server, and advisory locks are not replicated (the lock "
        f"session ended with: {loss.TERMINATED})"
    )
    # ... and when that is a standby, the lock's server is gone (or restarting), not failed over.
    to_standby = refine(loss.TERMINATED, answer(3600.0, server="10.0.0.6:5432", standby=True))
    assert to_standby.startswith(
        "the lock's server (10.0.0.5:5432) shut down, crashed, is restarting or is no longer a primary: "
        "the connection string now leads to 10.0.0.6:5432, a standby"
    )


def test_the_held_clock_counts_like_the_monotonic_one() -> None:
    before_monotonic, before = time.monotonic(), loss.held_clock()
    time.sleep(0.05)
    waited, held = time.monotonic() - before_monotonic, loss.held_clock() - before
    assert abs(held - waited) < 0.01, (held, waited)


def test_found_at_release_and_the_lost_message() -> None:
    assert loss.found_at_release(None) == "found at release: the session no longer held the key"
    assert loss.found_at_release("x") == "found at release: x"
    session = loss.lost_message("key 'k' (int64 1)", "why", transaction=False)
    assert session == (
        "lost key 'k' (int64 1) while the task ran: why. Another worker may now run the same work; "
        "this run is marked failed instead of successful"
    )
    assert loss.lost_message("k", "why", transaction=True).endswith(
        "(transaction mode: the guard committed nothing; only a COMMIT the work ran itself on the lock's connection, "
        "which ends the lock, committed anything)"
    )
    # The work ended the transaction itself: its own COMMIT did commit.
    ended = loss.lost_message("k", loss.ENDED_BY_WORK, transaction=True)
    assert "only a COMMIT" not in ended and ended.endswith("the guard committed nothing)")
    # A COMMIT whose answer never came: it may have committed.
    unknown = loss.lost_message("k", loss.commit_unknown("the connection broke", "committed"), transaction=True)
    assert "committed nothing" not in unknown and "whether it committed is unknown" in unknown
    assert "that transaction is 'committed'" in unknown and "check them before the work runs again" in unknown
    assert "said" not in loss.commit_unknown("the connection broke", None)
    assert loss.warned("why") == "why (on_lost='warn': the work went on without the lock)"
