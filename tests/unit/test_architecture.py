"""The layers hold, and docs/architecture.md says what the code is.

The import-linter contracts of pyproject.toml pass (imports go one way, no circle, type-only
imports included), and the page's tables of layers and modules are what
``devtools/architecture.py`` generates from those contracts and from the code: a module
that is gone, a new one, a changed first docstring sentence or an import added or dropped
makes the page stale, and this test says to regenerate it.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import architecture

ROOT = Path(__file__).resolve().parents[2]

#: import-linter (and its grimp) is the `lint` extra, installed with the default line only: the
#: imports of the package are the same on every Airflow line.
needs_import_linter = pytest.mark.skipif(
    importlib.util.find_spec("grimp") is None,
    reason="import-linter is installed in the default environment only (pyproject's `lint` extra); "
    "the import layers do not depend on the Airflow line",
)


@needs_import_linter
def test_the_import_layers_hold() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint_imports)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@needs_import_linter
def test_the_architecture_page_matches_the_code() -> None:
    assert architecture.written() == architecture.render(), (
        "docs/architecture.md's layer tables are stale: run `python3 devtools/dev.py architecture-doc` and commit"
    )


@needs_import_linter
def test_every_module_of_the_package_is_in_a_layer() -> None:
    """The contracts are exhaustive: a new module must be placed in a layer (and so in the page)."""
    rendered = architecture.render()
    modules = architecture.imports()
    missing = [
        name
        for name in modules
        if name != architecture.PACKAGE
        and not name.endswith("._version")
        and f"`{name.removeprefix(architecture.PACKAGE + '.')}`" not in rendered
    ]
    assert missing == [], f"modules in no layer of the page: {missing}"


def test_every_test_the_docs_name_exists() -> None:
    """``tests/x.py::test_y`` (or a following ``::test_z``) in the docs names a test that exists."""
    missing = []
    for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        current: Path | None = None
        for found in re.finditer(r"`(tests/[\w/]+\.py)(?:::(\w+))?`|`::(\w+)`", doc.read_text()):
            if found.group(1):
                current = ROOT / found.group(1)
                if not current.exists():
                    missing.append(f"{doc.name}: {found.group(1)}")
                    continue
            name = found.group(2) or found.group(3)
            if name and current is not None and current.exists() and f"def {name}(" not in current.read_text():
                missing.append(f"{doc.name}: {current.relative_to(ROOT)}::{name}")
    assert missing == [], f"the docs name tests that do not exist: {missing}"
