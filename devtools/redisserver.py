"""A throwaway Redis server (benchmarks, the Celery suite's broker): Debian's ``redis-server``
on a free port, no persistence, stopped by :meth:`RedisServer.stop`."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.pgcluster import free_port

INSTALL_HINT = "apt-get install -y redis-server"


def unavailable_reason(install: bool = False) -> str | None:
    """None if ``redis-server`` is on PATH (after ``apt-get install`` when ``install`` and root)."""
    if shutil.which("redis-server") is None and install and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "redis-server"], capture_output=True, timeout=600, check=False)
    if shutil.which("redis-server") is None:
        return f"redis-server is not installed (Debian: {INSTALL_HINT})"
    return None


def _ping(host: str, port: int) -> str | None:
    """The server's version, or None when it does not answer yet (plain RESP: no client library needed)."""
    with contextlib.suppress(OSError, ValueError), socket.create_connection((host, port), timeout=1) as sock:
        sock.sendall(b"INFO server\r\n")
        data = b""
        while b"\r\n" not in data:
            data += sock.recv(65536)
        header, _, body = data.partition(b"\r\n")
        length = int(header[1:])  # a bulk string: $<length>\r\n<body>\r\n
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("redis_version:"):
                return line.split(":", 1)[1].strip()
    return None


@dataclass
class RedisServer:
    """``redis-server`` listening on ``bind`` (addresses) at a free port."""

    port: int
    bind: tuple[str, ...]
    directory: Path
    version: str = ""

    @classmethod
    def start(cls, bind: tuple[str, ...] = ("127.0.0.1",)) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(f"redis-server is not installed (Debian: {INSTALL_HINT})")
        port = free_port()
        directory = Path(tempfile.mkdtemp(prefix="pglock-redis-"))
        subprocess.run(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                *bind,
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--daemonize",
                "yes",
                "--dir",
                str(directory),
                "--pidfile",
                str(directory / "redis.pid"),
                "--logfile",
                str(directory / "redis.log"),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        server = cls(port, bind, directory)
        server.version = server._wait_version()
        return server

    def client(self, host: str = "127.0.0.1") -> Any:
        """A ``redis.Redis`` client (needs the ``redis`` package)."""
        import redis

        return redis.Redis(host=host, port=self.port)

    def url(self, host: str = "127.0.0.1", db: int = 0) -> str:
        return f"redis://{host}:{self.port}/{db}"

    def _wait_version(self) -> str:
        deadline = time.monotonic() + 15
        while True:
            version = _ping(self.bind[0], self.port)
            if version is not None:
                return version
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer: {self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "redis.log").read_text()[-2000:]
        return ""

    def stop(self) -> None:
        with contextlib.suppress(OSError), socket.create_connection((self.bind[0], self.port), timeout=2) as sock:
            sock.sendall(b"SHUTDOWN NOSAVE\r\n")
            sock.recv(1024)
        pid_file = self.directory / "redis.pid"
        deadline = time.monotonic() + 10
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(self.directory, ignore_errors=True)
