"""One outcome-line shape for every outcome: the same fields in the same order, ``-`` for none.

Each outcome kind a guarded execution can end with is produced on real PostgreSQL and
parsed with one regular expression: the one docs/operations.md documents.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_pglock.exceptions import AlreadyDoneError, LockBusyError, LockConnectionError
from airflow_pglock.guard import LockGuard
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.keys import LockKey
from airflow_pglock.policy import LockPolicy
from airflow_pglock.run_rules import RunRules

FIELDS = (
    "mode",
    "deployment",
    "host",
    "conn",
    "database",
    "server",
    "pid",
    "waited",
    "held",
    "holder_pid",
    "holder_deployment",
    "holder_host",
)
VALUE = r"""(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\S+)"""
#: The documented parser (docs/operations.md, "The outcome line").
OUTCOME = re.compile(
    r"^pglock outcome=(?P<outcome>[a-z]+) (?P<key>key .+?) "
    + " ".join(f"{name}=(?P<{name}>{VALUE})" for name in FIELDS)
    + r"(?: - (?P<detail>.*))?$"
)

OURS = TaskIdentity("forecasts", "refresh_forecasts", "manual__2026-12-01T19:14:46.141234+00:00", -1, "staging", "w2")
THEIRS = TaskIdentity("forecasts", "refresh_forecasts", "manual__2026-12-01T19:14:46.141234+00:00", -1, "prod-eu", "w2")


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def _line(self, message: str, *args: Any) -> None:
        self.lines.append(message % args if args else message)

    info = warning = error = _line

    def outcome(self) -> re.Match[str]:
        found = [line for line in self.lines if line.startswith("pglock outcome=")]
        assert len(found) == 1, self.lines
        match = OUTCOME.match(found[0])
        assert match is not None, f"does not parse: {found[0]}"
        return match


def _guard(hook: Any, name: str, log: Lines, **policy: Any) -> LockGuard:
    rules = policy.pop("rules", None)
    return LockGuard(
        hook.database,
        LockKey.from_name(name),
        LockPolicy(**policy),
        application_name=OURS.application_name(),
        logger=log,
        rules=rules,
    )


@pytest.fixture
def held_by_prod(holder_hook: Any) -> Iterator[tuple[str, int]]:
    held = holder_hook.acquire("outcome/busy", application_name=THEIRS.application_name())
    assert held is not None
    try:
        yield "outcome/busy", held.server.backend_pid
    finally:
        held.release()
        held.close()


def _assert_own_fields(match: re.Match[str], database: str) -> None:
    assert match["deployment"] == "staging" and match["host"] == "w2"
    assert (match["conn"] == "dsn" and match["database"] == repr(database)) or match["database"] == database
    assert re.fullmatch(r"\d+\.\d{3}s", match["waited"])


def test_completed(hook: Any, admin: Any) -> None:
    log = Lines()
    with _guard(hook, "outcome/completed", log):
        pass
    m = log.outcome()
    assert m["outcome"] == "completed" and m["key"].startswith("key 'outcome/completed' (int64 ")
    _assert_own_fields(m, hook.resolve_settings().params["dbname"])
    assert m["pid"].isdigit() and m["held"].endswith("s") and m["held"] != "-"
    assert (m["holder_pid"], m["holder_deployment"], m["holder_host"]) == ("-", "-", "-")
    assert m["detail"] is None


@pytest.mark.parametrize(("on_busy", "outcome"), [("skip", "skipped"), ("fail", "failed"), ("defer", "deferred")])
def test_busy_names_the_holder_and_its_deployment(
    hook: Any, admin: Any, held_by_prod: tuple[str, int], on_busy: str, outcome: str
) -> None:
    name, holder_pid = held_by_prod
    log = Lines()
    timeout = {"wait_timeout": 60} if on_busy == "defer" else {}  # the adapter defers; the guard tries once
    with pytest.raises(LockBusyError), _guard(hook, name, log, on_busy=on_busy, **timeout):
        pass
    m = log.outcome()
    assert m["outcome"] == outcome
    _assert_own_fields(m, hook.resolve_settings().params["dbname"])
    assert m["pid"] == "-" and m["held"] == "-" and m["server"] != "-"
    assert (m["holder_pid"], m["holder_deployment"], m["holder_host"]) == (str(holder_pid), "prod-eu", "w2")
    assert m["detail"].startswith("busy: ") and "of deployment 'prod-eu' on host 'w2'" in m["detail"]


def test_waited_then_skipped(hook: Any, admin: Any, held_by_prod: tuple[str, int]) -> None:
    log = Lines()
    with pytest.raises(LockBusyError), _guard(hook, held_by_prod[0], log, on_busy="wait", wait_timeout=0.2):
        pass
    m = log.outcome()
    assert m["outcome"] == "skipped" and float(m["waited"][:-1]) >= 0.2 and m["holder_deployment"] == "prod-eu"


def test_skipped_once_per(hook: Any, admin: Any) -> None:
    from airflow_pglock.pg.schema import migrate

    with hook.database.connect("pglock-tests init-db") as conn:
        migrate(conn)
    first, second = Lines(), Lines()
    try:
        with _guard(hook, "outcome/once", first, rules=RunRules(period="2026-12-01")):
            pass
        with pytest.raises(AlreadyDoneError), _guard(hook, "outcome/once", second, rules=RunRules(period="2026-12-01")):
            pass
    finally:  # the session's test database has no registry for the tests after this one
        admin.execute("DROP SCHEMA pglock CASCADE")
    m = second.outcome()
    assert m["outcome"] == "skipped" and m["detail"].startswith("done: ") and m["pid"].isdigit()
    assert first.outcome()["outcome"] == "completed"


def test_failed_by_the_work(hook: Any, admin: Any) -> None:
    log = Lines()
    with pytest.raises(ZeroDivisionError), _guard(hook, "outcome/failed", log):
        1 / 0  # noqa: B018
    m = log.outcome()
    assert m["outcome"] == "failed" and m["pid"].isdigit() and m["detail"].startswith("ZeroDivisionError")


def test_failed_to_connect_names_the_configured_target(admin: Any) -> None:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    hook = AdvisoryLockHook(dsn="host=127.0.0.1 port=1 dbname='no such db' connect_timeout=2")
    log = Lines()
    with pytest.raises(LockConnectionError), _guard(hook, "outcome/unreachable", log):
        pass
    m = log.outcome()
    assert m["outcome"] == "failed" and m["pid"] == "-" and m["held"] == "-"
    assert m["database"] == "'no such db'" and m["server"] == "127.0.0.1:1" and m["conn"] == "dsn"
    assert m["detail"].startswith("LockConnectionError")


def test_lost(hook: Any, admin: Any) -> None:
    log = Lines()
    with _guard(hook, "outcome/lost", log, on_lost="warn") as lock:
        admin.execute("SELECT pg_terminate_backend(%s)", (lock.backend_pid,))
    m = log.outcome()
    assert m["outcome"] == "lost" and m["pid"].isdigit() and m["held"] != "-"


def test_the_documented_parser_is_the_one_the_provider_and_these_tests_use() -> None:
    from pathlib import Path

    from airflow_pglock.outcome import OUTCOME_LINE

    page = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    section = page.split("## The outcome line", 1)[1]
    snippet = section.split("```python", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {"re": re}
    exec(snippet, namespace)  # the documented code, as a reader would paste it
    assert namespace["OUTCOME"].pattern == OUTCOME_LINE.pattern == OUTCOME.pattern.removeprefix("^")
