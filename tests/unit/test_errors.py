"""The error family: every error airflow-pglock raises is a PgLockError (issue 17 items 4 and 5)."""

from __future__ import annotations

import ast
import builtins
import re
import uuid
from pathlib import Path

import pytest

from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError, PgLockError
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_pglock"


def test_a_bad_key_is_a_pglock_error_and_a_value_error() -> None:
    with pytest.raises(PgLockError) as error:
        LockKey.coerce(True)
    assert isinstance(error.value, InvalidLockKeyError) and isinstance(error.value, ValueError)
    with pytest.raises(PgLockError, match=str(2**63)):
        LockKey.from_int(2**63)


@pytest.mark.parametrize("pool_mode", ["sesion", "", "Session", 1])
def test_a_bad_pool_mode_is_refused_naming_the_value_before_any_connection(pool_mode: object) -> None:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    with pytest.raises(LockConfigurationError, match=f"pool_mode must be .*got {pool_mode!r}"):
        AdvisoryLockHook(dsn="host=nowhere.invalid", pool_mode=pool_mode)  # type: ignore[arg-type]


def test_a_pool_mode_declared_to_a_dsn_hook_is_in_its_settings() -> None:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    assert AdvisoryLockHook(dsn="host=nowhere.invalid").resolve_settings().pool_mode is None
    hook = AdvisoryLockHook(dsn="host=nowhere.invalid", pool_mode="session")
    assert hook.resolve_settings().pool_mode == "session"


@pytest.mark.parametrize("dsn", ["", "   ", 123, ["x"]])
def test_an_empty_or_non_str_dsn_is_refused_naming_it_before_any_connection(dsn: object) -> None:
    """Review -57: dsn="" connected to libpq's defaults (a local socket, the OS user's database),
    where a lock excludes nobody else; dsn=123 raised a builtin AttributeError."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    with pytest.raises(LockConfigurationError, match=f"DSN must be a non-empty .*got {re.escape(repr(dsn))}"):
        AdvisoryLockHook(dsn=dsn).acquire("k")  # type: ignore[arg-type]


def test_a_liveness_that_is_not_one_is_refused_naming_it() -> None:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    named = r"liveness must be a Liveness \(e.g. Liveness\(lease=60\)\) or None, got 60"
    with pytest.raises(LockConfigurationError, match=named):
        AdvisoryLockHook(dsn="host=nowhere.invalid", liveness=60)  # type: ignore[arg-type]


@pytest.mark.parametrize("lease", [0, 1, float("nan"), "30", True])
def test_a_bad_lease_is_a_pglock_error_naming_the_value(lease: object) -> None:
    with pytest.raises(LockConfigurationError, match="lease must be") as error:
        Liveness(lease)  # type: ignore[arg-type]
    assert isinstance(error.value, PgLockError) and isinstance(error.value, ValueError)


def _builtin_raises(path: Path) -> list[str]:
    """``raise ValueError(...)``-style statements: a built-in exception raised by the provider."""
    found = []
    tree = ast.parse(path.read_text())
    # A module's __getattr__ (PEP 562) ends an unknown name's lookup with AttributeError: the protocol.
    protocol = {
        id(raised)
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef) and function.name == "__getattr__"
        for raised in ast.walk(function)
    }
    for node in ast.walk(tree):
        if id(node) in protocol:
            continue
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(target, ast.Name) and isinstance(getattr(builtins, target.id, None), type):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} raise {target.id}")
    return found


def test_the_provider_raises_no_builtin_exception() -> None:
    """exceptions.py promises `except PgLockError` catches every error of the provider."""
    offenders = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _builtin_raises(path)]
    assert offenders == []


@pytest.mark.parametrize(
    ("tenant", "shown"),
    [({"a": 1}, "{'a': 1} (dict)"), ([1, 2], "[1, 2] (list)"), (1.5, "1.5 (float)"), (True, "True (bool)"),
     (object, "(type)")],
)  # fmt: skip
def test_a_tenant_without_a_stable_text_form_is_refused(tenant: object, shown: str) -> None:
    with pytest.raises(InvalidLockKeyError, match="tenant must be a str, an int or a UUID") as error:
        LockKey.for_task("tenant_exports", "export_one", tenant)
    assert shown in str(error.value) and "'tenant_exports/export_one'" in str(error.value)


def test_scalar_tenants_keep_their_text() -> None:
    tenant_id = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert LockKey.for_task("d", "t", 42).name == "d/t/42"
    assert LockKey.for_task("d", "t", "acme").name == "d/t/acme"
    assert LockKey.for_task("d", "t", tenant_id).name == f"d/t/{tenant_id}"
    with pytest.raises(InvalidLockKeyError, match="non-empty"):
        LockKey.for_task("d", "t", "  ")
