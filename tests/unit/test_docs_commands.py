"""The commands the docs tell a new user to type name things that exist (issue 17 items 1 and 8).

Pure text checks; the commands themselves run in tests/packaging/test_package.py (install)
and tests/airflow/test_examples.py (``airflow dags test``).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DAG_ID = re.compile(r"""dag_id\s*=\s*["']([\w.-]+)["']""")
DAG_FUNCTION = re.compile(r"^@dag\(.*\)\ndef (\w+)\(", re.MULTILINE)


def _lines(pattern: str) -> list[tuple[str, str]]:
    found = []
    for page in [*PAGES, *sorted((ROOT / "dags").glob("*.py"))]:
        for line in page.read_text().splitlines():
            if re.search(pattern, line):
                found.append((page.relative_to(ROOT).as_posix(), line.strip()))
    return found


def test_the_index_install_is_marked_as_after_the_first_release() -> None:
    """`pip install airflow-provider-pglock` fails until the first release: never offered as the way today."""
    from_index = [
        (page, line)
        for page, line in _lines(r"pip install .*airflow-provider-pglock")
        if "--find-links" not in line
        and "/" not in line.split("pip install", 1)[1].split("#")[0]
        and "No matching distribution" not in line  # the guide saying that it fails today
    ]
    assert from_index, "the docs no longer mention the index install at all"
    unmarked = [(page, line) for page, line in from_index if "after the first release" not in line.lower()]
    assert unmarked == []


def test_readme_and_getting_started_give_the_same_install_commands() -> None:
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    block = re.search(r"<!-- install-from-checkout[^>]*-->\n```bash\n(.*?)```", guide, re.DOTALL)
    assert block is not None
    install = [line for line in block[1].splitlines() if line.startswith("pip ")]
    readme = (ROOT / "README.md").read_text()
    assert install and all(line in readme for line in install)


def test_every_airflow_dags_test_names_an_example_dag() -> None:
    """... in dags/, or a DAG the page itself defines (getting-started's first DAG, an `@dag` function)."""
    dag_ids = {match for path in (ROOT / "dags").glob("*.py") for match in DAG_ID.findall(path.read_text())}
    assert {"warehouse_maintenance", "warehouse_load", "forecast_refresh"} <= dag_ids
    on_pages = {match for page in PAGES for match in DAG_FUNCTION.findall(page.read_text())}
    assert "first_lock" in on_pages
    dag_ids |= on_pages
    commands = _lines(r"airflow dags test \S+")
    assert commands
    named = [(page, re.search(r"airflow dags test (\S+)", line)[1]) for page, line in commands]  # type: ignore[index]
    assert [(page, dag) for page, dag in named if dag not in dag_ids] == []


def test_the_postgres_provider_floor_is_the_one_pyproject_requires() -> None:
    floor = re.search(r'"apache-airflow-providers-postgres>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert floor is not None
    stated = _lines(r"providers-postgres.*\d+\.\d+\+?")
    wrong = [
        (page, line)
        for page, line in stated
        if page != "docs/airflow-versions.md"  # its table: the versions helper's page (issue 11)
        and not re.search(rf"{re.escape(floor[1])}(\+| or newer)", line)
    ]
    assert wrong == []


def test_the_init_db_output_the_getting_started_guide_shows_is_the_one_printed_now() -> None:
    """Review -58: the guide showed four migrations after a fifth (lock scopes) was added."""
    from airflow_pglock.pg.schema import LATEST_VERSION, MIGRATIONS

    guide = (ROOT / "docs" / "getting-started.md").read_text()
    printed = "\n".join(
        [f"schema pglock: nothing -> version {LATEST_VERSION}"]
        + [f"  applied {m.version}: {m.description}" for m in MIGRATIONS]
    )
    assert f"```\n{printed}\n```" in guide


def test_the_grants_the_docs_list_are_the_ones_init_db_grants() -> None:
    """Review -58: the list a DBA grants by hand from missed the version table and the scopes' grants."""
    from airflow_pglock.pg.schema import MIGRATIONS

    page = (ROOT / "docs" / "once-per-period.md").read_text()
    listed = set(re.findall(r"^GRANT .+;$", page, re.MULTILINE))
    granted = {
        "GRANT USAGE ON SCHEMA pglock TO airflow_tasks;",
        "GRANT SELECT ON pglock.schema_version TO airflow_tasks;",
    }
    granted |= {grant.format(role="airflow_tasks") + ";" for m in MIGRATIONS for grant in m.grants}
    assert listed == granted
