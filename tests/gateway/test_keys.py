"""Keys: secrets are only ever kept as an HMAC; records say when a key may not be used."""
from __future__ import annotations

import time

import pytest

from gateway.durations import parse_duration
from gateway.estimate import request_tokens
from gateway.keys import KeyRecord, digest, new_secret


def test_secrets_are_long_random_and_prefixed():
    a, b = new_secret(), new_secret()
    assert a.startswith("sk-kvg-") and len(a) > 40 and a != b


def test_digest_is_keyed_by_the_server_secret():
    s = new_secret()
    assert digest("one", s) == digest("one", s) != digest("two", s)
    assert s not in digest("one", s) and len(digest("one", s)) == 64


def test_refusal_for_revoked_and_expired_keys():
    rec = KeyRecord(id="key_1", name="a", created=0.0)
    assert rec.refusal() is None
    assert "revoked" in rec.model_copy(update={"status": "revoked"}).refusal()
    assert "expired" in rec.model_copy(update={"expires": time.time() - 1}).refusal()


def test_allowed_models_empty_means_all():
    assert KeyRecord(id="k", name="a", created=0.0).allows("anything")
    rec = KeyRecord(id="k", name="a", created=0.0, models=["chat"])
    assert rec.allows("chat") and not rec.allows("code")


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200),
                                          ("30d", 2592000), ("2w", 1209600)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "1y", "-3d", "3 days"])
def test_bad_durations_say_what_is_accepted(text):
    with pytest.raises(ValueError, match="30d"):
        parse_duration(text)


def test_estimate_reserves_the_prompt_and_every_completion_cap():
    assert request_tokens({"prompt_token_ids": [1, 2, 3]}, 4, 2) == 3 + 8
    assert request_tokens({"prompt": "x" * 40}, None, 1) == 11
    chat = request_tokens({"messages": [{"role": "user", "content": "x" * 40}]}, 1, 1)
    assert chat > 11
