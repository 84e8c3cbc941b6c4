"""Blue/green: two deployments on different Airflow lines (or Pythons) share one lock database.

The moment two deployments really run the same DAGs at once is an upgrade side by side:
the old line and the new one both schedule tests/e2e/bluegreen_dags/bluegreen.py, each
with its own venv, AIRFLOW_HOME and metadata database, and only the lock database in
common. The lines must compute the same keys, see each other's holders and honour each
other's ledger rows (once_per completions, fencing tokens).

Run by ``python3 devtools/dev.py blue-green``, which builds the venvs of each pair and sets
``PGLOCK_BG_OLD_PYTHON`` / ``PGLOCK_BG_NEW_PYTHON`` to their interpreters; without them
(a plain pytest run) the module is skipped. ``PGLOCK_BG_SPLIT_LOCK_DATABASES=1`` gives
the new line a lock database of its own: then every check of the shared run must fail
(with ``PGLOCK_BG_WAIT_TIMEOUT=120``, the seconds a winner waits for the other line, it
takes about as long as a passing run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_pglock.keys import LockKey
from airflow_pglock.pg import schema
from devtools.pgcluster import Cluster, free_port
from tests.e2e.deployment import Deployment

OLD_PYTHON = os.environ.get("PGLOCK_BG_OLD_PYTHON", "")
NEW_PYTHON = os.environ.get("PGLOCK_BG_NEW_PYTHON", "")
if not (OLD_PYTHON and NEW_PYTHON):
    pytest.skip(
        "blue/green needs two venvs: run `python3 devtools/dev.py blue-green` "
        "(sets PGLOCK_BG_OLD_PYTHON and PGLOCK_BG_NEW_PYTHON)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.slow, pytest.mark.airflow, pytest.mark.timeout(900)]

DAGS = Path(__file__).parent / "bluegreen_dags"
LINES = ("old", "new")
PERIOD = "2026-01-01"
CONTENDERS = ("named", "int64", "pair", *(f"tenant_{kind}" for kind in ("str", "int", "uuid", "intenum", "strenum")))
POOL_TASKS = ("pool_0", "pool_1")
ONCE = {"once_old_first": "old", "once_new_first": "new"}
FENCES = {"old": ("fence_first", "fence_second"), "new": ("fence_first",)}  # the key is taken old, new, old
COMMON_TASKS = (*CONTENDERS, *POOL_TASKS, *ONCE, "gate", "hold")
ALL_TASKS = {line: (*COMMON_TASKS, *FENCES[line]) for line in LINES}
FINISHED = ("success", "failed", "skipped", "upstream_failed", "removed")
DEADLINE_SECONDS = 420
#: The key names and numbers every line must compute alike (tenants of each type, pool slots).
KEY_TABLE_SCRIPT = """
import enum, json, uuid
from airflow_pglock.keys import LockKey, slot_keys
class Tenant(enum.IntEnum):
    ACME = 4343
class Shop(str, enum.Enum):
    ACME = "acme-shop"
keys = {
    "name": LockKey.from_name("bluegreen/named/2026-01-01"),
    "name_unicode": LockKey.from_name("rapport/été/東京"),
    "task": LockKey.for_task("bluegreen", "named"),
    "tenant_str": LockKey.for_task("bluegreen", "t", tenant="acme-corp"),
    "tenant_int": LockKey.for_task("bluegreen", "t", tenant=4242),
    "tenant_uuid": LockKey.for_task("bluegreen", "t", tenant=uuid.UUID("7d4e3f0a-9b1c-4d2e-8f6a-5b4c3d2e1f0a")),
    "tenant_intenum": LockKey.for_task("bluegreen", "t", tenant=Tenant.ACME),
    "tenant_strenum": LockKey.for_task("bluegreen", "t", tenant=Shop.ACME),
    "int64": LockKey.coerce(7340012345678901234),
    "int64_min": LockKey.coerce(-(2**63)),
    "pair": LockKey.coerce((73400, -12345)),
}
for i, slot in enumerate(slot_keys(LockKey.from_name("bluegreen/pool"), 3), 1):
    keys[f"pool_slot_{i}"] = slot
print(json.dumps({k: [v.name, list(v.numbers), list(v.pg_locks)] for k, v in keys.items()}))
"""

LOCK_TABLES = """
CREATE TABLE bg_runs (seq bigserial PRIMARY KEY, job text, period text, line text, pid int, token bigint,
                      at timestamptz DEFAULT clock_timestamp());
CREATE TABLE bg_release (released boolean);
CREATE TABLE bg_register (fencing_token bigint, line text);
INSERT INTO bg_register VALUES (NULL, NULL);
"""
REGISTER_TRIGGER = (
    "CREATE TRIGGER bg_register_fenced BEFORE UPDATE ON bg_register FOR EACH ROW"
    " EXECUTE FUNCTION pglock.reject_stale_fencing_token('bluegreen/fence')"
)


def _describe(python: str) -> str:
    probe = subprocess.run(
        [python, "-c", "import sys, airflow; print(airflow.__version__, '%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, f"{python} cannot import airflow: {probe.stderr[-2000:]}"
    version, python_version = probe.stdout.split()[-2:]
    return f"Airflow {version} on Python {python_version}"


PYTHONS = {"old": OLD_PYTHON, "new": NEW_PYTHON}


def test_every_line_computes_the_same_keys() -> None:
    """The pure check: each venv's interpreter computes the same table of keys."""
    tables = {}
    for line, python in PYTHONS.items():
        out = subprocess.run([python, "-c", KEY_TABLE_SCRIPT], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{line} ({python}): {out.stderr[-2000:]}"
        tables[line] = json.loads(out.stdout.strip().splitlines()[-1])
    assert tables["old"] == tables["new"], f"{_describe(OLD_PYTHON)} vs {_describe(NEW_PYTHON)}"
    assert len(tables["old"]) == 14


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster({"max_connections": "300"}) as server:
        yield server


def _create_database(cluster: Cluster, name: str) -> str:
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return cluster.dsn_for(name)


@pytest.fixture(scope="module")
def deployments(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Deployment]]:
    """``old`` and ``new``: each its own venv, AIRFLOW_HOME and metadata DB (migrated by its own line)."""
    lock_uri = _create_database(cluster, "locks")
    with psycopg.connect(lock_uri, autocommit=True) as conn:
        conn.execute(LOCK_TABLES)
        schema.migrate(conn)  # airflow-pglock init-db: completions, fencing tokens
        conn.execute(REGISTER_TRIGGER)
    # PGLOCK_BG_SPLIT_LOCK_DATABASES=1 points the new line at a second lock database: the
    # check that the assertions can fail (each must, then).
    new_lock_uri = lock_uri
    if os.environ.get("PGLOCK_BG_SPLIT_LOCK_DATABASES") == "1":
        new_lock_uri = _create_database(cluster, "locks_apart")
        with psycopg.connect(new_lock_uri, autocommit=True) as conn:
            conn.execute(LOCK_TABLES)
            schema.migrate(conn)
    base = tmp_path_factory.mktemp("bluegreen")
    metadata = {line: _create_database(cluster, f"meta_{line}") for line in LINES}
    result: dict[str, Deployment] = {}
    for line in LINES:
        peer = "new" if line == "old" else "old"
        uri = lock_uri if line == "old" else new_lock_uri
        env = {
            "AIRFLOW_CONN_POSTGRES_DEFAULT": uri,
            "PGLOCK_BG_DSN": uri,
            "PGLOCK_BG_ROLE": line,
            "AIRFLOW__PGLOCK__DEPLOYMENT": f"bg-{line}",  # two deployments on one host, told apart by name
            "PGLOCK_BG_OWN_METADATA": metadata[line],
            "PGLOCK_BG_PEER_METADATA": metadata[peer],
            "AIRFLOW__CORE__PARALLELISM": "32",
            "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": "32",
            "PGLOCK_BG_WAIT_TIMEOUT": os.environ.get("PGLOCK_BG_WAIT_TIMEOUT", str(DEADLINE_SECONDS)),
        }
        result[line] = Deployment(line, base / line, metadata[line], free_port(), DAGS, env, python=PYTHONS[line])
        result[line].home.mkdir(parents=True)
    began = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # each line migrates its own metadata DB, both at once
        migrated = dict(
            zip(LINES, pool.map(lambda d: d.airflow("db", "migrate", timeout=600), result.values()), strict=True)
        )
    for line, done in migrated.items():
        assert done.returncode == 0, f"{line}: airflow db migrate failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    print(f"blue/green: both metadata DBs migrated in {time.monotonic() - began:.0f} s")
    started: list[Deployment] = []
    try:
        for deployment in result.values():
            started.append(deployment)
            deployment.start_api_server()
        for deployment in result.values():
            deployment.start_scheduling()
        yield result
    finally:
        for deployment in started:
            deployment.stop()
        shutil.rmtree(base, ignore_errors=True)


def _states(deployment: Deployment) -> dict[str, str | None]:
    rows = deployment.query("SELECT task_id, state FROM task_instance WHERE dag_id = 'bluegreen'")
    return dict(rows)  # type: ignore[arg-type]


def _lock_rows(uri: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(uri, autocommit=True) as conn:
        return [tuple(row) for row in conn.execute(statement, params).fetchall()]


def _wait_until(what: str, deployments: dict[str, Deployment], done: Any) -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not done():
        for deployment in deployments.values():
            deployment.check_alive()
        if time.monotonic() > deadline:
            states = {line: _states(d) for line, d in deployments.items()}
            logs = "\n".join(d.logs() for d in deployments.values())
            raise AssertionError(f"{what}: not after {DEADLINE_SECONDS} s; task states {states}\n{logs}")
        time.sleep(1)


def _task_log(deployment: Deployment, task_id: str) -> str:
    paths = sorted((deployment.home / "logs").rglob(f"task_id={task_id}/**/*.log"))
    paths += sorted((deployment.home / "logs").rglob(f"task_id={task_id}/*.log"))
    return "".join(path.read_text(errors="replace") for path in dict.fromkeys(paths))


def _skip_line(deployment: Deployment, task_id: str) -> str:
    log = _task_log(deployment, task_id)
    found = re.search(r"pglock outcome=skipped[^\n\"]*", log)
    assert found, f"line {deployment.name}: no skip outcome line in the log of {task_id}:\n{log[-3000:]}"
    return found.group(0)


def _named_holder(pid: int, line: str) -> str:
    """How a skip names the holder of the other line: its pid, deployment and host (maybe shortened)."""
    return f"pid {pid} of deployment 'bg-{line}' on host '"


def _locks_from(python: str, uri: str) -> list[dict[str, Any]]:
    cli = Path(python).parent / "airflow-pglock"
    out = subprocess.run(
        [str(cli), "locks", "--dsn", uri, "--output", "json"], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, f"{cli} locks: {out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    report = json.loads(out.stdout)
    return list(report["locks"])


def _lock_uris(deployments: dict[str, Deployment]) -> list[str]:
    """The lock database(s) the lines use: one, unless PGLOCK_BG_SPLIT_LOCK_DATABASES split them."""
    return list(dict.fromkeys(d.extra_env["PGLOCK_BG_DSN"] for d in deployments.values()))


def _all_lock_rows(deployments: dict[str, Deployment], statement: str) -> list[tuple[Any, ...]]:
    return [row for uri in _lock_uris(deployments) for row in _lock_rows(uri, statement)]


def test_old_and_new_line_run_each_job_once(deployments: dict[str, Deployment]) -> None:
    """Each assertion adds to ``problems``, reported together (a broken pair shows all it breaks)."""
    lock_uri = _lock_uris(deployments)[0]
    described = {line: _describe(d.python) for line, d in deployments.items()}
    print(f"blue/green: old = {described['old']}, new = {described['new']}")
    started = time.monotonic()
    problems: list[str] = []

    def check(condition: bool, problem: str) -> bool:
        if not condition:
            problems.append(problem)
        return condition

    # Both hold a key of their own at once: `airflow-pglock locks` of either line lists both holders.
    def both_hold() -> bool:
        return len(_all_lock_rows(deployments, "SELECT 1 FROM bg_runs WHERE job = 'hold'")) == 2

    _wait_until("both lines hold their 'hold' key", deployments, both_hold)
    holders = dict(_all_lock_rows(deployments, "SELECT line, pid FROM bg_runs WHERE job = 'hold'"))
    for line, deployment in deployments.items():
        entries = _locks_from(deployment.python, deployment.extra_env["PGLOCK_BG_DSN"])
        # the name is recorded with the release (the registry): while held, the numbers and the holder
        listed = {
            (tuple(e["key"]["numbers"]), e["pid"], e["state"], e["deployment"], *(e["airflow"] or {}).values())
            for e in entries
        }
        for holder_line, pid in holders.items():
            key = LockKey.from_name(f"bluegreen/hold/{holder_line}")
            # the holder as `locks` parses its application_name: deployment, DAG, task, run, map index
            airflow = ("bluegreen", "hold", "scheduled__2026-01-01T00:00:00+00:00", -1)
            holding = (key.numbers, pid, "holding", f"bg-{holder_line}", *airflow)
            check(
                holding in listed,
                f"`airflow-pglock locks` of the {line} line ({described[line]}) misses the {holder_line} line's "
                f"holder pid {pid}: {sorted(listed, key=str)}",
            )
    for uri in _lock_uris(deployments):
        _lock_rows(uri, "INSERT INTO bg_release VALUES (true) RETURNING released")

    def all_finished() -> bool:
        return all(
            all(_states(d).get(task_id) in FINISHED for task_id in ALL_TASKS[line]) for line, d in deployments.items()
        )

    _wait_until("every task of both lines finished", deployments, all_finished)
    print(f"blue/green: both lines finished {time.monotonic() - started:.0f} s after start-up")
    states = {line: _states(d) for line, d in deployments.items()}
    runs = _all_lock_rows(deployments, "SELECT job, line, pid, token FROM bg_runs ORDER BY seq")
    ran: dict[str, list[tuple[str, int, int | None]]] = {}
    for job, line, pid, token in runs:
        ran.setdefault(job, []).append((line, pid, token))

    # Every contended key ran exactly once; the other line skipped, naming this line's holder.
    for job in CONTENDERS:
        outcome = {line: states[line][job] for line in LINES}
        if not check(sorted(outcome.values()) == ["skipped", "success"], f"{job}: not run exactly once: {outcome}"):
            continue
        if not check(len(ran.get(job, [])) == 1, f"{job}: ran {ran.get(job)}, expected once"):
            continue
        winner, pid, _ = ran[job][0]
        check(outcome[winner] == "success", f"{job}: the {winner} line ran it but its task is {outcome[winner]}")
        loser = "new" if winner == "old" else "old"
        skip = _skip_line(deployments[loser], job)
        check(
            f"is held by {_named_holder(pid, winner)}" in skip,
            f"{job}: the {loser} line's skip does not name pid {pid} of deployment 'bg-{winner}': {skip}",
        )

    # The pool of 2 slots: 4 contenders over both lines, exactly 2 ran; every skip names both holders.
    pool_runs = [entry for job in POOL_TASKS for entry in ran.get(job, [])]
    check(len(pool_runs) == 2, f"pool of 2 slots: {len(pool_runs)} runs {pool_runs}")
    pool_states = [states[line][job] for line in LINES for job in POOL_TASKS]
    check(sorted(pool_states) == ["skipped"] * 2 + ["success"] * 2, f"pool task states: {pool_states}")
    for line in LINES:
        for job in POOL_TASKS:
            if states[line][job] == "skipped":
                skip = _skip_line(deployments[line], job)
                for holder_line, pid, _ in pool_runs:
                    check(
                        _named_holder(pid, holder_line) in skip,
                        f"{line} {job}: the skip does not name pid {pid} of deployment 'bg-{holder_line}': {skip}",
                    )

    # once_per: the completion one line recorded stops the other line.
    completions = _all_lock_rows(deployments, "SELECT key_name, period FROM pglock.completions")
    for job, leader in ONCE.items():
        follower = "new" if leader == "old" else "old"
        lines_ran = [line for line, _, _ in ran.get(job, [])]
        check(lines_ran == [leader], f"{job}: ran on {lines_ran}, expected only on the {leader} line")
        job_states = {line: states[line][job] for line in LINES}
        check(job_states == {leader: "success", follower: "skipped"}, f"{job}: {job_states}")
        if job_states[follower] == "skipped":
            skip = _skip_line(deployments[follower], job)
            check("already done for period" in skip and "(once_per)" in skip, f"{job}: {skip}")
        check(completions.count((f"bluegreen/{job}", PERIOD)) == 1, f"{job}: completions {completions}")

    # Fencing: tokens issued by either line grow on one key across both; the register accepted each.
    order = [(line, token) for job, line, _, token in runs if job.startswith("fence_")]  # in the order they ran
    tokens = [token for _, token in order]
    check([line for line, _ in order] == ["old", "new", "old"], f"fenced runs: {order}")
    check(tokens == sorted(set(tokens)), f"fencing tokens not increasing across the lines: {order}")
    for line in LINES:
        fenced = {job: states[line][job] for job in FENCES[line]}
        check(set(fenced.values()) == {"success"}, f"{line}: fenced tasks {fenced} (a refused token fails the task)")
    register = _lock_rows(lock_uri, "SELECT fencing_token, line FROM bg_register")
    check(register == [(tokens[-1], "old")], f"register {register}, expected the last token {tokens[-1:]} by old")
    if len(tokens) >= 2:  # the new line's token, now older than the old line's last one: refused
        try:
            _lock_rows(lock_uri, "UPDATE bg_register SET fencing_token = %s RETURNING line", [tokens[-2]])
        except psycopg.errors.CheckViolation as refused:
            check("stale fencing token" in str(refused), f"the stale write was refused, but how: {refused}")
        else:
            check(False, f"the register accepted the stale token {tokens[-2]} after {tokens[-1]}")

    assert problems == [], "blue/green " + " -> ".join(described.values()) + ":\n" + "\n".join(problems)
