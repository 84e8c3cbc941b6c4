"""The servers a benchmark run owns: a throwaway PostgreSQL cluster, a Redis server and,
when the machine allows it, a network namespace to cut holders off from both.

Everything is started on free ports and stopped at the end, whatever happens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
from dataclasses import dataclass, field
from typing import Any

import psycopg

from devtools.netns import NetNamespace, NetNamespaceUnavailableError
from devtools.pgcluster import Cluster
from devtools.redisserver import RedisServer

BENCH_DATABASE = "pglock_bench"
# 10,000 advisory locks held at once (scale) need lock-table room: the shared lock table has
# max_locks_per_transaction * (max_connections + max_prepared_transactions) slots.
PG_SETTINGS = {"max_connections": "300", "max_locks_per_transaction": "512"}


@dataclass
class Servers:
    """What one benchmark run uses. ``netns`` is None (with ``netns_error``) where unavailable."""

    cluster: Cluster
    redis_server: RedisServer | None
    netns: NetNamespace | None
    netns_error: str | None
    missing: dict[str, str] = field(default_factory=dict)

    @property
    def redis(self) -> RedisServer:
        assert self.redis_server is not None, "no Redis server: check Servers.has('python-redis-lock') first"
        return self.redis_server

    def has(self, library: str) -> bool:
        """Whether an alternative (``pals``, ``python-redis-lock``) can be measured here."""
        return library not in self.missing

    @property
    def dsn(self) -> str:
        return self.cluster.dsn_for(BENCH_DATABASE)

    def dsn_from_netns(self) -> str:
        assert self.netns is not None
        return f"postgresql://postgres@{self.netns.host_addr}:{self.cluster.port}/{BENCH_DATABASE}"

    def admin(self, application_name: str = "pglock-bench admin") -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, application_name=application_name)

    def server_version(self) -> str:
        with self.admin() as conn:
            row = conn.execute("SELECT version()").fetchone()
        return str(row[0]) if row else "?"


INSTALL_HINT = "pip install 'airflow-provider-pglock[bench]' (or: python3 devtools/dev.py bench)"


def missing_alternatives() -> dict[str, str]:
    """The alternatives that cannot be measured here, and why (the harness runs without them)."""
    missing = {}
    if importlib.util.find_spec("pals") is None:
        missing["pals"] = f"PALs is not installed: {INSTALL_HINT}"
    if importlib.util.find_spec("redis_lock") is None or importlib.util.find_spec("redis") is None:
        missing["python-redis-lock"] = f"python-redis-lock is not installed: {INSTALL_HINT}"
    elif shutil.which("redis-server") is None:
        missing["python-redis-lock"] = "no redis-server on PATH (Debian: apt-get install -y redis-server)"
    return missing


@contextlib.contextmanager
def servers(with_netns: bool = True, without: tuple[str, ...] = ()) -> Any:
    """Start PostgreSQL (database ``pglock_bench``), Redis and a network namespace; stop them all after.

    :param with_netns: create the network namespace (only the recovery benchmark needs it).
    :param without: alternatives to leave out (``pals``, ``python-redis-lock``).
    """
    netns: NetNamespace | None = None
    netns_error = NetNamespace.unavailable_reason() if with_netns else "not requested"
    if netns_error is None:
        try:
            netns = NetNamespace().create()
        except NetNamespaceUnavailableError as error:
            netns, netns_error = None, str(error)
    listen = ["127.0.0.1"] + ([netns.host_addr] if netns else [])
    cluster = Cluster(
        settings={**PG_SETTINGS, "listen_addresses": f"'{','.join(listen)}'"},
        trusted_subnets=[netns.subnet] if netns else [],
    )
    redis_server: RedisServer | None = None
    try:
        cluster.init()
        cluster.start()
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {BENCH_DATABASE}")
        missing = missing_alternatives()
        missing.update({library: f"{library} left out (--without)" for library in without})
        if "python-redis-lock" not in missing:
            redis_server = RedisServer.start(tuple(listen))
        yield Servers(cluster, redis_server, netns, netns_error, missing)
    finally:
        if redis_server is not None:
            redis_server.stop()
        cluster.destroy()
        if netns is not None:
            netns.destroy()
