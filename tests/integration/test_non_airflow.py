"""docs/howto-non-airflow-service.md: a Python service locks without importing Airflow (issue 17 item 8).

The how-to's block runs as written (only the DSN is this test's) in a fresh interpreter, which
then reports whether Airflow was imported. The hook's own cost, stated in the how-to, is
shown the same way: importing it imports Airflow and creates the Airflow home.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from tests.helpers import advisory_locks, held_lock

ROOT = Path(__file__).resolve().parents[2]
HOWTO = ROOT / "docs" / "howto-non-airflow-service.md"
DOC_DSN = "postgresql://billing@db/locks"


def _howto_block() -> str:
    block = re.search(r"<!-- without-airflow[^>]*-->\n```python\n(.*?)```", HOWTO.read_text(), re.DOTALL)
    assert block is not None, "the how-to lost its without-airflow block"
    assert DOC_DSN in block[1]
    return block[1]


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def _plain_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["HOME"] = str(home)
    return env


def test_the_howto_locks_without_importing_airflow(dsn: str, admin: Any, tmp_path: Path) -> None:
    block = _howto_block().replace(DOC_DSN, dsn)
    script = block + textwrap.dedent(
        """
        import sys
        print("airflow imported:", any(m == "airflow" or m.startswith("airflow.") for m in sys.modules))
        """
    )
    env = _plain_env(tmp_path)
    free = _run(script, env)
    assert free.returncode == 0, free.stderr
    assert "airflow imported: False" in free.stdout
    assert not (tmp_path / "airflow").exists()
    # The same key as the provider's: a lock held through the hook makes the service back off.
    with held_lock(AdvisoryLockHook(dsn=dsn), "billing/close-month") as held:
        assert held is not None
        busy = _run(script, env)
    assert busy.returncode == 1 and "someone else is closing the month" in busy.stderr
    assert advisory_locks(admin) == []


def test_importing_the_hook_imports_airflow_and_creates_its_home(tmp_path: Path) -> None:
    """What the how-to says of the hook path (no timing asserted: that is for benchmarks)."""
    env = _plain_env(tmp_path)
    result = _run(
        "import sys; import airflow_pglock.hooks.advisory_lock; print('airflow' in sys.modules)",
        env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("True")
    assert (tmp_path / "airflow" / "logs").is_dir()
