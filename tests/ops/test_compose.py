"""The compose files, Prometheus config and Grafana provisioning are valid, and compose runs kvgate
through the same entry points the integration tests start (no Docker engine needed)."""
from __future__ import annotations

import json
import os
import shutil
import sys
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
# no secret exported: secrets-init makes them (a fresh clone's `docker compose up` just works)
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
ONE_SHOT = {"model-init", "secrets-init", "tls-init"}  # run once and exit: no restart policy
PUBLISHED = {"gateway", "grafana", "prometheus", "gateway-tls"}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run installs it")
        pytest.skip(f"{name} is not installed (apt-get install docker-compose prometheus)")
    return path


def _config(files: list[str], profile: str | None = None) -> dict:
    """The merged, interpolated configuration, as docker-compose itself resolves it."""
    args = [a for f in files for a in ("-f", f)] + (["--profile", profile] if profile else [])
    out = subprocess.run([_tool("docker-compose"), *args, "config"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["gpu", "cpu"])
def test_docker_compose_config_accepts_the_files(files):
    args = [a for f in files for a in ("-f", f)]
    out = subprocess.run([_tool("docker-compose"), *args, "config", "-q"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _kvgate_services(config: dict) -> dict[str, dict]:
    return {name: svc for name, svc in config["services"].items()
            if str(svc.get("image", "")).startswith("kvgate") and name not in ONE_SHOT}


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


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["gpu", "cpu"])
def test_every_long_running_service_has_a_memory_limit(files):
    for name, svc in _config(files)["services"].items():
        if name not in ONE_SHOT:
            assert svc.get("mem_limit"), f"{name} has no memory limit"


def test_only_the_gateway_grafana_and_prometheus_are_published_and_on_loopback():
    for name, svc in _config(COMPOSE_SETS[1], profile="tls")["services"].items():
        for port in svc.get("ports", []):
            assert name in PUBLISHED, f"{name} publishes {port}"
            published = port if isinstance(port, str) else f"{port['host_ip']}:{port['published']}"
            assert published.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_redis_requires_the_generated_password_and_never_evicts():
    services = _config(COMPOSE_SETS[0])["services"]
    command = services["redis"]["command"]
    assert command[:2] == ["redis-server", "/secrets/redis.conf"]  # requirepass, from secrets-init
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert services["secrets-init"]["command"][:2] == ["init-secrets", "/secrets"]
    for name in ("redis", "gateway", "worker", "celery-worker", "celery-beat"):
        assert services[name]["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"
        if name != "redis":  # kvgate reads KVGATE_REDIS_URL (with the password) from the volume
            assert services[name]["environment"]["KVGATE_SECRETS_DIR"] == "/secrets"
            assert "KVGATE_REDIS_URL" not in services[name]["environment"]


def test_one_shot_services_run_kvgate_commands_that_exist():
    services = _config(COMPOSE_SETS[0], profile="tls")["services"]
    for name in ("secrets-init", "tls-init"):
        command = services[name]["command"]
        cmd = kvgate_cli.commands[command[0]]
        options = {opt for p in cmd.params for opt in p.opts}
        assert all(a in options for a in command[1:] if a.startswith("--")), command


def test_tls_profile_serves_https_with_the_certificate_tls_init_makes():
    services = _config(COMPOSE_SETS[1], profile="tls")["services"]
    init, gateway = services["tls-init"], services["gateway-tls"]
    assert init["profiles"] == gateway["profiles"] == ["tls"]
    hosts = [init["command"][i + 1] for i, a in enumerate(init["command"]) if a == "--host"]
    assert {"localhost", "127.0.0.1", "gateway-tls"} <= set(hosts)
    command = gateway["command"]
    assert command[command.index("--ssl-certfile") + 1] == "/certs/server.pem"
    assert command[command.index("--ssl-keyfile") + 1] == "/certs/server.key"
    assert gateway["depends_on"]["tls-init"]["condition"] == "service_completed_successfully"
    assert gateway["healthcheck"]["test"][1:] == ["python3", "-m", "kvgate.probe",
                                                  "https://localhost:8443/readyz",
                                                  "--cafile", "/certs/ca.pem"]


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["gpu", "cpu"])
def test_healthchecks_hold_no_argument_with_a_space(files):
    """podman's Docker API splits a CMD healthcheck's arguments at spaces: `python3 -c "import
    ..."` would run as `python3 -c import`. CMD-SHELL (one string, for sh) is not split."""
    for name, svc in _config(files)["services"].items():
        test = svc.get("healthcheck", {}).get("test", [])
        if test and test[0] == "CMD":
            assert not any(" " in arg for arg in test[1:]), f"{name}: {test}"


def test_init_secrets_writes_each_secret_once_and_processes_read_them(tmp_path):
    folder = tmp_path / "secrets"
    first = subprocess.run([sys.executable, "-m", "kvgate", "init-secrets", str(folder)], env=ENV,
                           capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    values = {p.name: p.read_text() for p in folder.iterdir()}
    assert set(values) >= {"KVGATE_SECRET", "KVGATE_ADMIN_KEY", "KVGATE_API_KEY", "KVGATE_REDIS_URL",
                           "redis.conf"}
    for name in ("KVGATE_SECRET", "KVGATE_ADMIN_KEY", "KVGATE_API_KEY", "KVGATE_REDIS_URL"):
        assert (folder / name).stat().st_mode & 0o077 == 0, f"{name} is readable by others"
    password = values["redis.conf"].split()[1]
    assert f":{password}@redis:6379/" in values["KVGATE_REDIS_URL"]
    again = subprocess.run([sys.executable, "-m", "kvgate", "init-secrets", str(folder)], env=ENV,
                           capture_output=True, text=True, timeout=60)
    assert "already" in again.stdout
    assert {p.name: p.read_text() for p in folder.iterdir()} == values  # idempotent: keys stay valid
    # every kvgate command loads them before reading its options; a variable that is set wins
    probe = ("import os\nfrom kvgate.cli import main\ntry:\n    main(['worker', '--help'])\n"
             "except SystemExit:\n    pass\nprint(os.environ['KVGATE_REDIS_URL'], "
             "os.environ['KVGATE_API_KEY'], os.environ['KVGATE_ADMIN_KEY'])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**ENV, "KVGATE_SECRETS_DIR": str(folder), "KVGATE_ADMIN_KEY": "sk-by-hand"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == [values["KVGATE_REDIS_URL"].strip(),
                                       values["KVGATE_API_KEY"].strip(), "sk-by-hand"]
