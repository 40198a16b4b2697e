"""Shared by the paged-engine tests: tiny random models and transformers' greedy reference."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="session")
def build_tiny(tmp_path_factory):
    """build_tiny(name, arch, **overrides) -> a tiny HF folder, built once per session per name."""
    from worker.models.demo import build_model_dir

    built: dict[str, Path] = {}

    def build(name: str, arch: str = "llama", **kw) -> Path:
        if name not in built:
            built[name] = build_model_dir(tmp_path_factory.mktemp(name), arch=arch, **{**TINY, **kw})
        return built[name]

    return build


@pytest.fixture(scope="session")
def random_prompts():
    """Ids from the middle of the vocabulary: no special tokens, so no EOS inside prompts."""

    def make(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 2000) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]

    return make


@pytest.fixture(scope="session")
def hf_greedy():
    """transformers generate in fp32, one prompt at a time, stopping at EOS as the engine does."""

    @torch.inference_mode()
    def generate(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        outs = []
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=model.config.pad_token_id)
            outs.append(out[0, len(p):].tolist())
        return outs

    return generate
