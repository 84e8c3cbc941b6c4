"""A hot standby of a throwaway :class:`~devtools.pgcluster.Cluster` (fault tests).

``pg_basebackup -R`` from the primary with the same server binaries, then started on its
own port: it streams from the primary and answers read-only queries, with
``pg_is_in_recovery()`` true.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from devtools.pgcluster import Cluster, free_port


def start_standby(primary: Cluster) -> Cluster:
    """A running standby of ``primary``; ``destroy()`` it when done."""
    standby = Cluster(port=free_port(), base_dir=Path(tempfile.mkdtemp(prefix="pglock-standby-")))
    standby.socket_dir.mkdir(parents=True, exist_ok=True)
    if standby.user is not None:
        for path in (standby.base_dir, standby.socket_dir):
            os.chown(path, standby.user.pw_uid, standby.user.pw_gid)
    try:
        standby._run(
            str(standby.bin_dir / "pg_basebackup"),
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-D",
            str(standby.data_dir),
            "-R",
            "-X",
            "stream",
            "--no-sync",
            "--checkpoint=fast",  # the default spread checkpoint takes minutes
        )
        with open(standby.data_dir / "postgresql.conf", "a") as conf:
            conf.write(
                "\n# standby overrides\n"
                "listen_addresses = '127.0.0.1'\n"
                f"port = {standby.port}\n"
                f"unix_socket_directories = '{standby.socket_dir}'\n"
                "hot_standby = on\n"
            )
        standby.start()
    except BaseException:
        standby.destroy()
        raise
    return standby
