"""Why a lock was lost, in words a DAG author can act on. Pure: no I/O, no threads.

The guard and its heartbeat decide *that* a lock is lost; these functions say *why*, from
what they saw (an error's SQLSTATE, a probe that went unanswered, the server's start).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

from airflow_pglock import forks

# Errors with which the server ends a session (its locks end with it).
SESSION_ENDED_STATES = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03", "25P04"})

TERMINATED = "the session was terminated (pg_terminate_backend() or a server shutdown)"

ENDED_BY_WORK = (
    "the work ended the lock's transaction itself (COMMIT or ROLLBACK on lock.connection): the lock ended "
    "with it, and what ran afterwards ran without the lock"
)

ABORTED_BY_AN_ERROR = (
    "the lock's transaction was aborted by an error on lock.connection, outside a savepoint: PostgreSQL "
    "releases a transaction's locks at the error, not at its later ROLLBACK, so the key was free from then on "
    "(seen from a side connection)"
)

#: The manual handle (no side look): what an aborted transaction means for its lock.
ABORTED_UNLESS_IN_A_SAVEPOINT = (
    "an error aborted the lock's transaction: unless it came inside a savepoint (then the lock stays until "
    "the transaction ends), it released the lock at once, since PostgreSQL frees a transaction's locks at the "
    "error, not at its later ROLLBACK; another holder may have taken the key since"
)


def unverified_after_error(seconds: float) -> str:
    """A transaction lock's heartbeat was answered with an error and no side look could be made."""
    return (
        "the lock's transaction answered the heartbeat with an error (aborted, or in a failed savepoint), and "
        f"no side connection could tell within {seconds:.1f} s whether it still held the key: given up as lost"
    )


NOT_HELD_SEEN_ASIDE = (
    "the lock session no longer holds the key (seen from a side connection while the work kept "
    "the lock's connection busy: the session was terminated, or its transaction ended)"
)

SESSION_GONE_SEEN_ASIDE = (
    "the lock session has ended (seen from a side connection while its own connection was busy: the session "
    "was terminated, or the server restarted)"
)

CLOSED_AT_RELEASE = "found at release: the lock connection was closed"
CLOSED_BEFORE_COMMIT = (
    "found at release: the lock's connection was closed before its COMMIT (by the work, or it broke): no COMMIT "
    "was sent, and the server rolled back the transaction open at the close"
)

NOT_HELD_AT_FENCING = (
    "found when its fencing token was issued, before the work started: the lock session no longer held the key "
    "(its session or transaction had ended, e.g. this process stalled for longer than the lease). No token was "
    "issued and the work did not run (a later holder's token stays the newest)"
)

NOT_HELD_AFTER_FENCING = (
    "found after its fencing token was issued, before the work started: the lock's transaction had ended "
    "while the token's commit on the side connection waited (for a synchronous standby, or a row lock) longer "
    "than the lease. The token was not handed to the work, and the work did not run"
)

SUB_KEY_ENDED = "found at release: the lock's transaction no longer held"


def sub_key_ended(key: str) -> str:
    """A transaction-mode sub-key was found ended before the lock's transaction (``key``: described)."""
    return (
        f"{SUB_KEY_ENDED} {key}, one of its sub-keys (a ROLLBACK TO SAVEPOINT ends a sub-key taken after the "
        "savepoint; an error "
        "that aborts the transaction, or the work's own COMMIT or ROLLBACK, ends them all), so the work went on "
        "without it"
    )


NOT_HELD_AT_COMPLETION = "found at completion: the session no longer held the key (nothing recorded)"


def is_ordinary_error(sqlstate: str | None) -> bool:
    """An error the session survives, with its locks (e.g. a statement in an aborted transaction)."""
    state = sqlstate or ""
    return bool(state) and state[:2] != "08" and state not in SESSION_ENDED_STATES


def session_answered(error: BaseException, connection_closed: bool) -> bool:
    """Whether ``error`` came from a session that lives on (it answered with an ordinary error)."""
    return not connection_closed and is_ordinary_error(getattr(error, "sqlstate", None))


def session_end_reason(sqlstate: str, detail: str, error_name: str, lease: float) -> tuple[str, bool]:
    """Why the session ended, from the error's SQLSTATE (or a 57P.. notice just before it).

    :param detail: the first line of the error (or of the notice).
    :param error_name: the error's class name, for an error without a known state.
    :returns: the reason, and whether asking the server may tell more (e.g. a restart).
    """
    if sqlstate == "57P01":
        return TERMINATED, True
    if sqlstate in {"57P02", "57P03"}:
        return f"the PostgreSQL server crashed or is shutting down ({detail})", True
    if sqlstate == "57P05":
        return (
            f"the server ended the session after the lease ({lease:g} s) without a heartbeat "
            "(idle_session_timeout): this process was frozen, stalled or cut off from the server for longer "
            "than the lease",
            False,
        )
    if sqlstate == "25P03":
        return (
            f"the server ended the session after the lease ({lease:g} s) idle in its transaction "
            "(idle_in_transaction_session_timeout): this process was frozen, stalled or cut off for longer "
            "than the lease",
            False,
        )
    if sqlstate == "25P04":
        return (
            f"the server ended the session at its transaction_timeout ({detail}; PostgreSQL 17+): a transaction "
            "on the lock's session outlasted it. In mode='transaction' the lock's transaction lasts as long as the "
            "work: lift transaction_timeout for the lock's role or database (ALTER ROLE ... SET transaction_timeout "
            "= 0) or use mode='session'; in mode='session', a transaction the work kept open on the lock's "
            "connection, or a commit that waited for a synchronous standby, lasted that long",
            False,
        )
    return f"the connection to the lock database broke ({error_name}: {detail})", True


def error_reason(error: BaseException, lease: float, notice: tuple[str, str] | None = None) -> tuple[str, bool]:
    """Why the session ended, as far as a driver error (or the server's notice before it) tells.

    :param notice: ``(sqlstate, message)`` of a 57P.. notice the server sent just before it hung up.
    :returns: the reason, and whether asking the server may tell more (see :func:`session_end_reason`).
    """
    state = getattr(error, "sqlstate", None) or ""
    text = str(error).strip().splitlines()
    detail = text[0] if text else type(error).__name__
    if not state and notice is not None:
        state, detail = notice
    return session_end_reason(state, detail, type(error).__name__, lease)


def not_held_reason(mode: str) -> str:
    """The probe was answered: the session is alive but does not hold the key (any more)."""
    if mode == "transaction":
        return (
            "the transaction holding the lock ended while the work ran (a COMMIT or ROLLBACK on the lock's "
            "connection releases a transaction-level lock; a session that ended takes it along)"
        )
    return "the session is alive but no longer holds the key (something on this connection unlocked it)"


def no_answer_reason(silent: float, server: str, lease: float) -> str:
    """No answer to the heartbeat for ``silent`` seconds: given up before the server may release it."""
    return (
        f"no answer from the lock database for {silent:.1f} s (the network to {server} is "
        "cut, or the server or this process was frozen); the server releases the lock of a session "
        f"silent for the lease ({lease:g} s), so it is given up for lost now"
    )


#: Seconds by which the server's start must precede the lock's answer to say it did not restart:
#: the lock statement ran on the server at most this long before its answer was read (its answer's
#: latency). Only the "terminated, no restart" wording rests on it; "restarted" needs no margin.
RESTART_MARGIN = 0.02

_BOOT_CLOCK = getattr(time, "CLOCK_BOOTTIME", None)


def held_clock() -> float:
    """Seconds on this machine's clock for how long a lock was held: ``CLOCK_BOOTTIME``, which
    also counts a suspend of the machine (``time.monotonic()`` does not), where there is one."""
    return time.clock_gettime(_BOOT_CLOCK) if _BOOT_CLOCK is not None else time.monotonic()


@dataclass(frozen=True)
class ServerStart:
    """The server's start, asked after a loss: ``pg_postmaster_start_time()`` and how long ago
    that was on the server's clock (``uptime``), asked at :func:`held_clock` = ``asked_at`` and
    answered at ``seen_at`` (the server read its clock in between), by the server at ``server``
    (``host:port`` as the connection reached it), which also answers to every name in
    ``addresses`` (``server`` and ``inet_server_addr():inet_server_port()``) and is a standby
    when ``in_recovery``.

    Comparing the uptime with how long the lock had been held needs no start time from when
    the lock was taken (the lock statement does not ask it) and no agreement between clocks.
    On this machine's clock the server started between ``asked_at - uptime`` and
    ``seen_at - uptime``, however late the answer was read.
    """

    started_at: dt.datetime
    uptime: float
    asked_at: float
    seen_at: float
    server: str
    addresses: frozenset[str]
    in_recovery: bool


def refine_with_server_start(reason: str, server: ServerStart | None, acquired: float, lock_server: str) -> str:
    """A vague reason made precise with the server's start (None: the server is unreachable).

    :param acquired: :func:`held_clock` when the lock was taken (its statement answered).
    :param lock_server: ``host:port`` the lock's connection reached; a connection string with
        several hosts may now lead to another server, whose uptime says nothing about the lock's.
    """
    if server is None:
        return (
            "the PostgreSQL server shut down, crashed or is restarting: it does not accept connections now "
            f"(the lock session ended with: {reason})"
        )
    if lock_server not in server.addresses:
        if server.in_recovery:
            return (
                f"the lock's server ({lock_server}) shut down, crashed, is restarting or is no longer a primary: "
                f"the connection string now leads to {server.server}, a standby (the lock session ended with: "
                f"{reason})"
            )
        return (
            f"the connection now leads to another address ({server.server}, a primary) than the lock's "
            f"({lock_server}): a failover or switchover if it is another server, and advisory locks are not "
            f"replicated (the lock session ended with: {reason})"
        )
    if server.asked_at - server.uptime > acquired:  # it started after the lock's answer, at the earliest
        when = server.started_at.isoformat(timespec="seconds")
        return f"the PostgreSQL server restarted at {when} (the lock session ended with it)"
    started_before = server.seen_at - server.uptime < acquired - RESTART_MARGIN  # at the latest
    if reason.startswith("the session was terminated") and started_before:
        return (
            "the session was terminated by pg_terminate_backend() (an administrator or a tool ended it; the "
            f"server at {lock_server} has run since before the lock was taken, unless another server took over "
            "its address, e.g. a failover behind a virtual IP or a pooler)"
        )
    return reason


def found_at_release(reason: str | None) -> str:
    """The unlock found the key gone (``reason``: what else was seen, if anything)."""
    return f"found at release: {reason or 'the session no longer held the key'}"


def unlock_failed_after_completion(reason: str) -> str:
    """The completion was recorded while the key was held, then the unlock failed."""
    return (
        f"the unlock failed after the completion was recorded ({reason}); the work ran under the lock to its "
        "end, and the server frees the key when it ends the session"
    )


def unlock_failed_while_held(error: BaseException) -> str:
    """A session lock's unlock failed on a session that lives on (a cancelled statement), and a
    second unlock found the key still held."""
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return f"the unlock failed ({reason}); sent again, it found the key still held: the work ran under the lock"


#: How a transaction lock's COMMIT whose answer never came is reported (:func:`commit_unknown`).
COMMIT_UNKNOWN = "found at commit: the session ended while its COMMIT ran"


def commit_unknown(reason: str, server_says: str | None) -> str:
    """A transaction lock's checked COMMIT was sent, and the session ended before its answer came
    back: the server may have committed (the check passed: the key was held to the COMMIT) or not.

    :param reason: why the session ended.
    :param server_says: ``txid_status()`` of the lock's transaction as a side connection read it
        afterwards (``committed``, ``aborted``, ``in progress``), or None when it could not be read.
        The side connection may reach another server (a failover behind the same address) whose
        transaction of that id is not the lock's: said, never acted upon.
    """
    said = (
        f"; afterwards the database the lock's connection settings lead to said that transaction is {server_says!r} "
        "(the lock's server, unless a failover moved that address)"
        if server_says
        else ""
    )
    return f"{COMMIT_UNKNOWN} ({reason}): whether it committed is unknown{said}"


def lost_message(key: str, reason: str, *, transaction: bool) -> str:
    """The message of the LockLostError that fails the run."""
    if forks.is_forked_reason(reason):  # held all along, by the parent: no other worker can have it
        return f"{key} is not held in this process: {reason}"
    suffix = ""
    if transaction and reason.startswith(COMMIT_UNKNOWN):
        suffix = (
            " (transaction mode: the work's writes on the lock's connection may have been committed, under the lock, "
            "or not: check them before the work runs again)"
        )
    elif transaction and (reason in (ENDED_BY_WORK, CLOSED_BEFORE_COMMIT) or reason.startswith(SUB_KEY_ENDED)):
        suffix = " (transaction mode: what the work committed itself stays committed; the guard committed nothing)"
    elif transaction:  # found by the heartbeat too after the work's own COMMIT: never "nothing committed"
        suffix = (
            " (transaction mode: the guard committed nothing; only a COMMIT the work ran itself on the lock's "
            "connection, which ends the lock, committed anything)"
        )
    return (
        f"lost {key} while the task ran: {reason}. Another worker may now run the same "
        "work; this run is marked failed instead of successful" + suffix
    )


def warned(reason: str) -> str:
    return f"{reason} (on_lost='warn': the work went on without the lock)"
