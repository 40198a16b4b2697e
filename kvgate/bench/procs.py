"""The servers `make bench` starts: kvgate stacks (`kvgate up`), the bare baseline server, the
LiteLLM proxy (from a venv of its own, never the project's) and Portkey's gateway (Node, from a
folder of its own; see kvgate/bench/portkey.py). Each child runs in its own session and
is stopped through its own process group, so nothing else on the machine is touched."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvgate.bench import portkey
from shared.redis_server import free_port

LITELLM_SPEC = "litellm[proxy]==1.108.7"
LIMIT_RPM = 1_000_000  # both gateways enforce a limit this high: counted on every request, never hit
LIMIT_TPM = 1_000_000_000


@dataclass
class Server:
    name: str
    url: str
    key: str | None
    proc: subprocess.Popen
    headers: dict = field(default_factory=dict)  # sent with every request


class Processes:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.children: list[subprocess.Popen] = []

    def spawn(self, name: str, args: list[str], env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                cwd=cwd, start_new_session=True)
        self.children.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc in self.children:
            self.children.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.children)):
            self.stop(proc)

    def wait_http(self, proc: subprocess.Popen, url: str, name: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.log_dir / name}.log")
            try:
                if httpx.get(url, timeout=2).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{name} not ready after {timeout_s:.0f}s; see {self.log_dir / name}.log")

    # -- the servers ------------------------------------------------------------------------
    def kvgate(self, name: str, model_dir: Path, engine: str, env: dict | None = None) -> Server:
        """`kvgate up` (Redis, one worker, one gateway process) and a key with rpm/tpm limits."""
        state = self.log_dir / name
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir(parents=True)
        proc = self.spawn(name, [sys.executable, "-m", "kvgate", "up", "--model", str(model_dir), "--port", "0",
                                 "--state-dir", str(state), "--engine", engine, "--served-name", "demo"], env)
        deadline = time.monotonic() + 300
        while not (state / "dev.key").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvgate up ({name}) did not start; see {self.log_dir / name}.log")
            time.sleep(0.2)
        url = (state / "gateway.url").read_text().strip()
        return Server(name, url, create_key(url, (state / "admin.key").read_text().strip()), proc)

    def baseline(self, model_dir: Path) -> Server:
        port, key = free_port(), "sk-base-" + secrets.token_hex(8)
        proc = self.spawn("baseline", [sys.executable, "-m", "kvgate.bench.baseline", "--model", str(model_dir),
                                       "--port", str(port)], {"KVGATE_BASELINE_API_KEY": key})
        url = f"http://127.0.0.1:{port}"
        self.wait_http(proc, url + "/healthz", "baseline")
        return Server("baseline", url, key, proc)

    def litellm(self, venv: Path, upstream: Server, served_name: str) -> Server:
        """LiteLLM's proxy in front of `upstream`: master key (auth) and a deployment rpm/tpm limit,
        enforced in memory by the `enforce_model_rate_limits` pre-call check (key-level limits
        would need its Postgres)."""
        port, key = free_port(), "sk-litellm-" + secrets.token_hex(8)
        config = self.log_dir / "litellm.yaml"
        config.write_text(LITELLM_CONFIG.format(name=served_name, api_base=upstream.url + "/v1",
                                                api_key=upstream.key, rpm=LIMIT_RPM, tpm=LIMIT_TPM, master_key=key))
        proc = self.spawn("litellm", [str(venv / "bin" / "litellm"), "--config", str(config), "--port", str(port),
                                      "--num_workers", "1"], {"LITELLM_LOG": "ERROR"}, cwd=self.log_dir)
        url = f"http://127.0.0.1:{port}"
        self.wait_http(proc, url + "/health/liveliness", "litellm")
        return Server("litellm", url, key, proc)

    def portkey(self, folder: Path, upstream: Server, served_name: str) -> Server:
        """Portkey's gateway in front of `upstream`; its config (and the upstream's key) travel in
        a header on every request, as the open-source gateway takes them."""
        port = free_port()
        proc = self.spawn("portkey", portkey.command(folder, port), {"NODE_ENV": "production"}, cwd=folder)
        url = f"http://127.0.0.1:{port}"
        self.wait_http(proc, url + "/", "portkey")
        return Server("portkey", url, None, proc, portkey.config_header(upstream.url, upstream.key, served_name))


LITELLM_CONFIG = """\
model_list:
  - model_name: {name}
    litellm_params:
      model: text-completion-openai/synthetic
      api_base: {api_base}
      api_key: {api_key}
      rpm: {rpm}
      tpm: {tpm}
router_settings:
  optional_pre_call_checks: ["enforce_model_rate_limits"]
litellm_settings:
  drop_params: true
general_settings:
  master_key: {master_key}
"""


def create_key(url: str, admin_key: str) -> str:
    """A key of its own for the benchmark, with rpm and tpm set (so the limit code runs)."""
    resp = httpx.post(f"{url}/admin/keys", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30,
                      json={"name": "bench-" + secrets.token_hex(4), "rpm": LIMIT_RPM, "tpm": LIMIT_TPM})
    resp.raise_for_status()
    return resp.json()["secret"]


def ensure_litellm(venv: Path) -> Path | None:
    """A venv with LiteLLM's proxy, made once (it is never a project dependency); None if it
    cannot be installed here."""
    stamp = venv / ".installed"
    if stamp.exists() and stamp.read_text().strip() == LITELLM_SPEC:
        return venv
    print(f"installing {LITELLM_SPEC} into {venv} (once) ...", flush=True)
    log = venv.with_suffix(".install.log")
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        ok = subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], stdout=out, stderr=out).returncode == 0
        ok = ok and subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LITELLM_SPEC],
                                   stdout=out, stderr=out).returncode == 0
    if not ok:
        print(f"could not install LiteLLM (see {log}); its comparison is skipped", flush=True)
        return None
    stamp.write_text(LITELLM_SPEC + "\n")
    return venv
