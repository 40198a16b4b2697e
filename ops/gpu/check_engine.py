"""The GPU check's engine sections, each run in a process of its own by check.py: the transformers
baselines (which also build the model folder) first, then the paged engine eager, then with CUDA
graphs. Each engine variant reports its rate, the Triton compiles its timed run caused (0 expected),
and a few greedy generations with logprobs that check.py compares across the variants."""
from __future__ import annotations

import importlib
import random
import time
from pathlib import Path

import torch

from check_common import Report, Scale, sync

TOP_LOGPROBS = 5  # alternatives kept per greedy step, to tell a near tie from a wrong token


def make_requests(s: Scale, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, output length) pairs, the same in every process."""
    rng = random.Random(seed)
    return [([rng.randrange(3, 2000) for _ in range(rng.randint(*s.prompt_len))], rng.randint(*s.output_len))
            for _ in range(s.num_requests)]


def greedy_prompts(s: Scale) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in s.greedy_prompts]


def build_llama_like(path: Path, s: Scale):
    """A random-weight Llama-3.2-1B-shaped folder (llama3 RoPE scaling, tied embeddings) plus the
    demo tokenizer; returns the transformers model, kept for the baselines."""
    import transformers

    from worker.models.demo import train_tokenizer

    tokenizer = train_tokenizer(vocab_size=2048)
    config = transformers.LlamaConfig(
        **s.model, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype=s.dtype_name)
    torch.manual_seed(0)
    with torch.device(s.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=s.dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    model.generation_config.eos_token_id = None  # like ignore_eos: generate the full length
    model.generation_config.save_pretrained(path)
    return model.eval()


def hf_baselines(report: Report, s: Scale, model_dir: Path) -> None:
    """Builds the model folder the engine variants load, then times transformers on it."""
    requests = make_requests(s)
    report.put("engine.requests", len(requests))
    report.put("engine.output_tokens", sum(o for _, o in requests))
    model = build_llama_like(model_dir, s)
    report.put("hf.sequential.tokens_per_s", hf_sequential(model, requests, s))
    report.put("hf.static.tokens_per_s", hf_static(model, requests, s))


@torch.inference_mode()
def hf_sequential(model, requests, s: Scale) -> float:
    """transformers generate, one request at a time, until the time allowance is spent."""
    device = model.device
    model.generate(torch.tensor([[5] * 16], device=device), max_new_tokens=4, do_sample=False,
                   pad_token_id=0)  # warm-up
    sync(s.device)
    tokens, start = 0, time.perf_counter()
    for prompt, out_len in requests:
        model.generate(torch.tensor([prompt], device=device), max_new_tokens=out_len,
                       min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        tokens += out_len
        if time.perf_counter() - start > s.hf_seconds:
            break
    sync(s.device)
    print(f"  sequential: {tokens} tokens in {time.perf_counter() - start:.1f}s")
    return tokens / (time.perf_counter() - start)


@torch.inference_mode()
def hf_static(model, requests, s: Scale) -> float:
    """Padded static batches (left-padded, each runs to its longest output); counts only the
    tokens each request asked for."""
    device = model.device
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(requests), s.static_batch):
        batch = requests[i:i + s.static_batch]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        longest = max(o for _, o in batch)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=0)
        tokens += sum(o for _, o in batch)
        if time.perf_counter() - start > s.hf_seconds:
            break
    sync(s.device)
    print(f"  static: {tokens} useful tokens in {time.perf_counter() - start:.1f}s")
    return tokens / (time.perf_counter() - start)


def engine_variant(report: Report, s: Scale, model_dir: Path, name: str) -> None:
    """`eager` or `graphs`: the timed run, then the greedy generations check.py compares."""
    from worker.engine.engine import LLMEngine

    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"no model folder at {model_dir}: the engine.hf section builds it")
    engine = LLMEngine.from_model_dir(model_dir, **engine_config(s, name))
    warm_up(engine, s)
    before = jit_compiles()
    tokens, seconds = timed_run(engine, make_requests(s), s)
    after = jit_compiles()
    report.put(f"engine.{name}.tokens_per_s", tokens / seconds)
    report.put(f"engine.{name}.jit_compiles_timed", None if before is None else after - before)
    report.put(f"engine.{name}.graph_steps", getattr(engine.runner, "num_graph_steps", None))
    report.put(f"engine.{name}.greedy", greedy(engine, greedy_prompts(s), s.greedy_tokens), quiet=True)


def tp_variant(report: Report, s: Scale, model_dir: Path) -> None:
    """Tensor parallelism over 2 GPUs (NCCL, a rank per GPU, CUDA graphs captured per rank): the
    timed run and the greedy generations check.py compares with the one-GPU graphs run. Skipped,
    saying so, with one GPU visible; --smoke runs it on the CPU over gloo."""
    from worker.engine.engine import LLMEngine

    gpus = torch.cuda.device_count() if s.device == "cuda" else 2
    if gpus < 2:
        report.put("engine.tp.skipped", f"{gpus} GPU visible: tensor parallelism needs 2")
        return
    engine = LLMEngine.from_model_dir(model_dir, **engine_config(s, "graphs"), tensor_parallel_size=2)
    try:
        warm_up(engine, s)
        tokens, seconds = timed_run(engine, make_requests(s), s)
        report.put("engine.tp.tokens_per_s", tokens / seconds)
        report.put("engine.tp.comm_share", engine.runner.shard.comm_seconds / seconds)
        report.put("engine.tp.graph_steps", getattr(engine.runner, "num_graph_steps", None))
        report.put("engine.tp.rank_memory", list(engine.runner.rank_memory), quiet=True)
        report.put("engine.tp.greedy", greedy(engine, greedy_prompts(s), s.greedy_tokens), quiet=True)
    finally:
        engine.close()


def engine_config(s: Scale, name: str) -> dict:
    """KV sized by the work rather than the free memory. On a CPU (--smoke) nothing is captured, so
    `graphs` runs its decode steps through the graphs' padded buffers instead."""
    total = s.num_requests * (s.prompt_len[1] + s.output_len[1])
    config = dict(device=s.device, dtype=s.dtype_name, attention_backend="triton", block_size=s.block_size,
                  max_num_seqs=s.num_requests, max_num_batched_tokens=max(2048, 8 * s.prompt_len[1]),
                  max_model_len=s.prompt_len[1] + s.output_len[1] + 16,
                  num_blocks=2 * -(-total // s.block_size), enforce_eager=name == "eager")
    if name == "graphs" and s.device != "cuda":
        config["pad_decode_eagerly"] = True
    return config


def warm_up(engine, s: Scale) -> None:
    """Two short requests: the first attend builds every Triton kernel variant, and the allocator
    settles."""
    from worker.engine.types import SamplingParams

    params = SamplingParams(max_tokens=min(8, s.output_len[0]), temperature=0.0, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"warm{i}", [5 + i] * 16, params)
    while engine.has_unfinished():
        engine.step()
    sync(s.device)


def timed_run(engine, requests, s: Scale) -> tuple[int, float]:
    """Output tokens and seconds for all requests at once."""
    from worker.engine.types import SamplingParams

    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0.0,
                                                           ignore_eos=True))
    tokens = 0
    while engine.has_unfinished() and time.perf_counter() - start < s.engine_seconds:
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    seconds = time.perf_counter() - start
    if engine.has_unfinished():
        print(f"  engine stopped after {seconds:.0f}s with {tokens} tokens (rate so far)")
        for i in range(len(requests)):
            engine.abort(f"r{i}")
        while engine.has_unfinished():
            engine.step()
    return tokens, seconds


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[dict]]:
    """Per prompt, per step: the token, its logprob and the top alternatives. All prompts at once,
    so the decode batch (padded up to a graph bucket) holds them together."""
    from worker.engine.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    steps: dict[str, list[dict]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
        steps[f"g{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            for lp in out.logprobs or []:
                steps[out.request_id].append({"token": lp.token_id, "logprob": lp.logprob, "top": lp.top})
    return list(steps.values())


def jit_compiles() -> int | None:
    """Kernels Triton has built (or loaded from its disk cache) in this process; None when they
    are interpreted."""
    kernels = [getattr(importlib.import_module(f"worker.kernels.{module}"), name) for module, name in (
        ("decode_attention", "_decode_partial_kernel"), ("decode_attention", "_decode_merge_kernel"),
        ("extend_attention", "_extend_kernel"), ("kv_write", "_write_kv_kernel"))]
    caches = [getattr(kernel, "device_caches", None) for kernel in kernels]
    if any(cache is None for cache in caches):
        return None
    return sum(len(entry[0]) for cache in caches for entry in cache.values())


def compare_greedy(eager: list[list[dict]], graphs: list[list[dict]], tolerance: float) -> dict:
    """Graph replay must generate what eager does: the same tokens, their logprobs within
    `tolerance`, until a near tie (eager's own logprob of the token graphs chose within `tolerance`
    of its best), after which the two contexts differ and comparing stops."""
    identical, worst, first_divergence, ok = 0, 0.0, [], len(eager) == len(graphs)
    for e_steps, g_steps in zip(eager, graphs):
        ok = ok and len(e_steps) == len(g_steps) > 0
        first_divergence.append(None)
        for step, (e, g) in enumerate(zip(e_steps, g_steps)):
            if e["token"] != g["token"]:
                alternative = dict((token, lp) for token, lp in e["top"]).get(g["token"])
                ok = ok and alternative is not None and e["logprob"] - alternative <= tolerance
                first_divergence[-1] = step
                break
            identical += 1
            worst = max(worst, abs(e["logprob"] - g["logprob"]))
    return {"tokens": sum(len(steps) for steps in eager), "identical_tokens": identical,
            "first_divergence": first_divergence, "max_logprob_diff": worst, "tolerance": tolerance,
            "ok": ok and worst <= tolerance}
