"""load_tokenizer hands AutoTokenizer a plain config where tokenizer_config.json names its class
(so the model's configuration module, and what transformers imports with it, is not loaded at a
worker's start): the tokenizer must be the one AutoTokenizer picks from the folder's own config,
whichever class the folder declares, including those AutoTokenizer corrects by model type."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from worker.engine.tokenizer import _config_for, load_tokenizer
from worker.models.demo import train_tokenizer

TEXT = "héllo world 你好 <|im_end|> 12345"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("saved-tokenizer")
    train_tokenizer().save_pretrained(path)
    return path


def _folder(root: Path, saved: Path, model_type: str, declared: str | None) -> Path:
    folder = root / f"{model_type}-{declared}"
    folder.mkdir()
    for f in saved.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    if declared is None:
        tokenizer_config.pop("tokenizer_class", None)
    elif declared != "saved":
        tokenizer_config["tokenizer_class"] = declared
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 2048}))
    return folder


# qwen2 is one of the model types whose declared class AutoTokenizer overrides; a ByteLevel
# tokenizer.json declared as LlamaTokenizer is loaded as TokenizersBackend
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("declared", ["saved", "LlamaTokenizerFast", "Qwen2TokenizerFast",
                                      "PreTrainedTokenizerFast", "GPT2Tokenizer", None])
def test_the_tokenizer_is_the_one_autotokenizer_picks_from_the_folders_config(tmp_path, saved, model_type, declared):
    folder = _folder(tmp_path, saved, model_type, declared)
    assert bool(_config_for(folder)) is (declared is not None)  # no class named: AutoTokenizer's own path
    ours = load_tokenizer(folder)
    reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert type(ours) is type(reference)
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.encode(TEXT) == reference.encode(TEXT)
    assert (ours.eos_token, ours.bos_token, ours.chat_template) == (
        reference.eos_token, reference.bos_token, reference.chat_template)


def test_code_of_the_folders_own_takes_autotokenizers_path(tmp_path, saved):
    folder = _folder(tmp_path, saved, "llama", "saved")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["x.Y", None]}}))
    assert _config_for(folder) == {}


def test_loading_it_does_not_import_the_models_configuration_module(tmp_path, saved):
    folder = _folder(tmp_path, saved, "llama", "saved")
    probe = ("import sys; from worker.engine.tokenizer import load_tokenizer; "
             f"load_tokenizer({str(folder)!r}); "
             "print('transformers.models.llama.configuration_llama' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_a_processors_chat_template_json_is_read_where_the_tokenizer_has_none(tmp_path, saved):
    folder, template = _folder(tmp_path, saved, "gemma3", "saved"), load_tokenizer(saved).chat_template
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert load_tokenizer(folder).chat_template is None
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    messages = [{"role": "user", "content": "hi"}]
    got = load_tokenizer(folder).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got == load_tokenizer(saved).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
