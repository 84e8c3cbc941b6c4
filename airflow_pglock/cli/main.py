"""``airflow-pglock``: which jobs hold locks, what a key is, whether the set-up is safe.

    airflow-pglock locks   [--dag DAG] [--key KEY] [--all-databases]
    airflow-pglock key     [NAME] [--tenant T] [--dag D --task T] [--int N | --pair A B] [--verify]
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
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from airflow_pglock.lock_report import LockEntry, PoolUsage

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_CONFIG = 3
EXIT_DATABASE = 4

DEFAULT_CONN_ID = "postgres_default"
PROG = "airflow-pglock"

# ------------------------------------------------------------------ arguments
# One spec serves both parsers: argparse here, airflow.cli.cli_config.Arg in definition.py.

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
    "key_dag": (("--dag",), {"help": "DAG id: the default key of a task is DAG/TASK", "metavar": "DAG_ID"}),
    "key_task": (("--task",), {"help": "task id (with --dag)", "metavar": "TASK_ID"}),
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
        ("key_name", "tenant", "key_dag", "key_task", "int_key", "pair_key", "slots", "verify"),
    ),
    "doctor": (
        "connect as a task would and check server, standby, pooler, liveness, privileges, capacity, registry",
        ("lease", "strict"),
    ),
    "init-db": (
        "create or upgrade airflow-pglock's schema 'pglock' (key-name registry); idempotent",
        ("grant", "status"),
    ),
}


class CliError(Exception):
    """An error the CLI reports on one line and turns into an exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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


# ------------------------------------------------------------------ helpers


def _hook(args: argparse.Namespace, lease: float | None = None) -> Any:
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
    if args.dsn is not None:
        if not args.dsn.strip():
            raise CliError("--dsn is empty; give a libpq connection string or URI", EXIT_CONFIG)
        hook = AdvisoryLockHook(dsn=args.dsn, liveness=liveness)
    else:
        use_server_connections()  # like `airflow connections get`: read the metadata database too
        conn_id = args.conn_id or os.environ.get("PGLOCK_CONN_ID") or DEFAULT_CONN_ID
        try:
            hook = AdvisoryLockHook(conn_id, liveness=liveness)
        except LockConfigurationError as error:
            raise CliError(str(error), EXIT_CONFIG) from None
    try:
        hook.connection_kwargs()  # a bad DSN or an unknown conn id fails here, before any work
    except LockConfigurationError as error:
        raise CliError(str(error), EXIT_CONFIG) from None
    return hook


def _print_json(data: Any, out: TextIO) -> None:
    json.dump(data, out, indent=2, sort_keys=False, default=str)
    out.write("\n")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
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


# ------------------------------------------------------------------ locks


def cmd_locks(args: argparse.Namespace, out: TextIO) -> int:
    from airflow_pglock.lock_report import collect_lock_report

    hook = _hook(args)
    from airflow_pglock.keys import InvalidLockKeyError

    pool = getattr(args, "pool", None)
    slots = 1 if getattr(args, "pool_slots", None) is None else _parse_int(args.pool_slots, "--slots")
    if slots != 1 and pool is None:
        raise CliError("--slots goes with --pool NAME (the pool's key name)", EXIT_USAGE)
    try:
        report = collect_lock_report(
            hook, dag=args.dag, key=args.key, all_databases=args.all_databases, pool=pool, slots=slots
        )
    except InvalidLockKeyError as error:
        raise CliError(str(error), EXIT_CONFIG) from None
    if args.output == "json":
        _print_json(report.to_json(), out)
        return EXIT_OK
    where = "every database" if report.all_databases else f"database {report.database!r}"
    filters = ", ".join(f"{k}={v!r}" for k, v in report.filters.items() if v is not None)
    head = f"{len(report.entries)} advisory lock session(s) in {where} ({report.server})"
    out.write(
        f"{head}{' matching ' + filters if filters else ''}; key-name registry: {report.registry}; "
        f"server time {report.taken_at.isoformat(timespec='seconds')}\n"
    )
    if report.pool is not None:
        out.write(f"pool {report.pool.name!r}: {report.pool.describe()}\n")
    if not report.entries:
        return EXIT_OK

    def database(e: LockEntry) -> list[str]:
        return [e.holder.database] if report.all_databases else []

    rows = [] if report.pool is not None else [_pool_row(p) + database(p.entries[0]) for p in report.pools]
    # --pool: its summary line above, then each slot's session; else a pool is one row
    rows += [_lock_row(e) + database(e) for e in report.entries if report.pool is not None or not report.pooled(e)]
    headers = ["KEY", "NUMBERS", "STATE", "WAITERS", "HOLDER (DAG / TASK / RUN or application)", "PID", "CLIENT"]
    headers += ["SINCE", "FOR"] + (["DATABASE"] if report.all_databases else [])
    _table(headers, rows, out)
    if any(e.since_basis and e.since_basis.startswith("session start") for e in report.entries):
        out.write("~ = the session started then; the lock may be younger (not an airflow-pglock session)\n")
    return EXIT_OK


def _holder_text(e: LockEntry) -> str:
    h = e.holder
    if e.airflow is not None:
        mapped = f"[{e.airflow.map_index}]" if e.airflow.map_index >= 0 else ""
        return f"{e.airflow.dag_id} / {e.airflow.task_id}{mapped} / {e.airflow.run_id}"
    return h.application_name or ("(hidden: no privilege)" if h.user is None else "(no application_name)")


def _since_text(e: LockEntry) -> str:
    since = "?" if e.since is None else e.since.isoformat(timespec="seconds")
    if e.since_basis and e.since_basis.startswith("session start"):
        since = "~" + since
    return since


def _pool_row(pool: PoolUsage) -> list[str]:
    """A pool as one row: 'K of N held', then each holder with its slot (oldest since, longest for)."""
    holding = [e for e in pool.entries if e.holder.granted]
    holders = "; ".join(f"slot {pool.slot_of(e)}: {_holder_text(e)}" for e in holding) or "-"
    dated = [e for e in holding if e.since is not None]
    oldest = min(dated, key=lambda e: e.since, default=None)  # type: ignore[arg-type,return-value]
    clients = dict.fromkeys(e.holder.client_addr or ("local" if e.holder.user else "?") for e in holding)
    return [
        f"{pool.name} (pool of {pool.slots})",
        f"{pool.key.numbers_text} (slot 1)",
        pool.describe(),
        f"{pool.waiting} waiting" if pool.waiting else "0",
        holders,
        ",".join(str(e.holder.pid) for e in holding) or "-",
        ",".join(clients) or "-",
        "-" if oldest is None else _since_text(oldest),
        "-" if oldest is None else human_duration(oldest.seconds),
    ]


def _lock_row(e: LockEntry) -> list[str]:
    h = e.holder
    name = " | ".join(e.names) + (" (COLLISION)" if e.collision else "") if e.names else "?"
    holder = _holder_text(e)
    since = _since_text(e)
    if h.granted:
        queue = str(h.waiters)
    elif h.blocked_by:
        queue = "behind " + ",".join(map(str, h.blocked_by))
    else:
        queue = "-"
    return [
        name,
        e.key.numbers_text + (" (pair)" if e.key.is_pair else ""),
        ("holding" if h.granted else "waiting") + (" shared" if h.shared else ""),
        queue,
        holder,
        str(h.pid) if h.pid is not None else "prepared xact",
        h.client_addr or ("local" if h.user else "?"),
        since,
        human_duration(e.seconds),
    ]


# ------------------------------------------------------------------ key


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CliError(f"{what} must be an integer, got {text!r}", EXIT_CONFIG) from None


def _key_from_args(args: argparse.Namespace) -> Any:
    from airflow_pglock.keys import LockKey

    numeric = args.int_key is not None or args.pair_key is not None
    if args.int_key is not None and args.pair_key is not None:
        raise CliError("give either --int or --pair, not both", EXIT_USAGE)
    if numeric and (args.name or args.tenant or args.dag or args.task):
        raise CliError("--int / --pair are keys on their own: no NAME, --tenant, --dag or --task with them", EXIT_USAGE)
    if args.int_key is not None:
        return LockKey.from_int(_parse_int(args.int_key, "--int"))
    if args.pair_key is not None:
        return LockKey.from_pair(_parse_int(args.pair_key[0], "--pair A"), _parse_int(args.pair_key[1], "--pair B"))
    if (args.dag is None) != (args.task is None):
        raise CliError("--dag and --task go together (the default key of a task is DAG/TASK)", EXIT_USAGE)
    if args.name is not None and args.dag is not None:
        raise CliError("give either NAME or --dag/--task (the task's default key), not both", EXIT_USAGE)
    if args.name is None and args.dag is None:
        raise CliError("give a key NAME, --dag D --task T, --int N or --pair A B", EXIT_USAGE)
    if args.dag is not None:
        return LockKey.for_task(args.dag, args.task, args.tenant)
    return LockKey.for_task("", "", args.tenant, base=args.name)


def key_description(key: Any) -> dict[str, Any]:
    """What ``key`` prints: numbers, pg_locks coordinates and SQL for other applications."""
    classid, objid, objsubid = key.pg_locks
    args_sql = key.sql
    holders_sql = (
        "SELECT pid, granted, mode FROM pg_locks WHERE locktype = 'advisory' AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) "
        f"AND classid = {classid} AND objid = {objid} AND objsubid = {objsubid}"
    )
    return {
        "name": key.name,
        "kind": "pair" if key.is_pair else "int64",
        "numbers": list(key.numbers),
        "pg_locks": {"classid": classid, "objid": objid, "objsubid": objsubid},
        "sql": {
            "key": args_sql,
            "try_lock": f"SELECT pg_try_advisory_lock({args_sql})",
            "unlock": f"SELECT pg_advisory_unlock({args_sql})",
            "holders": holders_sql,
        },
    }


def _print_slots(key: Any, slots: int, output: str, out: TextIO) -> int:
    """``key --slots N``: the pool's slot keys, each as ``key`` describes one."""
    from airflow_pglock.keys import InvalidLockKeyError, slot_keys

    try:
        keys = slot_keys(key, slots)
    except InvalidLockKeyError as error:
        raise CliError(str(error), EXIT_CONFIG) from None
    described = [key_description(slot) for slot in keys]
    if output == "json":
        _print_json({"pool": key.name, "slots": slots, "slot_keys": described}, out)
        return EXIT_OK
    out.write(f"pool {key.name!r}: {slots} slot(s); a run holds any one of them\n")
    for number, (slot, data) in enumerate(zip(keys, described, strict=True), start=1):
        out.write(f"slot {number}  {slot.name!r}  {slot.numbers_text}  take it: {data['sql']['try_lock']}\n")
    return EXIT_OK


def cmd_key(args: argparse.Namespace, out: TextIO) -> int:
    from airflow_pglock.keys import InvalidLockKeyError

    try:
        key = _key_from_args(args)
    except InvalidLockKeyError as error:
        raise CliError(str(error), EXIT_CONFIG) from None
    data = key_description(key)
    data["verified"] = None
    if getattr(args, "slots", None) is not None:
        return _print_slots(key, _parse_int(args.slots, "--slots"), args.output, out)
    code = EXIT_OK
    if args.verify:
        from airflow_pglock.hooks.inspection import compute_name_key

        hook = _hook(args)
        if key.name is not None and not key.is_pair:
            with hook.connect("pglock-cli key") as conn:
                server_value = compute_name_key(conn, key.name)
            matches = server_value == key.numbers[0]
            data["verified"] = {"server_int64": server_value, "matches": matches}
            code = EXIT_OK if matches else EXIT_PROBLEM
        else:
            data["verified"] = {"server_int64": None, "matches": True}  # numbers pass through unchanged
    if args.output == "json":
        _print_json(data, out)
        return code
    lines = [
        ("name", repr(key.name) if key.name is not None else "(none: explicit numbers)"),
        ("kind", "(int32, int32) pair" if key.is_pair else "int64"),
        ("numbers", key.numbers_text),
        (
            "pg_locks",
            f"classid={data['pg_locks']['classid']} objid={data['pg_locks']['objid']} "
            f"objsubid={data['pg_locks']['objsubid']}",
        ),
        ("SQL key", data["sql"]["key"]),
        ("take it", data["sql"]["try_lock"]),
        ("release", data["sql"]["unlock"]),
        ("who holds", data["sql"]["holders"]),
    ]
    if data["verified"] is not None and data["verified"]["server_int64"] is not None:
        verdict = "matches" if data["verified"]["matches"] else "DIFFERS"
        lines.append(("server", f"{data['verified']['server_int64']} ({verdict})"))
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        out.write(f"{label.ljust(width)}  {value}\n")
    return code


# ------------------------------------------------------------------ doctor


def cmd_doctor(args: argparse.Namespace, out: TextIO) -> int:
    from airflow_pglock.doctor import run_doctor

    lease = None
    if args.lease is not None:
        try:
            lease = float(args.lease)
        except ValueError:
            raise CliError(f"--lease must be a number of seconds, got {args.lease!r}", EXIT_CONFIG) from None
    report = run_doctor(_hook(args, lease=lease))
    connected = not any(c.name == "connection" and c.status == "problem" for c in report.checks)
    if args.output == "json":
        _print_json(report.to_json(), out)
    else:
        out.write(f"airflow-pglock doctor: {report.target}\n")
        for check in report.checks:
            out.write(f"  [{check.status.upper():<7}] {check.name:<10} {check.summary}\n")
            if check.fix and check.status != "ok":
                out.write(f"  {'':9} {'':<10} fix: {check.fix}\n")
        out.write(f"result: {report.status}\n")
    if not connected:
        return EXIT_DATABASE
    if report.status == "problem" or (args.strict and report.status == "warning"):
        return EXIT_PROBLEM
    return EXIT_OK


# ------------------------------------------------------------------ init-db


def cmd_init_db(args: argparse.Namespace, out: TextIO) -> int:
    from airflow_pglock.hooks.schema import LATEST_VERSION, SCHEMA, grant_usage, migrate, schema_status

    hook = _hook(args)
    with hook.connect("pglock-cli init-db") as conn:
        if args.status:
            status = schema_status(conn)
            data: dict[str, Any] = {
                "schema": SCHEMA,
                "installed": status.installed,
                "latest": status.latest,
                "pending": [{"version": m.version, "description": m.description} for m in status.pending],
                "applied": [
                    {"version": a.version, "description": a.description, "applied_at": a.applied_at.isoformat()}
                    for a in status.applied
                ],
            }
            if args.output == "json":
                _print_json(data, out)
            else:
                installed = "not installed" if status.installed is None else f"version {status.installed}"
                out.write(
                    f"schema {SCHEMA}: {installed} (latest {LATEST_VERSION}); "
                    f"{len(status.pending)} migration(s) pending\n"
                )
            return EXIT_OK
        result = migrate(conn)
        grants = {role: grant_usage(conn, role) for role in args.grant or ()}
    data = {
        "schema": SCHEMA,
        "before": result.before,
        "after": result.after,
        "applied": [{"version": m.version, "description": m.description} for m in result.applied],
        "granted": list(grants),
    }
    if args.output == "json":
        _print_json(data, out)
        return EXIT_OK
    if result.applied:
        before = "nothing" if result.before is None else f"version {result.before}"
        out.write(f"schema {SCHEMA}: {before} -> version {result.after}\n")
        for migration in result.applied:
            out.write(f"  applied {migration.version}: {migration.description}\n")
    else:
        out.write(f"schema {SCHEMA}: already at version {result.after} (nothing to do)\n")
    for role, statements in grants.items():
        out.write(f"  granted to {role}:\n")
        for statement in statements:
            out.write(f"    {statement};\n")
    return EXIT_OK


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

    from airflow_pglock.exceptions import LockConfigurationError, LockConnectionError, PgLockError
    from airflow_pglock.keys import InvalidLockKeyError

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
    sys.stderr.write(f"{PROG}: error: {message}\n")


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
