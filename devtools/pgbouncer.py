"""A throwaway PgBouncer in front of a PostgreSQL server (fault tests and demos; not the provider).

Uses Debian's ``pgbouncer`` package (installed with apt-get when missing and running as
root). PgBouncer refuses to run as root, so as root it runs as the same unprivileged user
as :class:`devtools.pgcluster.Cluster`. Listens on 127.0.0.1 on a free port, trust auth,
every database forwarded (``* = host=... port=...``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from devtools.pgcluster import RUN_AS_USER, free_port

DEBIAN_PACKAGE = "pgbouncer"


class PgBouncerUnavailableError(RuntimeError):
    """PgBouncer is not installed and cannot be installed here."""


def find_pgbouncer(install: bool = True) -> str:
    """Path of the pgbouncer binary; installs the Debian package when missing (as root)."""
    found = shutil.which("pgbouncer") or next(
        (path for path in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(path)), None
    )
    if found:
        return found
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PgBouncerUnavailableError("pgbouncer is not installed (Debian: apt-get install -y pgbouncer)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    result = subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", DEBIAN_PACKAGE], capture_output=True, text=True, env=env
    )
    if result.returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env)
        result = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", DEBIAN_PACKAGE],
            capture_output=True,
            text=True,
            env=env,
        )
    found = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None)
    if result.returncode != 0 or not found:
        raise PgBouncerUnavailableError(f"apt-get install {DEBIAN_PACKAGE} failed: {result.stderr.strip()[-500:]}")
    # The package starts a system-wide pgbouncer on 6432; ours runs on its own port and never needs it.
    if shutil.which("service"):
        subprocess.run(["service", "pgbouncer", "stop"], capture_output=True)
    return found


class PgBouncer:
    """One PgBouncer process, started by :meth:`start` and stopped by :meth:`stop`.

    :param upstream_port: port of the PostgreSQL server on 127.0.0.1.
    :param pool_mode: ``"transaction"`` (default), ``"session"`` or ``"statement"``.
    :param pool_size: server connections per database/user pair.
    :param server_reset_query: what a server session runs when its client leaves (session pooling);
        empty: nothing, so the session keeps what the client held (some setups turn it off).
    """

    def __init__(
        self,
        upstream_port: int,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 4,
        server_reset_query: str = "DISCARD ALL",
    ) -> None:
        self.binary = find_pgbouncer()
        self.upstream_port = upstream_port
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.server_reset_query = server_reset_query
        self.port = free_port()
        self.base_dir = Path(tempfile.mkdtemp(prefix="pglock-pgbouncer-"))
        self.log_file = self.base_dir / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.user: pwd.struct_passwd | None = pwd.getpwnam(RUN_AS_USER) if os.geteuid() == 0 else None

    def dsn_for(self, database: str, user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def _write_config(self) -> Path:
        (self.base_dir / "userlist.txt").write_text('"postgres" ""\n')
        ini = self.base_dir / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={self.upstream_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.base_dir / 'userlist.txt'}\n"
            "admin_users = postgres\n"
            f"pool_mode = {self.pool_mode}\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 200\n"
            f"server_reset_query = {self.server_reset_query}\n"
            "ignore_startup_parameters = extra_float_digits\n"
            f"logfile = {self.log_file}\n"
        )
        if self.user is not None:
            for path in (self.base_dir, *self.base_dir.iterdir()):
                os.chown(path, self.user.pw_uid, self.user.pw_gid)
        return ini

    def start(self, timeout: float = 15) -> PgBouncer:
        ini = self._write_config()
        kwargs: dict[str, object] = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        self.process = subprocess.Popen(
            [self.binary, str(ini)],
            cwd=self.base_dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **kwargs,  # type: ignore[call-overload]
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.process.returncode}:\n{self.read_log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"pgbouncer did not listen on {self.port} within {timeout} s:\n{self.read_log()}")

    def read_log(self) -> str:
        try:
            return self.log_file.read_text()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
