"""Helpers of the operations tests (CLI, registry, doctor, metrics, UI page); no fixtures here."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

VENV_BIN = Path(sys.executable).parent
PROCESS_CONTEXT = "_AIRFLOW_PROCESS_CONTEXT"


@contextlib.contextmanager
def scratch_database(server_dsn: str, prefix: str = "pglock_ops") -> Iterator[str]:
    """A database of its own (so init-db never touches the shared test database); dropped after."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(server_dsn)
    info["dbname"] = name
    try:
        yield psycopg.conninfo.make_conninfo(**info)
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                [name],
            )
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def dsn_uri(dsn: str) -> str:
    """The ``postgresql://`` URI of a key=value DSN (what AIRFLOW_CONN_* wants)."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    user = info.get("user", "postgres")
    return f"postgresql://{user}@{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}/{info['dbname']}"


def with_user(dsn: str, user: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["user"] = user
    return psycopg.conninfo.make_conninfo(**info)


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def run_cli(*argv: str, capsys: Any) -> CliResult:
    """``airflow-pglock ARGV`` in this process (stdout captured, stderr through capsys)."""
    from airflow_pglock.cli.main import main

    capsys.readouterr()
    out = io.StringIO()
    context = os.environ.get(PROCESS_CONTEXT)
    try:
        code = main(list(argv), out=out)
    finally:  # the CLI declares its (one-shot) process a server process: undo it for the next tests
        if context is None:
            os.environ.pop(PROCESS_CONTEXT, None)
        else:
            os.environ[PROCESS_CONTEXT] = context
    return CliResult(code, out.getvalue(), capsys.readouterr().err)


def run_console_script(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> CliResult:
    """The installed ``airflow-pglock`` console script, in a new process."""
    result = subprocess.run(
        [str(VENV_BIN / "airflow-pglock"), *argv], capture_output=True, text=True, env=env, timeout=timeout
    )
    return CliResult(result.returncode, result.stdout, result.stderr)


def hold(dsn: str, numbers: tuple[int, ...], application_name: str = "psql") -> psycopg.Connection[Any]:
    """A plain session (as psql would be) holding a session-level advisory lock; close it to release."""
    conn = psycopg.connect(dsn, autocommit=True, application_name=application_name)
    placeholders = ", ".join(["%s"] * len(numbers))
    conn.execute(f"SELECT pg_advisory_lock({placeholders})", list(numbers))  # type: ignore[arg-type]
    return conn
