"""Reading devtools/loopprobe's records of a trigger runner's event loop (tests/e2e, tests/unit/test_loopprobe.py).

The probe's docstring says what each record is. airflow-pglock's code on the loop is a
trigger task of a DAG whose triggers are all airflow-pglock's (``trigger <dag>/<task>``),
or the wake-up hub (``WakeupHub.*``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

PROBE = Path(__file__).resolve().parents[2] / "devtools" / "loopprobe"
#: How long a step of our code on the loop may take, GC and run-queue wait excluded (Airflow warns at 0.2 s).
OURS_MAX_STEP = 0.1
Record = dict[str, object]


def read(path: Path) -> list[Record]:
    """The probe's records; the probe must have run."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    assert any(r["kind"] == "started" for r in records), f"the loop probe did not run ({path})"
    return records


def our_slow_steps(records: list[Record], our_dags: Sequence[str]) -> list[Record]:
    """Steps of airflow-pglock's code on the loop longer than OURS_MAX_STEP.

    One callback (a trigger's step, the hub's), and the sum of ours within one turn of the
    loop (triggers woken together run one after another before the loop looks at its timers).
    Excluded: the garbage collector's time, and the loop thread's run-queue wait (it was
    ready to run while the OS ran other processes: a loaded machine, not a blocking call).
    """

    def ours(group: object) -> bool:
        return str(group).startswith((*(f"trigger {dag}/" for dag in our_dags), "WakeupHub."))

    slow: list[Record] = []
    for record in records:
        if record["kind"] == "slow_callback" and ours(record["group"]):
            if float(record["wall"]) - float(record["gc"]) - float(record["cpu_wait"]) > OURS_MAX_STEP:  # type: ignore[arg-type]
                slow.append(record)
        elif record["kind"] == "slow_iteration":
            groups = [g for g in record["by_group"] if ours(g[0])]  # type: ignore[attr-defined]
            if sum(g[2] - g[3] - g[4] for g in groups) > OURS_MAX_STEP:
                slow.append(record)
    return slow


def report(records: list[Record]) -> str:
    """The probe's stalls, slow turns of the loop and long collections, one line each."""
    return "\n".join(json.dumps(r)[:1500] for r in records if r["kind"] in ("stall", "slow_iteration", "gc"))
