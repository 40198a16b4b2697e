"""A model folder's generation_config.json sets the default of each sampling field a request leaves
out, and only of those: read and checked (worker/model_defaults.py), named on the entry by the
gateway (`left_to_model`), applied by the worker (`to_sampling_params`), dropped for an older peer."""
import json
import logging

import pytest

from gateway.schemas import ChatCompletionRequest, CompletionRequest
from shared import protocol
from shared.sampling import MODEL_DEFAULTS
from worker.admission import to_sampling_params
from worker.model_defaults import read_model_defaults, said

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def folder(tmp_path, config) -> str:
    (tmp_path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(tmp_path)


def test_what_the_file_sets_is_read(tmp_path):
    defaults = read_model_defaults(folder(tmp_path, QWEN3))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert said(defaults) == "temperature=0.6 top_p=0.95 top_k=20"


@pytest.mark.parametrize("config", [{}, {"temperature": None}, "not json", "[1, 2]"])
def test_a_file_that_sets_nothing_usable_gives_nothing(tmp_path, config):
    assert read_model_defaults(folder(tmp_path, config)) == {}


def test_no_file_or_no_folder_gives_nothing(tmp_path):
    assert read_model_defaults(str(tmp_path)) == {} and read_model_defaults("") == {}


def test_a_value_out_of_range_is_skipped_with_a_warning(tmp_path, caplog):
    bad = {"temperature": -1, "top_p": 0, "top_k": 2.5, "min_p": 0.05, "repetition_penalty": True}
    with caplog.at_level(logging.WARNING, logger="kvgate.worker"):
        assert read_model_defaults(folder(tmp_path, bad)) == {"min_p": 0.05}
    assert all(name in caplog.text for name in ("temperature", "top_p", "top_k", "repetition_penalty"))


def test_the_gateway_names_what_the_client_left_out():
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=1.0, top_k=5)
    assert chat.left_to_model() == ["top_p", "min_p", "repetition_penalty"]
    every = {"temperature": 0.5, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}
    assert CompletionRequest(model="m", prompt="x", **every).left_to_model() is None
    assert CompletionRequest(model="m", prompt="x").left_to_model() == list(MODEL_DEFAULTS)


def entry(**fields) -> protocol.RequestEntry:
    return protocol.RequestEntry(request_id="r", reply_channel="c", model="m", version="v1", kind="completion",
                                 prompt="x", created=0.0, deadline=1.0, **fields)


def test_the_worker_applies_the_model_default_only_where_the_client_left_it_out():
    sent = entry(params=protocol.WireParams(temperature=1.0, top_p=1.0), from_model=["top_p", "top_k"])
    params = to_sampling_params(sent, 10, {"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 0.95, 20)  # the client's 1.0 stays
    assert to_sampling_params(sent, 10).top_p == 1.0  # without defaults (KVGATE_GENERATION_CONFIG=none)
    assert to_sampling_params(entry(), 10, {"temperature": 0.6}).temperature == 1.0  # an older gateway's entry


def test_an_older_worker_never_sees_the_field():
    sent = entry(from_model=["temperature"])
    assert b"from_model" in protocol.encode(sent)
    assert b"from_model" not in protocol.encode(sent, 6)
