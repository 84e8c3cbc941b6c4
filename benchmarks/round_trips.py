"""8. Round trips of one guarded execution, and what they cost on a network.

A relay in front of PostgreSQL (``devtools/relay.py``) counts the client's flights (data
sent after it last received data: one network round trip each) for one execution of each
variant. The same variants are then timed side by side (interleaved rounds) directly on
loopback and through a relay that holds every chunk ``DELAY`` seconds in each direction
(a network with a 2 ms round trip), as ratios to the floor of the same round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from benchmarks.overhead import _pals_variants
from benchmarks.servers import Servers
from benchmarks.stats import Summary, interleaved, paired_ratios, table
from devtools.relay import Relay

DELAY = 0.001
FLOOR = "floor (raw psycopg: connect, try-lock, unlock, close)"
GUARD = "LockGuard (named key; what `@task.advisory_lock` runs)"
PALS = "pals, NullPool"
TARGET_FLIGHTS = 0
TARGET_LOOPBACK = 1.15
TARGET_DELAYED = 1.05


def _variants(dsn: str, with_pals: bool) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.keys import LockKey
    from airflow_pglock.policy import LockPolicy

    named, numbered = LockKey.from_name("bench-round-trips"), LockKey.from_int(1300)
    app = "dag_id=bench task_id=round_trips run_id=manual__1 map_index=-1 try=1"
    quiet = logging.getLogger("bench.round_trips")
    quiet.disabled = True

    def floor() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_try_advisory_lock(%s)", named.numbers).fetchone()
            conn.execute("SELECT pg_advisory_unlock(%s)", named.numbers).fetchone()

    def guarded(key: LockKey) -> Callable[[], None]:
        def run() -> None:
            with LockGuard(AdvisoryLockHook(dsn=dsn), key, LockPolicy(), application_name=app, logger=quiet):
                pass

        return run

    def session_lock() -> None:
        with AdvisoryLockHook(dsn=dsn).session_lock(named, application_name=app) as held:
            assert held is not None

    def try_acquire() -> None:
        held = AdvisoryLockHook(dsn=dsn).try_acquire(named, application_name=app)
        assert held is not None
        held.release()

    variants: dict[str, Callable[[], object]] = {
        FLOOR: floor,
        GUARD: guarded(named),
        "LockGuard (int64 key)": guarded(numbered),
        "hook.session_lock (named key)": session_lock,
        "hook.try_acquire + release (named key)": try_acquire,
    }
    if not with_pals:
        return variants, lambda: None
    pals, close = _pals_variants(dsn)
    variants[PALS] = pals[PALS]
    return variants, close


def _uri(host: str, port: int, dsn: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    return f"postgresql://{params.get('user') or 'postgres'}@{host}:{port}/{params['dbname']}"


@dataclass
class RoundTripResult:
    flights: dict[str, int] = field(default_factory=dict)
    loopback: dict[str, list[float]] = field(default_factory=dict)
    delayed: dict[str, list[float]] = field(default_factory=dict)

    def ratio(self, samples: dict[str, list[float]], name: str) -> Summary:
        return paired_ratios(samples, FLOOR)[name]


def run_round_trips(servers: Servers, rounds: int) -> RoundTripResult:
    result = RoundTripResult()
    upstream = psycopg.conninfo.conninfo_to_dict(servers.dsn)
    port = int(upstream.get("port") or 5432)
    with Relay(port) as counter:
        variants, close = _variants(_uri("127.0.0.1", counter.port, servers.dsn), servers.has("pals"))
        try:
            for name, operation in variants.items():
                operation()  # warm: imports, the registry lookup's first plan
                counter.settle()
                counter.reset()
                operation()
                result.flights[name] = counter.settle()
        finally:
            close()
    variants, close = _variants(_uri("127.0.0.1", port, servers.dsn), servers.has("pals"))
    try:
        result.loopback = interleaved(variants, rounds)
    finally:
        close()
    with Relay(port, delay=DELAY) as delayed:
        variants, close = _variants(_uri("127.0.0.1", delayed.port, servers.dsn), servers.has("pals"))
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
    return {
        "flights": (f"+{extra} ({result.flights[GUARD]} vs {result.flights[FLOOR]})", extra <= TARGET_FLIGHTS),
        "loopback": (f"{loop.median:.2f}x (pals NullPool {pals_loop.median:.2f}x)", loop.median <= TARGET_LOOPBACK),
        "delayed": (f"{slow.median:.2f}x", slow.median <= TARGET_DELAYED),
        "pals": (
            f"{loop.median:.2f}x vs {pals_loop.median:.2f}x",
            loop.median < pals_loop.median,
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
            (f"through the {DELAY * 2000:.0f} ms relay, target <= {TARGET_DELAYED}x the floor", checks["delayed"]),
            ("ahead of pals NullPool on loopback", checks["pals"]),
        )
    ]
    floor_flights, guard_flights = result.flights[FLOOR], result.flights[GUARD]
    per_flight = Summary.of(result.delayed[FLOOR]).median / floor_flights
    reading = (
        f"Reading: through the relay a flight costs about {per_flight * 1000:.1f} ms on this machine, so the round "
        f"trips alone would make the guard {guard_flights / floor_flights:.2f}x the floor; what it costs beyond that, "
        "and what separates it on loopback from the hook forms that make the same flights, is CPU time in the guard "
        "(the heartbeat thread, the interruption set-up, the outcome line), which a loaded 2-core machine magnifies."
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
            f"{DELAY * 1000:.0f} ms in each direction (a {DELAY * 2000:.0f} ms round trip). Ratios are to the floor "
            "of the same round. `tests/integration/test_round_trips.py` pins the flight counts.",
            "",
            table(
                [
                    "variant",
                    "flights",
                    "over the floor",
                    "loopback",
                    "ratio",
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
            "unlock, the terminate message. A guarded execution adds, today: the server inspection (one statement: "
            "`pg_backend_pid()` against the pid of the handshake to see a pooler, `pg_is_in_recovery()` for a "
            "standby, `version()` to see a server that is not PostgreSQL; every lock) and, for a named key, the "
            "key-name registry lookup. The liveness settings (`idle_session_timeout`, TCP keepalives, "
            "`tcp_user_timeout`, `client_connection_check_interval`) travel in the start-up packet (libpq "
            "`options`), no longer as a statement of their own. What the remaining two would need: the server facts "
            "read from the handshake (`server_version`, `in_hot_standby` on PostgreSQL 14+) and `pg_backend_pid()` "
            "returned by the lock statement itself (a refusal after the lock was taken must then unlock before it "
            "closes); the registry lookup sent in the same flight as the lock or the unlock statement (pipeline).",
        ]
    )
