"""The released artifacts: an sdist and a wheel that install into a fresh virtualenv.

``python -m build`` makes the sdist, then builds the wheel *from the sdist*: a file
missing from the sdist would be missing from the wheel, which must hold every module of
the checkout. Then the install commands of docs/getting-started.md run as written in a new
virtualenv with the pinned Airflow 3.3 environment (constraints/airflow-3.3.txt), where
Airflow must discover the provider and the console script must run.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import airflow_pglock

pytestmark = pytest.mark.slow

if not importlib.import_module("airflow_pglock.compat").AIRFLOW_V_3_PLUS:
    pytest.skip(
        "the artifacts are installed into a fresh Airflow 3.3 venv; that runs once, in the 3.3 suite",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[2]
#: What a fresh checkout does not hold (virtualenvs, caches, build output).
_NOT_IN_A_CHECKOUT = (".git", ".venv*", "*.egg-info", "build", "dist", "site", "__pycache__", ".*_cache", ".pglock-*")
CONSTRAINTS = ROOT / "constraints" / "airflow-3.3.txt"
VERSION = airflow_pglock.__version__


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)])  # the sdist, then a wheel built from it
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_sdist_and_wheel_contents(artifacts: dict[str, Path]) -> None:
    sdist, wheel = artifacts["sdist"], artifacts["wheel"]
    assert sdist.name == f"airflow_provider_pglock-{VERSION}.tar.gz"
    assert wheel.name == f"airflow_provider_pglock-{VERSION}-py3-none-any.whl"
    with tarfile.open(sdist) as tar:
        sdist_files = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "airflow_pglock/__init__.py", "airflow_pglock/py.typed"} <= sdist_files
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        dist_info = f"airflow_provider_pglock-{VERSION}.dist-info"
        metadata = whl.read(f"{dist_info}/METADATA").decode()
        entry_points = whl.read(f"{dist_info}/entry_points.txt").decode()
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "airflow_pglock").rglob("*.py")}
    assert sources <= names, f"modules missing from the wheel: {sorted(sources - names)}"
    assert not any(name.startswith(("tests/", "devtools/", "dags/", "benchmarks/")) for name in names)
    assert "airflow_pglock/py.typed" in names
    # The metadata states the supported matrix.
    assert "Requires-Dist: apache-airflow>=2.11" in metadata
    assert "Requires-Python: >=3.10" in metadata
    assert all(f"Classifier: Programming Language :: Python :: 3.{minor}" in metadata for minor in (10, 11, 12, 13))
    assert "Classifier: Framework :: Apache Airflow :: Provider" in metadata
    assert "provider_info = airflow_pglock.get_provider_info:get_provider_info" in entry_points
    assert "airflow-pglock = airflow_pglock.cli.main:main" in entry_points


def _documented_install() -> str:
    """The install commands of docs/getting-started.md, exactly as a reader copies them."""
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    block = re.search(r"<!-- install-from-checkout[^>]*-->\n```bash\n(.*?)```", guide, re.DOTALL)
    assert block is not None, "docs/getting-started.md lost its install-from-checkout block"
    return block[1]


def test_the_documented_install_works_in_a_fresh_airflow_33(tmp_path: Path) -> None:
    """getting-started's install commands, run as written into an Airflow 3.3 environment.

    The distribution is not on PyPI yet: the guide builds a wheel from a checkout (a copy of
    this one, named as in the guide) and installs it with pip; Airflow discovers the provider.
    """
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python, bin_dir = env_dir / "bin" / "python", env_dir / "bin"
    # The reader's Airflow environment: Airflow 3.3 and the Postgres provider, pinned.
    _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(CONSTRAINTS),
          "apache-airflow", "apache-airflow-providers-postgres"])  # fmt: skip
    workdir = tmp_path / "work"
    shutil.copytree(ROOT, workdir / "airflow-pglock", ignore=shutil.ignore_patterns(*_NOT_IN_A_CHECKOUT))
    home = tmp_path / "airflow-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV"))}
    env.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "PATH": f"{bin_dir}:{env['PATH']}"})
    env["PIP_CONSTRAINT"] = str(CONSTRAINTS)  # the environment stays pinned; the commands are the guide's
    commands = _documented_install()
    installed = _run(["bash", "-e", "-o", "pipefail", "-c", commands], env=env, cwd=workdir)
    assert "airflow-provider-pglock" in installed.stdout  # the guide's check: `airflow providers list | grep pglock`
    assert list((workdir / "dist").glob(f"airflow_provider_pglock-{VERSION}-py3-none-any.whl"))

    frozen = _run([str(python), "-m", "pip", "freeze"]).stdout
    assert "apache-airflow==3.3.2" in frozen and f"airflow-provider-pglock=={VERSION}" in frozen
    assert "psycopg-binary==" in frozen  # the [binary] extra
    check = _run([str(python), "-m", "pip", "check"])
    assert "No broken requirements" in check.stdout

    # Outside the checkout, so that nothing is imported from the source tree.
    providers = _run([str(bin_dir / "airflow"), "providers", "list", "-o", "json"], env=env, cwd=tmp_path).stdout
    assert '"package_name": "airflow-provider-pglock"' in providers and f'"version": "{VERSION}"' in providers
    decorators = _run(
        [
            str(python),
            "-c",
            "from airflow.providers_manager import ProvidersManager as P; print(sorted(P().taskflow_decorators))",
        ],
        env=env,
        cwd=tmp_path,
    )
    assert "'advisory_lock'" in decorators.stdout  # @task.advisory_lock is registered
    where = _run([str(python), "-c", "import airflow_pglock; print(airflow_pglock.__file__)"], env=env, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(env_dir))
    help_text = _run([str(bin_dir / "airflow-pglock"), "--help"], env=env, cwd=tmp_path).stdout
    assert "init-db" in help_text and "doctor" in help_text
    version = _run([str(bin_dir / "airflow-pglock"), "--version"], env=env, cwd=tmp_path).stdout
    assert VERSION in version
