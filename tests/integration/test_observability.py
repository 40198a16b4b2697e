"""Operability against live data: the stack (`kvgate up`, the gateway in two processes) scraped by a
real Prometheus; every dashboard panel and alert rule evaluated through Prometheus' HTTP API; the
counters equal what was sent whichever process served it; logs are JSON with request ids and no
prompt; one trace spans gateway and worker.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from shared.redis_server import free_port
from tests.conftest import start_stack, stop_stack

ROOT = Path(__file__).resolve().parents[2]
MARKER = "zebra-quartz-observability-prompt"  # must never reach a log
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__range": "5m", "$model": "demo", "$version": "v1"}
N_STREAMS, N_PLAIN = 6, 4
GPU_ONLY = "kvgate_gpu_memory_"  # series only a worker on a GPU exports (tests/ops/test_alert_rules.py)


def _prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing: .ci/run installs it")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return path


class Obs:
    def __init__(self, stack, prometheus_url: str, admin_key: str, spans: list[dict]):
        self.stack, self.prom, self.admin_key, self.spans = stack, prometheus_url, admin_key, spans
        self.sent: dict[tuple[str, str], int] = defaultdict(int)  # (route, status) -> requests

    def query(self, expr: str) -> dict:
        resp = httpx.get(self.prom + "/api/v1/query", params={"query": expr}, timeout=10)
        return resp.json()


def _start_prometheus(root: Path, gateway: str, worker_metrics: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    worker = httpx.URL(worker_metrics)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ROOT / "ops/prometheus/alerts.yml")],
        "scrape_configs": [  # the job names of ops/prometheus/prometheus.yml
            {"job_name": "kvgate-gateway", "static_configs": [{"targets": [httpx.URL(gateway).netloc.decode()]}]},
            {"job_name": "kvgate-worker", "metrics_path": worker.path,
             "static_configs": [{"targets": [worker.netloc.decode()]}]}]}
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(root / "prometheus.log", "ab")
    proc = subprocess.Popen([_prometheus_binary(), f"--config.file={root / 'prometheus.yml'}",
                             f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, (root / "prometheus.log").read_text()[-3000:]
        try:
            if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("prometheus did not become ready")


def _start_otlp_receiver() -> tuple[ThreadingHTTPServer, list[dict]]:
    """A stand-in for the collector: takes OTLP/HTTP trace exports, keeps the spans."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            export = ExportTraceServiceRequest()
            export.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            for rs in export.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
                spans.extend({"service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                              "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                              "attrs": {a.key: a.value.string_value for a in s.attributes}}
                             for ss in rs.scope_spans for s in ss.spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, spans


@pytest.fixture(scope="module")
def obs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("obs")
    receiver, spans = _start_otlp_receiver()
    otlp = {"KVGATE_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "200"}  # export every 0.2 s, not 5 s
    stack = start_stack(tiny_model_dir, root / ".kvgate", "paged", otlp, args=["--gateway-workers", "2"])
    prom = None
    try:
        metrics_url = (stack.state / "worker.metrics.url").read_text().strip()
        prom, prom_url = _start_prometheus(root, stack.url, metrics_url)
        o = Obs(stack, prom_url, (stack.state / "admin.key").read_text().strip(), spans)
        asyncio.run(_load(o))
        yield o
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(15)
        stop_stack(stack.proc)
        receiver.shutdown()


async def _load(o: Obs) -> None:
    """Streams and plain completions from fresh connections (so both gateway processes serve),
    refusals of each kind, a rate limit hit, a canary set and rolled back."""
    url, auth = o.stack.url, {"Authorization": f"Bearer {o.stack.key}"}

    async def one(route: str, body: dict, headers: dict = auth) -> int:
        async with httpx.AsyncClient(timeout=60) as client:  # a new connection per request
            if body.get("stream"):
                async with client.stream("POST", url + route, json=body, headers=headers) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
                    status = resp.status_code
            else:
                status = (await client.post(url + route, json=body, headers=headers)).status_code
        o.sent[(route, str(status))] += 1
        return status

    chat = {"model": "demo", "stream": True, "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{MARKER} tell me"}]}
    plain = {"model": "demo", "prompt": f"{MARKER} once upon", "max_tokens": 6, "ignore_eos": True}
    for _ in range(20):  # until both gateway processes have served some (the kernel picks)
        statuses = await asyncio.gather(*(one("/v1/chat/completions", chat) for _ in range(N_STREAMS)),
                                        *(one("/v1/completions", plain) for _ in range(N_PLAIN)))
        assert set(statuses) == {200}
        if len(_serving_pids(o.stack.state)) == 2:
            break
    assert await one("/v1/completions", plain, {"Authorization": "Bearer sk-kvg-wrong"}) == 401
    assert await one("/v1/completions", {**plain, "model": "nope"}) == 404
    admin = {"Authorization": f"Bearer {o.admin_key}"}
    async with httpx.AsyncClient(timeout=30) as client:
        made = await client.post(url + "/admin/keys", json={"name": "slow", "rpm": 1}, headers=admin)
        secret = made.json()["secret"]
        canary = await client.put(url + "/admin/canary/demo", headers=admin,
                                  json={"version": "v2", "stable": "v1", "weight": 10})
        assert canary.status_code == 200, canary.text
        for _ in range(100):  # the rollback counter is scraped at 0 first, so it shows an increase
            if o.query('kvgate_canary_rollbacks_total{trigger="manual"}')["data"]["result"]:
                break
            await asyncio.sleep(0.2)
        back = await client.post(url + "/admin/canary/demo/rollback", json={"reason": "test"}, headers=admin)
        assert back.status_code == 200, back.text
    limited = {"Authorization": f"Bearer {secret}"}
    assert [await one("/v1/completions", plain, limited) for _ in range(2)] == [200, 429]


def _scrape(url: str) -> dict[str, list]:
    text = httpx.get(url, timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _total(families: dict, name: str, **labels) -> float:
    return sum(s.value for s in families.get(name, []) if s.name == name + "_total"
               and all(s.labels.get(k) == v for k, v in labels.items()))


def _serving_pids(state: Path) -> set[int]:
    return {json.loads(line)["pid"] for line in (state / "gateway.log").read_text().splitlines()
            if '"kvgate.gateway.access"' in line and "/completions" in line}


def test_counters_equal_requests_sent_with_two_gateway_processes(obs):
    pids = _serving_pids(obs.stack.state)
    assert len(pids) == 2, f"requests were served by processes {pids}: expected both"
    for _ in range(6):  # each scrape is answered by either process: every one must see all
        fams = _scrape(obs.stack.url + "/metrics")
        for (route, status), n in obs.sent.items():
            got = _total(fams, "kvgate_gateway_requests", route=route, status=status)
            assert got == n, f"{route} {status}: counted {got}, sent {n}"
        assert _total(fams, "kvgate_gateway_rate_limited", limit="rpm") == 1
        assert _total(fams, "kvgate_canary_rollbacks", model="demo", trigger="manual") == 1
    served = sum(n for (_, status), n in obs.sent.items() if status == "200")
    worker = _scrape((obs.stack.state / "worker.metrics.url").read_text().strip())
    assert _total(worker, "kvgate_request_success", model="demo", version="v1") == served
    ttft = [s for s in worker["kvgate_time_to_first_token_seconds"] if s.name.endswith("_count")]
    assert sum(s.value for s in ttft) == served


def _dashboard_exprs() -> list[tuple[str, str, str]]:
    out = []
    for f in sorted((ROOT / "ops/grafana/dashboards").glob("*.json")):
        board = json.loads(f.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                out.append((board["title"], panel["title"], _substitute(target["expr"])))
    return out


def _substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():  # longest first: $__rate_interval before $version
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def test_every_dashboard_panel_has_data(obs):
    sent = sum(n for (route, status), n in obs.sent.items() if route == "/v1/chat/completions")
    _wait_for(lambda: _value(obs, 'sum(kvgate_gateway_requests_total{route="/v1/chat/completions"})') == sent,
              "Prometheus to scrape the final counts")
    exprs = _dashboard_exprs()
    assert len(exprs) >= 30
    empty: list = []

    def all_have_series() -> bool:
        empty.clear()
        for board, panel, expr in exprs:
            answer = obs.query(expr)
            assert answer["status"] == "success", f"{board} / {panel}: {answer.get('error')}\n{expr}"
            if not answer["data"]["result"] and GPU_ONLY not in expr:
                empty.append(f"{board} / {panel}: {expr}")
        return not empty

    _wait_for(all_have_series, "every panel to have series", timeout=30)
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_dashboard_variables_offer_the_model_and_version(obs):
    for f in sorted((ROOT / "ops/grafana/dashboards").glob("*.json")):
        for var in json.loads(f.read_text())["templating"]["list"]:
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
            selector, label = _substitute(match.group(1)), match.group(2)
            values = httpx.get(obs.prom + f"/api/v1/label/{label}/values",
                               params={"match[]": selector}, timeout=10).json()["data"]
            assert SUBSTITUTIONS[f"${var['name']}"] in values, (f.name, var["name"], values)


def test_every_alert_rule_evaluates_on_live_metrics(obs):
    rules = [r for g in yaml.safe_load((ROOT / "ops/prometheus/alerts.yml").read_text())["groups"]
             for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"KvgateNoLiveWorker", "KvgateHighErrorRate", "KvgateStreamDepthGrowing",
                                           "KvgateKVCacheFull", "KvgateCanaryRolledBack", "KvgateQueueAboveScaleOut",
                                           "KvgateGPUMemoryHigh", "KvgateEventLoopLag", "KvgateCircuitOpen"}
    for rule in rules:
        answer = obs.query(rule["expr"])
        assert answer["status"] == "success", f"{rule['alert']}: {answer.get('error')}"
        for metric in set(re.findall(r"\b(kvgate_\w+|up)\b(?=[{\[)\s])", rule["expr"])) - _gpu_only(rule):
            found = obs.query(f"count({metric})")["data"]["result"]
            assert found, f"{rule['alert']} reads {metric}, which no target exports"

    def evaluated() -> bool:
        groups = httpx.get(obs.prom + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        return all(r["health"] == "ok" for g in groups for r in g["rules"]) and groups

    _wait_for(evaluated, "Prometheus to evaluate every rule without error")
    firing = {a["labels"]["alertname"] for a in httpx.get(obs.prom + "/api/v1/alerts").json()["data"]["alerts"]}
    assert "KvgateCanaryRolledBack" in firing  # the rollback in the load


def _gpu_only(rule: dict) -> set[str]:
    return set(re.findall(rf"\b{GPU_ONLY}\w+", rule["expr"]))


def test_logs_are_json_with_request_ids_and_no_prompt(obs):
    for name in ("gateway.log", "worker.log"):
        lines = (obs.stack.state / name).read_text().splitlines()
        assert lines, name
        records = [json.loads(line) for line in lines]  # every line is one JSON object
        assert all(MARKER not in line for line in lines), f"{name} holds prompt text"
        about_requests = [r for r in records if r["msg"].startswith(("POST /v1", "request finished"))]
        assert about_requests and all(r.get("request_id") for r in about_requests), name
    worker_ids = {json.loads(line)["request_id"] for line in (obs.stack.state / "worker.log").read_text().splitlines()
                  if '"request finished"' in line}
    gateway_ids = {json.loads(line)["request_id"] for line in (obs.stack.state / "gateway.log").read_text().splitlines()
                   if '"kvgate.gateway.access"' in line}
    assert worker_ids and worker_ids <= gateway_ids  # one id follows a request across processes


def _value(obs: Obs, expr: str) -> float | None:
    result = obs.query(expr)["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _wait_for(check, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


# -- traces ----------------------------------------------------------------------------------
def test_gateway_and_worker_processes_export_one_trace_per_request(obs):
    """Real processes, tracing switched on by KVGATE_OTLP_ENDPOINT: each request the worker served
    is one trace, the gateway's server span (in either gateway process) its root."""
    served = sum(n for (_, status), n in obs.sent.items() if status == "200")
    _wait_for(lambda: sum(s["name"] == "decode" for s in obs.spans) >= served, "the spans of every request")
    spans = list(obs.spans)
    workers = [s for s in spans if s["service"] == "kvgate-worker" and s["name"] == "worker"]
    assert len(workers) == served
    for worker in workers:
        trace = [s for s in spans if s["trace_id"] == worker["trace_id"]]
        server = next(s for s in trace if s["service"] == "kvgate-gateway" and s["name"].startswith("POST /v1/"))
        assert worker["parent"] == server["span_id"] and server["parent"] == ""
        names = {s["name"] for s in trace}
        assert names >= {"auth", "limits", "limits.tokens", "dispatch", "queue wait", "prefill", "decode"}
        assert all(s["parent"] for s in trace if s is not server)  # one root


def test_gateway_and_worker_spans_share_one_trace(redis_server, tiny_model_dir):
    """The gateway app in-process and a worker service in a thread, one Redis between them, both
    exporting to one in-memory exporter: the worker's spans join the gateway's trace through the
    context the stream entry carried."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from gateway.app import create_app
    from shared import telemetry
    from shared.settings import GatewaySettings, WorkerSettings
    from worker.main import build_engine
    from worker.service import WorkerService

    exporter = InMemorySpanExporter()
    assert telemetry.setup_tracing("kvgate-test", exporter=exporter, simple=True)
    ws = WorkerSettings(model=str(tiny_model_dir), redis_url=redis_server.url, served_name="traced",
                        engine="synthetic", heartbeat_s=0.2)
    engine = build_engine(ws)
    service = WorkerService(ws, engine, engine.tokenizer)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    app = create_app(GatewaySettings(redis_url=redis_server.url, secret="trace-secret", api_key="sk-trace"))

    async def call() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                for _ in range(100):  # until the worker's first heartbeat
                    if (await client.get("/v1/models", headers={"Authorization": "Bearer sk-trace"})).json()["data"]:
                        break
                    await asyncio.sleep(0.1)
                return await client.post("/v1/completions", headers={"Authorization": "Bearer sk-trace"},
                                         json={"model": "traced", "prompt": "hi", "max_tokens": 4})
    try:
        resp = asyncio.run(call())
        assert resp.status_code == 200, resp.text
        request_id = resp.json()["id"]
        _wait_until(lambda: any(s.name == "decode" for s in exporter.get_finished_spans()))
    finally:
        service.stop()
        thread.join(10)
    spans = exporter.get_finished_spans()
    server = next(s for s in spans if s.kind == SpanKind.SERVER and s.name == "POST /v1/completions")
    trace_id = server.context.trace_id
    ours = {s.name: s for s in spans if s.context.trace_id == trace_id}
    assert set(ours) >= {"auth", "limits", "limits.tokens", "dispatch", "queue wait", "worker", "prefill", "decode"}
    for name in ("auth", "limits", "limits.tokens", "dispatch", "queue wait", "worker"):
        assert ours[name].parent.span_id == server.context.span_id, name
    for name in ("prefill", "decode"):
        assert ours[name].parent.span_id == ours["worker"].context.span_id, name
    assert ours["worker"].attributes["kvgate.request_id"] == request_id
    assert ours["queue wait"].end_time <= ours["prefill"].start_time <= ours["decode"].start_time


def _wait_until(check, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
