"""application_name: fits 63 bytes, ASCII, round-trips DAG / task / run."""

from __future__ import annotations

import pytest

from airflow_pglock.identity import MAX_APPLICATION_NAME_BYTES, TaskIdentity, parse_application_name


def test_round_trip_short() -> None:
    identity = TaskIdentity("forecasts", "refresh", "scheduled__2026-11-30T02:00:00+00:00")
    name = identity.application_name()
    assert name == "pglock forecasts refresh sch__2026-11-30T02:00:00+00:00"
    parsed = parse_application_name(name)
    assert parsed is not None
    assert (parsed.dag_id, parsed.task_id, parsed.run_id, parsed.map_index) == (
        "forecasts",
        "refresh",
        "scheduled__2026-11-30T02:00:00+00:00",
        -1,
    )


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
    assert name == f"pglock-hook close_month.py pid {os.getpid()} on {socket.gethostname()}"[:63]
    assert "s3cret" not in name and is_provider_session(name)
    monkeypatch.setattr(sys, "argv", ["/x/" + "a-very-long-program-name" * 4])
    long_name = hook_application_name()
    assert len(long_name.encode()) <= 63 and "~ pid " in long_name and f"pid {os.getpid()}" in long_name
    assert not is_provider_session("psql") and not is_provider_session(None)
    assert is_provider_session("pglock dag task manual__1")
