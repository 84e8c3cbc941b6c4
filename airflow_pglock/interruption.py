"""Interrupting the protected work when its lock is lost: at most once, never in a clean-up.

:class:`Interruption` belongs to one guarded execution. It records why the lock was lost
(the first reason, refined later) and raises :class:`LockLostInterrupt` in the guarded
thread: in the main thread through a real-time signal and a handler installed once, in
another thread with ``PyThreadState_SetAsyncExc``. The handler never raises while the main
thread is inside a guard's clean-up or starting a child process (code registered with
:func:`protect_clean_up`); the interruption then stays pending and is sent again until
delivered or disarmed.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from airflow_pglock.exceptions import LockLostInterrupt

# Airflow's supervisor uses SIGUSR2, so pick a real-time signal where the platform has one.
LOST_SIGNAL: int = getattr(signal, "SIGRTMIN", signal.SIGUSR1) + (7 if hasattr(signal, "SIGRTMIN") else 0)
# Seconds between two sends of an interruption the main thread has not taken yet. Longer than
# psycopg's wait interval (0.1 s): its C wait (psycopg[binary]) goes back to poll() after a
# signal and returns to Python, where the handler runs, only when a whole interval passes with
# no signal; a send every 50 ms kept a work waiting on a query from ever being interrupted.
PENDING_REPEAT = 0.25


class Interruption:
    """The loss of one guarded execution's lock and the interruption of its work.

    :param label: names the lock in the interruption's message (``key 'x' (int64 N)``).
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.lock = threading.Lock()  # guards every field below
        self.reason: str | None = None  # why the lock was lost; None while held
        self._armed = False  # the work runs and may be interrupted
        self._sent = False
        self._delivered = False
        self._thread: threading.Thread | None = None

    def arm(self, interrupt: bool) -> None:
        """The work starts in this thread; interrupt it on a loss if ``interrupt``."""
        self._thread = threading.current_thread()
        if not interrupt:
            return
        with self.lock:
            self._armed = True
        if self._thread is threading.main_thread():
            _arm_main_thread(self)

    def lost(self, reason: str) -> None:
        """Record the loss (the first reason wins) and interrupt the work at once, if armed."""
        with self.lock:
            if self.reason is None:
                self.reason = reason
            if not self._armed or self._sent or self._thread is None:
                return
            self._sent = True
            ident = self._thread.ident or 0
            if self._thread is threading.main_thread():
                signal.pthread_kill(ident, LOST_SIGNAL)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(LockLostInterrupt))

    def refine(self, reason: str) -> None:
        """Replace the reason by a more precise one (the work may already be interrupted)."""
        with self.lock:
            self.reason = reason

    def keep_pending(self, stop: threading.Event) -> None:
        """Main thread: send the interruption again until it is delivered, disarmed or ``stop`` is set."""
        while not stop.wait(PENDING_REPEAT):
            with self.lock:
                if not self._armed or self._delivered or self._thread is not threading.main_thread():
                    return
                signal.pthread_kill(self._thread.ident or 0, LOST_SIGNAL)

    def forked(self, reason: str) -> None:
        """In a child process forked during the work: the lock is the parent's, so ``reason`` is
        why it is not held here; nothing is interrupted (the lock guarding these fields may
        have been held at the fork)."""
        self.lock = threading.Lock()
        self._armed = False
        self.reason = reason
        _disarm_main_thread(self)

    def take(self) -> str | None:
        """Called by the signal handler in the guarded (main) thread: the reason to raise, once."""
        if not self._armed or self.reason is None or self._delivered:
            return None
        self._delivered = True
        return self.reason

    def disarm(self) -> None:
        """No interruption from now on (idempotent); an undelivered one is cancelled."""
        with self.lock:
            if not self._armed:
                return
            self._armed = False
            if self._sent and self._thread is not threading.main_thread():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread.ident or 0), None)  # type: ignore[union-attr]
        _disarm_main_thread(self)

    def disarm_absorbing(self) -> None:
        """:meth:`disarm`; an interruption raised meanwhile (at any bytecode until then) is absorbed."""
        while True:
            try:
                self.disarm()
                return
            except LockLostInterrupt:
                continue


# One handler for LOST_SIGNAL, installed the first time an interruption is armed in the main
# thread and left in place (it does nothing when none claims the signal; restoring SIG_DFL
# could let a late signal kill the process). Guards may nest: each armed interruption is on
# this stack; a lost one raises LockLostInterrupt in whatever the main thread runs, except
# inside a guard's clean-up.
_armed_in_main: list[Interruption] = []
_chained_handler: Any = None
_handler_installed = False
_no_interrupt_code: set[Any] = set()


def protect_clean_up(*functions: Callable[..., Any]) -> None:
    """Never raise an interruption while one of ``functions`` is on the main thread's stack."""
    _no_interrupt_code.update(function.__code__ for function in functions)


def _lost_signal_handler(signum: int, frame: FrameType | None) -> None:
    if _in_clean_up(frame):
        return  # sent again (Interruption.keep_pending)
    for interruption in reversed(_armed_in_main):
        reason = interruption.take()
        if reason is not None:
            raise LockLostInterrupt(f"lost {interruption.label}: {reason}")
    if callable(_chained_handler):
        _chained_handler(signum, frame)


def _in_clean_up(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _no_interrupt_code:
            return True
        frame = frame.f_back
    return False


def _arm_main_thread(interruption: Interruption) -> None:
    global _chained_handler, _handler_installed
    if not _handler_installed:
        _chained_handler = signal.signal(LOST_SIGNAL, _lost_signal_handler)
        _handler_installed = True
    _armed_in_main.append(interruption)


def _disarm_main_thread(interruption: Interruption) -> None:
    if interruption in _armed_in_main:
        _armed_in_main.remove(interruption)


protect_clean_up(Interruption.disarm, Interruption.disarm_absorbing, _disarm_main_thread)
# Nor while a child process is being started: raised inside Popen, the interruption would lose the
# half-built Popen and leave the child running, out of reach of the operator's on_kill().
protect_clean_up(subprocess.Popen.__init__)
