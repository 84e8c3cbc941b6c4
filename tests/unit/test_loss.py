"""Why a lock was lost, in words (pure functions: no server needed)."""

from __future__ import annotations

import datetime as dt

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


def test_reason_refined_with_the_server_start_time() -> None:
    before = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
    later = before + dt.timedelta(minutes=5)
    assert loss.refine_with_server_start(loss.TERMINATED, None, before).startswith(
        "the PostgreSQL server shut down, crashed or is restarting"
    )
    assert loss.refine_with_server_start("anything", later, before) == (
        "the PostgreSQL server restarted at 2026-11-30T12:05:00+00:00 (the lock session ended with it)"
    )
    assert "terminated by pg_terminate_backend()" in loss.refine_with_server_start(loss.TERMINATED, before, before)
    assert loss.refine_with_server_start("the connection broke", before, before) == "the connection broke"


def test_found_at_release_and_the_lost_message() -> None:
    assert loss.found_at_release(None) == "found at release: the session no longer held the key"
    assert loss.found_at_release("x") == "found at release: x"
    session = loss.lost_message("key 'k' (int64 1)", "why", transaction=False)
    assert session == (
        "lost key 'k' (int64 1) while the task ran: why. Another worker may now run the same work; "
        "this run is marked failed instead of successful"
    )
    assert loss.lost_message("k", "why", transaction=True).endswith(
        "(transaction mode: nothing written on the lock's connection was committed)"
    )
    assert loss.warned("why") == "why (on_lost='warn': the work went on without the lock)"
