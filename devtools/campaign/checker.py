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
   its sessions at that bound (the nemesis looks then: a fault's ``kept``), or the look failed.

Besides, the figures docs/safety.md shows: operations, faults by kind, believed-held overlap
windows, time to detect and time until the key is free again, by fault kind.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from devtools.campaign.nemesis import FAULT_KINDS, WORKER_FAULTS, release_bound

#: What every bound allows for: scheduling and the spacing of the history's events (a
#: process writes its ``lost`` or ``done`` line a moment after it acted on it).
JITTER = 1.0
#: A heartbeat's look from a side connection: a connect and one statement, milliseconds on the
#: campaign's loopback; the second is for a loaded machine (a connect that fails waits up to 2 s).
SIDE_LOOK = 1.0


#: A worker's own doing, which it writes in the history itself: a savepoint of the work's own
#: rolled back after it took transaction-mode sub-keys, which ends them while the work goes on
#: with them (found only at their release: the overlap lasts until then, and the run must end
#: lost); an error of the work's own statement caught outside a savepoint in a transaction-mode
#: guard, which aborts the lock's transaction and so ends its lock (found by the next heartbeat).
WORKER_OWN_FAULTS = ("savepoint-rollback", "caught-error")
#: Every kind the report counts.
REPORTED_KINDS = (*FAULT_KINDS, *WORKER_OWN_FAULTS)

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
    overlap last until the fault's end: a transaction-mode holder whose fencing token's commit
    waits for the synchronous standby learns of its loss when that commit returns.)
    """
    if kind == "caught-error":  # the next heartbeat's probe, then its look from a side connection
        return lease / 3 + SIDE_LOOK + JITTER
    if kind in WORKER_OWN_FAULTS:
        return math.inf
    if kind in ("sigstop-long", "sigstop-waiter"):
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
                )
            )
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
                )
            )
        elif kind == "recorded":
            run.recorded.append((e["key"], e["period"], e["t"]))
        elif kind == "write":
            run.writes += 1
            run.refused += 0 if e["accepted"] else 1
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
            run.outcome, run.detail = e["outcome"], e.get("detail", "")
            for hold in run.holds:
                hold.end = min(hold.end, e["t"])
    # A run with no outcome died with its process: its holds end with the SIGKILL (or the kill
    # of a worker the runner had to stop); failing that, with the process's last event.
    kills = sorted((f.start, pid) for f in faults if f.kind in ("sigkill", "runner-kill") for pid in f.pids)
    for run in runs.values():
        if run.outcome is None:
            death = next(
                (t for t, pid in kills if pid == run.pid and t >= run.start), last_seen.get(run.pid, run.start)
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
    if fault.kind in WORKER_FAULTS:
        return hold.pid in fault.pids
    if fault.kind in ("terminate", "cancel"):
        return hold.backend in fault.pids
    return True  # the server's faults end (or freeze) every session


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
                causes = [f for f in faults if _affected(f, older) and f.start <= start]
                if not causes:
                    violations.append(f"unexplained overlap {where}: {pair}; no fault before it affected the older")
                    continue
                cause = max(causes, key=lambda f: f.start)
                bound = overlap_bound(cause.kind, cause.end - cause.start, lease)
                if cause.kind in SERVER_FAULTS:  # ... or until the server is back, with its standby
                    bound = max(bound, cause.end + JITTER - start)
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
    runs, faults = build(events)
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
    overlap_violations, completed_older, overlaps = _check_overlaps(by_key, runs, faults, lease)
    violations += overlap_violations
    reported_success += completed_older

    # 8. one pool's name in one size at a time
    by_pool: dict[str, list[Hold]] = defaultdict(list)
    for holds in by_key.values():
        for hold in holds:
            if hold.pool is not None:
                by_pool[f"{hold.pool} (sizes)"].append(hold)
    size_violations, size_completed, size_overlaps = _check_overlaps(
        by_pool, runs, faults, lease, excludes=lambda older, newer: older.size != newer.size and older.key != newer.key
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

    # 7. once_per: a period is recorded once per key, and no scope takes a key for a period after
    # another run recorded it (its setup must have found the period done)
    records: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    for run in runs.values():
        for key, period, at in run.recorded:
            records[(key, period)].append((at, run.run))
    for (key, period), recorded in records.items():
        if len(recorded) > 1:
            violations.append(f"period {period!r} of {key!r} recorded {len(recorded)} times: {sorted(recorded)}")
        first_at, first_run = min(recorded)
        for hold in by_key.get(key, []):
            if hold.period == period and hold.run != first_run and hold.acquired > first_at:
                violations.append(
                    f"period {period!r} of {key!r} ran again: {hold.run} took the scope at {hold.acquired:.3f}, "
                    f"after {first_run} recorded it (by {first_at:.3f})"
                )

    # 9. a frozen or cut-off worker's sessions were ended on the server within the release bound
    looked = [fault for fault in faults if fault.kept is not None]
    for fault in looked:
        if fault.kept:
            violations.append(
                f"kept past the lease: {release_bound(lease):.1f} s after {fault.kind} on {fault.target} at "
                f"{fault.start:.3f} ({fault.detail}): " + "; ".join(fault.kept)
            )

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
    figures = {
        "runs": len(runs),
        "holds": sum(len(run.holds) for run in runs.values()),
        "writes": len(register_writes),
        "refused_writes": sum(1 for w in register_writes if not w[4]),
        "outcomes": {kind: dict(counts) for kind, counts in sorted(outcomes.items())},
        "faults": fault_counts,
        "stale_writes_accepted": stale_accepted,
        "lost_holds_reported_as_success": reported_success,
        "periods_recorded": sum(len(recorded) for recorded in records.values()),
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
    }
    return Report(violations, figures)
