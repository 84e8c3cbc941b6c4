"""The campaign's holders: processes that take hot keys through every public way to hold a lock.

Each worker process loops until the stop file appears: it picks a kind's keys, holds them
through the provider's public API, and while it believes it holds them ("works") writes to
the fencing register every :data:`STEP` seconds (with its fencing token where the kind has
one), then reports the outcome. Everything goes to its history file
(:mod:`devtools.campaign.history`). A worker may run in a network namespace (another
"host"); the nemesis freezes, kills and cuts workers off.

The kinds (every public way to hold a lock, see docs/safety.md):

* ``guard-session`` / ``guard-transaction``: what ``@task.advisory_lock(fencing=True)`` runs
  (``LockGuard.run``), in session and transaction mode; now and then (:data:`PAIR_SHARE`) on the
  hot (int32, int32) pair key :data:`PAIR_NUMBERS` (``WorkerConfig.pair_key`` names it), and now and
  then (:data:`RULES_SHARE`) on the rules key with ``once_per`` (a period of
  :data:`RULES_PERIOD_SECONDS`), ``min_interval`` (:data:`MIN_INTERVAL`) or both, as a plain guard
  checks and records them: its ``acquired`` event (written after the check) says them, a refusal
  names the recorded completion it met (``done_record``), and a completed run's ``recorded`` event
  says when its completion was recorded on the database clock (read back by its fencing token);
* ``guard-wait``: the same with ``on_busy="wait"`` (the pair key and the rules key too);
* ``hook-lock``: ``hook.lock(key)`` (no fencing), now and then on the numeric key (taken by its
  number: no name, so no registry state and no scope row asked), on the pair key (by its two
  numbers) or on the rules key (an exclusive holder without rules); a quarter of its runs take the
  key ``shared=True`` (two shared holders may overlap, a shared and an exclusive one may not), a
  quarter ``mode="transaction"``, a quarter wait for it (``timeout=HOOK_WAIT``);
* ``lock-session``: ``hook.lock_session()`` with ``try_lock_many`` batches, a waiting
  ``lock(key, timeout=...)`` or a single ``try_lock(key)`` (of a hot key or the numeric key; a
  third of the single tries ``shared=True``), and an early ``release``, after which it looks whether
  its session still holds its other keys (an ``unheld`` event when not); its batch ends with two keys
  of its own (``campaign/own/<n>/1`` and ``/2``, which no one else takes), so that whatever it
  gives back, another key of the batch stays held;
* ``guard-sub-keys``: a guard's own key plus sub-keys through its ``lock`` handle (a batch, or a
  single ``try_lock`` block of a hot key or the numeric key), in session mode or, a third of the
  time, in transaction mode (the sub-keys are then transaction locks, ended by the commit; now
  and then the batch is taken inside a savepoint of the work's own that is rolled back at once,
  which ends its keys while the work goes on with them: the run must end lost);
* ``pool``: a pool of slots (``slots=2``), in eras of :data:`SIZE_ERA` seconds of the wall
  clock: a quarter of them take the pool's name as a pool of ``slots=3``, a quarter as a plain
  key (``slots=1``, half of them waiting); a third of the runs of a pool of slots take it in
  ``mode="transaction"`` (its slot and its size markers are then transaction locks, and a tenth of
  those runs' work catches an error of its own statement, as ``guard-transaction``'s; the
  ``acquired`` event says the mode); and a tenth of the runs of any era the size of
  another: the sizes meet at every change of era, where each must be refused while a holder
  of another size holds the name (outcome ``refused``), and hold only while none does;
* ``scope``: a lock scope (``advisory_lock_scope``: docs/scopes.md) as its setup, tasks and
  teardown run it, with a fencing token per scope (a quarter of its runs run the setup again after
  the first task, as a task cleared mid-scope does: it takes over its own earlier row, with the same
  lineage, a new holder id and a new token, and the later tasks and the teardown use those): it
  believes it holds the key from its setup to its last task, the gaps between tasks included (the
  lease row holds it there). Half of
  its runs on one key have ``once_per`` a period of :data:`PERIOD_SECONDS` (the setup checks it,
  the teardown records it when every task succeeded: a ``recorded`` event). A third of its runs
  are a scope over the pool (``slots=2``, no token): it holds the slot its setup took.
* ``deferred``: a guarded deferrable operator (docs/deferrable-operators.md): it takes the key
  as a guard with a fencing token, works, hands the hold over to the triggerer's part (the hold
  hub of :mod:`airflow_pglock.triggers.holds`, run in the same process on an event loop of its
  own, as a triggerer runs it), works while the hub holds the key (the operator's external job
  while the task is deferred; it goes on while the hub takes the key back after its session was
  lost, under the row, and stops once the hub says the hold is lost), has the hub hand the hold
  back, and resumes as a guard that re-enters the hold and works again. A quarter of its runs end
  in the triggerer instead (an operator's trigger that finishes the task there: the hub deletes
  the row under the key, lowers the scopes' horizon and releases the key; no resume). It believes
  it holds the key from the first acquisition to its last work, the hand-overs included (the
  lease row holds it there).
  Half of its runs (:data:`TRIGGER_SHARE`) take the triggerer's part through the real
  ``GuardedTrigger`` (:mod:`airflow_pglock.triggers.guarded`) instead of the hub directly: built
  as ``guarded()`` builds it when an operator defers, around an operator trigger of the
  campaign's own (:mod:`devtools.campaign.external_job`: its external job writes the register
  every :data:`STEP` while the trigger waits, and goes on until an ``on_kill()`` stops it), its
  ``run()`` on an event loop as a triggerer runs it, and the first event taken: the hold handed
  back (resume as above), the task ended there (a task-end event: the job's ``done`` before the
  hub frees the key), lost (the resumed task's ``on_kill()`` stops the job: ``lost``) or failed
  (the job's write failed: the task re-enters the hold to free its row, and fails). It reaches
  the lock database through an Airflow connection (``AIRFLOW_CONN_CAMPAIGN_W<n>_LOCKS``, JSON: the
  lock DSN's two hosts, its two ports, ``target_session_attrs`` and ``connect_timeout`` as extras),
  through a hub that is ``hub_for``'s but for its session's lease (the campaign's, not a
  triggerer's 30 s) and name (``campaign w<n> holds``). It asks a random ``resume_hold`` (up to
  one second: the hold's clock from the trigger's start). On Airflow 3.3+ half of those runs
  (:data:`CLEAR_SHARE`) are cleared mid-hold: the trigger's task is cancelled as the triggerer
  cancels it for a user's action (``GuardedTrigger`` kills the job under the hold; the job takes up
  to two steps to stop and writes meanwhile, then ``lost``), a ``released`` event follows once the
  cancellation let the key go (a write after it lies outside the hold: checker rule 10), then
  ``cleared``; the triggerer's ``on_kill()`` comes a moment later, and the run ends lost (rule 12:
  never completed). When the job has writes left, the task's next try (a run of its own,
  ``<run>-next``) starts a step before the cancellation, as on Airflow 3.3+: it finds its earlier
  try's live row, waits for the key, takes the row over with a token of its own and works: a job
  still running once the key was let go overlaps it (rules 4 and 10).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.campaign.history import HistoryWriter

#: Seconds between two register writes of a holder (and the unit of its work).
STEP = 0.25
KINDS = (
    "guard-session",
    "guard-transaction",
    "guard-wait",
    "hook-lock",
    "lock-session",
    "guard-sub-keys",
    "pool",
    "scope",
    "deferred",
)
FENCED_KINDS = frozenset({"guard-session", "guard-transaction", "guard-wait", "scope", "deferred"})
#: The longest any statement of a worker waits on the server for a busy key (``lock_timeout``):
#: a guard's, a scope member's and a deferred operator's ``on_busy="wait"``. The nemesis's release
#: check allows for it (:func:`devtools.campaign.nemesis.release_bound`).
WAIT_TIMEOUT = 1.5
#: A worker's stall watch (:func:`watch_stalls`): it sleeps a tick and records a stall when it woke
#: more than STALL_MIN late while its process ran for less than STALL_CPU_SHARE of that time (the
#: machine did not run it: not its own work, which would have used the CPU).
STALL_TICK = 0.05
STALL_MIN = 0.5
STALL_CPU_SHARE = 0.2
#: A scope's lease, in workers' leases: a long freeze (1.5-2.5 leases) between its tasks may
#: outlast it (the scope lapses; its next task must fail as lost); a cut-off worker learns of
#: the cut at its next task's connect (2 s) well before it.
SCOPE_LEASE_FACTOR = 2.0
#: The length of a scope's once_per period, in seconds (the period is the wall clock's quotient).
PERIOD_SECONDS = 20
#: The length of an era of the pool kind's size, in seconds of the wall clock (every worker's the same).
SIZE_ERA = 5.0
#: The hot (int32, int32) pair key's numbers (the two-int32 key space, apart from every int64 key), taken
#: now and then by the guard kinds and ``hook-lock``; the history names it by ``WorkerConfig.pair_key``.
PAIR_NUMBERS = (20261202, 7)
#: The pair key's label in the history (taken by the guard kinds and ``hook-lock`` now and then).
PAIR_KEY = "campaign/pair"
#: The share of a guard kind's runs on the pair key, and (of the others) on the rules key.
PAIR_SHARE = 0.15
RULES_SHARE = 0.25
#: The length of a guard's ``once_per`` period on the rules key, in seconds (the wall clock's quotient, prefixed
#: ``g``: apart from the scopes' periods, which are other keys' anyway).
RULES_PERIOD_SECONDS = 6
#: A guard's ``min_interval`` on the rules key, in seconds (the database clock).
MIN_INTERVAL = 2.0
#: The share of the ``pool`` kind's runs (of a pool of slots, not the plain key) that take it in transaction mode.
POOL_TRANSACTION_SHARE = 1 / 3
#: The share of the ``deferred`` kind's runs whose triggerer's part runs the real ``GuardedTrigger``
#: (the others drive the hold hub directly), and of those (Airflow 3.3+) a task cleared mid-hold.
TRIGGER_SHARE = 0.5
CLEAR_SHARE = 0.5
#: The triggerer's cancel message for a user's action (a task cleared or marked while deferred).
USER_ACTION_CANCEL = "__airflow_user_action__"
#: The GuardedTrigger's ``connect_timeout`` (the workers' own).
TRIGGER_CONNECT_TIMEOUT = 2
#: How long a ``hook-lock`` run that waits for its key waits (``hook.lock(key, timeout=...)``): under
#: :data:`WAIT_TIMEOUT`, which the nemesis's release check allows for.
HOOK_WAIT = 0.5


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker process does.

    :param index: the worker's number (its history file, its application_name).
    :param kind: one of :data:`KINDS`.
    :param lock_dsn: the lock database's multi-host DSN, as seen from the worker's host.
    :param register_dsn: the fencing register's DSN, as seen from the worker's host.
    :param lease: the lease of its locks, in seconds.
    :param history: its history file.
    :param stop_file: the worker stops once this file exists (after its current run).
    :param seed: its random choices' seed (with the spawn number).
    :param hot_keys: the contended key names.
    :param pool: the pool's name; :param pool_slots: its size.
    :param numeric_key: the label of a key taken by its number (no name), or None: taken by
        ``hook-lock``, ``lock-session`` and ``guard-sub-keys`` now and then.
    :param pair_key: the label of the (int32, int32) pair key :data:`PAIR_NUMBERS`, or None: taken by
        the guard kinds and ``hook-lock`` now and then.
    :param rules_key: the key of the run rules (``once_per``, ``min_interval``), or None: taken by the
        guard kinds now and then with those rules, and by ``hook-lock`` (no rules) now and then.
    :param netns: the network namespace to enter first (another host), or None.
    """

    index: int
    kind: str
    lock_dsn: str
    register_dsn: str
    lease: float
    history: Path
    stop_file: Path
    seed: int
    hot_keys: tuple[str, ...]
    pool: str
    pool_slots: int
    numeric_key: str | None = None
    pair_key: str | None = None
    rules_key: str | None = None
    netns: str | None = None


class StaleTokenRefusedError(Exception):
    """The register refused this holder's write: a newer token was accepted for the key."""


class _Lost(Exception):  # noqa: N818 - a control-flow signal inside a lock session
    """A lock session was found lost between two steps."""


class Worker:
    def __init__(self, config: WorkerConfig, spawn: int) -> None:
        from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
        from airflow_pglock.liveness import Liveness

        self.config = config
        self.rng = random.Random(config.seed * 1000 + spawn)
        self.history = HistoryWriter(config.history, worker=config.index, pid=os.getpid(), kind=config.kind)
        self.hook = AdvisoryLockHook(dsn=config.lock_dsn, liveness=Liveness(config.lease), connect_timeout=2)
        self.name = f"campaign w{config.index}"
        #: Keys only this worker takes (a lock session's batch): ``campaign/own/<index>/<1|2>``.
        self._own_keys = (f"campaign/own/{config.index}/1", f"campaign/own/{config.index}/2")
        self._register: Any = None
        self.runs = 0

    # ----------------------------------------------------------------- the register

    def _write(self, run: str, key: str, token: int | None) -> None:
        import psycopg

        from devtools.campaign.servers import FENCED_WRITE, UNFENCED_WRITE

        if self._register is None or self._register.closed:
            self._register = psycopg.connect(self.config.register_dsn, autocommit=True)
        statement = FENCED_WRITE if token is not None else UNFENCED_WRITE
        try:
            row = self._register.execute(statement, {"key": key, "run": run, "token": token}).fetchone()
        except BaseException as error:
            if not isinstance(error, psycopg.Error):
                # The loss's interruption, landed while the write waited: psycopg cancels and drains
                # a statement only for KeyboardInterrupt and SystemExit. Left in flight, the write
                # could still land later, and the next write on this connection would fail.
                with contextlib.suppress(Exception):
                    self._register.cancel_safe(timeout=1.0)
            self._register.close()
            raise
        accepted, at = bool(row[0]), float(row[1])
        self.history.emit("write", run=run, key=key, token=token, accepted=accepted, at=at)
        if not accepted:
            raise StaleTokenRefusedError(f"the register refused token {token} for {key!r}")

    def _work(self, run: str, held: dict[str, int | None], lost: Any = None, *, finish: bool = True) -> None:
        """Write every held key every step, for a random while; ``lost()`` says a session is gone.

        Ends with a ``done`` event (also when it raises; not with ``finish`` False: a task of a
        scope, whose hold goes on): from then on the holder no longer uses the keys (what
        follows is the release). A loss it learns of is a ``lost`` event.
        """
        from airflow_pglock.exceptions import LockLostInterrupt

        try:
            for _ in range(self.rng.randint(2, 10)):
                if lost is not None and lost():
                    self.history.emit("lost", run=run)
                    raise _Lost(str(lost()))
                for key, token in list(held.items()):
                    self._write(run, key, token)
                time.sleep(STEP)
        except LockLostInterrupt:
            self.history.emit("lost", run=run)
            raise
        finally:
            if finish:
                self.history.emit("done", run=run)

    # ----------------------------------------------------------------- the kinds

    def _maybe_numeric(self, label: str, share: float) -> tuple[str, Any]:
        """``(label, key)`` to take: the named key ``label``, or (``share`` of the time) the
        numeric key, taken by its number and named in the history by its label."""
        from airflow_pglock.keys import LockKey

        numeric = self.config.numeric_key
        if numeric is None or self.rng.random() >= share:
            return label, label
        number = LockKey.from_name(numeric).int64
        assert number is not None  # a name's key is an int64
        return numeric, LockKey.from_int(number)

    def _guard(
        self,
        run: str,
        key: str,
        *,
        mode: str = "session",
        wait: bool = False,
        slots: int = 1,
        pool: str | None = None,
        lock_key: Any = None,
        rules: Any = None,
    ) -> None:
        """A guard's run; ``pool``: ``key`` is that pool's name, taken with ``slots`` (a refusal for
        another holder's size ends the run ``refused``); ``lock_key``: the key taken (a pair's), which
        the history names ``key``; ``rules``: its run rules (default: fencing, unless a pool of slots).

        With ``once_per`` or ``min_interval``, its ``acquired`` event says them (emitted after the
        guard checked them: the work begins there), and a completed run's ``recorded`` event says when
        the provider recorded the completion, on the database clock (:meth:`_recorded`)."""
        from airflow_pglock.exceptions import LockConfigurationError
        from airflow_pglock.guard import LockGuard
        from airflow_pglock.keys import LockKey
        from airflow_pglock.policy import LockPolicy
        from airflow_pglock.run_rules import RunRules

        policy = LockPolicy(
            mode=mode,  # type: ignore[arg-type]
            on_busy="wait" if wait else "skip",
            wait_timeout=WAIT_TIMEOUT if wait else None,
            slots=slots,
        )
        if rules is None:
            rules = RunRules(fencing=slots == 1)
        worked: list[float] = []  # when the work ended: the completion is recorded after it

        def work(handle: Any) -> None:
            name = key if lock_key is not None else str(handle.key.name)  # a pool's slot: the slot's name
            at = handle.acquired_at.timestamp()
            extra: dict[str, Any] = {} if pool is None else {"pool": pool, "size": slots, "mode": mode}
            if rules.records_completion:
                extra.update(period=rules.period, min_interval=rules.min_interval)
            self.history.emit(
                "acquired", run=run, key=name, token=handle.fencing_token, backend=handle.backend_pid, at=at, **extra
            )
            if mode == "transaction" and handle.connection is not None and self.rng.random() < 0.1:
                # An error of the work's own statement, caught outside a savepoint: it aborts the
                # lock's transaction, whose lock goes at once; the work goes on (it must end lost).
                import psycopg

                with contextlib.suppress(psycopg.errors.DivisionByZero):
                    handle.connection.execute("SELECT 1/0")
                now = time.time()
                self.history.emit("fault", kind="caught-error", start=now, end=now, target=run, pids=[os.getpid()])
            self._work(run, {name: handle.fencing_token})
            worked.append(time.time())

        target = lock_key if lock_key is not None else LockKey.from_name(key)
        guard = LockGuard(self.hook.database, target, policy, application_name=self.name, rules=rules)
        if not wait:
            self._tries(run, [key])
        try:
            guard.run(work)
        except LockConfigurationError as error:
            if pool is not None and _refused_for_another_size(error):
                raise _Refused from error
            raise
        except BaseException as error:
            if getattr(guard, "refusal", None) is error:
                raise _Busy([key], error, period=rules.period) from error
            raise
        if rules.records_completion and worked:
            self._recorded(run, key, target, rules, worked[0], guard.fencing_token)

    def _recorded(self, run: str, key: str, lock_key: Any, rules: Any, worked: float, token: int | None) -> None:
        """A completed run's ``recorded`` event: when its completion was recorded, on the database clock.

        The provider writes the record after the work returned, with ``clock_timestamp()`` (the
        statement's time, not the commit's: in transaction mode it commits with the unlock), under
        the lock; a ``min_interval`` check compares that time with its own ``clock_timestamp()``. The
        row is read back by the run's fencing token (``at_lo`` = ``at_hi`` = its ``completed_at``);
        when the look fails or finds another run's row (a rolling record is overwritten by the next
        run), the record's time is bracketed by the work's end and the guard's return (``at_lo``,
        ``at_hi``: the lock database runs on this machine's clock, as the campaign's does)."""
        import psycopg

        from airflow_pglock.pg.ledger import ROLLING_PERIOD

        returned = time.time()
        at_lo, at_hi = worked, returned
        classid, objid, objsubid = lock_key.pg_locks
        period = rules.period if rules.period is not None else ROLLING_PERIOD
        with contextlib.suppress(psycopg.Error):
            with psycopg.connect(self.config.lock_dsn, autocommit=True, connect_timeout=2) as conn:
                row = conn.execute(
                    "SELECT extract(epoch FROM completed_at)::float8, fencing_token FROM pglock.completions"
                    " WHERE objsubid = %s AND classid = %s AND objid = %s AND period = %s",
                    [objsubid, classid, objid, period],
                ).fetchone()
            if row is not None and token is not None and row[1] == token:
                at_lo = at_hi = float(row[0])
        self.history.emit(
            "recorded",
            run=run,
            key=key,
            period=rules.period,
            min_interval=rules.min_interval,
            at_lo=at_lo,
            at_hi=at_hi,
            exact=at_lo == at_hi,
        )

    def _guard_target(self, hot: list[str]) -> tuple[str, dict[str, Any]]:
        """A guard kind's key (its label) and ``_guard``'s keyword arguments: a hot key; now and then the
        pair key (fenced, as the others); now and then the rules key with ``once_per`` (a period of
        :data:`RULES_PERIOD_SECONDS`), ``min_interval`` (:data:`MIN_INTERVAL`) or both, fenced (the
        token names the run's record)."""
        from airflow_pglock.keys import LockKey
        from airflow_pglock.run_rules import RunRules

        draw = self.rng.random() if self.config.pair_key or self.config.rules_key else 1.0
        if self.config.pair_key is not None and draw < PAIR_SHARE:
            return self.config.pair_key, {"lock_key": LockKey.from_pair(*PAIR_NUMBERS)}
        if self.config.rules_key is not None and draw < PAIR_SHARE + RULES_SHARE:
            which = self.rng.choice(("once_per", "min_interval", "both"))
            period = f"g{int(time.time() // RULES_PERIOD_SECONDS)}" if which != "min_interval" else None
            interval = MIN_INTERVAL if which != "once_per" else None
            return self.config.rules_key, {"rules": RunRules(period=period, min_interval=interval, fencing=True)}
        return self.rng.choice(hot), {}

    def _pool_size(self) -> int:
        """This run's size of the pool's name: its era's, or a tenth of the time another era's."""
        sizes = (self.config.pool_slots, self.config.pool_slots + 1, self.config.pool_slots, 1)
        if self.rng.random() < 0.1:
            return self.rng.choice(sizes)
        return sizes[int(time.time() // SIZE_ERA) % len(sizes)]

    def _hook_lock(self, run: str, name: str) -> None:
        from airflow_pglock.keys import LockKey

        label, key = self._maybe_numeric(name, 0.3)
        draw = self.rng.random() if self.config.pair_key or self.config.rules_key else 1.0
        if self.config.pair_key is not None and draw < 0.15:  # the pair key, by its two numbers
            label, key = self.config.pair_key, LockKey.from_pair(*PAIR_NUMBERS)
        elif self.config.rules_key is not None and draw < 0.25:  # the rules key (no rules: an exclusive holder)
            label, key = self.config.rules_key, self.config.rules_key
        shared = self.rng.random() < 0.25  # readers: they may overlap one another, never an exclusive holder
        mode = "transaction" if self.rng.random() < 0.25 else "session"
        timeout = HOOK_WAIT if self.rng.random() < 0.25 else None
        if timeout is None:
            self._tries(run, [label])
        with self.hook.lock(
            key,
            mode=mode,  # type: ignore[arg-type]
            shared=shared,
            timeout=timeout,
            application_name=self.name,
        ) as handle:
            if handle is None:  # hook.lock() says busy and nothing else: who holds it, looked at at once
                raise _Busy([label], shared=shared, looked=self._holders({label: key}))
            at = handle.acquired_at.timestamp()
            self.history.emit(
                "acquired", run=run, key=label, token=None, backend=handle.backend_pid, at=at, shared=shared
            )
            self._work(run, {label: None})

    def _tries(self, run: str, keys: list[str]) -> None:
        """A ``tries`` event: the run is about to try ``keys`` (labels) without waiting. A run that then
        fails before its ``acquired`` event may have held them meanwhile (a statement after the try
        failed): the checker's rule 11 counts that. A wait is not announced: one that timed out held
        nothing."""
        self.history.emit("tries", run=run, keys=keys)

    def _holders(self, keys: dict[str, Any]) -> _Look:
        """The granted holders of ``keys`` (label: key), looked at right after a refusal that named
        none (``hook.holders()``): what the checker's rule 11 reads as the refusal's holders. A key
        whose look failed (the server away, no connection to be had) is said to be unlooked: it is
        judged as one whose look found nobody, and a violation says so."""
        look = _Look()
        for label, key in keys.items():
            try:
                holders = self.hook.holders(key)
            except Exception:
                look.unlooked.append(label)
                continue
            look.found += [
                {"key": label, "pid": holder.pid, "application_name": holder.application_name}
                for holder in holders
                if holder.granted
            ]
            if isinstance(key, str):  # a named key: another run's lock scope may hold it between its tasks
                with contextlib.suppress(Exception):
                    row = self.hook.scope(key)
                    if row is not None:
                        look.found.append({"key": label, "scope": row.describe()})
        return look

    def _still_held(self, run: str, backend: int, held: dict[str, int | None]) -> None:
        """After an early release, whether the session still holds its other keys (as the product
        says): a key it believes it holds that its backend no longer holds is an ``unheld`` event
        (the checker's rule 14; a fault of the session or the server excuses it)."""
        for key in held:
            try:
                holders = self.hook.holders(key)
            except Exception:  # the server is away: nothing learned
                continue
            if not any(holder.granted and holder.pid == backend for holder in holders):
                self.history.emit("unheld", run=run, key=key, backend=backend)

    def _lock_session(self, run: str, keys: list[str]) -> None:
        with self.hook.lock_session(application_name=self.name) as session:
            backend = session.server.backend_pid
            try:
                # The batch ends with two keys of this worker's own (no one else takes them): whatever
                # it gives back early, the session goes on holding another key of the batch.
                self._tries(run, keys[:-1])
                subs = session.try_lock_many([*keys[:-1], *self._own_keys])
                held: dict[str, int | None] = {}
                for sub in subs:
                    held[str(sub.key.name)] = None
                    at = sub.acquired_at.timestamp()
                    self.history.emit("acquired", run=run, key=sub.key.name, token=None, backend=backend, at=at)
                # The last key: a bounded wait, or a single try of it or of the numeric key (a named
                # key's single try reads its scope row with the try; the numeric one is the try alone),
                # a third of the single tries shared.
                shared, label, last_key = False, keys[-1], keys[-1]
                if self.rng.random() < 0.4:
                    last = session.lock(last_key, timeout=0.5)
                else:
                    label, last_key = self._maybe_numeric(keys[-1], 0.5)
                    shared = self.rng.random() < 1 / 3
                    self._tries(run, [label])
                    last = session.try_lock(last_key, shared=shared)
                with last as waited:
                    if waited is not None:
                        held[label] = None
                        at = waited.acquired_at.timestamp()
                        self.history.emit(
                            "acquired", run=run, key=label, token=None, backend=backend, at=at, shared=shared
                        )
                    if not set(held) - set(self._own_keys):  # every hot key busy: who holds them, looked at at once
                        tried: dict[str, Any] = {name: name for name in keys[:-1]}
                        tried[label] = last_key
                        raise _Busy(list(tried), shared=shared, looked=self._holders(tried))
                    try:
                        # No done event between the two works: the hold of every key but the one given
                        # back goes on (a done here would end them all, and nothing would judge the
                        # second work's writes).
                        self._work(run, held, lost=lambda: session.lost, finish=False)
                        if subs and self.rng.random() < 0.5:  # give one back early
                            held.pop(str(subs[0].key.name), None)
                            self.history.emit("released", run=run, key=subs[0].key.name)  # no longer used from here
                            session.release(subs[0])
                            self._still_held(run, backend, held)
                            if held:  # (a session holding nothing has nothing to work on)
                                self._work(run, held, lost=lambda: session.lost, finish=False)
                    finally:
                        self.history.emit("done", run=run)  # before the block releases the last key
            finally:
                self.history.emit("done", run=run)  # also when a statement failed before the work

    def _guard_sub_keys(self, run: str, keys: list[str]) -> None:
        from airflow_pglock.guard import LockGuard
        from airflow_pglock.keys import LockKey
        from airflow_pglock.policy import LockPolicy

        def work(handle: Any) -> None:
            if self.rng.random() < 0.3:  # a single sub-key in a with block, named or numeric
                label, key = self._maybe_numeric(keys[0], 0.5)
                self._tries(run, [label])
                with handle.try_lock(key) as sub:
                    if sub is None:
                        return
                    at = sub.acquired_at.timestamp()
                    self.history.emit("acquired", run=run, key=label, token=None, backend=handle.backend_pid, at=at)
                    self._work(run, {label: None})
                return
            if handle.connection is not None and self.rng.random() < 0.15:
                # The work's own savepoint, rolled back after the batch: it ends the batch's
                # transaction locks, the work goes on believing it holds them (the run must end lost).
                import psycopg

                self._tries(run, keys)
                with handle.connection.transaction():
                    subs = handle.try_lock_many(keys)
                    raise psycopg.Rollback()
                if subs:
                    now = time.time()
                    pids = [os.getpid()]
                    self.history.emit("fault", kind="savepoint-rollback", start=now, end=now, target=run, pids=pids)
            else:
                self._tries(run, keys)
                subs = handle.try_lock_many(keys)
            if not subs:
                return
            held: dict[str, int | None] = {}
            for sub in subs:
                held[str(sub.key.name)] = None
                at = sub.acquired_at.timestamp()
                self.history.emit("acquired", run=run, key=sub.key.name, token=None, backend=handle.backend_pid, at=at)
            self._work(run, held)

        own = LockKey.from_name(f"campaign/owner/{self.config.index}")
        policy = LockPolicy(mode="transaction" if self.rng.random() < 1 / 3 else "session")
        LockGuard(self.hook.database, own, policy, application_name=self.name).run(work)

    def _scope(self, run: str, key: str) -> None:
        """A scope's setup, 2-3 tasks with gaps between them, and its teardown (whatever happened).

        A third of the runs are a scope over the pool (``slots``): its tasks re-enter the slot its
        setup took (no fencing token: refused on a pool, as once_per)."""
        from airflow_pglock.exceptions import LockLostError
        from airflow_pglock.guard import LockGuard
        from airflow_pglock.keys import LockKey
        from airflow_pglock.policy import LockPolicy
        from airflow_pglock.run_rules import RunRules
        from airflow_pglock.scope_rules import ScopeRole

        pooled = self.rng.random() < 1 / 3
        slots = self.config.pool_slots if pooled else 1
        lineage = uuid.uuid4().hex  # this run's setup (a task cleared mid-scope runs it again)
        lock_key, holder = LockKey.from_name(self.config.pool if pooled else key), lineage + uuid.uuid4().hex
        cleared = self.rng.random() < 0.25  # a task cleared after the first: the setup runs again, mid-scope
        lease = SCOPE_LEASE_FACTOR * self.config.lease
        member_policy = LockPolicy(on_busy="wait", wait_timeout=WAIT_TIMEOUT, on_wait_timeout="fail", slots=slots)
        period = str(int(time.time() // PERIOD_SECONDS)) if not pooled and self.rng.random() < 0.5 else None
        slot: int | None = None

        def guard(kind: str, policy: LockPolicy, rules: RunRules | None = None) -> LockGuard:
            role = ScopeRole(
                kind=kind,  # type: ignore[arg-type]
                holder=holder,
                run=f"{self.name} {run}",
                task=kind,
                lease=lease,
                fencing=not pooled,
                slot=None if kind == "enter" else slot,
                lineage=lineage if kind == "enter" else None,
            )
            return LockGuard(self.hook.database, lock_key, policy, application_name=self.name, scope=role, rules=rules)

        entering: list[LockGuard] = []

        def setup() -> str:
            """The setup (again: it takes over its own earlier row, with a new holder id and token)."""
            nonlocal slot
            enter = guard("enter", LockPolicy(slots=slots), RunRules(period=period))
            entering.append(enter)
            with enter as handle:
                token, backend, at = handle.fencing_token, handle.backend_pid, handle.acquired_at.timestamp()
                slot, held_name = handle.slot, str(handle.key.name)
            # Not judged by the checker's rule 8 (no pool and size here): between its tasks a scope holds
            # no session and so no size marker, and another size of the name is not refused there
            # (docs/scopes.md); its next task is.
            self.history.emit(
                "acquired", run=run, key=held_name, token=token, backend=backend, at=at, period=period, slot=slot
            )
            return held_name

        try:
            held_name = setup()
        except BaseException as error:
            if entering[-1].refusal is error:
                raise _Busy([str(lock_key.name)], error, period=period) from error
            if pooled and _refused_for_another_size(error):
                raise _Refused from error
            raise
        succeeded = False
        try:
            for task in range(self.rng.randint(2, 3)):
                time.sleep(self.rng.uniform(0.0, 0.5))  # between tasks: only the lease row holds the scope
                if cleared and task == 1:
                    holder, before = lineage + uuid.uuid4().hex, held_name
                    try:
                        held_name = setup()
                    except BaseException as error:
                        if entering[-1].refusal is not error:
                            raise
                        self.history.emit("lost", run=run)  # its row lapsed (a freeze), another run took it
                        raise _Lost(f"the setup run again found the scope taken: {error}") from error
                    if held_name != before:  # another slot of the pool (its own was busy): the earlier
                        self.history.emit("released", run=run, key=before)  # row is no longer used
                try:
                    guard("member", member_policy).run(
                        lambda handle: self._work(run, {str(handle.key.name): handle.fencing_token}, finish=False)
                    )
                except LockLostError:
                    self.history.emit("lost", run=run)
                    raise
            succeeded = True
        finally:
            self.history.emit("done", run=run)
            # The teardown runs whatever the tasks' states, as Airflow's does; it records the
            # period only when every task succeeded.
            recording = succeeded and period is not None
            try:
                guard("leave", member_policy, RunRules(period=period) if recording else None).run(lambda handle: None)
                if recording:  # emitted after the record: a setup that took the scope later must have skipped
                    self.history.emit("recorded", run=run, key=held_name, period=period)
            except Exception as error:  # a lapsed scope frees itself; the run's outcome says what went wrong
                self.history.emit("teardown-failed", run=run, detail=f"{type(error).__name__}: {error}"[:300])

    def _deferred(self, run: str, key: str) -> None:
        """A guarded deferrable operator: worker, triggerer, worker again; one token throughout."""
        from airflow_pglock.exceptions import LockLostError
        from airflow_pglock.guard import LockGuard
        from airflow_pglock.keys import LockKey
        from airflow_pglock.policy import LockPolicy
        from airflow_pglock.run_rules import RunRules
        from airflow_pglock.scope_rules import HandOver, ScopeRole

        lock_key, holder = LockKey.from_name(key), uuid.uuid4().hex
        lease = SCOPE_LEASE_FACTOR * self.config.lease

        def role(kind: str) -> ScopeRole:
            return ScopeRole(
                kind=kind,  # type: ignore[arg-type]
                holder=holder,
                run=f"{self.name} {run}",
                task="deferred",
                lease=lease,
                hands_over=True,
            )

        token: list[int | None] = []
        work_failed: list[bool] = []  # its work failed: done already emitted, before the release
        work_ended: list[float] = []  # when its first work ended: the hand-over follows

        def first(handle: Any) -> HandOver:
            token.append(handle.fencing_token)
            at = handle.acquired_at.timestamp()
            self.history.emit(
                "acquired", run=run, key=key, token=handle.fencing_token, backend=handle.backend_pid, at=at
            )
            try:
                self._work(run, {key: handle.fencing_token}, finish=False)
            except BaseException:
                work_failed.append(True)
                self.history.emit("done", run=run)  # the work is over, and nothing hands the key over
                raise
            work_ended.append(time.time())
            return HandOver(None)

        guard = LockGuard(
            self.hook.database,
            lock_key,
            LockPolicy(),
            application_name=self.name,
            rules=RunRules(fencing=True),
            scope=role("outside"),
        )
        self._tries(run, [key])
        try:
            guard.run(first)
        except BaseException as error:
            if guard.refusal is error:
                raise _Busy([key], error) from error
            if work_ended:  # it worked, then the hand-over failed and the guard released: the work was
                self.history.emit("done", run=run, at=work_ended[0])  # over before the hand-over began
            raise
        try:
            ends_there = self.rng.random() < 0.25
            if self.rng.random() < TRIGGER_SHARE:
                ended = self._in_guarded_trigger(run, lock_key, holder, token[0], lease, ends_there, time.time())
            else:
                ended = self._in_triggerer(run, lock_key, holder, token[0], lease, ends_there)
            if ended:
                return  # the task ended in the triggerer
            resume = LockGuard(
                self.hook.database,
                lock_key,
                LockPolicy(on_busy="wait", wait_timeout=WAIT_TIMEOUT, on_wait_timeout="fail"),
                application_name=self.name,
                scope=role("resume"),
            )
            try:
                # Its done event comes before the release (the work stops using the key there).
                resume.run(lambda handle: self._work(run, {key: handle.fencing_token}))
            except LockLostError:
                self.history.emit("lost", run=run)
                raise
        except BaseException:
            self.history.emit("done", run=run)  # the first done ends the hold; a later one changes nothing
            raise

    def _in_triggerer(self, run: str, key: Any, holder: str, token: int | None, lease: float, ends_there: bool) -> bool:
        """The triggerer's part, on the hold hub directly: the hub takes the hold; the external job
        works while it is held. Whether the task ended there (else the hub handed the hold back for a
        resume)."""
        import asyncio

        from airflow_pglock.triggers.holds import DeferredHold, HoldHub

        def open_session() -> Any:
            return self.hook.open_lock_session(application_name=f"{self.name} holds")

        async def deferred() -> None:
            hub = HoldHub(open_session)
            hold = DeferredHold(key, holder, f"{self.name} {run}", lease)
            async with hub.holding(hold):
                await hold.settled.wait()
                for _ in range(self.rng.randint(2, 10)):
                    # As an external job, it goes on while the hub takes the key back after its session
                    # was lost (the row holds it; the hub gives up before the row's own end).
                    if hold.state not in ("held", "taking"):
                        self.history.emit("lost", run=run)
                        raise _Lost(str(hold.reason))
                    await asyncio.to_thread(self._write, run, str(key.name), token)
                    await asyncio.sleep(STEP)
                if ends_there:
                    self.history.emit("done", run=run)  # the job stops using the key before the hub frees it
                if not await (hub.end(hold) if ends_there else hub.hand_back(hold)):
                    self.history.emit("lost", run=run)
                    raise _Lost(str(hold.reason))

        asyncio.run(deferred())
        return ends_there

    def _in_guarded_trigger(
        self,
        run: str,
        key: Any,
        holder: str,
        token: int | None,
        lease: float,
        ends_there: bool,
        deferred_at: float,
    ) -> bool:
        """The triggerer's part through the real :class:`~airflow_pglock.triggers.guarded.GuardedTrigger`,
        built as ``guarded()`` builds it when the operator defers, around the campaign's own operator
        trigger (:class:`~devtools.campaign.external_job.JobTrigger`: its external job writes the
        register while the hold is held), and run as a triggerer runs it: its ``run()`` on an event
        loop, its first event taken. Now and then (:data:`CLEAR_SHARE`, Airflow 3.3+) the task is
        cleared mid-hold: the trigger's task is cancelled as the triggerer cancels it for a user's
        action, and its ``on_kill()`` called a moment later (the run ends lost). Whether the task
        ended in the triggerer (else the hold was handed back for a resume)."""
        import asyncio

        from airflow_pglock.compat import KILLS_CLEARED_TRIGGERS, TriggerEvent
        from airflow_pglock.triggers.guarded import ERROR, LOST, GuardedTrigger
        from devtools.campaign import external_job

        conn_id = self._airflow_connection()
        clears = KILLS_CLEARED_TRIGGERS and self.rng.random() < CLEAR_SHARE
        steps, resume_hold = self.rng.randint(2, 10), round(self.rng.uniform(0.0, 4 * STEP), 3)
        clear_after, kill_after = self.rng.uniform(0.0, 4.0) * STEP, self.rng.uniform(1.0, 3.0) * STEP
        stop_delay = self.rng.uniform(0.0, 2.0) * STEP
        self.history.emit("trigger", run=run, clears=clears, ends_there=ends_there, resume_hold=resume_hold)

        async def triggerer() -> Any:
            self._triggerer_hub(conn_id)
            job = external_job.ExternalJob(
                lambda: self._write(run, str(key.name), token),
                steps,
                STEP,
                lambda event: self.history.emit(event, run=run),
                ends_there=ends_there,
                stop_delay=stop_delay,
            )
            external_job.JOBS[run] = job
            # As guarded() builds it when the operator defers (operators/advisory_lock.py).
            trigger_classpath, trigger_kwargs = external_job.JobTrigger(run).serialize()
            trigger = GuardedTrigger(
                trigger_classpath=trigger_classpath,
                trigger_kwargs=trigger_kwargs,
                key_name=str(key.name),
                key_numbers=list(key.numbers),
                postgres_conn_id=conn_id,
                holder=holder,
                task=f"{self.name} {run}",
                lease=lease,
                deferred_at=deferred_at,
                resume={"holder": holder, "lease": lease, "key": key.describe(), "key_name": str(key.name)},
                connect_timeout=TRIGGER_CONNECT_TIMEOUT,
                resume_hold=resume_hold,
            )
            events: list[Any] = []

            async def consume() -> None:
                async with contextlib.aclosing(trigger.run()) as fired:
                    async for event in fired:
                        events.append(event)  # the triggerer takes the first event and ends the trigger
                        return

            running = asyncio.ensure_future(consume())
            if clears:
                started = asyncio.ensure_future(job.started.wait())
                await asyncio.wait({running, started}, return_when=asyncio.FIRST_COMPLETED)
                started.cancel()
                await asyncio.wait({running}, timeout=clear_after)  # mid-hold: the job runs
                next_try: Any = None
                if not running.done() and job.left >= 3:  # (its trigger does not fire meanwhile)
                    # The cleared task's next try starts before the triggerer cancels the trigger, finds
                    # its earlier try's live row and waits for the key (Airflow 3.3+).
                    next_try = asyncio.ensure_future(asyncio.to_thread(self._next_try, run, key, holder, lease))
                    await asyncio.sleep(STEP)
                if running.cancel(USER_ACTION_CANCEL):
                    with contextlib.suppress(asyncio.CancelledError):
                        await running
                    # The trigger's cancellation let the key go: from here on the run no longer holds it
                    # (GuardedTrigger killed the job under the hold, its lost event came before).
                    self.history.emit("released", run=run, key=str(key.name))
                    self.history.emit("cleared", run=run)
                    await asyncio.sleep(kill_after)  # the triggerer calls the trigger's on_kill() next
                    await trigger.on_kill()
                    await trigger.cleanup()
                    if next_try is not None:
                        await next_try
                    raise _Lost("the task was cleared while deferred: its trigger was cancelled, its job killed")
                if next_try is not None:
                    await next_try
            await running
            event = events[0]
            if type(event) is not TriggerEvent:
                return True  # a task-end event: the hub ended the hold (its row deleted, the key released)
            if event.payload["pglock"] == LOST:
                await job.kill()  # the task resumes with a lost hold: the operator's on_kill()
                self.history.emit("lost", run=run)
                raise _Lost(str(event.payload["reason"]))
            if event.payload["pglock"] == ERROR:
                return event.payload["error"]
            return False

        try:
            outcome = asyncio.run(triggerer())
        finally:
            external_job.JOBS.pop(run, None)
        if isinstance(outcome, str):  # the operator's trigger failed (its job did: done said so)
            self._free_row(key, holder, lease, run)
            raise RuntimeError(f"the operator's trigger failed while it held {key.name!r}: {outcome}")
        return bool(outcome)

    def _next_try(self, cleared: str, key: Any, holder: str, lease: float) -> None:
        """The next try of a task cleared while deferred, a run of its own (``<run>-next``): as
        ``guarded()`` does on Airflow 3.3+, it finds its earlier try's live hold row and waits for the
        key (the trigger holds it until its job stopped), takes the row over with a token of its own
        and works; its work must not overlap the earlier try's job."""
        from airflow_pglock.exceptions import LockLostError
        from airflow_pglock.guard import LockGuard
        from airflow_pglock.policy import LockPolicy
        from airflow_pglock.run_rules import RunRules
        from airflow_pglock.scope_rules import ScopeRole

        run, name = f"{cleared}-next", str(key.name)
        self.history.emit("attempt", run=run)
        outcome, detail = "completed", ""
        role = ScopeRole(holder=holder, run=f"{self.name} {cleared}", task="deferred", lease=lease, hands_over=True)
        policy = LockPolicy(on_busy="wait", wait_timeout=WAIT_TIMEOUT, on_wait_timeout="fail")
        guard = LockGuard(
            self.hook.database, key, policy, application_name=self.name, rules=RunRules(fencing=True), scope=role
        )

        def work(handle: Any) -> None:
            at = handle.acquired_at.timestamp()
            self.history.emit(
                "acquired", run=run, key=name, token=handle.fencing_token, backend=handle.backend_pid, at=at
            )
            self._work(run, {name: handle.fencing_token})

        try:
            guard.run(work)
        except (LockLostError, _Lost) as error:
            outcome, detail = "lost", str(error)[:300]
        except Exception as error:
            outcome, detail = "failed", f"{type(error).__name__}: {str(error)[:300]}"
        self.history.emit("outcome", run=run, outcome=outcome, detail=detail)

    def _free_row(self, key: Any, holder: str, lease: float, run: str) -> None:
        """A failed trigger's task resumes, re-enters its hold and frees its row (then fails)."""
        from airflow_pglock.guard import LockGuard
        from airflow_pglock.policy import LockPolicy
        from airflow_pglock.scope_rules import ScopeRole

        role = ScopeRole(
            kind="resume", holder=holder, run=f"{self.name} {run}", task="deferred", lease=lease, hands_over=True
        )
        policy = LockPolicy(on_busy="wait", wait_timeout=WAIT_TIMEOUT, on_wait_timeout="fail")
        with contextlib.suppress(Exception):  # the run fails anyway; a row left lapses with its lease
            LockGuard(self.hook.database, key, policy, application_name=self.name, scope=role).run(lambda handle: None)

    def _airflow_connection(self) -> str:
        """The Airflow connection the GuardedTrigger resolves for the lock database, as a triggerer
        reads one (``AIRFLOW_CONN_<ID>``, JSON): the lock DSN's two hosts in ``host``, and its two ports,
        ``target_session_attrs`` and ``connect_timeout`` as extras (PostgresHook passes extras that are
        libpq parameters on, and they win over the fields: the Port field takes one number)."""
        import json

        from psycopg.conninfo import conninfo_to_dict

        conn_id = f"campaign_w{self.config.index}_locks"
        parts = {name: str(value) for name, value in conninfo_to_dict(self.config.lock_dsn).items()}
        connection = {
            "conn_type": "postgres",
            "host": parts.pop("host"),
            "login": parts.pop("user", None),
            "schema": parts.pop("dbname", None),
            "extra": parts,
        }
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(connection)
        return conn_id

    def _triggerer_hub(self, conn_id: str) -> None:
        """Give the running loop the hold hub ``hub_for`` would make for ``conn_id`` (which the
        GuardedTrigger then finds), but for two things the campaign's scale needs: its session's lease
        is the campaign's (a triggerer's hub has the default 30 s, as long as the shortest
        ``deferral_lease``; the campaign's deferral lease is two of its 3 s leases), and its session is
        named after the worker (``campaign w<n> holds``: the nemesis aims at it and attributes it)."""
        import asyncio

        from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
        from airflow_pglock.triggers import holds

        hubs = holds._HUBS.setdefault(asyncio.get_running_loop(), {})
        index = (conn_id, TRIGGER_CONNECT_TIMEOUT)

        def open_session() -> Any:
            # A hook per session, as hub_for's: the Airflow connection is read anew.
            hook = AdvisoryLockHook(conn_id, connect_timeout=TRIGGER_CONNECT_TIMEOUT, liveness=self.hook.liveness)
            return hook.open_lock_session(application_name=f"{self.name} holds")

        def forget() -> None:
            hubs.pop(index, None)

        hubs[index] = holds.HoldHub(open_session, forget)

    # ----------------------------------------------------------------- the loop

    def one_run(self) -> None:
        from airflow_pglock.exceptions import LockLostError

        self.runs += 1
        run = f"w{self.config.index}-{os.getpid()}-{self.runs}"
        kind, hot = self.config.kind, list(self.config.hot_keys)
        self.history.emit("attempt", run=run)
        outcome, detail = "completed", ""
        refusal: dict[str, Any] = {}
        try:
            if kind in ("guard-session", "guard-transaction", "guard-wait"):
                mode = "transaction" if kind == "guard-transaction" else "session"
                key, target = self._guard_target(hot)
                self._guard(run, key, mode=mode, wait=kind == "guard-wait", **target)
            elif kind == "hook-lock":
                self._hook_lock(run, self.rng.choice(hot))
            elif kind == "lock-session":
                self._lock_session(run, self.rng.sample(hot, k=min(len(hot), self.rng.randint(2, 3))))
            elif kind == "guard-sub-keys":
                self._guard_sub_keys(run, self.rng.sample(hot, k=self.rng.randint(1, 2)))
            elif kind == "pool":
                size = self._pool_size()
                wait = size == 1 and self.rng.random() < 0.5  # a plain key's wait may see a pool begin
                # a third of the pools of slots in transaction mode: slot and size markers transaction locks
                mode = "transaction" if size > 1 and self.rng.random() < POOL_TRANSACTION_SHARE else "session"
                self._guard(run, self.config.pool, slots=size, wait=wait, pool=self.config.pool, mode=mode)
            elif kind == "scope":
                self._scope(run, self.rng.choice(hot))
            elif kind == "deferred":
                self._deferred(run, self.rng.choice(hot))
        except _Busy as busy:
            outcome, refusal = "skipped", busy.fields()
        except _Refused as refused:
            outcome, detail = "refused", str(refused.__cause__)[:300]
        except (LockLostError, _Lost) as error:
            outcome, detail = "lost", str(error)[:300]
        except Exception as error:
            outcome, detail = "failed", f"{type(error).__name__}: {str(error)[:300]}"
        self.history.emit("outcome", run=run, outcome=outcome, detail=detail, **refusal)

    def loop(self) -> None:
        self.history.emit("spawn")
        with stalls_watched(self.history):
            while not self.config.stop_file.exists():
                self.one_run()
                time.sleep(self.rng.uniform(0.0, 0.3))
        if self._register is not None:
            self._register.close()
        self.history.emit("stopped")
        self.history.close()


@dataclass
class _Look:
    """A look at a refusal's keys: the granted holders found, and the keys whose look failed."""

    found: list[dict[str, Any]] = field(default_factory=list)
    unlooked: list[str] = field(default_factory=list)


class _Busy(Exception):  # noqa: N818 - the key (or the pool) was busy: a skip
    """A skip, with what the refusal named: the checker's rule 11 judges a skip that names no holder.

    :param tried: the keys (a pool's name for a pool) the run tried and found busy.
    :param refusal: the guard's refusal (``LockBusyError``: its granted holders, or a lock scope's
        row; ``AlreadyDoneError``: a recorded ``once_per`` period), or None where the API says only
        "busy" (``hook.lock()`` yields None, a lock session's tries return nothing).
    :param shared: the run asked for the keys shared.
    :param period: a scope's ``once_per`` period (an ``AlreadyDoneError`` names it).
    """

    def __init__(
        self,
        tried: list[str],
        refusal: BaseException | None = None,
        *,
        shared: bool = False,
        period: str | None = None,
        looked: _Look | None = None,
    ) -> None:
        super().__init__(tried)
        self.tried, self.refusal, self.shared, self.period, self.looked = tried, refusal, shared, period, looked

    def fields(self) -> dict[str, Any]:
        """The skip's ``outcome`` event's fields: ``tried``, ``shared``, ``holders`` (the granted
        holders the refusal named, or a look right after it found: key, pid, application_name),
        ``unlooked`` (the keys whose look failed), ``scope_row`` (it named another run's lock scope),
        ``done_period`` (it named a recorded once_per period), ``done_record`` (a run rule's refusal:
        the recorded completion it named, its period, ``completed_at`` on the database clock and
        fencing token)."""
        from airflow_pglock.exceptions import AlreadyDoneError, LockBusyError

        fields: dict[str, Any] = {"tried": self.tried, "shared": self.shared, "holders": [], "scope_row": False}
        if self.looked is not None:
            fields["holders"], fields["looked"], fields["unlooked"] = self.looked.found, True, self.looked.unlooked
        if isinstance(self.refusal, LockBusyError):
            fields["holders"] = [
                {"key": self.tried[0], "pid": holder.pid, "application_name": holder.application_name}
                for holder in self.refusal.holders
                if holder.granted
            ]
            fields["scope_row"] = self.refusal.retry_after is not None  # only a scope row's refusal says when
        elif isinstance(self.refusal, AlreadyDoneError):
            completion: Any = self.refusal.completion
            named = getattr(completion, "period", None)
            # once_per's refusal names the run's period; min_interval's the key's latest record (any period)
            fields["done_period"] = self.period if named is None or named == self.period else None
            if named is not None:
                fields["done_record"] = {
                    "period": named,
                    "at": completion.completed_at.timestamp(),
                    "token": completion.fencing_token,
                }
        return fields


class _Refused(Exception):  # noqa: N818 - the pool's name was in use in another size
    pass


#: How the refusal of a pool's name says another holder of the name has another size
#: (airflow_pglock.pg.pools.pool_conflict_error); its fourth kind, a foreign program on a size
#: marker, would be a bug here: nothing else holds the campaign's markers.
POOL_SIZE_REFUSALS = (
    "it is in use right now as a pool of slots=",
    "it is in use right now as a plain key of that name",
    "it is in use right now as a pool of that name",
)


def _refused_for_another_size(error: BaseException) -> bool:
    from airflow_pglock.exceptions import LockConfigurationError

    return isinstance(error, LockConfigurationError) and any(text in str(error) for text in POOL_SIZE_REFUSALS)


def watch_stalls(history: HistoryWriter, stop: threading.Event) -> None:
    """Record this process's stalls (a ``stall`` event, from when its last tick began to when it woke).

    A freeze of the whole machine (a loaded host, its hypervisor) stops every worker as a SIGSTOP
    does, but the nemesis did not inject it: without the event the checker could not tell the
    overlaps it opens from a defect. A stall inside a freeze the nemesis injected is recorded too;
    the checker judges that one by the injected fault, and a worker's stall that the machine watch
    (:func:`machine_watch_main`) did not see as well not at all (:func:`devtools.campaign.checker.build`).
    """
    while not stop.is_set():
        wall, cpu = time.monotonic(), time.process_time()
        time.sleep(STALL_TICK)
        late = time.monotonic() - wall - STALL_TICK
        used = time.process_time() - cpu
        if late > STALL_MIN and used < STALL_CPU_SHARE * late:
            now = time.time()
            history.emit("stall", start=now - late - STALL_TICK, end=now, cpu=round(used, 4))


@contextlib.contextmanager
def stalls_watched(history: HistoryWriter) -> Iterator[None]:
    """:func:`watch_stalls` in a thread of its own while the block runs."""
    stop = threading.Event()
    watch = threading.Thread(target=watch_stalls, args=(history, stop), name="stall-watch", daemon=True)
    watch.start()
    try:
        yield
    finally:
        stop.set()
        watch.join()


def machine_watch_main(history_path: Path, stop_file: Path) -> None:
    """The body of the campaign's machine watch: a process of its own that only watches its stalls.

    It shares no code path with the provider, so a stall it records is the machine's; a worker's
    stall counts only where this one saw one too (:func:`devtools.campaign.checker.build`): a
    provider's call that kept a worker's whole interpreter waiting would stall that worker alone.
    """
    history = HistoryWriter(history_path, pid=os.getpid(), watch="machine")
    history.emit("watching")  # the report says whether it ran (a watch that never ran excuses nothing)
    with stalls_watched(history):
        while not stop_file.exists():
            time.sleep(0.5)
    history.close()


def worker_main(config: WorkerConfig, spawn: int) -> None:
    """The body of a forked worker process."""
    import logging

    # The history says what happened; the log lines (outcome lines included) go to the worker's own log.
    log = open(config.history.with_suffix(".log"), "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - the process's
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    logging.basicConfig(stream=log, level=logging.INFO, force=True)
    if config.netns:
        from devtools.netns import NetNamespace

        namespace = NetNamespace.__new__(NetNamespace)
        namespace.name = config.netns
        namespace.enter()
    Worker(config, spawn).loop()
