#!/usr/bin/env python3
"""Set up and run airflow-pglock's two commands with nothing but Python 3.11+.

    python3 devtools/dev.py demo    # two "deployments" run a guarded DAG at once
    python3 devtools/dev.py test    # the whole test suite (extra args go to pytest)
    PGLOCK_AIRFLOW=2.11 python3 devtools/dev.py test    # the same suite on Airflow 2.11 (.venv-2.11)
    python3 devtools/dev.py lint    # ruff + mypy
    python3 devtools/dev.py bench   # benchmarks -> docs/benchmarks.md (a few minutes; needs redis-server)

The first run creates .venv and installs the provider (editable) with the pinned
versions in constraints/airflow-3.3.txt; later runs reuse it until pyproject.toml or
the constraints change. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AIRFLOW_LINE = os.environ.get("PGLOCK_AIRFLOW", "3.3")
# One virtualenv per Airflow line: .venv for the default (3.3), .venv-<line> for the others.
VENV = Path(os.environ.get("PGLOCK_VENV", ROOT / (".venv" if AIRFLOW_LINE == "3.3" else f".venv-{AIRFLOW_LINE}")))
CONSTRAINTS = ROOT / "constraints" / f"airflow-{AIRFLOW_LINE}.txt"
EXTRAS = "test,docs"
# The benchmark's extra packages (pyproject's `bench` extra), pinned for reproducible numbers.
BENCH_PINS = ("PALs==0.4.0", "python-redis-lock==4.0.1", "redis==8.1.0", "pyinstrument==5.1.3")


def _python() -> Path:
    return VENV / "bin" / "python"


def _stamp() -> str:
    digest = hashlib.sha256()
    for path in (ROOT / "pyproject.toml", CONSTRAINTS):
        digest.update(path.read_bytes())
    digest.update(sys.version.encode())
    return digest.hexdigest()


def ensure_environment() -> Path:
    if sys.version_info < (3, 11):  # noqa: UP036 - this script runs on whatever python3 is first
        sys.exit(f"airflow-pglock needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not CONSTRAINTS.exists():
        sys.exit(f"no constraints file for Airflow {AIRFLOW_LINE}: {CONSTRAINTS} (see PGLOCK_AIRFLOW)")
    stamp_file = VENV / ".pglock-installed"
    if stamp_file.exists() and stamp_file.read_text() == _stamp() and _python().exists():
        return _python()
    if not _python().exists():
        print(f"[dev] creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=False).create(VENV)
    print(f"[dev] installing airflow-provider-pglock[{EXTRAS}] with {CONSTRAINTS.name} (first run only)", flush=True)
    pip = [str(_python()), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "-c", str(CONSTRAINTS), "-e", f"{ROOT}[{EXTRAS}]"], check=True, cwd=ROOT)
    stamp_file.write_text(_stamp())
    return _python()


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"demo", "test", "lint", "bench"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    python = str(ensure_environment())
    env = dict(os.environ)
    if command == "demo":
        return subprocess.call([python, str(ROOT / "devtools" / "demo.py"), *rest], cwd=ROOT, env=env)
    if command == "bench":
        installed = subprocess.run([python, "-c", "import pals, redis_lock, redis, pyinstrument"], capture_output=True)
        if installed.returncode != 0:
            print(f"[dev] installing the benchmark's packages: {', '.join(BENCH_PINS)}", flush=True)
            pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-c", str(CONSTRAINTS)]
            subprocess.run([*pip, *BENCH_PINS], check=True, cwd=ROOT)
        env["PGLOCK_BENCH_COMMAND"] = " ".join(["python3 devtools/dev.py bench", *rest])
        return subprocess.call([python, "-m", "benchmarks.run", *rest], cwd=ROOT, env=env)
    if command == "lint":
        ruff = subprocess.call([python, "-m", "ruff", "check", "airflow_pglock", "tests", "devtools", "dags"], cwd=ROOT)
        mypy = subprocess.call([python, "-m", "mypy"], cwd=ROOT)
        return ruff or mypy
    return subprocess.call([python, "-m", "pytest", *rest], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
