"""Schema 4 adds prompt logprobs: a delta written for an older gateway drops them, and a gateway
refuses a request that asks for them while an older worker serves its stream."""
from __future__ import annotations

import orjson

from shared import protocol
from tests.conftest import wire_entry


def test_an_older_peer_never_sees_prompt_logprobs():
    delta = protocol.Delta(request_id="r", seq=1, text="x", prompt_logprobs=[{"token_id": 5, "logprob": None}])
    assert "prompt_logprobs" in orjson.loads(protocol.encode(delta))
    assert "prompt_logprobs" not in orjson.loads(protocol.encode(delta, 3))
    assert protocol.decode_reply(protocol.encode(delta)).prompt_logprobs == [{"token_id": 5, "logprob": None}]


def test_prompt_logprobs_zero_is_a_feature_an_older_worker_lacks():
    asks = wire_entry("r", "c", params={"prompt_logprobs": 0})
    assert protocol.missing_features(asks, 3) == ["prompt_logprobs"]
    assert protocol.missing_features(asks, 4) == []
    assert protocol.missing_features(wire_entry("r", "c"), 3) == []
