"""`kvgate bench embeddings`: /v1/embeddings' throughput on the demo-sized model (`--model DIR`: any
causal folder) served with task embed (last token, normalized), in tokens of input embedded a second.

Four ways over the same inputs, in one run, each three rounds: the paged engine in-process
(`LLM.embed`, prefix caching off); transformers' base model on left-padded batches of 32 (what a naive
embedding server runs); the engine again on inputs it has embedded before (caching on: every full
block read from the cache); and through `kvgate up` (gateway → Redis → worker, caching off), 16
requests of 16 inputs at once with the openai client's default base64. The engine's vectors are
checked against transformers' on the way (the largest difference is reported).
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvgate.bench.engine import cpu_name
from kvgate.bench.procs import Processes

INPUTS, LENGTHS, ROUNDS, PER_REQUEST = 256, (32, 96), 3, 16
QUICK_INPUTS = 32


def run_bench(quick: bool = False, out_json: str | None = "bench-out/embeddings.json",
              model_dir: str | None = None) -> dict:
    from worker.engine.llm import LLM
    from worker.models.demo import build_model_dir

    with tempfile.TemporaryDirectory(prefix="kvgate-bench-embed-") as tmp:
        path = Path(model_dir) if model_dir else build_model_dir(Path(tmp) / "model", **_quick_sizes(quick))
        rng = random.Random(0)
        inputs = [[rng.randrange(3, 2000) for _ in range(rng.randint(*LENGTHS))]
                  for _ in range(QUICK_INPUTS if quick else INPUTS)]
        tokens = sum(map(len, inputs))
        uncached = LLM(path, task="embed", enable_prefix_caching=False)
        cached = LLM(path, task="embed")
        reference = _transformers(path)
        uncached.embed(inputs[:8]), reference(inputs[:8])  # warm
        cached.embed(inputs)  # every input's blocks in its cache
        rates: dict[str, list[float]] = {"engine": [], "transformers_batch32": [], "engine_cached": []}
        for _ in range(ROUNDS):
            ours = _timed(rates["engine"], tokens, uncached.embed, inputs)
            theirs = _timed(rates["transformers_batch32"], tokens, reference, inputs)
            _timed(rates["engine_cached"], tokens, cached.embed, inputs)
        uncached.close(), cached.close()
        rates["stack"] = _through_stack(path, inputs, tokens, Path(tmp) / "stack")
    report = {
        "cpu": cpu_name(), "inputs": len(inputs), "tokens": tokens, "tok_per_s": rates,
        "max_abs_diff_vs_transformers": max(abs(a - b) for u, v in zip(ours, theirs) for a, b in zip(u, v)),
        "embeddings.vs_transformers": statistics.median(rates["engine"]) / statistics.median(rates["transformers_batch32"]),
        "embeddings.stack_share": statistics.median(rates["stack"]) / statistics.median(rates["engine"]),
    }
    print(json.dumps(report, indent=1))
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(report, indent=1))
    return report


def _quick_sizes(quick: bool) -> dict:
    return dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128) if quick else {}


def _timed(rates: list[float], tokens: int, embed, inputs):
    start = time.perf_counter()
    vectors = embed(inputs)
    rates.append(tokens / (time.perf_counter() - start))
    return vectors


def _transformers(path: Path):
    """Batches of 32, left-padded, the last position's state, normalized."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(inputs: list[list[int]], batch: int = 32) -> list[list[float]]:
        vectors = []
        for i in range(0, len(inputs), batch):
            chunk = inputs[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(x)) + x for x in chunk])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
            last = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
            vectors += torch.nn.functional.normalize(last, dim=-1).tolist()
        return vectors

    return embed


def _through_stack(path: Path, inputs: list[list[int]], tokens: int, log_dir: Path) -> list[float]:
    from openai import AsyncOpenAI

    procs = Processes(log_dir)
    try:
        server = procs.kvgate("embed", path, "paged", {"KVGATE_TASK": "embed", "KVGATE_ENABLE_PREFIX_CACHING": "false"})

        async def rounds() -> list[float]:
            client = AsyncOpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=600)
            await client.embeddings.create(model="demo", input=inputs[:8])
            rates = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                answers = await asyncio.gather(*(client.embeddings.create(model="demo", input=inputs[i:i + PER_REQUEST])
                                                 for i in range(0, len(inputs), PER_REQUEST)))
                rates.append(tokens / (time.perf_counter() - start))
                if sum(a.usage.prompt_tokens for a in answers) != tokens:
                    raise RuntimeError("the stack charged other token counts than the inputs have")
            await client.close()
            return rates

        return asyncio.run(rounds())
    finally:
        procs.stop_all()
