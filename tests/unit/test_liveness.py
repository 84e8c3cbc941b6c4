from __future__ import annotations

import pytest

from airflow_pglock import server_rules
from airflow_pglock.liveness import Liveness


def test_default_lease_is_at_most_30_seconds() -> None:
    assert Liveness().lease <= 30


def test_settings_follow_the_lease() -> None:
    live = Liveness(9)
    assert live.heartbeat_interval == 3
    assert live.server_settings(transaction=False)["idle_session_timeout"] == "9000ms"
    assert live.server_settings(transaction=True)["idle_in_transaction_session_timeout"] == "9000ms"
    assert live.keepalive_idle + live.keepalive_interval * live.keepalive_count <= live.lease
    assert live.client_settings()["tcp_user_timeout"] == 9000


@pytest.mark.parametrize("bad", [0, 1, -5, float("nan"), "30", None])
def test_bad_lease_is_refused_with_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match="lease"):
        Liveness(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("lease", [3, 3.5, 4, 6, 10, 30, 120])
def test_bounds_are_ordered_for_any_lease(lease: float) -> None:
    """heartbeat < holder gives up < server releases; a dead peer's TCP is noticed within the lease."""
    live = Liveness(lease)
    assert live.heartbeat_interval < live.loss_deadline < live.lease
    assert live.loss_deadline + live.heartbeat_interval <= live.lease  # a full interval of margin
    assert live.keepalive_idle + live.keepalive_interval * live.keepalive_count <= live.lease
    assert live.keepalive_count >= 1 and live.keepalive_interval >= 1


def test_settings_follow_the_server_version() -> None:
    live = Liveness(6)
    modern = live.server_settings(transaction=False, server_version_num=160002)
    assert modern["idle_session_timeout"] == "6000ms"
    assert modern["client_connection_check_interval"] == "1000ms"
    old = live.server_settings(transaction=True, server_version_num=130010)
    assert "idle_session_timeout" not in old and "client_connection_check_interval" not in old
    assert old["idle_in_transaction_session_timeout"] == "6000ms"
    assert "idle_session_timeout" not in live.server_settings(transaction=True)


def test_session_locks_need_idle_session_timeout() -> None:
    import datetime as dt

    from airflow_pglock.exceptions import UnsafeSetupError
    from airflow_pglock.server_rules import ServerInfo

    pg13 = ServerInfo(
        backend_pid=1,
        reported_pid=1,
        version_num=130010,
        version="PostgreSQL 13.10",
        database="db",
        server_addr="10.0.0.1",
        server_port=5432,
        in_recovery=False,
        started_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    )
    with pytest.raises(UnsafeSetupError, match="idle_session_timeout") as error:
        server_rules.check_server(pg13, "session", None)
    assert "mode='transaction'" in str(error.value) and "130010" in str(error.value)
    server_rules.check_server(pg13, "transaction", None)  # bounded by idle_in_transaction_session_timeout


@pytest.mark.parametrize("lease", [3, 4, 6, 30])
def test_a_probe_waits_until_the_loss_deadline_and_a_late_one_never_past_the_answer_cutoff(lease: float) -> None:
    """On time: until 2L/3. Late (the process stalled): a grace of up to 1 s to hear a live
    server, never past L less the margin, and nothing past that (only an answer already there)."""
    live = Liveness(lease)
    assert live.loss_deadline < live.answer_cutoff < live.lease
    interval = live.heartbeat_interval
    assert live.probe_budget(interval) == pytest.approx(live.loss_deadline - interval)
    for since in (live.loss_deadline - 0.5, live.loss_deadline, live.loss_deadline + 0.5, live.answer_cutoff, 99.0):
        budget = live.probe_budget(since)
        assert 0 <= budget <= max(live.loss_deadline - since, 1.0)
        assert since + budget <= max(live.answer_cutoff, since)  # never past the cutoff
    assert live.probe_budget(live.answer_cutoff) == 0 and live.probe_budget(99.0) == 0
    # A probe late by a stall that ends well before the cutoff still gets its whole grace.
    assert live.probe_budget(live.answer_cutoff - 1.0) == pytest.approx(1.0)
