"""4. Recovery: how long a dead, frozen or cut-off holder keeps others out.

Each holder is a process of its own that takes a lock and then idles ("works"):

* ``airflow-pglock``: :class:`devtools.holder.Holder` (a LockGuard with a short lease);
* ``PostgreSQL defaults``: a plain session with ``pg_advisory_lock`` and none of the
  provider's settings (what pals or a hand-written lock gets);
* ``python-redis-lock``: ``expire`` = the same lease, ``auto_renewal=True``.

The fault hits every holder of a trial at the same moment: SIGKILL, SIGSTOP, or the
network namespace the holders run in is cut off (:class:`devtools.netns.NetNamespace`:
the link goes down, packets are dropped silently). A contender thread per holder then
tries the lock every 10 ms; the recovery time is from the fault to its first success,
capped. A holder that reaches the cap in the first trial is not tried again (its time is
``> cap``); the others are repeated.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.servers import Servers
from benchmarks.stats import Summary, progress, table
from devtools.holder import Holder, HolderConfig
from devtools.netns import NetNamespace

PGLOCK, DEFAULTS, REDIS = "airflow-pglock", "PostgreSQL defaults", "python-redis-lock"
VARIANTS = (PGLOCK, DEFAULTS, REDIS)
KILL, STOP, CUT = "SIGKILL", "SIGSTOP", "network cut"
FAULTS = (KILL, STOP, CUT)
POLL_SECONDS = 0.01


def _raw_holder(
    variant: str,
    dsn: str,
    redis_host: str,
    redis_port: int,
    key: str,
    lease: float,
    netns_index: int | None,
    pipe: Connection,
) -> None:
    """A holder without airflow-pglock: a plain PostgreSQL session lock, or python-redis-lock."""
    try:
        if netns_index is not None:
            NetNamespace(netns_index).enter()
        if variant == DEFAULTS:
            from airflow_pglock.keys import LockKey

            conn = psycopg.connect(dsn, autocommit=True, application_name="bench holder defaults")
            conn.execute("SELECT pg_advisory_lock(%s)", LockKey.from_name(key).numbers)
        else:
            import redis
            import redis_lock

            # After a cut or a freeze its renewal thread finds the key expired and raises: expected here.
            threading.excepthook = lambda args: None
            lock = redis_lock.Lock(redis.Redis(host=redis_host, port=redis_port), key, expire=lease, auto_renewal=True)
            lock.acquire()
        pipe.send({"event": "acquired", "t": time.monotonic()})
        while True:
            time.sleep(0.05)
    except BaseException as error:
        with contextlib.suppress(Exception):
            pipe.send({"event": "error", "error": f"{type(error).__name__}: {error}"})
    finally:
        os._exit(5)


class RawHolder:
    """The parent's side of a :func:`_raw_holder` process (same surface as devtools.holder.Holder)."""

    def __init__(self, *args: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        self._events, child_end = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_raw_holder, args=(*args, child_end), daemon=True)
        self.process.start()
        child_end.close()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        if not self._events.poll(timeout):
            raise TimeoutError(f"holder {self.pid}: no {event!r} within {timeout} s")
        message: dict[str, Any] = self._events.recv()
        if message["event"] != event:
            raise RuntimeError(f"holder {self.pid}: {message}")
        return message

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # also ends a stopped process, without thawing it first
        self.process.join(10)
        self._events.close()


@dataclass(frozen=True)
class Item:
    variant: str
    fault: str


@dataclass
class RecoveryResult:
    lease: float
    cap: float
    times: dict[Item, list[float | None]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    netns_error: str | None = None
    keepalive: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


class Contender:
    """Tries one holder's lock every 10 ms from its own pre-opened connection or client."""

    def __init__(self, servers: Servers, item: Item, key: str, lease: float) -> None:
        from airflow_pglock.keys import LockKey

        self.item, self.key = item, key
        self.numbers = LockKey.from_name(key).numbers
        self.conn: psycopg.Connection[Any] | None = None
        self.redis: Any = None
        if item.variant == REDIS:
            self.redis = servers.redis.client()
        else:
            self.conn = servers.admin("bench contender")
        self.lease = lease
        self.fault_at: float | None = None
        self.recovered: float | None = None

    def try_once(self) -> bool:
        if self.redis is not None:
            import redis_lock

            lock = redis_lock.Lock(self.redis, self.key, expire=self.lease)
            if lock.acquire(blocking=False):
                lock.release()
                return True
            return False
        assert self.conn is not None
        row = self.conn.execute("SELECT pg_try_advisory_lock(%s)", self.numbers).fetchone()
        if row and row[0]:
            self.conn.execute("SELECT pg_advisory_unlock(%s)", self.numbers)
            return True
        return False

    def poll(self, cap: float) -> None:
        assert self.fault_at is not None
        while time.monotonic() - self.fault_at < cap:
            if self.try_once():
                self.recovered = time.monotonic() - self.fault_at
                return
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.redis is not None:
            self.redis.close()


def _start_holder(servers: Servers, item: Item, key: str, lease: float) -> Any:
    in_netns = item.fault == CUT
    assert not in_netns or servers.netns is not None
    dsn = servers.dsn_from_netns() if in_netns else servers.dsn
    if item.variant == PGLOCK:
        netns = servers.netns.name if in_netns and servers.netns else None
        return Holder(HolderConfig(dsn, key, lease=lease, work_seconds=3600, netns=netns)).start()
    redis_host = servers.netns.host_addr if in_netns and servers.netns else "127.0.0.1"
    netns_index = servers.netns.index if in_netns and servers.netns else None
    redis_port = servers.redis_server.port if servers.redis_server is not None else 0
    return RawHolder(item.variant, dsn, redis_host, redis_port, key, lease, netns_index)


def run_trial(
    servers: Servers, items: list[Item], lease: float, cap: float, trial: int, delay: float
) -> dict[Item, float | None]:
    keys = {item: f"bench/recovery/{item.variant}/{item.fault}/{trial}" for item in items}
    holders: dict[Item, Any] = {}
    contenders: dict[Item, Contender] = {}
    try:
        for item in items:
            holders[item] = _start_holder(servers, item, keys[item], lease)
        for item in items:
            holders[item].wait_for("acquired", 60)
            contenders[item] = Contender(servers, item, keys[item], lease)
            if contenders[item].try_once():
                raise RuntimeError(f"{item}: a contender got the lock while the holder held it")
        time.sleep(delay)  # the fault's phase relative to heartbeats and renewals
        cut_at: float | None = None
        for item in items:
            if item.fault == CUT:
                if cut_at is None:
                    assert servers.netns is not None
                    servers.netns.cut()
                    cut_at = time.monotonic()
                contenders[item].fault_at = cut_at
            else:
                os.kill(holders[item].pid, signal.SIGKILL if item.fault == KILL else signal.SIGSTOP)
                contenders[item].fault_at = time.monotonic()
        threads = [threading.Thread(target=c.poll, args=(cap,), daemon=True) for c in contenders.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(cap + 30)
        return {item: contender.recovered for item, contender in contenders.items()}
    finally:
        if servers.netns is not None:
            servers.netns.restore()
        for holder in holders.values():
            holder.stop()
        for contender in contenders.values():
            contender.close()
        _wait_released(servers)


def _wait_released(servers: Servers, timeout: float = 15) -> None:
    """After a trial: no holder session may be left (a cut one is ended by force after ``timeout``)."""
    deadline = time.monotonic() + timeout
    with servers.admin() as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND application_name LIKE '%holder%'"
            ).fetchone()
            if row and row[0] == 0:
                return
            time.sleep(0.1)
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND application_name LIKE '%holder%'"
        )


def _keepalive_defaults() -> dict[str, str]:
    values = {}
    for name in ("tcp_keepalive_time", "tcp_keepalive_intvl", "tcp_keepalive_probes"):
        with contextlib.suppress(OSError):
            values[name] = Path(f"/proc/sys/net/ipv4/{name}").read_text().strip()
    return values


def run_recovery(
    servers: Servers, lease: float, cap: float, trials: int, faults: tuple[str, ...] = FAULTS
) -> RecoveryResult:
    import airflow_pglock.guard  # noqa: F401  (the holders fork with it imported: they start in milliseconds)

    result = RecoveryResult(lease, cap, netns_error=servers.netns_error, keepalive=_keepalive_defaults())
    usable = [f for f in faults if f != CUT or servers.netns is not None]
    pending = [Item(variant, fault) for fault in usable for variant in VARIANTS if servers.has(variant)]
    result.missing = {name: why for name, why in servers.missing.items() if name in VARIANTS}
    phases = random.Random(8)  # reproducible: the same fault phases on every run
    for trial in range(trials):
        if not pending:
            break
        progress(f"recovery trial {trial + 1}/{trials}: {len(pending)} holders, cap {cap:g} s")
        try:
            delay = lease * phases.uniform(0.5, 1.5)
            times = run_trial(servers, pending, lease, cap, trial, delay)
        except Exception as error:
            result.errors.append(f"trial {trial + 1}: {type(error).__name__}: {error}")
            continue
        for item, seconds in times.items():
            result.times.setdefault(item, []).append(seconds)
        pending = [item for item in pending if times[item] is not None]  # capped once: not repeated
    return result


def render(result: RecoveryResult) -> str:
    rows = []
    for fault in FAULTS:
        for variant in VARIANTS:
            values = result.times.get(Item(variant, fault))
            if values is None:
                continue
            if any(v is None for v in values):
                cell = f"**> {result.cap:g} s** (capped; n={len(values)})"
            else:
                s = Summary.of([v for v in values if v is not None])
                cell = f"{s.median:.2f} s (p25 {s.p25:.2f}, p75 {s.p75:.2f}, n {s.n})"
            rows.append([fault, variant, cell])
    keepalive = result.keepalive
    total = ""
    if keepalive:
        idle, interval, probes = (
            int(keepalive.get(k, 0)) for k in ("tcp_keepalive_time", "tcp_keepalive_intvl", "tcp_keepalive_probes")
        )
        seconds = idle + interval * probes
        total = (
            f"this machine's kernel defaults are tcp_keepalive_time={idle} s, tcp_keepalive_intvl={interval} s, "
            f"tcp_keepalive_probes={probes}: {seconds} s = {seconds // 3600} h {seconds % 3600 // 60} min "
            f"{seconds % 60} s"
        )
    lease = result.lease
    lines = [
        "## 4. Recovery: from the fault until another contender acquires",
        "",
        f"airflow-pglock runs with a short lease for this benchmark: **lease = {lease:g} s** (the default is 30 s; "
        f"the server ends a lock session idle for the lease, the holder heartbeats every lease/3 = {lease / 3:.2f} s). "
        f"python-redis-lock gets the same number as its `expire` (with `auto_renewal`). 'PostgreSQL defaults' is a "
        "plain session lock without any of the provider's settings. All holders of a trial are hit at the same "
        "moment, 0.5 to 1.5 leases after they acquired (drawn per trial, seeded: the fault lands at any phase of "
        f"the heartbeats and renewals); contenders try every {POLL_SECONDS * 1000:g} ms; measurements "
        f"stop at the cap of {result.cap:g} s.",
        "",
        table(["fault", "holder", "time until a contender acquires"], rows),
        "",
        f"Bounds: a frozen or cut-off airflow-pglock holder loses its lock at most one lease ({lease:g} s) after its "
        "last answered heartbeat, so at most a lease after the fault; python-redis-lock's key expires at most "
        "`expire` after its last renewal.",
        "",
        "Why:",
        "",
        "- **SIGKILL**: the kernel closes the dead holder's socket, the server sees the connection end and drops the "
        "session and its locks at once, with or without the provider's settings. A Redis lock is not tied to a "
        "connection: it stays until its `expire` runs out.",
        "- **SIGSTOP** (frozen process, e.g. a stuck VM or a debugger): the kernel still answers TCP keepalives for a "
        "frozen process, so only a server-side idle limit helps. The provider sets `idle_session_timeout` = the lease "
        "on its session (the heartbeat keeps a healthy one busy); without it the frozen holder keeps the lock for as "
        "long as it stays frozen.",
        "- **network cut**: without the provider's settings the server notices a silent peer only through TCP "
        f"keepalives, after the OS default ({total or 'about 2 h 11 min on Linux'}). The provider's "
        "`idle_session_timeout`, `tcp_keepalives_*` and `tcp_user_timeout` bound it by the lease.",
    ]
    lines += [f"\nNot measured: {reason}." for reason in result.missing.values()]
    if result.netns_error:
        lines += ["", f"The network cut was not measured: {result.netns_error}."]
    if result.errors:
        lines += ["", "Errors:", "", *[f"- {e}" for e in result.errors]]
    return "\n".join(lines)
