"""Where the lock database is, resolved into one immutable value (:class:`ConnectionSettings`).

The libpq parameters and what the connection declares about the path to the server
(``pool_mode``), from a DSN (:func:`from_dsn`) or, through the hook, from an Airflow
connection (``hooks/connection.py``). Nothing here opens a connection to PostgreSQL.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg

from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.identity import hook_application_name
from airflow_pglock.liveness import Liveness

#: How a server (or a pooler) refuses server settings in the start-up packet: PgBouncer without
#: ``ignore_startup_parameters = options``, or a server older than a setting (PostgreSQL 12/13).
STARTUP_OPTIONS_REFUSED = ("unsupported startup parameter", "unrecognized configuration parameter")

#: Server settings every connection of the provider sends in its start-up packet (libpq ``options``),
#: where they win over a role's or database's own (``ALTER ROLE/DATABASE ... SET``): timestamps and
#: intervals in the styles psycopg reads (it cannot read ``DateStyle = 'SQL, DMY'``, ``Postgres`` or
#: ``German``, nor another ``IntervalStyle``), and errors that end a statement, not the session
#: (``exit_on_error = on`` would end it at a wait that runs out, which is a busy key).
READABLE_SERVER_SETTINGS = {"DateStyle": "ISO", "IntervalStyle": "postgres", "exit_on_error": "off"}
#: libpq's ``client_encoding`` of every connection of the provider: text comes back as ``str``
#: whatever the database's or the role's encoding (``SQL_ASCII`` gives bytes), and a name the
#: database's encoding cannot hold is refused by the server (a ``psycopg.Error``), not by the
#: client's encoder. A pooler accepts it (PgBouncer tracks ``client_encoding``), unlike ``options``.
CLIENT_ENCODING = "UTF8"

_URI_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")
_KEYWORD_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with passwords in URIs (``://user:pw@``) and ``password=...`` replaced by ``***``.

    libpq repeats a malformed connection string word for word in its error message.
    """
    return _KEYWORD_PASSWORD.sub(r"\1***", _URI_PASSWORD.sub(r"\1***@", text))


#: How libpq and psycopg quote the part of a connection string they could not read.
_QUOTED = re.compile(r'"[^"]*"')
#: A connection string that may hold a password: a ``password`` keyword, or any URI (its user
#: part may hold one in several forms, ``user@server:pw@host`` among them, and its query may
#: name the keyword percent-encoded).
_HOLDS_PASSWORD = re.compile(r"password|://", re.IGNORECASE)


def redact_dsn_error(text: str, dsn: str) -> str:
    """The parser's message about the malformed ``dsn``, redacted: when ``dsn`` may hold a password,
    the parts the parser quoted are hidden too, since one may be a piece of the password that
    :func:`redact` cannot find (``missing "=" after "ret"`` for ``password=sec ret``,
    ``unexpected spaces found in "sec ret"`` for ``postgresql://user:sec ret@host``). When ``dsn``
    itself holds a ``"``, the quotes of the message cannot be paired: everything from the first
    to the last is hidden."""
    text = redact(text).strip()
    if _HOLDS_PASSWORD.search(dsn) is None or '"' not in text:
        return text
    if '"' in dsn:
        first, last = text.index('"'), text.rindex('"')
        hidden = f'{text[:first]}"***"{text[last + 1 :]}'
    else:
        hidden = _QUOTED.sub(_hide_unless_punctuation, text)
    return hidden if hidden == text else f"{hidden} (quoted parts hidden: the connection string may hold a password)"


def _hide_unless_punctuation(quoted: re.Match[str]) -> str:
    """A quoted part kept when it has no letter or digit (``"]"``, ``"="``); hidden otherwise, even
    when :func:`redact` found a password in it (a password with an unencoded ``@`` goes on past it)."""
    part = quoted.group(0)
    return part if not any(c.isalnum() for c in part) else '"***"'


#: The pooling modes a pooler may be declared with (PgBouncer's names); only ``"session"`` keeps session locks safe.
POOL_MODES = ("session", "transaction", "statement")


@dataclass(frozen=True)
class ConnectionSettings:
    """The lock database's connection, resolved once.

    :param params: libpq parameters (no liveness settings, no application_name).
    :param source: ``DSN`` or ``conn id 'x'``, for messages.
    :param pool_mode: the connection extra ``pool_mode`` (``"session"`` declares a pooler in
        session pooling, where session locks are safe); None when not declared.
    :param reusable: False when the parameters expire (an IAM token): resolve them for each connection.
    """

    params: Mapping[str, Any]
    source: str
    pool_mode: str | None = None
    reusable: bool = True

    def describe(self) -> str:
        """``'db' on host:port as user (conn id 'x')``; never the password."""
        return describe_params(self.params, self.source)

    def __repr__(self) -> str:  # never the password, wherever a traceback shows local variables
        return f"ConnectionSettings({self.describe()}, pool_mode={self.pool_mode!r}, reusable={self.reusable!r})"

    def session_params(
        self,
        application_name: str | None,
        liveness: Liveness,
        connect_timeout: int,
        *,
        server_settings: Mapping[str, str] | None = None,
        startup_options: bool = True,
    ) -> dict[str, Any]:
        """The libpq parameters of one connection of the provider: these, plus its name, liveness
        settings, ``client_encoding`` (:data:`CLIENT_ENCODING`) and, in the start-up packet,
        :data:`READABLE_SERVER_SETTINGS`.

        :param application_name: names the holder in ``pg_stat_activity``.
        :param liveness: the lease's client-side settings (keepalives, ``tcp_user_timeout``).
        :param connect_timeout: used when the connection sets none of its own.
        :param server_settings: server settings to send in the start-up packet (libpq
            ``options``, after the connection's own, so they win): no statement needed.
        :param startup_options: False: no server setting of the provider's in the start-up packet
            (the server or a pooler refused them); the connection's own ``options`` still go. None
            go either when the connection declares a pooler (``pool_mode``), which would refuse
            them or, configured to ignore them, drop them silently.
        """
        params = dict(self.params)
        params.setdefault("connect_timeout", connect_timeout)
        # The lease's keepalive settings win over the connection's extras: they bound how long
        # a dead peer goes unnoticed, and a looser extra would silently break that bound.
        params.update(liveness.client_settings())
        # So does the encoding: the provider reads text as str (an extra's would do for the work on
        # `lock.connection`, but not for the provider's own reads; the work gets str in UTF-8).
        params["client_encoding"] = CLIENT_ENCODING
        if application_name:
            params["application_name"] = application_name
        else:  # never anonymous: `locks` shows the provider, the program and its pid
            params.setdefault("application_name", hook_application_name())
        if startup_options and self.pool_mode is None:
            ours = " ".join(
                f"-c {name}={value}" for name, value in {**READABLE_SERVER_SETTINGS, **(server_settings or {})}.items()
            )
            params["options"] = f"{params['options']} {ours}" if params.get("options") else ours
        return params


def refused_startup_options(error: BaseException) -> bool:
    """Whether a failed connection attempt was refused for its start-up ``options``."""
    return any(phrase in str(error) for phrase in STARTUP_OPTIONS_REFUSED)


def describe_params(params: Mapping[str, Any], source: str) -> str:
    """``'db' on host:port as user (source)`` from libpq parameters; never the password."""
    host = shown_param("host", params.get("host")) or "local socket"
    port = params.get("port") or 5432
    database = shown_param("dbname", params.get("dbname")) or "(default database)"
    user = shown_param("user", params.get("user")) or "(default user)"
    return f"{database!r} on {host}:{port} as {user!r} ({source})"


#: The parameters a message names, where a password can land by mistake.
_SHOWN_PARAMS = ("host", "dbname", "user")


def shown_param(name: str, value: Any) -> Any:
    """A connection parameter as a message shows it. A password can be in the host, database or
    user field: a whole URI or keyword string pasted there (an Airflow connection's Host or Schema;
    Airflow masks its Password field only), or ``user:password@host`` typed into the Host field
    (a DSN URI whose host holds an ``@`` is refused: :func:`from_dsn`)."""
    if not isinstance(value, str):
        return value
    text = redact(value)
    if name == "host":
        text = ",".join(f"***@{part.rsplit('@', 1)[1]}" if "@" in part else part for part in text.split(","))
    return text


def redact_params(text: str, params: Mapping[str, Any]) -> str:
    """:func:`redact` of ``text``, a driver's message about connecting with ``params``, in which
    each host, database and user value shows as :func:`shown_param` shows it."""
    for name in _SHOWN_PARAMS:
        value = params.get(name)
        if not isinstance(value, str) or not value:
            continue
        for part in sorted({value, *value.split(",")} if name == "host" else {value}, key=len, reverse=True):
            hidden = shown_param(name, part)
            if part and hidden != part:
                text = text.replace(part, hidden)
    return redact(text)


def from_dsn(dsn: str) -> ConnectionSettings:
    """Settings from a libpq connection string or URI (checked, never echoed with its password)."""
    if not isinstance(dsn, str) or not dsn.strip():
        # "" is valid libpq: its defaults (PGHOST, a local socket, the OS user's database), maybe a
        # database nobody else locks in
        raise LockConfigurationError(
            f"the lock database's DSN must be a non-empty libpq connection string or URI, got {dsn!r}"
        )
    return _parsed_dsn(dsn)


#: The parameters of a URI that never hold an ``@`` of their own.
_NO_AT_IN_A_URI = ("host", "hostaddr", "port", "dbname")


@functools.lru_cache(maxsize=32)
def _parsed_dsn(dsn: str) -> ConnectionSettings:
    """Cached: a DSN's settings never change, and parsing it was a measurable share of a short
    guarded execution's CPU (the settings are immutable; ``session_params`` copies them)."""
    try:
        params = dict(psycopg.conninfo.conninfo_to_dict(dsn))
    except psycopg.ProgrammingError as error:
        raise LockConfigurationError(
            f"invalid DSN for the lock database: {redact_dsn_error(str(error), dsn)}"
        ) from None
    unencoded_ats = dsn.split("?", 1)[0].count("@")  # a database named with %40 is fine
    if "://" in dsn and unencoded_ats > 1 and any("@" in str(params.get(name) or "") for name in _NO_AT_IN_A_URI):
        # libpq ends the user part at the first @: the rest of a password with an unencoded @ is
        # read as the host, the port or the database, and would be shown wherever they are
        raise LockConfigurationError(
            "invalid DSN for the lock database: its host, port or database holds an '@', as when a password "
            "holds an unencoded '@' (libpq ends the user part at the first one); percent-encode '@' in the user "
            "or password as %40 (the DSN is not shown: it may hold a password)"
        )
    return ConnectionSettings(params=params, source="DSN")
