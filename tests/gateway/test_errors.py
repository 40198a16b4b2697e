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


@pytest.fixture
async def client(redis_server):
    app = create_app(GatewaySettings(secret="s", max_body_bytes=1024, redis_url=redis_server.url,
                                     api_key="sk-boot"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as c:
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
