"""The water-level alerts (issue 21) evaluated by Prometheus' own rule engine (`promtool test rules`)
on series shaped like what kvgate exports: each fires above its threshold once its `for` has passed,
and not below it. tests/integration/test_observability.py evaluates every rule on live metrics."""
from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.ops.test_compose import ROOT, _tool

KV = 'kvgate_kv_cache_usage_perc{model="demo",version="v1",instance="w1:9100"}'
DEPTH = 'kvgate_stream_depth{model="demo",version="%s",lane="interactive",instance="gw:8000"}'
LIVE = 'kvgate_workers_live{model="demo",version="%s",instance="gw:8000"}'
GPU = 'kvgate_gpu_memory_%s_bytes{model="demo",version="v1",instance="w%s:9100",device="0"}'
LAG = 'kvgate_gateway_event_loop_lag_seconds{instance="gw%s:8000"}'
BREAKER = 'kvgate_gateway_breaker_state{model="demo",version="%s",instance="gw:8000"}'


def _series() -> list[dict]:
    return [
        {"series": KV, "values": "0.97x20"},
        {"series": DEPTH % "v1", "values": "40x20"},  # 2 workers: 20 each, past the knee
        {"series": LIVE % "v1", "values": "2x20"},
        {"series": DEPTH % "v2", "values": "40x20"},  # 4 workers: 10 each
        {"series": LIVE % "v2", "values": "4x20"},
        {"series": DEPTH % "v3", "values": "20x20"},  # no live worker: counted as one
        {"series": LIVE % "v3", "values": "0x20"},
        {"series": GPU % ("used", "1"), "values": "79e9x20"},  # 98.75% of 80 GB
        {"series": GPU % ("total", "1"), "values": "80e9x20"},
        {"series": GPU % ("used", "2"), "values": "72e9x20"},  # 90%: the KV cache's budget
        {"series": GPU % ("total", "2"), "values": "80e9x20"},
        {"series": LAG % "1", "values": "0.4x20"},
        {"series": LAG % "2", "values": "0.02x20"},
        {"series": BREAKER % "v1", "values": "1x20"},
        {"series": BREAKER % "v2", "values": "0x20"},
    ]


def _fires(alert: str, at: str, *labels: dict) -> dict:
    return {"eval_time": at, "alertname": alert,
            "exp_alerts": [{"exp_labels": {"severity": sev, "alertname": alert, **lab}}
                           for sev, lab in labels]}


def test_water_level_alerts_fire_above_their_thresholds_only(tmp_path: Path):
    tests = [
        _fires("KvgateKVCacheFull", "4m"),  # `for: 5m` not yet passed
        _fires("KvgateKVCacheFull", "6m", ("warning", {"model": "demo", "version": "v1", "instance": "w1:9100"})),
        _fires("KvgateQueueAboveScaleOut", "6m", ("warning", {"model": "demo", "version": "v1"}),
               ("warning", {"model": "demo", "version": "v3"})),
        _fires("KvgateGPUMemoryHigh", "6m", ("warning", {"model": "demo", "version": "v1",
                                                          "instance": "w1:9100", "device": "0"})),
        _fires("KvgateEventLoopLag", "1m"),
        _fires("KvgateEventLoopLag", "3m", ("warning", {"instance": "gw1:8000"})),
        _fires("KvgateCircuitOpen", "3m", ("critical", {"model": "demo", "version": "v1"})),
    ]
    rules = yaml.safe_load((ROOT / "ops/prometheus/alerts.yml").read_text())
    for group in rules["groups"]:  # what fires, and when, is under test; not the wording
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    spec = {"rule_files": [str(tmp_path / "alerts.yml")], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": _series(), "alert_rule_test": tests}]}
    path = tmp_path / "water_levels.test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = subprocess.run([_tool("promtool"), "test", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
