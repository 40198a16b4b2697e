"""OpenAI's /v1/embeddings end to end with the real openai client: a gateway → Redis → a worker serving
an embedding model folder (a bare Qwen3 base model with sentence-transformers' last-token pooling
and Normalize, Matryoshka) beside a worker of a generative folder. Each vector is transformers' own
(the base model's last hidden state of the input as the folder's tokenizer writes it, pooled and
normalized); usage is the tokens the worker counted; every bound is a clear 4xx naming the field."""
from __future__ import annotations

import base64
import secrets
import time
from array import array

import httpx
import pytest
import torch
from openai import BadRequestError, OpenAI, PermissionDeniedError

from tests.integration.test_faults import FAST_HEARTBEAT, KEY, Cluster

ADMIN = "sk-kvg-embed-admin"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "Embeddings, one vector an input: ünïcode too."]


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory):
    from tests.conftest import TINY
    from worker.models.demo import build_embedding_dir

    return build_embedding_dir(tmp_path_factory.mktemp("embed-model"), matryoshka=True, head_dim=16, **TINY)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, embed_dir, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("embeddings"), embed_dir)
    c.start_gateway(KVGATE_ADMIN_KEY=ADMIN)
    generator = c._spawn("w-chatty", ["worker", "--model", str(tiny_model_dir), "--served-name", "chatty",
                                      "--redis-url", c.redis.url], {**FAST_HEARTBEAT, "KVGATE_WORKER_ID": "w-chatty"})
    c.start_worker("w-embed")
    c.worker_ready("w-chatty", generator)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(embed_dir):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embed_dir))
    model = AutoModel.from_pretrained(str(embed_dir), dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(item, dimensions: int | None = None) -> tuple[list[float], int]:
        ids = tokenizer.encode(item) if isinstance(item, str) else item
        state = model(torch.tensor([ids])).last_hidden_state[0, -1][:dimensions]
        return torch.nn.functional.normalize(state, dim=0).tolist(), len(ids)

    return embed


def client(cluster, key: str = KEY) -> OpenAI:
    return OpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _post(cluster, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(cluster.url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def close(got, want) -> None:
    """fp32 to 1e-4: the worker times its GEMM path at load (oneDNN or MKL, orders of summation apart),
    so vectors differ from transformers' in the last bits, never by what a wrong pooling gives (~0.1)."""
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), torch.tensor(want), atol=1e-4, rtol=1e-3)


def test_the_openai_client_gets_transformers_vectors_in_order_with_usage(cluster, reference):
    """The client asks for base64 by default (and decodes it); float is the same vector as JSON numbers."""
    answer = client(cluster).embeddings.create(model="demo", input=TEXTS)
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == "demo"
    tokens = 0
    for item, d in zip(TEXTS, answer.data):
        want, count = reference(item)
        close(d.embedding, want)
        tokens += count
    assert answer.usage.prompt_tokens == tokens == answer.usage.total_tokens

    floats = _post(cluster, {"model": "demo", "input": TEXTS[0], "encoding_format": "float"})
    assert floats.status_code == 200, floats.text
    body = floats.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    close(body["data"][0]["embedding"], reference(TEXTS[0])[0])
    raw = _post(cluster, {"model": "demo", "input": [TEXTS[0]], "encoding_format": "base64"}).json()
    # the same float32 values: JSON spells each as the shortest decimal that reads back to it
    assert array("f", base64.b64decode(raw["data"][0]["embedding"])) == array("f", body["data"][0]["embedding"])


def test_token_ids_and_matryoshka_dimensions(cluster, reference):
    one = [5, 17, 300, 42]
    answer = client(cluster).embeddings.create(model="demo", input=one, dimensions=24)
    [d] = answer.data
    assert len(d.embedding) == 24 and answer.usage.prompt_tokens == 4
    close(d.embedding, reference(one, 24)[0])
    batch = [[7, 8, 9], one, [1000] * 30]
    answer = client(cluster).embeddings.create(model="demo", input=batch)
    for ids, d in zip(batch, answer.data):
        close(d.embedding, reference(ids)[0])
    assert answer.usage.prompt_tokens == 37


def test_truncate_prompt_tokens_keeps_each_inputs_end(cluster, reference):
    """vLLM's truncate_prompt_tokens: an input past the context is embedded by its last tokens (-1: as
    many as the context holds) instead of refused; the usage counts what was embedded."""
    limit = httpx.get(cluster.url + "/v1/models/demo", headers={"Authorization": f"Bearer {KEY}"}).json()["max_model_len"]
    long = [9 + i % 500 for i in range(limit + 40)]
    refused = _post(cluster, {"model": "demo", "input": [long]})
    assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]
    kept = client(cluster).embeddings.create(model="demo", input=[long, [5, 6, 7]],
                                             extra_body={"truncate_prompt_tokens": -1})
    close(kept.data[0].embedding, reference(long[-limit:])[0])
    close(kept.data[1].embedding, reference([5, 6, 7])[0])
    assert kept.usage.prompt_tokens == limit + 3
    text = "a sentence whose beginning is cut away, and its end kept"
    five = client(cluster).embeddings.create(model="demo", input=text, extra_body={"truncate_prompt_tokens": 5})
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(cluster.model_dir)).encode(text)
    close(five.data[0].embedding, reference(ids[-5:])[0])
    assert five.usage.prompt_tokens == 5


def test_more_inputs_than_the_engine_schedules_at_once_come_back_in_order(cluster, reference):
    texts = [f"input number {i}: " + "word " * (i % 7) for i in range(40)]
    answer = client(cluster).embeddings.create(model="demo", input=texts)
    assert [d.index for d in answer.data] == list(range(40))
    for i in (0, 17, 39):
        close(answer.data[i].embedding, reference(texts[i])[0])


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": ""}, 422, "input", "at least 1 character"),
    ({"input": []}, 422, "input", "must not be empty"),
    ({"input": [[]]}, 422, "input", "at least 1 item"),
    ({"input": ["a", [1, 2]]}, 422, "input", "not a mix"),
    ({"input": ["a"] * 2049}, 422, "input", "at most 2048"),
    ({"input": "a", "encoding_format": "int8"}, 422, "encoding_format", "'float' or 'base64'"),
    ({"input": "a", "dimensions": 0}, 422, "dimensions", "greater than or equal to 1"),
    ({"input": "a", "normalize": False}, 422, "normalize", "Extra inputs"),
    ({"input": "a", "truncate_prompt_tokens": 0}, 422, "truncate_prompt_tokens", "k >= 1, or -1"),
    ({"input": [True, 5]}, 422, "input", "not a mix"),
    ({"input": [5.0, 6]}, 422, "input", "not a mix"),
    ({"input": [[[5]]]}, 422, "input", "valid integer"),
    ({"input": [[5, -1]]}, 422, "input", "greater than or equal to 0"),
    ({"input": {"text": "a"}}, 422, "input", "valid list"),
    ({"input": [[5, 10**6]]}, 400, "input", "input 0's token id 1000000 is outside"),
    ({"input": [[5] * 5000]}, 400, "input", "maximum context length is"),
    ({"input": "a", "dimensions": 65}, 400, "dimensions", "may have 1 to 64"),
])
def test_each_bad_input_is_refused_by_name(cluster, body, status, param, words):
    resp = _post(cluster, {"model": "demo", **body})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"].startswith(param) and words in error["message"], error


def test_each_model_serves_its_own_task(cluster):
    """Refused by the gateway, which the registry tells each worker's task (naming the model), before
    anything is queued; tokenizing on an embedding model still works."""
    with pytest.raises(BadRequestError, match="The model 'chatty' generates text; it does not serve embeddings"):
        client(cluster).embeddings.create(model="chatty", input="hello")
    with pytest.raises(BadRequestError, match="The model 'demo' is an embedding model: it serves /v1/embeddings"):
        client(cluster).chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError, match="embedding model"):
        client(cluster).completions.create(model="demo", prompt="hi", max_tokens=2)
    assert cluster.info("w-embed")["task"] == "embed" and cluster.info("w-chatty")["task"] == "generate"
    assert httpx.post(cluster.url + "/tokenize", json={"model": "demo", "prompt": "hello"},
                      headers={"Authorization": f"Bearer {KEY}"}).json()["count"] > 0
    reply = client(cluster).completions.create(model="chatty", prompt="Hello", max_tokens=3)
    assert reply.usage.completion_tokens >= 1  # the generative worker beside it serves as ever


def test_governance_403_429_and_the_usage_recorded(cluster, reference):
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def key(name: str, **fields) -> str:
        resp = httpx.post(cluster.url + "/admin/keys", headers=admin, json={"name": name, **fields}, timeout=30)
        assert resp.status_code == 201, resp.text
        return resp.json()["secret"]

    with pytest.raises(PermissionDeniedError):
        client(cluster, key("embed-other-" + secrets.token_hex(3), models=["chatty"])).embeddings.create(
            model="demo", input="x")
    name = "embed-" + secrets.token_hex(3)
    tight = key(name, tpm=40)
    assert _post(cluster, {"model": "demo", "input": [[5] * 30]}, key=tight).status_code == 200
    over = _post(cluster, {"model": "demo", "input": [[5] * 30]}, key=tight)
    assert over.status_code == 429 and "tokens" in over.json()["error"]["message"]
    deadline, rows = time.monotonic() + 10, []  # settled once the response has ended
    while not rows and time.monotonic() < deadline:
        rows = httpx.get(cluster.url + "/admin/usage", params={"key": name, "since": "1d"}, headers=admin,
                         timeout=30).json()["rows"]
        time.sleep(0.1)
    assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(1, 30, 0)]


def test_kvgate_up_serves_an_embedding_folder_and_runs_a_batch_of_embeddings(embed_dir, reference, tmp_path):
    """`kvgate up --model` on an embedding folder (its worker embeds), and OpenAI's Batch API with
    endpoint /v1/embeddings through the batch runner: each line's body is the vector the route gives."""
    import io

    import orjson

    from tests.conftest import start_stack, stop_stack

    stack = start_stack(embed_dir, tmp_path / ".kvgate", "paged", {"KVGATE_MAINTENANCE_S": "2"})
    try:
        api = OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0, timeout=60)
        lines = [{"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "demo", "input": [TEXTS[i % 3], f"line {i}"]}} for i in range(6)]
        upload = api.files.create(file=("in.jsonl", io.BytesIO(b"".join(orjson.dumps(x) + b"\n" for x in lines))),
                                  purpose="batch")
        batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 120
        while (batch := api.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.3)
        assert batch.status == "completed" and batch.request_counts.completed == 6, batch
        out = {o["custom_id"]: o for o in map(orjson.loads, api.files.content(batch.output_file_id).text.splitlines())}
        body = out["e-4"]["response"]["body"]
        close(body["data"][0]["embedding"], reference(TEXTS[1])[0])
        close(body["data"][1]["embedding"], reference("line 4")[0])
        assert batch.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out.values())
        assert batch.usage.output_tokens == 0
    finally:
        stop_stack(stack.proc)


def test_a_worker_killed_mid_request_is_taken_over_without_its_answered_inputs(embed_dir, reference, tmp_path):
    """The worker stops (SIGSTOP, then SIGKILL) with some vectors sent: the other worker takes the
    entry over, skips the inputs its checkpoint log says were answered, and the client gets every
    vector, each transformers' own, and the usage once."""
    import signal
    import threading

    from shared import names

    c = Cluster(tmp_path, embed_dir)
    try:
        c.start_gateway()
        victim = c.start_worker("w-victim", "--max-num-seqs", "2", KVGATE_FAULT_STEP_MS="100")
        texts = [f"text {i} " + "more " * (i % 5) for i in range(40)]
        answer = {}
        request = threading.Thread(target=lambda: answer.update(
            r=client(c).embeddings.create(model="demo", input=texts)))
        request.start()
        deadline = time.monotonic() + 60
        while not any(c.client.llen(k) >= 6 for k in c.client.scan_iter(names.checkpoint_key("embd-*"))):
            assert time.monotonic() < deadline, "the victim sent no vectors"
            time.sleep(0.02)
        victim.send_signal(signal.SIGSTOP)  # some vectors out, most not
        c.start_worker("w-survivor")
        victim.send_signal(signal.SIGKILL)
        request.join(120)
        assert not request.is_alive()
        got = answer["r"]
        assert [d.index for d in got.data] == list(range(40))
        for item, d in zip(texts, got.data):
            close(d.embedding, reference(item)[0])
        total = sum(reference(t)[1] for t in texts)
        assert got.usage.prompt_tokens == total
        survivor = c.fresh_info("w-survivor")
        assert survivor["requests_resumed"] == 1
        assert 0 < survivor["stats"]["prefix_cache_queries"] < total  # it embedded only the rest
    finally:
        c.close()
