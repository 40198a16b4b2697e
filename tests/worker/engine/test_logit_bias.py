"""logit_bias in the sampler: added to the given ids' logits, only in the rows that asked."""
from __future__ import annotations

import pytest
import torch

from worker.engine.engine import LLMEngine
from worker.engine.sampler import Sampler, SampleRow
from worker.engine.types import EngineRejected, SamplingParams

PROMPT = [5, 17, 301, 42, 999, 7]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=128)


def greedy(engine, rid, bias=None, max_tokens=6) -> list[int]:
    engine.add_request(rid, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                   logit_bias=bias))
    ids = []
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
    return ids


def test_plus_100_makes_greedy_pick_the_id_and_minus_100_bans_it(engine):
    free = greedy(engine, "free")
    assert greedy(engine, "plus", {1234: 100.0}) == [1234] * 6
    banned = greedy(engine, "minus", {free[0]: -100.0})
    assert free[0] not in banned and banned != free


def test_a_biased_row_leaves_its_batch_mates_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    plain = SamplingParams(temperature=0.0)
    rows = [SampleRow(plain, [1], []), SampleRow(SamplingParams(temperature=0.0, logit_bias={7: 100.0}), [1], []),
            SampleRow(plain, [1], [])]
    tokens, _ = Sampler([0])(logits, rows)
    alone, _ = Sampler([0])(logits[[0, 2]], [rows[0], rows[2]])
    assert tokens[1] == 7 and [tokens[0], tokens[2]] == alone


def test_logprobs_stay_the_models_own(engine):
    """Biases shape the draw, not the reported logprobs (computed from the raw logits, as vLLM)."""
    engine.add_request("lp", PROMPT, SamplingParams(max_tokens=1, temperature=0.0, logprobs=0,
                                                    logit_bias={1234: 100.0}))
    out = [o for o in engine.step() if o.logprobs][0]
    assert out.new_token_ids == [1234] and out.logprobs[0].logprob < -1.0


@pytest.mark.parametrize("bias, words", [({2048: 1.0}, "outside this model's vocabulary"),
                                         ({-1: 1.0}, "outside"), ({3: float("nan")}, "finite")])
def test_out_of_range_ids_and_values_are_refused(engine, bias, words):
    with pytest.raises(EngineRejected, match=words) as caught:
        engine.add_request("bad", PROMPT, SamplingParams(logit_bias=bias))
    assert caught.value.param == "logit_bias" and "bad" not in engine.requests


def test_held_tensors_are_made_once_per_object_and_let_go_past_their_budget():
    from worker.engine.logit_rules import HeldTensors

    made = []

    def make(ids):
        made.append(list(ids))
        return (torch.tensor(ids),)

    held = HeldTensors(make, budget=5, fresh=lambda ids, t: t[0].numel() == len(ids))
    a, b = [1, 2], [3, 4]
    assert held(a)[0].tolist() == [1, 2] and held(a)[0].tolist() == [1, 2] and made == [[1, 2]]
    a.append(9)  # grown (a resumed sequence's prompt): made again
    assert held(a)[0].tolist() == [1, 2, 9] and len(made) == 2
    held(b)  # 3 + 2 + 2 elements would pass 5: the first ones are let go
    assert held._size <= 5 and held(b)[0].tolist() == [3, 4] and len(made) == 3
