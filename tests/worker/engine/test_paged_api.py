"""The engine API around the model: seeded sampling, abort, admission, capacity, stats, stops, logprobs."""
import pytest
import torch

from worker.engine.engine import LLMEngine
from worker.engine.llm import LLM
from worker.engine.types import EngineRejected, SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(build_tiny):
    return build_tiny("exact-llama")


def run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_seeded_sampling_is_the_same_alone_in_a_batch_and_after_preemption(model_dir, random_prompts):
    prompts = random_prompts(16, 3, 60, seed=2)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    others = [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True) for _ in prompts[1:]]
    alone = LLM(model_dir).generate(prompts[:1], seeded)[0].token_ids
    in_batch = LLM(model_dir).generate(prompts, [seeded] + others)[0].token_ids
    small = LLM(model_dir, num_blocks=12, block_size=8)
    victims = []
    preempt = small.engine.scheduler._preempt
    small.engine.scheduler._preempt = lambda seq: (victims.append(seq.request_id), preempt(seq))
    last = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True, priority=9)
    preempted = small.generate(prompts, [last] + others)[0].token_ids  # lowest priority: a victim
    assert "0" in victims
    assert alone == in_batch == preempted
    assert len(set(map(tuple, [alone] + [r.token_ids for r in LLM(model_dir).generate(prompts[:1] * 3, others[:3])]))) > 1


def test_abort_frees_blocks_and_reports_once(model_dir, random_prompts):
    engine = LLMEngine.from_model_dir(model_dir, num_blocks=64, block_size=4)
    a, b = random_prompts(2, 20, 30, seed=3)
    engine.add_request("a", a, SamplingParams(max_tokens=40, ignore_eos=True, n=2))
    engine.add_request("b", b, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step(), engine.step()
    engine.abort("a")
    engine.abort("unknown")  # no-op
    assert engine.stats()["num_free_blocks"] > 64 - len(b) // 4 - 3
    outs = run(engine)
    aborted = [o for o in outs if o.request_id == "a"]
    assert sorted(o.index for o in aborted) == [0, 1]
    assert all(o.finished and o.finish_reason == "abort" for o in aborted)
    assert [o.finish_reason for o in outs if o.finished and o.request_id == "b"] == ["length"]
    assert engine.stats()["num_free_blocks"] == 64 and not engine.has_unfinished()


def test_admission_rejects_what_could_never_run_and_names_the_numbers(model_dir):
    engine = LLMEngine.from_model_dir(model_dir, max_model_len=64)
    with pytest.raises(EngineRejected, match=r"40 tokens.*max_tokens \(30\) = 70 .*64"):
        engine.add_request("x", list(range(3, 43)), SamplingParams(max_tokens=30))
    engine = LLMEngine.from_model_dir(model_dir, num_blocks=4, block_size=16)  # context: the pool's 64
    with pytest.raises(EngineRejected, match=r"50 tokens.*max_tokens \(20\) = 70 .*64"):
        engine.add_request("y", list(range(3, 53)), SamplingParams(max_tokens=20))
    with pytest.raises(EngineRejected, match="0 tokens"):
        engine.add_request("z", [], SamplingParams())
    assert not engine.has_unfinished()


def test_free_capacity_and_stats(model_dir):
    engine = LLMEngine.from_model_dir(model_dir, max_num_seqs=4, num_blocks=8, block_size=16)
    assert engine.free_capacity() == 4
    params = SamplingParams(max_tokens=8, ignore_eos=True)  # sampled unseeded: an EOS would end one early
    engine.add_request("a", list(range(3, 40)), params)  # 3 blocks owed
    assert engine.free_capacity() == 3
    engine.add_request("b", list(range(3, 80)), params)  # 5 more: none left
    assert engine.free_capacity() == 0
    stats = engine.stats()
    assert stats == {"num_running": 0, "num_waiting": 2, "kv_usage": 0.0, "prefix_cache_queries": 0,
                     "prefix_cache_hits": 0, "num_preemptions": 0, "num_fair_preemptions": 0,
                     "num_free_blocks": 8, "num_blocks": 8}
    engine.step()
    stats = engine.stats()
    assert stats["num_running"] == 2 and 0 < stats["kv_usage"] <= 1
    assert stats["prefix_cache_queries"] == 37 + 77 and stats["prefix_cache_hits"] == 32  # b starts like a
    run(engine)
    assert engine.free_capacity() == 4


def test_stop_string_across_tokens_cuts_the_text(model_dir, random_prompts):
    llm = LLM(model_dir)
    prompt = random_prompts(1, 10, 10, seed=6)
    free = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[6:10]
    assert stop.strip() and len(free.text) > 12
    cut = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:free.text.index(stop)]


def test_a_stop_string_ends_nothing_within_min_tokens(model_dir):
    """The probe's case: every token is "a" and so is the stop string; the first five are kept, the
    sixth stops (vLLM: stop strings are checked only past min_tokens)."""
    llm = LLM(model_dir)
    assert llm.engine.tokenizer.decode([67]) == "a"
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=["a"], min_tokens=5, logit_bias={67: 100.0})
    out = llm.generate([[5, 17, 301, 42]], params)[0]
    assert (out.text, out.finish_reason, len(out.token_ids)) == ("aaaaa", "stop", 6)


@torch.inference_mode()
def test_logprobs_match_transformers(model_dir, random_prompts):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(1, 12, 12, seed=8)[0]
    result = LLM(model_dir).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = prompt + result.token_ids
    ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, len(prompt) - 1:-1], dim=-1)
    for step, lp in enumerate(result.outputs[0].logprobs):
        assert lp.logprob == pytest.approx(ref[step, lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[step].topk(3).indices.tolist()
