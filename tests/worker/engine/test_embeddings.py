"""Embeddings from the paged engine are transformers' final hidden states (fp32), pooled as the folder
says — the last token's, or the mean over every token, summed chunk by chunk — cut to a Matryoshka
length and normalized, however the inputs are chunked, batched, preempted or read from the prefix
cache; and each bound is refused by name."""
from __future__ import annotations

from array import array

import pytest
import torch

from worker.engine import pooling
from worker.engine.llm import LLM
from worker.engine.sequence import SequenceStatus
from worker.engine.types import EngineRejected, SamplingParams

from .conftest import TINY


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from worker.models.demo import build_embedding_dir

    def build(name, **kw):  # (Qwen3's default heads are 128 wide)
        return build_embedding_dir(tmp_path_factory.mktemp(name), **{**TINY, "head_dim": 16, **kw})

    return {"last": build("embed-last", matryoshka=True),
            "mean": build("embed-mean", pooling="mean_tokens", normalize=False, arch="llama", bare=False),
            "cut": build("embed-cut", matryoshka=[16, 32])}


@torch.inference_mode()
def expected(model_dir, inputs, mode: str, normalize: bool, length: int | None = None) -> list[torch.Tensor]:
    """transformers' base model, one input at a time (no padding), pooled as sentence-transformers does."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vectors = []
    for ids in inputs:
        states = model(torch.tensor([ids])).last_hidden_state[0]
        v = states[-1] if mode == "last" else states.mean(dim=0)
        v = v[:length] if length else v
        vectors.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return vectors


def close(got, want) -> None:
    """fp32 to 1e-4: the engine times its GEMM path at load (oneDNN or MKL, orders of summation apart),
    so vectors differ from transformers' in the last bits, never by what a wrong pooling gives (~0.1)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == w.numel()
        torch.testing.assert_close(torch.tensor(g), w, atol=1e-4, rtol=1e-3)


def test_last_token_chunked_batched_and_cached(folders, random_prompts):
    inputs = random_prompts(6, 5, 70, seed=1)
    llm = LLM(folders["last"], block_size=8, max_num_batched_tokens=24, dtype="float32")
    want = expected(folders["last"], inputs, "last", True)
    sample, sampled = llm.engine.runner.sampler.sample, []
    llm.engine.runner.sampler.sample = lambda logits, rows: sampled.append(rows) or sample(logits, rows)
    close(llm.embed(inputs), want)
    assert not sampled  # an input's rows never reach the sampler (nor the head's logits)
    queries = llm.engine.pool.num_queries
    hits = llm.engine.pool.num_hits
    close(llm.embed(inputs), want)  # again: every full block but the last token's from the cache
    assert llm.engine.pool.num_queries > queries and llm.engine.pool.num_hits > hits
    assert all(abs(sum(x * x for x in v) - 1) < 1e-5 for v in llm.embed(inputs[:2]))
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_mean_is_summed_over_chunks_and_never_read_from_the_cache(folders, random_prompts):
    inputs = random_prompts(4, 30, 90, seed=2)
    llm = LLM(folders["mean"], block_size=8, max_num_batched_tokens=16, dtype="float32")
    want = expected(folders["mean"], inputs, "mean", False)
    close(llm.embed(inputs), want)
    hits = llm.engine.pool.num_hits
    close(llm.embed(inputs), want)
    assert llm.engine.pool.num_hits == hits  # a mean needs every position's state: none taken from the cache


def test_a_preempted_mean_input_starts_its_sum_again(folders, random_prompts):
    """Preempted part-way through its prefill (the fair order's yield), an input recomputes from its
    first token, and its sum with it."""
    inputs = random_prompts(1, 60, 60, seed=4)
    llm = LLM(folders["mean"], block_size=8, max_num_batched_tokens=16, dtype="float32")
    engine = llm.engine
    engine.add_embedding("r", inputs, SamplingParams(max_tokens=1))
    engine.step(), engine.step()
    [seq] = engine.requests["r"]
    assert 0 < seq.num_computed_tokens < seq.num_tokens and seq.pooled is not None
    assert engine.yield_slot({"r"}, priority=0) and seq.num_computed_tokens == 0
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    [out] = outputs
    close([array("f", out.embedding).tolist()], expected(folders["mean"], inputs, "mean", False))


def test_matryoshka_lengths_are_cut_then_normalized(folders, random_prompts):
    inputs = random_prompts(3, 10, 30, seed=5)
    llm = LLM(folders["last"], block_size=8, dtype="float32")
    close(llm.embed(inputs, dimensions=20), expected(folders["last"], inputs, "last", True, 20))
    listed = LLM(folders["cut"], block_size=8, dtype="float32")
    close(listed.embed(inputs, dimensions=32), expected(folders["cut"], inputs, "last", True, 32))
    with pytest.raises(EngineRejected, match="may have 16, 32"):
        listed.engine.add_embedding("r", inputs, SamplingParams(max_tokens=1), dimensions=20)


def test_a_request_holds_at_most_at_once_inputs_in_the_scheduler(folders, random_prompts):
    inputs = random_prompts(40, 3, 12, seed=6)
    llm = LLM(folders["last"], block_size=8, max_num_seqs=64, dtype="float32")
    engine = llm.engine
    engine.add_embedding("many", inputs, SamplingParams(max_tokens=1))
    engine.add_embedding("few", inputs[:3], SamplingParams(max_tokens=1))
    schedule, seen, done = engine.scheduler.schedule, [], {}

    def watched():
        batch = schedule()
        seen.append(sum(s.request_id == "many" for s in engine.scheduler.waiting + engine.scheduler.running))
        return batch
    engine.scheduler.schedule = watched
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.request_id, set()).add(out.index)
    assert max(seen) == pooling.AT_ONCE and len(seen) >= 3  # 40 inputs, 16 at a time
    assert done == {"many": set(range(40)), "few": {0, 1, 2}}
    assert not engine.requests and not engine.embedding_queue and not engine.embedding_open


def test_an_aborted_request_leaves_nothing_queued(folders, random_prompts):
    llm = LLM(folders["last"], block_size=8, dtype="float32")
    engine = llm.engine
    engine.add_embedding("gone", random_prompts(30, 3, 12, seed=7), SamplingParams(max_tokens=1))
    engine.step()
    queued = [s for s in engine.requests["gone"] if s.status == SequenceStatus.QUEUED]
    assert queued
    engine.abort("gone")
    outputs = engine.step()
    assert {o.finish_reason for o in outputs} == {"abort"}
    assert not engine.has_unfinished() and not engine.embedding_queue
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_takeover_skips_the_inputs_already_answered(folders, random_prompts):
    inputs = random_prompts(5, 5, 20, seed=8)
    llm = LLM(folders["last"], block_size=8, dtype="float32")
    llm.engine.add_embedding("r", inputs, SamplingParams(max_tokens=1), finished={0, 3})
    indices = set()
    while llm.engine.has_unfinished():
        indices |= {o.index for o in llm.engine.step()}
    assert indices == {1, 2, 4}


def test_each_bound_is_refused_by_name(folders, build_tiny):
    llm = LLM(folders["cut"], block_size=8, dtype="float32")
    engine, params = llm.engine, SamplingParams(max_tokens=1)
    refusals = [
        ([[5] * 3] * (pooling.MAX_INPUTS + 1), None, "2049 inputs; a request embeds 1 to 2048"),
        ([], None, "0 inputs"),
        ([[5, engine.vocab_size]], None, f"input token id {engine.vocab_size} at position 1"),
        ([[5], []], None, "input 1 has 0 tokens"),
        ([[5] * (engine.max_model_len + 1)], None, f"maximum context length is {engine.max_model_len}"),
        ([[5]] * 2048, None, "send at most"),  # 2048 x 64 floats fit; cut below the bytes bound to check it
    ]
    for inputs, dimensions, words in refusals[:-1]:
        with pytest.raises(EngineRejected, match=words):
            engine.add_embedding("r", inputs, params, dimensions)
    assert not engine.requests
    plain = LLM(folders["mean"], block_size=8, dtype="float32").engine
    with pytest.raises(EngineRejected, match="not a Matryoshka model"):
        plain.add_embedding("r", [[5, 6]], params, dimensions=8)
    plain.add_embedding("r", [[5, 6]], params, dimensions=plain.model_config.hidden_size)  # its own length
    with pytest.raises(EngineRejected, match="embedding model: it serves /v1/embeddings"):
        engine.add_request("g", [5, 6], params)
    generator = LLM(build_tiny("embed-generator"), block_size=8, dtype="float32").engine
    with pytest.raises(EngineRejected, match="does not serve embeddings"):
        generator.add_embedding("r", [[5, 6]], params)


def test_the_bytes_bound_names_how_many_inputs_fit(monkeypatch):
    monkeypatch.setattr(pooling, "MAX_BYTES", 64 * 4 * 10)
    with pytest.raises(EngineRejected, match="send at most 10 inputs a request"):
        pooling.check(None, 64, 11, None)
    assert pooling.check(None, 64, 10, None) == 64


def test_embed_task_serves_a_causal_folder_by_its_last_token(build_tiny, random_prompts):
    folder = build_tiny("embed-task-causal")
    inputs = random_prompts(3, 5, 25, seed=9)
    llm = LLM(folder, block_size=8, dtype="float32", task="embed")
    close(llm.embed(inputs), expected(folder, inputs, "last", True))


def test_tp2_pools_on_rank_0_as_tp1_does(folders, random_prompts):
    """Each rank holds the whole hidden states after its all-reduce; rank 0 pools, the others skip."""
    inputs = random_prompts(4, 5, 40, seed=10)
    with LLM(folders["mean"], block_size=8, max_num_batched_tokens=24, dtype="float32",
             tensor_parallel_size=2) as tp2:
        close(tp2.embed(inputs), expected(folders["mean"], inputs, "mean", False))
