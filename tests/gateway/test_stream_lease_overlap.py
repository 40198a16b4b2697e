"""A stream's lease is written while the worker computes the first token (gateway/openai_api.py
`first_reply_held`), not after it; a lease written for a request that then never started is
settled at once, with the request, not held for the resume grace. The app in-process, a real
Redis, a worker (synthetic engine) in a thread that refuses every request at admission."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import until_listed, worker_thread


@pytest.fixture
def refusing_worker(redis_server, tiny_model_dir):
    with worker_thread(redis_server.url, tiny_model_dir, "lease", fault_error_rate=1.0):
        yield


def test_a_lease_written_for_a_refused_stream_is_settled_at_once(redis_server, refusing_worker):
    from gateway.app import create_app
    from gateway.stream_leases import ABANDONED, StreamLease
    from shared import names
    from shared.settings import GatewaySettings
    from shared.usage import utc_day

    settings = GatewaySettings(redis_url=redis_server.url, secret="lease-secret", api_key="sk-boot",
                               retries_before_first_token=0, resume_grace_s=60)
    app = create_app(settings)
    body = {"model": "lease", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}

    async def run():
        async with app.router.lifespan_context(app):
            state = app.state.gateway
            record, secret = await state.keystore.create(state.keystore.new_record(name="lease"))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:
                await until_listed(client, "sk-boot")
                resp = await client.post("/v1/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {secret}"})
                await asyncio.sleep(0.3)  # the teardown runs after the response
            lease = StreamLease(record.id, resp.headers["x-request-id"])
            return (resp, await state.redis.hgetall(lease.name), await state.redis.zcard(names.OPEN_STREAMS),
                    await state.redis.zcard(names.inflight_key(record.id)),
                    await state.redis.get(names.daily_tokens_key(record.id, utc_day())))

    resp, fields, open_streams, slots, day = asyncio.run(run())
    assert resp.status_code >= 500 and "injected fault" in resp.text, resp.text
    assert fields, "the lease was written while the worker answered"
    assert fields[b"settled"] == ABANDONED.encode(), fields  # settled now, not after the 60 s grace
    assert open_streams == 0
    assert slots == 0  # its slot given back
    assert int(day or 0) == 0  # refused before any token: nothing charged
