from __future__ import annotations

import pytest

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
