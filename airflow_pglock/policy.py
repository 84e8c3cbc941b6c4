"""What a guarded execution does in each situation: the policy values and their checks.

Light on purpose (no psycopg, no hook): options are checked while a DAG file is parsed,
and parsing must not load the lock machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.keys import MAX_SLOTS
from airflow_pglock.server_rules import Scope

OnBusy = Literal["skip", "fail", "wait", "defer"]
OnLost = Literal["fail", "warn"]
OnError = Literal["fail", "skip"]
OnWaitTimeout = Literal["skip", "fail"]

ON_BUSY_CHOICES: tuple[str, ...] = ("skip", "fail", "wait", "defer")
ON_LOST_CHOICES: tuple[str, ...] = ("fail", "warn")
ON_ERROR_CHOICES: tuple[str, ...] = ("fail", "skip")
ON_WAIT_TIMEOUT_CHOICES: tuple[str, ...] = ("skip", "fail")
MODE_CHOICES: tuple[str, ...] = ("session", "transaction")

#: The largest ``lock_timeout`` PostgreSQL takes (a C int of milliseconds): it bounds ``on_busy="wait"``.
MAX_LOCK_TIMEOUT_MS = 2**31 - 1
#: The longest wait_timeout, in whole seconds (2,147,483 s, about 24.8 days; also for ``"defer"``).
MAX_WAIT_TIMEOUT_SECONDS = MAX_LOCK_TIMEOUT_MS // 1000
#: ``on_busy="defer"``: seconds a busy try first waits on the worker (server-side) before deferring.
#: About what a deferral costs (a resume takes ~2 s: the triggerer's and the scheduler's loops), so a
#: key freed within it is taken at once, and a longer wait costs at most twice the best choice.
DEFAULT_DEFER_AFTER_SECONDS = 2.0


def wait_timeout_problem(timeout: Any) -> str | None:
    """Why ``timeout`` is not a wait timeout (a positive, finite number of seconds up to
    :data:`MAX_WAIT_TIMEOUT_SECONDS`), or None when it is one."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        return "not a number of seconds"
    if not 0 < timeout <= MAX_WAIT_TIMEOUT_SECONDS:  # NaN and infinities too
        return "out of range"
    return None


def longest_wait_text() -> str:
    return (
        f"the longest is {MAX_WAIT_TIMEOUT_SECONDS:,} s ({MAX_WAIT_TIMEOUT_SECONDS // 86400} days "
        f"{MAX_WAIT_TIMEOUT_SECONDS % 86400 // 3600} hours: "
        f"PostgreSQL's lock_timeout is at most {MAX_LOCK_TIMEOUT_MS} ms)"
    )


def lock_timeout_ms(timeout: float) -> int:
    """``lock_timeout`` in milliseconds for a checked wait timeout (at least 1: 0 would mean no limit)."""
    return max(1, round(timeout * 1000))


def check_defer_after(defer_after: Any) -> None:
    """Refuse a ``defer_after`` that is not 0 or a positive number of seconds up to the longest wait."""
    if isinstance(defer_after, bool) or (defer_after != 0 and wait_timeout_problem(defer_after) is not None):
        raise LockConfigurationError(
            f"defer_after must be 0 (defer at once) or a positive number of seconds to wait on the worker "
            f"before deferring, got {defer_after!r}; {longest_wait_text()}"
        )


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LockConfigurationError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_mode(mode: Any) -> None:
    """Refuse a mode other than ``"session"`` or ``"transaction"``."""
    _check_choice("mode", mode, MODE_CHOICES)


def check_shared(shared: Any) -> None:
    """Refuse a ``shared`` that is not a bool (``"false"`` is truthy: a shared lock where an
    exclusive one was meant; a lock session would also lose track of it)."""
    if not isinstance(shared, bool):
        raise LockConfigurationError(f"shared must be True or False, got {shared!r}")


def check_slots(slots: Any, shared: Any) -> None:
    """Refuse a slot count that is not an integer from 1 to ``MAX_SLOTS``, a ``shared`` that is
    not a bool, or a shared pool."""
    check_shared(shared)
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise LockConfigurationError(f"slots must be an integer from 1 to {MAX_SLOTS}, got {slots!r}")
    if slots > 1 and shared is True:
        raise LockConfigurationError(
            f"shared=True cannot be combined with slots={slots}: a pool's slots are exclusive (a shared holder "
            "would not count against the pool); use slots=1 for a readers/writer lock"
        )


@dataclass(frozen=True)
class LockPolicy:
    """What a guarded execution does in each situation.

    :param mode: ``"session"`` (the lock spans any work) or ``"transaction"`` (the work
        runs inside the transaction that holds the lock, on the lock's connection).
    :param shared: take a shared lock (readers) instead of an exclusive one.
    :param on_busy: ``"skip"``, ``"fail"``, ``"wait"`` (up to ``wait_timeout``, then skip) or
        ``"defer"`` (try once; the Airflow adapter defers the task to the triggerer when busy).
    :param wait_timeout: seconds ``on_busy="wait"`` waits, enforced by the server (with
        ``"defer"``: the whole wait across deferrals).
    :param on_lost: ``"fail"`` (interrupt the work, fail) or ``"warn"`` (log and go on).
    :param on_error: ``"fail"`` or ``"skip"`` when the lock cannot be tried: the lock database
        cannot be used, or a setting must be fixed (a bad key, an unsafe set-up, a pool size that
        disagrees with another holder's). Never after the lock was taken.
    :param on_wait_timeout: ``"skip"`` or ``"fail"`` when ``on_busy="wait"`` ran out of
        ``wait_timeout`` (for ``"defer"`` the Airflow adapter applies it at the deadline).
    :param slots: the key names a pool of this many slots; a run holds any one free slot
        (1: a plain lock on the key). Exclusive only (``shared`` is refused with more than one).
    :param defer_after: ``"defer"``: seconds a busy try first waits on the worker (server-side,
        as ``"wait"``) before the adapter defers; 0: defer at once. Ignored by other ``on_busy``.
    """

    mode: Scope = "session"
    shared: bool = False
    on_busy: OnBusy = "skip"
    wait_timeout: float | None = None
    on_lost: OnLost = "fail"
    on_error: OnError = "fail"
    slots: int = 1
    on_wait_timeout: OnWaitTimeout = "skip"
    defer_after: float = 0.0

    def __post_init__(self) -> None:
        check_slots(self.slots, self.shared)
        check_mode(self.mode)
        _check_choice("on_busy", self.on_busy, ON_BUSY_CHOICES)
        _check_choice("on_lost", self.on_lost, ON_LOST_CHOICES)
        _check_choice("on_error", self.on_error, ON_ERROR_CHOICES)
        _check_choice("on_wait_timeout", self.on_wait_timeout, ON_WAIT_TIMEOUT_CHOICES)
        if self.on_busy in ("wait", "defer"):
            timeout = self.wait_timeout
            if wait_timeout_problem(timeout) is not None:
                raise LockConfigurationError(
                    f"on_busy={self.on_busy!r} needs wait_timeout, a positive number of seconds (the wait is "
                    f"bounded); got {timeout!r}; {longest_wait_text()}"
                )
        elif self.wait_timeout is not None:
            raise LockConfigurationError(
                f"wait_timeout={self.wait_timeout!r} only applies with on_busy='wait' or on_busy='defer'"
            )
        check_defer_after(self.defer_after)

    def first_wait(self) -> float | None:
        """Seconds the try waits for a busy key on the worker (server-side); None: try once."""
        if self.on_busy == "wait":
            return self.wait_timeout
        if self.on_busy == "defer" and self.defer_after > 0:
            return self.defer_after
        return None

    def busy_outcome(self) -> str:
        """The outcome line of a refusal because the key is busy: what the task will be."""
        if self.on_busy == "fail" or (self.on_busy == "wait" and self.on_wait_timeout == "fail"):
            return "failed"
        return "deferred" if self.on_busy == "defer" else "skipped"
