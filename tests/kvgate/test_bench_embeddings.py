"""`kvgate bench embeddings --quick` runs every way and writes the figures it prints."""
from __future__ import annotations

import json

from click.testing import CliRunner

from kvgate.cli import main


def test_the_quick_bench_measures_each_way_and_agrees_with_transformers(tmp_path):
    out = tmp_path / "embeddings.json"
    result = CliRunner().invoke(main, ["bench", "embeddings", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["tok_per_s"]) == {"engine", "transformers_batch32", "engine_cached", "stack"}
    assert all(len(rates) == 3 and min(rates) > 0 for rates in report["tok_per_s"].values())
    assert report["max_abs_diff_vs_transformers"] < 1e-3
    assert report["embeddings.vs_transformers"] > 0 and report["embeddings.stack_share"] > 0


def test_the_quick_encoder_bench_runs_the_encoder_engine_against_sentence_transformers_way(tmp_path):
    out = tmp_path / "encoder.json"
    result = CliRunner().invoke(main, ["bench", "embeddings", "--encoder", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["tok_per_s"]) == {"engine", "transformers_batch32", "stack"}  # nothing to cache
    assert all(len(rates) == 3 and min(rates) > 0 for rates in report["tok_per_s"].values())
    assert report["max_abs_diff_vs_transformers"] < 1e-4  # mean pooled over the real tokens on both sides
