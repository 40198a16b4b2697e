"""The `make bench` harness pieces that need no peer gateway: the multi-process load generator
against the bare baseline server, the figures' rounds and spread, and the JSON's names."""
from __future__ import annotations

import pytest

from kvgate.bench.datasets import DatasetOptions, Vocabulary, load_tokenizer, make_requests, send_times
from kvgate.bench.loadgen import LoadGenerator, _split
from kvgate.bench.report import TARGETS, _mix_md, figures, round_figures, spread
from kvgate.bench.serve import RunConfig


def test_processes_send_every_request_once_and_merge_the_results(baseline, tiny_model_dir):
    vocab = Vocabulary(load_tokenizer(tiny_model_dir))
    opts = DatasetOptions(input_len=12, output_len=3)
    requests = make_requests("random", 21, opts, vocab, seed=1)
    times = send_times("random", 21, 200.0, opts, 1000.0, seed=1)
    cfg = RunConfig(url=baseline, model="x", api_key="sk-base", num_prompts=21, request_rate=200.0,
                    stream=False, progress=False)
    loadgen = LoadGenerator(3)
    try:
        run = loadgen.run(cfg, requests, times)
    finally:
        loadgen.close()
    assert (run["num_requests"], run["completed"], run["failed"]) == (21, 21, 0)
    assert run["total_output_tokens"] == 21 * 3 and run["total_input_tokens"] == 21 * 12
    assert run["client_processes"] == 3 and len(run["client_cpu_s_per_s"]) == 3
    assert all(0 <= c < 5 for c in run["client_cpu_s_per_s"])
    # sent at their times from one start: the last was due at ~0.1 s, not after every share in turn
    assert max(times) < run["duration_s"] < 30


def test_a_wrong_key_fails_the_run_at_the_probe(baseline, tiny_model_dir):
    import click

    vocab = Vocabulary(load_tokenizer(tiny_model_dir))
    requests = make_requests("random", 2, DatasetOptions(input_len=8, output_len=2), vocab)
    loadgen = LoadGenerator(1)
    try:
        with pytest.raises(click.ClickException, match="HTTP 401"):
            loadgen.run(RunConfig(url=baseline, model="x", api_key="sk-wrong", stream=False, progress=False),
                        requests, [0.0, 0.0])
    finally:
        loadgen.close()


def test_concurrency_caps_add_up_across_processes():
    assert [_split(5, 3, i) for i in range(3)] == [2, 2, 1]
    assert [_split(None, 2, i) for i in range(2)] == [None, None]
    assert [_split(1, 2, i) for i in range(2)] == [1, 1]  # never 0: each process sends its share


def test_spread_is_min_median_max_of_the_rounds():
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert spread([1.0, None, 2.0]) is None


def _latency(kvgate_p50: float, litellm_p50: float, portkey_p50: float) -> dict:
    def path(p50):
        return {"ttft": {"p50": p50, "p99": p50}, "e2el": {"p50": p50, "p99": p50}}
    return {mode: {"baseline": path(1.0), "litellm": path(litellm_p50), "portkey": path(portkey_p50),
                   "kvgate": path(kvgate_p50)} for mode in ("nostream", "stream")}


def _ramp(kvgate: float, litellm: float) -> dict:
    return {name: {"max_sustained_rps": v, "levels": []} for name, v in
            (("baseline", 1000.0), ("litellm", litellm), ("portkey", 500.0), ("kvgate", kvgate))}


def test_figures_carry_the_issues_names_with_three_rounds():
    rounds = [{"latency": _latency(2.0, 5.0, 3.0), "ramp": _ramp(300.0, 60.0)},
              {"latency": _latency(3.0, 5.0, 3.0), "ramp": _ramp(400.0, 80.0)},
              {"latency": _latency(2.5, 5.0, 3.0), "ramp": _ramp(200.0, 100.0)}]
    results = {
        "engines": {"top_rounds": {"paged": [100.0, 120.0, 90.0], "hf": [10.0, 10.0, 10.0]}},
        "gateways": {"rounds": rounds, "latency": rounds[0]["latency"]},
        "ttft_added": {"added_p50_ms": 2.0, "rounds": [{"added_p50_ms": v} for v in (2.0, 4.0, 1.0)]},
    }
    per_round = round_figures(results)
    assert per_round["overhead_p50_vs_litellm"] == [0.25, 0.5, 0.375]  # (2-1)/(5-1), ...
    assert per_round["overhead_p50_vs_portkey"] == [0.5, 1.0, 0.75]
    assert per_round["rps_vs_litellm"] == [5.0, 5.0, 2.0]
    figs = figures(results)
    assert set(figs) == set(TARGETS) >= {"overhead_p50_vs_portkey", "overhead_p50_vs_litellm", "rps_vs_litellm",
                                         "ttft_added_ms_p50", "vs_naive_c64"}
    assert figs["vs_naive_c64"] == 10.0 and figs["ttft_added_ms_p50"] == 2.0
    assert figs["overhead_p50_vs_portkey"] == 0.75 and figs["mix_short_ttft_p99_ratio"] is None


def test_the_mix_figure_is_the_median_of_its_rounds_and_older_results_still_read():
    def by(p99: float) -> dict:
        return {"p99_ttft_ms": p99, "by_label": {"short": {"p99_ttft_ms": p99}}}

    mix = {"alone": by(30.0), "mixed": by(90.0),
           "short_p99_rounds": [{"alone_ms": 30.0, "mixed_ms": 90.0}, {"alone_ms": 40.0, "mixed_ms": 200.0},
                                {"alone_ms": 50.0, "mixed_ms": 100.0}]}
    assert round_figures({"mix": mix})["mix_short_ttft_p99_ratio"] == [3.0, 5.0, 2.0]
    assert figures({"mix": mix})["mix_short_ttft_p99_ratio"] == 3.0
    older = {"alone": by(30.0), "mixed": by(60.0)}  # a results.json from before the rounds
    assert round_figures({"mix": older})["mix_short_ttft_p99_ratio"] == [2.0]


def test_the_mix_table_shows_each_class_worst_gaps_between_tokens():
    def run(ttft: float, itl: float) -> dict:
        return {"completed": 9, "p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "p50_tpot_ms": 3.0, "p99_itl_ms": itl}

    mix = {"alone": run(10.0, 12.5), "mixed": {"by_label": {"short": run(20.0, 33.3), "long": run(200.0, 31.5)}},
           "mix_short_input": 32, "mix_short_output": 32, "short_rate": 9, "mix_long_input": 1024,
           "mix_long_output": 8, "long_rate": 1.5, "long_ttft_alone_ms": 150.0, "long_busy": 0.2}
    table = [line for line in _mix_md(mix) if line.startswith("| ")]
    assert table[0].endswith("| TPOT p50 ms | ITL p99 ms |")
    assert [row.split("|")[-2].strip() for row in table[2:]] == ["12.5", "33.3", "31.5"]
    del mix["mixed"]["by_label"]["long"]  # no long prompt finished: a row of zeros, not an error
    assert _mix_md(mix)[-1].startswith("| mix | long | 0 |")


def test_cpu_per_request_reads_each_role_and_divides_by_the_requests():
    """`kvgate bench cpu`'s arithmetic on this process's own counters (the stack is not started here)."""
    import os

    import psutil

    from kvgate.bench.cpu import per_request

    me = psutil.Process(os.getpid())
    t0 = me.cpu_times()
    sum(i * i for i in range(300_000))  # some user time
    t1 = me.cpu_times()
    out = per_request({"gateway": (t0.user, t0.system)}, {"gateway": (t1.user, t1.system)}, 10)
    assert out["gateway"]["user_ms"] == pytest.approx(100 * (t1.user - t0.user), abs=1e-3)
    assert out["gateway"]["total_ms"] == pytest.approx(out["gateway"]["user_ms"] + out["gateway"]["system_ms"], abs=2e-3)
    assert per_request({"worker": (1.0, 0.5)}, {"worker": (1.2, 0.5), "redis": (9.0, 9.0)}, 4) == {
        "worker": {"user_ms": 50.0, "system_ms": 0.0, "total_ms": 50.0}}  # only roles read both times


def test_an_only_run_without_an_earlier_one_leaves_the_published_report_alone(tmp_path):
    from kvgate.bench.compare import earlier_run

    raw, docs = tmp_path / "out" / "results.json", tmp_path / "docs"
    raw.parent.mkdir()
    assert earlier_run(raw, docs) == ({}, tmp_path / "out" / "docs")
    raw.write_text('{"engines": {"levels": []}}\n')
    assert earlier_run(raw, docs) == ({"engines": {"levels": []}}, docs)
