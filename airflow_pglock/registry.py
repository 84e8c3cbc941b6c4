"""Record a key's name with the release of a guarded execution's lock, and report collisions.

The key-name registry (``pglock.key_names``, created by ``airflow-pglock init-db``) is
optional: when it is missing, or the role may not write it, the task goes on exactly as
without it. What "a collision is reported" means:

* the release logs a WARNING naming both names, the key's numbers and what to do
  (the task ran: the two names already shared one lock before anyone looked);
* ``airflow-pglock locks`` and the UI page show every name of the key and mark it;
* ``airflow-pglock doctor`` reports a ``registry`` problem (exit code 1).
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from airflow_pglock.keys import LockKey
from airflow_pglock.pg.held import HeldLock
from airflow_pglock.pg.key_names import record_key_name, record_key_name_statement, registry_schema_present
from airflow_pglock.pg.release import AT_RELEASE_LOCK_TIMEOUT, BOUND_ERRORS, WriteAtRelease
from airflow_pglock.pg.sql import inline

log = logging.getLogger("airflow_pglock")


def record_acquisition(
    held: HeldLock, application_name: str | None, logger: logging.Logger | Any = None, slots: int = 1
) -> None:
    """Have the name of ``held.key`` recorded with the lock's release; warn of a collision then.

    The lock statement said whether the registry's schema is there (``held.registry``): when
    it is not (the default), nothing happens. When it is, the write costs no round trip: it
    travels with the release (before the unlock, or with the commit in transaction mode, in a
    savepoint there), so it never delays the work; the name is recorded, and a collision
    reported, when the hold ends. It never holds the release up either: it waits at most
    ``AT_RELEASE_LOCK_TIMEOUT`` for a lock (another transaction writing the registry), then
    is skipped with a warning naming the key. A write that fails there (this role may not use the
    registry) is logged as a warning, never silently lost and never failing the task (the
    registry is optional); before init-db version 4, a pool's slot is recorded by its name
    alone. A lock that is lost, or a transaction that rolls back, records nothing: the next
    hold does.

    :param held: the lock just taken (its connection runs the write).
    :param application_name: recorded as who used the name first.
    :param logger: where the collision warning goes (the task log).
    :param slots: the size of the pool ``held.key`` is a slot of (1: a plain key), recorded
        with the name so that ``locks`` can show the pool as one row.
    """
    logger = logger or log
    if held.key.name is None or not registry_schema_present(held.registry):
        return
    key = held.key

    def report(outcome: list[str] | BaseException) -> None:
        _report(key, outcome, logger)

    def failed(conn: psycopg.Connection[Any], error: psycopg.Error) -> None:
        if slots > 1 and isinstance(error, psycopg.errors.UndefinedColumn):
            try:  # init-db before version 4 has no slots column: record the name alone
                others = record_key_name(conn, key, application_name, 1, installed=True)
            except Exception as again:  # the registry is optional: never fail a task that held its lock
                report(again)
            else:
                report(others or [])
        else:
            report(error)

    try:  # binding the name client-side can fail too (a client encoding that cannot hold it)
        statement, params = record_key_name_statement(key, application_name, slots)
        write = inline(held.connection, statement, params)
        encoding = _encoding_not_holding(held.connection, write)
    except Exception as error:  # the registry is optional: never fail a task that holds its lock
        report(error)
        return
    if encoding is not None:
        # Not sent: the server converts a whole message before it runs any of it, so the unlock or
        # the COMMIT sent with this write would fail with it.
        logger.warning(
            "pglock does not record the name of %s in the key-name registry: the lock database's encoding (%s) "
            "cannot hold it. The lock is held and the task goes on",
            key.describe(),
            encoding,
        )
        return
    held.at_release = WriteAtRelease(statement=write, done=lambda rows: report([row[0] for row in rows]), failed=failed)


def _encoding_not_holding(conn: psycopg.Connection[Any], text: str) -> str | None:
    """The server's encoding when it cannot hold ``text`` (a ``LATIN1`` database and a name in
    Japanese), else None. ASCII fits every server encoding; one Python has no codec for holds ASCII only."""
    if text.isascii():
        return None
    encoding = conn.info.parameter_status("server_encoding") or "UTF8"  # reported in the handshake
    if encoding in ("UTF8", "SQL_ASCII"):  # SQL_ASCII stores the client's bytes as they come
        return None
    try:
        # PostgreSQL's encoding names to Python's codecs: psycopg's table (a private module, so it may
        # move in a later psycopg: then only ASCII names are recorded on such a server).
        from psycopg._encodings import pg2pyenc

        text.encode(pg2pyenc(encoding.encode()))
    except (ImportError, psycopg.NotSupportedError, UnicodeEncodeError, LookupError):
        return encoding
    return None


def _report(key: LockKey, outcome: list[str] | BaseException, logger: logging.Logger | Any) -> None:
    if isinstance(outcome, BOUND_ERRORS):
        logger.warning(
            "pglock skipped recording the name of %s in the key-name registry: the write waited longer than %s for "
            "a lock on pglock.key_names (%s: %s). Another transaction holds its row or the table: an UPDATE not yet "
            "committed in a manual-commit client (psql with AUTOCOMMIT off, a GUI), or an init-db waiting behind a "
            "reader. The lock was released as usual; a later hold records the name",
            key.describe(),
            AT_RELEASE_LOCK_TIMEOUT,
            type(outcome).__name__,
            str(outcome).strip(),
        )
        return
    if isinstance(outcome, BaseException):
        logger.warning(
            "pglock could not record the name of %s in the key-name registry (%s: %s); the lock is held and the "
            "task goes on. Grant the role access with `airflow-pglock init-db --grant <role>`",
            key.describe(),
            type(outcome).__name__,
            str(outcome).strip(),
        )
        return
    if outcome:
        logger.warning(
            "pglock KEY COLLISION: %s is also used under the name(s) %s (pg_locks %s): these jobs share one lock "
            "and exclude each other. Give one of them another key name",
            key.describe(),
            ", ".join(repr(name) for name in outcome),
            ", ".join(str(part) for part in key.pg_locks),
        )
