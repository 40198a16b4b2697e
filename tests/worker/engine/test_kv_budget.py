"""The KV cache sized to the machine: the CPU budget rule, max_model_len fitted to the pool (lowered
with a warning, or an explicit one refused with what to change), and requests without max_tokens
admitted without reserving their whole context."""
import logging

import pytest
import torch

from shared.settings import WorkerSettings
from tests.conftest import wire_entry
from worker.engine.engine import LLMEngine
from worker.engine.kv_budget import (GiB, MiB, CpuBudgetRule, KVCacheTooSmall, cpu_budget,
                                     fit_max_model_len)
from worker.engine.types import EngineRejected
from worker.main import build_engine
from worker.admission import to_sampling_params

torch.set_num_threads(1)
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # the tiny model: K and V, 2 layers, 2 KV heads of 16, fp32


@pytest.fixture(scope="module")
def model_dir(build_tiny):
    return build_tiny("kv-budget-llama")


@pytest.mark.parametrize("available, useful, rule, expected", [
    (20 * GiB, 100 * GiB, CpuBudgetRule(), 10 * GiB),  # half of what is available
    (100 * MiB, 100 * GiB, CpuBudgetRule(), 256 * MiB),  # the floor under a low reading
    (200 * GiB, 100 * GiB, CpuBudgetRule(), 32 * GiB),  # the cap on a big host
    (20 * GiB, 64 * MiB, CpuBudgetRule(), 64 * MiB),  # never more than the engine could fill
    (8 * GiB, 100 * GiB, CpuBudgetRule(fraction=0.25, floor=GiB, cap=4 * GiB), 2 * GiB),
    (2 * GiB, 100 * GiB, CpuBudgetRule(fraction=0.25, floor=GiB, cap=4 * GiB), GiB),
])
def test_the_cpu_budget_rule(available, useful, rule, expected):
    assert rule.budget(available, useful) == expected


def test_the_measured_budget_is_capped_by_what_max_num_seqs_full_sequences_use():
    budget, why = cpu_budget(block_bytes=1024, block_size=16, max_num_seqs=2, max_model_len=40)
    assert budget == 2 * 3 * 1024  # 2 sequences of 3 blocks: below the floor, but all they can use
    assert why.startswith("auto: 0.5 x ") and "available after the weights" in why


def test_a_context_that_fits_is_kept_and_one_that_does_not_is_lowered_with_one_warning(caplog):
    assert fit_max_model_len(None, 2048, 200, 16, 512, "kv_cache_memory") == 2048
    assert fit_max_model_len(1000, 2048, 100, 16, 512, "kv_cache_memory") == 1000
    with caplog.at_level(logging.WARNING, logger="kvgate.worker"):
        assert fit_max_model_len(None, 40960, 146, 16, 512, "kv_cache_memory") == 2336
    [record] = caplog.records
    assert "lowered from 40960 to 2336 tokens" in record.getMessage()
    assert "--kv-cache-memory (KVGATE_KV_CACHE_MEMORY) to at least 1310720 bytes" in record.getMessage()


def test_an_explicit_max_model_len_that_does_not_fit_says_what_to_change():
    with pytest.raises(KVCacheTooSmall) as err:
        fit_max_model_len(40960, 40960, 146, 16, 512, "kv_cache_memory")
    assert ("raise --kv-cache-memory (KVGATE_KV_CACHE_MEMORY) to at least 1310720 bytes, or lower "
            "--max-model-len to at most 2336") in str(err.value)
    with pytest.raises(KVCacheTooSmall, match="raise --gpu-memory-utilization"):
        fit_max_model_len(4096, 40960, 10, 16, 512, "gpu_memory_utilization")


def test_the_engine_lowers_the_models_context_to_its_pool_and_reports_it(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvgate.worker"):
        engine = LLMEngine.from_model_dir(model_dir, kv_cache_memory=40 * 16 * TOKEN_BYTES)
    assert engine.max_model_len == 640 and engine.pool.num_blocks == 40
    lowered = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lowered) == 1 and "max_model_len lowered from 2048 to 640 tokens" in lowered[0]
    line = next(r for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert "40 blocks x 16 tokens = 640 tokens, 327680 bytes" in line.getMessage()
    assert "max_model_len 640: 1 sequences of full length fit" in line.getMessage()
    fields = engine.kv_cache_fields()
    ranks = fields.pop("tp_ranks")
    assert fields == {"kv_blocks": 40, "kv_block_size": 16, "kv_tokens": 640, "kv_bytes": 327680,
                      "kv_dtype": "float32", "kv_max_concurrency": 1.0, "tp_size": 1}
    assert len(ranks) == 1 and ranks[0]["kv_bytes"] == 327680 and ranks[0]["weight_bytes"] > 0


def test_the_engine_refuses_an_explicit_context_its_pool_cannot_hold_and_the_advice_works(model_dir):
    with pytest.raises(KVCacheTooSmall) as err:
        LLMEngine.from_model_dir(model_dir, max_model_len=1024, kv_cache_memory=40 * 16 * TOKEN_BYTES)
    assert "at least 524288 bytes" in str(err.value) and "at most 640" in str(err.value)
    engine = LLMEngine.from_model_dir(model_dir, max_model_len=1024, kv_cache_memory=524288)
    assert engine.max_model_len == 1024 == engine.kv_cache.tokens


@pytest.mark.parametrize("kind", ["paged", "hf", "synthetic"])
def test_every_engine_serves_the_context_the_settings_give_and_admits_the_rest_of_it(model_dir, kind):
    engine = build_engine(WorkerSettings(model=str(model_dir), engine=kind, device="cpu", max_model_len=64))
    prompt = list(range(3, 53))
    assert engine.max_model_len == 64
    engine.add_request("rest", prompt, to_sampling_params(_no_max_tokens("rest"), 64 - len(prompt)))
    with pytest.raises(EngineRejected, match=r"= 65 tokens exceeds max_model_len of 64"):
        engine.add_request("over", prompt, to_sampling_params(_no_max_tokens("over"), 15))


def test_requests_without_max_tokens_run_together_where_reserving_their_context_would_not(
        model_dir, hf_greedy, random_prompts):
    """A pool of 1.5 contexts: reserving max_model_len per request admits one at a time; paging
    runs both at once, preempts under pressure, and the outputs still match transformers."""
    engine = LLMEngine.from_model_dir(model_dir, max_model_len=128, num_blocks=12, block_size=16)
    prompts = random_prompts(2, 20, 20, seed=11)
    for i, prompt in enumerate(prompts):
        params = to_sampling_params(_no_max_tokens(str(i)), engine.max_model_len - len(prompt))
        assert params.max_tokens == 108
        engine.add_request(str(i), prompt, params)
    assert 2 * engine.pool.blocks_for(128) > engine.pool.num_blocks
    outputs, peak = {0: [], 1: []}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[int(out.request_id)] += out.new_token_ids
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 2 and engine.stats()["num_preemptions"] >= 1  # both at full length do not fit
    assert [outputs[0], outputs[1]] == hf_greedy(model_dir, prompts, 108)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def _no_max_tokens(request_id: str):
    """A wire entry as the gateway writes one for a client that sent no max_tokens (greedy)."""
    return wire_entry(request_id, "channel", max_tokens=None, params={"ignore_eos": False})
