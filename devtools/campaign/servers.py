"""The campaign's servers: a lock database that can fail over, and the fencing register.

:class:`FailoverPair` is two PostgreSQL clusters on two fixed ports, one primary and one
streaming standby under **synchronous** replication (``synchronous_standby_names = '*'``,
``synchronous_commit = on``), so that a fencing token recorded on the primary is on the
standby before its statement returns (a primary without its standby, just promoted or just
set up, runs alone until the standby is rebuilt: there is nothing to fail over to then).
Clients reach whichever is primary through one multi-host DSN with
``target_session_attrs=read-write`` (:meth:`FailoverPair.dsn`). A failover stops (or
freezes) the primary, promotes the standby, and rebuilds the old primary's port as the new
standby (``pg_basebackup -R``), so the same DSN keeps working, failover after failover.

:class:`Register` is the protected work's storage, on a cluster of its own that no fault
touches: a table that accepts a write for a key only with a fencing token at least the last
one it accepted for that key (etcd's ``contrib/lock`` storage, in SQL), and logs every write
with its answer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from devtools.pgcluster import Cluster, free_port

#: The lock database's name on the pair.
LOCK_DATABASE = "locks"

_PAIR_SETTINGS = {
    "max_connections": "300",
    "wal_level": "replica",
    "max_wal_senders": "8",
    "hot_standby": "on",
    "synchronous_commit": "on",
    "wal_keep_size": "64MB",
}


def _listen(addresses: Sequence[str]) -> str:
    return "'" + ",".join(["127.0.0.1", *addresses]) + "'"


class FailoverPair:
    """A primary and a synchronous standby on fixed ports; roles swap at each failover.

    :param listen: addresses besides 127.0.0.1 to listen on (the network namespaces' host ends).
    :param trusted_subnets: networks allowed in (trust authentication), e.g. the namespaces'.
    """

    def __init__(self, *, listen: Sequence[str] = (), trusted_subnets: Sequence[str] = ()) -> None:
        self.listen = tuple(listen)
        self.trusted_subnets = tuple(trusted_subnets)
        self.ports = (free_port(), free_port())
        self.clusters: list[Cluster | None] = [None, None]
        self.primary_index = 0
        self.failovers = 0

    # ----------------------------------------------------------------- set-up

    def start(self) -> FailoverPair:
        settings = {**_PAIR_SETTINGS, "listen_addresses": _listen(self.listen)}
        primary = Cluster(settings, port=self.ports[0], trusted_subnets=self.trusted_subnets).init()
        with open(primary.data_dir / "pg_hba.conf", "a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")
        primary.start()
        self.clusters[0] = primary
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {LOCK_DATABASE}")
        self._build_standby(1)
        return self

    def _build_standby(self, index: int) -> Cluster:
        """A fresh standby of the primary on port ``self.ports[index]`` (its old data removed)."""
        primary = self.primary
        old = self.clusters[index]
        if old is not None:
            old.destroy()
        base = Path(primary.base_dir).parent / f"pglock-campaign-{os.getpid()}-{index}-{time.monotonic_ns()}"
        standby = Cluster(port=self.ports[index], base_dir=base, trusted_subnets=self.trusted_subnets)
        standby.socket_dir.mkdir(parents=True, exist_ok=True)
        if standby.user is not None:
            for path in (standby.base_dir, standby.socket_dir):
                os.chown(path, standby.user.pw_uid, standby.user.pw_gid)
        standby._run(
            str(standby.bin_dir / "pg_basebackup"),
            *("-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres", "-D", str(standby.data_dir)),
            *("-R", "-X", "stream", "--no-sync", "--checkpoint=fast"),
        )
        with open(standby.data_dir / "postgresql.conf", "a") as conf:
            conf.write(
                "\n# standby overrides\n"
                f"port = {standby.port}\n"
                f"unix_socket_directories = '{standby.socket_dir}'\n"
                f"listen_addresses = {_listen(self.listen)}\n"
            )
        standby.start()
        self.clusters[index] = standby
        self._synchronous("*")  # from now on a commit waits for the standby
        self._wait_synchronous()
        return standby

    def _synchronous(self, names: str) -> None:
        """Set the primary's ``synchronous_standby_names`` (``''``: alone, commits do not wait)."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
            conn.execute("SELECT pg_reload_conf()")

    def _wait_synchronous(self, timeout: float = 60) -> None:
        """Until the primary sees a synchronous standby (commits no longer wait)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(psycopg.Error), psycopg.connect(self.primary.dsn, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'").fetchone()
                if row and row[0] >= 1:
                    return
            time.sleep(0.2)
        raise RuntimeError("no synchronous standby after a rebuild")

    # ----------------------------------------------------------------- who is what

    @property
    def primary(self) -> Cluster:
        cluster = self.clusters[self.primary_index]
        assert cluster is not None
        return cluster

    @property
    def standby(self) -> Cluster:
        cluster = self.clusters[1 - self.primary_index]
        assert cluster is not None
        return cluster

    def dsn(self, host: str = "127.0.0.1") -> str:
        """The multi-host DSN clients use: whichever of the two ports is the primary (read-write)."""
        return (
            f"host={host},{host} port={self.ports[0]},{self.ports[1]} dbname={LOCK_DATABASE} user=postgres"
            " target_session_attrs=read-write connect_timeout=2"
        )

    def primary_dsn(self) -> str:
        """The current primary alone (the nemesis and the final checks)."""
        return self.primary.dsn_for(LOCK_DATABASE)

    # ----------------------------------------------------------------- faults

    def restart(self, mode: str) -> None:
        """Stop the primary (``fast`` or ``immediate``) and start it again; sessions end."""
        primary = self.primary
        primary.stop(mode)
        primary.start()
        self._wait_synchronous()

    def server_pids(self, cluster: Cluster) -> list[int]:
        """The postmaster and every process it started."""
        postmaster = cluster.postmaster_pid()
        if postmaster is None:
            return []
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(postmaster)], capture_output=True, text=True)
        return [postmaster, *(int(pid) for pid in children.stdout.split())]

    def _freeze(self, cluster: Cluster) -> list[int]:
        """SIGSTOP the postmaster first, then every process it started, until no new one shows up.

        Listed first and stopped afterwards, a backend the postmaster forked in between (a client
        connecting at that moment) kept running on the "frozen" primary: a campaign found a holder
        that went on, with its lock, on the old primary after the standby was promoted.
        """
        postmaster = cluster.postmaster_pid()
        if postmaster is None:
            return []
        os.kill(postmaster, signal.SIGSTOP)  # no new backend from here on
        frozen = [postmaster]
        while True:
            fresh = [pid for pid in self.server_pids(cluster) if pid not in frozen]
            if not fresh:
                return frozen
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            frozen += fresh

    def failover(self, *, freeze: bool, frozen_seconds: float = 0.0) -> None:
        """The primary goes (stopped at once, or frozen and killed ``frozen_seconds`` later); the
        standby is promoted; the old primary's port becomes the new standby.

        :param freeze: SIGSTOP every process of the primary instead of stopping it: its clients'
            sessions hang (their heartbeat's deadline finds them) while the promoted standby
            already accepts new locks.
        """
        old_index = self.primary_index
        old = self.primary
        frozen: list[int] = []
        if freeze:
            frozen = self._freeze(old)
        else:
            old.stop("immediate")
        self.standby._run(str(self.standby.bin_dir / "pg_ctl"), "-D", str(self.standby.data_dir), "-w", "promote")
        self.primary_index = 1 - old_index
        self.failovers += 1
        self._synchronous("")  # alone until its standby is rebuilt (there is none to fail over to meanwhile)
        if freeze:
            time.sleep(frozen_seconds)
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._build_standby(old_index)

    def destroy(self) -> None:
        for cluster in self.clusters:
            if cluster is not None:
                for pid in self.server_pids(cluster):  # a frozen server would not stop
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                cluster.destroy()


class Register:
    """The fencing register: accepts a key's write only with a token >= the last it accepted.

    Unfenced holders write with no token (accepted, logged): the checker judges them by the
    times they believed they held the key.
    """

    SCHEMA = """
    CREATE TABLE register (key text PRIMARY KEY, token bigint NOT NULL DEFAULT 0);
    CREATE TABLE writes (seq bigserial PRIMARY KEY, key text NOT NULL, run text NOT NULL, token bigint,
                         accepted boolean NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
    """

    def __init__(self, keys: Sequence[str], *, listen: Sequence[str] = (), trusted_subnets: Sequence[str] = ()):
        self.keys = tuple(keys)
        self.cluster = Cluster(
            {"listen_addresses": _listen(listen), "max_connections": "200"}, trusted_subnets=trusted_subnets
        )

    def start(self) -> Register:
        self.cluster.init().start()
        with psycopg.connect(self.cluster.dsn, autocommit=True) as conn:
            conn.execute(self.SCHEMA)
            for key in self.keys:
                conn.execute("INSERT INTO register (key) VALUES (%s)", [key])
        return self

    def dsn(self, host: str = "127.0.0.1") -> str:
        # A write on a cut network fails (as it would) within about a second: a lock session does
        # not interrupt its work (docs/howto-many-keys.md), so its worker's write in flight must
        # end before the server frees the lease (3 s) of the session the cut left silent. At 3 s
        # (the kernel acts on it at its next retransmission, here up to 4.5 s) a lock-session
        # worker blocked in a write still believed it held the key 2.4 s after another took it.
        return (
            f"host={host} port={self.cluster.port} dbname=postgres user=postgres connect_timeout=2"
            " tcp_user_timeout=1000 keepalives_idle=1 keepalives_interval=1 keepalives_count=2"
        )

    def writes(self) -> list[tuple[Any, ...]]:
        """Every write, in the order the register took it: (seq, key, run, token, accepted, at epoch)."""
        with psycopg.connect(self.cluster.dsn, autocommit=True) as conn:
            return [
                tuple(row)
                for row in conn.execute(
                    "SELECT seq, key, run, token, accepted, extract(epoch FROM at)::float8 FROM writes ORDER BY seq"
                ).fetchall()
            ]

    def destroy(self) -> None:
        self.cluster.destroy()


#: A fenced write: the register's row moves only forward; the write is logged with its answer.
FENCED_WRITE = (
    "WITH moved AS (UPDATE register SET token = %(token)s WHERE key = %(key)s AND token <= %(token)s"
    " RETURNING token)"
    " INSERT INTO writes (key, run, token, accepted) SELECT %(key)s, %(run)s, %(token)s, EXISTS (SELECT 1 FROM moved)"
    " RETURNING accepted, extract(epoch FROM at)::float8"
)
UNFENCED_WRITE = (
    "INSERT INTO writes (key, run, token, accepted) VALUES (%(key)s, %(run)s, NULL, true)"
    " RETURNING accepted, extract(epoch FROM at)::float8"
)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
