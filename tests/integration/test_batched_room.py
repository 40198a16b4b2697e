"""Through the stack: a batched completion that sets no max_tokens runs each prompt's choices to the end
of the worker's context (vLLM's per-prompt default), not to the room the longest prompt leaves."""
from __future__ import annotations

from openai import OpenAI

from tests.integration.test_faults import KEY, Cluster


def test_each_prompt_of_a_batch_without_max_tokens_runs_to_the_end_of_the_context(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir)
    try:
        c.start_gateway()
        c.start_worker("w-room", "--max-model-len", "64")
        client = OpenAI(base_url=c.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        prompts = [[11] * 10, [12] * 50]
        answer = client.completions.create(model="demo", prompt=prompts, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert [c.finish_reason for c in answer.choices] == ["length", "length"]
        assert answer.usage.completion_tokens == (64 - 10) + (64 - 50)
    finally:
        c.close()
