"""application_name: fits 63 bytes, ASCII, round-trips DAG / task / run."""

from __future__ import annotations

import socket

import pytest

from airflow_pglock.identity import (
    MAX_APPLICATION_NAME_BYTES,
    ParsedHookName,
    TaskIdentity,
    holder_where,
    is_provider_session,
    parse_application_name,
    parse_hook_name,
    run_digest,
)


def test_round_trip_short() -> None:
    identity = TaskIdentity("forecasts", "refresh", "scheduled__2026-11-30T02:00:00+00:00", deployment="eu", host="w1")
    name = identity.application_name()
    assert name == "pglock:eu@w1 forecasts refresh sch__2026-11-30T02:00:00+00:00"
    parsed = parse_application_name(name)
    assert parsed is not None
    assert (parsed.dag_id, parsed.task_id, parsed.run_id, parsed.map_index, parsed.deployment, parsed.host) == (
        "forecasts",
        "refresh",
        "scheduled__2026-11-30T02:00:00+00:00",
        -1,
        "eu",
        "w1",
    )
    assert parsed.where == "eu@w1"


def test_an_unnamed_deployment_is_its_host() -> None:
    name = TaskIdentity("d", "t", "manual__1", host="worker-3").application_name()
    assert name == "pglock:worker-3 d t man__1"
    parsed = parse_application_name(name)
    assert parsed is not None and parsed.deployment == parsed.host == "worker-3" and parsed.where == "worker-3"
    assert TaskIdentity("d", "t", "manual__1", deployment="worker-3", host="worker-3").application_name() == name
    assert TaskIdentity("d", "t", "r").application_name().startswith(f"pglock:{socket.gethostname()} ")


def test_two_deployments_on_one_host_are_told_apart() -> None:
    same = dict(dag_id="forecasts", task_id="refresh_forecasts", run_id="manual__2026-12-01T19:14:46.141234+00:00")
    prod = parse_application_name(TaskIdentity(**same, deployment="prod-eu", host="box").application_name())
    stage = parse_application_name(TaskIdentity(**same, deployment="staging", host="box").application_name())
    assert prod is not None and stage is not None
    assert (prod.deployment, prod.host) == ("prod-eu", "box") and (stage.deployment, stage.host) == ("staging", "box")


def test_deployment_names_become_one_token() -> None:
    parsed = parse_application_name(
        TaskIdentity("d", "t", "r", deployment="Prod EU@west é", host="h").application_name()
    )
    assert parsed is not None and parsed.deployment == "Prod_EU_west_?" and parsed.dag_id == "d"


# The issue's example: the same DAG and task in two deployments, the run id cut off.
ISSUE_RUN = "manual__2026-12-01T19:14:46.141234+00:00"


@pytest.mark.parametrize(
    ("deployment", "host", "dag", "task", "run", "map_index"),
    [
        (None, "worker-3", "forecasts", "refresh_forecasts", ISSUE_RUN, -1),
        ("prod-eu", "worker-3", "forecasts", "refresh_forecasts", ISSUE_RUN, -1),
        (
            "staging-eu-west-1",
            "airflow-worker-7d9f8b6c5-x2k4q.airflow.svc.cluster.local",
            "customer_exports",
            "export_one",
            "scheduled__2026-12-01T19:00:00+00:00",
            12,
        ),
        ("p" * 80, "h" * 80, "d" * 200, "group.task_" + "t" * 100, "r" * 300, 99999),
        ("prod", "w", "d", "t", "run with spaces " * 10, -1),
    ],
)
def test_every_name_fits_63_ascii_bytes_and_parses(
    deployment: str | None, host: str, dag: str, task: str, run: str, map_index: int
) -> None:
    name = TaskIdentity(dag, task, run, map_index, deployment, host).application_name()
    assert len(name.encode()) <= MAX_APPLICATION_NAME_BYTES and name.isascii(), name
    parsed = parse_application_name(name)
    assert parsed is not None, name
    assert parsed.map_index == map_index
    assert parsed.host is not None and parsed.deployment is not None
    assert dag.startswith(parsed.dag_id.rstrip("~")) and task.startswith(parsed.task_id.rstrip("~"))
    if deployment is not None:
        assert deployment.startswith(parsed.deployment.rstrip("~"))
        assert parsed.deployment[:1] == deployment[:1]
    assert parsed.run_id == run or parsed.run_id.endswith("~" + run_digest(run)), parsed.run_id


def test_the_issue_example_names_the_deployment_and_a_readable_unique_run() -> None:
    name = TaskIdentity(
        "forecasts", "refresh_forecasts", ISSUE_RUN, deployment="prod-eu", host="worker-3"
    ).application_name()
    assert name.startswith("pglock:prod-eu@worker-3 forecasts ")
    assert name.endswith(f"~{run_digest(ISSUE_RUN)}") and " man__20" in name  # its kind and year, and unique


def test_shortened_run_ids_stay_unique() -> None:
    """Runs a few microseconds, seconds or days apart, whose cut-off prefixes are the same, stay apart."""
    import datetime as dt

    start = dt.datetime(2026, 12, 1, 19, 14, 46, 141234, tzinfo=dt.timezone.utc)
    runs = [f"manual__{(start + dt.timedelta(microseconds=7 * i)).isoformat()}" for i in range(2000)]
    runs += [f"scheduled__{(start + dt.timedelta(minutes=i)).isoformat()}" for i in range(3000)]
    runs += [f"backfill__{(start + dt.timedelta(days=i)).isoformat()}" for i in range(1000)]
    names = {
        TaskIdentity("forecasts", "refresh_forecasts", run, -1, "prod-eu", "worker-3").application_name()
        for run in runs
    }
    assert len(names) == len(runs)
    parsed_runs = {parse_application_name(name).run_id for name in names}  # type: ignore[union-attr]
    assert len(parsed_runs) == len(runs)
    # The old format cut the same runs to one prefix: the defect this replaces.
    old_style = {f"pglock forecasts refresh_forecasts {run}"[:63] for run in runs[:2000]}
    assert len(old_style) < 2000


def test_shortened_forms_are_stable() -> None:
    one = TaskIdentity("forecasts", "refresh_forecasts", ISSUE_RUN, -1, "prod-eu", "worker-3")
    assert one.application_name() == TaskIdentity(**one.__dict__).application_name()


def test_the_format_of_older_provider_versions_is_still_parsed() -> None:
    old = "pglock forecasts refresh_forecasts man__2026-12-01T19:14:46.14~"
    parsed = parse_application_name(old)
    assert parsed is not None
    assert (parsed.dag_id, parsed.task_id, parsed.run_id) == (
        "forecasts",
        "refresh_forecasts",
        "manual__2026-12-01T19:14:46.14~",
    )
    assert parsed.deployment is None and parsed.host is None and parsed.where is None
    mapped = parse_application_name("pglock exports export_one#4 sch__2026-11-30T02:00:00+00:00")
    assert mapped is not None and mapped.map_index == 4 and mapped.run_id == "scheduled__2026-11-30T02:00:00+00:00"
    assert holder_where(old) == (None, None)
    hook = parse_hook_name("pglock-hook close_month.py pid 4242 on billing-1")
    assert hook == ParsedHookName("close_month.py", 4242, None, "billing-1")
    assert holder_where("pglock-hook close_month.py pid 4242 on billing-1") == (None, "billing-1")
    assert is_provider_session(old) and is_provider_session("pglock-hook close_month.py pid 4242 on billing-1")


def test_mapped_index_survives() -> None:
    parsed = parse_application_name(TaskIdentity("exports", "export_one", "manual__x", 17).application_name())
    assert parsed is not None and parsed.map_index == 17 and parsed.task_id == "export_one"


def test_long_ids_are_shortened_to_63_ascii_bytes() -> None:
    identity = TaskIdentity("d" * 200, "group.task_" + "t" * 100, "manual__2026-11-30T00:30:06.417713+00:00", 3)
    name = identity.application_name()
    assert len(name.encode()) <= MAX_APPLICATION_NAME_BYTES
    assert name.isascii()
    parsed = parse_application_name(name)
    assert parsed is not None and parsed.dag_id.startswith("dddddddd") and parsed.map_index == 3


def test_non_ascii_is_replaced() -> None:
    name = TaskIdentity("export_é", "t", "r").application_name()
    assert name.isascii() and "export_?" in name


def test_other_applications_are_not_parsed() -> None:
    assert parse_application_name("psql") is None
    assert parse_application_name(None) is None


def test_hook_sessions_name_the_program_pid_and_host(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import socket
    import sys

    from airflow_pglock.identity import hook_application_name, is_provider_session

    monkeypatch.setattr(sys, "argv", ["/opt/billing/close_month.py", "--password", "s3cret"])
    name = hook_application_name()
    assert name == f"pglock-hook:{socket.gethostname()} close_month.py pid {os.getpid()}"[:63]
    assert "s3cret" not in name and is_provider_session(name)
    named = hook_application_name("billing", "box-1")
    assert named == f"pglock-hook:billing@box-1 close_month.py pid {os.getpid()}"
    assert parse_hook_name(named) == ParsedHookName("close_month.py", os.getpid(), "billing", "box-1")
    monkeypatch.setattr(sys, "argv", ["/x/" + "a-very-long-program-name" * 4])
    long_name = hook_application_name("a-long-deployment-name" * 3, "a-long-host-name" * 5)
    assert len(long_name.encode()) <= 63 and "~ pid " in long_name and long_name.endswith(f" pid {os.getpid()}")
    parsed = parse_hook_name(long_name)
    assert parsed is not None and parsed.pid == os.getpid() and parsed.deployment and parsed.host
    assert not is_provider_session("psql") and not is_provider_session(None)
    assert is_provider_session("pglock dag task manual__1") and is_provider_session("pglock:d@h dag task r")
