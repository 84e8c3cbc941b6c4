"""The campaign's history: what every process did and what the nemesis did, one JSON object a line.

Each worker process appends its own file (``worker-<n>.jsonl``, flushed at every event, so a
SIGKILL loses at most the line being written), the nemesis ``nemesis.jsonl``. Times are
``time.time()``: every process runs on one machine, so they share the clock of the
database servers too (which stamp the register's writes).

Worker events (``event``): ``spawn``; ``attempt`` (a run begins: ``run``, ``kind``);
``acquired`` (``run``, ``key``, ``token``, ``backend`` = the lock session's backend pid, ``at`` =
when the provider took the lock, which its handle says: the event itself comes once the work
starts, after the fencing token);
``write`` (``run``, ``key``, ``token``, ``accepted``, ``at`` = the register's clock);
``lost`` (``run``: the process learned that its lock is gone); ``released`` (``run``, ``key``:
a sub-key given back before the run ends); ``outcome`` (``run``, ``outcome`` = completed |
skipped | lost | failed, ``detail``); ``stall`` (``start``, ``end``: the machine did not run the
process meanwhile, its watch thread found: :func:`devtools.campaign.workers.watch_stalls`).
Nemesis events: ``fault`` (``kind``, ``start``, ``end``, ``target``, ``pids``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


class HistoryWriter:
    """Appends events to one file, a line each, flushed at once."""

    def __init__(self, path: Path, **common: Any) -> None:
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._common = common
        self._lock = threading.Lock()  # a worker's stall watch writes from a thread of its own

    def emit(self, event: str, **data: Any) -> None:
        line = json.dumps({"t": time.time(), "event": event, **self._common, **data}) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_events(directory: Path) -> Iterator[dict[str, Any]]:
    """Every event of every file of ``directory``; a line cut short by a SIGKILL is skipped."""
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
