"""The checker: the whole history of a campaign against the promise, rule by rule.

A *hold* is one key that one run believed it held, from its ``acquired`` event until the
first of: its ``released`` (a sub-key given back), the run's ``done`` (the work stopped using
its keys, at the event's ``at`` where it has one; the release follows), its ``lost`` (it
learned the lock was gone), or the death of its process (a SIGKILL). Every key is exclusive
(a pool's slots are keys of their own).

Each of these is a failure of the run (:attr:`Report.violations`):

1. **stale write accepted**: the register accepted a fenced write whose token is lower than
   one it had accepted before for the key;
2. **refused write in a completed run**: a run reported ``completed`` although the register
   refused one of its writes;
3. **overlap with a completed older holder**: two holds of one key overlap and the older one's
   run was reported ``completed`` (it did not hold the key throughout: a lost lock reported as
   success);
4. **unexplained or unbounded overlap**: two holds overlap and no fault affected the older
   holder before the overlap began, or the overlap lasted longer than :func:`overlap_bound`
   allows for that fault's kind;
5. **token went backwards**: a fenced hold got a token lower than an earlier hold of the key;
6. **left behind**: a lock, a session or a process still there when the campaign ended;
7. **period recorded twice or run again**: a scope with ``once_per`` recorded a key's period
   that another run had recorded, or took the key's scope for a period after another run's
   ``recorded`` event for it (its setup must have found the period done);
8. **one pool in two sizes**: holds of a pool's slots (or of the plain key of its name, a size
   of 1) whose runs said different sizes overlap on different keys, judged as rules 3 and 4
   judge one key's (the slots of two sizes are partly different keys, which rule 3 alone misses);
9. **kept past the lease**: a worker frozen or cut off for longer than
   :func:`~devtools.campaign.nemesis.release_bound` still had an advisory lock granted to one of
   its sessions at that bound (the nemesis looks then: a fault's ``kept``), or the look failed;
10. **write outside a hold**: a run wrote to the register for a key outside every hold of that key
    it believed (from its ``acquired``'s ``at`` to the hold's end, within :data:`WRITE_SLACK`: the
    events of one process are sequential, so a write inside a hold is written before the event
    that ends it; a SIGKILLed run's holds end at the kill, which may land up to the fault's end);
11. **error reported as a skip**: a run reported ``skipped`` for a key that its refusal (or, where
    the API says only "busy", a look right after it) named no holder of, no lock scope's row and no
    recorded ``once_per`` period for, and that no other run's hold let go within :data:`JITTER` of
    the run (a database error reported as a busy key; see :func:`_judge_skips`);
12. **lost hold reported as success (its own fault)**: a run reported ``completed`` although the
    nemesis terminated the backend of one of its holds while it believed it held it (for the kinds
    whose hold lives on one session throughout: :data:`ONE_SESSION_KINDS`), or although a fault of
    its own (``caught-error``, ``savepoint-rollback``) ended its lock while it ran, or its task was
    cleared while deferred (a ``cleared`` event: its ``GuardedTrigger`` cancelled mid-hold);
13. **connection kept open for nothing**: while the workers ran, the session watch
    (:mod:`devtools.campaign.watch`) found a worker's session idle, holding no advisory lock, for
    longer than :func:`~devtools.campaign.watch.idle_bound`, and no freeze or cut of that worker
    explains it (a guard that kept its connection after its hold: the process's exit at the end
    closes it before rule 6 looks).

14. **believed held, not held on the server**: after a lock session's early release, the worker
    found that its session no longer held another key it believed it held (an ``unheld`` event),
    and no fault of that session or of the server explains it.

15. **run rules broken** (``once_per``, ``min_interval`` on a plain guard; a scope's ``once_per`` is rule 7's):
    a guard's period recorded twice for a key or run again after another run's record (rule 7, which
    judges the guards' records too); a run that worked within its ``min_interval`` of another run's
    recorded completion of the key (any period), judged with the database's clock as the provider
    uses it: the record's ``completed_at`` (``clock_timestamp()`` of the recording statement) against
    the run's ``acquired`` event, which the worker writes after the guard's check (a check that let
    it work at ``t`` saw ``t - completed_at >= min_interval``); two recorded completions closer than
    the later one's ``min_interval``; a run refused by a run rule that held or wrote the key anyway.
    Only records of completed runs count (a run refused by the rule records nothing), and a record
    may be missing after a failover when the nemesis cancelled its commit's wait for the standby
    (docs/safety.md: it then commits on the primary alone): such a pair is excused
    (:func:`_record_may_be_lost`).

A worker records its own stalls (``stall`` events: the machine did not run it for a while, which
the nemesis did not inject). The part of one that the machine watch (a process of its own that runs
no provider code) stalled through too is judged as a freeze of that worker (a ``sigstop-long`` of
that length) if it lasted half a lease or more, and explains only an overlap that began by its end;
one inside a freeze the nemesis injected into that worker is judged by that fault. Rule 13 takes
every such stall off the idle time it judges.

Two holds taken ``shared=True`` (readers, unfenced) may overlap: rules 3, 4 and 8 judge only pairs
of which at least one is exclusive.

Besides, the figures docs/safety.md shows: operations, faults by kind, believed-held overlap
windows, time to detect and time until the key is free again, by fault kind.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_pglock.keys import LockKey
from devtools.campaign.nemesis import FAULT_KINDS, WORKER_FAULTS, release_bound
from devtools.campaign.watch import idle_bound
from devtools.campaign.workers import PAIR_KEY, PAIR_NUMBERS, SCOPE_LEASE_FACTOR, STALL_TICK

#: What every bound allows for: scheduling and the spacing of the history's events (a
#: process writes its ``lost`` or ``done`` line a moment after it acted on it).
JITTER = 1.0
#: A heartbeat's look from a side connection: a connect and one statement, milliseconds on the
#: campaign's loopback; the second is for a loaded machine (a connect that fails waits up to 2 s).
SIDE_LOOK = 1.0
#: Rule 10's tolerance: a write event and the event that ends its hold are written by one process
#: one after the other; what is left is the rounding of a handle's ``acquired_at`` (microseconds).
WRITE_SLACK = 0.001
#: Rule 11: how long after a server fault's recorded start a refusal may still come from a session
#: of before it (the nemesis notes the start before it stops or promotes a server).
SERVER_FAULT_SLACK = 0.2
#: Rule 12's margin after a ``terminate`` returned: the backend exits a moment after the signal, and
#: a hold whose work ended meanwhile may release on a session that still answered.
TERMINATE_SLACK = 0.05
#: Rule 15: the worker's clock and the lock database's (``clock_timestamp()``) are one clock in the
#: campaign (the servers run on the workers' machine); what is left is rounding.
RULES_CLOCK_SLACK = 0.01
#: The kinds whose hold lives on one session from its take to its release (rule 12): a terminated
#: backend of theirs ended the hold. Not ``scope`` nor ``deferred``: their holds move between
#: sessions (tasks, the hold hub), and a lease row holds them in between.
ONE_SESSION_KINDS = frozenset(
    {"guard-session", "guard-transaction", "guard-wait", "hook-lock", "lock-session", "guard-sub-keys", "pool"}
)


#: A worker's own doing, which it writes in the history itself: a savepoint of the work's own
#: rolled back after it took transaction-mode sub-keys, which ends them while the work goes on
#: with them (found only at their release: the overlap lasts until then, and the run must end
#: lost); an error of the work's own statement caught outside a savepoint in a transaction-mode
#: guard, which aborts the lock's transaction and so ends its lock (found by the next heartbeat).
WORKER_OWN_FAULTS = ("savepoint-rollback", "caught-error")
#: A worker's stall that the nemesis did not inject, which the worker records itself
#: (:func:`devtools.campaign.workers.watch_stalls`): judged as a freeze of that worker.
STALL = "stall"
#: A stall shorter than this many leases costs no lock (:func:`check`).
STALL_LOSS_FACTOR = 0.5
#: The nemesis's freezes of a worker: a stall the worker records inside one is that fault's.
FREEZES = frozenset({"sigstop-short", "sigstop-long", "sigstop-waiter"})
#: The faults of one worker process: they hit the holds of that process only.
PROCESS_FAULTS = WORKER_FAULTS | {STALL}
#: Every kind the report counts.
REPORTED_KINDS = (*FAULT_KINDS, *WORKER_OWN_FAULTS, STALL)

#: The faults of the server: a holder hit by one may learn of it only once the server is back
#: (a transaction lock whose fencing token's commit waits for the synchronous standby).
SERVER_FAULTS = frozenset({"restart-fast", "restart-immediate", "failover", "failover-frozen"})


def overlap_bound(kind: str, duration: float, lease: float) -> float:
    """How long two believed holds may overlap after a fault of ``kind`` (docs/safety.md).

    A frozen worker believes it holds for as long as it is frozen (only fenced writes are
    safe then); the clients of a frozen primary learn of it at their heartbeat's deadline
    (``2 * lease / 3`` after their last answer, plus a grace of up to a second) while the
    promoted standby already grants the key. Every other fault ends the session on the
    server, or cuts off a holder that gives its lock up before the server frees it: no
    overlap beyond :data:`JITTER`. (After a fault of the server, :func:`check` also lets an
    overlap last until the fault's end, except for a fenced transaction-mode guard: before the
    guard asked its lock's session again after a slow token, such a holder whose token's commit
    waited for the synchronous standby started its work with its lock gone, and this allowance
    hid it: 11 to 13 overlaps of up to 1.8 s in each 12-minute run.)
    """
    if kind == "caught-error":  # the next heartbeat's probe, then its look from a side connection
        return lease / 3 + SIDE_LOOK + JITTER
    if kind in WORKER_OWN_FAULTS:
        return math.inf
    if kind in ("sigstop-long", "sigstop-waiter", STALL):
        return duration + JITTER
    if kind == "failover-frozen":
        return 2 * lease / 3 + min(lease / 3, 1.0) + JITTER
    return JITTER


@dataclass
class Hold:
    run: str
    worker: int
    pid: int
    kind: str
    key: str
    acquired: float
    token: int | None
    backend: int | None
    end: float = float("inf")
    period: str | None = None  # a scope with once_per: the period its setup checked
    slot: int | None = None  # a scope over the pool: the slot its setup took
    pool: str | None = None  # a slot of a pool, or the plain key of a pool's name: the pool's name
    size: int | None = None  # ... and the size its run said (1: the plain key)
    shared: bool = False  # taken shared (a reader): it may overlap other shared holds
    min_interval: float | None = None  # a guard with min_interval: the interval its guard checked
    seen: float = 0.0  # when its acquired event was written (after the guard's run rules were checked)
    mode: str | None = None  # a pool's holder: its lock mode


@dataclass
class Record:
    """A completion a completed run recorded, on the database clock: exactly (``at_lo == at_hi``) or
    bracketed by the work's end and the guard's return; a scope's, only bounded above."""

    run: str
    key: str
    period: str | None  # None: a min_interval run's rolling record
    at_lo: float
    at_hi: float
    min_interval: float | None = None


@dataclass
class Run:
    run: str
    worker: int
    pid: int
    kind: str
    start: float
    holds: list[Hold] = field(default_factory=list)
    outcome: str | None = None
    detail: str = ""
    lost_at: float | None = None
    refused: int = 0
    writes: int = 0
    recorded: list[tuple[str, str, float]] = field(default_factory=list)  # (key, period, after the record)
    records: list[Record] = field(default_factory=list)  # every recorded completion (rolling ones too)
    written: list[tuple[float, str]] = field(default_factory=list)  # (when the write's event came, key)
    ended: float | None = None  # when its outcome came
    skip: dict[str, Any] | None = None  # a skip's refusal: tried, holders, scope_row, done_period
    death_end: float | None = None  # a run that died: the end of the kill (rule 10's last moment)
    trigger: bool = False  # a deferred run whose triggerer's part ran the real GuardedTrigger
    cleared: bool = False  # ... and whose task was cleared mid-hold (its trigger cancelled for a user's action)
    keys: list[str] = field(default_factory=list)  # the keys it tried without waiting (a pool's name for a pool)
    tried_at: float | None = None  # when it first tried keys without waiting


@dataclass
class Fault:
    kind: str
    start: float
    end: float
    target: str
    pids: list[int]
    detail: str = ""
    kept: list[str] | None = None  # a long freeze or cut: its workers' advisory locks at the release bound
    waiter: bool = False  # sigstop-waiter: its target was found waiting for a key
    terminated: bool | None = None  # terminate: whether it signalled the backend (None: not said)
    waited: tuple[str, ...] = ()  # sigstop-waiter: the pg_locks coordinates (classid/objid/objsubid) it waited for


def _spread(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "n": len(ordered),
        "p50": round(statistics.median(ordered), 3),
        "p99": round(p99, 3),
        "max": round(ordered[-1], 3),
    }


@dataclass
class Report:
    violations: list[str]
    figures: dict[str, Any]

    @property
    def passed(self) -> bool:
        return not self.violations


def build(events: Iterable[dict[str, Any]]) -> tuple[dict[str, Run], list[Fault]]:
    """The runs (with their holds) and the faults of a history."""
    runs: dict[str, Run] = {}
    faults: list[Fault] = []
    last_seen: dict[int, float] = {}
    stalls: list[tuple[int, float, float, float | None]] = []
    machine: list[tuple[float, float]] = []  # the machine watch's stalls
    ordered = sorted(events, key=lambda e: e["t"])
    for e in ordered:
        kind = e["event"]
        if "pid" in e and kind != "fault":
            last_seen[e["pid"]] = e["t"]
        if kind == "fault":
            faults.append(
                Fault(
                    e["kind"],
                    e["start"],
                    e["end"],
                    e["target"],
                    list(e["pids"]),
                    e.get("detail", ""),
                    e.get("kept"),
                    e.get("waiter", False),
                    e.get("terminated"),
                    tuple(e.get("waited") or ()),
                )
            )
            continue
        if kind == "stall":
            if e.get("watch") == "machine":
                machine.append((e["start"], e["end"]))
            else:
                stalls.append((e["pid"], e["start"], e["end"], e.get("cpu")))
            continue
        if "run" not in e:
            continue
        run = runs.get(e["run"])
        if kind == "attempt":
            runs[e["run"]] = Run(e["run"], e["worker"], e["pid"], e["kind"], e["t"])
            continue
        if run is None:
            continue
        if kind == "acquired":  # from when the lock was taken (``at``), not when the work began
            acquired = e.get("at", e["t"])
            run.holds.append(
                Hold(
                    run.run,
                    run.worker,
                    run.pid,
                    run.kind,
                    e["key"],
                    acquired,
                    e["token"],
                    e.get("backend"),
                    period=e.get("period"),
                    slot=e.get("slot"),
                    pool=e.get("pool"),
                    size=e.get("size"),
                    shared=bool(e.get("shared", False)),
                    min_interval=e.get("min_interval"),
                    seen=e["t"],
                    mode=e.get("mode"),
                )
            )
        elif kind == "recorded":
            at_hi = e.get("at_hi", e["t"])
            if e.get("period") is not None:
                run.recorded.append((e["key"], e["period"], at_hi))
            run.records.append(
                Record(run.run, e["key"], e.get("period"), e.get("at_lo", run.start), at_hi, e.get("min_interval"))
            )
        elif kind == "write":
            run.writes += 1
            run.refused += 0 if e["accepted"] else 1
            run.written.append((e["t"], e["key"]))
        elif kind == "tries":
            run.keys += e["keys"]
            run.tried_at = e["t"] if run.tried_at is None else run.tried_at
        elif kind == "trigger":
            run.trigger = True
        elif kind == "cleared":
            run.cleared = True
        elif kind == "released":
            for hold in run.holds:
                if hold.key == e["key"] and hold.end == float("inf"):
                    hold.end = e["t"]
        elif kind in ("done", "lost"):
            if kind == "lost" and run.lost_at is None:
                run.lost_at = e["t"]
            for hold in run.holds:  # ``at``: the work stopped using its keys earlier than the event was written
                hold.end = min(hold.end, e.get("at", e["t"]))
        elif kind == "outcome":
            run.outcome, run.detail, run.ended = e["outcome"], e.get("detail", ""), e["t"]
            if run.outcome == "skipped" and "tried" in e:  # (a history from before rule 11 has no tried)
                names = ("tried", "holders", "scope_row", "done_period", "done_record", "shared", "unlooked")
                run.skip = {name: e.get(name) for name in names}
            for hold in run.holds:
                hold.end = min(hold.end, e["t"])
    # A worker's own stall is a freeze of it that the nemesis did not inject (the machine did not run it),
    # where the machine watch, a process that runs no provider code, stalled too (a provider's call that
    # kept the worker's interpreter waiting stalls that worker alone); inside a freeze the nemesis
    # injected, the injected fault judges it (a short freeze keeps its bound).
    # Only the part the machine watch covered too counts (give or take a tick of either watch).
    injected = [f for f in faults if f.kind in FREEZES]
    for pid, start, end, cpu in stalls:
        if any(pid in f.pids and f.start - JITTER <= end and f.end + JITTER >= start for f in injected):
            continue
        for begun, ended in machine:
            shared = (max(start, begun - STALL_TICK), min(end, ended + STALL_TICK))
            if shared[1] > shared[0]:
                detail = f"not run by the machine (cpu {cpu} s in its {end - start:.2f} s)"
                faults.append(Fault(STALL, *shared, f"worker pid {pid}", [pid], detail))
    faults.sort(key=lambda f: f.start)
    # A run with no outcome died with its process: its holds end with the SIGKILL (or the kill
    # of a worker the runner had to stop); failing that, with the process's last event.
    kills = sorted((f.start, pid, f.end) for f in faults if f.kind in ("sigkill", "runner-kill") for pid in f.pids)
    for run in runs.values():
        if run.outcome is None:
            seen = last_seen.get(run.pid, run.start)
            death, run.death_end = next(
                ((t, end) for t, pid, end in kills if pid == run.pid and t >= run.start), (seen, seen)
            )
            for hold in run.holds:
                hold.end = min(hold.end, death)
    return runs, faults


def _affected(fault: Fault, hold: Hold) -> bool:
    """Whether ``fault`` could have cost ``hold`` its lock: the hold was there while the fault was
    (a restart or a failover lasts until the server is back with its synchronous standby), give
    or take :data:`JITTER` for the spacing of the events."""
    if fault.start > hold.end or hold.acquired - JITTER > fault.end:
        return False
    if fault.kind in WORKER_OWN_FAULTS:  # its target is the run
        return hold.run == fault.target
    if fault.kind in PROCESS_FAULTS:
        return hold.pid in fault.pids
    if fault.kind in ("terminate", "cancel"):
        return hold.backend in fault.pids
    return True  # the server's faults end (or freeze) every session


#: The kinds whose runs hold a fencing token issued on a side connection (transaction mode): a
#: token's commit that waits for the synchronous standby after a server fault, while the lock's
#: transaction sits idle past its lease, must not let the work start (the guard asks the lock's
#: session again): they get no allowance until the server is back.
SIDE_TOKEN_KINDS = frozenset({"guard-transaction"})


def _bound_after(fault: Fault, older: Hold, start: float, lease: float) -> float:
    """How long an overlap from ``start`` may last after ``fault`` (:func:`overlap_bound`)."""
    bound = overlap_bound(fault.kind, fault.end - fault.start, lease)
    if fault.kind in SERVER_FAULTS and older.kind not in SIDE_TOKEN_KINDS:  # ... or until the server is back
        bound = max(bound, fault.end + JITTER - start)
    return bound


def _check_overlaps(
    by_key: dict[str, list[Hold]],
    runs: dict[str, Run],
    faults: Sequence[Fault],
    lease: float,
    excludes: Callable[[Hold, Hold], bool] = lambda older, newer: True,
) -> tuple[list[str], int, dict[str, list[float]]]:
    """Rules 3 and 4 over every pair of overlapping holds of a key that ``excludes`` says may not
    overlap: the violations, how many older holders were reported completed, and the overlaps'
    lengths by the fault that caused them."""
    violations: list[str] = []
    completed_older = 0
    overlaps: dict[str, list[float]] = defaultdict(list)
    for key, holds in by_key.items():
        holds.sort(key=lambda h: h.acquired)
        for i, older in enumerate(holds):
            for newer in holds[i + 1 :]:
                if newer.acquired >= older.end:
                    break
                start, end = newer.acquired, min(older.end, newer.end)
                if newer.run == older.run or end <= start or not excludes(older, newer):
                    continue
                pair = f"{older.run} ({older.kind}, {runs[older.run].outcome}) and {newer.run} ({newer.kind})"
                where = f"on {key!r} for {end - start:.3f} s from {start:.3f}"
                if runs[older.run].outcome == "completed":
                    completed_older += 1
                    violations.append(f"overlap with a completed older holder {where}: {pair}")
                causes = [
                    f
                    for f in faults
                    if _affected(f, older) and f.start <= start and (f.kind != STALL or start <= f.end + JITTER)
                ]  # (an injected freeze is judged by its bound alone; a stall also ends its reach at its end)
                if not causes:
                    violations.append(f"unexplained overlap {where}: {pair}; no fault before it affected the older")
                    continue
                # The fault that allows the longest overlap explains it: a later fault (a network cut)
                # may come while an earlier one (the work's own error aborting a transaction lock) has
                # already ended the lock, and the older holder learns of it by the earlier one's way.
                bound, cause = max(
                    ((_bound_after(fault, older, start, lease), fault) for fault in causes), key=lambda found: found[0]
                )
                overlaps[cause.kind].append(end - start)
                if end - start > bound:
                    violations.append(
                        f"overlap longer than its bound ({bound:.3f} s after {cause.kind} on {cause.target} at "
                        f"{cause.start:.3f}) {where}: {pair}"
                    )
    return violations, completed_older, overlaps


def check(
    events: Iterable[dict[str, Any]],
    register_writes: Sequence[tuple[Any, ...]],
    *,
    lease: float,
    leftovers: Sequence[str] = (),
) -> Report:
    """Check a campaign's history (events), the register's writes (seq, key, run, token,
    accepted, at) and what the runner found left at the end."""
    events = list(events)
    runs, every_fault = build(events)
    # A stall shorter than half the lease cannot have cost a lock (the server ends a session idle for
    # the lease, and the heartbeat speaks every third of it): the rules about losses ignore it; rule 13
    # (a session kept idle) takes every stall off the idle time it judges.
    faults = [f for f in every_fault if f.kind != STALL or f.end - f.start >= STALL_LOSS_FACTOR * lease]
    violations: list[str] = [f"left behind: {item}" for item in leftovers]
    reported_success = 0

    # 1. the register never accepted a stale token
    newest: dict[str, int] = {}
    stale_accepted = 0
    for seq, key, run, token, accepted, _at in register_writes:
        if token is None or not accepted:
            continue
        if token < newest.get(key, token):
            stale_accepted += 1
            violations.append(
                f"stale write accepted: write {seq} of {run} on {key!r} with token {token} < {newest[key]}"
            )
        newest[key] = max(newest.get(key, token), token)

    # 2. a completed run had every write accepted
    for run in runs.values():
        if run.outcome == "completed" and run.refused:
            reported_success += 1
            violations.append(f"refused write in a completed run: {run.run} ({run.kind}) had {run.refused} refused")

    # 3, 4. overlaps of believed holds
    by_key: dict[str, list[Hold]] = defaultdict(list)
    for run in runs.values():
        for hold in run.holds:
            by_key[hold.key].append(hold)
    overlap_violations, completed_older, overlaps = _check_overlaps(by_key, runs, faults, lease, excludes=_exclusive)
    violations += overlap_violations
    reported_success += completed_older

    # 8. one pool's name in one size at a time
    by_pool: dict[str, list[Hold]] = defaultdict(list)
    for holds in by_key.values():
        for hold in holds:
            if hold.pool is not None:
                by_pool[f"{hold.pool} (sizes)"].append(hold)
    size_violations, size_completed, size_overlaps = _check_overlaps(
        by_pool,
        runs,
        faults,
        lease,
        excludes=lambda older, newer: older.size != newer.size and older.key != newer.key and _exclusive(older, newer),
    )  # two holds of one key: rules 3 and 4 judged them already
    violations += [f"one pool in two sizes: {v}" for v in size_violations]
    reported_success += size_completed
    for kind, spans in size_overlaps.items():
        overlaps[kind] += spans

    # 5. fencing tokens only go up, in the order the key was taken
    for key, holds in by_key.items():
        last: tuple[int, str] | None = None
        for hold in holds:
            if hold.token is None:
                continue
            if last is not None and hold.token <= last[0]:
                violations.append(
                    f"token went backwards on {key!r}: {hold.run} got {hold.token} after {last[1]} got {last[0]}"
                )
            last = (hold.token, hold.run)

    # 7. once_per: a period is recorded once per key, and no scope (nor guard) takes a key for a period
    # after another run recorded it (its setup, or its guard's check, must have found the period done)
    records: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    for run in runs.values():
        for key, period, at in run.recorded:
            records[(key, period)].append((at, run.run))
    for (key, period), recorded in records.items():
        first_at, first_run = min(recorded)
        if len(recorded) > 1 and not any(
            _record_may_be_lost(runs, faults, record, later)
            for record in runs[first_run].records
            if record.key == key and record.period == period
            for later, _ in recorded[1:]
        ):
            violations.append(f"period {period!r} of {key!r} recorded {len(recorded)} times: {sorted(recorded)}")
        for hold in by_key.get(key, []):
            if hold.period == period and hold.run != first_run and hold.acquired > first_at:
                if any(
                    _record_may_be_lost(runs, faults, record, hold.acquired)
                    for record in runs[first_run].records
                    if record.key == key and record.period == period
                ):
                    continue
                violations.append(
                    f"period {period!r} of {key!r} ran again: {hold.run} took the scope at {hold.acquired:.3f}, "
                    f"after {first_run} recorded it (by {first_at:.3f})"
                )

    # 15. the other run rules: min_interval on the database clock; a refused run did not work
    rules_violations, rules_figures = _run_rules(runs, by_key, faults)
    violations += rules_violations

    # 9. a frozen or cut-off worker's sessions were ended on the server within the release bound
    looked = [fault for fault in faults if fault.kept is not None]
    for fault in looked:
        if fault.kept:
            violations.append(
                f"kept past the lease: {release_bound(lease):.1f} s after {fault.kind} on {fault.target} at "
                f"{fault.start:.3f} ({fault.detail}): " + "; ".join(fault.kept)
            )

    # 10. every write lies inside a hold of its run and key
    outside = _writes_outside(runs)
    violations += outside

    # 11. a skip names a holder, or another run's hold explains it
    skips = _judge_skips(runs, by_key, faults, lease)
    violations += skips.pop("violations")  # type: ignore[arg-type]

    # 12. a hold its own fault ended is not reported as success
    own_fault_violations = _own_faults_completed(runs, faults)
    violations += own_fault_violations
    reported_success += len(own_fault_violations)

    # 13. no worker session idle, holding nothing, past the bound while the workers ran
    idle_violations, watch = _idle_sessions(events, every_fault, lease)
    violations += idle_violations

    # 14. a key believed held is held on the server
    unheld = _unheld(events, runs, faults)
    violations += unheld

    # figures
    detect: dict[str, list[float]] = defaultdict(list)
    freed: dict[str, list[float]] = defaultdict(list)
    for fault in faults:
        for holds in by_key.values():
            for hold in holds:
                if not _affected(fault, hold):
                    continue
                run = runs[hold.run]
                if run.lost_at is not None and run.lost_at >= fault.start:
                    detect[fault.kind].append(run.lost_at - fault.start)
                later = next((h for h in holds if h.acquired > fault.start and h.run != hold.run), None)
                if later is not None:
                    freed[fault.kind].append(later.acquired - fault.start)
    outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for run in runs.values():
        outcomes[run.kind][run.outcome or "killed"] += 1
    fault_counts = {kind: sum(1 for f in faults if f.kind == kind) for kind in REPORTED_KINDS}
    machine_events = [e for e in events if e.get("watch") == "machine"]
    stalls = {
        "machine_watch": any(e["event"] == "watching" for e in machine_events),
        "machine": sum(1 for e in machine_events if e["event"] == "stall"),
        "workers": sum(1 for e in events if e["event"] == "stall" and e.get("watch") != "machine"),
        "judged": fault_counts[STALL],  # shared with the machine's, outside injected freezes, long enough
    }
    figures = {
        "runs": len(runs),
        "holds": sum(len(run.holds) for run in runs.values()),
        "writes": len(register_writes),
        "refused_writes": sum(1 for w in register_writes if not w[4]),
        "outcomes": {kind: dict(counts) for kind, counts in sorted(outcomes.items())},
        "faults": fault_counts,
        "stalls": stalls,
        "stale_writes_accepted": stale_accepted,
        "lost_holds_reported_as_success": reported_success,
        "periods_recorded": sum(len(recorded) for recorded in records.values()),
        "run_rules": rules_figures,
        "pair_holds": sum(1 for run in runs.values() for hold in run.holds if hold.key.startswith("campaign/pair")),
        "pool_transaction_holds": sum(
            1 for run in runs.values() for hold in run.holds if hold.pool is not None and hold.mode == "transaction"
        ),
        "pool_size_refusals": sum(1 for run in runs.values() if run.outcome == "refused"),
        "pool_scopes_completed": sum(
            1 for run in runs.values() if run.outcome == "completed" and any(h.slot is not None for h in run.holds)
        ),
        "overlap_seconds": {kind: _spread(overlaps.get(kind, [])) for kind in REPORTED_KINDS},
        "detect_seconds": {kind: _spread(detect.get(kind, [])) for kind in REPORTED_KINDS},
        "freed_seconds": {kind: _spread(freed.get(kind, [])) for kind in REPORTED_KINDS},
        "release_checks": {
            "looked": len(looked),
            "kept": sum(1 for fault in looked if fault.kept),
            "frozen_waiters": sum(1 for fault in faults if fault.waiter),
        },
        "lease": lease,
        "runs_that_held": sum(1 for run in runs.values() if run.holds),
        "shared_holds": sum(1 for run in runs.values() for hold in run.holds if hold.shared),
        "writes_outside_holds": len(outside),
        "unheld": len(unheld),
        "skips": skips,
        "terminated_holds": sum(1 for f in faults if f.kind == "terminate" and f.terminated),
        "session_watch": watch,
        "guarded_triggers": {
            "runs": sum(1 for run in runs.values() if run.trigger),
            "cleared": sum(1 for run in runs.values() if run.cleared),
            "outcomes": dict(Counter(run.outcome or "killed" for run in runs.values() if run.trigger)),
        },
    }
    return Report(violations, figures)


def _record_may_be_lost(runs: dict[str, Run], faults: Sequence[Fault], record: Record, later: float) -> bool:
    """Whether ``record`` may be missing from the primary of ``later``: the nemesis cancelled a
    statement of its run's session (the commit's wait for the synchronous standby among them: it then
    commits on the primary alone, with a warning, docs/safety.md) and a failover began between the
    record and ``later`` (the promoted standby may not have it)."""
    run = runs.get(record.run)
    if run is None:
        return False
    backends = {hold.backend for hold in run.holds if hold.key == record.key}
    end = run.ended if run.ended is not None else record.at_hi
    cancelled = any(
        f.kind == "cancel" and set(f.pids) & backends and run.start - JITTER <= f.start <= end + JITTER for f in faults
    )
    failed_over = any(
        f.kind in ("failover", "failover-frozen") and record.at_lo - JITTER <= f.start <= later for f in faults
    )
    return cancelled and failed_over


def _run_rules(
    runs: dict[str, Run], by_key: dict[str, list[Hold]], faults: Sequence[Fault]
) -> tuple[list[str], dict[str, Any]]:
    """Rule 15: min_interval, judged on the database clock, and no work in a run a rule refused.

    A guard's check compares ``clock_timestamp()`` with the key's latest ``completed_at`` (its
    recording statement's ``clock_timestamp()``, before its commit), after the lock is taken and
    before the work; the worker writes its ``acquired`` event after that check. So a hold with
    ``min_interval`` M, taken after a completion of the key was recorded (the record's upper bound
    before the hold's acquisition: the recording run held the key then), must have been seen (its
    event) at least M after that record (its lower bound, the most lenient); and two recorded
    completions are at least the later one's M apart."""
    violations: list[str] = []
    records: dict[str, list[Record]] = defaultdict(list)
    for run in runs.values():
        for record in run.records:
            records[record.key].append(record)
    worked = 0
    for key, holds in by_key.items():
        for hold in holds:
            if hold.min_interval is None:
                continue
            worked += 1
            for record in records.get(key, []):
                if record.run == hold.run or record.at_hi >= hold.acquired:
                    continue
                gap = hold.seen - record.at_lo
                if gap < hold.min_interval - RULES_CLOCK_SLACK and not _record_may_be_lost(
                    runs, faults, record, hold.acquired
                ):
                    violations.append(
                        f"run within min_interval: {hold.run} ({hold.kind}) worked on {key!r} from {hold.seen:.3f}, "
                        f"{gap:.3f} s after {record.run} recorded a completion (at {record.at_lo:.3f}, database "
                        f"clock), under its min_interval of {hold.min_interval:g} s"
                    )
    for key, keyed in records.items():
        for later in keyed:
            if later.min_interval is None:
                continue
            for earlier in keyed:
                if earlier.run == later.run or earlier.at_hi > later.at_lo:
                    continue
                gap = later.at_hi - earlier.at_lo
                if gap < later.min_interval - RULES_CLOCK_SLACK and not _record_may_be_lost(
                    runs, faults, earlier, later.at_lo
                ):
                    violations.append(
                        f"recorded within min_interval: {later.run} recorded {key!r} at {later.at_hi:.3f}, {gap:.3f} s "
                        f"after {earlier.run} (at {earlier.at_lo:.3f}, database clock), under its min_interval of "
                        f"{later.min_interval:g} s"
                    )
    refused = 0
    for run in runs.values():
        skip = run.skip
        if skip is None or (skip.get("done_record") is None and skip.get("done_period") is None):
            continue
        refused += 1
        tried = set(skip.get("tried") or [])
        held = sorted({hold.key for hold in run.holds if hold.key in tried} | {k for _, k in run.written if k in tried})
        if held:
            violations.append(
                f"refused by a run rule, worked anyway: {run.run} ({run.kind}) skipped {held} (done: "
                f"{skip.get('done_record') or skip.get('done_period')}) but held or wrote them"
            )
    figures = {
        "min_interval_holds": worked,
        "refused": refused,
        "recorded": sum(len(keyed) for keyed in records.values()),
        "recorded_rolling": sum(1 for keyed in records.values() for record in keyed if record.period is None),
        "recorded_exactly": sum(1 for keyed in records.values() for r in keyed if r.at_lo == r.at_hi),
    }
    return violations, figures


def _unheld(events: Sequence[dict[str, Any]], runs: dict[str, Run], faults: Sequence[Fault]) -> list[str]:
    """Rule 14: a worker's look found a key it believed held no longer held by its session."""
    violations = []
    for e in events:
        if e["event"] != "unheld" or e["run"] not in runs:
            continue
        run = runs[e["run"]]
        holds = [hold for hold in run.holds if hold.key == e["key"] and hold.acquired <= e["t"]]
        if any(_affected(fault, hold) and fault.start <= e["t"] for fault in faults for hold in holds):
            continue  # its session or the server was hit: the loss is the fault's
        violations.append(
            f"believed held, not held on the server: {run.run} ({run.kind}) found {e['key']!r} no longer held by "
            f"its backend {e['backend']} at {e['t']:.3f}, no fault explaining it"
        )
    return violations


def _exclusive(older: Hold, newer: Hold) -> bool:
    """Whether two holds of a key exclude each other: not when both were taken shared."""
    return not (older.shared and newer.shared)


def _writes_outside(runs: dict[str, Run]) -> list[str]:
    """Rule 10: a write of a run for a key outside every hold of it the run believed."""
    violations = []
    for run in runs.values():
        for at, key in run.written:
            holds = [hold for hold in run.holds if hold.key == key]
            inside = False
            for hold in holds:
                end = hold.end
                if run.outcome is None and run.death_end is not None and end < float("inf"):
                    end = max(end, run.death_end)  # the kill lands after the fault's start, by its end
                if hold.acquired - WRITE_SLACK <= at <= end + WRITE_SLACK:
                    inside = True
                    break
            if not inside:
                spans = ", ".join(f"{hold.acquired:.3f}-{hold.end:.3f}" for hold in holds) or "none"
                violations.append(
                    f"write outside a hold: {run.run} ({run.kind}, {run.outcome}) wrote {key!r} at {at:.3f}; "
                    f"its holds of it: {spans}"
                )
    return violations


def _family(key: str, hold: Hold) -> bool:
    """Whether ``hold`` holds ``key``, or a slot of the pool named ``key`` (``<name>#slot<i>``)."""
    return hold.key == key or hold.key.startswith(f"{key}#slot")


def pg_locks_of(label: str) -> str:
    """The ``pg_locks`` coordinates (``classid/objid/objsubid``) of a key the history names by ``label``:
    the pair key's numbers, else the name's (the numeric key is taken by its name's number)."""
    key = LockKey.from_pair(*PAIR_NUMBERS) if label == PAIR_KEY else LockKey.from_name(label)
    return "/".join(str(number) for number in key.pg_locks)


def _judge_skips(
    runs: dict[str, Run], by_key: dict[str, list[Hold]], faults: Sequence[Fault], lease: float
) -> dict[str, Any]:
    """Rule 11: every key a skipped run tried was named held (a holder, a scope's row, a recorded
    period) or another run's hold of it was let go (between its work's end and its run's outcome)
    within :data:`JITTER` of the run.

    A refusal names the sessions holding the key when it looks, right after the try (a guard's
    refusal; ``hook.lock()`` and a lock session's worker look themselves): it names nobody only when
    the holder let the key go between the try and the look. So a believed hold explains an unnamed
    skip only if it ended about then (a hot key is held by someone nearly all the time: a hold that
    merely overlapped the skip would explain every error), or if its run lost it (the server ended it
    at a moment the history does not have, before the run learnt it), except a scope's or a deferred
    operator's, whose sessions change while it is held (its tasks, its hand-overs: a try at such a
    moment finds the key busy and the look finds it free): those explain a skip they overlap; so does
    a run that a run rule refused (it held the key from its try to its refusal and never worked, so the
    history has no hold of it: found by the campaign, a skip "held by a session that released it
    since" next to a once_per refusal). Any
    other hold explains it only if no fault of the server began between its acquisition and the
    skip (more than :data:`SERVER_FAULT_SLACK` before the skip's end): a restart or a failover ends
    every session, so a hold from before it held nothing after it, however long its run went on
    believing (a database error reported as a skip happens there). A scope's or a deferred
    operator's row outlives the server's faults and may outlive its run's hold by its lease (a
    teardown or a hand-over that failed: the row lapses on its own): meanwhile a guard that takes the
    key to read the row gives it back at once, and another's try may find the key busy with no holder
    left to name. Such a hold explains a skip until its lease after its end, when another run's
    refusal within :data:`JITTER` read that row from the server (named it). A run that tried the key
    without waiting and ended without working on it (failed, lost, refused, killed) explains a skip it
    overlaps, as a run rule's refusal does, unless a fault of the server or of its own process
    overlapped it. A hold whose process was cut off while it held or released the key explains a skip
    of a worker outside the cut whose try came by the release bound after the cut and whose look came
    2L/3 after it or later (the server keeps a cut-off session until its own timeout, however early
    the holder gave the key up), unless a server fault had ended that session before. A waiter frozen
    while it waited explains a skip of the key it waited for (the nemesis records it) by a worker
    outside the freeze, tried by the thaw and looked at a lease after the freeze began or later (the
    server may grant it the key during the freeze, and ends its idle wait's transaction a lease
    later). A scope's or deferred operator's row that could be live at the try explains a skip whose
    look came late, after a fault of the server that began during the run. A skip whose
    worker-side look failed
    (``unlooked``) is judged as one that named nobody (a failed look happens when the server is away,
    when errors do too); its violation says so.
    """
    row_lease = SCOPE_LEASE_FACTOR * lease
    server = sorted(f.start for f in faults if f.kind in SERVER_FAULTS)
    recorded: dict[tuple[str, str], float] = {}
    row_named: dict[str, list[float]] = defaultdict(list)  # key: when a refusal named a scope's row for it
    for run in runs.values():
        for key, period, at in run.recorded:
            recorded[(key, period)] = min(at, recorded.get((key, period), at))
        if run.skip is not None and run.ended is not None:
            for holder in run.skip.get("holders") or []:
                if "scope" in holder:
                    row_named[holder["key"]].append(run.ended)
            if run.skip.get("scope_row"):
                for key in run.skip.get("tried") or []:
                    row_named[key].append(run.ended)
    # A run a run rule refused (once_per, min_interval) held the key from its try to its refusal, with no
    # acquired event (it never worked): another run's try meanwhile finds the key busy, and its look may
    # find it free ("held by a session that released it since"). It explains a skip it overlaps.
    checked: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for run in runs.values():
        skip = run.skip
        if skip is not None and run.ended is not None and (skip.get("done_record") or skip.get("done_period")):
            for key in skip.get("tried") or []:
                checked[key].append((run.start, run.ended, run.run))
    # A run that tried a key without waiting and ended without working at all (failed, refused, killed)
    # may have taken it and held it until then, with no acquired event: a statement after its try
    # failed (a cancel, a caught error). It explains a skip it overlaps, unless a fault of the server
    # or one of its own process (a cut, a freeze) overlapped it: its failure may then be the fault's,
    # its try never taking the key, for the reason that made the skip (rule 11's very case).
    # A run that ended lost without working did take the key (found lost at its fencing token, or
    # before it): it held the key from its try until the server ended its session, at a moment before
    # its outcome that the history does not have; it is judged as a hold its run lost (below).
    spans = [(f.start - SERVER_FAULT_SLACK, f.end + JITTER) for f in faults if f.kind in SERVER_FAULTS]
    unworked: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    lost_unworked: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for run in runs.values():
        end = run.ended if run.ended is not None else run.death_end
        if run.outcome in ("completed", "skipped") or end is None:
            continue
        if run.holds:  # it worked: a key it tried and holds no hold of was busy (a batch takes what it can)
            continue
        keys = run.keys
        if run.outcome == "lost" and run.tried_at is not None:
            for key in keys:
                lost_unworked[key].append((run.tried_at, end, run.run))
            continue
        hit = any(start <= end and stop >= run.start for start, stop in spans) or any(
            run.pid in f.pids and f.start <= end and f.end + JITTER >= run.start for f in faults
        )
        if not hit:
            for key in keys:
                unworked[key].append((run.start, end, run.run))
    counts = {"judged": 0, "named": 0, "explained": 0, "unexplained": 0}  # judged: runs; the others: keys
    violations: list[str] = []
    holds = [hold for keyed in by_key.values() for hold in keyed]
    cuts = [f for f in faults if f.kind == "netcut"]

    def freed_late(hold: Hold, released_by: float, run: Run) -> bool:
        # A holder cut off while it held (or released) its key gives it up at its heartbeat's deadline,
        # or cannot send its unlock; the server keeps its session, and the key, until its own timeout:
        # not before 2L/3 after the cut (its last statement came at most L/3 before it), by the release
        # bound after it (rule 9 looks there). A try until then meets the key, a look after the server
        # let go finds nobody. Not a skip of a worker in the same cut (its own try failing there is an
        # error reported as a skip), nor after a server fault that had already ended the hold's session
        # (a scope's or a deferred operator's hold moves between sessions: one taken after that fault).
        assert run.ended is not None
        return any(
            hold.pid in f.pids
            and run.pid not in f.pids
            and hold.acquired - JITTER <= f.start <= released_by
            and run.ended >= f.start + 2 * lease / 3 - JITTER
            and run.start <= f.start + release_bound(lease) + JITTER
            and not any(
                (f.start if hold.kind in ("scope", "deferred") else hold.acquired) <= start
                and start + SERVER_FAULT_SLACK < run.start
                for start in server
            )
            for f in cuts
        )

    def explains(hold: Hold, run: Run, key: str) -> bool:
        assert run.ended is not None
        if hold.run == run.run or not _family(key, hold) or hold.acquired - JITTER > run.ended:
            return False
        holder = runs[hold.run]
        released_by = holder.ended if holder.ended is not None else (holder.death_end or hold.end)
        if freed_late(hold, released_by, run):
            return True
        if hold.kind in ("scope", "deferred"):
            if hold.end + JITTER >= run.start:  # held throughout, its sessions changing (tasks, hand-overs)
                return True
            # Its row may have held the key at the try, a lease after the hold's end; the look named the
            # row if it was still live then (another refusal about then read it), or came late, once the
            # row had lapsed, after a fault of the server that began during the run (the worker's look
            # waited out a connect to the old primary: found by the campaign, seed 20261215).
            row_live_at_try = hold.acquired - JITTER <= run.start <= hold.end + JITTER + row_lease
            return row_live_at_try and (
                any(abs(at - run.ended) <= JITTER for at in row_named.get(hold.key, ()))
                or any(run.start - SERVER_FAULT_SLACK <= start <= run.ended for start in server)
            )
        if any(run.start - SERVER_FAULT_SLACK <= start <= run.ended for start in server) and (
            hold.acquired - JITTER <= run.start and released_by >= run.start - JITTER
        ):
            # A restart or failover began during the run: its try met the hold on the server of then,
            # its look (a new connection) the server of after, with none of its locks.
            return True
        # It let the key go about then (after the try, before the look), no server fault between: the
        # release lies between the work's end and the run's outcome (a holder frozen or starved between
        # the two releases late). A server fault during the run does not rule this out: a hold taken
        # after it, on the server of after, met a try made late in the run (a connect that waited out
        # the fault first; a deferred run found the key busy after a failover, its holder gone by its look).
        # A hold its run lost ended on the server at a moment the history does not have, before its run
        # learnt it (the server ending a transaction idle past its lease while the worker stalled, a
        # session cut off): a skip's look may come just after that moment, however long the run believed.
        lost = holder.lost_at is not None
        return (
            ((lost and hold.acquired - JITTER <= run.ended) or hold.end <= run.ended + JITTER)
            and released_by >= run.start - JITTER
            and not any(hold.acquired <= start and start + SERVER_FAULT_SLACK < run.start for start in server)
        )  # (a server fault after the run began may have come between its try, which met the hold, and its look)

    waiters = [f for f in faults if f.kind == "sigstop-waiter" and f.waited]

    def granted_while_frozen(run: Run, key: str) -> bool:
        # A waiter frozen while it waited may be granted the key during the freeze, with no event (it
        # is frozen): its session holds the key, idle in its wait's transaction, until the server ends
        # that a lease after the grant (if before the thaw; after it, the waiter goes on and records
        # its hold). A try until then meets the key, a look after names nobody: a skip of that key,
        # by another worker, whose try came by the thaw and whose look came a lease after the freeze
        # began or later.
        assert run.ended is not None
        return any(
            pg_locks_of(key) in f.waited
            and run.pid not in f.pids
            and run.start <= f.end + JITTER
            and run.ended >= f.start + lease - JITTER
            for f in waiters
        )

    def unworked_explains(run: Run, key: str) -> bool:
        assert run.ended is not None
        return any(
            other != run.run and start - JITTER <= run.ended and ended + JITTER >= run.start
            for start, ended, other in [*checked.get(key, ()), *unworked.get(key, ())]
        ) or any(  # as a hold its run lost (explains(): no server fault between its try and the run)
            other != run.run
            and tried - JITTER <= run.ended
            and ended >= run.start - JITTER
            and not any(tried <= start and start + SERVER_FAULT_SLACK < run.start for start in server)
            for tried, ended, other in lost_unworked.get(key, ())
        )

    for run in runs.values():
        skip = run.skip
        if skip is None or run.ended is None:
            continue
        counts["judged"] += 1
        named = {holder.get("key") for holder in skip.get("holders") or []}  # a session, or a scope's row
        unexplained = []
        for key in skip.get("tried") or []:
            if key in named or skip.get("scope_row"):
                counts["named"] += 1
                continue
            if skip.get("done_record") is not None:  # a run rule's refusal named a recorded completion
                counts["named"] += 1
                continue
            done_period = skip.get("done_period")
            if done_period is not None and recorded.get((key, done_period), math.inf) <= run.ended + JITTER:
                counts["named"] += 1
                continue
            if (
                any(explains(hold, run, key) for hold in holds)
                or unworked_explains(run, key)
                or granted_while_frozen(run, key)
            ):
                counts["explained"] += 1
                continue
            unexplained.append(key)
        if unexplained:
            counts["unexplained"] += len(unexplained)
            unlooked = sorted(set(unexplained) & set(skip.get("unlooked") or ()))
            violations.append(
                f"error reported as a skip: {run.run} ({run.kind}) skipped {unexplained} from {run.start:.3f} to "
                f"{run.ended:.3f}; its refusal named no holder, and no other run held them then"
                + (f" (the worker's look at {unlooked} failed)" if unlooked else "")
            )
    return {**counts, "violations": violations}


def _own_faults_completed(runs: dict[str, Run], faults: Sequence[Fault]) -> list[str]:
    """Rule 12: runs reported completed although their own fault ended a hold while they ran (or their
    task was cleared while deferred)."""
    violations = [
        f"lost hold reported as success: {run.run} ({run.kind}) completed although its task was cleared while "
        "deferred (its GuardedTrigger cancelled mid-hold, its job killed)"
        for run in runs.values()
        if run.cleared and run.outcome == "completed"
    ]
    for fault in faults:
        if fault.kind in WORKER_OWN_FAULTS:
            run = runs.get(fault.target)
            if run is not None and run.outcome == "completed":
                violations.append(
                    f"lost hold reported as success: {run.run} ({run.kind}) completed after its own "
                    f"{fault.kind} at {fault.start:.3f}"
                )
        if fault.kind != "terminate" or not fault.terminated:
            continue
        for run in runs.values():
            if run.kind not in ONE_SESSION_KINDS or run.outcome != "completed":
                continue
            hit = [
                hold
                for hold in run.holds
                if hold.backend in fault.pids
                and hold.acquired <= fault.start
                and fault.end + TERMINATE_SLACK < hold.end
            ]
            if hit:
                violations.append(
                    f"lost hold reported as success: {run.run} ({run.kind}) completed although its backend "
                    f"{hit[0].backend} was terminated at {fault.start:.3f}-{fault.end:.3f} while it held "
                    f"{hit[0].key!r} (until {hit[0].end:.3f})"
                )
    return violations


def _idle_sessions(events: Sequence[dict[str, Any]], faults: Sequence[Fault], lease: float) -> tuple[list[str], Any]:
    """Rule 13: a worker's session found idle, holding nothing, past :func:`idle_bound`, unless a
    freeze, cut or kill of that worker overlapped its idle time (its process could not close it)."""
    bound = idle_bound(lease)
    pids_of: dict[int, set[int]] = defaultdict(set)  # a worker's processes (restarted after a kill)
    found: list[dict[str, Any]] = []
    looks: dict[str, Any] = {}
    for e in events:
        if "worker" in e and "pid" in e:
            pids_of[e["worker"]].add(e["pid"])
        elif e["event"] == "idle-session":
            found.append(e)
        elif e["event"] == "session-watch":
            looks = {"looks": e["looks"], "failed": e["failed"]}
    violations = []
    longest_excused, longest = 0.0, 0.0
    for e in found:
        match = re.match(r"campaign w(\d+)(?: |$)", e.get("application_name") or "")
        if match is None or e["idle"] <= bound:
            longest = max(longest, e["idle"]) if match is not None else longest
            continue
        worker = int(match.group(1))
        since = e["t"] - e["idle"]
        mine = [fault for fault in faults if set(fault.pids) & pids_of[worker]]
        stalled = sum(max(0.0, min(f.end, e["t"]) - max(f.start, since)) for f in mine if f.kind == STALL)
        excused = e["idle"] - stalled <= bound or any(
            fault.kind in WORKER_FAULTS and fault.start - JITTER <= e["t"] and fault.end + JITTER >= since
            for fault in mine
        )
        if excused:
            longest_excused = max(longest_excused, e["idle"])
            continue
        violations.append(
            f"connection kept open for nothing: {e['application_name']!r} (backend {e['backend']}) idle and holding "
            f"no advisory lock for {e['idle']:.2f} s at {e['t']:.3f} (bound {bound:.2f} s), its worker neither frozen "
            "nor cut off"
        )
    watch = {**looks, "bound": bound, "longest_within_bound": round(longest, 3), "excused": round(longest_excused, 3)}
    return violations, watch
