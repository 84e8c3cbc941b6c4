"""What every ``airflow-pglock`` command shares: exit codes, the error that carries one, the hook
the command works through, and the table and JSON output."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from airflow_pglock.display import printable
from airflow_pglock.hooks import DEFAULT_CONN_ID

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_CONFIG = 3
EXIT_DATABASE = 4

PROG = "airflow-pglock"


class CliError(Exception):
    """An error the CLI reports on one line and turns into an exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def hook_from_args(args: argparse.Namespace, lease: float | None = None) -> Any:
    from airflow_pglock.compat import use_server_connections
    from airflow_pglock.exceptions import LockConfigurationError
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.liveness import Liveness

    if args.dsn is not None and args.conn_id is not None:
        raise CliError("give either --conn-id or --dsn, not both", EXIT_USAGE)
    liveness = None
    if lease is not None:
        try:
            liveness = Liveness(lease)
        except ValueError as error:
            raise CliError(f"--lease: {error}", EXIT_CONFIG) from None
    pool_mode = getattr(args, "pool_mode", None)
    try:
        if args.dsn is not None:
            if not args.dsn.strip():
                raise CliError("--dsn is empty; give a libpq connection string or URI", EXIT_CONFIG)
            hook = AdvisoryLockHook(dsn=args.dsn, liveness=liveness, pool_mode=pool_mode)
        else:
            use_server_connections()  # like `airflow connections get`: read the metadata database too
            if args.conn_id is not None and not args.conn_id.strip():  # an unset shell variable: never the default
                raise CliError(f"--conn-id is empty ({args.conn_id!r}); give an Airflow connection id", EXIT_CONFIG)
            conn_id = args.conn_id or os.environ.get("PGLOCK_CONN_ID") or DEFAULT_CONN_ID
            hook = AdvisoryLockHook(conn_id, liveness=liveness, pool_mode=pool_mode)
    except LockConfigurationError as error:
        raise CliError(str(error), EXIT_CONFIG) from None
    try:
        hook.resolve_settings()  # a bad DSN or an unknown conn id fails here, before any work
    except LockConfigurationError as error:
        raise CliError(str(error), EXIT_CONFIG) from None
    return hook


def print_json(data: Any, out: TextIO) -> None:
    json.dump(data, out, indent=2, sort_keys=False, default=str)
    out.write("\n")


#: The widest a cell of a table is shown (a longer one ends with ``~``): a key name or a row's text
#: is anyone's, and every row is padded to the widest cell of its column.
LONGEST_CELL = 120


def _cell(text: str) -> str:
    shown = printable(text)
    return shown if len(shown) <= LONGEST_CELL else shown[: LONGEST_CELL - 1] + "~"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    """``rows`` under ``headers``, in columns; every cell escaped and cut to :data:`LONGEST_CELL`."""
    rows = [[_cell(cell) for cell in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out.write(line.rstrip() + "\n")
    for row in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")


def human_duration(seconds: float | None) -> str:
    """``4.2s``, ``12m05s``, ``3h02m``, ``2d04h``: how long, at a glance."""
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def note(message: str) -> None:
    """A remark on stderr (the results on stdout stay machine-readable)."""
    sys.stderr.write(f"{PROG}: note: {message}\n")


def parse_int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CliError(f"{what} must be an integer, got {text!r}", EXIT_CONFIG) from None
