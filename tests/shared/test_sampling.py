"""The wire form of SamplingParams is derived from the dataclass, and still the shape gateways and
workers of the previous release write and read (tests/integration/test_request_contract.py walks
the whole path field by field)."""
from __future__ import annotations

import orjson

from shared import names, protocol
from shared.sampling import SamplingParams

# params as schema 1 and 2 wrote them for a request with defaults only (`encode` drops the Nones)
DEFAULT_PARAMS = (b'{"temperature":1.0,"top_p":1.0,"top_k":0,"min_p":0.0,"stop":[],"stop_token_ids":[],'
                  b'"presence_penalty":0.0,"frequency_penalty":0.0,"repetition_penalty":1.0,'
                  b'"ignore_eos":false,"min_tokens":0,"include_stop_str_in_output":false,"n":1}')


def test_the_wire_params_keep_their_json_shape():
    assert orjson.dumps(protocol.WireParams().model_dump(exclude_none=True)) == DEFAULT_PARAMS
    fields = protocol.WireParams.model_fields
    assert fields["max_tokens"].default is None  # absent: the rest of the context, not 16
    assert "priority" not in fields and "cache_salt" not in fields  # on the entry, beside params
    assert SamplingParams().max_tokens == 16  # the engine API's own default is untouched


def test_an_entry_of_the_previous_release_becomes_the_engines_params():
    raw = orjson.dumps({"v": 1, "type": "request", "request_id": "r", "model": "demo", "version": "v1",
                        "reply_channel": names.reply_channel("g"), "kind": "completion",
                        "prompt": "hi", "created": 1.0, "deadline": 2.0, "priority": 3,
                        "cache_salt": "salt", "params": {**orjson.loads(DEFAULT_PARAMS),
                                                         "stop": ["\n"], "seed": 7}})
    entry = protocol.decode_entry(raw)
    assert entry.sampling_params(max_tokens=40) == SamplingParams(
        max_tokens=40, stop=["\n"], seed=7, priority=3, cache_salt="salt")
    given = entry.model_copy(update={"params": protocol.WireParams(max_tokens=5)})
    assert given.sampling_params(max_tokens=40).max_tokens == 5  # a client's own max_tokens stands
