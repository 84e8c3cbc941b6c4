"""``airflow-pglock``: which jobs hold locks, what a key is, whether the set-up is safe.

    airflow-pglock locks   [--dag DAG] [--key KEY] [--all-databases]
    airflow-pglock key     [NAME] [--tenant T] [--dag D --task T [--dags-folder P]] [--int N | --pair A B] [--verify]
    airflow-pglock doctor  [--lease SECONDS] [--strict]
    airflow-pglock init-db [--grant ROLE ...] [--status]

Every command takes ``--conn-id ID`` (an Airflow connection, default ``postgres_default``)
or ``--dsn DSN``, and ``--output table|json``. The same commands run as ``airflow pglock
...`` on Airflow >= 3.2. This module only parses arguments and formats: the SQL is in the
hook layer (``airflow_pglock.hooks``).

Exit codes (see docs/operations.md):

* 0 - done; ``doctor``: no problem (notes allowed; warnings too, unless ``--strict``)
* 1 - ``doctor`` found a problem (or a warning, with ``--strict``); ``key --verify``: the
  server computed another key
* 2 - usage error (unknown option, missing argument)
* 3 - configuration error: bad DSN, unknown or non-Postgres conn id, invalid key
* 4 - the database could not be reached or refused the work (login, privileges, SQL error)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from airflow_pglock.cli.common import EXIT_CONFIG, EXIT_DATABASE, PROG, CliError
from airflow_pglock.cli.database import cmd_doctor, cmd_init_db
from airflow_pglock.cli.key import cmd_key
from airflow_pglock.cli.locks import cmd_locks
from airflow_pglock.hooks import DEFAULT_CONN_ID

ArgSpec = tuple[tuple[str, ...], dict[str, Any]]

ARGS: dict[str, ArgSpec] = {
    "conn_id": (
        ("--conn-id",),
        {
            "help": f"Airflow connection of the lock database (default {DEFAULT_CONN_ID})",
            "default": None,
            "metavar": "ID",
        },
    ),
    "dsn": (("--dsn",), {"help": "libpq connection string or URI instead of --conn-id", "metavar": "DSN"}),
    "output": (
        ("--output",),
        {"help": "table (for people, default) or json (for scripts)", "choices": ("table", "json"), "default": "table"},
    ),
    "locks_dag": (
        ("--dag",),
        {"help": "only keys that a task of this DAG holds or awaits", "metavar": "DAG_ID", "dest": "dag"},
    ),
    "locks_key": (
        ("--key",),
        {"help": "only this key: a name, an int64, or A,B for an int32 pair", "metavar": "KEY", "dest": "key"},
    ),
    "locks_pool": (
        ("--pool",),
        {"help": "only the slots of this pool (slots=N): one line 'K of N held' and its holders", "metavar": "NAME"},
    ),
    "locks_slots": (
        ("--slots",),
        {"help": "how many slots the --pool has (default 1)", "metavar": "N", "dest": "pool_slots", "default": None},
    ),
    "all_databases": (
        ("--all-databases",),
        {"help": "list every database's advisory locks (keys are per database)", "action": "store_true"},
    ),
    "key_name": (("name",), {"help": "the key name (omit with --dag/--task, --int, --pair)", "nargs": "?"}),
    "tenant": (("--tenant",), {"help": "tenant appended to the name: NAME/TENANT", "metavar": "TENANT"}),
    "key_dag": (
        ("--dag",),
        {"help": "DAG id: with --task, the key that task really takes (its DAG file is parsed)", "metavar": "DAG_ID"},
    ),
    "key_task": (("--task",), {"help": "task id (with --dag)", "metavar": "TASK_ID"}),
    "dags_folder": (
        ("--dags-folder",),
        {"help": "where --dag's DAG file is (default: Airflow's [core] dags_folder)", "metavar": "PATH"},
    ),
    "int_key": (("--int",), {"help": "an explicit int64 key", "metavar": "N", "dest": "int_key"}),
    "pair_key": (
        ("--pair",),
        {"help": "an explicit (int32, int32) key", "nargs": 2, "metavar": ("A", "B"), "dest": "pair_key"},
    ),
    "slots": (
        ("--slots",),
        {"help": "the key names a pool of N slots: print the N slot keys (slot 1 is the key itself)", "metavar": "N"},
    ),
    "verify": (
        ("--verify",),
        {"help": "ask PostgreSQL to compute the key too and compare (uses the connection)", "action": "store_true"},
    ),
    "lease": (
        ("--lease",),
        {"help": "the lease the tasks use, in seconds (default 30)", "default": None, "metavar": "SECONDS"},
    ),
    "pool_mode": (
        ("--pool-mode",),
        {
            "help": "a pooler between here and PostgreSQL and its pooling mode (session, transaction, statement), "
            "as the connection extra pool_mode declares it (for --dsn, which has none)",
            "metavar": "MODE",
            "default": None,
        },
    ),
    "strict": (("--strict",), {"help": "exit 1 on warnings too (notes never fail)", "action": "store_true"}),
    "grant": (
        ("--grant",),
        {
            "help": "grant this role (the one tasks connect as) what it needs on pglock's tables; repeatable",
            "action": "append",
            "metavar": "ROLE",
            "default": None,
        },
    ),
    "status": (("--status",), {"help": "only show the schema version; change nothing", "action": "store_true"}),
}

COMMON = ("conn_id", "dsn", "output")

COMMANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "locks": (
        "every advisory lock held or awaited: key name and numbers, holder's DAG/task/run, pid, client, since, waiters",
        ("locks_dag", "locks_key", "locks_pool", "locks_slots", "all_databases"),
    ),
    "key": (
        "a key's int64 or pair, its pg_locks coordinates and the SQL that computes it",
        ("key_name", "tenant", "key_dag", "key_task", "dags_folder", "int_key", "pair_key", "slots", "verify"),
    ),
    "doctor": (
        "connect as a task would and check server, standby, pooler, liveness, privileges, capacity, registry",
        ("lease", "pool_mode", "strict"),
    ),
    "init-db": (
        "create or upgrade airflow-pglock's schema 'pglock' (key-name registry); idempotent",
        ("grant", "status"),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Operate PostgreSQL advisory locks taken by airflow-pglock (and anybody else).",
        epilog="exit codes: 0 ok, 1 problem found, 2 usage, 3 configuration (DSN, conn id, key), 4 database",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, specific) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        for arg in (*specific, *COMMON):
            flags, kwargs = ARGS[arg]
            sub.add_argument(*flags, **kwargs)
        sub.set_defaults(handler=HANDLERS[name])
    return parser


def _version() -> str:
    from airflow_pglock import __version__

    return __version__


HANDLERS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "locks": cmd_locks,
    "key": cmd_key,
    "doctor": cmd_doctor,
    "init-db": cmd_init_db,
}


# ------------------------------------------------------------------ entry points


def run(handler: Callable[[argparse.Namespace, TextIO], int], args: argparse.Namespace, out: TextIO) -> int:
    """Run one command; turn every expected error into one line on stderr and an exit code."""
    import psycopg

    from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError, LockConnectionError, PgLockError

    try:
        return handler(args, out)
    except CliError as error:
        _error(str(error))
        return error.exit_code
    except (LockConfigurationError, InvalidLockKeyError) as error:
        _error(str(error))
        return EXIT_CONFIG
    except LockConnectionError as error:
        _error(str(error))
        return EXIT_DATABASE
    except psycopg.errors.InsufficientPrivilege as error:
        _error(f"the database refused: {str(error).strip()} (run it as a role with the privilege, e.g. the owner)")
        return EXIT_DATABASE
    except (psycopg.Error, PgLockError) as error:
        _error(f"database error: {type(error).__name__}: {str(error).strip()}")
        return EXIT_DATABASE


def _error(message: str) -> None:
    one_line = " ".join(message.split())  # libpq's messages span lines ("\n\tIs the server running ...")
    sys.stderr.write(f"{PROG}: error: {one_line}\n")


@contextlib.contextmanager
def results_stream() -> Iterator[TextIO]:
    """Keep stdout for results only: while a command runs, whatever else writes to stdout
    (Airflow's logging, set up when Airflow is imported, writes there) goes to stderr.

    Works on the file descriptors, so it also covers loggers that kept a reference to the
    original ``sys.stdout``. Yields the stream the results go to.
    """
    sys.stdout.flush()
    try:
        results_fd = os.dup(1)
    except OSError:  # no usable stdout (closed): nothing to protect
        yield sys.stdout
        return
    os.dup2(2, 1)
    results = os.fdopen(results_fd, "w", encoding="utf-8", closefd=True)
    try:
        yield results
    finally:
        results.flush()
        sys.stdout.flush()
        os.dup2(results_fd, 1)
        results.close()


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """The ``airflow-pglock`` console script.

    :param argv: arguments (default: ``sys.argv[1:]``).
    :param out: where results go (default: stdout, which then carries nothing else);
        errors and logs go to stderr.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help / --version (0) or a usage error (2)
        return int(exit_.code or 0)
    if out is not None:
        return run(args.handler, args, out)
    with results_stream() as results:
        return run(args.handler, args, results)


def airflow_command(name: str) -> Callable[[argparse.Namespace], None]:
    """The function ``airflow pglock NAME`` calls: same handler, exit code through SystemExit."""

    def command(args: argparse.Namespace) -> None:
        with results_stream() as results:
            code = run(HANDLERS[name], args, results)
        if code:
            sys.exit(code)

    command.__name__ = f"pglock_{name.replace('-', '_')}"
    return command


locks_command = airflow_command("locks")
key_command = airflow_command("key")
doctor_command = airflow_command("doctor")
init_db_command = airflow_command("init-db")


if __name__ == "__main__":
    sys.exit(main())
