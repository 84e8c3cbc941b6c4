"""``airflow-pglock locks``: every advisory lock held or awaited, named and explained."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from airflow_pglock.cli.common import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    hook_from_args,
    human_duration,
    parse_int,
    print_json,
    table,
)

if TYPE_CHECKING:
    from airflow_pglock.lock_report import ScopeEntry
    from airflow_pglock.lock_report.entries import LockEntry
    from airflow_pglock.lock_report.pools import PoolUsage


def cmd_locks(args: argparse.Namespace, out: TextIO) -> int:
    from airflow_pglock.lock_report import collect_lock_report

    hook = hook_from_args(args)
    from airflow_pglock.exceptions import InvalidLockKeyError

    pool = getattr(args, "pool", None)
    slots = 1 if getattr(args, "pool_slots", None) is None else parse_int(args.pool_slots, "--slots")
    if slots != 1 and pool is None:
        raise CliError("--slots goes with --pool NAME (the pool's key name)", EXIT_USAGE)
    try:
        report = collect_lock_report(
            hook, dag=args.dag, key=args.key, all_databases=args.all_databases, pool=pool, slots=slots
        )
    except InvalidLockKeyError as error:
        raise CliError(str(error), EXIT_CONFIG) from None
    if report.key_note is not None:
        sys.stderr.write(f"airflow-pglock: note: {report.key_note}\n")
    if args.output == "json":
        print_json(report.to_json(), out)
        return EXIT_OK
    where = "every database" if report.all_databases else f"database {report.database!r}"
    filters = ", ".join(f"{k}={v!r}" for k, v in report.filters.items() if v is not None)
    head = f"{len(report.entries)} advisory lock session(s) in {where} ({report.server})"
    out.write(
        f"{head}{' matching ' + filters if filters else ''}; key-name registry: {report.registry}; "
        f"server time {report.taken_at.isoformat(timespec='seconds')}\n"
    )
    if report.standby_warning is not None:
        out.write(f"WARNING: {report.standby_warning}\n")
    if report.pool is not None:
        out.write(f"pool {report.pool.name!r}: {report.pool.describe()}\n")
    if report.scopes:
        out.write(
            f"{len(report.scopes)} lock scope(s) or deferred task(s), each held by a lease row between its tasks "
            "or while the triggerer holds it (docs/scopes.md, docs/deferrable-operators.md):\n"
        )
        table(
            ["SCOPE KEY", "NUMBERS", "HELD BY (DEPLOYMENT: DAG RUN)", "TASK NOW", "LEASE UNTIL", "TOKEN"],
            [_scope_row(s) for s in report.scopes],
            out,
        )
    if not report.entries:
        return EXIT_OK

    def database(e: LockEntry) -> list[str]:
        return [e.holder.database] if report.all_databases else []

    rows = [] if report.pool is not None else [_pool_row(p) + database(p.entries[0]) for p in report.pools]
    # --pool: its summary line above, then each slot's session; else a pool is one row
    rows += [_lock_row(e) + database(e) for e in report.entries if report.pool is not None or not report.pooled(e)]
    headers = ["KEY", "NUMBERS", "STATE", "WAITERS", "HOLDER (DAG / TASK / RUN or application)", "DEPLOYMENT @ HOST"]
    headers += ["PID", "CLIENT", "SINCE", "FOR"] + (["DATABASE"] if report.all_databases else [])
    table(headers, rows, out)
    if any(not e.names for e in report.entries if report.pool is not None or not report.pooled(e)):
        out.write(f"{UNKNOWN_NAME_MARK} = {report.unknown_name_reason}\n")
    if any(e.since_basis and e.since_basis.startswith("session start") for e in report.entries):
        out.write(
            f"{SESSION_START_MARK} = the session started then; the lock may be younger (not an airflow-pglock session, "
            "or a lock session that holds several keys)\n"
        )
    return EXIT_OK


#: What the KEY column shows for a key without a known name (the footnote says why).
UNKNOWN_NAME_MARK = "?*"
#: What starts a SINCE that is its session's start, not the lock's (the footnote says why).
SESSION_START_MARK = "~"
#: How each footnote under the table starts (a reader counting the table's rows skips them).
FOOTNOTE_PREFIXES = (f"{UNKNOWN_NAME_MARK} = ", f"{SESSION_START_MARK} = ")


def where_text(deployment: str | None, host: str | None) -> str:
    """``prod-eu @ worker-3``; just the host when the deployment is unnamed; ``-`` if unknown."""
    if host is None:
        return "-"
    return host if deployment is None or deployment == host else f"{deployment} @ {host}"


def _holder_text(e: LockEntry) -> str:
    h = e.holder
    if e.airflow is not None:
        mapped = f"[{e.airflow.map_index}]" if e.airflow.map_index >= 0 else ""
        return f"{e.airflow.dag_id} / {e.airflow.task_id}{mapped} / {e.airflow.run_id}"
    return h.application_name or ("(hidden: no privilege)" if h.user is None else "(no application_name)")


def _since_text(e: LockEntry) -> str:
    since = "?" if e.since is None else e.since.isoformat(timespec="seconds")
    if e.since_basis and e.since_basis.startswith("session start"):
        since = SESSION_START_MARK + since
    return since


def _pool_waiters(pool: PoolUsage) -> str:
    """``0``, or how many wait for a slot and who: ``1 waiting (pid 12952 behind 16495)``."""
    waiting = [e for e in pool.entries if not e.holder.granted]
    if not waiting:
        return "0"
    who = ", ".join(
        f"pid {e.holder.pid}" + (f" behind {','.join(map(str, e.holder.blocked_by))}" if e.holder.blocked_by else "")
        for e in waiting
    )
    return f"{len(waiting)} waiting ({who})"


def _pool_row(pool: PoolUsage) -> list[str]:
    """A pool as one row: 'K of N held', then each holder with its slot (oldest since, longest for)."""
    holding = [e for e in pool.entries if e.holder.granted]
    holders = "; ".join(f"slot {pool.slot_of(e)}: {_holder_text(e)}" for e in holding) or "-"
    dated = [e for e in holding if e.since is not None]
    oldest = min(dated, key=lambda e: e.since, default=None)  # type: ignore[arg-type,return-value]
    clients = dict.fromkeys(e.holder.client for e in holding)
    return [
        f"{pool.name} (pool of {pool.slots})",
        f"{pool.key.numbers_text} (slot 1)",
        pool.describe(),
        _pool_waiters(pool),
        holders,
        "; ".join(dict.fromkeys(where_text(e.deployment, e.host) for e in holding)) or "-",
        ",".join(str(e.holder.pid) for e in holding) or "-",
        ",".join(clients) or "-",
        "-" if oldest is None else _since_text(oldest),
        "-" if oldest is None else human_duration(oldest.seconds),
    ]


def _scope_row(scope: ScopeEntry) -> list[str]:
    return [
        scope.key.name or UNKNOWN_NAME_MARK,
        scope.key.numbers_text,
        scope.run,
        scope.task_now or "- (between tasks)",
        scope.lease_until.isoformat(timespec="seconds"),
        "-" if scope.token is None else str(scope.token),
    ]


def _lock_row(e: LockEntry) -> list[str]:
    h = e.holder
    name = " | ".join(e.names) + (" (COLLISION)" if e.collision else "") if e.names else UNKNOWN_NAME_MARK
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
        where_text(e.deployment, e.host),
        str(h.pid) if h.pid is not None else "prepared xact",
        h.client,
        since,
        human_duration(e.seconds),
    ]
