"""Who holds a lock: the ``application_name`` of a lock connection, built and parsed.

Pure module. Format (printable ASCII, at most 63 bytes, PostgreSQL's limit)::

    pglock:<deployment>@<host> <dag_id> <task_id>[#<map_index>] <run_id>
    pglock-hook:<deployment>@<host> <program> pid <pid>

``<deployment>@<host>`` is just ``<host>`` when the deployment has no name of its own
(``[pglock] deployment`` unset: it is then the host). Airflow ids never contain spaces or
``@``, so the parts split unambiguously; the run id is last because it may hold spaces.

When the whole does not fit, parts are shortened in a fixed order (a long deployment
name or host and the host's domain first, then the run id, then the task and the DAG
ids, which ``locks --dag`` and key names derived from them need whole), each down to a
floor. A shortened run id keeps its beginning (an
Airflow run id's timestamp in ISO basic form, ``man__20261201T191446``) and ends with
``~`` and the first 6 hex digits of the SHA-256 of the full run id, so two runs never
look alike (``printf %s RUN_ID | sha256sum`` finds the run). A shortened host keeps its
end (where pod names differ) and starts with ``~``; other shortened parts end with ``~``.

Sessions of earlier provider versions named themselves ``pglock <dag> <task> <run>`` and
``pglock-hook <program> pid <pid> on <host>``: :func:`parse_application_name` and
:func:`parse_hook_name` still read those (no deployment then), so ``locks`` names them
during an upgrade.

No secret ever goes in here: only the deployment name, host, DAG, task and run ids.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import sys
from dataclasses import dataclass

from airflow_pglock.exceptions import LockConfigurationError

PREFIX = "pglock"
#: Prefix of the application_name of a lock taken through the hook without one.
HOOK_PREFIX = "pglock-hook"
#: Joins the prefix to ``<deployment>@<host>`` in the current format (older ones used a space).
WHERE_SEPARATOR = ":"
MAX_APPLICATION_NAME_BYTES = 63
TRUNCATION_MARK = "~"
#: Hex digits of SHA-256(full run id) that end a shortened run id.
RUN_DIGEST_CHARS = 6
_RUN_ID_ABBREVIATIONS = (
    ("scheduled__", "sch__"),
    ("manual__", "man__"),
    ("backfill__", "bf__"),
    ("asset_triggered__", "at__"),
)
# Parts of a task session's name, in the order they appear.
_DEPLOYMENT, _HOST, _DAG, _TASK, _RUN = range(5)
# (part, floor): shortened in this order, each at most down to its floor, until it fits.
_SHORTENING_STAGES = (
    (_DEPLOYMENT, 20),
    (_HOST, 20),
    (_RUN, 25),  # man__20261201T1914~<digest>: to the minute
    (_RUN, 20),  # man__20261201~<digest>: the day
    (_RUN, 14),  # man__20~<digest>: unique still; the DAG and task ids are worth more (filters, key names)
    (_TASK, 12),
    (_DAG, 12),
    (_TASK, 8),
    (_DAG, 8),
    (_HOST, 8),
    (_DEPLOYMENT, 8),
)
# A run id of Airflow's own form, <type>__<ISO timestamp>: shortened, its timestamp is
# written in ISO basic form (20261201T191446), which says the same in fewer bytes.
# Compiled at first use (re caches it), not when a DAG file is parsed.
_ISO_RUN_ID = r"^(\w+__)(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})"


def _ascii(text: str) -> str:
    return "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in text)


def name_token(text: str) -> str:
    """``text`` as an application_name spells a deployment, host, DAG or task: ASCII, no spaces, no ``@``."""
    return _ascii(text).replace(" ", "_").replace("@", "_")


_token = name_token


def run_digest(run_id: str) -> str:
    """The first hex digits of SHA-256(``run_id``): what ends a shortened run id."""
    return hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:RUN_DIGEST_CHARS]


def _abbreviate_run(run_id: str) -> str:
    run = _ascii(run_id)
    for long, short in _RUN_ID_ABBREVIATIONS:
        if run.startswith(long):
            return short + run[len(long) :]
    return run


def _expand_run(run: str) -> str:
    for long, short in _RUN_ID_ABBREVIATIONS:
        if run.startswith(short):
            return long + run[len(short) :]
    return run


def _shorten(part: int, text: str, room: int, run_id: str) -> str:
    if len(text) <= room:
        return text
    if part == _RUN:  # stays unique: the digest of the full run id
        iso = re.match(_ISO_RUN_ID, text)
        if iso is not None:
            text = iso.group(1) + "".join(iso.groups()[1:4]) + "T" + "".join(iso.groups()[4:])
        return text[: max(1, room - 1 - RUN_DIGEST_CHARS)] + TRUNCATION_MARK + run_digest(run_id)
    if part == _HOST:  # pod and worker names differ at their end
        return TRUNCATION_MARK + text[len(text) - max(1, room - 1) :]
    return text[: max(1, room - 1)] + TRUNCATION_MARK


def _where(deployment: str | None, host: str) -> str:
    return host if not deployment or deployment == host else f"{deployment}@{host}"


def default_host() -> str:
    """This machine's host name (what ``socket.gethostname()`` says)."""
    return socket.gethostname() or "localhost"


@dataclass(frozen=True)
class TaskIdentity:
    """The Airflow task instance behind a lock connection, and where it runs.

    :param dag_id: the DAG id.
    :param task_id: the task id.
    :param run_id: the DAG run id.
    :param map_index: the map index of a mapped task instance, -1 if not mapped.
    :param deployment: the deployment's name (``[pglock] deployment``); None: unnamed (the host).
    :param host: the host the task runs on (None: this machine's).
    """

    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1
    deployment: str | None = None
    host: str | None = None

    def application_name(self) -> str:
        host = _token(self.host or default_host())
        deployment = _token(self.deployment) if self.deployment else None
        if deployment == host:
            deployment = None
        parts = [deployment or "", host, _token(self.dag_id), _token(self.task_id), _abbreviate_run(self.run_id)]
        map_suffix = f"#{self.map_index}" if self.map_index >= 0 else ""  # never shortened away

        def render(texts: list[str]) -> str:
            where = _where(texts[_DEPLOYMENT], texts[_HOST])
            return f"{PREFIX}{WHERE_SEPARATOR}{where} {texts[_DAG]} {texts[_TASK]}{map_suffix} {texts[_RUN]}"

        if len(render(parts)) > MAX_APPLICATION_NAME_BYTES and "." in host:  # the domain goes first
            parts[_HOST] = host.split(".", 1)[0] or host
        shown = list(parts)
        for part, floor in _SHORTENING_STAGES:
            overflow = len(render(shown)) - MAX_APPLICATION_NAME_BYTES
            if overflow <= 0:
                break
            room = max(floor, len(shown[part]) - overflow)
            if room < len(shown[part]):  # always from the whole part, so each form is the same
                shown[part] = _shorten(part, parts[part], room, self.run_id)
        return render(shown)[:MAX_APPLICATION_NAME_BYTES]  # a last resort, never reached with sane ids


@dataclass(frozen=True)
class ParsedApplicationName(TaskIdentity):
    """What an airflow-pglock ``application_name`` says about a holder: the task identity it was
    built from, as far as it can be read back.

    Parts may be shortened (they then contain ``~``; a shortened run id ends with
    ``~`` and :func:`run_digest` of the full one). ``deployment`` and ``host`` are None for a
    session named by a provider version older than the deployment identity.
    """

    @property
    def where(self) -> str | None:
        """``deployment@host`` (just ``host`` when the deployment is unnamed); None if unknown."""
        return None if self.host is None else _where(self.deployment, self.host)


@dataclass(frozen=True)
class ParsedHookName:
    """What a hook lock session's ``application_name`` says (``pglock-hook ...``).

    :param program: the program's file name (may be shortened: ``~``).
    :param pid: the client process id, if the name carries it.
    :param deployment: the deployment (the host when unnamed); None when unknown.
    :param host: the host; None when unknown.
    """

    program: str
    pid: int | None
    deployment: str | None
    host: str | None

    @property
    def where(self) -> str | None:
        return None if self.host is None else _where(self.deployment, self.host)


def check_application_name(application_name: object) -> None:
    """Refuse a caller's ``application_name`` that is not a string, or holds a NUL (None: the default)."""
    if application_name is not None and (not isinstance(application_name, str) or "\x00" in application_name):
        raise LockConfigurationError(
            f"application_name must be a string without NUL characters, or None, got {application_name!r}"
        )


def hook_application_name(deployment: str | None = None, host: str | None = None) -> str:
    """``pglock-hook:<deployment>@<host> <program> pid <pid>``: a hook lock session, when its caller names none.

    Only the program's file name, the pid, the host and the deployment's name: never
    arguments or environment (where secrets live). Shortened to PostgreSQL's 63 bytes:
    the program first, then the host, then the deployment.

    :param deployment: the deployment's name (None: unnamed, the host stands for it).
    :param host: the host (None: this machine's).
    """
    program = _token(os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python")
    host_token = _token(host or default_host())
    deployment_token = _token(deployment) if deployment else ""
    tail = f" pid {os.getpid()}"
    head = f"{HOOK_PREFIX}{WHERE_SEPARATOR}"
    where_room = MAX_APPLICATION_NAME_BYTES - len(head) - len(tail) - 1 - 8  # at least 8 for the program
    if len(_where(deployment_token, host_token)) > where_room and "." in host_token:
        host_token = host_token.split(".", 1)[0] or host_token
    for part, floor in ((_HOST, 20), (_DEPLOYMENT, 20), (_HOST, 8), (_DEPLOYMENT, 8)):
        overflow = len(_where(deployment_token, host_token)) - where_room
        if overflow <= 0:
            break
        text = host_token if part == _HOST else deployment_token
        room = max(floor, len(text) - overflow)
        if room < len(text):
            if part == _HOST:
                host_token = _shorten(_HOST, text, room, "")
            else:
                deployment_token = _shorten(_DEPLOYMENT, text, room, "")
    where = _where(deployment_token, host_token)
    room = MAX_APPLICATION_NAME_BYTES - len(head) - len(where) - 1 - len(tail)
    if len(program) > room:
        program = program[: max(1, room - len(TRUNCATION_MARK))] + TRUNCATION_MARK
    return f"{head}{where} {program}{tail}"[:MAX_APPLICATION_NAME_BYTES]


#: application_name of a triggerer's session that holds the keys of deferred guarded operators.
DEFERRED_HOLDS_APPLICATION_NAME = "airflow-pglock deferred holds"


def is_provider_session(application_name: str | None) -> bool:
    """True for an airflow-pglock lock session: a guarded task's or a hook's (one session per lock)."""
    return parse_application_name(application_name) is not None or parse_hook_name(application_name) is not None


def _split_where(token: str) -> tuple[str | None, str]:
    deployment, at, host = token.partition("@")
    return (deployment or None, host) if at else (token, token)


def parse_application_name(application_name: str | None) -> ParsedApplicationName | None:
    """The deployment, host, DAG, task and run in an airflow-pglock task ``application_name``.

    Reads the current format and the one before it (``pglock <dag> <task> <run>``, no
    deployment); None for any other application.
    """
    if not application_name:
        return None
    deployment: str | None = None
    host: str | None = None
    if application_name.startswith(PREFIX + WHERE_SEPARATOR):
        parts = application_name[len(PREFIX) + 1 :].split(" ", 3)
        if len(parts) != 4 or not parts[0]:
            return None
        where, dag, task, run = parts
        deployment, host = _split_where(where)
    elif application_name.startswith(PREFIX + " "):  # provider versions before the deployment identity
        parts = application_name.split(" ", 3)
        if len(parts) != 4:
            return None
        _, dag, task, run = parts
    else:
        return None
    map_index = -1
    if "#" in task:
        task, _, index_text = task.rpartition("#")
        map_index = int(index_text) if index_text.isdigit() else -1
    return ParsedApplicationName(
        dag_id=dag, task_id=task, run_id=_expand_run(run), map_index=map_index, deployment=deployment, host=host
    )


def parse_hook_name(application_name: str | None) -> ParsedHookName | None:
    """The program, pid, deployment and host of a hook lock session; None for others.

    Reads ``pglock-hook:<deployment>@<host> <program> pid <pid>`` and the older
    ``pglock-hook <program> pid <pid> on <host>``.
    """
    if not application_name:
        return None
    if application_name.startswith(HOOK_PREFIX + WHERE_SEPARATOR):
        where, _, rest = application_name[len(HOOK_PREFIX) + 1 :].partition(" ")
        if not where:
            return None
        deployment, host = _split_where(where)
        program, _, pid_text = rest.partition(" pid ")
        return ParsedHookName(program, int(pid_text) if pid_text.isdigit() else None, deployment, host)
    if application_name.startswith(HOOK_PREFIX + " "):
        rest = application_name[len(HOOK_PREFIX) + 1 :]
        program, _, tail = rest.partition(" pid ")
        pid_text, _, old_host = tail.partition(" on ")
        return ParsedHookName(program, int(pid_text) if pid_text.isdigit() else None, None, old_host or None)
    return None


def holder_where(application_name: str | None) -> tuple[str | None, str | None]:
    """``(deployment, host)`` of any airflow-pglock session (task or hook); ``(None, None)`` if unknown.

    The deployment is None when the session names none (an older provider version).
    """
    parsed = parse_application_name(application_name)
    if parsed is not None:
        return parsed.deployment, parsed.host
    hook = parse_hook_name(application_name)
    if hook is not None:
        return hook.deployment, hook.host
    return None, None
