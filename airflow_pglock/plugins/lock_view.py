"""The "Advisory locks" page of the Airflow UI (Airflow >= 3.1), behind Airflow's authentication.

A FastAPI app mounted by the API server at ``/pglock`` (``fastapi_apps``) serves

* ``/pglock/locks``: the page (an ``external_views`` entry shows it in the UI's
  *Browse* menu, inside the UI);
* ``/pglock/api/locks?conn_id=&dag=&key=&pool=&slots=``: the same JSON as
  ``airflow-pglock locks --output json`` (``pool`` and ``slots``: as ``--pool`` and ``--slots``).

Both need a logged-in user allowed to see the cluster-activity view
(``AccessView.CLUSTER_ACTIVITY``: Airflow's viewers and up); the browser's Airflow session
cookie is enough, API clients send ``Authorization: Bearer <token>``. The page reads only
the connections listed in ``[pglock] ui_conn_ids`` (comma-separated, default
``postgres_default``); a request for another conn id is refused.

Nothing heavy is imported when plugins load (task processes load plugins too): the
FastAPI app and Airflow's security dependencies are built on the first request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from airflow.configuration import conf
from airflow.plugins_manager import AirflowPlugin

from airflow_pglock.compat import HAS_UI_PAGE
from airflow_pglock.hooks import DEFAULT_CONN_ID

URL_PREFIX = "/pglock"
DEFAULT_REFRESH_SECONDS = 5
LOCK_ICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" stroke="currentColor" '
    'stroke-width="2" stroke-linecap="round" stroke-linejoin="round"><rect x="4" y="11" width="16" height="10" '
    'rx="2"/><path d="M8 11V7a4 4 0 0 1 8 0v4"/></svg>'
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def ui_base_path() -> str:
    """The path the Airflow UI is served under (``[api] base_url``), with a trailing ``/``."""
    from urllib.parse import urlparse

    base_url = conf.get("api", "base_url", fallback="/") or "/"
    path = urlparse(base_url).path if base_url.startswith(("http://", "https://")) else base_url
    return path.rstrip("/") + "/"


def ui_conn_ids() -> list[str]:
    """The connections the page may read: ``[pglock] ui_conn_ids``, comma-separated."""
    raw = conf.get("pglock", "ui_conn_ids", fallback=DEFAULT_CONN_ID) or DEFAULT_CONN_ID
    return [part.strip() for part in raw.split(",") if part.strip()] or [DEFAULT_CONN_ID]


def refresh_seconds() -> int:
    """Seconds between two refreshes of the page: ``[pglock] ui_refresh_seconds`` (default 5, min 1)."""
    try:
        return max(1, int(conf.getint("pglock", "ui_refresh_seconds", fallback=DEFAULT_REFRESH_SECONDS)))
    except ValueError:
        return DEFAULT_REFRESH_SECONDS


def create_app() -> Any:
    """The FastAPI app (built on the first request by :class:`LazyApp`)."""
    import psycopg
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import requires_access_view
    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.responses import HTMLResponse, Response

    from airflow_pglock.compat import use_server_connections
    from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError, LockConnectionError, PgLockError
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.lock_report import collect_lock_report
    from airflow_pglock.plugins.page import render_page

    use_server_connections()
    app = FastAPI(title="airflow-pglock: advisory locks", docs_url=None, redoc_url=None, openapi_url=None)
    authorized = [Depends(requires_access_view(AccessView.CLUSTER_ACTIVITY))]

    @app.get("/locks", response_class=HTMLResponse, dependencies=authorized)
    def page() -> HTMLResponse:
        return HTMLResponse(
            render_page(conn_ids=ui_conn_ids(), refresh_seconds=refresh_seconds()),
            headers={"Cache-Control": "no-store"},
        )

    @app.get("/api/locks", dependencies=authorized)
    def locks(
        conn_id: str | None = None,
        dag: str | None = None,
        key: str | None = None,
        pool: str | None = None,
        slots: int = 1,
    ) -> dict[str, Any]:
        allowed = ui_conn_ids()
        chosen = conn_id or allowed[0]
        if chosen not in allowed:
            raise HTTPException(
                status_code=400,
                detail=f"conn_id {chosen!r} is not one of [pglock] ui_conn_ids ({', '.join(allowed)})",
            )
        if slots != 1 and not pool:
            raise HTTPException(status_code=400, detail=f"slots={slots} goes with pool=NAME (the pool's key name)")
        try:
            report = collect_lock_report(
                AdvisoryLockHook(chosen), dag=dag or None, key=key or None, pool=pool or None, slots=slots
            )
        except (LockConfigurationError, InvalidLockKeyError) as error:
            raise HTTPException(status_code=400, detail=str(error)) from None
        except LockConnectionError as error:
            raise HTTPException(status_code=503, detail=str(error)) from None
        except (PgLockError, psycopg.Error) as error:  # e.g. a statement_timeout: the page says which
            detail = f"the lock database refused the read ({type(error).__name__}: {str(error).strip()})"
            raise HTTPException(status_code=503, detail=detail) from None
        data = report.to_json()
        data["conn_id"] = chosen
        base = ui_base_path()
        add_run_urls(data["locks"], base)
        for usage in data["pools"] + ([data["pool"]] if "pool" in data else []):
            add_run_urls(usage["holders"] + usage["waiting"], base)
        return data

    @app.get("/static/lock.svg")
    def icon() -> Response:  # public: the UI shows it in the menu
        return Response(LOCK_ICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    return app


def add_run_urls(entries: list[dict[str, Any]], ui_base: str) -> None:
    """Give each Airflow holder a ``run_url``: its DAG run in this Airflow UI (None if unknown).

    A long DAG, task or run id is shortened in the application_name (PostgreSQL keeps 63
    bytes; the shortened part ends with ``~``). Such a prefix is looked up in this deployment's
    metadata database; when exactly one DAG / run matches, the entry gets the full ids and
    the link; a shortened run id ends with the digest of the full one, which picks the run
    among the DAG's unfinished runs. A holder of another named deployment (its
    application_name names a deployment other than this one's ``[pglock] deployment``)
    gets no link: its run is not in this metadata database.

    :param entries: the ``locks`` of a report's JSON; changed in place.
    :param ui_base: the UI's base path (see :func:`ui_base_path`).
    """
    from urllib.parse import quote

    from airflow_pglock.compat import deployment_name
    from airflow_pglock.identity import name_token

    here = deployment_name()
    resolved: dict[tuple[str, str], tuple[str, str] | None] = {}
    for entry in entries:
        holder = entry.get("airflow")
        entry["run_url"] = None
        if not holder:
            continue
        deployment = entry.get("deployment")
        if deployment and deployment != entry.get("host") and (here is None or deployment != name_token(here)):
            continue  # another (named) deployment's run: this deployment is unnamed, or named otherwise
        ids = (holder["dag_id"], holder["run_id"])
        if ids not in resolved:
            resolved[ids] = _full_run_ids(*ids)
        full = resolved[ids]
        if full is not None:
            holder["dag_id"], holder["run_id"] = full  # shortened ids completed
            holder["task_id"] = _full_task_id(full[0], full[1], holder["task_id"])
            entry["run_url"] = f"{ui_base}dags/{quote(full[0], safe='')}/runs/{quote(full[1], safe='')}"


def _full_task_id(dag_id: str, run_id: str, task_id: str) -> str:
    """A shortened task id (``~``) completed from the run's task instances when one matches."""
    if not task_id.endswith("~"):
        return task_id
    try:
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            found = session.scalars(
                select(TaskInstance.task_id)
                .where(
                    TaskInstance.dag_id == dag_id,
                    TaskInstance.run_id == run_id,
                    TaskInstance.task_id.startswith(task_id[:-1], autoescape=True),
                )
                .distinct()
                .limit(2)
            ).all()
    except Exception:  # a convenience, as the link: never fail the page for it
        return task_id
    return found[0] if len(found) == 1 else task_id


def _full_run_ids(dag_id: str, run_id: str) -> tuple[str, str] | None:
    from airflow_pglock.identity import RUN_DIGEST_CHARS, TRUNCATION_MARK, run_digest

    mark = TRUNCATION_MARK
    kept, _, digest = run_id.rpartition(mark)
    digested = bool(kept) and len(digest) == RUN_DIGEST_CHARS and all(c in "0123456789abcdef" for c in digest)
    if not dag_id.endswith(mark) and mark not in run_id:
        return dag_id, run_id
    try:
        from airflow.models.dag import DagModel
        from airflow.models.dagrun import DagRun
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            if dag_id.endswith(mark):
                dags = session.scalars(
                    select(DagModel.dag_id).where(DagModel.dag_id.startswith(dag_id[:-1], autoescape=True)).limit(2)
                ).all()
                if len(dags) != 1:
                    return None
                dag_id = dags[0]
            if digested:  # a shortened run id ends with the digest of the full one: the runs of the DAG
                # that can hold a lock now (not finished) are few; find the one with that digest
                candidates = session.scalars(
                    select(DagRun.run_id).where(DagRun.dag_id == dag_id, DagRun.end_date.is_(None))
                ).all()
                runs = [run for run in candidates if run_digest(run) == digest]
                if len(runs) != 1:
                    return None
                run_id = runs[0]
            elif run_id.endswith(mark):  # a session of an older provider version: a prefix
                runs = session.scalars(
                    select(DagRun.run_id)
                    .where(DagRun.dag_id == dag_id, DagRun.run_id.startswith(run_id[:-1], autoescape=True))
                    .limit(2)
                ).all()
                if len(runs) != 1:
                    return None
                run_id = runs[0]
    except Exception:  # the link is a convenience: never fail the page for it
        return None
    return dag_id, run_id


class LazyApp:
    """An ASGI app that builds the real one on its first request (keeps plugin loading light)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._app: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is None:
            self._app = self._factory()
        await self._app(scope, receive, send)


def _external_views() -> list[dict[str, Any]]:
    base = ui_base_path()
    return [
        {
            "name": "Advisory locks",
            "href": f"{base}{URL_PREFIX.lstrip('/')}/locks",
            "destination": "nav",
            "category": "browse",
            "url_route": "pglock_locks",
            "icon": f"{base}{URL_PREFIX.lstrip('/')}/static/lock.svg",
        }
    ]


class PgLockPlugin(AirflowPlugin):
    """Registers the advisory-lock page (through the provider's ``plugins`` entry and ``airflow.plugins``).

    Empty before Airflow 3.1 (no ``external_views`` there): the page is absent, the CLI and
    the API stay available.
    """

    name = "pglock"
    if HAS_UI_PAGE:
        fastapi_apps = [{"app": LazyApp(create_app), "url_prefix": URL_PREFIX, "name": "airflow-pglock advisory locks"}]
        external_views = _external_views()
