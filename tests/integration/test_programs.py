"""Programs through the gateway (kvgate up on the tiny model): the same results as the in-process
engine for the same seeds, forks read their shared prefix from the prefix cache, every call counts
against the program's key, and a key without the model gets its 403 as an exception. Also echo and
prompt_logprobs on /v1/completions as an OpenAI client sees them, and lm-evaluation-harness's
loglikelihood request (a prompt of token ids, echoed with its logprobs)."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from kvgate.lang import Endpoint, ProgramError, assistant, function, gen, select, user
from tests.conftest import start_stack, stop_stack


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("programs"), "paged")
    s.admin_key = (s.state / "admin.key").read_text().strip()
    yield s
    stop_stack(s.proc)


@pytest.fixture(scope="module")
def local(tiny_model_dir):
    from kvgate.lang import Local

    backend = Local(tiny_model_dir)
    yield backend
    backend.close()


def _key(stack, **fields) -> tuple[str, str]:
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_key}"}) as admin:
        resp = admin.post("/admin/keys", json={"name": f"prog-{time.monotonic_ns()}", **fields})
    assert resp.status_code == 201, resp.text
    return resp.json()["key"]["name"], resp.json()["secret"]


@function
def mixed(s, topic):
    s += user(f"Tell me about {topic}.")
    s += assistant(gen("answer", max_tokens=6, seed=3, temperature=0.8))
    s += " Verdict:"
    s += select("verdict", [" yes", " no", " maybe so"])
    s += " Code: "
    s += gen("code", max_tokens=8, regex="[a-z]{2,5}", seed=5)
    forks = s.fork(2)
    forks += gen("more", max_tokens=4, seed=1, temperature=1.0)
    forks.join()
    s["more"] = [f["more"] for f in forks]


def test_same_program_same_result_on_both_backends(stack, local):
    endpoint = Endpoint(stack.url, stack.key, "demo")
    try:
        for topic in ("rivers", "stones"):
            remote, here = mixed.run(topic=topic, backend=endpoint), mixed.run(topic=topic, backend=local)
            assert remote.variables == here.variables and remote.text() == here.text()
            assert re.fullmatch("[a-z]{2,5}", remote["code"])
    finally:
        endpoint.close()


@function
def four_ways(s):
    s += "A long shared context that every branch reads. " * 12
    forks = s.fork(4)
    for i, f in enumerate(forks):
        f += f"Branch {i}:"
        f += gen("x", max_tokens=4, seed=i, temperature=1.0)
    forks.join()
    s["xs"] = [f["x"] for f in forks]


def _hits(stack) -> int:
    return stack.worker_info()["stats"]["prefix_cache_hits"]


def test_fork_of_four_reads_the_shared_prefix_from_the_cache(stack):
    info = stack.worker_info()
    block = info["kv_block_size"]
    before = _settled_hits(stack)
    s = four_ways.run(backend=Endpoint(stack.url, stack.key, "demo"))
    assert len(s["xs"]) == 4
    shared = len(s.text())  # characters; the tiny tokenizer's tokens are at least one each
    deadline = time.monotonic() + 10
    while _hits(stack) - before < 3 * block and time.monotonic() < deadline:
        time.sleep(0.2)
    # at least three of the four read the context's full blocks (the first computed them)
    prefix_tokens = _settled_hits(stack) - before
    assert prefix_tokens >= 3 * block and shared > 0


def _settled_hits(stack) -> int:
    """The counter once two heartbeats in a row agree (the registry is a beat behind)."""
    last = _hits(stack)
    while True:
        time.sleep(1.1)
        now = _hits(stack)
        if now == last:
            return now
        last = now


def test_calls_count_against_the_key_and_a_key_without_the_model_gets_403(stack):
    name, secret = _key(stack)
    endpoint = Endpoint(stack.url, secret, "demo")
    s = mixed.run(topic="keys", backend=endpoint)
    # gen, select (the state, then its 3 choices as one batched completion), gen, two forks' gens: 6 requests
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_key}"}) as admin:
        rows = admin.get("/admin/usage", params={"key": name, "since": "1d"}).json()["rows"]
    assert sum(r["requests"] for r in rows) == 6 and s["verdict"]
    _, narrow = _key(stack, models=["other"])
    with pytest.raises(ProgramError) as err:
        mixed.run(topic="keys", backend=Endpoint(stack.url, narrow, "demo"))
    assert err.value.status == 403 and err.value.step == "gen 'answer'" and "demo" in err.value.message


def test_echo_and_prompt_logprobs_on_completions(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack.url + "/v1", api_key=stack.key)
    out = client.completions.create(model="demo", prompt="one two three", max_tokens=2, echo=True,
                                    logprobs=2, temperature=0)
    choice = out.choices[0]
    assert choice.text.startswith("one two three")
    lps = choice.logprobs
    n = out.usage.prompt_tokens
    assert lps.token_logprobs[0] is None and all(v is not None for v in lps.token_logprobs[1:])
    assert len(lps.tokens) == n + 2 and "".join(lps.tokens[:n]) == "one two three"
    raw = httpx.post(stack.url + "/v1/completions", headers={"Authorization": f"Bearer {stack.key}"}, json={
        "model": "demo", "prompt": "one two three", "max_tokens": 1, "prompt_logprobs": 1}).json()
    scores = raw["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == n
    for i, entry in enumerate(scores[1:], start=1):  # the prompt token, and the top one
        assert pytest.approx(lps.token_logprobs[i]) in [v["logprob"] for v in entry.values()]
    stream = client.completions.create(model="demo", prompt="one two", max_tokens=3, echo=True, stream=True,
                                       temperature=0)
    assert "".join(c.choices[0].text for c in stream).startswith("one two")


def test_a_prompt_of_token_ids_is_echoed_as_the_tokenizer_writes_it(stack, tiny_model_dir):
    """lm-evaluation-harness's `local-completions` scores a continuation by sending the tokens of
    context + continuation, echoed with logprobs, max_tokens 1 (its loglikelihood request): the
    answer is the one the same prompt sent as text gets — text, tokens and logprobs — streamed or
    whole, and each of n streamed choices starts with the prompt."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    text = "The cat sat on the mat, and then"
    ids = AutoTokenizer.from_pretrained(str(tiny_model_dir))(text, add_special_tokens=False)["input_ids"]
    client = OpenAI(base_url=stack.url + "/v1", api_key=stack.key)
    lm_eval = {"model": "demo", "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    as_ids, as_text = client.completions.create(prompt=[ids], **lm_eval), client.completions.create(prompt=text, **lm_eval)
    mine, theirs = as_ids.choices[0], as_text.choices[0]
    assert mine.text == theirs.text and mine.text.startswith(text) and len(mine.text) > len(text)
    assert mine.logprobs.tokens == theirs.logprobs.tokens and len(mine.logprobs.tokens) == len(ids) + 1
    assert mine.logprobs.token_logprobs[0] is None
    assert mine.logprobs.token_logprobs[1:] == pytest.approx(theirs.logprobs.token_logprobs[1:], abs=1e-5)
    assert as_ids.usage.prompt_tokens == len(ids)
    stream = client.completions.create(model="demo", prompt=ids, max_tokens=3, n=2, echo=True, stream=True,
                                       temperature=0.9, seed=7)
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1] and all(t.startswith(text) and len(t) > len(text) for t in texts.values())


def test_a_batch_of_prompts_answers_each_as_alone_in_openais_order(stack, tiny_model_dir):
    """OpenAI's batched completion (a list of prompts): prompt p's n choices are p*n .. p*n+n-1, each
    the answer the prompt gets alone (greedy), whole or streamed, its echo and logprobs its own prompt's;
    the usage is the prompts' together, and the key's token budget is reserved for all of them."""
    from openai import OpenAI, RateLimitError
    from transformers import AutoTokenizer

    client = OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0)
    texts = ["one two three", "The river runs", "a"]
    greedy = {"model": "demo", "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=t, **greedy) for t in texts]
    batch = client.completions.create(prompt=texts, n=2, **greedy)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * 4
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=texts, stream=True, **greedy):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}
    # lm-evaluation-harness's batched loglikelihood: token ids, echoed with their logprobs
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    lm_eval = {"model": "demo", "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True}
    scored = client.completions.create(prompt=ids, **lm_eval)
    for p, choice in enumerate(scored.choices):
        one = client.completions.create(prompt=[ids[p]], **lm_eval).choices[0]
        assert choice.index == p and choice.text == one.text and choice.text.startswith(texts[p])
        assert choice.logprobs.tokens == one.logprobs.tokens and len(choice.logprobs.tokens) == len(ids[p]) + 1
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(one.logprobs.token_logprobs[1:], abs=1e-5)
    one = len(ids[1]) + 2
    _, tight = _key(stack, tpm=4 * one)  # one prompt's reservation fits, twice over; sixteen's do not
    small = OpenAI(base_url=stack.url + "/v1", api_key=tight, max_retries=0)
    assert small.completions.create(prompt=[ids[1]], model="demo", max_tokens=2).usage.prompt_tokens == len(ids[1])
    with pytest.raises(RateLimitError):
        small.completions.create(prompt=[ids[1]] * 16, model="demo", max_tokens=2)
    assert small.completions.create(prompt=[ids[1]] * 2, model="demo", max_tokens=2).usage.total_tokens == 2 * one


def test_a_select_past_one_batch_scores_as_the_in_process_engine(stack, local):
    """A select of 20 choices through the gateway (two batched completions of 16 and 4, sent at
    once) picks and scores as the in-process backend does."""
    endpoint = Endpoint(stack.url, stack.key, "demo")
    try:
        choices = [f" option {i}" + " and more" * (i % 3) for i in range(20)]
        state = "Pick the best one of these:"
        remote, here = endpoint.score(state, choices), local.score(state, choices)
        assert remote == pytest.approx(here, abs=1e-4) and len(set(remote)) > 10
        assert endpoint.usage["requests"] == 3
    finally:
        endpoint.close()


def test_max_tokens_0_echoes_the_prompt_with_its_logprobs_and_nothing_more(stack):
    """OpenAI's legacy scoring request (lm-evaluation-harness's `openai-completions` sends it): echo,
    logprobs, max_tokens 0 — the prompt and its tokens' logprobs, those a max_tokens 1 request gets
    for the prompt, no completion; streamed alike; without echo or prompt_logprobs a 400."""
    from openai import OpenAI

    client = OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0)
    scoring = {"model": "demo", "prompt": "one two three four", "echo": True, "logprobs": 3, "temperature": 0}
    zero, one = client.completions.create(max_tokens=0, **scoring), client.completions.create(max_tokens=1, **scoring)
    n = zero.usage.prompt_tokens
    choice = zero.choices[0]
    assert choice.text == "one two three four" and choice.finish_reason == "length"
    assert zero.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == n
    assert choice.logprobs.tokens == one.choices[0].logprobs.tokens[:n]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(one.choices[0].logprobs.token_logprobs[1:n], abs=1e-5)
    streamed = list(client.completions.create(max_tokens=0, stream=True, **{**scoring, "logprobs": None}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "one two three four"
    scores = httpx.post(stack.url + "/v1/completions", headers={"Authorization": f"Bearer {stack.key}"}, json={
        "model": "demo", "prompt": "one two three four", "max_tokens": 0, "prompt_logprobs": 1}).json()
    assert scores["choices"][0]["text"] == "" and len(scores["choices"][0]["prompt_logprobs"]) == n
    bare = httpx.post(stack.url + "/v1/completions", headers={"Authorization": f"Bearer {stack.key}"},
                      json={"model": "demo", "prompt": "x", "max_tokens": 0})
    assert bare.status_code == 400 and bare.json()["error"]["param"] == "max_tokens", bare.text
    assert "generates nothing" in bare.json()["error"]["message"]
