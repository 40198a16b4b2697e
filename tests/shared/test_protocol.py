import orjson
import pytest

from shared import names, protocol


def _entry(**kw):
    base = dict(request_id="r1", reply_channel=names.reply_channel("g1"), model="demo", version="v1",
                kind="chat", messages=[{"role": "user", "content": "hi"}], created=1.0, deadline=2.0)
    return protocol.RequestEntry(**{**base, **kw})


def test_entry_round_trip_keeps_every_field():
    entry = _entry(params=protocol.WireParams(max_tokens=5, stop=["\n"], seed=7), priority=3,
                   trace={"traceparent": "00-abc"})
    assert protocol.decode_entry(protocol.encode(entry)) == entry


@pytest.mark.parametrize("reply", [
    protocol.Delta(request_id="r", seq=1, text="é", token_ids=[3], finish_reason="stop"),
    protocol.Done(request_id="r", seq=2, prompt_tokens=4, completion_tokens=9),
    protocol.ErrorReply(request_id="r", seq=1, code="timeout", message="late"),
])
def test_replies_round_trip_by_type(reply):
    assert protocol.decode_reply(protocol.encode(reply)) == reply


def test_a_steps_replies_travel_as_one_message_in_order():
    replies = [protocol.Delta(request_id="a", seq=1, text="x", token_ids=[1]),
               protocol.Delta(request_id="b", seq=7, text="y", token_ids=[2]),
               protocol.Done(request_id="a", seq=2, prompt_tokens=1, completion_tokens=1)]
    message = protocol.encode_replies([protocol.encode(r) for r in replies])
    assert protocol.decode_replies(message) == replies
    assert protocol.decode_replies(protocol.encode(replies[1])) == [replies[1]]
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_replies(message.replace(f'"v":{protocol.SCHEMA_VERSION}'.encode(), b'"v":99', 1))


def test_unknown_schema_version_is_refused():
    raw = protocol.encode(protocol.Cancel(request_id="r")).replace(f'"v":{protocol.SCHEMA_VERSION}'.encode(), b'"v":99')
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_cancel(raw)
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_reply(b"not json")


def test_the_previous_schema_is_read_and_written_for_an_older_peer():
    err = protocol.ErrorReply(request_id="r", seq=3, code="engine_step_failed", message="m", retryable=True)
    old = orjson.loads(protocol.encode(err, version=protocol.OLDEST_SCHEMA))
    assert old["v"] == 1 and "retryable" not in old  # v1 had no such field
    back = protocol.decode_reply(protocol.encode(err, version=1))
    assert back.v == 1 and back.retryable is False and back.code == err.code
    entry = _entry()
    v1 = protocol.decode_entry(protocol.encode(entry, version=1))
    assert v1.v == 1 and protocol.encode(v1) == protocol.encode(entry, version=1)  # kept on re-encode
    assert protocol.peer_version(None) == 1 and protocol.peer_version(99) == protocol.SCHEMA_VERSION
    with pytest.raises(protocol.ProtocolError):
        protocol.encode(entry, version=protocol.OLDEST_SCHEMA - 1)


def test_an_undecodable_message_still_names_whom_to_answer():
    raw = orjson.dumps({"v": 99, "type": "request", "request_id": "r9", "reply_channel": "kvgate:reply:g"})
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_entry(raw)
    assert protocol.addressee(raw) == ("r9", "kvgate:reply:g")
    assert protocol.addressee(b"[1, 2]") is None and protocol.addressee(b"\xff") is None
    replies = orjson.dumps([{"v": 99, "request_id": "a"}, {"v": 99, "request_id": "b"}, 7])
    assert protocol.addressees(replies) == ["a", "b"]


def test_names_are_namespaced_and_distinct():
    made = {names.request_stream("m", "v"), names.request_stream("m", "v", names.BATCH_LANE),
            names.reply_channel("g"), names.CANCEL_CHANNEL, names.cancelled_key("r"),
            names.WORKERS_ZSET, names.worker_key("w"), names.model_versions_key("m")}
    assert len(made) == 8 and all(n.startswith("kvgate:") for n in made)


def test_schema_3_features_are_dropped_for_a_schema_2_peer_and_named_as_missing():
    entry = _entry(tools=[{"type": "function", "function": {"name": "f"}}],
                   chat_template_kwargs={"enable_thinking": True},
                   params=protocol.WireParams(logit_bias={5: 1.0}))
    v2 = orjson.loads(protocol.encode(entry, version=2))
    assert v2["v"] == 2 and "tools" not in v2 and "chat_template_kwargs" not in v2
    assert protocol.missing_features(entry, 2) == ["tools", "chat_template_kwargs", "logit_bias"]
    assert protocol.missing_features(entry, 3) == [] and protocol.missing_features(_entry(), 1) == []
    delta = protocol.Delta(request_id="r", seq=1, text="a", reasoning="thinking")
    assert "reasoning" not in orjson.loads(protocol.encode(delta, version=2))
    assert protocol.decode_reply(protocol.encode(delta)).reasoning == "thinking"


def test_tokenizer_kinds_are_schema_5_and_never_sent_to_an_older_worker():
    entry = _entry(kind="tokenize", messages=None, prompt="hi",
                   render=protocol.RenderOptions(add_special_tokens=False, return_token_strs=True))
    assert protocol.decode_entry(protocol.encode(entry)) == entry
    assert protocol.missing_features(entry, 4) == ["tokenize"] and protocol.missing_features(entry, 5) == []
    detok = _entry(kind="detokenize", messages=None, prompt_token_ids=[1, 2])
    assert protocol.missing_features(detok, 4) == ["tokenize"]
    assert "render" not in orjson.loads(protocol.encode(entry, version=4))
    delta = protocol.Delta(request_id="r", seq=1, token_ids=[1], token_strs=["▁a"])
    assert protocol.decode_reply(protocol.encode(delta)) == delta
    assert "token_strs" not in orjson.loads(protocol.encode(delta, version=4))


def test_echo_prompt_batched_prompts_and_tokenizer_info_are_schema_8_and_never_sent_to_an_older_worker():
    entry = _entry(kind="completion", messages=None, prompt_token_ids=[1, 2], echo_prompt=True)
    assert protocol.decode_entry(protocol.encode(entry)).echo_prompt
    assert protocol.missing_features(entry, 7) == ["echo"] and protocol.missing_features(entry, 8) == []
    assert b"echo_prompt" not in protocol.encode(entry, version=7)
    for prompts in (["a", "b"], [[1, 2], [3]]):
        batch = _entry(kind="completion", messages=None, prompts=prompts)
        assert protocol.decode_entry(protocol.encode(batch)).prompts == prompts
        assert protocol.missing_features(batch, 7) == ["batched prompts"] and b"prompts" not in protocol.encode(
            batch, version=7)
    info = _entry(kind="tokenizer_info", messages=None)
    assert protocol.decode_entry(protocol.encode(info)) == info
    assert protocol.missing_features(info, 7) == ["tokenizer_info"] and protocol.missing_features(info, 8) == []
    delta = protocol.Delta(request_id="r", seq=1, prompt_texts=["<s> hi", "yo"])
    assert protocol.decode_reply(protocol.encode(delta)).prompt_texts == ["<s> hi", "yo"]
    assert "prompt_texts" not in orjson.loads(protocol.encode(delta, version=7))


def test_the_key_weight_travels_and_an_older_peer_is_not_sent_it():
    entry = _entry(key_id="key_1", weight=2.5)
    assert protocol.decode_entry(protocol.encode(entry)).weight == 2.5
    assert b"weight" not in protocol.encode(entry, version=4)
    assert protocol.decode_entry(protocol.encode(entry, version=4)).weight == 1.0  # the default
    with pytest.raises(ValueError):
        _entry(weight=0)


def test_a_delta_is_written_as_its_model_dump_would_write_it():
    """A Delta skips pydantic's deep copy (protocol._dumped): the bytes are the same, unset fields
    left out and a None inside a logprob entry kept."""
    scores = [{"token_id": 1, "token": "a", "bytes": [97], "logprob": None},
              {"token_id": 2, "token": "b", "bytes": [98], "logprob": -0.5, "rank": 1,
               "top": [["b", -0.5]], "top_ids": [2], "top_bytes": [[98]]}]
    delta = protocol.Delta(request_id="r", seq=1, text="b", token_ids=[2], prompt_logprobs=scores)
    assert orjson.loads(protocol.encode(delta)) == delta.model_dump(exclude_none=True)
    assert "reasoning" not in orjson.loads(protocol.encode(delta))
    assert protocol.decode_reply(protocol.encode(delta, version=3)).prompt_logprobs is None  # v4's field
