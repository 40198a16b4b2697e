"""`kvgate bench programs` at tiny sizes: the three programs, three ways, on the tiny model; the JSON
names the issue fixes, and prefix caching computes fewer prompt tokens than no caching."""
from __future__ import annotations

import json
import tempfile

import pytest

from kvgate.bench.programs import Sizes, run_bench

SMOKE = Sizes(branch=2, depth=1, thought_tokens=2, doc_tokens=60, questions=2, choices=2, instruction_tokens=20)


@pytest.mark.timeout(900)  # three `kvgate up` stacks and settled hit counters: minutes on a loaded 2-core machine
def test_programs_bench_smoke(tmp_path, tiny_model_dir, monkeypatch):
    out = tmp_path / "programs.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the bench makes its folder
    report = run_bench(quick=True, out_json=str(out), model_dir=str(tiny_model_dir), sizes=SMOKE)
    assert list(scratch.iterdir()) == []  # a finished run leaves no logs folder behind
    written = json.loads(out.read_text())
    assert set(written["figures"]) == {"programs.tot_vs_naive", "programs.extract_vs_naive",
                                       "programs.select_vs_naive"}
    assert all(v > 0 for v in written["figures"].values())
    for name, rows in report["programs"].items():
        cached, uncached = rows["program_cached"], rows["program_uncached"]
        assert rows["same_results"], name  # same seeds: the program and the naive calls agree
        assert cached["prompt_tokens_computed"] < uncached["prompt_tokens_computed"], (name, rows)
        assert cached["requests"] == uncached["requests"] > 0  # the same program both ways
