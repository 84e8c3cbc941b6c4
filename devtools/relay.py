"""A TCP relay in front of PostgreSQL that counts the client's flights and can delay each direction.

A *flight* is data the client sends after it last received data: one network round trip
each (the first packet of a connection counts as one). ``delay`` holds every chunk that
long before forwarding it, in each direction, so a request/answer costs ``2 * delay``
more than on loopback: a network of that round-trip time.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from devtools.pgcluster import free_port


class _Flow:
    """One client connection: its two pumps and its flight count."""

    def __init__(self, client: socket.socket, upstream: socket.socket, relay: Relay) -> None:
        self.client, self.upstream, self.relay = client, upstream, relay
        self.answered = True  # the client has data it has not answered yet (true before its first packet)
        self.flights = 0

    def start(self) -> None:
        with self.relay.lock:
            self.relay.active += 2
        for source, target, from_client in ((self.client, self.upstream, True), (self.upstream, self.client, False)):
            threading.Thread(target=self._pump, args=(source, target, from_client), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, from_client: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if from_client:
                    with self.relay.lock:
                        if self.answered:
                            self.flights += 1
                            self.relay.flights += 1
                            self.answered = False
                elif not self.answered:
                    with self.relay.lock:
                        self.answered = True  # before forwarding: the client may answer at once
                if self.relay.delay:
                    time.sleep(self.relay.delay)
                target.sendall(chunk)
        except OSError:
            pass
        finally:
            with self.relay.lock:
                self.relay.active -= 1
            for end in (source, target):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)


class Relay:
    """Relay ``127.0.0.1:<port>`` to ``upstream_host:upstream_port``; use as a context manager.

    :param delay: seconds each chunk waits before it is forwarded, in each direction.
    :ivar flights: client flights over all connections since the last :meth:`reset`.
    """

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", *, delay: float = 0.0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay = delay
        self.port = free_port()
        self.flights = 0
        self.connections = 0
        self.active = 0  # running pumps
        self.lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._flows: list[_Flow] = []
        self._closed = False

    def reset(self) -> None:
        with self.lock:
            self.flights = 0
            self.connections = 0

    def settle(self, timeout: float = 10.0) -> int:
        """Wait until every relayed connection has closed; the flights counted since :meth:`reset`."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            time.sleep(0.002)
        if self.active:
            raise TimeoutError(f"{self.active // 2} relayed connections still open after {timeout} s")
        return self.flights

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            for end in (client, upstream):
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            flow = _Flow(client, upstream, self)
            with self.lock:
                self.connections += 1
                self._flows.append(flow)
            flow.start()

    def __enter__(self) -> Relay:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._closed = True
        self._listener.close()
        for flow in self._flows:
            for end in (flow.client, flow.upstream):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)  # a pump blocked in recv() keeps a merely closed socket open
                end.close()


@contextlib.contextmanager
def relay_process(upstream_port: int, upstream_host: str = "127.0.0.1", *, delay: float = 0.0) -> Iterator[int]:
    """A :class:`Relay` in a process of its own; yields its port.

    Its pumps then run outside the measured client's process: a client busy in Python holds
    the relay's threads up (they share its interpreter lock), which a real network does not.
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "devtools.relay", str(upstream_port), "--host", upstream_host, "--delay", str(delay)],
        cwd=Path(__file__).resolve().parents[1],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"the relay process did not start: {line!r}")
        yield int(line.split()[1])
    finally:
        if process.stdin is not None:
            process.stdin.close()  # the relay ends when its standard input does
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="Relay a local port to PostgreSQL until standard input closes.")
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each chunk waits, in each direction")
    args = parser.parse_args()
    with Relay(args.upstream_port, args.host, delay=args.delay) as relay:
        print(f"port {relay.port}", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
