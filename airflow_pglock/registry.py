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

from airflow_pglock.hooks.advisory_lock import HeldLock
from airflow_pglock.hooks.schema import record_key_name

log = logging.getLogger("airflow_pglock")


def record_acquisition(
    held: HeldLock, application_name: str | None, logger: logging.Logger | Any = None, slots: int = 1
) -> list[str]:
    """Record the name of ``held.key`` on its own connection; return the other names of that key.

    Never raises: a missing table is silently skipped; a missing privilege or any other
    error is logged as a warning and the task goes on.

    :param held: the lock just taken (its connection runs the insert).
    :param application_name: recorded as who used the name first.
    :param logger: where the collision warning goes (the task log).
    :param slots: the size of the pool ``held.key`` is a slot of (1: a plain key), recorded
        with the name so that ``locks`` can show the pool as one row.
    """
    logger = logger or log
    if held.key.name is None:
        return []
    try:
        others = record_key_name(held.connection, held.key, application_name, slots)
    except Exception as error:  # the registry is optional: never fail a task that holds its lock
        logger.warning(
            "pglock could not record the name of %s in the key-name registry (%s: %s); the lock is held and the "
            "task goes on. Grant the role access with `airflow-pglock init-db --grant <role>`",
            held.key.describe(),
            type(error).__name__,
            str(error).strip(),
        )
        return []
    if not others:
        return []
    logger.warning(
        "pglock KEY COLLISION: %s is also used under the name(s) %s (pg_locks %s): these jobs share one lock and "
        "exclude each other. Give one of them another key name",
        held.key.describe(),
        ", ".join(repr(name) for name in others),
        ", ".join(str(part) for part in held.key.pg_locks),
    )
    return others
