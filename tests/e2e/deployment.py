"""One real Airflow deployment for the end-to-end tests: its own AIRFLOW_HOME and metadata DB.

Airflow 3: the processes a production deployment runs with LocalExecutor: ``airflow
api-server`` (only its execution API: Airflow 3 task processes report to it instead of
touching the metadata DB), ``airflow scheduler`` (with the executor inside) and ``airflow
dag-processor``. Airflow 2 (``python`` is a 2.x venv's interpreter): ``airflow scheduler``
alone, which parses the DAG files itself and runs LocalExecutor. What the deployment did is
read back from its own metadata database.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

PROCESSES = (
    ("api-server", ("api-server", "--apps", "execution", "--workers", "1", "--host", "127.0.0.1")),
    ("scheduler", ("scheduler",)),
    ("dag-processor", ("dag-processor",)),
    ("triggerer", ("triggerer",)),  # started only by the tests that defer (start_triggerer)
)


def sqlalchemy_uri(libpq_uri: str) -> str:
    """``postgresql://...`` -> the SQLAlchemy URL Airflow's metadata DB expects (psycopg2 driver)."""
    return libpq_uri.replace("postgresql://", "postgresql+psycopg2://", 1)


@dataclass
class Deployment:
    name: str
    home: Path
    metadata_uri: str
    api_port: int
    dags_folder: Path
    extra_env: Mapping[str, str]
    jwt_secret: str = field(default_factory=lambda: secrets.token_hex(32))  # shared by this deployment only
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: The interpreter of the venv whose Airflow this deployment runs (default: the tests' own).
    python: str = sys.executable

    @functools.cached_property
    def airflow_version(self) -> str:
        probe = subprocess.run(
            [self.python, "-c", "import airflow; print(airflow.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if probe.returncode != 0:
            raise AssertionError(
                f"deployment {self.name}: {self.python} cannot import airflow:\n{probe.stderr[-2000:]}"
            )
        return probe.stdout.strip().splitlines()[-1]

    @property
    def airflow_2(self) -> bool:
        return self.airflow_version.startswith("2.")

    @property
    def env(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith(("AIRFLOW", "PGLOCK_"))}
        env.update(
            {
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__PARALLELISM": "8",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{self.api_port}/execution/",
                "AIRFLOW__API__PORT": str(self.api_port),
                "AIRFLOW__API_AUTH__JWT_SECRET": self.jwt_secret,
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_uri(self.metadata_uri),
                "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False",
                "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__SCHEDULER__DAG_DIR_LIST_INTERVAL": "5",  # Airflow 2's name for the refresh interval
                "PATH": f"{Path(self.python).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                "PGLOCK_E2E_DEPLOYMENT": self.name,
                # A crash of a process (a dry run once saw the trigger runner die of SIGSEGV 3 s after
                # the triggerer started, not reproduced) prints each thread's Python stack to its log.
                "PYTHONFAULTHANDLER": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def airflow(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.python, "-m", "airflow", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.home,
        )

    def start_api_server(self) -> None:
        """Start the api-server first: task processes report to its execution API (Airflow 3 only)."""
        self.home.mkdir(parents=True, exist_ok=True)
        if not self.airflow_2:
            self._spawn("api-server")

    def start_scheduling(self) -> None:
        """Once the api-server answers: the scheduler (LocalExecutor inside) and the dag-processor.

        Airflow 2: the scheduler alone (it parses the DAG files itself)."""
        if self.airflow_2:
            self._spawn("scheduler")
            return
        self.wait_for_api()
        self._spawn("scheduler")
        self._spawn("dag-processor")

    def start_triggerer(self) -> None:
        """``airflow triggerer`` (deferred tasks wait in it); a restart appends to the same log."""
        self._spawn("triggerer")

    def kill(self, role: str) -> None:
        """SIGKILL one process and what it forked (a crash, not a shutdown)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.processes[role].pid, signal.SIGKILL)
        self.processes[role].wait(timeout=30)

    def kill_leftovers(self) -> list[int]:
        """SIGKILL what is left of this deployment's processes once its roles are killed: task
        processes run in process groups of their own, which :meth:`kill` does not reach.

        Found by their environment (this deployment's AIRFLOW_HOME) or, where a process title
        overwrote it (Airflow 3's task supervisors and task processes), by their working
        directory: the deployment's home, where its roles were started. Scanned again until a
        scan finds none: a supervisor may have forked its task process during the scan."""
        marker = f"AIRFLOW_HOME={self.home}".encode()
        home = str(self.home)
        killed: list[int] = []
        while True:
            found = []
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit() or int(entry.name) in (os.getpid(), *killed):
                    continue
                with contextlib.suppress(OSError):
                    cwd = os.readlink(entry / "cwd")
                    ours = cwd == home or cwd.startswith(home + "/")
                    if ours or marker in (entry / "environ").read_bytes().split(b"\0"):
                        os.kill(int(entry.name), signal.SIGKILL)
                        found.append(int(entry.name))
            if not found:
                return killed
            killed += found

    def restart(self, role: str) -> None:
        """Stop one process as a shutdown does (SIGTERM, then SIGKILL after 30 s) and start it again."""
        process = self.processes[role]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill(role)
        self._spawn(role)

    def _spawn(self, role: str) -> None:
        args = dict(PROCESSES)[role]
        if role == "api-server":
            args = (*args, "--port", str(self.api_port))
        with open(self.home / f"{role}.log", "ab") as log:  # the child keeps its own descriptor
            self.processes[role] = subprocess.Popen(
                [self.python, "-m", "airflow", *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.home,
                start_new_session=True,  # its own process group: stop() ends the workers it forks too
            )

    def wait_for_api(self, timeout: float = 120) -> None:
        url = f"http://127.0.0.1:{self.api_port}/execution/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
            time.sleep(0.5)
        raise AssertionError(f"deployment {self.name}: api-server not healthy after {timeout} s\n{self.logs()}")

    def check_alive(self) -> None:
        for role, process in self.processes.items():
            if process.poll() is not None:
                raise AssertionError(
                    f"deployment {self.name}: {role} exited with {process.returncode}\n{self.logs(role)}"
                )

    def stop(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # whatever survived, workers included
            process.wait(timeout=10)

    def logs(self, role: str | None = None, tail: int = 4000) -> str:
        roles = [role] if role else [name for name, _ in PROCESSES]
        parts = []
        for name in roles:
            path = self.home / f"{name}.log"
            if path.exists():
                parts.append(f"--- {self.name} {name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def query(self, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Read this deployment's own metadata database."""
        with psycopg.connect(self.metadata_uri, autocommit=True) as conn:
            return [tuple(row) for row in conn.execute(statement, params).fetchall()]
