"""A process forked while a lock is held leaves its parent's locks alone.

A child made by ``os.fork()`` inherits its parent's sockets, and with them the lock sessions.
Left as they are, the child's unwinding of a guard would unlock the parent's key on the
parent's session (or its close would end that session) while the parent still works under
it, and a lock taken by another thread could be held forever in the child's copy. Right
after a fork, in the child, every object registered here is told so once: lock connections
stop reaching the server, heartbeats and guards know they hold nothing in this process.

Each registered object is held weakly: registration keeps nothing alive.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from typing import Any

_in_child: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()


def after_fork_in_child(owner: Any, forked: Callable[[Any], None]) -> None:
    """Call ``forked(owner)`` in a child process forked while ``owner`` lives."""
    _in_child[owner] = forked


_FORKED = "was forked from the lock's holder"


def is_forked_reason(reason: str) -> bool:
    """Whether ``reason`` is :func:`forked_reason`'s: the lock is held, by another process."""
    return _FORKED in reason


def forked_reason(holder_pid: int) -> str:
    """Why a lock is not held in a forked child: the reason its guard or lock session reports there."""
    return (
        f"this process (pid {os.getpid()}) {_FORKED} (pid {holder_pid}) while it held "
        f"the lock: the lock stays with pid {holder_pid}, and this process neither holds nor releases it"
    )


def forget(owner: Any) -> None:
    """``owner`` no longer holds a lock: a later fork leaves it as it is."""
    _in_child.pop(owner, None)


def _tell_children() -> None:
    for owner, forked in list(_in_child.items()):
        try:
            forked(owner)
        except Exception as error:  # one object's failure must not leave the others as they were
            # No logging here: a handler's lock may have been held by another thread at the fork.
            with contextlib.suppress(OSError):
                os.write(2, f"pglock: after a fork, {type(owner).__name__} could not be told: {error!r}\n".encode())
    _in_child.clear()


os.register_at_fork(after_in_child=_tell_children)
