"""`python3 devtools/dev.py test` (the README's command) leaves the checkout as it was.

Recording the version matrix writes matrix-results/*.json, which are tracked: only a run
that asks for it (PGLOCK_MATRIX_RESULTS, as .ci/run sets it) records. The pytest command
dev.py would start is captured instead of run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from devtools import dev

ROOT = Path(__file__).resolve().parents[2]


def _pytest_env_of(monkeypatch: pytest.MonkeyPatch, *argv: str) -> dict[str, str]:
    started: list[dict[str, str]] = []

    def call(args: list[str], **kwargs: Any) -> int:
        assert args[1:3] == ["-m", "pytest"], args
        started.append(kwargs["env"])
        return 0

    monkeypatch.setattr(dev, "ensure_environment", lambda: Path("/venv/bin/python"))
    monkeypatch.setattr(dev.subprocess, "call", call)
    assert dev.main(list(argv)) == 0
    (env,) = started
    return env


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
