"""`python3 devtools/dev.py test` (the README's command) leaves the checkout as it was.

Recording the version matrix writes matrix-results/*.json, which are tracked: only a run
that asks for it (PGLOCK_MATRIX_RESULTS, as .ci/run sets it) records. The pytest command
dev.py would start is captured instead of run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from devtools import dev

ROOT = Path(__file__).resolve().parents[2]


class _Started:
    """Stands for a pytest process dev.py would start (nothing is run)."""

    def __init__(self, args: list[str], **kwargs: Any) -> None:
        assert args[1:3] == ["-m", "pytest"], args
        self.args, self.env = args, kwargs["env"]

    def wait(self) -> int:
        return 0


def _pytest_runs_of(monkeypatch: pytest.MonkeyPatch, *argv: str) -> list[_Started]:
    started: list[_Started] = []

    def call(args: list[str], **kwargs: Any) -> int:
        started.append(_Started(args, **kwargs))
        return 0

    def popen(args: list[str], **kwargs: Any) -> _Started:
        started.append(_Started(args, **kwargs))
        return started[-1]

    monkeypatch.setattr(dev, "ensure_environment", lambda: Path("/venv/bin/python"))
    monkeypatch.setattr(dev, "_call", call)
    monkeypatch.setattr(dev.subprocess, "Popen", popen)
    assert dev.main(list(argv)) == 0
    return started


def _pytest_env_of(monkeypatch: pytest.MonkeyPatch, *argv: str) -> dict[str, str]:
    """The environment of the pytest run(s) dev.py starts (the same for every part of a whole run)."""
    runs = _pytest_runs_of(monkeypatch, *argv)
    recorded = {(run.env.get("PGLOCK_MATRIX_RESULTS"), run.env.get("PGLOCK_MATRIX_SUITE")) for run in runs}
    assert len(recorded) == 1, recorded
    return runs[0].env


def test_the_whole_suite_runs_every_test_file_once_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dev.suite_parts_problem() is None
    runs = _pytest_runs_of(monkeypatch, "test")
    assert [run.env["PGLOCK_SUITE_PART"] for run in runs] == ["1/2", "2/2"]
    assert len({run.env["PGLOCK_TEST_DATABASE"] for run in runs}) == 2  # apart on a shared server
    every_file = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("*/test_*.py"))
    ran: list[str] = []
    for run in runs:
        ignored = {arg.removeprefix("--ignore=") for arg in run.args if arg.startswith("--ignore=")}
        for entry in (arg for arg in run.args if arg.startswith("tests/")):
            files = [entry] if entry.endswith(".py") else [f for f in every_file if f.startswith(entry + "/")]
            ran += [file for file in files if file not in ignored]
    assert sorted(ran) == every_file


@pytest.mark.parametrize(
    ("parts", "problem"),
    [
        ((("tests/unit",), ("tests/unit",)), "runs twice ['tests/unit/test_"),
        ((("tests/unit", "tests/nowhere.py"),), "is not a test directory or file ['tests/nowhere.py']"),
        ((("tests/integration",),), "leaves out ['tests/airflow/"),
    ],
)
def test_suite_parts_that_would_not_run_every_file_once_are_named(
    monkeypatch: pytest.MonkeyPatch, parts: tuple[tuple[str, ...], ...], problem: str
) -> None:
    monkeypatch.setattr(dev, "SUITE_PARTS", parts)
    assert problem in (dev.suite_parts_problem() or "")


def test_a_file_moved_to_another_part_leaves_its_directory_there(monkeypatch: pytest.MonkeyPatch) -> None:
    moved = "tests/unit/test_dev_environment.py"
    monkeypatch.setattr(dev, "SUITE_PARTS", (("tests/unit",), (moved,)))
    assert dev.suite_part_arguments(("tests/unit",)) == ["tests/unit", f"--ignore={moved}"]
    assert dev.suite_part_arguments((moved,)) == [moved]


@pytest.mark.parametrize("argv", [("test",), ("matrix",)])
def test_a_plain_run_records_nothing_into_the_checkout(monkeypatch: pytest.MonkeyPatch, argv: tuple[str]) -> None:
    monkeypatch.delenv("PGLOCK_MATRIX_RESULTS", raising=False)
    env = _pytest_env_of(monkeypatch, *argv)
    assert "PGLOCK_MATRIX_RESULTS" not in env


@pytest.mark.parametrize(("argv", "suite"), [(("test",), "full suite"), (("matrix",), "matrix")])
def test_a_run_that_asks_records_where_it_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: tuple[str], suite: str
) -> None:
    monkeypatch.setenv("PGLOCK_MATRIX_RESULTS", str(tmp_path))
    monkeypatch.delenv("PGLOCK_LINE_INDEPENDENT_ONCE", raising=False)  # .ci/run sets it on the non-default lines
    env = _pytest_env_of(monkeypatch, *argv)
    assert env["PGLOCK_MATRIX_RESULTS"] == str(tmp_path) and env["PGLOCK_MATRIX_SUITE"] == suite


def test_a_line_that_skips_the_line_independent_tests_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PGLOCK_MATRIX_RESULTS", str(tmp_path))
    monkeypatch.setenv("PGLOCK_LINE_INDEPENDENT_ONCE", "1")
    env = _pytest_env_of(monkeypatch, "test")
    assert env["PGLOCK_MATRIX_SUITE"].startswith("full suite (") and "default line" in env["PGLOCK_MATRIX_SUITE"]


def test_a_partial_test_run_never_records(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PGLOCK_MATRIX_RESULTS", str(tmp_path))
    env = _pytest_env_of(monkeypatch, "test", "tests/unit")
    assert "PGLOCK_MATRIX_RESULTS" not in env  # a part of the suite would misstate the versions table


def test_ci_asks_for_the_record() -> None:
    """.ci/run records every leg (then renders docs/airflow-versions.md from them)."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'export PGLOCK_MATRIX_RESULTS="$PWD/matrix-results"' in ci
    assert "python3 devtools/dev.py test\n" in ci  # the README's command, unchanged


def test_the_parts_of_a_whole_run_record_one_file(tmp_path: Path) -> None:
    """Each part writes what it saw; the last to end merges them into the one record of the run."""
    import json
    import os
    import subprocess
    import sys

    # Never this run's own recording (.ci/run's whole suite sets both): a nested pytest that inherits
    # them writes this part's partial record, and may merge it with the other part's too early.
    outside = {k: v for k, v in os.environ.items() if k not in ("PGLOCK_MATRIX_RESULTS", "PGLOCK_SUITE_PART")}
    env = {**outside, "PGLOCK_MATRIX_RESULTS": str(tmp_path), "PGLOCK_MATRIX_SUITE": "full suite"}
    for number, path in enumerate(["tests/unit/test_stable_keys.py", "tests/unit/test_keys.py"], 1):
        part = {**env, "PGLOCK_SUITE_PART": f"{number}/2"}
        ran = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
            cwd=ROOT,
            env=part,
            capture_output=True,
        )
        assert ran.returncode == 0, ran.stdout[-2000:]
        if number == 1:
            assert not list(tmp_path.glob("*.json"))  # nothing recorded before the last part ends
    [record] = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    alone = [
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
            cwd=ROOT,
            env=outside,
            capture_output=True,
        ).stdout.decode()
        for path in ["tests/unit/test_stable_keys.py", "tests/unit/test_keys.py"]
    ]
    passed = sum(int(text.split(" passed")[0].split()[-1]) for text in alone)
    assert record["passed"] == passed and record["failed"] == 0
    assert record["features"]["stable-keys"]["outcome"] == "passed"
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in tmp_path.glob("*.json")]  # no part left


def test_ctrl_c_lets_the_command_dev_py_runs_clean_up_before_dev_py_ends(tmp_path: Path) -> None:
    """Ctrl-C reaches the terminal's whole process group: dev.py must wait while the command it
    runs cleans up (the demo stops its PostgreSQL), not kill it at once as ``subprocess.call`` did."""
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    marker, started = tmp_path / "cleaned-up", tmp_path / "started"
    child = textwrap.dedent(
        f"""
        import pathlib, time
        pathlib.Path({str(started)!r}).touch()
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            time.sleep(1.5)  # longer than subprocess.call's quarter of a second
            pathlib.Path({str(marker)!r}).touch()
        """
    )
    wrapper = textwrap.dedent(
        f"""
        import sys
        from devtools import dev
        try:
            dev._call([sys.executable, "-c", {child!r}])
        except KeyboardInterrupt:
            sys.exit(130)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", wrapper],
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for _ in range(300):
        if started.exists():
            break
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=60) == 130
    assert marker.exists(), "dev.py ended before the interrupted command had cleaned up"
