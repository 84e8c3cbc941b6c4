"""The "Advisory locks" page in a real Airflow UI: real ``airflow api-server``, real headless Chromium.

While a guarded task of a real DAG run (dag.test) holds its lock, a browser logs in to
the Airflow UI through its login form (SimpleAuthManager), opens the plugin page from the
UI, and must see the holder, linked to its DAG run (the run id is shortened in the lock's
application_name, so the link proves the page resolved it in the metadata database).
When the task ends, the page must drop the row by itself (it refreshes). The JSON endpoint
must refuse anonymous requests and connections not listed in ``[pglock] ui_conn_ids``.

Set PGLOCK_SCREENSHOT_DIR to keep the screenshot (docs/img/ui-locks.png is made so).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_pglock.compat import HAS_UI_PAGE, UI_PAGE_SINCE
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.schema import migrate
from airflow_pglock.policy import LockPolicy
from devtools.browser import BrowserUnavailableError, find_chromium, headless_flags
from devtools.pgcluster import free_port
from tests.helpers import run_dag
from tests.ops_helpers import dsn_uri, scratch_database

pytestmark = [
    pytest.mark.airflow,
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_UI_PAGE, reason="the Advisory locks UI page is an Airflow 3.1+ plugin"),
]

CONN_ID = "pglock_ui"
USER, PASSWORD = "ops-admin", "pglock-ui-test-password"
KEY = "nightly-settlement"

UI_DAG = """
import os
import time

import pendulum
from airflow.sdk import dag, task


@dag(dag_id="ui_settlement_dag", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def ui_settlement_dag():
    @task.advisory_lock(postgres_conn_id="pglock_ui", key="nightly-settlement")
    def settle_while_watched():
        # Hold the lock until the browser has seen it (bounded: never hang the suite).
        deadline = time.monotonic() + 150
        while not os.path.exists(os.environ["PGLOCK_UI_DONE"]) and time.monotonic() < deadline:
            time.sleep(0.2)

    settle_while_watched()


the_dag = ui_settlement_dag()
"""


@dataclass
class ApiServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def token(self) -> str:
        request = urllib.request.Request(
            f"{self.url}/auth/token",
            data=json.dumps({"username": USER, "password": PASSWORD}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return str(json.load(response)["access_token"])

    def get(self, path: str, token: str | None = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(f"{self.url}{path}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            return error.code, json.load(error)


@pytest.fixture(scope="module")
def ui_db(pg_server: str) -> Iterator[str]:
    with scratch_database(pg_server, prefix="pglock_ui") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)  # the registry names the key on the page
        # Earlier runs: each release records its key's name (and a slot's pool size) in the registry.
        with _pool_held(dsn, 3):
            pass
        earlier = AdvisoryLockHook(dsn=dsn).acquire(KEY)
        assert earlier is not None and earlier.release()
        yield dsn


@pytest.fixture(scope="module")
def api_server(airflow_db: Path, ui_db: str) -> Iterator[ApiServer]:
    """``airflow api-server`` on a free port, SimpleAuthManager with a known user and password."""
    workdir = Path(tempfile.mkdtemp(prefix="pglock-api-"))
    passwords = workdir / "passwords.json"
    passwords.write_text(json.dumps({USER: PASSWORD}))
    port = free_port()
    env = {
        **os.environ,
        "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__API_AUTH__JWT_SECRET": "pglock-ui-test-jwt-secret",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__PGLOCK__UI_CONN_IDS": CONN_ID,
        "AIRFLOW__PGLOCK__UI_REFRESH_SECONDS": "1",
        "AIRFLOW__PGLOCK__DEPLOYMENT": "ui-deployment",  # as its task's lock session (the same deployment)
        f"AIRFLOW_CONN_{CONN_ID.upper()}": dsn_uri(ui_db),
    }
    log = workdir / "api-server.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "airflow", "api-server", "--host", "127.0.0.1", "--port", str(port), "-w", "1"],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ApiServer(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"api-server exited:\n{log.read_text()[-3000:]}"
            try:
                if server.get("/api/v2/monitor/health")[0] == 200:
                    break
            except (OSError, ValueError):
                pass
            assert time.monotonic() < deadline, f"api-server not up in time:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.matrix("ui-page", since=UI_PAGE_SINCE)
def test_json_endpoint_needs_authentication_and_an_allowed_connection(api_server: ApiServer, ui_db: str) -> None:
    assert api_server.get("/pglock/api/locks")[0] == 401
    assert api_server.get("/pglock/locks")[0] == 401
    token = api_server.token()
    status, data = api_server.get("/pglock/api/locks?conn_id=postgres_default", token)
    assert status == 400 and "ui_conn_ids" in data["detail"]
    holder = psycopg.connect(ui_db, autocommit=True, application_name="billing-service")
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", LockKey.from_name("billing").numbers)
        status, data = api_server.get("/pglock/api/locks", token)
    finally:
        holder.close()
    assert status == 200 and data["conn_id"] == CONN_ID
    [entry] = data["locks"]
    assert entry["application_name"] == "billing-service" and entry["run_url"] is None
    assert entry["key"]["numbers"] == list(LockKey.from_name("billing").numbers)


def test_a_holder_of_a_named_deployment_gets_no_link_from_an_unnamed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheduled run ids are the same in every deployment: a link to another deployment's run
    would open this one's run of the same DAG. An unnamed deployment linked every holder."""
    from airflow_pglock.plugins import lock_view

    monkeypatch.setattr("airflow_pglock.compat.deployment_name", lambda: None)  # this deployment is unnamed
    run = "scheduled__2026-12-06T00:00:00+00:00"
    entries = [{"airflow": {"dag_id": "nightly", "task_id": "t", "run_id": run}, "deployment": "prod-eu", "host": "w1"}]
    lock_view.add_run_urls(entries, "/")
    assert entries[0]["run_url"] is None, entries[0]


POOL = "ui-exports"


@contextlib.contextmanager
def _pool_held(ui_db: str, count: int) -> Iterator[list[LockGuard]]:
    """``count`` slots of the pool POOL (slots=3) held by guarded executions of DAG ``exports_<n>``,
    which record the pool's size in the registry, as a guarded task does."""
    guards = []
    try:
        for n in range(count):
            app = TaskIdentity(f"exports_{n}", "export", "manual__2026-11-30T00:00:00+00:00", -1).application_name()
            guard = LockGuard(
                AdvisoryLockHook(dsn=ui_db).database, LockKey.from_name(POOL), LockPolicy(slots=3), application_name=app
            )
            guard.__enter__()
            guards.append(guard)
        yield guards
    finally:
        for guard in guards:
            guard.__exit__(None, None, None)


@pytest.mark.matrix("ui-page", since=UI_PAGE_SINCE)
def test_json_endpoint_shows_pools_and_passes_pool_and_slots_through(api_server: ApiServer, ui_db: str) -> None:
    token = api_server.token()
    with _pool_held(ui_db, 2) as guards:
        status, data = api_server.get("/pglock/api/locks", token)
        assert status == 200, data
        [pool] = data["pools"]  # told nothing: the registry knows the pool and its size
        assert (pool["name"], pool["summary"], pool["slots_source"]) == (POOL, "2 of 3 held", "registry")
        assert [(h["slot"], h["pid"]) for h in sorted(pool["holders"], key=lambda h: h["slot"])] == [
            (1, guards[0].held.server.backend_pid),  # type: ignore[union-attr]
            (2, guards[1].held.server.backend_pid),  # type: ignore[union-attr]
        ]
        assert all(h["airflow"]["dag_id"].startswith("exports_") and "run_url" in h for h in pool["holders"])
        assert len(data["locks"]) == 2 and "pool" not in data

        status, data = api_server.get(f"/pglock/api/locks?pool={POOL}&slots=5", token)  # as the caller says
        assert status == 200, data
        assert data["pool"]["summary"] == "2 of 5 held" and data["pool"]["slots_source"] == "given"
        assert sorted(e["key"]["name"] for e in data["locks"]) == [POOL, f"{POOL}#slot2"]
        status, data = api_server.get("/pglock/api/locks?pool=not-a-pool&slots=2", token)
        assert status == 200 and data["pool"]["summary"] == "0 of 2 held" and data["locks"] == []

        status, data = api_server.get("/pglock/api/locks?slots=3", token)
        assert status == 400 and "slots=3 goes with pool=NAME" in data["detail"]
        status, data = api_server.get(f"/pglock/api/locks?pool={POOL}&slots=0", token)
        assert status == 400 and "slots must be an integer from 1 to 1000, got 0" in data["detail"]
    status, data = api_server.get("/pglock/api/locks", token)
    assert status == 200 and data["pools"] == [] and data["locks"] == []


def _chromium() -> tuple[str, str]:
    """Chromium and its driver for a browser test, which is skipped without them (or selenium)."""
    pytest.importorskip("selenium", reason="the browser test drives Chromium with selenium (test extra)")
    try:
        return find_chromium()
    except BrowserUnavailableError as error:
        pytest.skip(f"no headless browser here: {error}")


def _browser(chromium: str, chromedriver: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in headless_flags(tempfile.mkdtemp(prefix="pglock-chromium-")):
        options.add_argument(flag)
    # An explicit driver path: selenium never tries to download one.
    return webdriver.Chrome(service=Service(chromedriver), options=options)


def _watch_in_browser(
    server: ApiServer, ui_db: str, done: Path, shot: Path, seen: dict[str, Any], browser: tuple[str, str]
) -> None:
    """Log in, open the page, record what it shows, screenshot; then release the task and
    wait for the page to notice by itself. Always releases the task."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver = None
    others: list[psycopg.Connection[Any]] = []
    try:
        deadline = time.monotonic() + 90
        with psycopg.connect(ui_db, autocommit=True) as conn:
            while not conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0]:
                assert time.monotonic() < deadline, "the guarded task never took its lock"
                time.sleep(0.2)
        # Company for the task: a non-Airflow holder of another key, and a job queued behind the task.
        others.append(psycopg.connect(ui_db, autocommit=True, application_name="billing-service"))
        others[-1].execute("SELECT pg_advisory_lock(42)")
        others.append(psycopg.connect(ui_db, autocommit=True, application_name="reporting-job"))
        queued = others[-1]
        threading.Thread(
            target=lambda: queued.execute("SELECT pg_advisory_lock(%s)", LockKey.from_name(KEY).numbers), daemon=True
        ).start()
        driver = _browser(*browser)
        wait = WebDriverWait(driver, 60)
        driver.get(f"{server.url}/")  # not logged in: the UI sends us to its login form
        wait.until(ec.presence_of_element_located((By.NAME, "username"))).send_keys(USER)
        driver.find_element(By.NAME, "password").send_keys(PASSWORD)
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda d: "/auth/login" not in d.current_url)
        driver.get(f"{server.url}/plugin/pglock_locks")  # the page as the UI's Browse menu opens it
        driver.switch_to.frame(wait.until(ec.presence_of_element_located((By.TAG_NAME, "iframe"))))
        link = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "a.run-link")))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#locks tbody tr")) == 3)
        row = link.find_element(By.XPATH, "./ancestor::tr")
        seen["rows"] = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#locks tbody tr")]
        seen.update(link_text=link.text, href=link.get_attribute("href"), row=row.text)
        seen["target"] = link.get_attribute("target")
        driver.switch_to.default_content()
        time.sleep(0.5)
        driver.save_screenshot(str(shot))
        driver.switch_to.frame(driver.find_element(By.TAG_NAME, "iframe"))
        done.touch()  # the task returns and releases its lock; the queued job takes it
        wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "a.run-link"))
        seen["rows_after"] = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#locks tbody tr")]
    except BaseException as error:  # reported by the test thread
        seen["error"] = f"{type(error).__name__}: {error}"
    finally:
        done.touch()
        if driver is not None:
            driver.quit()
        for conn in others:
            conn.close()


def test_page_shows_the_holding_task_in_a_real_browser(
    api_server: ApiServer, ui_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chromium = _chromium()
    done, shot = tmp_path / "browser-done", tmp_path / "ui-locks.png"
    monkeypatch.setenv("PGLOCK_UI_DONE", str(done))
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", dsn_uri(ui_db))
    monkeypatch.setenv("AIRFLOW__PGLOCK__DEPLOYMENT", "ui-deployment")  # the task's lock session names it
    seen: dict[str, Any] = {}
    browser = threading.Thread(
        target=_watch_in_browser, args=(api_server, ui_db, done, shot, seen, chromium), daemon=True
    )
    browser.start()
    try:
        result = run_dag(UI_DAG, "ui_settlement_dag")
    finally:
        done.touch()
        browser.join(120)
    assert "error" not in seen, seen.get("error")
    assert result.state("settle_while_watched") == "success"
    assert seen["link_text"] == "ui_settlement_dag / settle_while_watched"
    quoted_run = urllib.parse.quote(result.run_id, safe="")
    assert seen["href"] == f"{api_server.url}/dags/ui_settlement_dag/runs/{quoted_run}"
    assert seen["target"] == "_top"  # leaves the iframe for the UI's own run page
    assert KEY in seen["row"] and "holding" in seen["row"]
    assert any("reporting-job" in row and "waiting" in row for row in seen["rows"])
    assert any("billing-service" in row and "holding" in row for row in seen["rows"])
    assert "ui-deployment @ " in seen["row"], seen["row"]  # the holder's deployment and host
    # key 42 has no name: its row says why and what to do
    [billing] = [row for row in seen["rows"] if "billing-service" in row]
    assert "name unknown:" in billing and "names are recorded when a hold ends" in billing, billing
    # The page refreshed by itself: the task's row is gone, the queued job now holds the key.
    assert len(seen["rows_after"]) == 2
    assert any("reporting-job" in row and "holding" in row for row in seen["rows_after"])
    assert shot.stat().st_size > 10_000
    keep = os.environ.get("PGLOCK_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, Path(keep) / "ui-locks.png")


def _login_and_open_page(driver: Any, server: ApiServer) -> Any:
    """Log in through the UI's form and open the page as its Browse menu does; inside its iframe."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    # The UI redirects to its login form after it loads: a look-up during that navigation is
    # "aborted by navigation" (a WebDriverException), and is simply tried again.
    wait = WebDriverWait(driver, 60, ignored_exceptions=(WebDriverException,))
    driver.get(f"{server.url}/")
    wait.until(ec.presence_of_element_located((By.NAME, "username"))).send_keys(USER)
    driver.find_element(By.NAME, "password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(lambda d: "/auth/login" not in d.current_url)
    driver.get(f"{server.url}/plugin/pglock_locks")
    driver.switch_to.frame(wait.until(ec.presence_of_element_located((By.TAG_NAME, "iframe"))))
    return wait


def test_page_shows_a_pool_as_one_row_with_its_holders_in_a_real_browser(api_server: ApiServer, ui_db: str) -> None:
    chromium = _chromium()
    from selenium.webdriver.common.by import By

    plain = AdvisoryLockHook(dsn=ui_db).acquire("billing", application_name="billing-service")
    driver = None
    try:
        with _pool_held(ui_db, 2) as guards:
            driver = _browser(*chromium)
            wait = _login_and_open_page(driver, api_server)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#locks tbody tr")) == 2)
            [pool_row] = driver.find_elements(By.CSS_SELECTOR, "#locks tbody tr.pool")
            text = pool_row.text
            rows = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#locks tbody tr")]
            pids = [str(g.held.server.backend_pid) for g in guards]  # type: ignore[union-attr]
    finally:
        if driver is not None:
            driver.quit()
        if plain is not None:
            plain.release()
    assert POOL in text and "pool of 3 slots" in text and "2 of 3 held" in text, text
    assert "slot 1: exports_0 / export" in text and "slot 2: exports_1 / export" in text, text
    assert all(pid in text for pid in pids), text
    assert f"{POOL}#slot2" not in "".join(rows)  # the slot is not a row of its own
    assert any("billing-service" in row and "holding" in row for row in rows), rows


@pytest.mark.matrix("ui-page", since=UI_PAGE_SINCE)
def test_page_shows_no_holder_from_an_earlier_read_once_the_lock_database_cannot_be_read(
    api_server: ApiServer, ui_db: str, pg_server: str
) -> None:
    """The rows of an earlier read stayed up under the error, as if the session still held its
    key (a stopped server holds nothing). Now the table is emptied and the page says since when
    it has no data; it fills again once the database answers."""
    chromium = _chromium()
    from selenium.webdriver.common.by import By

    from tests.helpers import allow_connections

    holder = AdvisoryLockHook(dsn=ui_db).acquire("billing", application_name="billing-service")
    assert holder is not None
    server = psycopg.connect(pg_server, autocommit=True)
    database = psycopg.conninfo.conninfo_to_dict(ui_db)["dbname"]
    driver = None
    try:
        driver = _browser(*chromium)
        wait = _login_and_open_page(driver, api_server)
        rows = lambda d: [r.text for r in d.find_elements(By.CSS_SELECTOR, "#locks tbody tr")]  # noqa: E731
        wait.until(lambda d: any("billing-service" in row for row in rows(d)))
        allow_connections(server, database, False)
        wait.until(lambda d: "Could not read the locks" in d.find_element(By.ID, "error").text)
        during = (rows(driver), driver.find_element(By.ID, "meta").text, driver.find_element(By.ID, "error").text)
        allow_connections(server, database, True)
        wait.until(lambda d: any("billing-service" in row for row in rows(d)))
    finally:
        allow_connections(server, database, True)
        server.close()
        if driver is not None:
            driver.quit()
        holder.release()
    shown, meta, error = during
    assert shown == [], f"rows of an earlier read stayed up: {shown}"
    assert meta.startswith("No current data: the last read failed at"), meta
    assert "not currently accepting connections" in error, error


@pytest.mark.matrix("ui-page", since=UI_PAGE_SINCE)
def test_page_names_a_deferred_task_that_holds_its_key_in_a_real_browser(api_server: ApiServer, ui_db: str) -> None:
    chromium = _chromium()
    from selenium.webdriver.common.by import By

    from airflow_pglock.scope_rules import HandOver, ScopeRole

    # What a guarded deferrable operator's deferral leaves while its trigger waits: the lease row
    # (docs/deferrable-operators.md); the JSON marks it deferred and the page says so.
    key = LockKey.from_name("warehouse/refresh")
    role = ScopeRole(holder="deferred-ui", run="dep-a: warehouse manual__1", task="refresh", lease=300, hands_over=True)
    LockGuard(AdvisoryLockHook(dsn=ui_db).database, key, LockPolicy(), scope=role).run(lambda handle: HandOver(None))
    driver = None
    try:
        status, data = api_server.get("/pglock/api/locks", api_server.token())
        assert status == 200, data
        [scope] = [s for s in data["scopes"] if s["key"]["name"] == "warehouse/refresh"]
        assert scope["deferred"] is True and scope["run"] == "dep-a: warehouse manual__1"
        driver = _browser(*chromium)
        wait = _login_and_open_page(driver, api_server)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#locks tbody tr.scope"))
        [row] = driver.find_elements(By.CSS_SELECTOR, "#locks tbody tr.scope")
        text = row.text
    finally:
        if driver is not None:
            driver.quit()
        with psycopg.connect(ui_db, autocommit=True) as conn:
            conn.execute("DELETE FROM pglock.scopes WHERE holder = 'deferred-ui'")
    assert "warehouse/refresh" in text and "deferred: held by the triggerer" in text, text
    assert "deferred: refresh (deferred, held by the triggerer)" in text and "dep-a: warehouse manual__1" in text, text
