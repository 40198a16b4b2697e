"""The GPU check's judgements that need no GPU: when Triton's interpreter cannot work, and whether the
CUDA-graph variant generated what the eager one did."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "gpu"))

from check_common import interpreter_problem  # noqa: E402
from check_engine import compare_greedy  # noqa: E402


def test_triton_3_6_interpreter_with_numpy_2_4_or_later_is_named_as_the_problem():
    problem = interpreter_problem("3.6.0", "2.5.2")  # the H200 image's pair
    assert "3.6.0" in problem and "2.5.2" in problem
    assert interpreter_problem("3.6.0", "2.3.5") is None
    assert interpreter_problem("3.7.1", "2.4.6") is None  # this machine's pair
    assert interpreter_problem("3.10.0rc1", "2.6.0.dev0") is None


def _steps(*tokens, logprob=-1.0, alternative=None):
    """One prompt's greedy steps; `alternative` = (token, logprob) also in the top list."""
    top = [alternative] if alternative else []
    return [{"token": t, "logprob": logprob, "top": [[t, logprob], *top]} for t in tokens]


def test_identical_generations_agree():
    got = compare_greedy([_steps(1, 2, 3)], [_steps(1, 2, 3, logprob=-1.05)], tolerance=0.1)
    assert got["ok"] and got["identical_tokens"] == 3 and got["first_divergence"] == [None]
    assert abs(got["max_logprob_diff"] - 0.05) < 1e-9


def test_a_divergence_at_a_near_tie_is_allowed_and_ends_the_comparison():
    eager = [_steps(1, 2, 3, alternative=[9, -1.02])]
    graphs = [_steps(1, 9, 4)]
    got = compare_greedy(eager, graphs, tolerance=0.1)
    assert got["ok"] and got["first_divergence"] == [1] and got["identical_tokens"] == 1


def test_a_token_eager_thought_unlikely_or_drifting_logprobs_fail():
    far = compare_greedy([_steps(1, 2, alternative=[9, -3.0])], [_steps(1, 9)], tolerance=0.1)
    unseen = compare_greedy([_steps(1, 2)], [_steps(1, 7)], tolerance=0.1)
    drift = compare_greedy([_steps(1, 2)], [_steps(1, 2, logprob=-1.5)], tolerance=0.1)
    missing = compare_greedy([_steps(1, 2)], [[]], tolerance=0.1)
    assert not far["ok"] and not unseen["ok"] and not drift["ok"] and not missing["ok"]


def test_compiled_kernels_can_be_counted_and_interpreted_ones_say_so():
    """engine.*.jit_compiles_timed reads Triton's per-kernel caches: a Triton that renamed them
    would turn the count into an error on the device, so read them here (nothing compiled yet)."""
    count = "import check_engine; print(check_engine.jit_compiles())"
    root = Path(__file__).resolve().parents[2]
    for interpret, want in (("0", "0"), ("1", "None")):
        env = {**os.environ, "TRITON_INTERPRET": interpret,
               "PYTHONPATH": os.pathsep.join([str(root), str(root / "ops" / "gpu")])}
        proc = subprocess.run([sys.executable, "-c", count], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split() == [want]
