"""One Airflow 3 deployment with CeleryExecutor: control plane on this host, two workers on
"other hosts" (network namespaces with their own address and host name).

On the host: ``airflow api-server`` (core API and execution API, on every address so the
workers reach it over their links), ``scheduler`` (CeleryExecutor), ``dag-processor`` and
``triggerer``. Broker: a Redis server of its own (devtools/redisserver.py). Celery results
and Airflow metadata: one PostgreSQL database. Each worker runs ``airflow celery worker``
inside its namespace, consumes one queue (named like the worker) and reaches the broker,
the metadata database, the execution API and the lock database through its veth link
only: cutting the link (devtools/netns.py) partitions exactly that worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from devtools.netns import NetNamespace
from tests.e2e.deployment import Deployment, sqlalchemy_uri

HOST_ROLES: dict[str, tuple[str, ...]] = {
    "api-server": ("api-server", "--workers", "1", "--host", "0.0.0.0"),
    "scheduler": ("scheduler",),
    "dag-processor": ("dag-processor",),
    "triggerer": ("triggerer",),
}


def unavailable_reason() -> str | None:
    """Why a Celery deployment with namespaced workers cannot run here, or None: network namespaces
    (root, iproute2), util-linux's ``unshare`` (a worker's own host name) and redis-server (installed
    from Debian when missing and possible)."""
    from devtools import redisserver

    reason = NetNamespace.unavailable_reason()
    if reason:
        return reason
    if shutil.which("unshare") is None:
        return "util-linux's `unshare` is not installed (a worker's own host name needs it)"
    return redisserver.unavailable_reason(install=True)


@dataclass
class Worker:
    """A Celery worker on its own "host": a namespace, a host name and a queue."""

    name: str
    netns: NetNamespace
    process: subprocess.Popen[bytes] | None = None
    log_offset: int = 0  # where this start's output begins in the worker's log file

    @property
    def hostname(self) -> str:
        return f"pglock-{self.name}"

    @property
    def address(self) -> str:
        """The worker's address as the host (and the lock database) sees it."""
        return self.netns.ns_addr


@dataclass
class CeleryDeployment(Deployment):
    """A :class:`Deployment` whose executor is Celery, with workers in network namespaces.

    :param broker_port: the Redis server's port (listening on 127.0.0.1 and on each
        namespace's host-side address).
    :param pg_port: the PostgreSQL cluster's port (same addresses).
    :param metadata_db: / lock_db: database names on that cluster.
    """

    broker_port: int = 0
    pg_port: int = 0
    metadata_db: str = "airflow"
    lock_db: str = "locks"
    workers: dict[str, Worker] = field(default_factory=dict)

    def _uris(self, host: str) -> dict[str, str]:
        """Connection settings for a process that reaches the servers at ``host``."""
        pg = f"postgresql://postgres@{host}:{self.pg_port}"
        return {
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_uri(f"{pg}/{self.metadata_db}"),
            "AIRFLOW__CELERY__BROKER_URL": f"redis://{host}:{self.broker_port}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + sqlalchemy_uri(f"{pg}/{self.metadata_db}"),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://{host}:{self.api_port}/execution/",
            "AIRFLOW_CONN_POSTGRES_DEFAULT": f"{pg}/{self.lock_db}",
            "PGLOCK_CELERY_LOCK_DSN": f"{pg}/{self.lock_db}",
        }

    @property
    def env(self) -> dict[str, str]:
        env = super().env
        env.update(
            {
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",  # the test triggers runs by REST
                "AIRFLOW__CORE__HOSTNAME_CALLABLE": "socket.gethostname",  # a worker's own (UTS) host name
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
                "AIRFLOW__CELERY__SYNC_PARALLELISM": "1",
                # The broker redelivers an unacknowledged task after this; far beyond the test.
                "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "3600",
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(self.trigger_log_port),
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
                # A worker that vanished (killed, frozen, cut off) stops heartbeating its task:
                # the scheduler fails the task after this many seconds (default 300).
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
                "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__API__PORT": str(self.api_port),
            }
        )
        env.update(self._uris("127.0.0.1"))
        return env

    @property
    def trigger_log_port(self) -> int:
        return self.api_port + 1 if self.api_port < 65535 else self.api_port - 1

    def worker_env(self, worker: Worker) -> dict[str, str]:
        env = self.env
        env.update(self._uris(worker.netns.host_addr))
        env["PGLOCK_CELERY_WORKER"] = worker.name
        return env

    # ------------------------------------------------------------------ processes

    def start(self, workers: list[Worker]) -> None:
        """api-server and the workers at once, then (once the api-server answers) scheduler,
        dag-processor and triggerer."""
        self.home.mkdir(parents=True, exist_ok=True)
        self._spawn_role("api-server")
        for worker in workers:
            self.start_worker(worker)
        self.wait_for_api()
        for role in ("scheduler", "dag-processor", "triggerer"):
            self._spawn_role(role)

    def _spawn_role(self, role: str) -> None:
        args = HOST_ROLES[role]
        if role == "api-server":
            args = (*args, "--port", str(self.api_port))
        self.processes[role] = self._popen([sys.executable, "-m", "airflow", *args], self.env, role)

    def _popen(self, argv: list[str], env: Mapping[str, str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.home / f"{log_name}.log", "ab") as log:  # the child keeps its own descriptor
            return subprocess.Popen(
                argv, env=dict(env), stdout=log, stderr=subprocess.STDOUT, cwd=self.home, start_new_session=True
            )

    def start_worker(self, worker: Worker) -> None:
        """``airflow celery worker`` inside the worker's namespace, with its host name, on its queue."""
        self.workers[worker.name] = worker
        worker.log_offset = len(self._log_text(worker.name))
        argv = [
            sys.executable,
            "-m",
            "airflow",
            "celery",
            "worker",
            "--queues",
            worker.name,
            "--concurrency",
            "2",
            "--celery-hostname",
            f"{worker.name}@{worker.hostname}",
            "--pid",
            str(self.home / f"worker-{worker.name}.pid"),
            "--skip-serve-logs",
            "--without-mingle",
            "--without-gossip",
        ]
        worker.process = self._popen(worker.netns.command(argv, worker.hostname), self.worker_env(worker), worker.name)

    def wait_for_workers(self, timeout: float = 180) -> None:
        """Until every worker's log says Celery is ready to consume."""
        deadline = time.monotonic() + timeout
        pending = set(self.workers)
        while pending:
            for name in sorted(pending):
                worker = self.workers[name]
                assert worker.process is not None
                if worker.process.poll() is not None:
                    raise AssertionError(f"worker {name} exited with {worker.process.returncode}\n{self.logs(name)}")
                if f"{name}@{worker.hostname} ready." in self._log_text(name)[worker.log_offset :]:
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise AssertionError(f"workers {sorted(pending)} not ready after {timeout} s\n{self.logs()}")
            time.sleep(0.5)

    def kill_worker(self, worker: Worker) -> None:
        """SIGKILL every process on the worker's "host" (its namespace), like a power cut."""
        worker.netns.signal_all(signal.SIGKILL)
        if worker.process is not None:
            worker.process.wait(timeout=30)

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.netns.signal_all(signal.SIGCONT)
            worker.netns.restore()
            if worker.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for worker in self.workers.values():
            if worker.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            worker.netns.signal_all(signal.SIGKILL)
            if worker.process is not None:
                worker.process.wait(timeout=10)
        super().stop()

    def _log_text(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, role: str | None = None, tail: int = 4000) -> str:
        names = [role] if role else [*HOST_ROLES, *self.workers]
        return "\n".join(f"--- {name} ---\n{self._log_text(name)[-tail:]}" for name in names)

    # ------------------------------------------------------------------ REST

    def trigger(self, dag_id: str, conf: Mapping[str, Any]) -> str:
        """Create a DAG run through the public REST API; its run id."""
        body = json.dumps({"logical_date": None, "conf": dict(conf)}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.api_port}/api/v2/dags/{dag_id}/dagRuns",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return str(json.load(response)["dag_run_id"])

    def wait_for_dags(self, dag_ids: list[str], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            rows = self.query("SELECT dag_id FROM dag WHERE dag_id = ANY(%s) AND NOT is_paused", [dag_ids])
            if len(rows) == len(dag_ids):
                return
            self.check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"DAGs not parsed after {timeout} s: have {rows}\n{self.logs('dag-processor')}")
            time.sleep(1)

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        path = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        attempt = path / f"attempt={try_number}.log"
        return attempt.read_text(errors="replace") if attempt.exists() else ""
