"""The demo: two Airflow "deployments" run the same guarded DAGs at the same moment.

Each deployment has its own AIRFLOW_HOME and metadata DB; they share only the lock
database: the Airflow connection ``postgres_default`` if configured
(``AIRFLOW_CONN_POSTGRES_DEFAULT``), otherwise an embedded PostgreSQL started here.
It prints who ran, who skipped, who deferred and why. Run it through ``python3 devtools/dev.py demo``.

``airflow dags test`` runs a deferred task's trigger inline (in the test process) instead of
in an ``airflow triggerer``; the real triggerer is covered by tests/e2e/test_defer_triggerer.py.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools.pgcluster import Cluster  # noqa: E402

DEMO_DIR = ROOT / ".pglock-demo"
DEPLOYMENTS = ("A", "B")
TENANTS = [1, 2, 3, 4]
SLOW_TENANT = 1
#: B (1 s per export) starts once A holds the slow tenant and must reach it within this: B's cold start
#: (`dags test` on Airflow 3.3, next to A's: up to 19 s here) and up to three exports before it.
SLOW_EXPORT_SECONDS = 45
OUTCOME = re.compile(r"pglock outcome=(?P<outcome>\w+) (?P<rest>.*?)(?: \[airflow\.task.*)?$")
TASK_LINE = re.compile(r"task_id=(?P<task>[\w.]+) map_index=(?P<index>-?\d+)")


@dataclass
class Outcome:
    deployment: str
    task: str
    outcome: str
    detail: str


def deployment_env(name: str, conn_uri: str) -> dict[str, str]:
    home = DEMO_DIR / f"deployment-{name}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False",
            "AIRFLOW_CONN_POSTGRES_DEFAULT": conn_uri,
            "PGLOCK_EXPORT_DIR": str(DEMO_DIR / "exports" / name),
            "AIRFLOW__PGLOCK__DEPLOYMENT": f"deployment-{name}",  # told apart on one host (docs/operations.md)
        }
    )
    return env


def airflow(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "airflow", *args], env=env, capture_output=True, text=True)


def migrate(name: str, env: dict[str, str]) -> None:
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    result = airflow(env, "db", "migrate")
    if result.returncode != 0:
        raise SystemExit(f"deployment {name}: airflow db migrate failed:\n{result.stderr[-3000:]}")


def init_lock_db(env: dict[str, str]) -> None:
    """``airflow-pglock init-db``: the table where ``once_per`` records completed periods."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "airflow-pglock"), "init-db"], env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(f"airflow-pglock init-db failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")


def wait_until_held(conn_uri: str, keys: Sequence[str], first_done: threading.Event, timeout: float = 120.0) -> None:
    """Return once some session holds one of ``keys`` (or the first deployment's run ended, or
    after ``timeout`` s): the second deployment starts while the first holds one, however slowly
    this machine starts ``airflow dags test`` (and whichever mapped task it runs first). A run that
    finds its work done already (a configured lock database: an earlier demo today) holds a key for
    milliseconds only."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    hook = AdvisoryLockHook(dsn=conn_uri)
    deadline = time.monotonic() + timeout
    while not any(holder.granted for key in keys for holder in hook.holders(key)):
        if first_done.wait(0.2) or time.monotonic() > deadline:
            return


def wait_until_scoped(conn_uri: str, key: str, first_done: threading.Event, timeout: float = 120.0) -> None:
    """Return once a lock scope holds ``key`` (or the first deployment's run ended, or after ``timeout`` s)."""
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

    hook = AdvisoryLockHook(dsn=conn_uri)
    deadline = time.monotonic() + timeout
    while hook.scope(key) is None:
        if first_done.wait(0.2) or time.monotonic() > deadline:
            return


def run_both(
    dag_id: str,
    conf: dict[str, object],
    envs: dict[str, dict[str, str]],
    *when: str,
    overlap_on: Sequence[str] = (),
    scope_on: str | None = None,
    conf_of: dict[str, dict[str, object]] | None = None,
    conn_uri: str,
) -> list[Outcome]:
    """Run ``dag_id`` in both deployments: at the same moment, or, given ``overlap_on``, B once A
    holds one of those keys (``scope_on``: once a lock scope of A's holds that key). ``conf_of``
    gives a deployment a conf of its own instead of ``conf``."""

    first_done = threading.Event()

    def one(name: str) -> list[Outcome]:
        if name != DEPLOYMENTS[0] and overlap_on:
            wait_until_held(conn_uri, overlap_on, first_done)
        if name != DEPLOYMENTS[0] and scope_on is not None:
            wait_until_scoped(conn_uri, scope_on, first_done)
        run_conf = (conf_of or {}).get(name, conf)
        try:
            result = airflow(envs[name], "dags", "test", dag_id, *when, "-c", json.dumps(run_conf))
        finally:
            if name == DEPLOYMENTS[0]:
                first_done.set()
        log = result.stdout + result.stderr
        (DEMO_DIR / f"{dag_id}-{name}.log").write_text(log)
        return parse(name, log, result.returncode)

    with ThreadPoolExecutor(len(DEPLOYMENTS)) as pool:
        results = list(pool.map(one, DEPLOYMENTS))
    return [outcome for outcomes in results for outcome in outcomes]


def parse(deployment: str, log: str, returncode: int) -> list[Outcome]:
    outcomes: list[Outcome] = []
    current_task = "?"
    for line in log.splitlines():
        if "[DAG TEST] starting" in line and (task := TASK_LINE.search(line)):
            index = int(task["index"])
            current_task = task["task"] + (f"[{index}]" if index >= 0 else "")
        if (match := OUTCOME.search(line)) is not None:
            outcome = Outcome(deployment, current_task, match["outcome"], match["rest"].strip())
            if not outcomes or outcomes[-1] != outcome:  # Airflow 2's `dags test` prints each task line twice
                outcomes.append(outcome)
    if not outcomes:
        tail = "\n".join(log.splitlines()[-30:])
        raise SystemExit(f"deployment {deployment}: no pglock outcome in the output (exit {returncode}):\n{tail}")
    return outcomes


def by_tenant(outcome: Outcome, tenants: list[int]) -> Outcome:
    """``export_tenant[i]``, a map index into this deployment's own tenant list, as ``export tenant T``."""
    if (mapped := re.fullmatch(r"export_tenant\[(\d+)\]", outcome.task)) is None:
        return outcome
    return dataclasses.replace(outcome, task=f"export tenant {tenants[int(mapped[1])]}")


def summarize(title: str, outcomes: list[Outcome]) -> None:
    print(f"\n=== {title}")
    for item in sorted(outcomes, key=lambda o: (o.task, o.outcome != "completed", o.deployment)):
        verbs = {"completed": "RAN", "skipped": "SKIPPED", "deferred": "DEFERRED", "failed": "FAILED", "lost": "LOST"}
        verb = verbs.get(item.outcome, item.outcome)
        detail = item.detail
        if item.outcome in ("skipped", "deferred") and "busy: " in detail:
            detail = detail.split("busy: ", 1)[1]
        elif item.outcome == "skipped" and " already done " in detail:
            detail = "already done " + detail.split(" already done ", 1)[1]
        elif item.outcome == "completed":
            key = detail.split(" mode=")[0]
            held = re.search(r"held=([\d.]+s)", detail)
            detail = f"{key}, held for {held[1] if held else '?'}"
        print(f"  deployment {item.deployment}  {item.task:<22} {verb:<8} {detail}")


def airflow_has_lock_scopes() -> bool:
    from airflow_pglock.compat import HAS_LOCK_SCOPE  # the version gate lives there

    return HAS_LOCK_SCOPE


def main() -> int:
    configured = os.environ.get("AIRFLOW_CONN_POSTGRES_DEFAULT")
    cluster: Cluster | None = None
    shutil.rmtree(DEMO_DIR, ignore_errors=True)
    started = time.monotonic()
    try:
        if configured:
            conn_uri = configured
            print(
                "lock database: the configured connection postgres_default (tenant days it already recorded as\n"
                "  exported, by an earlier demo today, are skipped as done: once_per)"
            )
        else:
            print("lock database: no connection configured; starting an embedded PostgreSQL ...", flush=True)
            cluster = Cluster().init().start()
            conn_uri = cluster.dsn
            print(f"  {cluster.dsn} (binaries: {cluster.bin_dir})")
        envs = {name: deployment_env(name, conn_uri) for name in DEPLOYMENTS}
        print("setting up two Airflow deployments (own AIRFLOW_HOME and metadata DB each) ...", flush=True)
        with ThreadPoolExecutor(len(DEPLOYMENTS)) as pool:
            list(pool.map(lambda name: migrate(name, envs[name]), DEPLOYMENTS))

        init_lock_db(envs["A"])

        print("both deployments run forecast_refresh at once (one global key, on_busy='skip') ...", flush=True)
        # Started together, the two tries come a start-up difference apart, well within the hold. (B started
        # only once A held the key missed it on a machine just booted: B's cold start outlasted an 8 s hold.)
        forecast = run_both("forecast_refresh", {"work_seconds": 10}, envs, conn_uri=conn_uri)
        summarize("forecast_refresh: one key for the whole job", forecast)

        day = dt.datetime.now(dt.timezone.utc).date().isoformat()
        print(
            f"\ndeployment A exports tenant {SLOW_TENANT} for {day} (a slow one: {SLOW_EXPORT_SECONDS} s); "
            "once A holds its key,\n"
            "deployment B runs tenant_exports for all four tenants (one key per tenant, on_busy='defer',\n"
            "once_per='{{ ds }}') ...",
            flush=True,
        )
        # B starts once A holds the key, so B meets it whichever order `dags test` runs the mapped exports in
        # (it iterates a set). Two full runs of 10 s exports, B started once A held any tenant, passed each
        # other without ever meeting in a CI run; and after a release the deployment whose export ends next
        # wins the race for the next tenant, so both running all four with A slow made B defer up to four times.
        tenants_of = {"A": [SLOW_TENANT], "B": TENANTS}
        exports = run_both(
            "tenant_exports",
            {"tenants": tenants_of["B"], "work_seconds": 1},
            envs,
            day,
            conf_of={"A": {"tenants": tenants_of["A"], "work_seconds": SLOW_EXPORT_SECONDS}},
            overlap_on=[f"tenant_exports/export_tenant/{SLOW_TENANT}"],
            conn_uri=conn_uri,
        )
        exports = [by_tenant(outcome, tenants_of[outcome.deployment]) for outcome in exports]
        summarize("tenant_exports: one key per tenant", exports)

        if airflow_has_lock_scopes():
            print(
                "\nboth deployments run ingestion_refresh (trigger -> wait -> promote in one lock scope on\n"
                "'ingestion-server'); B starts once A's scope holds the key ...",
                flush=True,
            )
            ingestion = run_both(
                "ingestion_refresh", {"work_seconds": 10}, envs, scope_on="ingestion-server", conn_uri=conn_uri
            )
            summarize("ingestion_refresh: one lock scope over three tasks", ingestion)
            scoped = sorted(
                {o.deployment for o in ingestion if o.task.startswith("refresh.") and o.outcome == "completed"}
            )
            ran_in = ", ".join(scoped) or "none"
            print(
                f"ingestion_refresh: the scope's tasks ran in deployment(s) {ran_in}; the other's\n"
                "setup found the scope held (its tasks were skipped by Airflow's trigger rules). Between A's tasks no\n"
                "process held the key: the scope's lease row did (docs/scopes.md)."
            )
        else:
            print(
                "\ningestion_refresh (a lock scope over three tasks) is not run: lock scopes need Airflow 3 "
                "(docs/scopes.md)."
            )

        ran = [o for o in forecast if o.outcome == "completed"]
        files = sorted((DEMO_DIR / "exports").glob("*/tenant-*.json"))
        per_tenant: dict[str, list[str]] = {}
        for path in files:
            per_tenant.setdefault(path.name.split("-")[1], []).append(path.parent.name)
        deferred = sorted({(o.deployment, o.task) for o in exports if o.outcome == "deferred"})
        print(
            f"\nforecast_refresh ran {len(ran)} time(s) across 2 deployments.\n"
            f"tenant_exports: {len(deferred)} export(s) deferred ("
            + ", ".join(f"{task} in {name}" for name, task in deferred)
            + f"); export files written: {len(files)} for 4 tenants ("
            + ", ".join(f"tenant {t} by {'+'.join(who)}" for t, who in sorted(per_tenant.items()))
            + ").\n"
            + (
                "B exported the other tenants (one key per tenant: A's tenant kept none of them waiting);\n"
                f"B's export of tenant {SLOW_TENANT} deferred while A held its key, took the key right after A's\n"
                "release and found the day already exported (once_per)."
                if deferred
                else f"Nothing deferred this time: B did not meet A's key of tenant {SLOW_TENANT} while A held it\n"
                "(B started too slowly, or an earlier demo today exported the day already: once_per)."
            )
            + "\n`airflow dags test` runs the wait inline; in a deployment it waits in `airflow triggerer`\n"
            "(tests/e2e/test_defer_triggerer.py)."
        )
        print(f"demo finished in {time.monotonic() - started:.0f} s; deployments are in {DEMO_DIR}")
        return 0
    finally:
        if cluster is not None:
            cluster.destroy()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # its PostgreSQL is stopped (main's finally); Airflow's runs got the Ctrl-C too
        print("demo interrupted: its PostgreSQL is stopped", file=sys.stderr)
        sys.exit(130)
