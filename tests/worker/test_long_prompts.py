"""Long prompts are made off the serving loop (worker/prompt_thread.py): while one is rendered and
tokenized, the requests already running go on getting tokens (on the loop, a 900k-character prompt
held every one of them for ~0.45 s), and what the thread makes is what the loop would have made.
One real worker process on a real Redis, fed by XADD as a gateway would."""
from __future__ import annotations

import time

import orjson
import pytest

from shared import names, protocol
from tests.integration.test_faults import Cluster
from tests.worker.test_heard_cancels import publish_cancel
from tests.worker.test_wire_schemas import Channel, entry, xadd
from worker.admission import INLINE_BYTES

LONG = "hello world, this is some text. " * 28_000  # ~900k characters: far beyond the context


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("long"), tiny_model_dir)
    c.start_worker("w1")
    yield c
    c.close()


def _next_items(ch: Channel, timeout: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = ch.pubsub.get_message(timeout=0.5)
        if message and message["type"] == "message":
            items = orjson.loads(message["data"])
            return items if isinstance(items, list) else [items]
    raise AssertionError("no reply")


def test_running_requests_get_tokens_while_a_long_prompt_is_made(cluster):
    ch = Channel(cluster, "long-running")
    xadd(cluster, protocol.encode(entry("runner", ch.name, prompt="Once upon a time",
                                        params={"max_tokens": 1500})))
    while not any(i["request_id"] == "runner" and i["type"] == "delta" for i in _next_items(ch)):
        pass
    # ~5.4M characters, XADDed as no gateway would pass it (its body limit is 1 MiB): ~2.5 s of
    # tokenizing, so the steps the loop takes meanwhile stand well clear of the few it took before
    # the worker picked the entry up, even on a loaded machine
    xadd(cluster, protocol.encode(entry("long", ch.name, prompt=LONG * 6)))
    runner_tokens, runner_done, answer = 0, False, None
    while answer is None:
        for item in _next_items(ch):
            if item["request_id"] == "long":
                answer = item
            elif item["type"] == "delta":
                runner_tokens += len(item["token_ids"])
            else:
                runner_done = True
    assert answer["type"] == "error" and answer["code"] == "context_length_exceeded", answer
    # on the loop, no step would have run while it was tokenized (the tree before: 3 tokens)
    assert runner_tokens >= 20 or runner_done, runner_tokens
    _stop(cluster, "runner")


def _stop(cluster: Cluster, request_id: str) -> None:
    """Cancelled and its entry acknowledged: a 1,500-token runner left going slows every long prompt
    of the tests after it (the thread shares the GIL with the loop's steps: ~25 s on a loaded host)."""
    publish_cancel(cluster, request_id)
    stream, deadline = names.request_stream("demo", "v1"), time.monotonic() + 60
    while cluster.client.xlen(stream) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.client.xlen(stream) == 0, f"{request_id} was not stopped"


def test_a_long_prompt_made_in_the_thread_is_the_tokenizers_own(cluster, tiny_model_dir):
    from worker.engine.tokenizer import encode_prompt, load_tokenizer

    text = "kvgate makes long prompts off the loop. " * 400
    assert len(text) > INLINE_BYTES
    ch = Channel(cluster, "long-tokenize")
    tokenize = entry("tok", ch.name, prompt=text).model_copy(update={"kind": "tokenize"})
    xadd(cluster, protocol.encode(tokenize))
    replies = ch.raw_replies("tok")
    assert replies[-1]["type"] == "done", replies[-1]
    assert replies[0]["token_ids"] == encode_prompt(load_tokenizer(str(tiny_model_dir)), text)


def test_short_entries_start_while_the_thread_is_busy_with_long_ones(cluster):
    """Long prompts queue for the thread; a short one behind them starts at once, not after them."""
    ch = Channel(cluster, "long-queue")
    for i in range(4):
        xadd(cluster, protocol.encode(entry(f"long{i}", ch.name, prompt=LONG + str(i))))
    xadd(cluster, protocol.encode(entry("short", ch.name, prompt="hi")))
    order = []
    while len(order) < 5:
        for item in _next_items(ch, timeout=60):
            if item["type"] in ("done", "error"):
                order.append(item["request_id"])
    # the thread takes two long prompts at a time (AHEAD): the short one ends before the third
    assert order.index("short") < 3, order


def test_a_key_flooding_over_long_prompts_does_not_keep_another_keys_long_prompts_waiting(
        cluster, tiny_model_dir):
    """A prompt made and then refused (beyond the context) took the thread as long as it is long:
    its tenant is charged for it, so under the fair order another tenant's long prompts, within the
    context, go next rather than after every one of the flood's (uncharged, the flood's counter
    stayed the least, and a prompt of the other tenant sent after the flood's last ended after it)."""
    from worker.engine.tokenizer import encode_prompt, load_tokenizer

    within = "the " * 2000
    assert len(encode_prompt(load_tokenizer(str(tiny_model_dir)), within)) + 6 <= 2048
    ch = Channel(cluster, "long-fair")
    sent = [("flood0", "flood"), ("flood1", "flood"), ("flood2", "flood"), ("flood3", "flood"),
            ("light0", "light"), ("flood4", "flood"), ("flood5", "flood"), ("light1", "light")]
    for rid, tenant in sent:  # a flood's prompt takes the thread ~2x as long as a light one's prefill
        prompt = LONG * 2 + rid if tenant == "flood" else within + rid
        raw = protocol.encode(entry(rid, ch.name, prompt=prompt, key_id=tenant))
        assert len(raw) > INLINE_BYTES
        xadd(cluster, raw)
    ends, started = {}, []  # started: each request's first reply, in the order they came
    while len(ends) < len(sent):
        for item in _next_items(ch, timeout=60):
            if item["request_id"] not in started:
                started.append(item["request_id"])
            if item["type"] in ("done", "error"):
                ends[item["request_id"]] = item["type"]
    assert ends["light0"] == ends["light1"] == "done" and ends["flood5"] == "error"
    # made before flood5, light1 has its first token before flood5 is made and refused
    assert started.index("light1") < started.index("flood5"), started


def test_a_cancel_heard_while_its_prompt_is_made_is_honoured(cluster):
    """The client left while its long prompt was in the thread: once made, the entry is acknowledged
    and never started (no reply at all; started, this one would have answered that it is beyond
    the context)."""
    ch = Channel(cluster, "long-cancelled")
    xadd(cluster, protocol.encode(entry("left", ch.name, prompt=LONG * 6)))  # ~2.5 s to tokenize
    time.sleep(0.5)  # taken into the thread
    publish_cancel(cluster, "left")
    xadd(cluster, protocol.encode(entry("after", ch.name, prompt="hi")))
    assert ch.raw_replies("after", timeout=60)[-1]["type"] == "done"
    stream = names.request_stream("demo", "v1")
    deadline = time.monotonic() + 30
    while cluster.client.xlen(stream) and time.monotonic() < deadline:
        message = ch.pubsub.get_message(timeout=0.2)  # anything for "left" is a reply: none may come
        if message and message["type"] == "message":
            assert b'"left"' not in message["data"], message["data"][:200]
    assert cluster.client.xlen(stream) == 0, "the cancelled entry was not acknowledged"
    assert "left" not in ch.got


def test_a_long_echoed_prompt_of_ids_is_decoded_in_the_thread_as_the_loop_would(cluster, tiny_model_dir):
    """Token ids to echo are decoded back to text off the loop when the entry is long (a context's
    worth of ids takes the tokenizer tens of milliseconds): its verdict carries the tokenizer's text."""
    from worker.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    ids = [260 + (i * 7919) % 1700 for i in range(1900)]  # within the context (2,048), past INLINE_BYTES
    ch = Channel(cluster, "long-echo")
    echoed = entry("echo-long", ch.name, prompt_token_ids=ids, echo_prompt=True)
    assert len(protocol.encode(echoed)) > INLINE_BYTES
    xadd(cluster, protocol.encode(echoed))
    replies = ch.raw_replies("echo-long")
    assert replies[-1]["type"] == "done", replies[-1]
    assert replies[0]["prompt_texts"] == [tokenizer.decode(ids, skip_special_tokens=False)]
