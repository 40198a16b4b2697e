"""Responses and Messages streams resume like chat's (issue 22's "takeover and resume" on every
route): each reply's events end with an `id:`; a client that lost its stream sends the same POST to
another gateway with Last-Event-ID and gets the rest, rebuilt from the reply log through a fresh
renderer, so sequence numbers, item ids and open blocks continue where they stopped.

Real processes (tests/integration/test_resume.py's two gateways and a worker); SSE read with httpx.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
import orjson

from tests.integration.test_resume import _create_key
from tests.integration.test_resume import two_gateways as two_gateways  # noqa: F401  (the fixture)


@dataclass
class Typed:
    """One connection's typed events: (the id in force after it, event name, data)."""

    events: list[tuple[str | None, str, dict]] = field(default_factory=list)
    status: int | None = None
    body: dict | None = None

    def upto_last_id(self) -> tuple[str, list[tuple[str | None, str, dict]]]:
        """What a client holds for Last-Event-ID: the last id received and the events up to it."""
        last = max(i for i, (eid, _, _) in enumerate(self.events) if eid and (i == 0 or self.events[i - 1][0] != eid))
        return self.events[last][0], self.events[:last + 1]


async def read_typed(client: httpx.AsyncClient, url: str, key: str, body: dict, seen: Typed,
                     last_id: str | None = None, stop_after: int | None = None) -> None:
    headers = {"Authorization": f"Bearer {key}", **({"Last-Event-ID": last_id} if last_id else {})}
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        seen.status = resp.status_code
        if resp.status_code != 200:
            seen.body = orjson.loads(await resp.aread())
            return
        current, name, data = None, None, None
        async for line in resp.aiter_lines():
            if line.startswith("id: "):
                current = line[4:]
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = orjson.loads(line[6:])
            elif line == "" and data is not None:
                if name != "ping":  # Messages' keep-alive: not part of the answer
                    seen.events.append((current, name, data))
                name, data = None, None
                if stop_after is not None and len(seen.events) >= stop_after:
                    return


def _texts(events, kind: str) -> str:
    return "".join(d.get("delta", "") if kind == "responses" else (d.get("delta") or {}).get("text", "")
                   for _, name, d in events
                   if name == ("response.output_text.delta" if kind == "responses" else "content_block_delta"))


BODIES = {
    "responses": ("/v1/responses", {"model": "demo", "input": "Tell a long story", "max_output_tokens": 60,
                                    "temperature": 0, "stream": True}),
    "messages": ("/v1/messages", {"model": "demo", "max_tokens": 60, "temperature": 0, "stream": True,
                                  "messages": [{"role": "user", "content": "Tell a long story"}]}),
}


def test_responses_and_messages_streams_resume_at_another_gateway(two_gateways):
    cluster, (_, url1), url2 = two_gateways
    key = _create_key(url2, "agent-resumer", max_concurrent=10)

    async def scenario(kind: str):
        path, body = BODIES[kind]
        async with httpx.AsyncClient(timeout=120) as client:
            cut, rest, reference, wrong = Typed(), Typed(), Typed(), Typed()
            await read_typed(client, url1 + path, key, body, cut, stop_after=6)  # the client drops
            last_id, held = cut.upto_last_id()
            await read_typed(client, url2 + path, key, body, rest, last_id=last_id)
            await read_typed(client, url2 + "/v1/chat/completions", key,
                             {"model": "demo", "messages": [{"role": "user", "content": "x"}], "stream": True},
                             wrong, last_id=last_id)
            await read_typed(client, url2 + path, key, body, reference)
            return held, rest, reference, wrong

    for kind in ("responses", "messages"):
        held, rest, reference, wrong = asyncio.run(scenario(kind))
        assert rest.status == 200 and reference.status == 200, (kind, rest.body, reference.body)
        assert wrong.status == 400 and wrong.body["error"]["code"] == "invalid_last_event_id", wrong.body
        whole = held + rest.events
        assert _texts(whole, kind) == _texts(reference.events, kind), kind
        assert len(_texts(rest.events, kind)) > 0, f"{kind}: nothing came after the cut"
        names = [name for _, name, _ in whole]
        if kind == "responses":
            seqs = [d["sequence_number"] for _, _, d in whole]
            assert seqs == list(range(len(seqs))), seqs  # no event twice, none lost
            created = whole[0][2]["response"]
            done = whole[-1][2]["response"]
            assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")
            assert done["id"] == created["id"] and done["created_at"] == created["created_at"]
            items = {d["item_id"] for _, n, d in whole if n == "response.output_text.delta"}
            assert len(items) == 1 and done["output"][-1]["id"] in items  # the same item throughout
        else:
            assert names.count("message_start") == 1 and names[-1] == "message_stop"
            starts = [d["index"] for _, n, d in whole if n == "content_block_start"]
            assert starts == sorted(set(starts)), starts  # no block opened twice
