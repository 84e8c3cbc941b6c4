"""8. Round trips of one guarded execution, and what they cost on a network.

A relay in front of PostgreSQL (``devtools/relay.py``) counts the client's flights (data
sent after it last received data: one network round trip each) for one execution of each
variant. The same variants are then timed side by side (interleaved rounds) directly on
loopback and through a relay that holds every chunk ``DELAY`` seconds in each direction
(a network with a 2 ms round trip; the relay runs in a process of its own, as a network is
outside the client), as ratios to the floor of the same round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from benchmarks.overhead import _pals_variants
from benchmarks.servers import Servers
from benchmarks.stats import Summary, interleaved, paired_ratios, table
from devtools.relay import Relay, relay_process

DELAY = 0.001
FLOOR = "floor (raw psycopg: connect, try-lock, unlock, close)"
GUARD = "LockGuard (named key; as `@task.advisory_lock` runs it: lines written, metrics sent)"
PALS = "pals, NullPool"
TARGET_FLIGHTS = 0
TARGET_LOOPBACK = 1.10  # issue 31: through a guarded task and through hook.lock() alike
TARGET_DELAYED = 1.05
HOOK = "hook.lock (named key; LockGuard)"


REGISTRY = "LockGuard (named key, key-name registry installed)"


def _variants(
    dsn: str, with_pals: bool, registry_dsn: str | None = None
) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    from airflow_pglock.compat import get_stats
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.keys import LockKey
    from airflow_pglock.policy import LockPolicy

    named, numbered = LockKey.from_name("bench-round-trips"), LockKey.from_int(1300)
    app = "dag_id=bench task_id=round_trips run_id=manual__1 map_index=-1 try=1"

    def floor() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_try_advisory_lock(%s)", named.numbers).fetchone()
            conn.execute("SELECT pg_advisory_unlock(%s)", named.numbers).fetchone()

    def guarded(key: LockKey, where: str = dsn, policy: LockPolicy | None = None) -> Callable[[], None]:
        def run() -> None:
            hook = AdvisoryLockHook(dsn=where)
            # the module's logger, which run.py sends to /dev/null: the lines are still formatted and written
            with LockGuard(hook.database, key, policy or LockPolicy(), application_name=app, stats=get_stats):
                pass

        return run

    def hook_lock() -> None:
        with AdvisoryLockHook(dsn=dsn).lock(named, application_name=app) as handle:
            assert handle is not None

    def acquire() -> None:
        held = AdvisoryLockHook(dsn=dsn).acquire(named, application_name=app)
        assert held is not None
        held.release()

    variants: dict[str, Callable[[], object]] = {
        FLOOR: floor,
        GUARD: guarded(named),
        "LockGuard (int64 key)": guarded(numbered),
        "LockGuard (named key, transaction mode)": guarded(named, policy=LockPolicy(mode="transaction")),
        HOOK: hook_lock,
        "hook.acquire + release (named key)": acquire,
    }
    if registry_dsn is not None:
        variants[REGISTRY] = guarded(named, registry_dsn)
    if not with_pals:
        return variants, lambda: None
    pals, close = _pals_variants(dsn)
    variants[PALS] = pals[PALS]
    return variants, close


def _uri(host: str, port: int, dsn: str, dbname: str | None = None) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    return f"postgresql://{params.get('user') or 'postgres'}@{host}:{port}/{dbname or params['dbname']}"


#: Executions per variant for the client CPU column (process CPU time: every thread of this process).
CPU_RUNS = 100


def client_cpu(variants: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """CPU seconds this process spends per execution of each variant (``time.process_time``),
    variant after variant: what a loaded machine cannot hide, unlike wall time."""
    spent: dict[str, float] = {}
    for name, operation in variants.items():
        operation()
        started = time.process_time()
        for _ in range(runs):
            operation()
        spent[name] = (time.process_time() - started) / runs
    return spent


@dataclass
class RoundTripResult:
    flights: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    loopback: dict[str, list[float]] = field(default_factory=dict)
    delayed: dict[str, list[float]] = field(default_factory=dict)

    def ratio(self, samples: dict[str, list[float]], name: str) -> Summary:
        return paired_ratios(samples, FLOOR)[name]


def run_round_trips(servers: Servers, rounds: int) -> RoundTripResult:
    from benchmarks.overhead import REGISTRY_DATABASE, _registry_dsn

    result = RoundTripResult()
    upstream = psycopg.conninfo.conninfo_to_dict(servers.dsn)
    port = int(upstream.get("port") or 5432)
    _registry_dsn(servers)

    def variants_through(relay_port: int) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
        registry = _uri("127.0.0.1", relay_port, servers.dsn, REGISTRY_DATABASE)
        return _variants(_uri("127.0.0.1", relay_port, servers.dsn), servers.has("pals"), registry)

    with Relay(port) as counter:
        variants, close = variants_through(counter.port)
        try:
            for name, operation in variants.items():
                operation()  # warm: imports, the registry lookup's first plan
                counter.settle()
                counter.reset()
                operation()
                result.flights[name] = counter.settle()
        finally:
            close()
    variants, close = variants_through(port)
    try:
        result.loopback = interleaved(variants, rounds)
        result.cpu = client_cpu(variants, max(3, min(CPU_RUNS, rounds)))
    finally:
        close()
    # The delaying relay runs in a process of its own: in this one, the client's Python work would
    # hold its pumps up (one interpreter lock), and the CPU-heavier variants would pay twice.
    with relay_process(port, delay=DELAY) as delayed_port:
        variants, close = variants_through(delayed_port)
        try:
            result.delayed = interleaved(variants, max(1, rounds // 2))
        finally:
            close()
    return result


def verdicts(result: RoundTripResult) -> dict[str, tuple[str, bool]]:
    """measure -> (result text, met)."""
    extra = result.flights[GUARD] - result.flights[FLOOR]
    loop, slow = result.ratio(result.loopback, GUARD), result.ratio(result.delayed, GUARD)
    pals_loop = result.ratio(result.loopback, PALS) if PALS in result.loopback else Summary.of([float("nan")])
    hook = result.ratio(result.loopback, HOOK) if HOOK in result.loopback else Summary.of([float("nan")])
    return {
        "flights": (f"+{extra} ({result.flights[GUARD]} vs {result.flights[FLOOR]})", extra <= TARGET_FLIGHTS),
        "loopback": (f"{loop.median:.2f}x (pals NullPool {pals_loop.median:.2f}x)", loop.median <= TARGET_LOOPBACK),
        "hook": (f"{hook.median:.2f}x", hook.median <= TARGET_LOOPBACK),
        "delayed": (f"{slow.median:.2f}x", slow.median <= TARGET_DELAYED),
        "pals": (  # ahead by a margin outside both p25-p75 ranges
            f"{loop.median:.2f}x ({loop.p25:.2f}-{loop.p75:.2f}) vs {pals_loop.median:.2f}x "
            f"({pals_loop.p25:.2f}-{pals_loop.p75:.2f})",
            loop.p75 < pals_loop.p25,
        ),
    }


def render(result: RoundTripResult) -> str:
    rows = []
    for name in result.flights:
        loop, slow = result.ratio(result.loopback, name), result.ratio(result.delayed, name)
        rows.append(
            [
                name,
                str(result.flights[name]),
                f"{result.flights[name] - result.flights[FLOOR]:+d}",
                Summary.of(result.loopback[name]).fmt(1000, " ms"),
                f"{loop.median:.2f}x ({loop.p25:.2f}-{loop.p75:.2f})",
                f"{result.cpu[name] * 1000:.2f} ms" if name in result.cpu else "-",
                Summary.of(result.delayed[name]).fmt(1000, " ms"),
                f"{slow.median:.2f}x ({slow.p25:.2f}-{slow.p75:.2f})",
            ]
        )
    checks = verdicts(result)
    lines = [
        f"- {label}: **{'met' if met else 'missed'}**, {text}"
        for label, (text, met) in (
            (f"round trips over the floor, target +{TARGET_FLIGHTS}", checks["flights"]),
            (f"loopback, target <= {TARGET_LOOPBACK}x the floor", checks["loopback"]),
            (f"hook.lock() on loopback, target <= {TARGET_LOOPBACK}x the floor", checks["hook"]),
            (f"through the {DELAY * 2000:.0f} ms relay, target <= {TARGET_DELAYED}x the floor", checks["delayed"]),
            ("ahead of pals NullPool on loopback, p75 below its p25", checks["pals"]),
        )
    ]
    floor_flights, guard_flights = result.flights[FLOOR], result.flights[GUARD]
    per_flight = Summary.of(result.delayed[FLOOR]).median / floor_flights
    reading = (
        f"Reading: through the relay a flight costs about {per_flight * 1000:.1f} ms on this machine, so the round "
        f"trips alone would make the guard {guard_flights / floor_flights:.2f}x the floor. What it costs beyond that, "
        "on loopback and through the relay alike, is time the floor does not spend: CPU in the client (the heartbeat "
        "thread's start, the interruption set-up, the outcome line, the rules) and server work in a fresh "
        "backend for what the lock statement asks besides the try (see section 1 for the steps). A loaded 2-core "
        "machine magnifies both."
    )
    if GUARD in result.cpu and FLOOR in result.cpu:
        cpu_extra = (result.cpu[GUARD] - result.cpu[FLOOR]) * 1000
        wall_extra = (Summary.of(result.loopback[GUARD]).median - Summary.of(result.loopback[FLOOR]).median) * 1000
        reading += (
            f" Client CPU per execution (all threads of the process): the guard {result.cpu[GUARD] * 1000:.2f} ms, "
            f"the floor {result.cpu[FLOOR] * 1000:.2f} ms, so {cpu_extra:.2f} ms of the {wall_extra:.2f} ms the guard "
            "takes over the floor on loopback (medians) is Python work in this process."
        )
    floor_loop = Summary.of(result.loopback[FLOOR]).median
    floor_slow = Summary.of(result.delayed[FLOOR]).median
    why = (
        "**Why the time targets are missed, and what meeting them would take.** Every form makes the floor's "
        "flights, so what separates the guard from the floor is work, not latency: client CPU (the column) and "
        "server work in a fresh backend for what the lock statement asks besides the try (the pooler check, "
        "`pg_is_in_recovery()`, the registry's state, a pool's marker: section 1, 'part by part') and the "
        "unlock's `pg_notify` (which wakes a deferred waiter at once). The targets leave "
        f"{(TARGET_LOOPBACK - 1) * floor_loop * 1000:.2f} ms on loopback ({TARGET_LOOPBACK - 1:.2f} x the floor) and "
        f"{(TARGET_DELAYED - 1) * floor_slow * 1000:.2f} ms through the relay ({TARGET_DELAYED - 1:.2f} x the floor "
        "there). The server work alone (section 1) is about as much as the loopback allowance: meeting it would "
        "mean dropping a promise (the pooler or standby check, `airflow-pglock locks` naming keys, pools and plain "
        "locks of one name excluding each other, the at-once wake-up), not faster code. Cut for issue 31: the "
        "heartbeat thread starts without waiting for it to run and is not joined when the work ended before it "
        "ran; the lock statement's text is rendered once per process; the server's start time is asked only "
        "after a loss; the connection's description is built only for an error. The client work left is the "
        "guard's bookkeeping around the two statements (the outcome and acquired lines, the interruption's "
        "signal handler, the heartbeat's pipe, the rules): the client CPU column's difference, spread over many "
        "small steps (section 1's profile), none of them a round trip. A guarded task pays all of "
        "this once per task process, whose own start-up (the task runner, imports) is hundreds of milliseconds: "
        "section 6 compares whole `dag.test()` runs."
    )
    delayed = paired_ratios(result.delayed, FLOOR)
    if PALS in delayed and delayed[PALS].median > delayed[GUARD].median:
        reading += (
            " pals with NullPool makes the most flights (its engine's own start-up queries), which is why the guard "
            "is ahead of it through the relay whatever the loopback ratio."
        )
    return "\n".join(
        [
            "## 8. Round trips, and their cost on a network",
            "",
            "Run alone with `.venv/bin/python -m benchmarks.run --sections round_trips`. A relay in front of "
            "PostgreSQL (`devtools/relay.py`) counts the client's flights (data the client sends after it last "
            "received data: one network round trip each) for one execution of each variant; then the variants run "
            f"side by side, interleaved, directly on loopback and through a relay that holds each chunk "
            f"{DELAY * 1000:.0f} ms in each direction (a {DELAY * 2000:.0f} ms round trip; it runs in a process of its "
            "own, as a network is outside the client: in the client's process its threads would wait for the "
            "client's Python work). Ratios are to the floor of the same round. "
            "`tests/integration/test_round_trips.py` pins the flight counts.",
            "",
            table(
                [
                    "variant",
                    "flights",
                    "over the floor",
                    "loopback",
                    "ratio",
                    "client CPU",
                    f"through the {DELAY * 2000:.0f} ms relay",
                    "ratio",
                ],
                rows,
            ),
            "",
            *lines,
            "",
            reading,
            "",
            "The floor's 5 flights: SSL request, start-up (trust auth answers it in one flight), the try-lock, the "
            "unlock, the terminate message. A guarded execution makes the same five. The liveness settings "
            "(`idle_session_timeout`, TCP keepalives, `tcp_user_timeout`, `client_connection_check_interval`) travel "
            "in the start-up packet (libpq `options`). The server facts the safety rules need come from the "
            "handshake (the `server_version` parameter: the version, and whether it looks like PostgreSQL at all; "
            "the backend pid of the key data) and from the lock statement itself, which returns `pg_backend_pid()` "
            "(a pooler's pid differs), `pg_is_in_recovery()` (a standby) and, for a "
            "named key, whether the key-name registry is installed, and which takes the lock only on a primary and, "
            "for a session lock, only on the session the handshake reported (or through a declared session pooler). "
            "A transaction lock sends `BEGIN` and its liveness settings with the try, and the check that its "
            "transaction still holds the key with the `COMMIT`. An installed registry's write travels with the "
            "release, in the unlock's (or the commit's) flight (the row 'registry installed').",
            "",
            why,
        ]
    )
