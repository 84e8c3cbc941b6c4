"""A network namespace with its own address, joined to this host by a veth pair (fault tests).

A process that enters the namespace reaches the host at :attr:`NetNamespace.host_addr`
(a server must listen there) and is seen by the host as :attr:`NetNamespace.ns_addr`.
:meth:`NetNamespace.cut` takes the host end of the link down: from then on packets in
both directions are dropped, with no error, like a pulled cable or a firewall that
drops; :meth:`NetNamespace.restore` brings it back. Needs root (CAP_NET_ADMIN,
CAP_SYS_ADMIN) and iproute2's ``ip``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess

CLONE_NEWNET = 0x40000000
#: Namespaces named from a pid use indices 1..PID_BASED_INDICES; the rest are for explicit use.
PID_BASED_INDICES = 230


class NetNamespaceUnavailableError(RuntimeError):
    """Network namespaces cannot be created here (not root, no ``ip``, or not permitted)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetNamespaceUnavailableError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


class NetNamespace:
    """One namespace ``pglock<n>`` with veth ``plh<n>`` (host side) / ``pln<n>`` (inside).

    :param index: 1..250, picks the names and the /30 subnet 10.213.<index>.0. Default: from
        the pid, in 1..230; 231..250 are left for explicit indices (the Celery suite's workers).
    """

    def __init__(self, index: int | None = None) -> None:
        self.index = index if index is not None else os.getpid() % PID_BASED_INDICES + 1
        self.name = f"pglock{self.index}"
        self.host_if = f"plh{self.index}"
        self.ns_if = f"pln{self.index}"
        self.host_addr = f"10.213.{self.index}.1"
        self.ns_addr = f"10.213.{self.index}.2"
        self.subnet = f"10.213.{self.index}.0/30"
        self.created = False

    @staticmethod
    def unavailable_reason() -> str | None:
        """None if namespaces can be made here; otherwise why not."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "iproute2's `ip` is not installed (Debian: apt-get install -y iproute2)"
        return None

    def create(self) -> NetNamespace:
        reason = self.unavailable_reason()
        if reason:
            raise NetNamespaceUnavailableError(reason)
        self.destroy()  # a leftover of a killed earlier run
        try:
            _ip("netns", "add", self.name)
            self.created = True
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("-n", self.name, "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if)
            _ip("-n", self.name, "link", "set", self.ns_if, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def enter(self) -> None:
        """Move the calling thread (and the threads and sockets it creates later) into the namespace.

        Meant for a freshly forked child process, before it opens any connection.
        """
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns into {self.name}: {os.strerror(errno)}")
        finally:
            os.close(fd)

    def command(self, argv: list[str], hostname: str | None = None) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec``), optionally with its own host name
        (a UTS namespace: the program sees ``hostname`` as this machine's name, like a separate host)."""
        prefix = ["ip", "netns", "exec", self.name]
        if hostname is None:
            return [*prefix, *argv]
        return [*prefix, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]

    def pids(self) -> list[int]:
        """Every process inside the namespace (as ``ip netns pids`` lists them)."""
        listed = _ip("netns", "pids", self.name, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]

    def signal_all(self, signum: int) -> list[int]:
        """Send ``signum`` to every process inside the namespace (the whole "host" at once); the pids."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return pids

    def cut(self) -> None:
        """Drop every packet between the namespace and the host, silently."""
        _ip("link", "set", self.host_if, "down")

    def restore(self) -> None:
        _ip("link", "set", self.host_if, "up")

    def destroy(self) -> None:
        """Remove the namespace and both veth ends (idempotent)."""
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self.host_if, check=False)
        self.created = False

    def __enter__(self) -> NetNamespace:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
