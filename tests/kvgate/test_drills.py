"""`kvgate bench burst` and `kvgate bench soak`: the pass-criteria arithmetic fed a leak, and both
drills at tiny sizes on a real `kvgate up --engine synthetic` stack, checking resilience.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from kvgate.bench.burst import Outcome, recovery_s, summarize_burst
from kvgate.bench.soak import growth, leaked_blocks, verdict


def _sample(rss: int, redis_mem: int = 1000, keys: int = 10) -> dict:
    return {"rss": {"worker": rss, "gateway": 500}, "redis_used_memory": redis_mem, "redis_keys": keys,
            "fds": 40, "connections": 8}


def test_growth_ignores_the_warm_up_and_flags_a_steady_climb():
    warm_then_flat = [100, 150, 180, 190] + [200, 201, 199, 200] * 4  # the first 20%: warm-up
    assert abs(growth(warm_then_flat)) < 0.01
    climbing = [200 + 5 * i for i in range(20)]  # +2.5% a sample: a leak
    assert growth(climbing) > 0.05


def test_verdict_fails_a_leak_in_rss_redis_blocks_or_keys():
    flat = [_sample(1000) for _ in range(20)]
    assert verdict(flat, 0, [])["passed"]
    rss_leak = [_sample(1000 + 20 * i) for i in range(20)]
    assert not (v := verdict(rss_leak, 0, []))["passed"] and v["rss_growth_by_process"]["worker"] > 0.05
    redis_leak = [_sample(1000, redis_mem=1000 + 30 * i) for i in range(20)]
    assert not (v := verdict(redis_leak, 0, []))["passed"] and v["redis_growth"] > 0.05
    assert not verdict(flat, 3, [])["passed"]
    assert not verdict(flat, 0, ["kvgate:ckpt:abc"])["passed"]
    assert leaked_blocks({"num_blocks": 64, "num_free_blocks": 61}) == 3
    assert leaked_blocks({"num_running": 0}) is None  # synthetic: no pool to leak from


def test_a_step_at_the_restart_is_told_apart_from_a_climb():
    """The verdict judges the whole run; the figures beside it show a step between two flat lives."""
    step = [dict(_sample(1000 if i < 20 else 1100), t=float(i)) for i in range(40)]
    v = verdict(step, 0, [], restart_at=20.0)
    assert not v["passed"] and abs(v["rss_growth_by_process"]["worker"] - 0.1) < 1e-9
    assert v["rss_restart_step"]["worker"] == 0.1 and v["rss_growth_by_life"]["worker"] == [0.0, 0.0]
    climb = [dict(_sample(1000 + 10 * i), t=float(i)) for i in range(40)]
    lives = verdict(climb, 0, [], restart_at=20.0)["rss_growth_by_life"]["worker"]
    assert all(g > 0.05 for g in lives)  # a leak climbs within each life
    assert verdict(step, 0, [], restart_at=38.0)["rss_growth_by_life"]["worker"] == [0.1]  # one life


def test_burst_summary_flags_an_unclean_end_and_measures_recovery():
    spans = {"1x": (0, 10), "2x": (10, 20), "3x": (20, 30), "after": (30, 50)}
    ok = [Outcome(start=t, phase=p, label="short", status=200, ttft=0.05, tokens=4)
          for p, (lo, hi) in spans.items() for t in range(lo, hi)]
    slow = [Outcome(start=30.5 + t, phase="after", label="short", status=200, ttft=2.0, tokens=4) for t in range(4)]
    shed = [Outcome(start=25, phase="3x", label="short", status=503, retry_after="1")]
    assert recovery_s(ok + slow, spans["after"], 0.05) == 4.0  # windows [30,32), [32,34) still slow
    found = {"sustainable_rps": 1.0, "levels": []}
    good = summarize_burst(ok + shed, spans, found, [])
    assert good["passed"] and good["shed_share_3x"] == 1 / 11
    no_retry_after = Outcome(start=25, phase="3x", label="short", status=503)
    assert not summarize_burst(ok + [no_retry_after], spans, found, [])["passed"]
    assert not summarize_burst(ok, spans, found, ["python -m kvgate worker"])["passed"]


def test_both_drills_on_a_synthetic_stack(tiny_model_dir, tmp_path):
    out = tmp_path / "resilience.json"
    env = {**os.environ, "KVGATE_HEARTBEAT_S": "0.3", "KVGATE_HEARTBEAT_TTL_S": "2"}
    common = ["--model", str(tiny_model_dir), "--engine", "synthetic", "--out", str(out), "--plots", str(tmp_path)]
    burst = subprocess.run([sys.executable, "-m", "kvgate", "bench", "burst", *common, "--burst-s", "2",
                            "--calm-s", "2", "--rate", "4", "--out-dir", str(tmp_path / "b")], env=env,
                           capture_output=True, text=True, timeout=120)
    assert burst.returncode == 0, burst.stdout + burst.stderr
    soak = subprocess.run([sys.executable, "-m", "kvgate", "bench", "soak", *common, "--duration", "8",
                           "--rate", "4", "--sample-s", "0.5", "--out-dir", str(tmp_path / "s")], env=env,
                          capture_output=True, text=True, timeout=120)
    doc = json.loads(out.read_text())
    for name in ("shed_share_3x", "recovery_s"):
        assert name in doc["burst"], name
    for name in ("rss_growth", "leaked_blocks", "redis_growth", "duration_s"):
        assert name in doc["soak"], name
    assert doc["burst"]["processes_exited"] == [] and doc["burst"]["unclean"] == []
    assert doc["soak"]["duration_s"] == 8 and doc["soak"]["worker_killed_at_s"] is not None
    assert doc["soak"]["untimed_keys"] == [] and doc["soak"]["unclean"] == 0, soak.stdout + soak.stderr
    assert len(doc["soak"]["samples"]) >= 5
    for png in ("burst_ttft.png", "burst_shed.png", "soak_rss.png", "soak_redis.png", "soak_fds.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
