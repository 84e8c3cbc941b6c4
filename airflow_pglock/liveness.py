"""Liveness settings of a lock connection: how long a dead holder can keep a lock.

Pure module. One number, the *lease* ``L`` (seconds, default 30, at least 3), sets all of them:

* **server side, the lease itself**: the server ends a lock session that has been idle for
  ``L`` seconds (``idle_session_timeout``, and ``idle_in_transaction_session_timeout`` for
  its transactions: a session lock's wait for a busy key, every transaction-mode lock), which
  releases its advisory locks. A healthy holder's heartbeat runs a
  statement every ``L / 3`` s, so its session is never idle that long;
* **holder side, loss detection**: a heartbeat that has no answer ``2L / 3`` s after the
  last confirmed one makes the holder consider its lock lost (and interrupt the protected
  work) a full heartbeat interval *before* the server may release it. When the holder's own
  process stalled (a GC pause, a C call holding the GIL, CPU starvation), a probe that starts
  or sends its question late still waits up to a second for a live server's answer, never
  past ``L`` less :data:`ANSWER_CUTOFF_MARGIN` (:meth:`Liveness.probe_budget`);
* **TCP, belt and braces**: keepalives probe a silent peer after ``L / 3`` s, every ``L / 9``
  s, at most 3 times (so a dead peer is noticed within ``L``), ``tcp_user_timeout`` drops a
  connection whose sent data stays unacknowledged for ``L`` s, on both ends; and
  ``client_connection_check_interval`` (PostgreSQL 14+) lets the server notice a vanished
  client while a statement of the protected work still runs (transaction mode).

Hence: a holder that freezes, crashes or drops off the network loses its lock on the
server at most ``L`` seconds after its last heartbeat (plus the server's timer granularity,
well under a second), instead of after the OS keepalive default of about two hours; and it
stops its protected work before that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from airflow_pglock.exceptions import LockConfigurationError

DEFAULT_LEASE_SECONDS = 30.0
MIN_LEASE_SECONDS = 3.0
#: The largest TCP keepalive idle time and interval the OS takes (Linux: ``MAX_TCP_KEEPIDLE``
#: and ``MAX_TCP_KEEPINTVL``, 32767 s); libpq's ``setsockopt`` fails for a larger one.
MAX_TCP_KEEPALIVE_SECONDS = 32767
#: The largest millisecond setting PostgreSQL and libpq take (``idle_session_timeout``,
#: ``tcp_user_timeout``...: a C int).
MAX_SETTING_MS = 2**31 - 1
#: The longest lease: its keepalive idle time (``lease / 3``) is the first setting to reach a
#: limit, ``MAX_TCP_KEEPALIVE_SECONDS`` (98301 s, about 27.3 hours).
MAX_LEASE_SECONDS = min(3 * MAX_TCP_KEEPALIVE_SECONDS, MAX_SETTING_MS // 1000)
#: Seconds before the server may end a silent lock session (``lease`` after the last confirmed
#: heartbeat) by which a holder whose process stalled has stopped waiting for an answer: the
#: time for its alarm to interrupt the work.
ANSWER_CUTOFF_MARGIN = 0.25
#: The most a probe that starts or sends its question late (its process stalled) waits for a
#: live server's answer: a second, less where the lease leaves less.
LATE_PROBE_GRACE = 1.0
#: ``idle_session_timeout`` and ``client_connection_check_interval`` appeared in PostgreSQL 14.
IDLE_SESSION_TIMEOUT_VERSION = 140000


@dataclass(frozen=True)
class Liveness:
    """Server- and client-side liveness settings derived from one lease.

    :param lease: seconds a silent holder may keep its lock on the server (default 30,
        from :data:`MIN_LEASE_SECONDS` to :data:`MAX_LEASE_SECONDS`).
    """

    lease: float = DEFAULT_LEASE_SECONDS

    def __post_init__(self) -> None:
        lease = self.lease
        number = not isinstance(lease, bool) and isinstance(lease, int | float)
        if not number or not MIN_LEASE_SECONDS <= lease <= MAX_LEASE_SECONDS:  # NaN and infinities too
            raise LockConfigurationError(
                f"lease must be a number of seconds, at least {MIN_LEASE_SECONDS:g} s and at most "
                f"{MAX_LEASE_SECONDS:,} s (its TCP keepalive idle time, lease/3, may not exceed the OS limit of "
                f"{MAX_TCP_KEEPALIVE_SECONDS} s), got {lease!r}"
            )

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two heartbeats of a healthy holder (``lease / 3``)."""
        return self.lease / 3

    @property
    def loss_deadline(self) -> float:
        """Seconds after the last confirmed heartbeat at which the holder gives its lock up
        for lost when no newer heartbeat was answered (``2 * lease / 3``)."""
        return 2 * self.heartbeat_interval

    @property
    def answer_cutoff(self) -> float:
        """Seconds after the last confirmed heartbeat past which the holder waits for no answer
        at all, however late its process let the probe run (``lease`` less :data:`ANSWER_CUTOFF_MARGIN`)."""
        return self.lease - ANSWER_CUTOFF_MARGIN

    def probe_budget(self, since_confirmed: float) -> float:
        """Seconds a probe started ``since_confirmed`` s after the last confirmed one may wait for
        its answer: until :attr:`loss_deadline`; one that starts later (the process stalled) gets
        up to :data:`LATE_PROBE_GRACE` to hear a live server, never past :attr:`answer_cutoff`
        (0: the question is sent, and only an answer already there counts)."""
        late = min(LATE_PROBE_GRACE, self.answer_cutoff - since_confirmed)
        return max(self.loss_deadline - since_confirmed, late, 0.0)

    @property
    def lease_ms(self) -> int:
        return math.ceil(self.lease * 1000)

    @property
    def keepalive_idle(self) -> int:
        """Seconds of silence before the first TCP keepalive probe."""
        return max(1, int(self.lease / 3))

    @property
    def keepalive_interval(self) -> int:
        """Seconds between two unanswered TCP keepalive probes."""
        return max(1, int(self.lease / 9))

    @property
    def keepalive_count(self) -> int:
        """Unanswered probes before the peer counts as dead (idle + interval * count <= lease)."""
        return max(1, min(3, int((self.lease - self.keepalive_idle) // self.keepalive_interval)))

    def server_settings(
        self, transaction: bool, server_version_num: int = IDLE_SESSION_TIMEOUT_VERSION
    ) -> dict[str, str]:
        """``set_config`` name -> value for the lock's session (or transaction).

        :param transaction: settings for a transaction-level lock (``SET LOCAL``) rather
            than for the session.
        :param server_version_num: the server's ``server_version_num``; settings it does
            not know are left out (the caller refuses set-ups that need them).
        """
        modern = server_version_num >= IDLE_SESSION_TIMEOUT_VERSION
        # A session lock too: its session is in a transaction while it waits for a busy key (and
        # then until its commit), where idle_session_timeout does not apply; a holder frozen
        # just as the key was granted would keep it for as long as it stays frozen.
        settings: dict[str, str] = {"idle_in_transaction_session_timeout": f"{self.lease_ms}ms"}
        if not transaction and modern:
            settings["idle_session_timeout"] = f"{self.lease_ms}ms"
        settings.update(
            {
                "tcp_keepalives_idle": str(self.keepalive_idle),
                "tcp_keepalives_interval": str(self.keepalive_interval),
                "tcp_keepalives_count": str(self.keepalive_count),
                "tcp_user_timeout": str(self.lease_ms),
            }
        )
        if modern:
            settings["client_connection_check_interval"] = f"{self.keepalive_interval * 1000}ms"
        return settings

    def client_settings(self) -> dict[str, str | int]:
        """libpq connection parameters for the client end of the socket."""
        return {
            "keepalives": 1,
            "keepalives_idle": self.keepalive_idle,
            "keepalives_interval": self.keepalive_interval,
            "keepalives_count": self.keepalive_count,
            "tcp_user_timeout": self.lease_ms,
        }
