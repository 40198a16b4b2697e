"""Streams that survive their gateway (issue 21): every SSE event has an id; a client whose gateway
died, or whose connection broke, gets the rest of its stream from any gateway with Last-Event-ID,
exactly once, and what the request held (slot, tokens, usage) is settled once.

Real processes: Redis, two `kvgate gateway`s and a `kvgate worker` (tests/integration/test_faults.py's
Cluster). The client reads SSE with httpx, as the `openai` client does not resume by itself.
"""
from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from shared import names
from shared.settings import GatewaySettings
from shared.usage import utc_day
from tests.integration.test_faults import Cluster

ADMIN = "sk-kvg-resume-admin"


@dataclass
class Seen:
    """What one client got of one stream, over however many connections."""

    events: list[tuple[str, dict]] = field(default_factory=list)  # (event id, data)
    done: bool = False
    status: int | None = None
    error: dict | None = None
    retry_after: str | None = None  # of a refusal
    connections: int = 0

    @property
    def last_id(self) -> str | None:
        return self.events[-1][0] if self.events else None

    def text(self) -> str:
        out = ""
        for _, ev in self.events:
            for c in ev.get("choices", []):
                out += c.get("text") or (c.get("delta") or {}).get("content") or ""
        return out

    def usage(self) -> dict | None:
        return next((ev["usage"] for _, ev in self.events if ev.get("usage")), None)


async def read_sse(client: httpx.AsyncClient, method: str, url: str, key: str, seen: Seen,
                   body: dict | None = None, last_id: str | None = None, stop_after: int | None = None):
    """Reads one connection's events into `seen` (ends quietly when the connection breaks)."""
    headers = {"Authorization": f"Bearer {key}"}
    if last_id:
        headers["Last-Event-ID"] = last_id
    seen.connections += 1
    try:
        async with client.stream(method, url, json=body, headers=headers) as resp:
            seen.status = resp.status_code
            if resp.status_code != 200:
                seen.error = orjson.loads(await resp.aread())["error"]
                seen.retry_after = resp.headers.get("retry-after")
                return
            event_id = None
            async for line in resp.aiter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: "):
                    if line == "data: [DONE]":
                        seen.done = True
                        return
                    data = orjson.loads(line[6:])
                    assert event_id is not None, f"an event without an id: {line}"
                    if "error" in data:
                        seen.error = data["error"]
                    seen.events.append((event_id, data))
                    event_id = None
                    if stop_after is not None and len(seen.events) >= stop_after:
                        return  # the client goes away
    except httpx.HTTPError:  # the gateway died under it
        return


def _body(i: int, max_tokens: int) -> dict:
    options = {"stream_options": {"include_usage": True}}
    if i % 4 == 0:
        return {"model": "demo", "messages": [{"role": "user", "content": f"Tell story {i}"}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True, **options}
    return {"model": "demo", "prompt": f"Request number {i} says", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, **options}


def _path(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _ids_in_order(seen: Seen) -> list[int]:
    seqs = [int(i.rpartition(":")[2]) for i, _ in seen.events]
    assert seqs == sorted(set(seqs)), f"event ids repeat or go back: {seqs}"
    return seqs


def _create_key(url: str, name: str, **limits) -> str:
    r = httpx.post(url + "/admin/keys", json={"name": name, **limits},
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 201, r.text
    return r.json()["secret"]


def _usage(cluster: Cluster, key_id: str) -> dict[str, int]:
    raw = cluster.client.hgetall(names.usage_key(key_id, utc_day()))
    return {k.decode().rpartition("|")[2]: int(v) for k, v in raw.items()}


def _tpm(cluster: Cluster, key_id: str) -> int:
    return sum(int(v) for v in cluster.client.hvals(names.tpm_key(key_id)))


def _wait_for(check, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


@pytest.fixture
def two_gateways(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir)
    env = {"KVGATE_ADMIN_KEY": ADMIN, "KVGATE_RESUME_GRACE_S": "3"}
    g1 = c.start_gateway(**env)
    url1 = c.url
    c.start_gateway(**env)
    url2 = c.url
    # 20 ms a step: a stream outlives the grace and the sweeps on a fast, quiet machine too
    c.start_worker("w1", "--max-num-seqs", "24", KVGATE_FAULT_STEP_MS="20")
    yield c, (g1, url1), url2
    c.close()


def test_streams_survive_their_gateway_sigkilled_mid_stream(two_gateways):
    cluster, (g1, url1), url2 = two_gateways
    key = _create_key(url2, "resumer", max_concurrent=20)  # a resume taking a new slot would 429
    key_id = cluster.client.hget(names.KEY_NAMES, "resumer").decode()
    n, max_tokens = 20, 80
    bodies = [_body(i, max_tokens) for i in range(n)]
    on_g1 = [i for i in range(n) if i % 2 == 0]

    async def scenario():
        seen, cut = [Seen() for _ in range(n)], {}
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:

            async def cut_and_resumed(i: int, body: dict):
                """On the gateway that dies; back at once to the other with Last-Event-ID: half
                resend the same POST, half GET /v1/streams/<id>."""
                await read_sse(client, "POST", url1 + _path(body), key, seen[i], body)
                assert not seen[i].done, "the kill should land mid-stream"
                cut[i] = seen[i].last_id
                if i % 4 == 2:
                    rid = cut[i].rpartition(":")[0]
                    await read_sse(client, "GET", f"{url2}/v1/streams/{rid}", key, seen[i], last_id=cut[i])
                else:
                    await read_sse(client, "POST", url2 + _path(body), key, seen[i], body, cut[i])

            tasks = [asyncio.create_task(cut_and_resumed(i, b) if i in on_g1 else
                                         read_sse(client, "POST", url2 + _path(b), key, seen[i], b))
                     for i, b in enumerate(bodies)]
            deadline = time.monotonic() + 120
            while not all(len(seen[i].events) >= 4 for i in on_g1):
                assert time.monotonic() < deadline, [(s.status, s.error, len(s.events)) for s in seen]
                await asyncio.sleep(0.01)
            g1.send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks)
            return seen, cut

    seen, cut = asyncio.run(scenario())
    for i, s in enumerate(seen):
        assert s.status == 200 and s.error is None and s.done, (i, s.status, s.error)
        _ids_in_order(s)
    _wait_for(lambda: _usage(cluster, key_id).get("requests", 0) >= n)
    _wait_for(lambda: cluster.client.zcard(names.inflight_key(key_id)) == 0)  # no slot is left
    time.sleep(0.5)
    usage, tpm = _usage(cluster, key_id), _tpm(cluster, key_id)
    delivered = [s.usage() for s in seen]
    assert all(u is not None and u["completion_tokens"] == max_tokens for u in delivered)

    reference = [Seen() for _ in range(n)]

    async def clean():
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(read_sse(client, "POST", url2 + _path(b), key, reference[i], b)
                                   for i, b in enumerate(bodies)))

    asyncio.run(clean())
    resumed_text = sum(len(seen[i].text()) - len(_text_upto(seen[i], cut[i])) for i in on_g1)
    print(f"\n[resume] {len(on_g1)} streams cut by SIGKILL of their gateway, resumed at the other; "
          f"{resumed_text} characters came after the cut; usage {usage}")
    for i in range(n):
        assert seen[i].text() == reference[i].text(), f"stream {i} differs from an uninterrupted run"
    # settled once: one request each, no error, the tokens the clients were told; the TPM window
    # holds exactly those tokens (each reservation replaced by the actual count)
    assert usage == {"requests": n, "prompt_tokens": sum(u["prompt_tokens"] for u in delivered),
                     "completion_tokens": n * max_tokens}
    assert tpm == sum(u["total_tokens"] for u in delivered)
    _wait_for(lambda: cluster.client.zcard(names.OPEN_STREAMS) == 0)


def _text_upto(seen: Seen, last_id: str) -> str:
    out = Seen(events=[])
    for event in seen.events:
        out.events.append(event)
        if event[0] == last_id:
            break
    return out.text()


def test_a_client_that_leaves_can_come_back_within_the_grace_and_one_that_does_not_is_settled(two_gateways):
    cluster, (_, url1), url2 = two_gateways
    key = _create_key(url2, "leaver", max_concurrent=5)
    other, echoer = _create_key(url2, "other"), _create_key(url2, "echoer")
    key_id = cluster.client.hget(names.KEY_NAMES, "leaver").decode()
    echoed = {**_body(2, 20), "echo": True}
    body, long = _body(1, 150), _body(1, 1000)  # the one that never comes back runs ~20 s

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            back, gone = Seen(), Seen()
            await asyncio.gather(read_sse(client, "POST", url1 + "/v1/completions", key, back, body, stop_after=3),
                                 read_sse(client, "POST", url1 + "/v1/completions", key, gone, long, stop_after=3))
            await asyncio.sleep(1.0)  # disconnected, within the 3 s grace: still running
            rid = back.last_id.rpartition(":")[0]
            stranger, bad = Seen(), Seen()
            await read_sse(client, "GET", f"{url2}/v1/streams/{rid}", other, stranger, last_id=back.last_id)
            await read_sse(client, "POST", url2 + "/v1/completions", key, bad, body, last_id="nonsense")
            await read_sse(client, "POST", url2 + "/v1/completions", key, back, body, back.last_id)
            # an echoed completion resumed from before its first chunk still starts with its prompt
            # (the echo travels in the stream's lease: the other gateway never saw the request)
            first, again = Seen(), Seen()
            await read_sse(client, "POST", url1 + "/v1/completions", echoer, first, echoed, stop_after=1)
            erid = first.last_id.rpartition(":")[0]
            await read_sse(client, "GET", f"{url2}/v1/streams/{erid}", echoer, again, last_id=f"{erid}:0")
            # and a prompt of token ids, whose text the worker wrote on its verdict: heard again there
            ids = (await client.post(url2 + "/tokenize", headers={"Authorization": f"Bearer {echoer}"}, json={
                "model": "demo", "prompt": echoed["prompt"], "add_special_tokens": False})).json()["tokens"]
            by_ids, by_ids_again = Seen(), Seen()
            await read_sse(client, "POST", url1 + "/v1/completions", echoer, by_ids, {**echoed, "prompt": ids},
                           stop_after=1)
            irid = by_ids.last_id.rpartition(":")[0]
            await read_sse(client, "GET", f"{url2}/v1/streams/{irid}", echoer, by_ids_again, last_id=f"{irid}:0")
            return back, gone, stranger, bad, first, again, by_ids_again

    back, gone, stranger, bad, first, again, by_ids_again = asyncio.run(scenario())
    assert first.text().startswith(echoed["prompt"]) and again.done, (first.text(), again.status)
    assert again.events[0] == first.events[0] and len(again.text()) > len(first.text())
    assert by_ids_again.done and by_ids_again.text().startswith(echoed["prompt"]), by_ids_again.text()
    assert stranger.status == 404 and stranger.error["code"] == "stream_not_found"
    assert bad.status == 400 and bad.error["param"] == "Last-Event-ID"
    assert back.done and back.error is None and back.usage()["completion_tokens"] == 150
    _ids_in_order(back)
    # the one that never came back: cancelled on the worker after the grace, its slot freed, its
    # reservation charged (a client that leaves is not refunded) and one request + error counted
    _wait_for(lambda: cluster.info("w1")["requests_aborted"] >= 1 and cluster.info("w1")["active"] == 0)
    _wait_for(lambda: _usage(cluster, key_id).get("requests", 0) >= 2)
    time.sleep(0.5)
    usage = _usage(cluster, key_id)
    assert usage["requests"] == 2 and usage["errors"] == 1
    assert usage["completion_tokens"] == 150
    assert cluster.client.zcard(names.inflight_key(key_id)) == 0
    gone_id = gone.last_id.rpartition(":")[0]
    assert cluster.client.hget(names.stream_lease(key_id, gone_id), "settled") == b"abandoned"
    late = Seen()
    asyncio.run(_late(url2, key, gone_id, gone.last_id, late))
    assert late.status == 404  # cancelled: nothing more will come


async def _late(url: str, key: str, request_id: str, last_id: str, seen: Seen) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        await read_sse(client, "GET", f"{url}/v1/streams/{request_id}", key, seen, last_id=last_id)


def test_a_canary_failing_before_its_first_token_is_retried_on_stable_and_charged_once(tmp_path, tiny_model_dir):
    """KVGATE_FAULT_ERROR_RATE=1 on the canary: every request it takes fails at admission; each is
    sent again to the stable version and served; the key pays each once; the retries are counted."""
    cluster = Cluster(tmp_path, tiny_model_dir)
    try:
        cluster.start_gateway(KVGATE_ADMIN_KEY=ADMIN)
        first = cluster.spawn_worker("w1")
        cluster.worker_ready("w2", cluster.spawn_worker("w2", "--version", "v2", "--fault-error-rate", "1.0"))
        cluster.worker_ready("w1", first)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = httpx.put(cluster.url + "/admin/canary/demo", headers=admin, timeout=10,
                      json={"version": "v2", "stable": "v1", "weight": 100})
        assert r.status_code == 200, r.text
        key = _create_key(cluster.url, "retried")
        key_id = cluster.client.hget(names.KEY_NAMES, "retried").decode()
        bodies = [_body(i, 12) for i in range(6)]

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                seen = [Seen() for _ in bodies]
                await asyncio.gather(*(read_sse(client, "POST", cluster.url + _path(b), key, seen[i], b)
                                       for i, b in enumerate(bodies)))
                whole = await client.post(cluster.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                          json={**bodies[1], "stream": False, "stream_options": None})
                return seen, whole

        seen, whole = asyncio.run(scenario())
        assert all(s.status == 200 and s.done and s.error is None for s in seen), [s.error for s in seen]
        assert all(s.usage()["completion_tokens"] == 12 for s in seen)
        assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 12
        assert whole.headers["x-kvgate-version"] == "v1"  # the version that answered
        _wait_for(lambda: cluster.info("w1")["requests_finished"] == 7)  # all served by stable
        _wait_for(lambda: _usage(cluster, key_id).get("requests", 0) >= 7)
        time.sleep(0.3)
        usage = _usage(cluster, key_id)
        assert usage["requests"] == 7 and "errors" not in usage and usage["completion_tokens"] == 7 * 12
        fields = cluster.client.hkeys(names.usage_key(key_id, utc_day()))
        assert {f.decode().split("|")[1] for f in fields} == {"v1"}, fields  # usage where it was served
        page = httpx.get(cluster.url + "/metrics").text
        assert 'kvgate_gateway_retries_total{code="engine_error",model="demo",version="v2"} 7.0' in page
    finally:
        cluster.close()


def test_a_finished_stream_longer_than_a_page_of_its_log_replays_whole_and_in_order(two_gateways):
    """A resumed stream reads its reply log LOG_PAGE lines at a time (so a long replay does not hold
    the event loop): across the pages, the replay is the stream as it was first sent."""
    from gateway.dispatch import LOG_PAGE

    cluster, (_, url1), url2 = two_gateways
    key = _create_key(url2, "replayer")
    body = {**_body(1, 150), "n": 4}

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            whole, again = Seen(), Seen()
            await read_sse(client, "POST", url1 + "/v1/completions", key, whole, body)
            rid = whole.last_id.rpartition(":")[0]
            lines = cluster.client.llen(names.checkpoint_key(rid))
            await read_sse(client, "GET", f"{url2}/v1/streams/{rid}", key, again, last_id=f"{rid}:0")
            past = Seen()  # events it never sent: said so at its end, not a clean-looking [DONE]
            await read_sse(client, "POST", url2 + "/v1/completions", key, past, body, last_id=f"{rid}:{10**23}")
            return whole, again, lines, past

    whole, again, lines, past = asyncio.run(scenario())
    assert lines > 2 * LOG_PAGE, lines
    assert whole.done and again.done and again.error is None
    assert again.events == whole.events
    _ids_in_order(again)
    assert len(past.events) == 1 and past.error["code"] == "invalid_last_event_id", past.events
    assert "past this stream's last event" in past.error["message"]


def test_a_stream_resumed_past_its_limit_a_minute_is_a_429_and_other_streams_are_not(two_gateways):
    cluster, (_, url1), url2 = two_gateways
    key = _create_key(url2, "resumer")
    limit = GatewaySettings.model_fields["max_resumes_per_minute"].default

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            first, second = Seen(), Seen()
            await read_sse(client, "POST", url1 + "/v1/completions", key, first, _body(1, 4))
            await read_sse(client, "POST", url1 + "/v1/completions", key, second, _body(2, 4))
            replays = []
            for i in range(limit + 1):
                rid = first.last_id.rpartition(":")[0]
                replays.append(Seen())
                await read_sse(client, "GET", f"{(url1, url2)[i % 2]}/v1/streams/{rid}", key, replays[-1],
                               last_id=f"{rid}:0")
            other = Seen()
            rid2 = second.last_id.rpartition(":")[0]
            await read_sse(client, "GET", f"{url2}/v1/streams/{rid2}", key, other, last_id=f"{rid2}:0")
            return first, replays, other, second

    first, replays, other, second = asyncio.run(scenario())
    assert all(r.done and r.events == first.events for r in replays[:-1])  # the limit, across gateways
    refused = replays[-1]
    assert refused.status == 429 and refused.error["code"] == "too_many_resumes", refused.error
    assert str(limit) in refused.error["message"] and refused.error["param"] == "Last-Event-ID"
    assert 1 <= int(refused.retry_after) <= 60
    assert other.done and other.events == second.events  # counted per stream
