"""The documentation site builds with warnings as errors, and the reference misses no parameter.

``mkdocs build --strict`` fails on a nav entry without its page, a broken link or anchor
between pages, a snippet that does not exist, or a docstring mkdocstrings cannot read.
The reference pages are generated from the docstrings, so the second test checks that
every parameter of every public class and function they show has its ``:param`` line.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def _mkdocs_config() -> dict[str, Any]:
    # mkdocs.yml may use !!python/name tags in the future; plain YAML today.
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_every_nav_entry_has_its_page() -> None:
    pages = _nav_pages(_mkdocs_config()["nav"])
    assert len(pages) >= 20
    missing = [page for page in pages if not (DOCS / page).is_file()]
    assert missing == [], f"nav entries without a page in docs/: {missing}"
    assert "changelog.md" in pages and (ROOT / "CHANGELOG.md").is_file()


def test_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    warnings = [line for line in result.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert result.returncode == 0 and warnings == [], "\n".join(warnings) or result.stderr[-3000:]
    # The reference is generated from the code: the decorator page shows the operator's parameters.
    page = (tmp_path / "site" / "reference" / "decorators" / "index.html").read_text()
    for parameter in ("tenant_arg", "on_busy", "wait_timeout", "on_lost", "on_error", "lease"):
        assert re.search(rf"<code>{parameter}</code>|>{parameter}<", page), f"{parameter} missing from the reference"
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text()
    assert "First release" in changelog  # the snippet of CHANGELOG.md was included


def _reference_objects() -> list[tuple[str, Any]]:
    """(qualified name, object) of every class and function the reference pages render."""
    found: list[tuple[str, Any]] = []
    for page in sorted((DOCS / "reference").glob("*.md")):
        text = page.read_text()
        for block in re.finditer(r"^::: ([\w.]+)\n((?:    .*\n?)*)", text, re.MULTILINE):
            module = importlib.import_module(block[1])
            members = re.findall(r"^\s+- (\w+)$", block[2], re.MULTILINE)
            names = members or [n for n in getattr(module, "__all__", dir(module)) if not n.startswith("_")]
            for name in names:
                value = getattr(module, name)
                if getattr(value, "__module__", None) == module.__name__ or members:
                    found.append((f"{block[1]}.{name}", value))
    return found


#: Constructor arguments of classes that only the provider builds (users receive them): their
#: attributes are documented (``:ivar``), these arguments are not part of the public API.
BUILT_INTERNALLY = {"airflow_pglock.handle.LockHandle": {"held", "lost_reason"}}


def _undocumented(obj: Any) -> list[str]:
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return []
        target: Any = obj.__init__
        docstring = (obj.__doc__ or "") + (obj.__init__.__doc__ or "")
    else:
        target, docstring = obj, obj.__doc__ or ""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    skip = {"self", "cls", "python_callable", "op_args", "op_kwargs"} if inspect.isclass(obj) else {"self", "cls"}
    skip |= BUILT_INTERNALLY.get(f"{obj.__module__}.{obj.__qualname__}", set())
    return [
        p.name
        for p in parameters
        if p.name not in skip
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and not re.search(rf":(param|ivar) {p.name}:", docstring)
    ]


def test_every_public_parameter_in_the_reference_is_documented() -> None:
    objects = _reference_objects()
    assert len(objects) >= 12
    gaps = {name: missing for name, obj in objects if (missing := _undocumented(obj))}
    assert gaps == {}, f"parameters without a :param line (the reference shows them undocumented): {gaps}"


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("howto-*.md")))
def test_howto_pages_are_in_the_nav(page: str) -> None:
    assert page in _nav_pages(_mkdocs_config()["nav"])
