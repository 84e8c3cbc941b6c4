"""docker-compose.yml refers to real things (there is no Docker engine here to run it).

Parsed as YAML (anchors and merge keys resolved as Compose does), then checked: services,
images and build contexts, the Dockerfile and what it copies, mounted paths, the hosts
and databases in connection URIs, depends_on targets and conditions, host ports, and the
commands each container runs (against Airflow's and airflow-pglock's real CLI parsers).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ROLES = ("api-server", "scheduler", "dag-processor", "triggerer")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def _deployments(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """deployment prefix -> {role: service name}, from the service names ``<d>-<role>``."""
    found: dict[str, dict[str, str]] = {}
    for name, service in services.items():
        command = _command(service)
        if command and command[0] in ROLES and "-" in name:
            found.setdefault(name.split("-", 1)[0], {})[command[0]] = name
    return found


def _init_sql(services: dict[str, dict[str, Any]], service: str) -> str:
    """The SQL mounted into a postgres service's /docker-entrypoint-initdb.d."""
    texts = []
    for volume in services[service].get("volumes", []):
        host, container = str(volume).split(":")[:2]
        if container.startswith("/docker-entrypoint-initdb.d/"):
            texts.append((ROOT / host).read_text())
    return "\n".join(texts)


def test_services_images_and_builds(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert "image" in service or "build" in service, f"{name}: neither image nor build"
        build = service.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), f"{name}: build context {context} does not exist"
            dockerfile = context / (build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        image = str(service.get("image", ""))
        assert re.fullmatch(r"[a-z0-9][a-z0-9._/-]*(:[\w.-]+)?", image), f"{name}: bad image reference {image!r}"


def test_dockerfile_copies_real_paths_and_matches_the_constraints() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    copies = re.findall(r"^COPY\s+(?:--\S+\s+)*(.+)\s+\S+$", dockerfile, re.MULTILINE)
    assert copies, "the Dockerfile copies nothing"
    for sources in copies:
        for source in sources.split():
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
    for path in re.findall(r"/opt/airflow-pglock/(constraints/[\w.-]+\.txt)", dockerfile):
        assert (ROOT / path).is_file(), f"Dockerfile uses {path}, which does not exist"
    base = re.search(r"apache/airflow:(\d+\.\d+\.\d+)-python(\d+\.\d+)", dockerfile)
    assert base, "the Dockerfile does not start from an apache/airflow image"
    pinned = re.search(r"^apache-airflow==(\S+)$", (ROOT / "constraints/airflow-3.3.txt").read_text(), re.MULTILINE)
    assert pinned and pinned[1] == base[1], f"image Airflow {base[1]} vs constraints {pinned[1] if pinned else None}"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv*" in ignored and ".git" in ignored  # a small build context


def test_mounted_paths_exist(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for volume in service.get("volumes", []):
            host = str(volume).split(":")[0]
            assert host.startswith("./"), f"{name}: {volume} is not a path in this repository"
            assert (ROOT / host).exists(), f"{name}: mounts {host}, which does not exist"


def test_depends_on_and_ports(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        depends = service.get("depends_on", {})
        targets = depends.items() if isinstance(depends, dict) else ((t, {}) for t in depends)
        for target, options in targets:
            assert target in services, f"{name} depends on {target!r}, which is not a service"
            condition = (options or {}).get("condition", "service_started")
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy: no healthcheck"
            elif condition == "service_completed_successfully":
                assert services[target].get("restart") == "no", f"{target} is awaited to complete, yet restarts"
            else:
                assert condition == "service_started", f"{name}: unknown condition {condition!r}"
    host_ports = [str(p).split(":")[0] for s in services.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), f"host ports clash: {host_ports}"


def test_connection_uris_point_at_services_databases_and_roles(services: dict[str, dict[str, Any]]) -> None:
    created: dict[str, str] = {}
    for name in services:
        sql = _init_sql(services, name)
        for database in re.findall(r"CREATE DATABASE (\w+)", sql):
            created[database] = name
        for role in re.findall(r"CREATE ROLE (\w+)", sql):
            created[f"role:{role}"] = name
    for name, service in services.items():
        env = _env(service)
        postgres_env = env.get("POSTGRES_USER", "postgres")
        if "POSTGRES_PASSWORD" in env:
            created[f"role:{postgres_env}"] = name
            created[postgres_env] = name  # the image creates a database named after the user
        for variable, value in env.items():
            for uri in re.findall(r"\b[a-z][\w+]*://\S+", value):
                parts = urlsplit(uri)
                assert parts.hostname in services, f"{name}: {variable} points at {parts.hostname!r}, not a service"
                if parts.scheme.startswith("postgres"):
                    database = parts.path.lstrip("/")
                    assert created.get(database) == parts.hostname, f"{name}: {variable}: no database {database!r}"
                    assert created.get(f"role:{parts.username}") == parts.hostname, f"{name}: no role {parts.username}"
                    assert parts.port == 5432  # the container port, not the published one
                elif parts.scheme == "http":
                    assert parts.port == 8080 and _command(services[parts.hostname]) == ["api-server"]


def test_two_deployments_share_only_the_lock_database(services: dict[str, dict[str, Any]]) -> None:
    deployments = _deployments(services)
    assert set(deployments) == {"a", "b"}
    for prefix, roles in deployments.items():
        assert set(roles) == set(ROLES), f"deployment {prefix}: {sorted(roles)}"
    env = {prefix: _env(services[roles["scheduler"]]) for prefix, roles in deployments.items()}
    assert env["a"]["AIRFLOW_CONN_POSTGRES_DEFAULT"] == env["b"]["AIRFLOW_CONN_POSTGRES_DEFAULT"]
    for variable in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CORE__EXECUTION_API_SERVER_URL"):
        assert env["a"][variable] != env["b"][variable], variable
    for variable in ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
        assert env["a"][variable] != env["b"][variable], f"{variable} must differ between deployments"
    for prefix, roles in deployments.items():
        # Within a deployment every process agrees on the metadata DB, the API and the JWT secret.
        values = {tuple(sorted(_env(services[s]).items())) for s in roles.values()}
        assert len(values) == 1, f"deployment {prefix}: processes disagree on their environment"
        url = urlsplit(env[prefix]["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
        assert url.hostname == roles["api-server"]
        for service in roles.values():
            volumes = services[service].get("volumes", [])
            assert any(str(v).startswith("./dags:/opt/airflow/dags") for v in volumes), f"{service}: no dags/"
            assert services[service].get("build"), f"{service} does not run the image with the provider"


def test_commands_exist_in_the_real_clis(services: dict[str, dict[str, Any]]) -> None:
    from airflow_pglock.cli.main import build_parser
    from airflow_pglock.compat import AIRFLOW_V_3_PLUS

    if not AIRFLOW_V_3_PLUS:
        pytest.skip("the compose stack runs Airflow 3.3 (api-server); its commands are checked on Airflow 3")
    from airflow.cli.cli_parser import get_parser

    airflow_parser, pglock_parser = get_parser(), build_parser()
    checked = 0
    for name, service in services.items():
        command = _command(service)
        if not command or "build" not in service:  # postgres images run their own entrypoint
            continue
        parser, args = (pglock_parser, command[1:]) if command[0] == "airflow-pglock" else (airflow_parser, command)
        try:
            parser.parse_args(args)
        except SystemExit:  # argparse exits on an unknown command or option
            pytest.fail(f"{name}: {command} is not a valid command")
        checked += 1
    assert checked == 11  # lock-db-init, and init + 4 processes per deployment
