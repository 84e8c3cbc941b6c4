"""The heartbeat's check of a lock session, bounded in time whatever the network does.

:func:`probe` asks whether the session still holds its key (or only lives) and never
blocks much past its budget (a question its stalled thread sent late: its ``answer_by``): no
answer in time closes the connection and says so.
:func:`results_before` reads a query's results by a deadline, from the socket.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from typing import Any, Literal

import psycopg

from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import LATE_PROBE_GRACE
from airflow_pglock.pg.sql import held_condition, held_params

#: What a heartbeat found: the key is held; it is not; the protected work is using the
#: connection (transaction mode: the session is busy, hence not idle); no answer in time.
ProbeResult = Literal["held", "not held", "busy", "no answer"]


def probe(
    conn: psycopg.Connection[Any],
    key: LockKey | None,
    shared: bool,
    timeout: float,
    *,
    xact_id: int | None = None,
    before_giving_up: Callable[[], None] | None = None,
    answer_by: float | None = None,
) -> ProbeResult:
    """The heartbeat: does this session still hold ``key``? Never blocks much past ``timeout`` (or ``answer_by``).

    Unlike :func:`~airflow_pglock.pg.statements.is_held`, it cannot hang on a dead network or a frozen server: when no
    answer has arrived after ``timeout`` seconds, it closes the connection (so the server
    drops the session as soon as it hears from it again) and returns ``"no answer"``.
    When the protected work is using the connection for that long (transaction mode),
    it returns ``"busy"``: a session running a statement is not idle, so the server keeps
    its lock; also while the work has a pipeline open on it (a query sent now would be
    queued behind the work's). A session that ended raises the server's error
    (``AdminShutdown``, ``IdleSessionTimeout``...) or ``OperationalError`` when the
    connection broke.

    :param conn: the lock's own connection.
    :param key: the key it should hold; None: only whether the session is alive (a lock
        session: its locks can only end with it or by its own unlock), ``"held"`` if so.
    :param shared: whether it holds the key in shared mode.
    :param timeout: seconds to wait for the connection and the answer together.
    :param xact_id: transaction scope: the lock's transaction (see :func:`~airflow_pglock.pg.statements.is_held`).
    :param before_giving_up: called when there is no answer, before the connection is
        closed (closing lets the server release the lock: interrupt the work first).
    :param answer_by: ``time.monotonic()`` past which no answer is waited for, whatever
        ``timeout`` says (a thread stalled past it gives up as soon as it runs again, unless
        the answer is already there). Before it, the question gets up to
        :data:`~airflow_pglock.liveness.LATE_PROBE_GRACE` for its answer however late it
        left (its thread stalled between taking the connection and sending: a C call holding
        the GIL, CPU starvation; or the work held the connection until then). None: neither.
    """
    now = time.monotonic()
    deadline = now + max(0.0, timeout)
    if answer_by is not None:
        deadline = min(deadline, max(answer_by, now))
    lock = conn.lock  # psycopg serialises the use of a connection with this lock
    if not lock.acquire(timeout=max(0.0, deadline - now)):
        return "busy"
    try:
        if conn.closed:
            raise psycopg.OperationalError("the lock connection is closed")
        pgconn = conn.pgconn
        if pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
            return "busy"
        if key is None:
            statement, params = "SELECT true", []
        else:
            params = [str(value) for value in held_params(key, shared)]
            if xact_id is not None:
                params.append(str(xact_id))
            statement = "SELECT " + held_condition(None, ("$1", "$2", "$3", "$4"), None if xact_id is None else "$5")
        pgconn.send_query_params(statement.encode(), [value.encode() for value in params])
        if answer_by is not None:
            deadline = max(deadline, min(time.monotonic() + LATE_PROBE_GRACE, answer_by))
        results = results_before(pgconn, deadline)
        if results is None:
            if before_giving_up is not None:
                before_giving_up()
            conn.close()  # the query is still in flight: this connection can never be used again
            return "no answer"
    finally:
        lock.release()
    for result in results:
        if result.status != psycopg.pq.ExecStatus.TUPLES_OK:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    return "held" if results and results[-1].get_value(0, 0) == b"t" else "not held"


def results_before(pgconn: psycopg.pq.abc.PGconn, deadline: float) -> list[psycopg.pq.abc.PGresult] | None:
    """Every result of the query just sent on ``pgconn``; None if the deadline passed first.

    Past the deadline the socket is still polled once, without waiting: a thread that
    was stalled (GIL held by a C call, CPU starvation) past its deadline must not give up
    on an answer that arrived meanwhile.
    """

    def ready(events: int) -> bool:
        remaining = max(0.0, deadline - time.monotonic())
        poller = select.poll()
        poller.register(pgconn.socket, events)
        return bool(poller.poll(remaining * 1000))

    while pgconn.flush() != 0:
        if not ready(select.POLLOUT):
            return None
    results: list[psycopg.pq.abc.PGresult] = []
    while True:
        while pgconn.is_busy():
            if not ready(select.POLLIN):
                return None
            try:
                pgconn.consume_input()
            except psycopg.OperationalError:
                # The server sent its reason (e.g. FATAL: terminating connection) and hung up.
                if any(r.status == psycopg.pq.ExecStatus.FATAL_ERROR for r in results):
                    return results
                raise
        result = pgconn.get_result()
        if result is None:
            return results
        results.append(result)
