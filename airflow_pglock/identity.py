"""Who holds a lock: the ``application_name`` of a lock connection, built and parsed.

Pure module. Format (printable ASCII, at most 63 bytes, PostgreSQL's limit)::

    pglock <dag_id> <task_id>[#<map_index>] <run_id>

Airflow ids never contain spaces, so the parts split unambiguously; the run id is last
because it may. A part shortened to fit ends with ``~``. No secret ever goes in here:
only DAG, task and run ids.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

PREFIX = "pglock"
#: Prefix of the application_name of a lock taken through the hook without one.
HOOK_PREFIX = "pglock-hook"
MAX_APPLICATION_NAME_BYTES = 63
TRUNCATION_MARK = "~"
_RUN_ID_ABBREVIATIONS = (
    ("scheduled__", "sch__"),
    ("manual__", "man__"),
    ("backfill__", "bf__"),
    ("asset_triggered__", "at__"),
)


def _ascii(text: str) -> str:
    return "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in text)


@dataclass(frozen=True)
class TaskIdentity:
    """The Airflow task instance behind a lock connection.

    :param dag_id: the DAG id.
    :param task_id: the task id.
    :param run_id: the DAG run id.
    :param map_index: the map index of a mapped task instance, -1 if not mapped.
    """

    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1

    def application_name(self) -> str:
        dag = _ascii(self.dag_id).replace(" ", "_")
        task = _ascii(self.task_id).replace(" ", "_")
        map_suffix = f"#{self.map_index}" if self.map_index >= 0 else ""  # never shortened away
        run = _ascii(self.run_id)
        for long, short in _RUN_ID_ABBREVIATIONS:
            if run.startswith(long):
                run = short + run[len(long) :]
        parts = [dag, task, run]
        overflow = len(" ".join([PREFIX, *parts])) + len(map_suffix) - MAX_APPLICATION_NAME_BYTES
        # Shorten the run id first, then the task, then the DAG, keeping at least 8 chars each.
        for index in (2, 1, 0):
            if overflow <= 0:
                break
            part = parts[index]
            keep = max(8, len(part) - overflow - len(TRUNCATION_MARK))
            if keep < len(part):
                overflow -= len(part) - keep - len(TRUNCATION_MARK)
                parts[index] = part[:keep] + TRUNCATION_MARK
        parts[1] += map_suffix
        return " ".join([PREFIX, *parts])[:MAX_APPLICATION_NAME_BYTES]


@dataclass(frozen=True)
class ParsedApplicationName:
    """What an ``application_name`` says about a holder (parts may be shortened: ``~``)."""

    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1


def hook_application_name() -> str:
    """``pglock-hook <program> pid <pid> on <host>``: a hook lock session, when its caller names none.

    Only the program's file name, the pid and the host name: never arguments or environment
    (where secrets live). Shortened to PostgreSQL's 63 bytes, program first.
    """
    program = _ascii(os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python").replace(" ", "_")
    tail = f" pid {os.getpid()} on {_ascii(socket.gethostname()).replace(' ', '_')}"
    room = MAX_APPLICATION_NAME_BYTES - len(HOOK_PREFIX) - 1 - len(tail)
    if len(program) > room:
        program = program[: max(1, room - len(TRUNCATION_MARK))] + TRUNCATION_MARK
    return f"{HOOK_PREFIX} {program}{tail}"[:MAX_APPLICATION_NAME_BYTES]


def is_provider_session(application_name: str | None) -> bool:
    """True for an airflow-pglock lock session: a guarded task's or a hook's (one session per lock)."""
    return parse_application_name(application_name) is not None or bool(
        application_name and application_name.startswith(HOOK_PREFIX + " ")
    )


def parse_application_name(application_name: str | None) -> ParsedApplicationName | None:
    """The DAG, task and run in an airflow-pglock ``application_name``; None for others."""
    if not application_name or not application_name.startswith(PREFIX + " "):
        return None
    parts = application_name.split(" ", 3)
    if len(parts) != 4:
        return None
    _, dag, task, run = parts
    map_index = -1
    if "#" in task:
        task, _, index_text = task.rpartition("#")
        map_index = int(index_text) if index_text.isdigit() else -1
    for long, short in _RUN_ID_ABBREVIATIONS:
        if run.startswith(short):
            run = long + run[len(short) :]
    return ParsedApplicationName(dag_id=dag, task_id=task, run_id=run, map_index=map_index)
