"""``airflow-pglock doctor`` and ``init-db``: is the lock database safe, and its ``pglock`` schema."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from airflow_pglock.cli.common import (
    EXIT_CONFIG,
    EXIT_DATABASE,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    CliError,
    hook_from_args,
    print_json,
)


def cmd_doctor(args: argparse.Namespace, out: TextIO) -> int:
    from airflow_pglock.doctor import run_doctor

    lease = None
    if args.lease is not None:
        try:
            lease = float(args.lease)
        except ValueError:
            raise CliError(f"--lease must be a number of seconds, got {args.lease!r}", EXIT_CONFIG) from None
    report = run_doctor(hook_from_args(args, lease=lease))
    connected = not any(c.name == "connection" and c.status == "problem" for c in report.checks)
    if args.output == "json":
        print_json(report.to_json(), out)
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
    from airflow_pglock.pg.schema import LATEST_VERSION, SCHEMA, grant_usage, migrate, missing_roles, schema_status

    roles = list(args.grant or ())
    if args.status and roles:
        raise CliError("--status only reads the schema's state; give --grant without --status", EXIT_USAGE)
    blank = [role for role in roles if not role.strip()]
    if blank:
        raise CliError(f"--grant {blank[0]!r} is empty; give the role tasks connect as", EXIT_CONFIG)
    hook = hook_from_args(args)
    with hook.database.connect("pglock-cli init-db") as conn:
        missing = missing_roles(conn, roles)  # before any migration: nothing is changed for a typo
        if missing:
            raise CliError(
                f"--grant: no role {', '.join(map(repr, missing))} in this cluster (role names are case-sensitive "
                "here, as written); nothing was changed",
                EXIT_CONFIG,
            )
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
                print_json(data, out)
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
        print_json(data, out)
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
