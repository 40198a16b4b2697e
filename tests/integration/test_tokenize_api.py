"""vLLM's /tokenize and /detokenize end to end, with plain httpx as vLLM's users call them: a real
gateway → Redis → a real worker whose admission answers from the demo model's tokenizer. The ids
are the Hugging Face tokenizer's own; governance is /v1's (401, 403, the key's requests)."""
from __future__ import annotations

import secrets

import httpx
import pytest
from transformers import AutoTokenizer

from tests.integration.test_faults import KEY, Cluster

ADMIN = "sk-kvg-tokenize-admin"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, world!"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("tokenize"), tiny_model_dir)
    c.start_gateway(KVGATE_ADMIN_KEY=ADMIN)
    c.start_worker("w-tokenize")
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


def _post(cluster: Cluster, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(cluster.url + path, json=body, headers=headers, timeout=60)


def _key(cluster: Cluster, name: str, **fields) -> str:
    resp = httpx.post(cluster.url + "/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"},
                      json={"name": name, **fields}, timeout=30)
    assert resp.status_code == 201, resp.text
    return resp.json()["secret"]


def test_tokenize_gives_the_tokenizers_ids_for_a_prompt_and_a_chat(cluster, hf):
    text = "The quick brown fox jumps over the lazy dog."
    out = _post(cluster, "/tokenize", {"model": "demo", "prompt": text, "return_token_strs": True})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["tokens"] == hf.encode(text) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] > 0 and out.headers["x-kvgate-version"]
    bare = _post(cluster, "/tokenize", {"model": "demo", "prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf.encode(text, add_special_tokens=False) and bare["token_strs"] is None

    chat = _post(cluster, "/tokenize", {"model": "demo", "messages": CHAT}).json()
    rendered = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == hf.encode(rendered, add_special_tokens=False)
    plain = _post(cluster, "/tokenize", {"model": "demo", "messages": CHAT, "add_generation_prompt": False}).json()
    assert plain["tokens"] == hf.encode(hf.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)
    assert plain["count"] < chat["count"]  # the generation prompt is rendered only when asked


def test_detokenize_round_trips_and_refuses_ids_past_the_vocabulary_or_context(cluster, hf):
    text = "Round trip: ünïcode, digits 12345, and spaces."
    ids = _post(cluster, "/tokenize", {"model": "demo", "prompt": text}).json()["tokens"]
    back = _post(cluster, "/detokenize", {"model": "demo", "tokens": ids})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": hf.decode(ids)} and text in back.json()["prompt"]

    bad = _post(cluster, "/detokenize", {"model": "demo", "tokens": [5, len(hf) + 7]})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "tokens" and error["code"] == "invalid_token_id"
    assert f"token id {len(hf) + 7} at position 1" in error["message"]
    limit = _post(cluster, "/tokenize", {"model": "demo", "prompt": "x"}).json()["max_model_len"]
    long = _post(cluster, "/detokenize", {"model": "demo", "tokens": [5] * (limit + 1)})
    assert long.status_code == 400 and str(limit) in long.json()["error"]["message"]
    negative = _post(cluster, "/detokenize", {"model": "demo", "tokens": [-1]})
    assert negative.status_code == 422 and negative.json()["error"]["param"].startswith("tokens")


def test_bad_template_options_and_unknown_fields_are_refused_by_name(cluster):
    both = _post(cluster, "/tokenize", {"model": "demo", "messages": CHAT, "continue_final_message": True})
    assert both.status_code == 422 and "continue_final_message" in both.json()["error"]["message"]
    custom = _post(cluster, "/tokenize", {"model": "demo", "prompt": "x", "chat_template": "{{ x }}"})
    assert custom.status_code == 422 and "chat_template" in custom.json()["error"]["message"]
    # a tool's schema chat would refuse is refused here too, by the same words
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "zzz"}}}]
    schema = _post(cluster, "/tokenize", {"model": "demo", "messages": CHAT, "tools": tools})
    chat = _post(cluster, "/v1/chat/completions", {"model": "demo", "messages": CHAT, "tools": tools, "max_tokens": 1})
    assert schema.status_code == chat.status_code == 400, schema.text
    assert schema.json()["error"] == chat.json()["error"]
    assert schema.json()["error"]["param"] == "tools.0.function.parameters"


def test_governance_401_403_and_the_request_counted_with_no_tokens(cluster):
    assert _post(cluster, "/tokenize", {"model": "demo", "prompt": "x"}, key=None).status_code == 401
    assert _post(cluster, "/detokenize", {"model": "demo", "tokens": [1]}, key="sk-kvg-nope").status_code == 401
    other = _key(cluster, "tok-other-" + secrets.token_hex(3), models=["not-demo"])
    denied = _post(cluster, "/tokenize", {"model": "demo", "prompt": "x"}, key=other)
    assert denied.status_code == 403 and denied.json()["error"]["param"] == "model"

    name = "tok-" + secrets.token_hex(3)
    key = _key(cluster, name, rpm=3)
    assert _post(cluster, "/tokenize", {"model": "demo", "prompt": "hello"}, key=key).status_code == 200
    assert _post(cluster, "/detokenize", {"model": "demo", "tokens": [1, 2]}, key=key).status_code == 200
    assert _post(cluster, "/tokenize", {"model": "demo", "messages": CHAT}, key=key).status_code == 200
    limited = _post(cluster, "/tokenize", {"model": "demo", "prompt": "hello"}, key=key)
    assert limited.status_code == 429  # each call was a request of the key's minute
    row = httpx.get(cluster.url + "/admin/usage", params={"key": name, "since": "1d"},
                    headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()["rows"][0]
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (3, 0, 0)


def test_lm_evals_remote_tokenizer_reads_the_info_and_tokenizes_without_naming_the_model(cluster, hf):
    """lm-evaluation-harness's RemoteTokenizer (vLLM's endpoints): GET /tokenizer_info for the special
    tokens and the chat template, /tokenize and /detokenize with no model — the one this key may use —
    and the eos token's text tokenizes to the eos id."""
    headers = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(cluster.url + "/tokenizer_info", headers=headers, timeout=60)
    assert info.status_code == 200, info.text
    body = info.json()
    assert (body["eos_token"], body["bos_token"], body["chat_template"]) == (hf.eos_token, hf.bos_token,
                                                                             hf.chat_template)
    assert body["model_max_length"] > 0 and body["vocab_size"] == len(hf) and body["tokenizer_class"]
    assert httpx.get(cluster.url + "/tokenizer_info", params={"model": "demo"}, headers=headers).json() == body
    eos = _post(cluster, "/tokenize", {"prompt": body["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [hf.eos_token_id]
    text = "lm-eval scores this"
    ids = _post(cluster, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert ids == hf.encode(text, add_special_tokens=False)
    assert _post(cluster, "/detokenize", {"tokens": ids}).json()["prompt"] == text
    # a key that may use no served model (or several) must name one; an unknown one is the usual 404
    narrow = _key(cluster, f"narrow-{secrets.token_hex(3)}", models=["other"])
    refused = _post(cluster, "/tokenize", {"prompt": text}, key=narrow)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_required"
    assert httpx.get(cluster.url + "/tokenizer_info", headers=headers, params={"model": "nope"}).status_code == 404
    assert httpx.get(cluster.url + "/tokenizer_info").status_code == 401
