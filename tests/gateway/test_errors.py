"""Every refusal leaves the gateway in OpenAI's shape through one `error_response`: the gateway's
own errors with their headers, and what FastAPI, Starlette and the body limit refuse before any
route runs (no Redis needed for those: the app is called in-process, without its lifespan)."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.errors import error_response
from shared.errors import RateLimited
from shared.settings import GatewaySettings

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


def test_an_error_carries_its_headers_and_retry_after():
    exc = RateLimited("over", retry_after=2.2, headers={"x-ratelimit-limit-requests": "5"})
    exc.with_headers({"x-kvgate-version": "v2"})
    resp = error_response(exc)
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "3" and resp.headers["x-ratelimit-limit-requests"] == "5"
    assert resp.headers["x-kvgate-version"] == "v2"


async def _client(redis_server, max_body_bytes: int):
    app = create_app(GatewaySettings(secret="s", max_body_bytes=max_body_bytes, redis_url=redis_server.url,
                                     api_key="sk-boot"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as c:
            yield c


@pytest.fixture
async def client(redis_server):
    async for c in _client(redis_server, 1024):
        yield c


@pytest.fixture
async def roomy(redis_server):
    async for c in _client(redis_server, 1 << 20):
        yield c


@pytest.mark.parametrize("method, path, body, key, status, kind, code", [
    ("GET", "/nowhere", None, "sk-boot", 404, "invalid_request_error", None),
    ("GET", "/v1/chat/completions", None, "sk-boot", 405, "invalid_request_error", None),
    ("POST", "/v1/completions", b"{not json", "sk-boot", 422, "invalid_request_error", "invalid_value"),
    ("POST", "/v1/completions", b"x" * 2048, "sk-boot", 413, "invalid_request_error",
     "payload_too_large"),
    # a body is not looked at before its key is known: not JSON, too large, and still a 401
    ("POST", "/v1/completions", b"{not json", None, 401, "authentication_error", "invalid_api_key"),
    ("POST", "/v1/completions", b"x" * 2048, "sk-wrong", 401, "authentication_error",
     "invalid_api_key"),
])
async def test_refusals_before_any_route_runs_are_in_openai_shape(client, method, path, body, key,
                                                                  status, kind, code):
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    resp = await client.request(method, path, content=body, headers=headers)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (kind, code) and error["message"]


@pytest.mark.parametrize("method, path, says", [
    ("GET", "/v1/modelz", "Invalid URL (GET /v1/modelz)"),
    ("GET", "/v1/" + "x" * 5000, "Invalid URL (GET /v1/" + "x" * 196 + "...)"),
    ("DELETE", "/v1/chat/completions", "Method DELETE is not allowed on /v1/chat/completions"),
])
async def test_a_route_that_is_not_there_is_named_with_its_method(client, method, path, says):
    """As OpenAI says it ("Invalid URL (GET /v1/modelz)"), a long path cut: not Starlette's bare
    "Not Found", which a client that mistyped a path cannot tell from a model that is not there."""
    resp = await client.request(method, path, headers={"authorization": "Bearer sk-boot"})
    assert resp.status_code in (404, 405) and resp.json()["error"]["message"] == says


def test_no_handler_reaches_into_app_state():
    """The process's state reaches handlers through gateway/deps.py only."""
    modules = {p.name: p.read_text() for p in GATEWAY.glob("*.py")}
    assert "openai_api.py" in modules and "app.state.gateway" in modules["deps.py"]
    readers = sorted(name for name, text in modules.items() if "app.state" in text
                     and name not in ("app.py", "deps.py", "state.py"))
    assert readers == []


async def test_a_refusal_before_the_body_is_counted_under_its_routes_template(client):
    """AuthFirst answers before the router runs; the metrics still name the route by its template
    (a path a client made up would be a new series each time)."""
    from gateway import metrics

    def counted(route: str) -> float:
        return metrics.REQUESTS.labels(route, "401", "", "")._value.get()

    before = counted("/v1/batches/{batch_id}/cancel"), counted("unmatched")
    for batch_id in ("batch_a", "batch_b"):
        resp = await client.post(f"/v1/batches/{batch_id}/cancel")
        assert resp.status_code == 401
    await client.post("/made/up/path")
    assert counted("/v1/batches/{batch_id}/cancel") == before[0] + 2
    assert counted("unmatched") == before[1] + 1


_CHAT = b'{"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize("content_type, encoding, body, status, says", [
    ("text/plain", None, _CHAT, 415, "send Content-Type: application/json (it was 'text/plain')"),
    ("application/x-www-form-urlencoded", None, _CHAT, 415, "must be JSON"),
    (None, None, _CHAT, 415, "(none was sent)"),  # what `curl -d` without -H sends is a form; none at all here
    ("application/json", None, b"", 422, "the request body is empty"),
    ("application/json", None, b"[1, 2]", 422, "the request body must be a JSON object"),
    ("application/json", None, b"null", 422, "the request body must be a JSON object"),
    ("application/json", "gzip", b"\x1f\x8b\x08\x00", 415, "Content-Encoding 'gzip' is not supported"),
    ("application/json", None, b'{"model": "d\xffemo"}', 422, "not UTF-8 (byte 0xff at offset 12)"),
    ("application/json", None, b'{"model": "\\ud800"}', 422, "no low surrogate"),  # UTF-8, a bad escape
])
async def test_a_body_that_cannot_be_read_says_why(client, content_type, encoding, body, status, says):
    headers = {"authorization": "Bearer sk-boot"}
    if content_type:
        headers["content-type"] = content_type
    if encoding:
        headers["content-encoding"] = encoding
    resp = await client.post("/v1/chat/completions", content=body, headers=headers)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert says in error["message"] and "surrogates not allowed" not in error["message"]
    assert "dictionary" not in error["message"]


@pytest.mark.parametrize("path, fields, param, says", [
    # pydantic's names for a union's branches (`constrained-str`, `list[...]`) are not the body's
    ("/v1/chat/completions", {"stop": ""}, "stop", "at least 1 character"),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi"}] * 10_001}, "input", "at most 10000 items"),
    # a flag is a JSON boolean and a token id a JSON integer: "yes", 1.0 and true are none
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs", "valid boolean"),
    ("/v1/responses", {"input": "hi", "store": "yes"}, "store", "valid boolean"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt.0", "valid integer"),
    ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt.0", "valid integer"),
    ("/v1/chat/completions", {"stop_token_ids": [True]}, "stop_token_ids.0", "valid integer"),
])
async def test_a_refused_field_is_named_as_the_body_spells_it(roomy, path, fields, param, says):
    body = {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    if path != "/v1/chat/completions":
        body = {"model": "demo", "prompt": "hi"} if path == "/v1/completions" else {"model": "demo"}
    resp = await roomy.post(path, json={**body, **fields}, headers={"authorization": "Bearer sk-boot"})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("fields, says", [
    ({"input": []}, "input: List should have at least 1 item"),
    ({"input": [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(129)]},
     "input: List should have at most 128 items"),
])
async def test_responses_name_their_own_fields_for_what_chat_refuses(roomy, fields, says):
    """/v1/responses becomes a chat request; what chat's bounds refuse of it names `input`."""
    resp = await roomy.post("/v1/responses", json={"model": "demo", **fields},
                            headers={"authorization": "Bearer sk-boot"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "input" and error["message"].startswith(says), error
    assert "of the chat request it becomes" in error["message"]


async def test_a_messages_turn_past_its_blocks_bound_names_the_bound(roomy):
    """Of `content`'s two forms (a string, a list of blocks), the list broke its bound: that is said,
    not that the content should have been a string (in Anthropic's shape on /v1/messages)."""
    uses = [{"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}} for i in range(2000)]
    resp = await roomy.post("/v1/messages", headers={"authorization": "Bearer sk-boot"}, json={
        "model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": uses}]})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"].startswith("messages.1.content: List should have at most 256 items"), error
