"""A StatsD socket the metrics tests read (Airflow's own StatsD client sends to it).

The fixture that points Airflow's metrics at it is conftest's ``statsd``."""

from __future__ import annotations

import socket
import threading

PGLOCK_PREFIX = "airflow.pglock."


class StatsdListener:
    """A UDP socket that collects every StatsD datagram sent to it."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65535)
            except TimeoutError:
                continue
            self.lines.extend(data.decode().splitlines())

    def metrics(self) -> list[tuple[str, dict[str, str], str]]:
        """(name without ``airflow.pglock.``, tags, type) of every pglock metric: ``airflow.pglock.x,tag=v,...:1|c``."""
        parsed = []
        for line in list(self.lines):
            head, _, value = line.partition(":")
            name, *tags = head.split(",")
            if name.startswith(PGLOCK_PREFIX):
                parsed.append(
                    (
                        name.removeprefix(PGLOCK_PREFIX),
                        dict(tag.split("=", 1) for tag in tags),
                        value.rpartition("|")[2],
                    )
                )
        return parsed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
