"""The machine and the versions a benchmark ran with (everything docs/benchmarks.md states about them)."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _first(path: str, prefix: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    return "?"


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def machine() -> dict[str, str]:
    memory = _first("/proc/meminfo", "MemTotal")
    with contextlib.suppress(ValueError):
        memory = f"{int(memory.split()[0]) / 1024 / 1024:.1f} GiB"
    return {
        "date (UTC)": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "nproc": str(len(os.sched_getaffinity(0))),
        "CPU": _first("/proc/cpuinfo", "model name"),
        "memory": memory,
        "kernel": f"{platform.system()} {platform.release()}",
    }


def _package(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def git_revision() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "airflow_pglock"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + (" (airflow_pglock/ has uncommitted changes)" if dirty else "")


def versions(postgres: str, redis_server: str) -> dict[str, str]:
    import psycopg

    libpq = psycopg.pq.version()
    return {
        "airflow-provider-pglock": f"{_package('airflow-provider-pglock')} at git {git_revision()}",
        "Python": platform.python_version(),
        "PostgreSQL": postgres,
        "Apache Airflow": _package("apache-airflow"),
        "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__}, libpq {libpq // 10000}.{libpq % 100})",
        "pals": _package("PALs"),
        "SQLAlchemy (for pals)": _package("SQLAlchemy"),
        "python-redis-lock": _package("python-redis-lock"),
        "redis (redis-py)": _package("redis"),
        "Redis server": redis_server,
    }
