"""One request contract: every field of the OpenAI request models reaches the engine unchanged, and
every engine sampling field is reachable from a request, through the real path — an HTTP body →
the gateway's validation and `to_sampling_params()` → the entry it XADDs → the worker's decode and
`to_sampling_params` → engine SamplingParams. A field added on one side only (shared/sampling.py
or gateway/schemas.py) fails here by name. The worker is played at the protocol level (it records
the raw entry), so the entry is read exactly as a worker reads it; no engine runs."""
from __future__ import annotations

import dataclasses
import time
from typing import get_args

import httpx
import orjson
import pytest
from pydantic.fields import FieldInfo

from gateway.schemas import ChatCompletionRequest, CompletionRequest
from shared import protocol
from shared.sampling import SamplingParams
from tests.integration.test_faults import HEADERS, Cluster, _wait
from tests.integration.test_schema_skew import MODEL, ProtocolPeer
from worker.admission import to_sampling_params

REST = 50  # what the worker passes as "the rest of the context" for a request without max_tokens
NOT_SAMPLING = {"model", "stream", "stream_options", "user", "messages", "prompt", "echo",  # routing,
                "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",  # on the entry
                "reasoning_effort"}  # the template's (in chat_template_kwargs)
COMPLETIONS_ONLY = {"prompt_logprobs", "prompt_logprobs_start"}  # a chat refuses them (unsupported.py)
FROM_THE_KEY = {"cache_salt"}  # the engine field no request sets          # response shape, refused
CONSTRAINT = {"json": None, "json_object": False, "regex": None, "choice": None, "grammar": None}
SAMPLES = {"stop": ("halt", ["halt"]), "stop_token_ids": ([7], [7]),  # (request value, engine value)
           "logit_bias": ({"7": -100}, {7: -100.0}),
           "structured_outputs": ({"regex": "[ab]+"}, {**CONSTRAINT, "regex": "[ab]+"})}
SPELLED = {  # the other spellings of structured_outputs: (what the body says, what the engine gets)
    "response_format": ({"response_format": {"type": "json_object"}},
                        {"structured_outputs": {**CONSTRAINT, "json_object": True}}),
    "guided_json": ({"guided_json": {"type": "object"}},
                    {"structured_outputs": {**CONSTRAINT, "json": '{"type":"object"}'}}),
    "guided_regex": ({"guided_regex": "[ab]+"}, {"structured_outputs": {**CONSTRAINT, "regex": "[ab]+"}}),
    "guided_choice": ({"guided_choice": ["a", "b"]},
                      {"structured_outputs": {**CONSTRAINT, "choice": ["a", "b"]}}),
    "guided_grammar": ({"guided_grammar": 'root ::= "a"'},
                       {"structured_outputs": {**CONSTRAINT, "grammar": 'root ::= "a"'}}),
}
RESPELLED = {**SPELLED,  # chat's OpenAI spellings: (what the body says, what the engine gets)
    "max_completion_tokens": ({"max_completion_tokens": 5}, {"max_tokens": 5}),
    "logprobs": ({"logprobs": True}, {"logprobs": 0}),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
}
ROUTES = [
    ("/v1/chat/completions", ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]},
     RESPELLED),
    ("/v1/completions", CompletionRequest, {"prompt": "hi"}, SPELLED),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("contract"), tiny_model_dir)
    c.start_gateway()
    c.peer = ProtocolPeer(c.redis.url, speaks=protocol.SCHEMA_VERSION, advertise=True)
    c.peer.start()
    _wait(lambda: MODEL in [m["id"] for m in httpx.get(c.url + "/v1/models", headers=HEADERS,
                                                      timeout=2).json()["data"]], c.procs[0])
    yield c
    c.peer.stopping.set()
    c.peer.join(5)
    c.close()


def _engine_params(cluster: Cluster, route: str, body: dict) -> SamplingParams:
    """What the engine gets for `body`: the entry the gateway queued, decoded as a worker does."""
    seen = len(cluster.peer.entries)
    resp = httpx.post(cluster.url + route, json={"model": MODEL, **body}, headers=HEADERS, timeout=30)
    assert resp.status_code == 200, f"{body}: {resp.text}"
    deadline = time.monotonic() + 5
    while len(cluster.peer.entries) == seen and time.monotonic() < deadline:
        time.sleep(0.01)
    raw = orjson.dumps(cluster.peer.entries[-1])
    return to_sampling_params(protocol.decode_entry(raw), REST)


def _sample(name: str, info: FieldInfo) -> tuple:
    """A valid value other than the field's default, from its type and bounds, with what the engine
    should get for it (the same, but for the SAMPLES)."""
    if name in SAMPLES:
        return SAMPLES[name]
    kinds = set(get_args(info.annotation) or [info.annotation]) - {type(None)}
    bound = {k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le")
             if getattr(m, k, None) is not None}
    low, high = bound.get("ge", bound.get("gt")), bound.get("le")
    if kinds == {bool}:
        return not info.default, not info.default
    if kinds == {int}:
        value = (low if info.default is None else info.default) + 1
    elif kinds == {float} and high is not None:
        value = (info.default + high) / 2 if info.default < high else (low + info.default) / 2
    else:
        raise AssertionError(f"add a sample value of `{name}` to SAMPLES")
    assert high is None or value <= high, name
    return value, value


@pytest.mark.parametrize("route, model, base, respelled", ROUTES, ids=["chat", "completions"])
def test_every_request_field_reaches_the_engine_unchanged(cluster, route, model, base, respelled):
    baseline = _engine_params(cluster, route, base)
    assert all(getattr(baseline, k) for k in FROM_THE_KEY), "the key's cache salt reaches the engine"
    # the request's defaults are the engine's; no max_tokens is the rest of the context
    assert dataclasses.replace(baseline, **dict.fromkeys(FROM_THE_KEY)) == SamplingParams(max_tokens=REST)
    reached = set()
    for name, info in model.model_fields.items():
        if name in NOT_SAMPLING:
            continue
        if name in respelled:
            asks, expected = respelled[name]
        else:
            value, engine_value = _sample(name, info)
            asks, expected = {name: value}, {name: engine_value}
        got = dataclasses.asdict(_engine_params(cluster, route, {**base, **asks}))
        changed = {k: v for k, v in got.items() if v != getattr(baseline, k)}
        assert changed == expected, f"{route} field `{name}` = {asks}: the engine got {changed}"
        reached |= set(changed)
    only_text = COMPLETIONS_ONLY if model is ChatCompletionRequest else set()
    unreachable = {f.name for f in dataclasses.fields(SamplingParams)} - FROM_THE_KEY - only_text - reached
    assert not unreachable, f"{route}: no request field sets {sorted(unreachable)}"
