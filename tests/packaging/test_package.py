"""The released artifacts: an sdist and a wheel that install into a fresh virtualenv.

``python -m build`` makes the sdist, then builds the wheel *from the sdist*: a file
missing from the sdist would be missing from the wheel, which must hold every module of
the checkout. Then the install commands of docs/getting-started.md run as written in a new
virtualenv with the pinned Airflow 3.3 environment (constraints/airflow-3.3.txt), where
Airflow must discover the provider and the console script must run.

The version comes from git (setuptools-scm): each commit builds a version of its own, so
that `pip install --upgrade` from a newer checkout installs the newer code.
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

pytestmark = pytest.mark.slow

if not importlib.import_module("airflow_pglock.compat").AIRFLOW_V_3_PLUS:
    pytest.skip(
        "the artifacts are installed into a fresh Airflow 3.3 venv; that runs once, in the 3.3 suite",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[2]
#: What a fresh checkout does not hold (virtualenvs, caches, build output).
_NOT_IN_A_CHECKOUT = (
    ".git",
    ".venv*",
    "*.egg-info",
    "_version.py",
    "build",
    "dist",
    "site",
    "__pycache__",
    ".*_cache",
    ".pglock-*",
)
CONSTRAINTS = ROOT / "constraints" / "airflow-3.3.txt"
#: What setuptools-scm makes of an untagged history: commit N is 0.1.0.devN+g<hash>, and
#: uncommitted changes add .d<date>. Without git metadata: pyproject's fallback_version.
GIT_VERSION = re.compile(r"0\.1\.0\.dev(?P<count>\d+)\+g(?P<hash>[0-9a-f]{7,40})(?:\.d\d{8})?")
FALLBACK_VERSION = "0.1.0.dev0"


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _git(checkout: Path, *args: str) -> str:
    return _run(["git", "-C", str(checkout), *args]).stdout.strip()


def _assert_version(version: str, checkout: Path) -> None:
    """A build of this tree has git's version (commit count, HEAD's hash), or the fallback without git metadata."""
    if not (checkout / ".git").exists():
        assert version == FALLBACK_VERSION
        return
    matched = GIT_VERSION.fullmatch(version)
    assert matched is not None, f"{version!r}: expected 0.1.0.dev<commits>+g<hash>[.d<date>] from git"
    assert matched["count"] == _git(checkout, "rev-list", "--count", "HEAD"), version
    assert _git(checkout, "rev-parse", "HEAD").startswith(matched["hash"]), version


def _sdist_version(checkout: Path, out: Path) -> str:
    _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(checkout)])
    (sdist,) = out.glob("*.tar.gz")
    return sdist.name.removeprefix("airflow_provider_pglock-").removesuffix(".tar.gz")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)])  # the sdist, then a wheel built from it
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_sdist_and_wheel_contents(artifacts: dict[str, Path]) -> None:
    sdist, wheel = artifacts["sdist"], artifacts["wheel"]
    version = sdist.name.removeprefix("airflow_provider_pglock-").removesuffix(".tar.gz")
    _assert_version(version, ROOT)  # from git, in a checkout
    assert wheel.name == f"airflow_provider_pglock-{version}-py3-none-any.whl"  # built from the sdist: PKG-INFO's
    with tarfile.open(sdist) as tar:
        sdist_files = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "airflow_pglock/__init__.py", "airflow_pglock/py.typed"} <= sdist_files
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        dist_info = f"airflow_provider_pglock-{version}.dist-info"
        metadata = whl.read(f"{dist_info}/METADATA").decode()
        entry_points = whl.read(f"{dist_info}/entry_points.txt").decode()
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "airflow_pglock").rglob("*.py")}
    assert sources <= names, f"modules missing from the wheel: {sorted(sources - names)}"
    assert not any(name.startswith(("tests/", "devtools/", "dags/", "benchmarks/")) for name in names)
    assert "airflow_pglock/py.typed" in names
    assert "airflow_pglock/_version.py" in names  # __version__ at run time, where there is no git
    assert "LICENSE" in sdist_files and f"{dist_info}/licenses/LICENSE" in names  # Apache-2.0 4(a): a copy of it
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    # The metadata admits what the matrix tests, nothing more (Python 3.14 and Airflow 3.5 untested).
    assert "Requires-Dist: apache-airflow<3.5,>=2.11" in metadata
    assert "Requires-Dist: apache-airflow-providers-postgres>=7.1" in metadata
    assert "Requires-Python: <3.14,>=3.10" in metadata
    assert all(f"Classifier: Programming Language :: Python :: 3.{minor}" in metadata for minor in (10, 11, 12, 13))
    assert "Classifier: Framework :: Apache Airflow :: Provider" in metadata
    assert "provider_info = airflow_pglock.get_provider_info:get_provider_info" in entry_points
    assert "airflow-pglock = airflow_pglock.cli.main:main" in entry_points


def _documented_install(marker: str = "install-from-checkout") -> str:
    """The install (or upgrade) commands of docs/getting-started.md, exactly as a reader copies them."""
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    block = re.search(rf"<!-- {marker}[^>]*-->\n```bash\n(.*?)```", guide, re.DOTALL)
    assert block is not None, f"docs/getting-started.md lost its {marker} block"
    return block[1]


@pytest.mark.timeout(1200)  # a fresh Airflow environment, then the guide's install and its upgrade
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
    checkout = workdir / "airflow-pglock"
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(*_NOT_IN_A_CHECKOUT))
    if (ROOT / ".git").exists():  # a reader's checkout has its history: the version comes from it
        _run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(tmp_path / "history")])
        shutil.move(tmp_path / "history" / ".git", checkout / ".git")
        _git(checkout, "reset", "--quiet")  # the index of HEAD: only this tree's own changes count as changes
        assert _git(checkout, "rev-parse", "HEAD") == _git(ROOT, "rev-parse", "HEAD")
    home = tmp_path / "airflow-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV"))}
    env.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "PATH": f"{bin_dir}:{env['PATH']}"})
    env["PIP_CONSTRAINT"] = str(CONSTRAINTS)  # the environment stays pinned; the commands are the guide's
    commands = _documented_install()
    installed = _run(["bash", "-e", "-o", "pipefail", "-c", commands], env=env, cwd=workdir)
    assert "airflow-provider-pglock" in installed.stdout  # the guide's check: `airflow providers list | grep pglock`
    (wheel,) = (workdir / "dist").glob("airflow_provider_pglock-*-py3-none-any.whl")
    version = wheel.name.removeprefix("airflow_provider_pglock-").removesuffix("-py3-none-any.whl")
    _assert_version(version, checkout)

    frozen = _run([str(python), "-m", "pip", "freeze"], env=env).stdout  # env: no PYTHONPATH onto a source tree
    assert "apache-airflow==3.3.2" in frozen and f"airflow-provider-pglock=={version}" in frozen
    assert "psycopg-binary==" in frozen  # the [binary] extra
    check = _run([str(python), "-m", "pip", "check"], env=env)
    assert "No broken requirements" in check.stdout

    # Outside the checkout, so that nothing is imported from the source tree.
    providers = _run([str(bin_dir / "airflow"), "providers", "list", "-o", "json"], env=env, cwd=tmp_path).stdout
    assert '"package_name": "airflow-provider-pglock"' in providers
    assert f'"version": "{version}"' in providers  # get_provider_info's, from the installed _version.py
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
    printed = _run([str(bin_dir / "airflow-pglock"), "--version"], env=env, cwd=tmp_path).stdout
    assert version in printed

    if not (checkout / ".git").exists():
        return  # no history to move on: the upgrade needs a newer commit
    # A newer commit (as after a `git pull`): the guide's upgrade installs it, where a plain install would not.
    _git(checkout, "-c", "user.name=pglock-tests", "-c", "user.email=tests@pglock.invalid",
         "commit", "--quiet", "--allow-empty", "-m", "a newer commit")  # fmt: skip
    _run(["bash", "-e", "-o", "pipefail", "-c", _documented_install("upgrade-from-checkout")], env=env, cwd=workdir)
    upgraded = _run([str(bin_dir / "airflow-pglock"), "--version"], env=env, cwd=tmp_path).stdout
    newer = re.search(r"\d\S*", upgraded.removeprefix("airflow-pglock"))
    assert newer is not None and newer[0] != version, upgraded
    _assert_version(newer[0], checkout)


@pytest.mark.timeout(900)  # three sdist builds, each in its own build environment
def test_each_commit_builds_a_version_of_its_own(tmp_path: Path) -> None:
    """A newer commit is a newer version (pip upgrades to it); a tree without git builds as the fallback."""
    if not (ROOT / ".git").exists():
        pytest.skip("this tree has no git metadata: its build is the fallback version (the last step below)")
    from packaging.version import Version

    clone = tmp_path / "clone"
    _run(["git", "clone", "--quiet", str(ROOT), str(clone)])
    first = _sdist_version(clone, tmp_path / "first")
    _assert_version(first, clone)
    _git(clone, "-c", "user.name=pglock-tests", "-c", "user.email=tests@pglock.invalid",
         "commit", "--quiet", "--allow-empty", "-m", "one more commit")  # fmt: skip
    second = _sdist_version(clone, tmp_path / "second")
    _assert_version(second, clone)
    assert Version(second) > Version(first)

    # A downloaded archive: the files of a commit, no git metadata, nothing built before. (A folder
    # that was built before keeps airflow_provider_pglock.egg-info, whose version setuptools-scm repeats.)
    archive = tmp_path / "archive"
    archive.mkdir()
    _git(clone, "archive", "--output", str(tmp_path / "archive.tar"), "HEAD")
    with tarfile.open(tmp_path / "archive.tar") as tar:
        tar.extractall(archive, filter="data")
    assert _sdist_version(archive, tmp_path / "from-archive") == FALLBACK_VERSION
