"""`kvgate demo-model` writes an ordinary HF folder that loads through the same path as a real one."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shared.settings import WorkerSettings
from worker.engine.types import SamplingParams
from worker.main import build_engine


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "model"
    subprocess.run([sys.executable, "-m", "kvgate", "demo-model", str(out)], check=True,
                   capture_output=True)
    return out


def test_demo_model_is_a_normal_hf_folder(demo_dir):
    names = {p.name for p in demo_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir, local_files_only=True)
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 2e7


def test_demo_model_is_deterministic(demo_dir, tmp_path):
    from worker.models.demo import build_model_dir

    again = build_model_dir(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (demo_dir / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_text() == (demo_dir / "tokenizer.json").read_text()


@pytest.mark.parametrize("engine", ["hf", "paged"])
def test_worker_engine_serves_demo_like_transformers(demo_dir, engine):
    from transformers import AutoModelForCausalLM

    eng = build_engine(WorkerSettings(model=str(demo_dir), engine=engine, device="cpu"))
    from worker.engine.tokenizer import render_chat

    prompt = render_chat(eng.tokenizer, [{"role": "user", "content": "Hello there"}])
    eng.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    got: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            got.extend(out.new_token_ids)
    ref = AutoModelForCausalLM.from_pretrained(demo_dir, local_files_only=True)
    ref.generation_config.eos_token_id = None  # like ignore_eos: never stop, never suppress eos
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12,
                            do_sample=False)[0, len(prompt):].tolist()
    assert got == want
