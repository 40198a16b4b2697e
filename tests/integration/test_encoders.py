"""BERT-style encoders end to end over HTTP: a gateway → Redis → a worker of a BERT embedding folder
(mean pooling, normalized: all-MiniLM's shape) and one of an XLM-RoBERTa cross-encoder
(bge-reranker's). The openai client gets transformers' vectors; /v1/rerank gets transformers'
scores, best first; an input past the encoder's 512 positions is refused, or truncated keeping its
[CLS] and [SEP]; an encoder never generates."""
from __future__ import annotations

import httpx
import pytest
import torch
from openai import BadRequestError, OpenAI

from tests.integration.test_faults import FAST_HEARTBEAT, KEY, Cluster

TEXTS = ["the worker keeps each block of tokens", "héllo café über straße", "a", "redis queue batch latency"]
QUERY = "what is a cache"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from worker.models.demo import build_encoder_dir

    root = tmp_path_factory.mktemp("encoders")
    return {"embed": build_encoder_dir(root / "minilm", kind="bert", pooling="mean_tokens"),
            "cross": build_encoder_dir(root / "bge-reranker", kind="xlm-roberta", classifier=True)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, folders):
    c = Cluster(tmp_path_factory.mktemp("encoders-stack"), folders["embed"])
    c.start_gateway()
    cross = c._spawn("w-cross", ["worker", "--model", str(folders["cross"]), "--served-name", "cross",
                                 "--redis-url", c.redis.url], {**FAST_HEARTBEAT, "KVGATE_WORKER_ID": "w-cross"})
    c.start_worker("w-embed")
    c.worker_ready("w-cross", cross)
    yield c
    c.close()


@torch.inference_mode()
def _vectors(folder, texts: list[str]) -> list[torch.Tensor]:
    """sentence-transformers' mean pooling over every token, then Normalize, on transformers' states."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder, dtype=torch.float32)
    states = [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0] for t in texts]
    return [torch.nn.functional.normalize(h.mean(0), dim=0) for h in states]


@torch.inference_mode()
def _scores(folder, query: str, documents: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    return [torch.sigmoid(model(**tokenizer(query, d, return_tensors="pt")).logits[0, 0]).item() for d in documents]


def _client(cluster) -> OpenAI:
    return OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_the_openai_client_gets_a_bert_folders_vectors(cluster, folders):
    answer = _client(cluster).embeddings.create(model="demo", input=TEXTS)
    for got, want in zip(answer.data, _vectors(folders["embed"], TEXTS)):
        assert torch.allclose(torch.tensor(got.embedding), want, atol=1e-4)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["embed"])
    assert answer.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)


def test_rerank_by_an_xlm_roberta_cross_encoder(cluster, folders):
    resp = httpx.post(cluster.url + "/v1/rerank", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "cross", "query": QUERY, "documents": TEXTS})
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    want = _scores(folders["cross"], QUERY, TEXTS)
    assert [r["index"] for r in results] == sorted(range(len(TEXTS)), key=lambda i: -want[i])
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
        assert r["document"]["text"] == TEXTS[r["index"]]


def test_an_input_past_the_encoders_positions_is_refused_or_truncated_keeping_its_ends(cluster, folders):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["embed"])
    long = " ".join(["token cache worker"] * 300)  # ~900 tokens: past BERT's 512 positions
    with pytest.raises(BadRequestError, match="maximum context length is 512"):
        _client(cluster).embeddings.create(model="demo", input=long)
    answer = _client(cluster).embeddings.create(model="demo", input=long, extra_body={"truncate_prompt_tokens": -1})
    # the tokenizer's own truncation keeps [CLS], the first 510 tokens and [SEP]
    kept = tokenizer.decode(tokenizer(long, truncation=True, max_length=512)["input_ids"], skip_special_tokens=True)
    [want] = _vectors(folders["embed"], [kept])
    assert answer.usage.prompt_tokens == 512
    assert torch.allclose(torch.tensor(answer.data[0].embedding), want, atol=1e-4)


def test_an_encoder_never_generates(cluster):
    for model in ("demo", "cross"):
        resp = httpx.post(cluster.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model", resp.text
        assert f"'{model}'" in resp.json()["error"]["message"]
    resp = httpx.post(cluster.url + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "cross", "input": "hi"}, timeout=60)
    assert resp.status_code == 400 and "reranker" in resp.json()["error"]["message"], resp.text
