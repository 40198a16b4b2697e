"""Programs on the demo-shaped tiny model: the in-process backend, and transformers' reference for select."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def local(tiny_model_dir):
    from kvgate.lang import Local

    backend = Local(tiny_model_dir, dtype="float32", block_size=8)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def reference_select(tiny_model_dir):
    """select's rule in transformers (fp32): the mean logprob of the choice's tokens after the state,
    tokenized as a completion prompt is."""
    from transformers import AutoModelForCausalLM

    from worker.engine.tokenizer import encode_prompt, load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(tiny_model_dir)

    @torch.inference_mode()
    def scores(state: str, choices: list[str]) -> list[float]:
        start = len(encode_prompt(tokenizer, state))
        out = []
        for choice in choices:
            ids = encode_prompt(tokenizer, state + choice)
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            first = min(start, len(ids) - 1)
            out.append(sum(logprobs[i - 1, ids[i]].item() for i in range(first, len(ids))) / (len(ids) - first))
        return out

    return scores
