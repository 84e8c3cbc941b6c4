"""``airflow-pglock key``: what a key is (numbers, ``pg_locks`` coordinates, SQL for other programs)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from airflow_pglock.cli.common import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    CliError,
    hook_from_args,
    note,
    parse_int,
    print_json,
)


def _key_from_args(args: argparse.Namespace) -> Any:
    from airflow_pglock.keys import LockKey

    numeric = args.int_key is not None or args.pair_key is not None
    if args.int_key is not None and args.pair_key is not None:
        raise CliError("give either --int or --pair, not both", EXIT_USAGE)
    if numeric and (args.name or args.tenant or args.dag or args.task):
        raise CliError("--int / --pair are keys on their own: no NAME, --tenant, --dag or --task with them", EXIT_USAGE)
    if args.int_key is not None:
        return LockKey.from_int(parse_int(args.int_key, "--int"))
    if args.pair_key is not None:
        return LockKey.from_pair(parse_int(args.pair_key[0], "--pair A"), parse_int(args.pair_key[1], "--pair B"))
    if (args.dag is None) != (args.task is None):
        raise CliError("--dag and --task go together (the default key of a task is DAG/TASK)", EXIT_USAGE)
    if args.name is not None and args.dag is not None:
        raise CliError("give either NAME or --dag/--task (the task's default key), not both", EXIT_USAGE)
    if args.name is None and args.dag is None:
        raise CliError("give a key NAME, --dag D --task T, --int N or --pair A B", EXIT_USAGE)
    if args.dag is not None:
        return _task_key(args)
    return LockKey.for_task("", "", args.tenant, base=args.name)


def _task_key(args: argparse.Namespace) -> Any:
    """The key task ``--task`` of DAG ``--dag`` takes: its DAG file parsed, its lock options read.

    A DAG no file defines gives the default key (DAG/TASK, what a task without ``key=``
    takes), said so on stderr. A key or tenant that is a template renders only when the
    task runs: then ``--tenant`` gives the tenant, or the command says what to give.
    """
    from airflow_pglock.compat import load_dag
    from airflow_pglock.keys import LockKey
    from airflow_pglock.task_guard import lock_spec_of, resolve_key

    dag, folder = load_dag(args.dag, getattr(args, "dags_folder", None))
    if dag is None:
        default = LockKey.for_task(args.dag, args.task, args.tenant)
        note(
            f"no DAG {args.dag!r} in the DAG files of {folder}: this is the DEFAULT key of a task "
            f"({default.name!r}, what a task without key= takes); give --dags-folder for its real key"
        )
        return default
    task = dag.task_dict.get(args.task)
    if task is None:
        tasks = ", ".join(sorted(dag.task_dict)) or "none"
        raise CliError(f"DAG {args.dag!r} has no task {args.task!r}; its tasks: {tasks}", EXIT_CONFIG)
    spec = lock_spec_of(task)
    if spec is None:
        raise CliError(
            f"task {args.task!r} of DAG {args.dag!r} is not guarded by airflow-pglock (no @task.advisory_lock, "
            "guarded() or @advisory_lock): it takes no key",
            EXIT_CONFIG,
        )
    key, tenant = spec.templated["key"], spec.templated["tenant"]
    if args.tenant is not None:
        tenant = args.tenant
    elif spec.tenant_arg is not None:
        raise CliError(
            f"the tenant of task {args.task!r} is its argument {spec.tenant_arg!r}, one per call: give --tenant VALUE",
            EXIT_USAGE,
        )
    for option, value in (("key", key), ("tenant", tenant)):
        if isinstance(value, str) and ("{{" in value or "{%" in value):
            hint = "give --tenant VALUE" if option == "tenant" else "give the rendered name: airflow-pglock key NAME"
            raise CliError(
                f"the {option} of task {args.task!r} is the template {value!r}, rendered when the task runs: {hint}",
                EXIT_USAGE,
            )
    found = resolve_key(key, tenant, args.dag, args.task)
    if spec.policy.slots > 1:
        note(f"task {args.task!r} takes any free slot of a pool of {spec.policy.slots}: --slots {spec.policy.slots}")
    return found


def key_description(key: Any) -> dict[str, Any]:
    """What ``key`` prints: numbers, pg_locks coordinates and SQL for other applications."""
    from airflow_pglock.pg.inspection import key_statements

    classid, objid, objsubid = key.pg_locks
    return {
        "name": key.name,
        "kind": "pair" if key.is_pair else "int64",
        "numbers": list(key.numbers),
        "pg_locks": {"classid": classid, "objid": objid, "objsubid": objsubid},
        "sql": key_statements(key),
    }


def _print_slots(key: Any, slots: int, output: str, out: TextIO) -> int:
    """``key --slots N``: the pool's slot keys, each as ``key`` describes one."""
    from airflow_pglock.exceptions import InvalidLockKeyError
    from airflow_pglock.keys import slot_keys

    try:
        keys = slot_keys(key, slots)
    except InvalidLockKeyError as error:
        raise CliError(str(error), EXIT_CONFIG) from None
    described = [key_description(slot) for slot in keys]
    if output == "json":
        print_json({"pool": key.name, "slots": slots, "slot_keys": described}, out)
        return EXIT_OK
    out.write(f"pool {key.name!r}: {slots} slot(s); a run holds any one of them\n")
    for number, (slot, data) in enumerate(zip(keys, described, strict=True), start=1):
        out.write(f"slot {number}  {slot.name!r}  {slot.numbers_text}  take it: {data['sql']['try_lock']}\n")
    return EXIT_OK


def cmd_key(args: argparse.Namespace, out: TextIO) -> int:
    from airflow_pglock.exceptions import InvalidLockKeyError

    try:
        key = _key_from_args(args)
    except InvalidLockKeyError as error:
        raise CliError(str(error), EXIT_CONFIG) from None
    data = key_description(key)
    data["verified"] = None
    if getattr(args, "slots", None) is not None:
        if args.verify:  # it would be left undone
            raise CliError("--verify checks one key: give it without --slots (or verify a slot's own name)", EXIT_USAGE)
        return _print_slots(key, parse_int(args.slots, "--slots"), args.output, out)
    code = EXIT_OK
    if args.verify:
        from airflow_pglock.pg.inspection import compute_name_key

        hook = hook_from_args(args)
        if key.name is not None and not key.is_pair:
            with hook.database.connect("pglock-cli key") as conn:
                server_value = compute_name_key(conn, key.name)
            matches = server_value == key.numbers[0]
            data["verified"] = {"server_int64": server_value, "matches": matches}
            code = EXIT_OK if matches else EXIT_PROBLEM
        else:
            data["verified"] = {"server_int64": None, "matches": True}  # numbers pass through unchanged
    if args.output == "json":
        print_json(data, out)
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
