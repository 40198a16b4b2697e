"""Which time limits a request gets: the key's, else its route's, else the gateway's (no Redis)."""
from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from gateway import timeouts
from gateway.keys import KeyRecord
from shared import names
from shared.settings import GatewaySettings


def _key(**limits) -> KeyRecord:
    return KeyRecord(id="key_1", name="alice", created=0, **limits)


def _settings(**env) -> GatewaySettings:
    return GatewaySettings(request_timeout_s=600, ttft_timeout_s=30, **env)


def test_defaults_apply_to_every_route():
    got = timeouts.of(_settings(), _key(), "/v1/messages", names.DEFAULT_LANE)
    assert (got.ttft_s, got.total_s) == (30, 600)
    assert "KVGATE_TTFT_TIMEOUT_S" in got.no_first_token().message
    assert "KVGATE_REQUEST_TIMEOUT_S" in got.total_passed().message


def test_a_route_replaces_the_defaults_it_names_and_only_on_its_path():
    s = _settings(route_timeouts={"responses": {"total_s": 900}, "chat": {"ttft_s": 5}})
    responses = timeouts.of(s, _key(), "/v1/responses", names.DEFAULT_LANE)
    assert (responses.ttft_s, responses.total_s) == (30, 900)
    assert "KVGATE_ROUTE_TIMEOUTS[responses]" in responses.total_passed().message
    chat = timeouts.of(s, _key(), "/v1/chat/completions", names.DEFAULT_LANE)
    assert (chat.ttft_s, chat.total_s) == (5, 600)
    plain = timeouts.of(s, _key(), "/v1/completions", names.DEFAULT_LANE)
    assert (plain.ttft_s, plain.total_s) == (30, 600)


def test_a_key_replaces_its_route_and_zero_lifts_the_first_token_limit():
    s = _settings(route_timeouts={"chat": {"ttft_s": 5, "total_s": 60}})
    got = timeouts.of(s, _key(ttft_timeout_s=0, request_timeout_s=7200), "/v1/chat/completions",
                      names.DEFAULT_LANE)
    assert got.ttft_s is None and got.total_s == 7200
    assert got.first_token_by(100.0) == math.inf
    assert "key 'alice' request_timeout_s" in got.total_passed().message


def test_batch_lines_wait_behind_interactive_traffic_without_a_first_token_limit():
    got = timeouts.of(_settings(), _key(ttft_timeout_s=1), "/v1/chat/completions", names.BATCH_LANE)
    assert got.ttft_s is None and got.total_s == 600


def test_timeouts_are_504s_with_their_own_codes():
    got = timeouts.of(_settings(), _key(), "/v1/chat/completions", names.DEFAULT_LANE)
    assert got.first_token_by(100.0) == 130.0
    ttft, total = got.no_first_token(), got.total_passed()
    assert (ttft.status, ttft.code) == (504, "ttft_timeout")
    assert (total.status, total.code) == (504, "timeout")
    assert "30 s" in ttft.message and "600 s" in total.message


def test_unknown_routes_and_fields_are_refused_at_start():
    with pytest.raises(ValidationError):
        _settings(route_timeouts={"embeddings": {"ttft_s": 1}})
    with pytest.raises(ValidationError):
        _settings(route_timeouts={"chat": {"ttft": 1}})
    with pytest.raises(ValidationError):
        _key(request_timeout_s=0)
