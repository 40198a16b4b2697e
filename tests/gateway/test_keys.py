"""Keys: secrets are only ever kept as an HMAC; records say when a key may not be used."""
from __future__ import annotations

import time

import pytest

from gateway.durations import parse_duration
from gateway.estimate import request_tokens
from gateway.keys import KeyRecord, bootstrap_record, digest, new_secret
from shared.errors import PermissionDenied


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


@pytest.mark.parametrize("text", ["", "d", "1y", "-3d", "3 days", "9" * 11, "1" * 10_000 + "w"])
def test_bad_durations_say_what_is_accepted(text):
    with pytest.raises(ValueError, match="30d"):
        parse_duration(text)


def test_estimate_reserves_the_prompt_and_every_completion_cap():
    assert request_tokens({"prompt_token_ids": [1, 2, 3]}, 4, 2) == 3 + 8
    assert request_tokens({"prompt": "x" * 40}, None, 1) == 11
    chat = request_tokens({"messages": [{"role": "user", "content": "x" * 40}]}, 1, 1)
    assert chat > 11


def _key(**fields) -> KeyRecord:
    return KeyRecord(id=fields.pop("id", "key_1"), name="a", created=0.0, **fields)


def test_a_key_may_only_lower_its_own_priority_by_default():
    key = _key()
    for allowed in (0, 1, 100):
        key.check_priority(allowed)
    with pytest.raises(PermissionDenied) as refused:
        key.check_priority(-1)
    err = refused.value
    assert (err.status, err.code, err.param) == (403, "priority_not_allowed", "priority")
    assert "priority 0 or higher" in err.message and "asked for -1" in err.message


def test_best_priority_is_per_key_and_admins_ask_any():
    _key(best_priority=-20).check_priority(-20)
    with pytest.raises(PermissionDenied, match="priority 5 or higher"):
        _key(best_priority=5).check_priority(4)
    _key(role="admin", best_priority=50).check_priority(-100)
    bootstrap_record("admin", "admin").check_priority(-100)
    with pytest.raises(PermissionDenied):
        bootstrap_record("dev", "user").check_priority(-1)


def test_cache_salt_is_per_tenant_by_default():
    alice_1, alice_2 = _key(id="k1", owner="alice"), _key(id="k2", owner="alice")
    bob, lone = _key(id="k3", owner="bob"), _key(id="k4")
    assert alice_1.cache_salt() == alice_2.cache_salt()  # one tenant: shared hits
    salts = {alice_1.cache_salt(), bob.cache_salt(), lone.cache_salt(), _key(id="k5").cache_salt()}
    assert len(salts) == 4 and None not in salts  # other tenants, each keyless owner its own
    assert "alice" not in alice_1.cache_salt()  # hashed: no owner name travels with requests
    assert bootstrap_record("dev", "user").cache_salt() != bootstrap_record("admin", "admin").cache_salt()


def test_cache_scope_key_and_shared():
    isolated = _key(id="k1", owner="alice", cache_scope="key")
    assert isolated.cache_salt() not in (None, _key(id="k2", owner="alice").cache_salt())
    assert _key(owner="alice", cache_scope="shared").cache_salt() is None


@pytest.mark.parametrize("stored,scope", [(True, "key"), (False, "tenant")])
def test_records_of_the_previous_version_read_their_cache_isolation(stored, scope):
    raw = '{"id": "k", "name": "a", "created": 0.0, "cache_isolation": %s}' % str(stored).lower()
    record = KeyRecord.model_validate_json(raw)
    assert record.cache_scope == scope and "cache_isolation" not in record.model_dump()


def test_weight_defaults_to_one_and_is_bounded_on_create_and_update():
    from pydantic import ValidationError

    from gateway.admin_schemas import KeyCreate, KeyUpdate

    assert KeyRecord(id="key_1", name="a", created=0.0).weight == 1.0
    assert KeyCreate(name="a", weight=2.5).weight == 2.5
    for bad in (0, 0.001, 101):
        with pytest.raises(ValidationError, match="weight"):
            KeyCreate(name="a", weight=bad)
        with pytest.raises(ValidationError, match="weight"):
            KeyUpdate(weight=bad)
