"""The compose files, Prometheus config and Grafana provisioning are valid, and compose runs kvgate
through the same entry points the integration tests start (no Docker engine needed)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import click
import pytest
import yaml

from kvgate.cli import main as kvgate_cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_SETS = [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cpu.yml"]]
# What the integration tests start: `kvgate up` spawns gateway, worker, celery worker and beat
# (kvgate/up.py); tests/integration/test_faults.py starts gateway and worker directly.
TESTED_ENTRY_POINTS = {"gateway", "worker", "celery worker", "celery beat"}
ENV = {"KVGATE_API_KEY": "sk-compose-check", "KVGATE_SECRET": "compose-check-secret"}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run installs it")
        pytest.skip(f"{name} is not installed (apt-get install docker-compose prometheus)")
    return path


def _config(files: list[str]) -> dict:
    """The merged, interpolated configuration, as docker-compose itself resolves it."""
    args = [a for f in files for a in ("-f", f)]
    out = subprocess.run([_tool("docker-compose"), *args, "config"], cwd=ROOT, env={**os.environ, **ENV},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["gpu", "cpu"])
def test_docker_compose_config_accepts_the_files(files):
    args = [a for f in files for a in ("-f", f)]
    out = subprocess.run([_tool("docker-compose"), *args, "config", "-q"], cwd=ROOT,
                         env={**os.environ, **ENV}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _kvgate_services(config: dict) -> dict[str, dict]:
    return {name: svc for name, svc in config["services"].items()
            if str(svc.get("image", "")).startswith("kvgate") and "entrypoint" not in svc}


def _subcommand(command: list[str]) -> tuple[str, click.Command, list[str]]:
    """('celery worker', the click command, the arguments after it) from a compose command."""
    cmd = kvgate_cli.commands[command[0]]
    if command[0] == "celery":
        return f"celery {command[1]}", cmd, command[2:]
    return command[0], cmd, command[1:]


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["gpu", "cpu"])
def test_compose_runs_the_entry_points_the_tests_start(files):
    services = _kvgate_services(_config(files))
    seen = set()
    for name, svc in services.items():
        command = svc["command"]
        entry, cmd, rest = _subcommand(command)
        assert entry in TESTED_ENTRY_POINTS, f"service {name} runs `kvgate {entry}`, which no test starts"
        seen.add(entry)
        if entry.startswith("celery"):
            continue  # its arguments go to Celery itself
        options = {opt for p in cmd.params for opt in p.opts}
        for arg in rest:
            if arg.startswith("--"):
                assert arg.split("=")[0] in options, f"service {name}: `kvgate {entry}` has no {arg}"
    assert seen == TESTED_ENTRY_POINTS


def test_worker_reserves_a_gpu_and_the_cpu_variant_does_not():
    gpu = _config(COMPOSE_SETS[0])["services"]
    devices = gpu["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices and "gpu" in devices[0]["capabilities"]
    cpu = _config(COMPOSE_SETS[1])["services"]
    assert cpu["worker"].get("profiles") == ["gpu"], "the GPU worker must be off on a CPU machine"
    assert "deploy" not in cpu["worker-cpu"]
    assert "worker" in cpu["worker-cpu"]["networks"]["default"]["aliases"]  # Prometheus finds it
    assert cpu["worker-cpu"]["command"][1:] == cpu["worker"]["command"][1:]


def test_services_wait_for_what_they_need():
    services = _config(COMPOSE_SETS[0])["services"]
    for name in ("redis", "gateway", "worker", "celery-worker", "prometheus", "grafana"):
        assert "healthcheck" in services[name], f"{name} has no healthcheck"
    for name in ("gateway", "worker", "celery-worker", "celery-beat"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert any(v.endswith(":/models") or ":/models:" in v for v in services["worker"]["volumes"])
    assert services["gateway"]["environment"]["KVGATE_OTLP_ENDPOINT"].startswith("http://otel-collector:")
    for name in ("prometheus", "grafana", "otel-collector", "jaeger"):
        assert name in services


ONE_SHOT = {"model-init"}  # runs once and exits: restarting it would redo finished work


def _raw_services(files: list[str]) -> dict[str, dict]:
    """The files' services merged key by key, as compose merges an override (no Docker needed)."""
    merged: dict[str, dict] = {}
    for f in files:
        for name, svc in yaml.safe_load((ROOT / f).read_text())["services"].items():
            merged[name] = {**merged.get(name, {}), **svc}
    return merged


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["gpu", "cpu"])
def test_every_long_running_service_restarts_when_it_dies(files):
    services = _raw_services(files)
    assert ONE_SHOT <= set(services)
    for name, svc in services.items():
        if name in ONE_SHOT:
            assert svc.get("restart", "no") == "no", f"{name} runs once: no restart policy"
        else:
            assert svc.get("restart") == "unless-stopped", f"{name} has no restart policy"


def test_prometheus_config_and_rules_pass_promtool():
    promtool = _tool("promtool")
    for args in (["check", "config", "ops/prometheus/prometheus.yml"],
                 ["check", "rules", "ops/prometheus/alerts.yml"]):
        out = subprocess.run([promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


def test_grafana_provisioning_finds_the_dashboards():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("./"))
    provider = yaml.safe_load((ROOT / "ops/grafana/provisioning/dashboards/kvgate.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts["./ops/grafana/dashboards"] == path
    assert mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    sources = yaml.safe_load((ROOT / "ops/grafana/provisioning/datasources/kvgate.yml").read_text())
    uids = {d["uid"] for d in sources["datasources"]}
    titles = set()
    for f in sorted((ROOT / "ops/grafana/dashboards").glob("*.json")):
        board = json.loads(f.read_text())
        titles.add(board["title"])
        assert {v["name"] for v in board["templating"]["list"]} >= {"model", "version"}
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] in uids
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])
    assert titles == {"kvgate / Gateway", "kvgate / Engine"}
