"""/v1/rerank and /v1/score end to end over HTTP: a gateway → Redis → workers of two rerankers (a
Qwen3 <X>ForSequenceClassification folder scored by its `score` head, and a causal LM served with
--task score and two answer tokens) beside a worker of a generative folder. Each score is
transformers' own (the folder's model over the pair as its tokenizer encodes it); the documents come
back best first with their indices; usage is the tokens the worker counted; every bad body is a
clear 4xx naming the field, refused before anything is queued; a model serves only its own task."""
from __future__ import annotations

import secrets
import signal
import subprocess
import threading
import time

import httpx
import pytest
import torch

from gateway.scores_api import PAIR_CHARS
from shared import names
from tests.integration.test_faults import FAST_HEARTBEAT, KEY, Cluster

ADMIN = "sk-kvg-rerank-admin"
QUERY = "what is a cache"
# scored 0.01 to 0.99 by both demo rerankers, none within 0.005 of another: the order is the scores'
DOCS = ["the worker keeps each block of tokens", "héllo café 😀 über straße", "a", "redis queue batch latency",
        "the model makes a token, then the next one", "你好 世界 日本語", "water"]
# the causal folder's answer tokens ("Ġno", "Ġthe": each one token of the demo tokenizer), as
# Qwen3-Reranker's "no,yes": the score is P(second) of the two
ANSWERS = ("Ġno", "Ġthe")


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    from tests.conftest import TINY
    from worker.models.demo import build_reranker_dir

    return build_reranker_dir(tmp_path_factory.mktemp("reranker"), head_dim=16, **TINY)


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    from tests.conftest import TINY
    from worker.models.demo import build_reranker_dir

    return build_reranker_dir(tmp_path_factory.mktemp("causal-reranker"), classifier=False, head_dim=16, **TINY)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, reranker_dir, causal_dir, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("rerank"), reranker_dir)
    c.start_gateway(KVGATE_ADMIN_KEY=ADMIN)
    others = {"w-chatty": ["--model", str(tiny_model_dir), "--served-name", "chatty"],
              "w-yesno": ["--model", str(causal_dir), "--served-name", "yesno", "--task", "score",
                          "--score-tokens", ",".join(ANSWERS)]}
    procs = {name: c._spawn(name, ["worker", *args, "--redis-url", c.redis.url],
                            {**FAST_HEARTBEAT, "KVGATE_WORKER_ID": name}) for name, args in others.items()}
    c.start_worker("w-rerank")
    for name, proc in procs.items():
        c.worker_ready(name, proc)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(reranker_dir):
    """transformers' score of each (query, document) pair, and its tokens, by the classifier folder."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reranker_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(reranker_dir), dtype=torch.float32).eval()

    @torch.inference_mode()
    def score(query: str, document: str) -> tuple[float, int]:
        ids = tokenizer(query, document)["input_ids"]
        return torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item(), len(ids)

    return score


def _post(cluster, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(cluster.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def close(got: float, want: float) -> None:
    """To 1e-4: the worker's timed GEMM path moves the last bits, never by what a wrong pair gives."""
    assert abs(got - want) < 1e-4, (got, want)


def test_rerank_is_transformers_scores_best_first_with_each_index_and_document(cluster, reference):
    want = [reference(QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i][0])
    assert all(want[a][0] - want[b][0] > 1e-3 for a, b in zip(order, order[1:])), "scores too close to order"
    body = _ok(_post(cluster, "/v1/rerank", {"model": "demo", "query": QUERY, "documents": DOCS}))
    assert body["model"] == "demo" and body["id"].startswith("score-")
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        close(r["relevance_score"], want[r["index"]][0])
        assert r["document"] == {"text": DOCS[r["index"]]}
    tokens = sum(count for _, count in want)
    assert body["usage"]["prompt_tokens"] == tokens == body["usage"]["total_tokens"]


def test_top_n_return_documents_document_objects_and_every_path_answer_alike(cluster, reference):
    want = {i: reference(QUERY, d)[0] for i, d in enumerate(DOCS)}
    best = sorted(want, key=lambda i: -want[i])
    top = _ok(_post(cluster, "/v1/rerank", {"model": "demo", "query": QUERY, "documents": DOCS, "top_n": 2,
                                            "return_documents": False}))
    assert [r["index"] for r in top["results"]] == best[:2]
    assert all(set(r) == {"index", "relevance_score"} for r in top["results"])
    assert top["usage"]["prompt_tokens"] == sum(reference(QUERY, d)[1] for d in DOCS)  # all scored, two kept
    objects = [{"text": d} for d in DOCS]
    answers = [_ok(_post(cluster, path, {"model": "demo", "query": QUERY, "documents": objects, "top_n": 4}))
               for path in ("/v1/rerank", "/rerank", "/v2/rerank")]
    for answer in answers:
        assert [(r["index"], r["document"]["text"]) for r in answer["results"]] == [(i, DOCS[i]) for i in best[:4]]
        for r in answer["results"]:
            close(r["relevance_score"], want[r["index"]])
    assert len({a["id"] for a in answers}) == 3
    every = _ok(_post(cluster, "/v1/rerank", {"model": "demo", "query": QUERY, "documents": DOCS, "top_n": 0}))
    assert [r["index"] for r in every["results"]] == best


def test_score_one_to_many_and_pairwise_by_index(cluster, reference):
    many = _ok(_post(cluster, "/v1/score", {"model": "demo", "text_1": QUERY, "text_2": DOCS}))
    assert many["object"] == "list" and many["model"] == "demo" and isinstance(many["created"], int)
    assert [(d["index"], d["object"]) for d in many["data"]] == [(i, "score") for i in range(len(DOCS))]
    for d, doc in zip(many["data"], DOCS):
        close(d["score"], reference(QUERY, doc)[0])
    queries = [f"question {i}: " + DOCS[-1 - i] for i in range(len(DOCS))]
    pairwise = _ok(_post(cluster, "/score", {"model": "demo", "text_1": queries, "text_2": DOCS}))
    for d, query, doc in zip(pairwise["data"], queries, DOCS):
        close(d["score"], reference(query, doc)[0])
    assert pairwise["usage"]["prompt_tokens"] == sum(reference(q, d)[1] for q, d in zip(queries, DOCS))
    one = _ok(_post(cluster, "/v1/score", {"model": "demo", "text_1": DOCS[0], "text_2": DOCS[1]}))
    [d] = one["data"]
    close(d["score"], reference(DOCS[0], DOCS[1])[0])


def test_a_causal_lm_with_answer_tokens_scores_by_their_softmax(cluster, causal_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(causal_dir))
    model = AutoModelForCausalLM.from_pretrained(str(causal_dir), dtype=torch.float32).eval()
    answers = tokenizer.convert_tokens_to_ids(list(ANSWERS))
    with torch.inference_mode():
        want = [model(torch.tensor([tokenizer(QUERY, d)["input_ids"]])).logits[0, -1, answers].softmax(-1)[1].item()
                for d in DOCS]
    assert cluster.info("w-yesno")["task"] == "score" and cluster.info("w-rerank")["task"] == "score"
    body = _ok(_post(cluster, "/v1/rerank", {"model": "yesno", "query": QUERY, "documents": DOCS}))
    assert [r["index"] for r in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for r in body["results"]:
        close(r["relevance_score"], want[r["index"]])


def _queued(cluster) -> str:
    """The reranker's request stream's last id: it moves with every entry XADDed, answered or not."""
    info = cluster.info("w-rerank")
    stream = names.request_stream("demo", info["version"])
    return cluster.client.xinfo_stream(stream)["last-generated-id"]


RERANK = {"model": "demo", "query": QUERY, "documents": DOCS[:2]}
HUGE = {"model": "demo", "query": "q" * 500_000, "documents": [f"document {i}" for i in range(20)]}


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/rerank", {**RERANK, "temperature": 0}, 422, "temperature", "Extra inputs"),
    ("/v1/rerank", {**RERANK, "documents": []}, 422, "documents", "at least 1 item"),
    ("/v1/rerank", {**RERANK, "documents": ["d"] * 2049}, 422, "documents", "at most 2048"),
    ("/v1/rerank", {**RERANK, "query": ""}, 422, "query", "at least 1 character"),
    ("/v1/rerank", {**RERANK, "top_n": -1}, 422, "top_n", "greater than or equal to 0"),
    ("/v1/rerank", {**RERANK, "top_n": 2049}, 422, "top_n", "less than or equal to 2048"),
    ("/v1/rerank", {**RERANK, "documents": ["a", 5]}, 422, "documents", "documents[1] is a int: each document is a text"),
    ("/v1/rerank", {**RERANK, "return_documents": "yes"}, 422, "return_documents", "valid boolean"),
    ("/v1/rerank", {**RERANK, "top_n": True}, 422, "top_n", "valid integer"),
    ("/v1/rerank", {**RERANK, "documents": "a"}, 422, "documents", "valid list"),
    ("/v1/rerank", {**RERANK, "documents": [{"text": ""}]}, 422, "documents.0", "at least 1 character"),
    ("/v1/rerank", {**RERANK, "documents": [{"txt": "a"}]}, 422, "documents.0", "Field required"),
    ("/v1/rerank", {**RERANK, "query": ["q"]}, 422, "query", "valid string"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS}, 422, "model", "Field required"),
    ("/v1/score", {"model": "demo", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_1",
     "text_1 has 2 texts and text_2 3"),
    ("/v1/score", {"model": "demo", "text_1": ["a", "b"], "text_2": "c"}, 400, "text_1", "text_1 has 2 texts"),
    ("/v1/score", {"model": "demo", "text_1": "a", "text_2": []}, 422, "text_2", "at least 1 item"),
    ("/v1/score", {"model": "demo", "text_1": "a", "text_2": ["b", ""]}, 422, "text_2.1", "at least 1 character"),
    ("/v1/score", {"model": "demo", "text_1": "a", "text_2": ["b"] * 2049}, 422, "text_2", "at most 2048"),
    ("/v1/score", {"model": "demo", "text_1": "a"}, 422, "text_2", "Field required"),
    ("/v1/rerank", HUGE, 400, "documents", f"at most {PAIR_CHARS}"),
    ("/v1/score", {"model": "demo", "text_1": "x" * 450_000, "text_2": ["y"] * 20}, 400, "text_2",
     f"at most {PAIR_CHARS}"),
])
def test_each_bad_body_is_refused_by_name_before_anything_is_queued(cluster, path, body, status, param, words):
    _ok(_post(cluster, "/v1/rerank", RERANK))  # the stream exists, and the worker serves between bad bodies
    before = _queued(cluster)
    resp = _post(cluster, path, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error
    assert error["param"] == param if param is None else error["param"].startswith(param), error
    assert _queued(cluster) == before, "a refused body was queued"


def test_a_body_that_is_not_a_json_object_is_refused_and_the_worker_serves_on(cluster, reference):
    before = _queued(cluster)
    for content, words in ((b"{not json", "not valid JSON"), (b"\xff\xfe", "not UTF-8"), (b"", "empty"),
                           (b"[1, 2]", "must be a JSON object")):
        resp = httpx.post(cluster.url + "/v1/rerank", content=content, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert resp.status_code == 422, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"], error
    assert _queued(cluster) == before
    info = cluster.fresh_info("w-rerank")
    assert info["requests_rejected"] == info["requests_failed"] == 0  # no bad body reached it
    body = _ok(_post(cluster, "/v1/rerank", RERANK))
    for r in body["results"]:
        close(r["relevance_score"], reference(QUERY, DOCS[r["index"]])[0])


def test_2048_documents_are_scored_and_a_pair_past_the_context_is_refused_by_the_worker(cluster, reference):
    docs = [f"doc {i}" for i in range(2048)]
    body = _ok(_post(cluster, "/v1/rerank", {"model": "demo", "query": "q", "documents": docs, "top_n": 2048,
                                             "return_documents": False}))
    assert sorted(r["index"] for r in body["results"]) == list(range(2048))
    for r in body["results"][::400]:
        close(r["relevance_score"], reference("q", docs[r["index"]])[0])
    info = cluster.fresh_info("w-rerank")
    limit, rejected = info["max_model_len"], info["requests_rejected"]
    long = _post(cluster, "/v1/score", {"model": "demo", "text_1": "word " * limit, "text_2": ["a", "b"]})
    assert long.status_code == 400, long.text
    error = long.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"maximum context length is {limit}" in error["message"]
    assert cluster.fresh_info("w-rerank")["requests_rejected"] == rejected + 1  # the worker counts the tokens
    _ok(_post(cluster, "/v1/rerank", RERANK))


def test_each_model_serves_its_own_task(cluster):
    """Refused by the gateway, naming the model, before anything is queued."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body, words in (
            ("/v1/embeddings", {"model": "demo", "input": "hello"}, "The model 'demo' is a reranker"),
            ("/v1/chat/completions", {"model": "demo", **chat}, "The model 'demo' is a reranker"),
            ("/v1/completions", {"model": "yesno", "prompt": "hi", "max_tokens": 2}, "The model 'yesno' is a reranker"),
            ("/v1/rerank", {**RERANK, "model": "chatty"}, "The model 'chatty' generates text; it does not score"),
            ("/v1/score", {"model": "chatty", "text_1": "a", "text_2": "b"}, "The model 'chatty' generates text")):
        resp = _post(cluster, path, body)
        assert resp.status_code == 400, (path, resp.text)
        error = resp.json()["error"]
        assert error["param"] == "model" and words in error["message"], (path, error)
    assert cluster.info("w-chatty")["task"] == "generate"
    _ok(_post(cluster, "/v1/chat/completions", {"model": "chatty", **chat}))  # the generative worker beside it


def test_governance_403_429_and_the_usage_recorded(cluster, reference):
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def key(name: str, **fields) -> str:
        resp = httpx.post(cluster.url + "/admin/keys", headers=admin, json={"name": name, **fields}, timeout=30)
        assert resp.status_code == 201, resp.text
        return resp.json()["secret"]

    other = key("rerank-other-" + secrets.token_hex(3), models=["chatty"])
    for path, body in (("/v1/rerank", RERANK), ("/v1/score", {"model": "demo", "text_1": "a", "text_2": "b"})):
        resp = _post(cluster, path, body, key=other)
        assert resp.status_code == 403 and "demo" in resp.json()["error"]["message"], resp.text
    name = "rerank-" + secrets.token_hex(3)
    once = key(name, rpm=1)
    body = _ok(_post(cluster, "/v2/rerank", RERANK, key=once))
    tokens = sum(reference(QUERY, d)[1] for d in RERANK["documents"])
    assert body["usage"]["prompt_tokens"] == tokens
    over = _post(cluster, "/v1/score", {"model": "demo", "text_1": "a", "text_2": "b"}, key=once)
    assert over.status_code == 429, over.text
    deadline, rows = time.monotonic() + 10, []  # settled once the response has ended
    while not rows and time.monotonic() < deadline:
        rows = httpx.get(cluster.url + "/admin/usage", params={"key": name, "since": "1d"}, headers=admin,
                         timeout=30).json()["rows"]
        time.sleep(0.1)
    assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(1, tokens, 0)]


def test_a_worker_of_schema_9_beside_is_never_sent_scores_it_cannot_read(cluster):
    """A rolling upgrade: a worker of the previous release (schema 9, no `texts` nor `pairs`) still
    serves the reranker's stream, so each score is a retryable 503 naming the feature, not queued."""
    import orjson

    old = {**cluster.info("w-rerank"), "worker_id": "w-old", "schema": 9, "ts": time.time()}
    cluster.client.set(names.worker_key("w-old"), orjson.dumps(old), ex=30)
    cluster.client.zadd(names.WORKERS_ZSET, {"w-old": time.time() + 30})
    try:
        time.sleep(0.6)  # the gateway reads the registry again after half a second
        before = _queued(cluster)
        for path, body in (("/v1/rerank", RERANK), ("/v1/score", {"model": "demo", "text_1": "a", "text_2": "b"})):
            resp = _post(cluster, path, body)
            assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
            error = resp.json()["error"]
            assert error["code"] == "upgrade_in_progress" and error["param"] == "scores", error
        assert _queued(cluster) == before
    finally:
        cluster.client.zrem(names.WORKERS_ZSET, "w-old")
        cluster.client.delete(names.worker_key("w-old"))


def test_a_worker_killed_mid_request_is_taken_over_and_the_answer_is_whole(cluster, reranker_dir, reference):
    """The worker stops (SIGSTOP, then SIGKILL) with some pairs' scores sent: another worker takes the
    entry over, scores the rest, and the client gets every document ranked, each score
    transformers' own, and the usage once."""
    def spawn(name: str, *flags: str, **env) -> subprocess.Popen:
        proc = cluster._spawn(name, ["worker", "--model", str(reranker_dir), "--served-name", "takeover",
                                     "--redis-url", cluster.redis.url, *flags],
                              {**FAST_HEARTBEAT, "KVGATE_WORKER_ID": name, **env})
        return cluster.worker_ready(name, proc)

    victim = spawn("w-victim", "--max-num-seqs", "2", KVGATE_FAULT_STEP_MS="100")
    docs = [f"document {i}: " + "word " * (i % 5) for i in range(40)]
    earlier = set(cluster.client.scan_iter(names.checkpoint_key("score-*")))  # the other tests' requests
    answer = {}
    request = threading.Thread(target=lambda: answer.update(r=_post(
        cluster, "/v1/rerank", {"model": "takeover", "query": QUERY, "documents": docs})))
    request.start()
    deadline = time.monotonic() + 60
    while not any(cluster.client.llen(k) >= 6 for k in cluster.client.scan_iter(names.checkpoint_key("score-*"))
                  if k not in earlier):
        assert time.monotonic() < deadline, "the victim sent no scores"
        time.sleep(0.02)
    victim.send_signal(signal.SIGSTOP)  # some scores out, most not
    spawn("w-survivor")
    victim.send_signal(signal.SIGKILL)
    request.join(120)
    assert not request.is_alive()
    body = _ok(answer["r"])
    want = [reference(QUERY, d) for d in docs]
    assert sorted(r["index"] for r in body["results"]) == list(range(40))
    got = [r["relevance_score"] for r in body["results"]]
    assert got == sorted(got, reverse=True)
    for r in body["results"]:
        close(r["relevance_score"], want[r["index"]][0])
        assert r["document"]["text"] == docs[r["index"]]
    total = sum(count for _, count in want)
    assert body["usage"]["prompt_tokens"] == total
    survivor = cluster.fresh_info("w-survivor")
    assert survivor["requests_resumed"] == 1
    assert 0 < survivor["stats"]["prefix_cache_queries"] < total  # it scored only the rest
