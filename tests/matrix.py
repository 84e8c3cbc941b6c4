"""The version matrix: which public feature each test shows working, recorded per Airflow line and Python.

A test that shows a feature carries ``@pytest.mark.matrix("<feature>")``; ``pytest -m matrix``
(``python3 devtools/dev.py matrix``) runs exactly those tests. A feature that needs a newer
Airflow also has a test of its absence on older lines; both carry ``since=(major, minor)``,
and on an older line the feature is recorded as absent when that test passed.

When ``PGLOCK_MATRIX_RESULTS`` names a directory (``.ci/run`` sets it to matrix-results/;
``devtools/dev.py`` passes it on to ``matrix`` and to a whole ``test`` run, and leaves it out
otherwise), the session writes ``airflow-<line>-py<X.Y>.json`` there;
``python3 devtools/dev.py versions-doc`` renders them into docs/airflow-versions.md.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import platform
import time
from collections.abc import Generator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

#: feature id -> what the versions page calls it (in this order).
FEATURES: dict[str, str] = {
    "provider": "provider registers (`airflow providers list`, `@task.advisory_lock`)",
    "task-session": "`@task.advisory_lock`: runs when free, skips when busy (session mode)",
    "task-transaction": '`@task.advisory_lock(mode="transaction")`',
    "tenant-arg": "`tenant_arg` on a mapped task",
    "stable-keys": "the same key numbers on every Python (names, tenants of each accepted type, pools, int64, pairs)",
    "guarded": "`guarded(BashOperator(...))`",
    "sensor-poke": "`AdvisoryLockSensor` (poke, reschedule)",
    "sensor-deferrable": "`AdvisoryLockSensor(deferrable=True)`",
    "branch": "`@advisory_lock` under `@task.branch`",
    "every-entry-point": "one DAG file using every entry point parses and runs",
    "examples": "the example DAGs in `dags/` parse",
    "parse-time": "parsing a DAG file loads neither psycopg nor the lock machinery; bad options refused",
    "console-script": "`airflow-pglock` console script (locks, key, doctor, init-db)",
    "cli-group": "`airflow pglock ...` (Airflow 3.2+)",
    "ui-page": "Browse → Advisory locks page (Airflow 3.1+)",
    "lock-scope": "`advisory_lock_scope`: one lock over a task group (Airflow 3.0+; refused at parse time before)",
    "deferrable-guard": "`guarded(deferrable operator)`: the hold follows the task into the triggerer and back "
    "(Airflow 3.0+; refused at parse time before)",
    "work-signals": "Airflow's signals in guarded work: a skip, a sensor's reschedule, a branch's downstream "
    "skips (Human-in-the-loop operators refused on 3.3+)",
}

_outcomes: dict[str, list[tuple[str, str]]] = {}
_since: dict[str, tuple[int, int]] = {}
_totals = {"passed": 0, "failed": 0, "skipped": 0}
_started = time.monotonic()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for marker in item.iter_markers("matrix"):
            unknown = [feature for feature in marker.args if feature not in FEATURES]
            if unknown or not marker.args:
                expected = ", ".join(FEATURES)
                given = unknown or "none"
                raise pytest.UsageError(f"{item.nodeid}: matrix features {given}, expected some of: {expected}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    decisive = report.when == "call" or (report.when == "setup" and not report.passed) or report.failed
    if not decisive:
        return
    result = "failed" if report.failed else "skipped" if report.skipped else "passed"
    _totals[result] += 1
    reason = str(report.longrepr[2]) if report.skipped and isinstance(report.longrepr, tuple) else ""
    for marker in item.iter_markers("matrix"):
        for feature in marker.args:
            _outcomes.setdefault(feature, []).append((result, reason.removeprefix("Skipped: ")))
            if "since" in marker.kwargs:
                _since[feature] = tuple(marker.kwargs["since"])  # type: ignore[assignment]


def _summary(
    feature: str,
    airflow: tuple[int, int],
    outcomes: dict[str, list[tuple[str, str]]],
    since_of: dict[str, tuple[int, int]],
) -> dict[str, str]:
    results = outcomes[feature]
    entry = {"label": FEATURES[feature]}
    if any(result == "failed" for result, _ in results):
        return {**entry, "outcome": "failed"}
    if any(result == "passed" for result, _ in results):
        since = since_of.get(feature)
        if since is not None and airflow < since:
            return {**entry, "outcome": "absent", "detail": f"absent (needs Airflow {since[0]}.{since[1]})"}
        return {**entry, "outcome": "passed"}
    return {**entry, "outcome": "skipped", "detail": results[0][1]}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    directory = os.environ.get("PGLOCK_MATRIX_RESULTS")
    if not directory:
        return
    airflow_version = version("apache-airflow")
    airflow = tuple(int(part) for part in airflow_version.split(".")[:2])
    python = platform.python_version()
    path = Path(directory) / f"airflow-{airflow[0]}.{airflow[1]}-py{'.'.join(python.split('.')[:2])}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    part = os.environ.get("PGLOCK_SUITE_PART")  # "k/n": this session is part k of n of one run (dev.py)
    if part is None:
        if _outcomes:
            _write(path, airflow_version, python, _outcomes, _since, _totals, time.monotonic() - _started)
        return
    number, count = (int(n) for n in part.split("/"))
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the last part to end merges them all
        raw = {"outcomes": _outcomes, "since": _since, "totals": _totals}
        path.with_suffix(f".part{number}").write_text(json.dumps(raw))
        parts = [path.with_suffix(f".part{n}") for n in range(1, count + 1)]
        if not all(p.exists() for p in parts):
            return
        outcomes: dict[str, list[tuple[str, str]]] = {}
        since: dict[str, tuple[int, int]] = {}
        totals = dict.fromkeys(_totals, 0)
        for p in parts:
            data = json.loads(p.read_text())
            for feature, results in data["outcomes"].items():
                outcomes.setdefault(feature, []).extend((str(r[0]), str(r[1])) for r in results)
            since.update({feature: (int(v[0]), int(v[1])) for feature, v in data["since"].items()})
            for name, value in data["totals"].items():
                totals[name] += int(value)
            p.unlink()
        started = float(os.environ.get("PGLOCK_SUITE_STARTED", time.time()))
        if outcomes:
            _write(path, airflow_version, python, outcomes, since, totals, time.time() - started)
    path.with_suffix(".lock").unlink(missing_ok=True)


def _write(
    path: Path,
    airflow_version: str,
    python: str,
    outcomes: dict[str, list[tuple[str, str]]],
    since: dict[str, tuple[int, int]],
    totals: dict[str, int],
    seconds: float,
) -> None:
    airflow = tuple(int(part) for part in airflow_version.split(".")[:2])
    record = {
        "airflow": airflow_version,
        "python": python,
        "suite": os.environ.get("PGLOCK_MATRIX_SUITE", "pytest -m matrix"),
        "recorded": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": round(seconds),
        **totals,
        "features": {
            feature: _summary(feature, airflow, outcomes, since)  # type: ignore[arg-type]
            for feature in FEATURES
            if feature in outcomes
        },
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
