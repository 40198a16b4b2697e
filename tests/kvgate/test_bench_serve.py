"""`kvgate bench serve`: the metric math on hand-made timings, the workloads, the synthetic engine,
the bare baseline server, and a real run against a `kvgate up --engine synthetic` stack."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from kvgate.bench.datasets import DatasetOptions, Vocabulary, load_tokenizer, make_requests, send_times
from kvgate.bench.metrics import RequestResult, distribution, meets_slo, summarize, summarize_by_label
from tests.conftest import start_stack, stop_stack  # plain helpers (python -m pytest puts . on the path)
from worker.engine.types import SamplingParams

RUN_FIELDS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p50", "p90", "p99")]
RUN_FIELDS += ["duration_s", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "total_token_throughput", "request_goodput", "good_requests", "ttfts_ms"]


def result(ttft: float, itl: list[float], output_len: int, prompt_len: int = 10, label: str = "") -> RequestResult:
    """A streamed request whose first chunk came at `ttft` and the rest `itl` apart (one token each)."""
    return RequestResult(success=True, ttft=ttft, itl=itl, latency=ttft + sum(itl), output_len=output_len,
                         prompt_len=prompt_len, label=label)


# -- metric math --------------------------------------------------------------------------------
def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = result(0.100, [0.020, 0.030, 0.040], output_len=4)
    assert r.latency == pytest.approx(0.190)
    assert r.tpot == pytest.approx(0.030)  # (0.190 - 0.100) / 3
    assert result(0.1, [], output_len=1).tpot is None  # vLLM: no TPOT for a one-token answer


def test_percentiles_interpolate_linearly_in_ms():
    d = distribution([0.010, 0.020, 0.030, 0.040, 0.050])
    assert d["mean"] == pytest.approx(30.0)
    assert d["median"] == d["p50"] == pytest.approx(30.0)
    assert d["p90"] == pytest.approx(46.0)  # rank 0.9·4 = 3.6: 40 + 0.6·10
    assert d["p99"] == pytest.approx(49.6)
    assert distribution([])["p99"] == 0.0


def test_summary_pools_itls_and_counts_only_completed_requests():
    rs = [result(0.010, [0.002, 0.004], 3, prompt_len=5), result(0.030, [0.006], 2, prompt_len=7),
          RequestResult(success=False, error="HTTP 500")]
    s = summarize(rs, duration_s=2.0)
    assert (s["completed"], s["failed"], s["num_requests"]) == (2, 1, 3)
    assert s["total_input_tokens"] == 12 and s["total_output_tokens"] == 5
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(8.5)
    assert s["mean_itl_ms"] == pytest.approx(4.0)  # 2, 4 and 6 ms pooled
    assert s["mean_tpot_ms"] == pytest.approx((3.0 + 6.0) / 2)  # per request: 6/2 and 6/1 ms
    assert s["mean_ttft_ms"] == pytest.approx(20.0)
    assert s["p50_e2el_ms"] == pytest.approx((16.0 + 36.0) / 2)


def test_goodput_counts_requests_within_every_slo():
    fast = result(0.010, [0.001] * 4, 5)
    slow_first = result(0.200, [0.001] * 4, 5)
    slow_decode = result(0.010, [0.050] * 4, 5)
    one_token = result(0.010, [], 1)
    assert meets_slo(fast, {"ttft": 50, "tpot": 10})
    assert not meets_slo(slow_first, {"ttft": 50, "tpot": 10})
    assert not meets_slo(slow_decode, {"ttft": 50, "tpot": 10})
    assert meets_slo(one_token, {"tpot": 0.0})  # its TPOT counts as 0
    s = summarize([fast, slow_first, slow_decode, one_token], 2.0, {"ttft": 50, "tpot": 10})
    assert s["good_requests"] == 2 and s["request_goodput"] == pytest.approx(1.0)
    assert "request_goodput" not in summarize([fast], 1.0)


def test_figures_by_label():
    rs = [result(0.010, [0.001], 2, label="short"), result(0.500, [0.001], 2, label="long")]
    by = summarize_by_label(rs, 1.0)
    assert by["short"]["p99_ttft_ms"] == pytest.approx(10.0)
    assert by["long"]["p99_ttft_ms"] == pytest.approx(500.0)


# -- workloads ----------------------------------------------------------------------------------
def test_prompts_have_the_asked_token_lengths(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    vocab = Vocabulary(tokenizer)
    for req in make_requests("random", 5, DatasetOptions(input_len=40, output_len=7), vocab):
        assert len(tokenizer.encode(req.prompt, add_special_tokens=True)) == req.prompt_len == 40
        assert req.output_len == 7
    shared = make_requests("shared-prefix", 8, DatasetOptions(prefix_len=64, input_len=16, num_prefixes=2), vocab)
    assert all(r.prompt_len == 80 for r in shared)
    assert shared[0].prompt[:200] == shared[2].prompt[:200] != shared[1].prompt[:200]
    mix = make_requests("long-short", 20, DatasetOptions(long_fraction=0.25, long_input_len=200), vocab)
    assert [r.label for r in mix].count("long") == 5
    assert {r.prompt_len for r in mix if r.label == "long"} == {200}


def test_arrival_times():
    opts = DatasetOptions(burst_size=4, burst_interval_s=0.5)
    assert send_times("random", 3, float("inf"), opts) == [0.0, 0.0, 0.0]
    times = send_times("random", 4000, 20.0, opts, seed=1)
    assert times == sorted(times) and (times[-1] / len(times)) == pytest.approx(1 / 20, rel=0.1)
    assert send_times("burst", 9, float("inf"), opts) == [0.0] * 4 + [0.5] * 4 + [1.0]


# -- the synthetic engine -----------------------------------------------------------------------
def test_synthetic_engine_emits_max_tokens_for_all_requests_at_once(tiny_model_dir):
    from worker.engine.synthetic import SyntheticEngine

    engine = SyntheticEngine.from_model_dir(tiny_model_dir)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, n=2))
    engine.add_request("b", [1, 2], SamplingParams(max_tokens=1))
    engine.add_request("c", [1], SamplingParams(max_tokens=5))
    first = engine.step()
    assert sorted((o.request_id, o.index) for o in first) == [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    assert [o.finish_reason for o in first if o.request_id == "b"] == ["length"]
    engine.abort("c")
    outs = engine.step() + engine.step()
    assert [o.finish_reason for o in outs if o.request_id == "c"] == ["abort"]
    assert [o.num_output_tokens for o in outs if o.finished and o.request_id == "a"] == [3, 3]
    assert not engine.has_unfinished() and engine.free_capacity() == engine.max_num_seqs
    assert engine.token_id not in engine.eos_token_ids and engine.token_text


def test_synthetic_engine_resumes_after_the_tokens_already_sent(tiny_model_dir):
    from worker.engine.synthetic import SyntheticEngine
    from worker.engine.types import Resume

    engine = SyntheticEngine.from_model_dir(tiny_model_dir)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=4, n=3), Resume({0: [7, 7, 7], 2: [7]}, {1}))
    outs = engine.step() + engine.step() + engine.step()
    assert [(o.index, o.num_output_tokens, o.finish_reason) for o in outs] == [
        (0, 4, "length"), (2, 2, None), (2, 3, None), (2, 4, "length")]
    assert not engine.has_unfinished()


# -- the bare baseline server (`baseline`: tests/conftest.py), and a run through it ---------------
def test_baseline_serves_completions_behind_a_key(baseline):
    body = {"model": "x", "prompt": "hello world", "max_tokens": 3}
    assert httpx.post(baseline + "/v1/completions", json=body).status_code == 401
    headers = {"Authorization": "Bearer sk-base"}
    whole = httpx.post(baseline + "/v1/completions", json=body, headers=headers).json()
    assert whole["usage"]["completion_tokens"] == 3 and whole["choices"][0]["finish_reason"] == "length"
    body.update(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", baseline + "/v1/completions", json=body, headers=headers) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 3 + 2  # a chunk per token, usage, [DONE]
    assert json.loads(lines[-2][5:])["usage"]["completion_tokens"] == 3


def test_run_against_the_baseline_is_exact(baseline, tiny_model_dir):
    from kvgate.bench.serve import RunConfig, run_benchmark

    cfg = RunConfig(url=baseline, model="x", api_key="sk-base", num_prompts=6, max_concurrency=2, progress=False)
    run = run_benchmark(cfg, DatasetOptions(input_len=20, output_len=5), str(tiny_model_dir))["runs"][0]
    assert run["completed"] == 6 and run["failed"] == 0
    assert run["total_input_tokens"] == 6 * 20 and run["total_output_tokens"] == 6 * 5
    assert 0 < run["p50_ttft_ms"] <= run["p50_e2el_ms"]


# -- a real run through kvgate ------------------------------------------------------------------
def test_bench_serve_through_a_synthetic_stack(tiny_model_dir, tmp_path):
    stack = start_stack(tiny_model_dir, tmp_path / "state", "synthetic")
    try:
        common = [sys.executable, "-m", "kvgate", "bench", "serve", "--url", stack.url, "--api-key", stack.key,
                  "--tokenizer", str(tiny_model_dir), "--num-prompts", "8", "--input-len", "16",
                  "--output-len", "6", "--no-progress"]
        out, plots = tmp_path / "run.json", tmp_path / "plots"
        single = subprocess.run(common + ["--max-concurrency", "4", "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000",
                                          "--out", str(out), "--plots", str(plots)],
                                capture_output=True, text=True, timeout=120)
        assert single.returncode == 0, single.stdout + single.stderr
        run = json.loads(out.read_text())["runs"][0]
        assert [f for f in RUN_FIELDS if f not in run] == []
        assert (run["completed"], run["failed"], run["max_concurrency"]) == (8, 0, 4)
        assert run["total_output_tokens"] == 8 * 6 and run["total_input_tokens"] == 8 * 16
        assert run["good_requests"] == 8 and run["p99_ttft_ms"] > 0
        assert (plots / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        sweep = subprocess.run(common + ["--sweep", "1,4", "--plots", str(plots), "--out", str(out)],
                               capture_output=True, text=True, timeout=120)
        assert sweep.returncode == 0, sweep.stdout + sweep.stderr
        runs = json.loads(out.read_text())["runs"]
        assert [r["max_concurrency"] for r in runs] == [1, 4] and all(r["completed"] == 8 for r in runs)
        assert (plots / "throughput.png").exists() and (plots / "ttft_p99.png").exists()
    finally:
        stop_stack(stack.proc)


def test_targets_are_judged_both_ways():
    from kvgate.bench.report import met

    assert met("vs_naive_c64", 12.0) == "met" and met("vs_naive_c64", 3.0) == "**not met**"
    assert met("ttft_added_ms_p50", 2.5) == "met" and met("ttft_added_ms_p50", 4.0) == "**not met**"
    assert met("rps_vs_litellm", None) == "not measured"
