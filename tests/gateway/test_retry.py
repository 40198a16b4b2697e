"""Retry before the first token (gateway/retry.py), on a real Redis: the dispatcher's Handle sends a
request again when it fails before any token, never after one, at most the setting's times."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway import retry
from gateway.dispatch import Dispatcher
from shared import names, protocol
from shared.errors import EngineFailure, InvalidRequest


@pytest.fixture
async def dispatcher(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushall()
    d = Dispatcher(client, "retry-test", max_retries=1)
    await d.start()
    yield d
    await d.stop()
    await client.aclose()


def _entry(request_id: str) -> protocol.RequestEntry:
    return protocol.RequestEntry(request_id=request_id, reply_channel=names.reply_channel("retry-test"),
                                 model="demo", version="v1", kind="completion", prompt="hi",
                                 created=time.time(), deadline=time.time() + 30)


async def _answer(d: Dispatcher, handle, *replies) -> None:
    """Publishes, as a worker would, replies to the attempt the handle waits on now."""
    raws = [protocol.encode(r.model_copy(update={"request_id": handle.request_id})) for r in replies]
    await d.redis.publish(d.channel, protocol.encode_replies(raws))


def _error(seq: int, code: str = "engine_error") -> protocol.ErrorReply:
    return protocol.ErrorReply(request_id="", seq=seq, code=code, message="injected")


async def _collect(handle) -> list:
    return [r async for r in handle.replies(keepalive_s=5)]


async def _run(d: Dispatcher, handle, script) -> list | Exception:
    task = asyncio.create_task(_collect(handle))
    for step in script:
        await asyncio.sleep(0.1)
        await _answer(d, handle, *step)
    try:
        return await asyncio.wait_for(task, 5)
    except Exception as exc:
        return exc


STREAM = names.request_stream("demo", "v1")


async def test_an_error_before_the_first_token_is_sent_again_once(dispatcher):
    before = retry.RETRIES.labels("demo", "v1", "engine_error")._value.get()
    handle = await dispatcher.submit(STREAM, _entry("cmpl-a"))
    delta = protocol.Delta(request_id="", seq=2, text="x", token_ids=[5])
    done = protocol.Done(request_id="", seq=3, prompt_tokens=1, completion_tokens=1)
    got = await _run(dispatcher, handle, [(protocol.Delta(request_id="", seq=1), _error(2)),
                                          (protocol.Delta(request_id="", seq=1), delta, done)])
    assert isinstance(got, list) and isinstance(got[-1], protocol.Done), got
    assert handle.request_id == "cmpl-a-r1" and handle.client_id == "cmpl-a"
    ids = [protocol.decode_entry(f[protocol.ENTRY_FIELD]).request_id
           for _, f in await dispatcher.redis.xrange(STREAM)]
    assert ids == ["cmpl-a", "cmpl-a-r1"]
    assert retry.RETRIES.labels("demo", "v1", "engine_error")._value.get() == before + 1


async def test_retries_are_bounded_by_the_setting(dispatcher):
    handle = await dispatcher.submit(STREAM, _entry("cmpl-b"))
    got = await _run(dispatcher, handle, [(_error(1),), (_error(1),)])
    assert isinstance(got, EngineFailure) and handle.retries == 1
    assert await dispatcher.redis.xlen(STREAM) == 2


async def test_never_after_the_first_token_nor_for_the_request_s_own_fault(dispatcher):
    after_token = await dispatcher.submit(STREAM, _entry("cmpl-c"))
    got = await _run(dispatcher, after_token, [(protocol.Delta(request_id="", seq=1, text="x", token_ids=[5]),
                                                _error(2))])
    assert isinstance(got, EngineFailure) and after_token.retries == 0
    bad_input = await dispatcher.submit(STREAM, _entry("cmpl-d"))
    got = await _run(dispatcher, bad_input, [(_error(1, "invalid_request"),)])
    assert isinstance(got, InvalidRequest) and bad_input.retries == 0
    assert await dispatcher.redis.xlen(STREAM) == 2  # neither was queued again


async def test_a_retry_moved_to_another_version_is_named_by_the_handle(dispatcher):
    """A canary's failure is retried on its stable version: the answer's version header and the
    usage follow the handle's version (gateway/client_wait.py `named`, Lease.holdings)."""
    async def to_stable(model, version):
        return "v0", None
    dispatcher.retarget = to_stable
    handle = await dispatcher.submit(STREAM, _entry("cmpl-e"))
    assert handle.version == "v1"
    done = protocol.Done(request_id="", seq=2, prompt_tokens=1, completion_tokens=0)
    got = await _run(dispatcher, handle, [(_error(1),), (protocol.Delta(request_id="", seq=1), done)])
    assert isinstance(got, list) and isinstance(got[-1], protocol.Done), got
    assert handle.version == "v0" and handle.request_id == "cmpl-e-r1"
    assert await dispatcher.redis.xlen(names.request_stream("demo", "v0")) == 1
