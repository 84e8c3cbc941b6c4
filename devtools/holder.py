"""A lock holder in its own process, to freeze, kill or cut off (fault tests, demos).

The child is forked from the caller (so it starts in milliseconds, with the provider
already imported), optionally enters a network namespace, takes the lock with
:class:`~airflow_pglock.guard.LockGuard` and "works" (sleeps in small steps) while
holding it. It reports what happens to the parent as events over a pipe, each stamped
with ``time.monotonic()`` (one clock for all processes of the machine):

* ``acquired`` (``backend_pid``), ``busy``;
* ``interrupted`` (the work received LockLostInterrupt; ``message``);
* ``outcome``: ``completed``, ``lost`` (``cause``), ``busy`` or ``error`` (``error``).

Exit codes: 0 completed, 3 lost, 4 busy, 5 error.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

EXIT_COMPLETED, EXIT_LOST, EXIT_BUSY, EXIT_ERROR = 0, 3, 4, 5


@dataclass(frozen=True)
class HolderConfig:
    """What the holder process does.

    :param dsn: libpq DSN of the lock database (as seen from inside ``netns``, if any).
    :param key: the key name.
    :param lease: the lease in seconds.
    :param work_seconds: how long the protected work runs if nothing happens.
    :param mode: ``"session"`` or ``"transaction"``.
    :param on_lost: ``"fail"`` or ``"warn"``.
    :param in_thread: run the guarded work in a non-main thread.
    :param netns: name of a network namespace to enter first (see devtools.netns).
    :param wait_timeout: wait this long for a busy key (``on_busy="wait"``); None: try once.
    """

    dsn: str
    key: str
    lease: float = 3.0
    work_seconds: float = 60.0
    mode: str = "session"
    on_lost: str = "fail"
    in_thread: bool = False
    netns: str | None = None
    wait_timeout: float | None = None


def _enter_netns(name: str) -> None:
    from devtools.netns import NetNamespace

    namespace = NetNamespace.__new__(NetNamespace)
    namespace.name = name
    namespace.enter()


def _child(config: HolderConfig, pipe: Connection) -> None:
    def emit(event: str, **data: Any) -> None:
        pipe.send({"event": event, "t": time.monotonic(), **data})

    from airflow_pglock.exceptions import LockBusyError, LockLostError, LockLostInterrupt
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.handle import LockHandle
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.keys import LockKey
    from airflow_pglock.liveness import Liveness
    from airflow_pglock.policy import LockPolicy

    if config.netns:
        _enter_netns(config.netns)
    hook = AdvisoryLockHook(dsn=config.dsn, liveness=Liveness(config.lease), connect_timeout=5)
    policy = LockPolicy(mode=config.mode, on_lost=config.on_lost)  # type: ignore[arg-type]
    if config.wait_timeout is not None:
        policy = LockPolicy(
            mode=config.mode,  # type: ignore[arg-type]
            on_lost=config.on_lost,  # type: ignore[arg-type]
            on_busy="wait",
            wait_timeout=config.wait_timeout,
        )
    guard = LockGuard(
        hook.database, LockKey.from_name(config.key), policy, application_name=f"pglock holder {os.getpid()}"
    )

    def work(handle: LockHandle) -> None:
        emit("acquired", backend_pid=handle.backend_pid)
        try:
            deadline = time.monotonic() + config.work_seconds
            while time.monotonic() < deadline:
                time.sleep(0.01)
        except LockLostInterrupt as interrupt:
            emit("interrupted", message=str(interrupt))
            raise

    code = EXIT_ERROR
    try:
        if config.in_thread:
            failure: list[BaseException] = []

            def in_thread() -> None:
                try:
                    guard.run(work)
                except BaseException as error:
                    failure.append(error)

            thread = threading.Thread(target=in_thread, name="guarded-work")
            thread.start()
            thread.join()
            if failure:
                raise failure[0]
        else:
            guard.run(work)
        emit("outcome", outcome="completed", lost=guard.outcome == "lost")
        code = EXIT_COMPLETED
    except LockLostError as lost:
        emit("outcome", outcome="lost", cause=lost.cause, error=str(lost))
        code = EXIT_LOST
    except LockBusyError as busy:
        emit("outcome", outcome="busy", error=str(busy))
        code = EXIT_BUSY
    except BaseException as error:
        emit("outcome", outcome="error", error=f"{type(error).__name__}: {error}")
    finally:
        pipe.close()
    os._exit(code)  # skip the parent's inherited atexit handlers (pytest, Airflow)


class Holder:
    """The parent's side of one holder process.

    :param config: what the child does.
    """

    def __init__(self, config: HolderConfig) -> None:
        self.config = config
        ctx = multiprocessing.get_context("fork")
        self._events, child_end = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_child, args=(config, child_end), daemon=True)
        self._child_end = child_end
        self.events: list[dict[str, Any]] = []

    def start(self) -> Holder:
        self.process.start()
        self._child_end.close()
        return self

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        """The first event named ``event`` (waiting up to ``timeout`` s for it)."""
        deadline = time.monotonic() + timeout
        while True:
            for seen in self.events:
                if seen["event"] == event:
                    return seen
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"holder {self.pid}: no {event!r} event within {timeout} s; events: {self.events}")
            try:
                if self._events.poll(min(remaining, 0.05)):
                    self.events.append(self._events.recv())
            except (EOFError, OSError):
                if not self.process.is_alive():
                    raise TimeoutError(
                        f"holder {self.pid} exited ({self.process.exitcode}) without {event!r}; events: {self.events}"
                    ) from None
                time.sleep(0.05)

    def signal(self, signum: int) -> float:
        """Send ``signum``; returns when (monotonic)."""
        os.kill(self.pid, signum)
        return time.monotonic()

    def join(self, timeout: float) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode

    def stop(self) -> None:
        """Make sure the child is gone (SIGCONT first, in case it was frozen)."""
        if self.process.pid is not None and self.process.is_alive():
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.pid, signum)
                except ProcessLookupError:
                    break
            self.process.join(10)
        self._events.close()

    def __enter__(self) -> Holder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
