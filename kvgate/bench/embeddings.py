"""`kvgate bench embeddings`: /v1/embeddings' throughput on the demo-sized model (`--model DIR`: any
causal folder) served with task embed (last token, normalized), in tokens of input embedded a second.

Four ways over the same inputs, in one run, each three rounds: the paged engine in-process
(`LLM.embed`, prefix caching off); transformers' base model on left-padded batches of 32 (what a naive
embedding server runs); the engine again on inputs it has embedded before (caching on: every full
block read from the cache); and through `kvgate up` (gateway → Redis → worker, caching off), 16
requests of 16 inputs at once with the openai client's default base64. The engine's vectors are
checked against transformers' on the way (the largest difference is reported).

`--encoder` (or an encoder `--model`): a BERT folder of all-MiniLM-L6's sizes (mean pooling, as
sentence-transformers serves it) on kvgate's encoder engine, against transformers the way
sentence-transformers' `encode` runs it (inputs sorted by length, right-padded batches of 32, the
masked mean, normalized); no cached round (an encoder caches nothing).
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


MINILM = dict(hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536)  # all-MiniLM-L6-v2's


def run_bench(quick: bool = False, out_json: str | None = "bench-out/embeddings.json",
              model_dir: str | None = None, encoder: bool = False) -> dict:
    from worker.engine.llm import LLM
    from worker.models.demo import build_encoder_dir, build_model_dir
    from worker.models.pooling import is_encoder_folder

    with tempfile.TemporaryDirectory(prefix="kvgate-bench-embed-") as tmp:
        if model_dir:
            path = Path(model_dir)
        elif encoder:
            path = build_encoder_dir(Path(tmp) / "encoder", kind="bert", pooling="mean_tokens",
                                     **({} if quick else MINILM))
        else:
            path = build_model_dir(Path(tmp) / "model", **_quick_sizes(quick))
        encoder = is_encoder_folder(path)
        rng = random.Random(0)
        inputs = [_input(rng, encoder) for _ in range(QUICK_INPUTS if quick else INPUTS)]
        tokens = sum(map(len, inputs))
        uncached = LLM(path, task="embed", enable_prefix_caching=False)
        cached = None if encoder else LLM(path, task="embed")
        reference = _sentence_transformers(path) if encoder else _transformers(path)
        uncached.embed(inputs[:8]), reference(inputs[:8])  # warm
        rates: dict[str, list[float]] = {"engine": [], "transformers_batch32": []}
        if cached:
            cached.embed(inputs)  # every input's blocks in its cache
            rates["engine_cached"] = []
        for _ in range(ROUNDS):
            ours = _timed(rates["engine"], tokens, uncached.embed, inputs)
            theirs = _timed(rates["transformers_batch32"], tokens, reference, inputs)
            if cached:
                _timed(rates["engine_cached"], tokens, cached.embed, inputs)
        uncached.close()
        if cached:
            cached.close()
        rates["stack"] = _through_stack(path, inputs, tokens, Path(tmp) / "stack")
    report = {
        "cpu": cpu_name(), "model": "encoder (all-MiniLM-L6 sizes)" if encoder and not model_dir else str(path.name),
        "inputs": len(inputs), "tokens": tokens, "tok_per_s": rates,
        "max_abs_diff_vs_transformers": max(abs(a - b) for u, v in zip(ours, theirs) for a, b in zip(u, v)),
        "embeddings.vs_transformers": statistics.median(rates["engine"]) / statistics.median(rates["transformers_batch32"]),
        "embeddings.stack_share": statistics.median(rates["stack"]) / statistics.median(rates["engine"]),
    }
    print(json.dumps(report, indent=1))
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(report, indent=1))
    return report


def _input(rng: random.Random, encoder: bool) -> list[int]:
    """Random ids, 32 to 96 of them; an encoder's framed by its [CLS] (2) and [SEP] (3) as the demo
    BERT tokenizer numbers them, from its 1,024-token vocabulary."""
    body = [rng.randrange(5, 1000 if encoder else 2000) for _ in range(rng.randint(*LENGTHS))]
    return [2, *body[2:], 3] if encoder else body


def _sentence_transformers(path: Path):
    """As sentence-transformers' `encode` runs a BERT folder: sorted by length, right-padded batches of
    32, the mean over the real tokens, normalized, answered in the inputs' order."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(inputs: list[list[int]], batch: int = 32) -> list[list[float]]:
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        vectors: list = [None] * len(inputs)
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            width = max(len(inputs[i]) for i in chunk)
            ids = torch.tensor([inputs[i] + [0] * (width - len(inputs[i])) for i in chunk])
            mask = torch.tensor([[1] * len(inputs[i]) + [0] * (width - len(inputs[i])) for i in chunk])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            mean = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
            for i, v in zip(chunk, torch.nn.functional.normalize(mean, dim=-1).tolist()):
                vectors[i] = v
        return vectors

    return embed


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
