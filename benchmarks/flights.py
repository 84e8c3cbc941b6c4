"""A tiny TCP relay that counts a client's flights (round trips) to a server.

A flight is a burst of bytes from the client sent after the server last spoke (or at
the start): a client that sends one statement and waits for its answer makes one flight
per statement; a pipelined batch is one flight. Loopback only, for benchmarks.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class FlightRelay:
    """Listen on a free loopback port and relay every connection to ``(host, port)``."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.flights = 0
        self._server_spoke = True  # the next client bytes start a flight
        self._mutex = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self._mutex:
            self.flights, self._server_spoke = 0, True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                with self._mutex:
                    if from_client and self._server_spoke:
                        self.flights += 1
                    self._server_spoke = not from_client
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()


@contextlib.contextmanager
def relay(host: str, port: int) -> Iterator[FlightRelay]:
    flight_relay = FlightRelay(host, port)
    try:
        yield flight_relay
    finally:
        flight_relay.close()
