"""Prompt logprobs are transformers' log-softmax over the prompt positions (fp32), however the prompt
is chunked or served from the prefix cache, and `prompt_logprobs_start` keeps cache hits before it."""
from __future__ import annotations

import pytest
import torch

from worker.engine.llm import LLM
from worker.engine.types import EngineRejected, SamplingParams


@pytest.fixture(scope="module")
def model_dir(build_tiny):
    return build_tiny("prompt-logprobs")


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.inference_mode()
    def logprobs(prompt: list[int]) -> torch.Tensor:
        """[len(prompt), vocab]: row j is the distribution of token j + 1."""
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)

    return logprobs


def check(prompt, scores, ref, k: int, start: int = 0) -> None:
    assert len(scores) == len(prompt) and scores[0] is None
    for i in range(1, len(prompt)):
        if i < start:
            assert scores[i] is None
            continue
        s, row = scores[i], ref[i - 1]
        assert s.token_id == prompt[i]
        assert s.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert s.rank == int((row > row[prompt[i]]).sum()) + 1
        assert [t for t, _ in s.top] == row.topk(k).indices.tolist()
        assert [v for _, v in s.top] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)


def test_token_exact_whole_prompt_chunked_and_cached(model_dir, reference, random_prompts):
    prompts = random_prompts(4, 20, 60, seed=3)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    llm = LLM(model_dir, block_size=8, max_num_batched_tokens=24, dtype="float32")
    for _ in range(2):  # the second time every block is cached: scoring still recomputes them
        for prompt, result in zip(prompts, llm.generate(prompts, params)):
            check(prompt, result.prompt_logprobs, reference(prompt), 3)
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_start_keeps_the_cache_hits_before_it(model_dir, reference, random_prompts):
    state = random_prompts(1, 40, 40, seed=5)[0]
    llm = LLM(model_dir, block_size=8, dtype="float32")
    llm.generate([state], SamplingParams(max_tokens=1, temperature=0))
    hits = llm.engine.pool.num_hits
    choice = state + [11, 12, 13]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, prompt_logprobs_start=len(state))
    (result,) = llm.generate([choice], params)
    check(choice, result.prompt_logprobs, reference(choice), 0, start=len(state))
    assert llm.engine.pool.num_hits - hits == 32  # the blocks ending before position 39: 4 of 8


def test_other_choices_and_plain_requests_carry_none(model_dir, random_prompts):
    llm = LLM(model_dir)
    prompt = random_prompts(1, 10, 10)[0]
    (scored,) = llm.generate([prompt], SamplingParams(max_tokens=2, n=2, prompt_logprobs=1, seed=1))
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=2))
    assert len(scored.prompt_logprobs) == len(prompt) and plain.prompt_logprobs is None


def test_out_of_range_is_refused(model_dir):
    llm = LLM(model_dir)
    with pytest.raises(EngineRejected, match="prompt_logprobs must be between 0 and"):
        llm.generate([[5, 6]], SamplingParams(prompt_logprobs=10**9))
    with pytest.raises(EngineRejected, match="prompt_logprobs_start must be 0 or more"):
        llm.generate([[5, 6]], SamplingParams(prompt_logprobs=1, prompt_logprobs_start=-1))


def test_tensor_parallel_scores_on_rank_zero(model_dir, reference, random_prompts):
    prompts = random_prompts(2, 20, 30, seed=9)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    with LLM(model_dir, tensor_parallel_size=2, dtype="float32", block_size=8) as tp2:
        for prompt, result in zip(prompts, tp2.generate(prompts, params)):
            check(prompt, result.prompt_logprobs, reference(prompt), 2)


def test_what_one_reply_would_carry_is_bounded(model_dir, monkeypatch):
    """One entry per prompt token plus each scored token's top: they travel in one reply message,
    and Redis drops a subscriber it must send more than 32 MB at once (every stream of that gateway
    with it), so a request that would ask for more is refused, naming the limit."""
    from worker.engine import base

    monkeypatch.setattr(base, "MAX_PROMPT_SCORES_BYTES", 1 << 20)
    prompt = [(7 * i) % 2000 + 1 for i in range(1900)]
    with LLM(model_dir) as llm:
        with pytest.raises(EngineRejected, match="1899 of them scored with 20 top entries each, come to "
                                                 "about 2.0 MB in one reply; the limit is 1 MB") as refused:
            llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=20))
        assert refused.value.param == "prompt_logprobs"
        late = SamplingParams(max_tokens=1, prompt_logprobs=20, prompt_logprobs_start=1500)
        scores = llm.generate([prompt], late)[0].prompt_logprobs  # 1900 × 130 + 400 × 20 × 50 bytes
        assert sum(s is not None for s in scores) == 400 and len(scores) == 1900


def test_a_batch_of_prompts_is_each_prompt_with_its_own_choices_and_scores(model_dir, reference, random_prompts):
    """A batched completion is one request: prompt p's n choices are p*n .. p*n+n-1, each prompt's
    first choice carries its own prompt's scores, and greedy choices are the prompt's alone."""
    prompts = random_prompts(3, 9, 30, seed=11)
    params = SamplingParams(max_tokens=4, temperature=0, n=2, prompt_logprobs=2, ignore_eos=True)
    llm = LLM(model_dir, block_size=8, dtype="float32")
    alone = llm.generate(prompts, params)
    engine = llm.engine
    engine.add_request("batch", prompts, params)
    outputs: dict[int, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "batch" and out.error is None
            outputs.setdefault(out.index, []).append(out)
    assert sorted(outputs) == list(range(6))
    for index, outs in outputs.items():
        p, first = divmod(index, 2)
        assert [t for o in outs for t in o.new_token_ids] == alone[p].outputs[first].token_ids
        scores = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        if first == 0:
            assert [o.prompt_token_ids for o in outs if o.prompt_logprobs is not None] == [prompts[p]]
            check(prompts[p], scores[0], reference(prompts[p]), 2)
        else:
            assert scores == []
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_batch_is_bounded_by_its_choices_and_each_prompt_checked(model_dir):
    llm = LLM(model_dir)
    with pytest.raises(EngineRejected, match=r"9 prompts x n \(2\) = 18 choices; at most 16"):
        llm.engine.add_request("r", [[5, 6]] * 9, SamplingParams(n=2))
    with pytest.raises(EngineRejected, match="prompt 1's token id 999999 at position 1"):
        llm.engine.add_request("r", [[5, 6], [5, 999999]], SamplingParams())
    with pytest.raises(EngineRejected, match="the prompt has 0 tokens"):
        llm.engine.add_request("r", [[5, 6], []], SamplingParams())
    assert not llm.engine.has_unfinished()


def test_max_tokens_0_scores_the_prompt_and_samples_nothing(model_dir, reference, random_prompts):
    """OpenAI's legacy scoring request (echo, logprobs, max_tokens 0): the prompt's scores as any
    other request's, no token sampled, each choice finished by length once its prefill ends."""
    prompts = random_prompts(3, 20, 50, seed=11)
    llm = LLM(model_dir, block_size=8, max_num_batched_tokens=24, dtype="float32")
    sample, sampled = llm.engine.runner.sampler.sample, []
    llm.engine.runner.sampler.sample = lambda logits, rows: sampled.append(rows) or sample(logits, rows)
    results = llm.generate(prompts, SamplingParams(max_tokens=0, n=2, temperature=0, prompt_logprobs=2))
    assert not sampled
    for prompt, result in zip(prompts, results):
        check(prompt, result.prompt_logprobs, reference(prompt), 2)
        assert [(c.token_ids, c.finish_reason) for c in result.outputs] == [([], "length")] * 2
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_max_tokens_0_needs_the_paged_engine(model_dir):
    from worker.engine.hf_engine import HFEngine

    with pytest.raises(EngineRejected, match="max_tokens 0 .* needs the paged engine"):
        HFEngine.from_model_dir(model_dir, device="cpu", dtype="float32").add_request(
            "r", [5, 6, 7], SamplingParams(max_tokens=0))
