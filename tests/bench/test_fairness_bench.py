"""`kvgate bench fairness`'s arithmetic: tokens against weights, and an arm's rounds summed up
(median and spread of each figure, B's TTFT samples of every round pooled)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvgate.bench.fairness import Result, _shares, _ttft, fairness_command, summarize


def _round(alone: list[float], beside: list[float], share_error: float) -> dict:
    results = [Result("b", "alone", 0.0, ttft=t) for t in alone] + [Result("b", "beside", 0.0, ttft=t) for t in beside]
    a, b = _ttft(results, "alone"), _ttft(results, "beside")
    return {"light_ttft_alone": a, "light_ttft_beside": b, "light_ttft_p99_ratio": b["p99_s"] / a["p99_s"],
            "share_error": share_error}


def test_shares_count_only_tokens_inside_the_window_against_the_weights():
    results = [Result("a", "both", 0.0, token_times=[0.5, 1.5, 2.5, 9.0]),
               Result("b", "both", 0.0, token_times=[1.0, 1.1, 1.2, 1.3, 1.4, 1.6, 0.1])]
    got = _shares(results, (1.0, 3.0), {"a": 1.0, "b": 2.0})
    assert got["tokens"] == {"a": 2, "b": 6}
    assert got["share"] == {"a": 0.25, "b": 0.75}
    # a's share 0.25 against 1/3 misses by a quarter of its weight share; b's by an eighth
    assert got["share_error"] == pytest.approx(0.25)


def test_an_arms_rounds_give_the_median_the_spread_and_the_pooled_ratio():
    rounds = [_round([0.01] * 9 + [0.02], [0.02] * 10, 0.05),
              _round([0.01] * 10, [0.03] * 10, 0.01),
              _round([0.01] * 10, [0.015] * 10, 0.20)]
    s = summarize(rounds)
    assert [r["light_ttft_p99_ratio"] for r in s["rounds"]] == pytest.approx([0.02 / 0.0191, 3.0, 1.5])
    assert s["light_ttft_p99_ratio"] == pytest.approx(1.5)
    spread = s["light_ttft_p99_ratio_spread"]
    assert (spread["min"], spread["max"]) == pytest.approx((0.02 / 0.0191, 3.0))
    assert (s["share_error"], s["share_error_spread"]["min"], s["share_error_spread"]["max"]) == (0.05, 0.01, 0.20)
    assert (s["light_ttft_pooled"]["alone"]["n"], s["light_ttft_pooled"]["beside"]["n"]) == (30, 30)
    pooled_alone = s["light_ttft_pooled"]["alone"]["p99_s"]
    assert 0.01 < pooled_alone < 0.02  # one slow sample of 30 is not the pooled p99's whole value
    assert s["light_ttft_p99_ratio_pooled"] == pytest.approx(s["light_ttft_pooled"]["beside"]["p99_s"] / pooled_alone)


def test_a_round_that_could_not_measure_leaves_the_figure_unset():
    rounds = [_round([0.01] * 10, [0.02] * 10, 0.05), {**_round([0.01], [0.02], 0.1), "light_ttft_p99_ratio": None}]
    s = summarize(rounds)
    assert s["light_ttft_p99_ratio"] is None and s["light_ttft_p99_ratio_spread"] is None
    assert s["share_error"] == pytest.approx(0.1)  # of two rounds the upper, as make bench's figures


def test_an_unknown_arm_is_refused_before_any_stack_starts(tmp_path):
    result = CliRunner().invoke(fairness_command, ["--arms", "fair,lottery", "--out", str(tmp_path / "f.json")])
    assert result.exit_code == 2 and "fair, fair_wait, fifo" in result.output
    assert not (tmp_path / "f.json").exists()
