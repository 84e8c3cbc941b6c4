"""Record a key's name when a guarded execution takes it, and report collisions.

The key-name registry (``pglock.key_names``, created by ``airflow-pglock init-db``) is
optional: when it is missing, or the role may not write it, the task goes on exactly as
without it. What "a collision is reported" means:

* the acquisition logs a WARNING naming both names, the key's numbers and what to do
  (the task still runs: the two names already shared one lock before anyone looked);
* ``airflow-pglock locks`` and the UI page show every name of the key and mark it;
* ``airflow-pglock doctor`` reports a ``registry`` problem (exit code 1).
"""

from __future__ import annotations

import logging
from typing import Any

from psycopg.errors import InsufficientPrivilege

from airflow_pglock.hooks.advisory_lock import HeldLock
from airflow_pglock.hooks.schema import REGISTRY_NO_ACCESS, REGISTRY_READY, record_key_name
from airflow_pglock.keys import LockKey

log = logging.getLogger("airflow_pglock")


def record_acquisition(
    held: HeldLock, application_name: str | None, logger: logging.Logger | Any = None, slots: int = 1
) -> None:
    """Record the name of ``held.key`` on its own connection; warn of a collision.

    The lock statement said whether the registry is there (``held.registry``): when it is
    not (the default), nothing happens and no statement runs; when the role may not use it,
    a warning says so, without a statement either. Only an installed, usable registry costs
    a round trip: the write (in a savepoint in transaction mode, so that an error cannot
    abort the lock's transaction). Never raises: the registry is optional.

    :param held: the lock just taken (its connection runs the insert).
    :param application_name: recorded as who used the name first.
    :param logger: where the collision warning goes (the task log).
    :param slots: the size of the pool ``held.key`` is a slot of (1: a plain key), recorded
        with the name so that ``locks`` can show the pool as one row.
    """
    logger = logger or log
    if held.key.name is None or held.registry is None or held.registry == "absent":
        return
    key = held.key

    def report(outcome: list[str] | BaseException) -> None:
        _report(key, outcome, logger)

    if held.registry in REGISTRY_NO_ACCESS:
        problem = f"the registry is installed, but this role has {REGISTRY_NO_ACCESS[held.registry]}"
        report(InsufficientPrivilege(problem))  # what the write would have raised, without a statement
    elif held.registry != REGISTRY_READY:
        report(ValueError(f"unknown registry state {held.registry!r}"))
    else:
        try:
            others = record_key_name(held.connection, key, application_name, slots, installed=True)
        except Exception as error:  # the registry is optional: never fail a task that holds its lock
            report(error)
        else:
            report(others or [])


def _report(key: LockKey, outcome: list[str] | BaseException, logger: logging.Logger | Any) -> None:
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
