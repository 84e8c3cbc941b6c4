"""Liveness settings of a lock connection: how long a dead holder can keep a lock.

Pure module. One number, the *lease*, sets all of them:

* the server ends a session that has been idle for ``lease`` seconds
  (``idle_session_timeout``; ``idle_in_transaction_session_timeout`` in transaction
  mode), releasing its advisory locks; a healthy holder's heartbeat runs every
  ``lease / 3`` seconds, so it is never idle that long;
* the server's TCP keepalives probe a silent client after ``lease / 3`` s, every
  ``lease / 9`` s, 3 times, and ``tcp_user_timeout`` drops a connection whose sent data
  stays unacknowledged for ``lease`` s; the client side uses the same values.

Hence: a holder that freezes, crashes or drops off the network loses its lock on the
server at most ``lease`` seconds after its last heartbeat (plus the server's timer
granularity, well under a second), instead of after the OS keepalive default of ~2 h.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_LEASE_SECONDS = 30.0
MIN_LEASE_SECONDS = 3.0


@dataclass(frozen=True)
class Liveness:
    """Server- and client-side liveness settings derived from one lease.

    :param lease: seconds a silent holder may keep its lock on the server (default 30).
    """

    lease: float = DEFAULT_LEASE_SECONDS

    def __post_init__(self) -> None:
        if isinstance(self.lease, bool) or not isinstance(self.lease, int | float) or not math.isfinite(self.lease):
            raise ValueError(f"lease must be a number of seconds, got {self.lease!r}")
        if self.lease < MIN_LEASE_SECONDS:
            raise ValueError(f"lease must be at least {MIN_LEASE_SECONDS:g} s, got {self.lease!r}")

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two heartbeats of a healthy holder."""
        return self.lease / 3

    @property
    def lease_ms(self) -> int:
        return math.ceil(self.lease * 1000)

    @property
    def keepalive_idle(self) -> int:
        return max(1, int(self.lease / 3))

    @property
    def keepalive_interval(self) -> int:
        return max(1, int(self.lease / 9))

    keepalive_count = 3

    def server_settings(self, transaction: bool) -> dict[str, str]:
        """``set_config`` name -> value for the lock's session (or transaction)."""
        idle_setting = "idle_in_transaction_session_timeout" if transaction else "idle_session_timeout"
        return {
            idle_setting: f"{self.lease_ms}ms",
            "tcp_keepalives_idle": str(self.keepalive_idle),
            "tcp_keepalives_interval": str(self.keepalive_interval),
            "tcp_keepalives_count": str(self.keepalive_count),
            "tcp_user_timeout": str(self.lease_ms),
        }

    def client_settings(self) -> dict[str, str | int]:
        """libpq connection parameters for the client end of the socket."""
        return {
            "keepalives": 1,
            "keepalives_idle": self.keepalive_idle,
            "keepalives_interval": self.keepalive_interval,
            "keepalives_count": self.keepalive_count,
            "tcp_user_timeout": self.lease_ms,
        }
