"""2. Import cost of airflow_pglock on top of airflow.sdk.

Each sample is a fresh interpreter that imports ``airflow.sdk`` (timed, for reference),
resolves the plain ``@task`` decorator (what any DAG with a Python task loads), then
``import airflow_pglock`` and the first use of ``@task.advisory_lock`` (Airflow imports
``airflow_pglock.decorators.advisory_lock`` through the provider's task-decorators entry),
each timed with ``time.perf_counter``, so each number is the extra cost on top of what was
loaded before it. One more interpreter runs the same with ``python -X importtime`` to name
the heaviest modules the decorator pulls in.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.stats import Summary, table

TARGET_SECONDS = 0.050
ROOT = Path(__file__).resolve().parents[1]
STEPS = (
    ("airflow.sdk", "import airflow.sdk"),
    ("`@task` (first use; any DAG with a Python task pays it)", "airflow.sdk.task.python"),
    ("`import airflow_pglock`", "import airflow_pglock"),
    (
        "`@task.advisory_lock` (first use: Airflow imports `airflow_pglock.decorators.advisory_lock`)",
        "airflow.sdk.task.advisory_lock",
    ),
)
PROBE = """
import json, sys, time
times = {}
for name, statement in %r:
    started = time.perf_counter()
    exec(statement)
    times[name] = time.perf_counter() - started
print(json.dumps(times))
"""
IMPORTTIME = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)")


@dataclass
class ImportResult:
    samples: dict[str, list[float]] = field(default_factory=dict)
    heaviest: list[tuple[str, float]] = field(default_factory=list)
    new_modules: int = 0
    decorator_total: float = 0.0
    runtime_only: dict[str, float] = field(default_factory=dict)


def run_imports(runs: int) -> ImportResult:
    result = ImportResult()
    code = PROBE % (STEPS,)
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        for name, seconds in json.loads(out.stdout.strip().splitlines()[-1]).items():
            result.samples.setdefault(name, []).append(seconds)
    # Which modules the decorator adds on top of airflow.sdk, and the heaviest of them (cumulative).
    traced = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            "import sys, airflow.sdk; airflow.sdk.task.python; sys.stderr.write('--- after airflow.sdk ---\\n'); "
            "import airflow_pglock.decorators.advisory_lock",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    after = traced.stderr.split("--- after airflow.sdk ---", 1)[-1]
    entries = []
    for match in IMPORTTIME.finditer(after):
        depth = len(match.group(3)) // 2
        entries.append((match.group(4), int(match.group(2)) / 1e6, depth))
    result.new_modules = len(entries)
    result.heaviest = sorted([(name, seconds) for name, seconds, _ in entries], key=lambda item: -item[1])[:12]
    cumulative = {name: seconds for name, seconds, _ in entries}
    result.decorator_total = cumulative.get("airflow_pglock.decorators.advisory_lock", 0.0)
    # Needed when the task runs, not when the DAG file is parsed: the driver, and the trigger base class.
    runtime_only = ("psycopg", "airflow.triggers.base")
    result.runtime_only = {name: cumulative[name] for name in runtime_only if name in cumulative}
    return result


def render(result: ImportResult) -> str:
    rows = []
    for name, _ in STEPS:
        values = result.samples.get(name, [])
        rows.append([name, Summary.of(values).fmt(1000, " ms", 1)])
    extra = Summary.of([a + b for a, b in zip(result.samples[STEPS[2][0]], result.samples[STEPS[3][0]], strict=True)])
    verdict = "met" if extra.median < TARGET_SECONDS else "MISSED"
    heaviest = table(
        ["module (imported by the decorator module, not yet by airflow.sdk and `@task`)", "cumulative ms"],
        [[f"`{name}`", f"{seconds * 1000:.1f}"] for name, seconds in result.heaviest],
    )
    return "\n".join(
        [
            "## 2. Import cost on top of `airflow.sdk`",
            "",
            "Fresh interpreter per sample; each import timed after the previous one, so each row is the extra cost "
            "on top of the rows above it. The second row is what a DAG file using the plain `@task` decorator "
            "already loads (Airflow resolves it to the standard provider's Python operator on first use).",
            "",
            table(["import", "time (median, p25, p75, n)"], rows),
            "",
            f"**Target: `airflow_pglock` + its decorator module < {TARGET_SECONDS * 1000:.0f} ms extra: {verdict}** "
            f"(median {extra.median * 1000:.1f} ms, p25 {extra.p25 * 1000:.1f}, p75 {extra.p75 * 1000:.1f}). "
            "`import airflow_pglock` alone imports neither Airflow nor psycopg.",
            "",
            f"`python -X importtime` (one run): the decorator module adds {result.new_modules} modules to those of "
            "`airflow.sdk` and `@task`; the heaviest, cumulative (a module's time includes the modules it imports):",
            "",
            heaviest,
            "",
            _runtime_only_text(result),
        ]
    )


def _runtime_only_text(result: ImportResult) -> str:
    if not result.runtime_only or not result.decorator_total:
        return ""
    parts = ", ".join(f"`{name}` {seconds * 1000:.0f} ms" for name, seconds in result.runtime_only.items())
    share = sum(result.runtime_only.values()) / result.decorator_total
    return (
        f"Of the decorator module's {result.decorator_total * 1000:.0f} ms in this run, {share:.0%} is code a DAG file "
        f"does not need while it is parsed, only when the task runs: {parts}. The decorator module imports "
        "`airflow_pglock.guard` and `task_guard` (hence psycopg) at module level, and `compat` imports the trigger "
        "base class for the sensor's trigger. Importing those where they are used (in `execute`, in the trigger "
        "module) could take up to this share off every DAG file parse that uses the decorator."
    )
