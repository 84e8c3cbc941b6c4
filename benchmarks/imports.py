"""2. Import cost of airflow_pglock on top of airflow.sdk: what parsing a DAG file pays.

Each sample is a fresh interpreter that imports ``airflow.sdk`` (timed, for reference),
resolves the plain ``@task`` decorator (what any DAG with a Python task loads), then
another provider's decorator (``@task.bash``), then ``import airflow_pglock``, the first
use of ``@task.advisory_lock`` (Airflow imports ``airflow_pglock.decorators.advisory_lock``
through the provider's task-decorators entry) and the modules of ``guarded()`` and
``AdvisoryLockSensor``, each timed with ``time.perf_counter``, so each number is the extra
cost on top of what was loaded before it. One more interpreter runs the same with
``python -X importtime`` to name the heaviest modules ours pull in, and to check that the
modules a task needs only when it runs (psycopg, the guard, the trigger) stay unloaded.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.stats import Summary, table

#: airflow-pglock's parse-time cost, all adapters, beyond what another provider's decorator costs.
TARGET_SECONDS = 0.030
ROOT = Path(__file__).resolve().parents[1]
BASH = "`@task.bash` (another provider's decorator, first use)"
STEPS = (
    ("airflow.sdk", "import airflow.sdk"),
    ("`@task` (first use; any DAG with a Python task pays it)", "airflow.sdk.task.python"),
    (BASH, "airflow.sdk.task.bash"),
    ("`import airflow_pglock`", "import airflow_pglock"),
    (
        "`@task.advisory_lock` (first use: Airflow imports `airflow_pglock.decorators.advisory_lock`)",
        "airflow.sdk.task.advisory_lock",
    ),
    (
        "`guarded()` and `AdvisoryLockSensor` (their modules)",
        "import airflow_pglock.operators.advisory_lock, airflow_pglock.sensors.advisory_lock",
    ),
)
OURS = tuple(name for name, _ in STEPS[3:])
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
#: Needed when a task runs, never while its DAG file is parsed (tests/airflow/test_parse_time.py).
RUNTIME_ONLY = ("psycopg", "airflow_pglock.guard", "airflow_pglock.hooks.advisory_lock", "airflow.triggers.base")


@dataclass
class ImportResult:
    samples: dict[str, list[float]] = field(default_factory=dict)
    heaviest: list[tuple[str, float]] = field(default_factory=list)
    new_modules: int = 0
    ours_total: float = 0.0
    runtime_only_loaded: list[str] = field(default_factory=list)

    def ours(self) -> Summary:
        """airflow-pglock's parse-time cost per sample: the package and all three adapters."""
        return Summary.of([sum(values) for values in zip(*(self.samples[name] for name in OURS), strict=True)])

    def over_bash(self) -> float:
        """Median of (ours - ``@task.bash``), per sample: the cost beyond another provider's decorator."""
        bash = self.samples[BASH]
        per_sample = [sum(values) for values in zip(*(self.samples[name] for name in OURS), strict=True)]
        return Summary.of([mine - theirs for mine, theirs in zip(per_sample, bash, strict=True)]).median


def compile_bytecode() -> None:
    """Compile Airflow's modules and ours to bytecode, as ``pip install`` does for a wheel.

    Without it each sample would compile every module it imports from source again wherever
    no bytecode was written (PYTHONDONTWRITEBYTECODE, a fresh editable checkout), measuring the
    compiler instead of the import: a deployment's DAG processor reads compiled files.
    """
    import airflow

    packages = [Path(path) for path in airflow.__path__] + [ROOT / "airflow_pglock"]
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *map(str, packages)],
        capture_output=True,
        check=False,  # a module that does not compile is imported from source, as before
    )


def run_imports(runs: int) -> ImportResult:
    result = ImportResult()
    compile_bytecode()
    code = PROBE % (STEPS,)
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        for name, seconds in json.loads(out.stdout.strip().splitlines()[-1]).items():
            result.samples.setdefault(name, []).append(seconds)
    # Which modules ours add on top of airflow.sdk, @task and @task.bash, and the heaviest (cumulative).
    traced = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            "import sys, airflow.sdk; airflow.sdk.task.python; airflow.sdk.task.bash; "
            "sys.stderr.write('--- before airflow_pglock ---\\n'); "
            "import airflow_pglock; airflow.sdk.task.advisory_lock; "
            "import airflow_pglock.operators.advisory_lock, airflow_pglock.sensors.advisory_lock",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    after = traced.stderr.split("--- before airflow_pglock ---", 1)[-1]
    entries = [
        (match.group(4), int(match.group(2)) / 1e6, len(match.group(3)) // 2) for match in IMPORTTIME.finditer(after)
    ]
    result.new_modules = len(entries)
    result.heaviest = sorted([(name, seconds) for name, seconds, _ in entries], key=lambda item: -item[1])[:12]
    result.ours_total = sum(seconds for _, seconds, depth in entries if depth == 0)
    result.runtime_only_loaded = [name for name, _, _ in entries if name in RUNTIME_ONLY]
    return result


def render(result: ImportResult) -> str:
    rows = []
    for name, _ in STEPS:
        values = result.samples.get(name, [])
        rows.append([name, Summary.of(values).fmt(1000, " ms", 1)])
    ours, over = result.ours(), result.over_bash()
    verdict = "met" if over < TARGET_SECONDS else "MISSED"
    heaviest = table(
        [
            "module (imported by airflow-pglock's adapters, not yet by airflow.sdk, `@task`, `@task.bash`)",
            "cumulative ms",
        ],
        [[f"`{name}`", f"{seconds * 1000:.1f}"] for name, seconds in result.heaviest],
    )
    loaded = ", ".join(f"`{name}`" for name in result.runtime_only_loaded) or "none"
    return "\n".join(
        [
            "## 2. Import cost on top of `airflow.sdk` (DAG parse time)",
            "",
            "Fresh interpreter per sample, Airflow's modules and ours compiled to bytecode first (as `pip install` "
            "does for a wheel; without it every sample would time the compiler wherever no bytecode was written). "
            "Each import timed after the previous one, so each row is the extra cost "
            "on top of the rows above it. The second row is what a DAG file using the plain `@task` decorator "
            "already loads (Airflow resolves it to the standard provider's Python operator on first use); the "
            "third is another provider's decorator, for comparison. The last three rows are everything a DAG file "
            "using airflow-pglock imports (`@task.advisory_lock`, `@advisory_lock`, `guarded()`, "
            "`AdvisoryLockSensor`).",
            "",
            table(["import", "time (median, p25, p75, n)"], rows),
            "",
            f"**Target: airflow-pglock's parse-time imports < {TARGET_SECONDS * 1000:.0f} ms over `@task.bash`'s: "
            f"{verdict}** (median of the per-sample difference {over * 1000:.1f} ms; airflow-pglock's rows alone: "
            f"median {ours.median * 1000:.1f} ms, p25 {ours.p25 * 1000:.1f}, p75 {ours.p75 * 1000:.1f}).",
            "",
            f"`python -X importtime` (one run): airflow-pglock's adapters add {result.new_modules} modules "
            f"({result.ours_total * 1000:.1f} ms cumulative) to those of `airflow.sdk`, `@task` and `@task.bash`; "
            "the heaviest, cumulative (a module's time includes the modules it imports):",
            "",
            heaviest,
            "",
            f"Loaded of the modules a task needs only when it runs ({', '.join(f'`{n}`' for n in RUNTIME_ONLY)}): "
            f"{loaded}. The adapters import the guard, the hook (psycopg) and the trigger where they are used "
            "(when the task executes or the sensor defers); `tests/airflow/test_parse_time.py` keeps it so.",
        ]
    )
